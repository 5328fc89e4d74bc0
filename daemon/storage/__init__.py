"""Everything below the device: the host pool (L2), the page codec and the Redis tier (L3).

Built and tested on their own so far (host_pool, copies, codec, redis_tier); the tree, the service
and the `load`/`prefetch` operations do not use them yet.
"""
