"""attach: pool descriptors arrive with the response frame (SCM_RIGHTS) and are mapped shared."""

from __future__ import annotations

import asyncio
import gc
import mmap
import os
import socket
import time
from array import array
from typing import Any

import pytest
from radixd_client import AsyncClient, Client, ConnectionLost, PoolError, ReceiptError
from radixd_client import protocol as P
from radixd_client.pools import (
    DTYPE_ITEMSIZE,
    POOL_LAYOUT,
    AttachedPools,
    attach_pools,
    contiguous_strides,
    map_pool_fd,
    open_cuda_ipc,
)

torch = pytest.importorskip("torch")



def _pools_module() -> Any:
    return pytest.importorskip("daemon.gpu.pools")


def make_pools(**overrides: Any) -> Any:
    """The daemon's own pools, so descriptions are exactly what the daemon sends."""
    pools = _pools_module()
    from daemon.gpu.profile import ModelProfile

    fields: dict[str, Any] = dict(name="tiny", page_size=4, sliding_window=8, num_full_layers=3,
                                  num_swa_layers=2, num_kv_heads=2, head_dim=8,
                                  dtype="bfloat16", device="cpu", full_pages=6, swa_pages=4)
    fields.update(overrides)
    return pools.KVPools(ModelProfile(**fields))


def attach_result(kv: Any) -> tuple[P.AttachResult, list[int]]:
    """What the daemon's service builds for attach (kept in step with daemon/service.py)."""
    infos, fds = [], []
    for pool in kv.pools():
        desc = pool.describe()
        fds.append(pool.fd)
        infos.append(P.PoolInfo(pool=pool.kind, kind="memfd", fd_index=len(fds) - 1,
                                dtype=desc["dtype"], shape=desc["shape"], nbytes=desc["nbytes"],
                                device=desc["device"], description=desc))
    return P.AttachResult(pools=infos), fds


def send_with_fds(frame: bytes, fds: list[int], split: bool = False) -> Any:
    def send(sock: socket.socket) -> None:
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array("i", fds).tobytes())]
        if split:  # header alone first, the descriptors with the body
            sock.sendall(frame[:4])
            sock.sendmsg([frame[4:]], anc)
        else:  # as the daemon does: one sendmsg for the whole frame and the descriptors
            sock.sendmsg([frame], anc)
    return send


def handler_for(kv: Any, *, split: bool = False) -> Any:
    def handler(req: Any) -> Any:
        if isinstance(req, P.Attach):
            result, fds = attach_result(kv)
            return send_with_fds(P.ok_frame(req.id, result), fds, split)
        if isinstance(req, P.Ping):
            return P.ok_frame(req.id, P.PingResult(payload=req.payload))
        return P.ok_frame(req.id, P.Empty())
    return handler


def check_shared(kv: Any, attached: AttachedPools) -> None:
    assert attached.full.shape == kv.full.buffer.shape
    assert attached.full.dtype == torch.bfloat16
    assert attached.swa is not None and attached.swa.shape == kv.swa.buffer.shape
    assert attached.page_size == 4 and attached.num_layers("full") == 3
    assert attached.num_layers("swa") == 2 and attached.num_pages("swa") == 4
    # The engine writes through its per-layer view; the daemon's pool sees it, and back.
    k = attached.k("full", 2)
    assert k.shape == (6, 4, 2, 8) and k.is_contiguous()
    k[3].fill_(1.5)
    assert bool((kv.full.k(2)[3] == 1.5).all())
    kv.swa.v(1)[2].fill_(-2)
    assert bool((attached.v("swa", 1)[2] == -2).all())
    assert attached.k("full", 0).data_ptr() != kv.full.k(0).data_ptr()  # a second mapping


@pytest.mark.parametrize("split", [False, True], ids=["one-sendmsg", "fds-with-body"])
def test_sync_attach_maps_the_daemons_pools(fake_daemon: Any, kit: Any, split: bool) -> None:
    with make_pools() as kv:
        d = fake_daemon(handler_for(kv, split=split))
        c = Client.from_socket(d.client_sock)
        assert c.ping(b"before").payload == b"before"  # a response read just before attach
        before = kit.open_fds()
        with c.attach("tiny") as attached:
            # the received descriptors are closed after mapping, and the mappings keep none
            # (an mmap object kept a copy before Python 3.13: a rebound pool's old memory
            # then stayed allocated)
            assert kit.open_fds() == before
            check_shared(kv, attached)
            assert "tiny" in repr(attached) and attached.names == ("full", "swa")
            assert attached.infos["full"].kind == "memfd"
        assert attached.closed and "closed" in repr(attached)
        gc.collect()
        assert kit.open_fds() == before
        with pytest.raises(PoolError, match="closed"):
            attached.k("full", 0)
        assert c.ping(b"after").payload == b"after"  # the stream is still in step
        assert d.requests[2] == P.Attach(id=3, model="tiny")


def test_async_attach_waits_for_other_calls(fake_daemon: Any, kit: Any, run: Any) -> None:
    with make_pools() as kv:
        base = handler_for(kv)

        def handler(req: Any) -> Any:
            if isinstance(req, P.Ping):  # slow answers: the pings are in flight during attach
                def slow(sock: socket.socket) -> None:
                    time.sleep(0.01)
                    sock.sendall(base(req))
                return slow
            return base(req)

        d = fake_daemon(handler)

        async def main() -> None:
            c = await AsyncClient.from_socket(d.client_sock)
            before = kit.open_fds()
            pings = [asyncio.ensure_future(c.ping(bytes([i]))) for i in range(5)]
            await asyncio.sleep(0)  # let them be sent
            attaching = asyncio.ensure_future(c.attach("tiny"))
            await asyncio.sleep(0)  # the attach now waits for the pings to be answered...
            late = [asyncio.ensure_future(c.ping(b"x")) for _ in range(3)]  # ...these for it
            attached = await attaching
            assert all(p.done() for p in pings)
            more = await asyncio.gather(*late)
            assert [p.result().payload for p in pings] == [bytes([i]) for i in range(5)]
            assert all(m.payload == b"x" for m in more)
            assert kit.open_fds() == before
            check_shared(kv, attached)
            attached.close()
            gc.collect()
            assert kit.open_fds() == before
            await c.close()

        run(main())
        ops = d.ops()
        # attach went out alone: after every earlier ping was answered, before the later ones
        assert ops == ["hello"] + ["ping"] * 5 + ["attach"] + ["ping"] * 3


def test_attach_refused_by_the_daemon(fake_daemon: Any) -> None:
    d = fake_daemon(lambda req: P.error_frame(req.id, P.Code.BAD_ARGUMENT, "export_pools off"))
    c = Client.from_socket(d.client_sock)
    with pytest.raises(Exception, match="export_pools off"):
        c.attach("tiny")
    assert not c.closed


def test_bad_descriptions_close_the_descriptors(fake_daemon: Any, kit: Any) -> None:
    with make_pools() as kv:
        def handler(req: Any) -> Any:
            result, fds = attach_result(kv)
            result.pools[1].description = {**result.pools[1].description, "nbytes": 3}
            return send_with_fds(P.ok_frame(req.id, result), fds)

        d = fake_daemon(handler)
        c = Client.from_socket(d.client_sock)
        before = kit.open_fds()
        with pytest.raises(PoolError, match=r"description\.nbytes"):
            c.attach("tiny")
        assert kit.open_fds() == before
        assert not c.closed


def test_daemon_gone_during_attach(fake_daemon: Any, kit: Any) -> None:
    with make_pools() as kv:
        def handler(req: Any) -> Any:
            result, fds = attach_result(kv)
            frame = P.ok_frame(req.id, result)

            def send(sock: socket.socket) -> None:
                sock.sendmsg([frame[:10]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                             array("i", fds).tobytes())])
                sock.close()
                raise EOFError
            return send

        d = fake_daemon(handler)
        c = Client.from_socket(d.client_sock)
        before = kit.open_fds()
        with pytest.raises(ConnectionLost):
            c.attach("tiny")
        assert c.closed
        assert kit.open_fds() <= before  # received fds closed (and the client's socket too)


# ---------------------------------------------------------------------------- pure client side

def _memfd_pool(shape: list[int], dtype: str = "float16") -> tuple[int, dict[str, Any]]:
    nbytes = DTYPE_ITEMSIZE[dtype]
    for s in shape:
        nbytes *= s
    fd = os.memfd_create("client-test", os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    desc = {"version": 1, "storage": "memfd", "dtype": dtype, "shape": shape,
            "strides": list(contiguous_strides(shape)), "nbytes": nbytes,
            "layout": list(POOL_LAYOUT)}
    return fd, desc


def test_map_pool_fd_without_the_daemon() -> None:
    fd, desc = _memfd_pool([2, 2, 3, 4, 1, 2])
    try:
        t = map_pool_fd(fd, desc)
        t[1, 0, 2].fill_(3.0)
        m = mmap.mmap(fd, desc["nbytes"])
        view = torch.frombuffer(m, dtype=torch.float16).view(2, 2, 3, 4, 1, 2)
        assert bool((view[1, 0, 2] == 3.0).all())
        del view
    finally:
        os.close(fd)
    assert float(t[1, 0, 2].sum()) == 3.0 * 8  # alive after the fd is closed


def test_attach_pools_validates_what_the_daemon_sent() -> None:
    fd, desc = _memfd_pool([1, 2, 2, 4, 1, 2])
    info = P.PoolInfo(pool="full", kind="memfd", fd_index=0, dtype="float16",
                      shape=desc["shape"], nbytes=desc["nbytes"], device="cpu", description=desc)
    try:
        with pytest.raises(PoolError, match="fd_index 0 but 0 fds"):
            attach_pools("m", P.AttachResult(pools=[info]), [])
        odd = P.PoolInfo(**{**_fields(info), "kind": "rdma"})
        with pytest.raises(PoolError, match="unknown kind 'rdma'"):
            attach_pools("m", P.AttachResult(pools=[odd]), [fd])
        wrong = P.PoolInfo(**{**_fields(info), "shape": [9, 9, 9, 9, 9, 9]})
        with pytest.raises(PoolError, match="disagree"):
            attach_pools("m", P.AttachResult(pools=[wrong]), [fd])
        with pytest.raises(PoolError, match="twice"):
            attach_pools("m", P.AttachResult(pools=[info, info]), [fd])
        swa_only = P.PoolInfo(**{**_fields(info), "pool": "swa"})
        with pytest.raises(PoolError, match="no full pool"):
            attach_pools("m", P.AttachResult(pools=[swa_only]), [fd])
        ok = attach_pools("m", P.AttachResult(pools=[info]), [fd])
        assert ok.swa is None
        with pytest.raises(PoolError, match="has no 'swa' pool"):
            ok.k("swa", 0)
        with pytest.raises(PoolError, match="layer: 1 out of range"):
            ok.v("full", 1)
    finally:
        os.close(fd)


def _fields(info: P.PoolInfo) -> dict[str, Any]:
    return {f: getattr(info, f) for f in info.__struct_fields__}


@pytest.mark.cpu_only
def test_cuda_ipc_without_cuda_is_a_clear_error() -> None:
    info = P.PoolInfo(pool="full", kind="cuda_ipc", fd_index=-1, dtype="bfloat16",
                      shape=[1, 2, 2, 4, 1, 8], nbytes=256, device="cuda:0", handle=b"x")
    with pytest.raises(PoolError, match="needs torch with CUDA"):
        open_cuda_ipc(info)
    with pytest.raises(PoolError, match="needs torch with CUDA"):
        attach_pools("m", P.AttachResult(pools=[info]), [])


def test_receipt_errors_do_not_affect_attach(fake_daemon: Any) -> None:
    """An ordinary error just before attach leaves nothing unread in the socket."""
    with make_pools() as kv:
        base = handler_for(kv)
        d = fake_daemon(lambda req: P.error_frame(req.id, P.Code.BAD_RECEIPT, "no")
                        if isinstance(req, P.Unlock) else base(req))
        c = Client.from_socket(d.client_sock)
        with pytest.raises(ReceiptError):
            c.unlock("tiny", 1)
        with c.attach("tiny") as attached:
            assert attached.full.shape == kv.full.buffer.shape
