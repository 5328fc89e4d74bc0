"""Who should copy the pages between SGLang's host pool and radixd's: the engine, or the daemon?

Issue 12 left two ways to move page bytes without the socket:

- **engine copies** (what ``radixd-sglang`` does): radixd's host pool is a memfd that the engine
  maps (``kv_attach``); a ``kv_lookup`` pins the pages, the engine copies them into its own host
  pool, a ``kv_release`` unpins them;
- **daemon copies**: SGLang runs with its shm host-pool allocator (``"allocator": "shm"``), hands
  that memory to radixd once (SCM_RIGHTS), and each get becomes one request after which the
  daemon has copied the pages into the engine's pool.

Both are a memcpy between two shared mappings; what differs is the process that does it and the
round trip around it. This measures both on the same bytes in one run, with plain processes
standing for the two sides (no daemon logic: the figure is the copy path itself): a "daemon"
process owning one memfd pool and an "engine" process owning another, each mapping the other's
as the path needs, with a Unix socket for the request. Page geometry as in
``bench/sglang_bench.py`` (36 layers, 8 KV heads, head dim 128, bf16, page 64: 9 MiB a page).

    python bench/sglang_copy_paths.py [--pages 32] [--reps 5]
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import socket
import struct
import time

import torch

PAGE_BYTES = 2 * 36 * 8 * 128 * 2 * 64  # K and V, 36 layers, 8 heads, dim 128, bf16, page 64


def _pool(name: str, pages: int) -> tuple[int, torch.Tensor]:
    fd = os.memfd_create(name)
    os.ftruncate(fd, pages * PAGE_BYTES)
    mm = mmap.mmap(fd, pages * PAGE_BYTES)
    t = torch.frombuffer(mm, dtype=torch.uint8).view(pages, PAGE_BYTES)
    t.fill_(1)  # touched: neither side pays first-touch faults inside the timing
    return fd, t


def _map(fd: int, pages: int) -> torch.Tensor:
    mm = mmap.mmap(fd, pages * PAGE_BYTES)
    return torch.frombuffer(mm, dtype=torch.uint8).view(pages, PAGE_BYTES)


def _daemon(sock: socket.socket, pages: int) -> None:
    """Owns the store's pool; on request copies pages into the engine's pool it was handed."""
    torch.set_num_threads(1)
    fd, store = _pool("store", pages)
    socket.send_fds(sock, [b"s"], [fd])  # for the engine-copies path (kv_attach)
    _, fds, _, _ = socket.recv_fds(sock, 1, 1)  # the engine's shm pool (daemon-copies path)
    engine = _map(fds[0], pages)
    while True:
        head = sock.recv(4)
        if not head:
            return
        n = struct.unpack("<I", head)[0]
        engine[:n].copy_(store[:n])  # one request: copy n pages, then answer
        sock.sendall(b"k")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pages", type=int, default=32, help="pages per get (9 MiB each)")
    ap.add_argument("--reps", type=int, default=5, help="best of this many")
    args = ap.parse_args()
    torch.set_num_threads(1)
    n = args.pages
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = mp.get_context("spawn").Process(target=_daemon, args=(theirs, n))
    proc.start()
    _, fds, _, _ = socket.recv_fds(mine, 1, 1)
    store = _map(fds[0], n)  # radixd's host pool, mapped by the engine (kv_attach)
    fd, own = _pool("engine", n)  # SGLang's host pool (shm allocator)
    socket.send_fds(mine, [b"e"], [fd])

    def engine_copies() -> None:
        own[:n].copy_(store[:n])

    def daemon_copies() -> None:
        mine.sendall(struct.pack("<I", n))
        assert mine.recv(1) == b"k"

    results = {}
    for name, fn in (("engine copies (radixd-sglang)", engine_copies),
                     ("daemon copies (shm allocator)", daemon_copies),
                     ("engine copies (again)", engine_copies),
                     ("daemon copies (again)", daemon_copies)):
        best = min(_timed(fn) for _ in range(args.reps))
        results[name] = n * PAGE_BYTES / best / 1e9
    mine.close()
    proc.join(10)
    e = max(results["engine copies (radixd-sglang)"], results["engine copies (again)"])
    dm = max(results["daemon copies (shm allocator)"], results["daemon copies (again)"])
    print(f"{n} pages of {PAGE_BYTES} B ({n * PAGE_BYTES / 2**20:.0f} MiB) a get, best of "
          f"{args.reps}, one copy thread each")
    print(f"engine copies  {e:6.2f} GB/s")
    print(f"daemon copies  {dm:6.2f} GB/s   daemon/engine {dm / e:.2f}")


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
