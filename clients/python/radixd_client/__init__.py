"""radixd-client: the Python client library of radixd (KV-cache pages and prefix tree daemon).

- :class:`Client`: blocking, for engine scheduler loops (one connection = one session).
- :class:`AsyncClient`: asyncio, one connection shared by many tasks with pipelining.
- :mod:`radixd_client.protocol`: the wire protocol (the one definition, shared with the daemon).
- :mod:`radixd_client.errors`: one exception class per family of error codes.
- :mod:`radixd_client.connection`: the connection rules without I/O (framing, ids, order,
  decoding), which both clients and the daemon's frame loop are built on.
- :mod:`radixd_client.operations`: each operation's request, written once for every client.
- :class:`RequestLifecycle` (:mod:`radixd_client.lifecycle`): one engine request's cache
  bookkeeping, from the locked match to ``cache_finished``, writes checked against its own pages.
- :mod:`radixd_client.pools`: mapping the daemon's KV pools (``Client.attach``); needs torch.

Importing the package imports neither torch nor numpy.
"""

from __future__ import annotations

from . import protocol
from .aio import AsyncClient, AsyncClientBatch
from .client import BatchFuture, Client, ClientBatch, pages
from .errors import (
    CODE_TO_ERROR,
    AuthError,
    BadArgument,
    BatchSkipped,
    ConnectFailed,
    ConnectionLost,
    InternalError,
    LimitExceeded,
    NodeNotUsable,
    NotFoundError,
    OutOfMemory,
    PageError,
    PoolError,
    ProtocolError,
    QuotaExceeded,
    RadixdError,
    ReceiptError,
    SegmentsNotMapped,
    SessionRestarted,
    ShuttingDown,
    TimedOut,
    UndecodableResult,
)
from .lifecycle import NotWritable, RequestLifecycle
from .protocol import int32_bytes
from .reconnect import Reconnect

__version__ = "0.2.0"

__all__ = [
    "CODE_TO_ERROR",
    "AsyncClient",
    "AsyncClientBatch",
    "AuthError",
    "BadArgument",
    "BatchFuture",
    "BatchSkipped",
    "Client",
    "ClientBatch",
    "ConnectFailed",
    "ConnectionLost",
    "InternalError",
    "LimitExceeded",
    "NodeNotUsable",
    "NotFoundError",
    "NotWritable",
    "OutOfMemory",
    "PageError",
    "PoolError",
    "ProtocolError",
    "QuotaExceeded",
    "RadixdError",
    "ReceiptError",
    "Reconnect",
    "RequestLifecycle",
    "SegmentsNotMapped",
    "SessionRestarted",
    "ShuttingDown",
    "TimedOut",
    "UndecodableResult",
    "__version__",
    "int32_bytes",
    "pages",
    "protocol",
]
