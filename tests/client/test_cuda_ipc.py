"""CUDA IPC attach: a producer process exports a CUDA pool, this process opens and writes it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from radixd_client import protocol as P

_PRODUCER = textwrap.dedent(
    """
    import json, sys
    import torch
    from radixd_client.pools import contiguous_strides, export_cuda_ipc_handle

    shape = [2, 2, 8, 4, 2, 16]
    pool = torch.zeros(shape, dtype=torch.bfloat16, device="cuda:0")
    pool[1, 0, 3] = 2.0
    desc = {"version": 1, "storage": "cuda", "device": "cuda:0", "dtype": "bfloat16",
            "shape": shape, "strides": list(contiguous_strides(shape)),
            "nbytes": pool.numel() * 2}
    print(json.dumps({"handle": export_cuda_ipc_handle(pool).hex(), "desc": desc}), flush=True)
    sys.stdin.readline()  # the consumer has written
    torch.cuda.synchronize()
    print(json.dumps({"written": float(pool[0, 1, 5].float().sum())}), flush=True)
    sys.stdin.readline()  # keep the memory alive until the consumer is done
    """
)


@pytest.mark.gpu
def test_cuda_ipc_attach() -> None:
    import torch
    from radixd_client.pools import attach_pools

    proc = subprocess.Popen([sys.executable, "-c", _PRODUCER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        first = json.loads(proc.stdout.readline())
        desc = first["desc"]
        info = P.PoolInfo(pool="full", kind="cuda_ipc", fd_index=-1, dtype="bfloat16",
                          shape=desc["shape"], nbytes=desc["nbytes"], device="cuda:0",
                          description=desc, handle=bytes.fromhex(first["handle"]))
        pools = attach_pools("m", P.AttachResult(pools=[info]), [])
        assert pools.full.device.type == "cuda"
        assert float(pools.full[1, 0, 3].float().sum()) == 2.0 * 4 * 2 * 16
        pools.v("full", 0)[5].fill_(1.0)
        torch.cuda.synchronize()
        proc.stdin.write("\n")
        proc.stdin.flush()
        second = json.loads(proc.stdout.readline())
        assert second["written"] == 1.0 * 4 * 2 * 16
        pools.close()
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
