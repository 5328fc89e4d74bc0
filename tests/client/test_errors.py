"""Error mapping: every protocol code has its class; client-side errors say what to do."""

from __future__ import annotations

import pickle

import pytest
from radixd_client import errors as E
from radixd_client import protocol as P

FAMILIES: dict[type[E.RadixdError], set[str]] = {
    E.ProtocolError: {"bad_frame", "frame_too_large", "unknown_op", "version_unsupported"},
    E.AuthError: {"not_authenticated", "auth_failed", "already_authenticated",
                  "model_not_allowed"},
    E.NotFoundError: {"unknown_model", "unknown_node"},
    E.NodeNotUsable: {"node_not_usable"},
    E.ReceiptError: {"bad_receipt"},
    E.PageError: {"page_not_held", "bad_page"},
    E.OutOfMemory: {"out_of_memory"},
    E.QuotaExceeded: {"quota_exceeded"},
    E.LimitExceeded: {"too_many_tokens", "too_many_inflight", "too_many_sessions",
                      "too_many_locks"},
    E.BatchSkipped: {"not_executed"},
    E.BadArgument: {"bad_argument"},
    E.ShuttingDown: {"shutting_down"},
    E.InternalError: {"internal"},
}


def test_every_code_is_mapped_exactly_as_specified() -> None:
    assert set(E.CODE_TO_ERROR) == set(P.ALL_CODES)
    assert len(P.ALL_CODES) == len(set(P.ALL_CODES)) == 24
    for cls, codes in FAMILIES.items():
        assert {c for c, k in E.CODE_TO_ERROR.items() if k is cls} == codes
    assert set().union(*FAMILIES.values()) == set(P.ALL_CODES)


@pytest.mark.parametrize("code", P.ALL_CODES)
def test_error_from_wire(code: str) -> None:
    details = {"pool": "full", "available": 3}
    err = E.error_from_wire(P.Error(code=code, message=f"{code}!", details=details))
    assert type(err) is E.CODE_TO_ERROR[code]
    assert isinstance(err, E.RadixdError) and isinstance(err, Exception)
    assert err.code == code
    assert err.message == str(err) == f"{code}!"
    assert err.details == details
    assert code in repr(err)
    # A class's default code is one of its own codes.
    assert type(err).default_code in FAMILIES[type(err)]


def test_unknown_code_is_a_plain_radixd_error() -> None:
    err = E.error_from_wire(P.Error(code="added_in_v9", message="new"))
    assert type(err) is E.RadixdError
    assert err.code == "added_in_v9" and err.message == "new" and err.details == {}


def test_failed_response_without_error() -> None:
    err = E.error_from_wire(None)
    assert isinstance(err, E.ProtocolError) and "without an error" in err.message


@pytest.mark.parametrize("code", [*P.ALL_CODES, "added_in_v9"])
def test_errors_pickle_with_code_and_details(code: str) -> None:
    err = E.error_from_wire(P.Error(code=code, message="m", details={"a": [1, 2]}))
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err)
    assert (back.code, back.message, back.details) == (code, "m", {"a": [1, 2]})


def test_connection_lost_tells_the_caller_to_reconnect() -> None:
    default = E.ConnectionLost()
    assert default.code == "connection_lost"
    for err in (default, E.ConnectionLost("connection to radixd lost (EOF)")):
        assert "session" in err.message and "reconnect" in err.message
        assert "held" in err.message
    assert str(E.ConnectionLost("x (EOF)")).startswith("x (EOF): ")
    # The explanation is not repeated when a message is re-wrapped.
    again = E.ConnectionLost(E.ConnectionLost("x").message)
    assert again.message.count("reconnect") == 1
    timed = E.TimedOut("no answer")
    assert isinstance(timed, E.ConnectionLost) and timed.code == "timeout"
    assert pickle.loads(pickle.dumps(timed)).message == timed.message


def test_client_side_codes_are_not_protocol_codes() -> None:
    local = [E.ConnectionLost, E.TimedOut, E.ConnectFailed, E.PoolError]
    for cls in local:
        assert cls.default_code not in P.ALL_CODES
        assert issubclass(cls, E.RadixdError)


def test_pool_error_is_also_a_runtime_error() -> None:
    err = E.PoolError("description.shape: bad")
    assert isinstance(err, RuntimeError) and isinstance(err, E.RadixdError)
    assert str(err) == "description.shape: bad" and err.code == "pool_error"
