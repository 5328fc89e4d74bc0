"""Regression tests for the defects a code review found (each failed on the code it was written
against and passes since the fix), plus properties that were in doubt and hold."""

from __future__ import annotations

import os
import time
from array import array

import msgspec
import pytest
from radixd_client import protocol

from daemon.gpu.profile import ModelProfile
from daemon.model_cache import ModelCache
from daemon.tree import BadArgument, CollectingSink, RadixTree, as_token_bytes
from daemon.tree.invariants import check_tree

from .conftest import Raw

P = 4
MODEL = "m"




# ---------------------------------------------------------------------------- server framing


@pytest.mark.parametrize("op", [[1, 2], {"x": 1}])
def test_unhashable_op_gets_an_error_and_the_session_survives(daemon, op) -> None:
    """server.py:176 (_bad_frame): `op not in P.OPS` raises TypeError for an unhashable op (a
    list or a map): the exception escapes data_received, asyncio drops the connection (and the
    session with everything it held) instead of answering bad_frame/unknown_op."""
    c = Raw(daemon.socket)
    c.send(msgspec.msgpack.encode({"id": 7, "op": op}))
    resp = c.recv()  # actual: ConnectionError("closed")
    assert not resp.ok and resp.error.code in ("bad_frame", "unknown_op")
    assert c.call(protocol.Ping(id=8, payload=b"x")).ok
    c.close()



def test_deeply_nested_body_gets_an_error_and_the_session_survives(daemon) -> None:
    """server.py:128-131: _handle catches only msgspec.DecodeError/ValidationError around
    decode_request, but msgspec raises RecursionError for a deeply nested value (here inside an
    unknown field of a ping, which msgspec would otherwise skip). It escapes data_received and
    asyncio drops the connection and the session (every lock and page it held) instead of
    answering bad_frame (DESIGN 7: 'the session survives unless the framing itself is broken')."""
    c = Raw(daemon.socket)
    body = b"\x83\xa2op\xa4ping\xa2id\x09\xa1x" + b"\x91" * 200_000 + b"\xc0"
    c.send(body)
    resp = c.recv()  # actual: ConnectionError("closed")
    assert not resp.ok and resp.error.code == "bad_frame"
    assert c.call(protocol.Ping(id=10, payload=b"y")).ok
    c.close()


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_attach_hold_has_no_read_backpressure(daemon) -> None:
    """server.py:88-97/237/244-245: while an attach waits for the transport's write buffer to drain
    (`holding`), data_received keeps appending to self.buf and _process returns at once; reading
    is paused only above the write high-water mark (max_inflight * 64 KiB = 16 MiB). A client that
    leaves one big response unread (below the mark), sends attach and then streams requests makes
    the daemon buffer all of them: unbounded memory (and `_send_with_fds` polls every 1 ms
    forever). Expected: reading stops (backpressure) while frames are held."""
    c = Raw(daemon.socket)
    # one unread response of 4 MiB: the kernel takes a few hundred KiB, the transport keeps the
    # rest, below the 16 MiB high-water mark, so reading is not paused
    c.send(protocol.encode_body(protocol.Ping(id=1, payload=b"\0" * (4 << 20))))
    time.sleep(0.3)
    c.send(protocol.encode_body(protocol.Attach(id=2, model=MODEL)))
    time.sleep(0.3)
    before = _rss_kib(daemon.proc.pid)
    frame = protocol.encode(protocol.Ping(id=3, payload=b"\1" * (1 << 20)))
    c.s.settimeout(5)
    sent = 0
    try:
        for _ in range(256):  # 256 MiB of requests
            c.s.sendall(frame)
            sent += len(frame)
    except TimeoutError:
        pass  # backpressure: what should happen early
    time.sleep(0.5)
    grown_mib = (_rss_kib(daemon.proc.pid) - before) / 1024
    c.close()
    assert sent < 64 << 20 and grown_mib < 64, (
        f"the daemon read {sent >> 20} MiB it cannot process yet; its RSS grew {grown_mib:.0f} MiB")


# ---------------------------------------------------------------------------- service: quotas

SMALL = {"name": "m", "page_size": P, "sliding_window": 2 * P, "num_full_layers": 1,
         "num_swa_layers": 1, "num_kv_heads": 1, "head_dim": 4, "dtype": "float32",
         "device": "cpu", "full_pages": 21, "swa_pages": 21, "export_pools": False}


def _service(tenants):
    from daemon.config import Config
    from daemon.service import Service

    return Service(Config(models=[SMALL], tenants=tenants), create_pools=False)


def _session(svc, token):
    from daemon.service import Peer

    return svc.open_session(svc.authenticate(token, Peer(0, os.getuid(), os.getgid())), Peer())


def _toks(n_pages: int, base: int) -> bytes:
    return array("i", range(base, base + n_pages * P)).tobytes()


def test_quota_eviction_happens_even_when_the_alloc_then_fails() -> None:
    """service.py:215-236 + 285-286: _enforce_quota evicts the tenant's cached pages before
    cache.alloc decides whether the allocation can succeed at all. When the pool cannot satisfy
    it (another tenant holds the rest), the request fails with out_of_memory but the tenant's
    cache is gone: a refused request that changed state (ModelCache.alloc itself takes care to
    'refuse before evicting anyone's cache for nothing')."""
    from daemon.gpu.allocator import OutOfPages

    svc = _service([{"name": "a", "token": "ta", "namespace": "na", "quota_full_pages": 10},
                    {"name": "b", "token": "tb", "namespace": "nb"}])
    sa, sb = _session(svc, "ta"), _session(svc, "tb")
    cache = svc.models["m"].cache
    from radixd_client import protocol as Pr

    # alice caches 8 pages; bob holds 12 of the remaining 12: the pool (20 usable) is full
    a = svc.alloc(sa, Pr.Alloc(model="m", n=8))
    svc.insert(sa, Pr.Insert(model="m", tokens=_toks(8, 1), full_pages=a.full_pages,
                             swa_pages=a.swa_pages))
    svc.alloc(sb, Pr.Alloc(model="m", n=12))
    assert cache.tree.namespaces["na"].full_pages == 8
    # alice asks for 10: within quota only if her 8 cached pages go, and even then the pool has
    # only 8 free pages: the request must fail, and should leave her cache alone
    with pytest.raises(OutOfPages):
        svc.alloc(sa, Pr.Alloc(model="m", n=10))
    assert cache.check() == []
    assert cache.tree.namespaces["na"].full_pages == 8, (
        f"the refused alloc evicted {8 - cache.tree.namespaces['na'].full_pages} of alice's "
        "cached pages")


# ---------------------------------------------------------------------------- tree: refusals


def _pages(*labels: int) -> bytes:
    out: list[int] = []
    for lab in labels:
        out += [lab * 1000 + j for j in range(P)]
    return as_token_bytes(out)


def test_refused_insert_leaves_the_tree_unchanged() -> None:
    """radix.py:571 (insert loop) + 590-592: with a prev_prefix_len longer than the cached
    prefix, the loop first splits the node the sequence diverges in (`child =
    self._split(child, m)` for the tree-owned part), and only then refuses with 'prev_prefix_len
    ... is longer than the cached prefix'. _advance (line 542) has already moved the churn clock
    too. TreeError's contract: 'the request was refused and the tree is unchanged'. Low severity
    (the split is structurally valid), but a client can fragment nodes with requests that fail."""
    sink = CollectingSink()
    t = RadixTree(P, 2 * P, sink)
    t.insert("ns", _pages(1, 2, 3), array("i", [1, 2, 3]), array("i", [1, 2, 3]))
    before = (sorted(t.nodes), t._clock, t.stats["splits"])
    with pytest.raises(BadArgument, match="longer than the cached prefix"):
        t.insert("ns", _pages(1, 5, 6), array("i", [9]), array("i", [9]), prev_prefix_len=2 * P)
    assert check_tree(t) == []
    assert (sorted(t.nodes), t._clock, t.stats["splits"]) == before


# ---------------------------------------------------------------------------- checker gaps


NS = "ns"


def seq(labels: list[int]) -> bytes:
    return as_token_bytes([lab * 1000 + j for lab in labels for j in range(4)])


def _cache() -> ModelCache:
    profile = ModelProfile(
        name="m", page_size=4, num_full_layers=1, num_kv_heads=1, head_dim=1, full_pages=32,
        sliding_window=8, num_swa_layers=1, swa_pages=32, dtype="float32", device="cpu")
    return ModelCache(profile)


def test_checker_sees_an_swa_page_owned_by_no_holding() -> None:
    """model_cache.py:311-316: the holdings/owner-map agreement is checked per holding (pages a
    holding lists must map to it) and, for the full pool only, by a total count. An SWA page left
    in _swa_owner that no holding lists is invisible to check(), yet release_owner() (which walks
    the holding) never frees it: a permanent leak the checker cannot report."""
    c = _cache()
    _, w = c.alloc(1, 2)
    c.holdings[1].swa.discard(w[0])  # the corruption a bookkeeping bug would leave
    assert c.check() != []


def test_checker_sees_a_receipt_no_holding_lists() -> None:
    """model_cache.py:317-320: receipts are compared registry-vs-tree only; a receipt in
    _receipts that its owner's holding does not list (so release_owner never unlocks it: a lock
    leaked forever) passes check()."""
    c = _cache()
    f, w = c.alloc(1, 2)
    res, rid = c.insert(1, NS, seq([1, 2]), f, w, lock=True)
    c.holdings[1].receipts.discard(rid)
    assert c.check() != []
