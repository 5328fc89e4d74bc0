"""The wire codec: every request and every result type survives encode -> decode unchanged."""

from __future__ import annotations

import struct
from array import array
from typing import Any

import msgspec
import pytest
from radixd_client import protocol as P

TOK = struct.pack("<5i", 1, 2, 3, -4, 2**31 - 1)
PAGES = struct.pack("<3i", 5, 6, 7)

# One instance per request type, every field away from its default where it has one.
REQUESTS: list[P.Request] = [
    P.Hello(id=1, version=3, token="s3cret", client="engine-0"),
    P.Ping(id=2, payload=b"\x00\xffpayload"),
    P.Attach(id=3, model="m"),
    P.Match(id=4, model="m", tokens=TOK, lock=True),
    P.Lock(id=5, model="m", node=42),
    P.Unlock(id=6, model="m", receipt=9),
    P.ReleaseSwa(id=7, model="m", receipt=10),
    P.Alloc(id=8, model="m", n=3),
    P.Free(id=9, model="m", full_pages=PAGES, swa_pages=PAGES[:4]),
    P.Insert(id=10, model="m", tokens=TOK, full_pages=PAGES, swa_pages=PAGES, prev_prefix_len=4,
             swa_evicted_len=2, lock=True),
    P.CacheUnfinished(id=11, model="m", tokens=TOK, full_pages=PAGES, swa_pages=PAGES,
                      prev_prefix_len=8, swa_evicted_len=4, receipt=12),
    P.CacheFinished(id=12, model="m", tokens=TOK, full_pages=PAGES, swa_pages=b"",
                    prev_prefix_len=0, swa_evicted_len=0, receipt=None),
    P.Evict(id=13, model="m", full_pages=5, swa_pages=6),
    P.Stats(id=14, model="m"),
    P.Load(id=16, model="m", tokens=TOK, lock=True),
    P.Prefetch(id=17, model="m", tokens=TOK, policy="timeout", timeout_ms=50),
    P.KvAttach(id=18, model="m"),
    P.KvLookup(id=19, model="m", keys=[b"k1", b"k2"], pool="swa", fetch=True, timeout_ms=5),
    P.KvReserve(id=20, model="m", keys=[b"k1"]),
    P.KvCommit(id=21, model="m", pin=3),
    P.KvRelease(id=22, model="m", pin=4),
    P.KvClear(id=23, model="m"),
    P.Batch(id=15, stop_on_error=False, ops=[
        P.Ping(payload=b"x"), P.Match(model="m", tokens=TOK), P.Lock(model="m", node=1),
        P.Unlock(model="m", receipt=2), P.ReleaseSwa(model="m", receipt=3),
        P.Alloc(model="m", n=1), P.Free(model="m", full_pages=PAGES),
        P.Insert(model="m", tokens=TOK, full_pages=PAGES),
        P.CacheUnfinished(model="m", tokens=TOK, full_pages=PAGES, receipt=4),
        P.CacheFinished(model="m", tokens=TOK, full_pages=PAGES),
        P.Evict(model="m", full_pages=1), P.Stats(),
        P.KvLookup(model="m", keys=[b"k"]), P.KvReserve(model="m", keys=[b"k"]),
        P.KvCommit(model="m", pin=1), P.KvRelease(model="m", pin=2), P.KvClear(model="m"),
    ]),
]

MODEL = P.ModelInfo(name="m", page_size=16, sliding_window=None, num_full_layers=4,
                    num_swa_layers=0, num_kv_heads=8, head_dim=128, dtype="float16",
                    device="cuda:0", full_pages=1000, swa_pages=0)
INSERTED = P.InsertResult(prefix_len=16, inserted_len=32, full_pages=PAGES, swa_pages=b"",
                          node=77, receipt=5)

# One instance per op's result type.
RESULTS: dict[str, P.Result] = {
    "hello": P.HelloResult(session=1, version=1, instance="ab", tenant="t", namespace="n",
                           models=[MODEL, P.ModelInfo(
                               name="swa", page_size=4, sliding_window=8, num_full_layers=1,
                               num_swa_layers=3, num_kv_heads=1, head_dim=64, dtype="bfloat16",
                               device="cpu", full_pages=10, swa_pages=5)],
                           limits=P.Limits(max_frame_bytes=1 << 24, max_tokens=1 << 17,
                                           max_inflight=128)),
    "ping": P.PingResult(payload=b"pong"),
    "attach": P.AttachResult(pools=[
        P.PoolInfo(pool="full", kind="memfd", fd_index=0, dtype="bfloat16",
                   shape=[2, 2, 10, 4, 1, 8], nbytes=2 * 2 * 10 * 4 * 8 * 2, device="cpu",
                   description={"version": 1, "storage": "memfd", "shape": [2, 2, 10, 4, 1, 8],
                                "layout_fingerprint": "ab" * 16}),
        P.PoolInfo(pool="swa", kind="cuda_ipc", fd_index=-1, dtype="float16",
                   shape=[1, 2, 5, 4, 1, 8], nbytes=800, device="cuda:0", handle=b"\x01\x02"),
    ]),
    "match": P.MatchResult(prefix_len=8, full_pages=PAGES, swa_pages=PAGES[:4], node=3,
                           full_hit_len=12, host_hit_len=16, receipt=4),
    "lock": P.LockResult(receipt=99),
    "unlock": P.Empty(),
    "release_swa": P.Empty(),
    "alloc": P.AllocResult(full_pages=PAGES, swa_pages=PAGES),
    "free": P.Empty(),
    "insert": INSERTED,
    "cache_unfinished": P.InsertResult(prefix_len=0, inserted_len=0, full_pages=b"",
                                       swa_pages=b"", node=0, receipt=None),
    "cache_finished": INSERTED,
    "evict": P.EvictResult(full_pages=3, swa_pages=1),
    "stats": P.StatsResult(tenant="t", namespace="n",
                           models={"m": {"full_pages": 3, "matches": 10}}),
    "load": P.LoadResult(prefix_len=16, full_pages=PAGES, swa_pages=PAGES[:4], node=9,
                         full_hit_len=16, host_hit_len=0, receipt=7, loaded_len=8),
    "prefetch": P.PrefetchResult(status="complete", l3_hit_len=32, fetched_len=32),
    "kv_attach": P.KvAttachResult(pools=[P.KvPoolInfo(pool="full", fd_index=0, slots=4,
                                                      page_nbytes=64, nbytes=256)]),
    "kv_lookup": P.KvLookupResult(present=b"\x01\x00", slots=array("i", [5, 0]), prefix=1,
                                  pin=9, fetched=1),
    "kv_reserve": P.KvReserveResult(slots=array("i", [0, 7]), pin=2, full=1, busy=0),
    "kv_commit": P.Empty(),
    "kv_release": P.Empty(),
    "kv_clear": P.KvClearResult(removed=3),
    "batch": P.BatchResult(results=[
        P.BatchItem(ok=True, result=msgspec.Raw(P.encode_body(P.LockResult(receipt=1)))),
        P.BatchItem(ok=False, error=P.Error(code=P.Code.BAD_RECEIPT, message="no",
                                            details={"receipt": 1})),
    ]),
}


def test_samples_cover_every_type() -> None:
    assert {type(r) for r in REQUESTS} == set(P.OPS.values())
    assert set(RESULTS) == set(P.RESULT_TYPES) == set(P.OPS)
    for op, result in RESULTS.items():
        assert type(result) is P.RESULT_TYPES[op]
    batch = next(r for r in REQUESTS if isinstance(r, P.Batch))
    assert {type(op) for op in batch.ops} == set(P.BatchOp.__args__)  # type: ignore[attr-defined]


@pytest.mark.parametrize("req", REQUESTS, ids=lambda r: r.__struct_config__.tag)
def test_request_round_trip(req: P.Request) -> None:
    frame = P.encode(req)
    (n,) = P.HEADER.unpack(frame[:4])
    assert n == len(frame) - 4
    assert P.decode_request(frame[4:]) == req
    assert P.decode_request(memoryview(frame)[4:]) == req
    assert P.encode_body(req) == frame[4:]
    # The op travels as the tag; it is what the daemon dispatches on.
    assert msgspec.msgpack.decode(frame[4:])["op"] == req.__struct_config__.tag


def test_defaults_are_omitted_and_restored() -> None:
    body = P.encode_body(P.Match(model="m", tokens=b""))
    assert msgspec.msgpack.decode(body) == {"op": "match", "model": "m", "tokens": b""}
    assert P.decode_request(body) == P.Match(id=0, model="m", tokens=b"", lock=False)
    assert msgspec.msgpack.decode(P.encode_body(P.Stats())) == {"op": "stats"}


@pytest.mark.parametrize("op", sorted(RESULTS))
def test_result_round_trip_through_an_ok_frame(op: str) -> None:
    frame = P.ok_frame(123, RESULTS[op])
    (n,) = P.HEADER.unpack(frame[:4])
    assert n == len(frame) - 4
    resp = P.decode_response(frame[4:])
    assert resp.id == 123 and resp.ok and resp.error is None
    decoded = P.decode_result(op, resp.result)
    assert decoded == RESULTS[op]
    # The hand-assembled ok frame is byte-identical to encoding the equivalent map.
    assert frame[4:] == msgspec.msgpack.encode(
        {"id": 123, "ok": True, "result": msgspec.msgpack.decode(P.encode_body(RESULTS[op]))})


def test_batch_items_decode_to_their_op_types() -> None:
    resp = P.decode_response(P.ok_frame(1, RESULTS["batch"])[4:])
    items = P.decode_result("batch", resp.result).results  # type: ignore[attr-defined]
    assert P.decode_result("lock", items[0].result) == P.LockResult(receipt=1)
    assert items[1].error == P.Error(code="bad_receipt", message="no", details={"receipt": 1})


@pytest.mark.parametrize("code", P.ALL_CODES)
def test_error_frame_round_trip(code: str) -> None:
    frame = P.error_frame(5, code, f"{code} happened", {"pool": "full", "n": 3})
    resp = P.decode_response(frame[4:])
    assert resp.id == 5 and resp.ok is False
    assert resp.error == P.Error(code=code, message=f"{code} happened",
                                 details={"pool": "full", "n": 3})
    assert P.decode_response(P.error_frame(0, code, "m")[4:]).error.details == {}  # type: ignore


def test_header_is_u32_little_endian() -> None:
    assert P.HEADER_SIZE == 4
    assert P.HEADER.pack(0x01020304) == b"\x04\x03\x02\x01"


def test_malformed_request_is_refused() -> None:
    with pytest.raises(msgspec.ValidationError):
        P.decode_request(msgspec.msgpack.encode({"op": "nope", "id": 1}))
    with pytest.raises(msgspec.ValidationError):
        P.decode_request(msgspec.msgpack.encode({"op": "match", "id": 1, "model": "m"}))
    with pytest.raises(msgspec.DecodeError):
        P.decode_request(b"\xc1")


def test_unknown_result_fields_are_ignored() -> None:
    """A newer daemon may add result fields; this client must still decode the result."""
    raw = msgspec.msgpack.encode({"receipt": 3, "added_later": [1, 2]})
    assert P.decode_result("lock", raw) == P.LockResult(receipt=3)


def test_result_types_are_msgspec_structs() -> None:
    for t in P.RESULT_TYPES.values():
        assert issubclass(t, msgspec.Struct)
    sample: Any = RESULTS["match"]
    assert msgspec.structs.asdict(sample)["node"] == 3


def test_hello_always_carries_the_protocol_version() -> None:
    """Not omitted as a default: a later protocol must never mistake an old client for a new one."""
    body = msgspec.msgpack.decode(P.encode_body(P.Hello()))
    assert body["version"] == P.PROTOCOL_VERSION == 1
    assert body["op"] == "hello"


def test_a_kv_clear_answer_from_a_daemon_before_l3_cleared_says_nothing() -> None:
    """An older daemon's answer has no ``l3_cleared``: None (it does not say), not True, so a
    caller cannot take an unrecorded clear for a recorded one."""
    old = P.decode_result("kv_clear", msgspec.msgpack.encode({"removed": 3}))
    assert old.removed == 3 and old.l3_cleared is None
    assert P.decode_result("kv_clear", msgspec.msgpack.encode(
        {"removed": 0, "l3_cleared": False})).l3_cleared is False
