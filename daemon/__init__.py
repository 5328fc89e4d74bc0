"""radixd: a daemon that owns KV-cache memory and the prefix radix tree for LLM engines.

The package is split by dependency direction (DESIGN.md section 3): ``daemon.tree`` is pure,
``daemon.gpu`` owns device memory, ``daemon.storage`` owns the tiers below the device.
"""

__version__ = "0.1.0"
