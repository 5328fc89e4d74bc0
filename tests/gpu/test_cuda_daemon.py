"""A real daemon whose model lives on a CUDA device: engines map its pools through CUDA IPC, KV
written on the GPU goes to the host tier (a memfd page-locked with cudaHostRegister) and comes
back byte-exact, a second engine process reads what the first wrote, and the key-addressed store's
mapped host pool round-trips pages to and from GPU tensors. Each daemon ends with a strict full
check (the fixture's teardown). Deselected where CUDA is missing; the same paths run on the CPU
device in tests/daemon."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest
import torch
from radixd_client import Client
from radixd_client.protocol import int32_list

from tests.harness import REPO, daemon_conftest

make_daemon = daemon_conftest().make_daemon  # the fixture itself, re-exported for this folder

P = 16
WINDOW = 32
CUDA_MODEL = {
    "name": "m", "page_size": P, "sliding_window": WINDOW, "num_full_layers": 2,
    "num_swa_layers": 2, "num_kv_heads": 2, "head_dim": 64, "dtype": "bfloat16",
    "device": "cuda", "full_pages": 64, "swa_pages": 32, "host_pages": 64,
    "host_swa_pages": 32,
}

pytestmark = pytest.mark.gpu


def seq(n_pages: int, base: int = 1) -> list[int]:
    return list(range(base, base + n_pages * P))


def fill(pools: Any, tokens: list[int], c: Client) -> dict[tuple[str, int], torch.Tensor]:
    """Allocate and insert ``tokens``, writing random KV on the GPU; returns it per page."""
    n = len(tokens) // P
    a = c.alloc("m", n)
    fp, sp = int32_list(a.full_pages), int32_list(a.swa_pages)
    kept: dict[tuple[str, int], torch.Tensor] = {}
    for i, (f, s) in enumerate(zip(fp, sp, strict=True)):
        pools.full[:, :, f] = torch.randn(pools.full[:, :, f].shape, device="cuda").to(
            pools.full.dtype)
        pools.swa[:, :, s] = torch.randn(pools.swa[:, :, s].shape, device="cuda").to(
            pools.swa.dtype)
        kept[("full", i)] = pools.full[:, :, f].clone()
        kept[("swa", i)] = pools.swa[:, :, s].clone()
    torch.cuda.synchronize()
    c.insert("m", tokens, fp, sp)
    return kept


def verify(pools: Any, result: Any, kept: dict[tuple[str, int], torch.Tensor]) -> int:
    torch.cuda.synchronize()
    fp, sp = int32_list(result.full_pages), int32_list(result.swa_pages)
    n = result.prefix_len // P
    assert len(fp) == n
    for i, f in enumerate(fp):
        assert torch.equal(pools.full[:, :, f], kept[("full", i)]), i
    for j, s in enumerate(sp):
        i = n - len(sp) + j
        assert torch.equal(pools.swa[:, :, s], kept[("swa", i)]), i
    return len(fp) + len(sp)


def wait_for(fn: Any, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if fn():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_cuda_device_host_device_round_trip(make_daemon, policy: str) -> None:
    d = make_daemon({"models": [{**CUDA_MODEL, "write_policy": policy}]})
    with Client(d.socket, timeout=30) as c:
        pools = c.attach("m")
        assert pools.full.device.type == "cuda" and pools.swa.device.type == "cuda"
        toks = seq(12)
        kept = fill(pools, toks, c)
        if policy == "write_through":
            wait_for(lambda: c.stats("m").models["m"]["tree_host_pages"] == 12, "host copy")
        ev = c.evict("m", full_pages=1000, swa_pages=1000)
        assert ev.full_pages == 12
        # scribble over the freed device pages: a load must copy the bytes back, not find them
        pools.full.zero_()
        pools.swa.zero_()
        torch.cuda.synchronize()
        m = c.match("m", toks)
        assert (m.prefix_len, m.host_hit_len) == (0, 12 * P)
        r = c.load("m", toks, lock=True)
        assert (r.prefix_len, r.loaded_len) == (12 * P, 12 * P)
        assert verify(pools, r, kept) == 12 + WINDOW // P
        c.unlock("m", r.receipt)


_READER = textwrap.dedent(
    """
    import json, sys
    import torch
    from radixd_client import Client
    from radixd_client.protocol import int32_list

    sock, tokens = sys.argv[1], json.loads(sys.argv[2])
    with Client(sock, timeout=30) as c:
        pools = c.attach("m")
        r = c.match("m", tokens, lock=True)
        fp = int32_list(r.full_pages)
        torch.cuda.synchronize()
        sums = [float(pools.full[:, :, f].float().sum()) for f in fp]
        c.unlock("m", r.receipt)
    print(json.dumps({"prefix_len": r.prefix_len, "sums": sums}), flush=True)
    """
)


def test_cuda_second_engine_process_reads_the_first_ones_kv(make_daemon) -> None:
    d = make_daemon({"models": [CUDA_MODEL]})
    with Client(d.socket, timeout=30) as c:
        pools = c.attach("m")
        toks = seq(6, base=1000)
        kept = fill(pools, toks, c)
        out = subprocess.run([sys.executable, "-c", _READER, d.socket, json.dumps(toks)],
                             capture_output=True, text=True, timeout=120, cwd=REPO, check=True)
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert got["prefix_len"] == 6 * P
        want = [float(kept[("full", i)].float().sum()) for i in range(6)]
        assert got["sums"] == want


def test_cuda_keyed_store_host_pool_round_trips_gpu_pages(make_daemon) -> None:
    """The engine copies between its GPU tensors and radixd's page-locked host pool mapped into
    its process (what the SGLang backend does with its own host pool)."""
    d = make_daemon({"models": [CUDA_MODEL]})
    with Client(d.socket, timeout=30) as a, Client(d.socket, timeout=30) as b:
        pa = a.kv_attach("m")
        r = a.kv_reserve("m", [b"k1", b"k2", b"k3"])
        assert r.pin and all(r.slots)
        nbytes = pa.page_nbytes["full"]
        src = torch.randint(0, 256, (3, nbytes), dtype=torch.uint8, device="cuda")
        for i, s in enumerate(r.slots):
            pa.pool("full")[s].copy_(src[i], non_blocking=True)
        torch.cuda.synchronize()
        a.kv_commit("m", r.pin)
        pb = b.kv_attach("m")
        got = b.kv_lookup("m", [b"k1", b"k2", b"k3"])
        assert got.present == b"\x01\x01\x01"
        dst = torch.empty_like(src)
        for i, s in enumerate(got.slots):
            dst[i].copy_(pb.pool("full")[s], non_blocking=True)
        torch.cuda.synchronize()
        b.kv_release("m", got.pin)
        assert torch.equal(dst, src)
