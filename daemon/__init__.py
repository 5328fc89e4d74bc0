"""radixd: a daemon that owns KV-cache memory and the prefix radix tree for LLM engines.

The package is split by dependency direction (docs/design.md section 3): ``daemon.app`` (the
composition root) builds everything; ``daemon.server`` and ``daemon.admin`` use ``daemon.service``
(and read it through its query API, ``daemon.queries``), which uses ``daemon.tiers`` and
``daemon.model_cache``; ``daemon.tree`` is pure, ``daemon.gpu`` owns device memory,
``daemon.storage`` owns the tiers below the device.
"""

__version__ = "0.1.0"
