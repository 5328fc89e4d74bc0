"""Everything below the device: the host pool (L2), the copies between device and host, the
page codec and the Redis tier (L3).

:mod:`daemon.tiers` composes them with a model's cache at run time (backups, ``load``,
``prefetch``, L3 writes); these modules know nothing of the tree, so that each can be tested on
its own.
"""
