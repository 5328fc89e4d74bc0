"""Exceptions raised by the radixd client, one class per family of daemon error codes.

Every failed response carries a stable ``code`` (see :class:`radixd_client.protocol.Code`);
:func:`error_from_wire` turns it into an instance of the class that :data:`CODE_TO_ERROR` maps the
code to, keeping the daemon's ``message`` and ``details``. A code this client does not know (a
newer daemon) becomes a plain :class:`RadixdError` with that code, so ``except RadixdError`` always
catches it.

Errors raised by the client itself, with no daemon response behind them, use codes that are not
in ``protocol.ALL_CODES``: ``connection_lost`` (and its subclasses), ``connect_failed`` and
``pool_error``. ``not_executed`` (a batch item that did not run) is a protocol code, also used by
the client for items of a batch that was never sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .protocol import Code, Error

__all__ = [
    "CODE_TO_ERROR",
    "AuthError",
    "BadArgument",
    "BatchSkipped",
    "ConnectFailed",
    "ConnectionLost",
    "InternalError",
    "LimitExceeded",
    "NodeNotUsable",
    "NotFoundError",
    "OutOfMemory",
    "PageError",
    "PoolError",
    "ProtocolError",
    "QuotaExceeded",
    "RadixdError",
    "ReceiptError",
    "ShuttingDown",
    "TimedOut",
    "error_from_wire",
]


def _rebuild(cls: type[RadixdError], message: str, code: str, details: dict[str, Any]
             ) -> RadixdError:
    return cls(message, code=code, details=details)


class RadixdError(Exception):
    """Base of every error this client raises.

    ``code`` is the stable error code (a ``protocol.Code`` value for errors the daemon sent),
    ``message`` the human-readable text, ``details`` a dict of structured extras (for example the
    per-pool page counts of :class:`OutOfMemory`). ``str(error)`` is the message.
    """

    #: The code an instance gets when none is given.
    default_code: str = "error"

    def __init__(self, message: str = "", *, code: str | None = None,
                 details: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code if code is not None else self.default_code
        self.details: dict[str, Any] = dict(details) if details else {}

    def __reduce__(self) -> Any:
        # Exception pickles only ``args``; keep the code and the details across processes.
        return (_rebuild, (type(self), self.message, self.code, self.details))

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        extra = f", details={self.details!r}" if self.details else ""
        return f"{type(self).__name__}({self.message!r}, code={self.code!r}{extra})"


# ---------------------------------------------------------------------------- daemon families

class ProtocolError(RadixdError):
    """The frame or request was not understood: bad_frame, frame_too_large, unknown_op,
    version_unsupported. Usually a client bug or a client/daemon version mismatch."""

    default_code = Code.BAD_FRAME


class UndecodableResult(ProtocolError):
    """The daemon answered, but this client could not decode the result (a daemon newer than
    the client, or a bug in one of them): unlike a refusal, the operation ran."""


class AuthError(RadixdError):
    """not_authenticated, auth_failed, already_authenticated, model_not_allowed."""

    default_code = Code.AUTH_FAILED


class NotFoundError(RadixdError):
    """unknown_model, unknown_node."""

    default_code = Code.UNKNOWN_MODEL


class NodeNotUsable(RadixdError):
    """node_not_usable: the node's sliding window was evicted since it was matched; match again."""

    default_code = Code.NODE_NOT_USABLE


class ReceiptError(RadixdError):
    """bad_receipt: not this session's, already released, or never taken."""

    default_code = Code.BAD_RECEIPT


class PageError(RadixdError):
    """page_not_held (a page id this session does not hold), bad_page (outside the pool)."""

    default_code = Code.PAGE_NOT_HELD


class OutOfMemory(RadixdError):
    """out_of_memory: an allocation could not be satisfied even after eviction.

    ``details`` carries the daemon's per-pool counts (available, evictable, locked, held).
    """

    default_code = Code.OUT_OF_MEMORY


class QuotaExceeded(RadixdError):
    """quota_exceeded: over the tenant's page quota, even after evicting its own cold pages.

    ``details`` says which pool and by how much (today: pool, limit, requested, over).
    """

    default_code = Code.QUOTA_EXCEEDED


class LimitExceeded(RadixdError):
    """too_many_tokens, too_many_inflight, too_many_sessions, too_many_locks: a daemon limit
    (the per-request ones are in ``HelloResult.limits``)."""

    default_code = Code.TOO_MANY_TOKENS


class BadArgument(RadixdError):
    """bad_argument: well-formed but invalid (lengths, alignment, ranges)."""

    default_code = Code.BAD_ARGUMENT


class ShuttingDown(RadixdError):
    """shutting_down: the daemon is stopping; reconnect to its successor."""

    default_code = Code.SHUTTING_DOWN


class InternalError(RadixdError):
    """internal: a daemon bug. The cache stayed consistent and the session survives."""

    default_code = Code.INTERNAL


#: Every code the protocol defines, mapped to the class raised for it.
CODE_TO_ERROR: dict[str, type[RadixdError]] = {
    Code.BAD_FRAME: ProtocolError,
    Code.FRAME_TOO_LARGE: ProtocolError,
    Code.UNKNOWN_OP: ProtocolError,
    Code.VERSION_UNSUPPORTED: ProtocolError,
    Code.NOT_AUTHENTICATED: AuthError,
    Code.AUTH_FAILED: AuthError,
    Code.ALREADY_AUTHENTICATED: AuthError,
    Code.MODEL_NOT_ALLOWED: AuthError,
    Code.UNKNOWN_MODEL: NotFoundError,
    Code.UNKNOWN_NODE: NotFoundError,
    Code.NODE_NOT_USABLE: NodeNotUsable,
    Code.BAD_RECEIPT: ReceiptError,
    Code.PAGE_NOT_HELD: PageError,
    Code.BAD_PAGE: PageError,
    Code.OUT_OF_MEMORY: OutOfMemory,
    Code.QUOTA_EXCEEDED: QuotaExceeded,
    Code.TOO_MANY_TOKENS: LimitExceeded,
    Code.TOO_MANY_INFLIGHT: LimitExceeded,
    Code.TOO_MANY_SESSIONS: LimitExceeded,
    Code.TOO_MANY_LOCKS: LimitExceeded,
    Code.BAD_ARGUMENT: BadArgument,
    Code.SHUTTING_DOWN: ShuttingDown,
    Code.INTERNAL: InternalError,
}


def error_from_wire(error: Error | None) -> RadixdError:
    """The exception for the ``error`` of a failed response (or batch item)."""
    if error is None:  # ok=false without an error: a daemon bug, reported as such
        return ProtocolError("the daemon sent a failed response without an error",
                             code=Code.BAD_FRAME)
    cls = CODE_TO_ERROR.get(error.code, RadixdError)
    return cls(error.message, code=error.code, details=error.details)


# ---------------------------------------------------------------------------- client-side errors

_LOST = ("the radixd session is gone, and with it everything it held (lock receipts, allocated "
         "pages); reconnect with a new client and start the affected requests over")


class ConnectionLost(RadixdError):
    """The connection to the daemon closed or broke (daemon stopped or restarted, socket error,
    or the client closed it).

    The daemon releases everything a session held when its connection ends, so nothing obtained
    through this client is valid any more: receipts, held pages and node ids must be forgotten,
    and the caller must reconnect (a new ``Client``) and redo its work from a fresh ``match``.
    ``details["sent"]``: False (an ``AsyncClient``'s) when nothing of the call was sent.
    """

    default_code = "connection_lost"

    def __init__(self, message: str = "", *, code: str | None = None,
                 details: Mapping[str, Any] | None = None) -> None:
        if not message:
            message = f"connection to radixd lost: {_LOST}"
        elif _LOST not in message:
            message = f"{message}: {_LOST}"
        super().__init__(message, code=code, details=details)


class SessionRestarted(ConnectionLost):
    """The daemon went away (restart, upgrade) and a client with a reconnect policy is connected
    again, on a new session, with its attached pools mapped again in place.

    Raised by the call that was cut (with ``AsyncClient``, by every call that was in flight or
    waiting, or made while the new session was being opened). Everything the old session held
    is gone (receipts, pages, node ids): start the requests that were in flight over from a
    fresh ``match`` (``RequestLifecycle.restart``). Calls made after it work.
    ``details["attach_again"]``: the models whose pools could not be mapped again in place and
    were closed (model -> why); ``attach`` them again and rebuild the views.
    ``details["sent"]``: False when the call was refused before it was sent because it was made
    for a session the client had left (``Client.on_session``) or, on an ``AsyncClient``, while
    the new session was being opened; without the key, the call may have been sent.
    """

    default_code = "session_restarted"


class TimedOut(ConnectionLost):
    """No response within the client's ``timeout``. The client closes the connection (the stream
    can no longer be trusted to be in step), so this is also a :class:`ConnectionLost`."""

    default_code = "timeout"


class ConnectFailed(RadixdError):
    """The client could not connect to the daemon's socket (missing, refused, permission)."""

    default_code = "connect_failed"


class BatchSkipped(RadixdError):
    """A batch operation without a result of its own. Either it did not run (an earlier one
    failed with ``stop_on_error``, the batch was never sent because the ``with`` block raised,
    or the daemon refused the whole batch: the message says "not run"), or the batch was sent
    and then the connection was lost or the call interrupted (a cancelled task, a timeout), so
    it may have run: the message says so, and whatever it took belongs to the session (with a
    reconnect policy, to the session that ended)."""

    default_code = Code.NOT_EXECUTED


CODE_TO_ERROR[Code.NOT_EXECUTED] = BatchSkipped


class PoolError(RadixdError, RuntimeError):
    """A KV pool could not be mapped or used (bad description, size, closed pool, bad page id).

    Also what the daemon's own pool code raises, so the daemon and the client share one class.
    """

    default_code = "pool_error"


class SegmentsNotMapped(PoolError):
    """The daemon carried out the call, but its result names pool segments that could not be
    mapped into this process (out of memory, ``vm.max_map_count``, descriptors): there, the
    pages of those segments are private zeros, not the pool, so nothing may be written to or
    read from them.

    ``result`` is what the call returned (for a batch, its ``(ok, result)`` outcomes, which its
    futures also hold), so that what the call took is not lost: free the pages an ``alloc``
    gave, unlock the receipt a ``match`` took (``RequestLifecycle`` records them, and its
    ``abort`` gives them back). ``details["models"]`` names the models whose pools are behind.
    The next result that names a new segment generation tries to map them again.
    """

    default_code = "segments_not_mapped"

    def __init__(self, message: str = "", *, code: str | None = None,
                 details: Mapping[str, Any] | None = None, result: Any = None) -> None:
        super().__init__(message, code=code, details=details)
        self.result = result
