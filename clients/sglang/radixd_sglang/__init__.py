"""radixd as SGLang's HiCache storage backend (``--hicache-storage-backend dynamic``).

See docs/sglang.md: SGLang instances on one node share radixd's host tier and its Redis tier.
"""

from .backend import RadixdHiCacheStorage

__all__ = ["RadixdHiCacheStorage"]
