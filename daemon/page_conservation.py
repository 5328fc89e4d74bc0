"""Page conservation of one device pool, checked in bounded steps: every page is exactly one of
free, cached in the tree, or held by a session (the model cache's full check, between whose
steps requests are served)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from .gpu.allocator import TABLE_SCAN_STEP
from .tree import PageMarks

#: a page's count in the tree -> at most 2 (so that sums of a chunk's bytes never carry)
_AT_MOST_2 = bytes([0, 1] + [2] * 254)


def conserved_steps(name: str, alloc: Any, free: bytearray, in_tree: PageMarks,
                    holder: np.ndarray, counts: list[np.ndarray], v: list[str]
                    ) -> Iterator[None]:
    """Page conservation of one pool, a chunk of page ids at a time: every page but the padding
    page is exactly one of free (on a free list: ``free``), in the tree, held by a session (its
    number in ``holder``). Each chunk is one comparison of integers built from its bytes (free +
    tree count + held == 1, bytewise, with no carries); only a chunk that differs is looked at
    page by page. Appends to ``counts`` the pages held per session number."""
    cap = alloc.capacity
    outside: list[int] = []
    held_numbers = np.zeros(1, dtype=np.int64)
    for start in range(0, len(holder), TABLE_SCAN_STEP):
        chunk = holder[start:start + TABLE_SCAN_STEP]
        if chunk.min() < 0:  # never written so: a corrupted table, reported, not counted
            v.append(f"{name} pool: negative session numbers in the page table from {start}")
            chunk = np.maximum(chunk, 0)
        c = np.bincount(chunk)
        if len(c) > len(held_numbers):
            held_numbers = np.pad(held_numbers, (0, len(c) - len(held_numbers)))
        held_numbers[:len(c)] += c
        yield
    if holder[0]:
        v.append(f"{name} pool: the padding page 0 is held by session number {holder[0]}")
    counts.append(held_numbers)
    n_held = int(held_numbers[1:].sum())
    tree = in_tree.counts
    if len(tree) > cap and tree.count(0, cap) != len(tree) - cap:
        outside += [p for p in range(cap, len(tree)) if tree[p]]
    found: dict[str, list[int]] = {"free and in the tree": [], "free and held by a session": [],
                                   "in the tree and held by a session": [], "unaccounted": []}
    step = 16384  # bytes compared at C speed; a chunk that differs is looked at one by one
    for start in range(1, cap, step):
        end = min(cap, start + step)
        t = bytes(tree[start:end]).ljust(end - start, b"\0").translate(_AT_MOST_2)
        h = (holder[start:end] != 0).tobytes()
        f = free[start:end]
        if (int.from_bytes(t, "little") + int.from_bytes(h, "little")
                + int.from_bytes(f, "little") != int.from_bytes(b"\1" * (end - start), "little")):
            for i in range(end - start):
                ff, tt, hh = f[i], min(t[i], 1), h[i]
                for label, hit in (("free and in the tree", ff and tt),
                                   ("free and held by a session", ff and hh),
                                   ("in the tree and held by a session", tt and hh),
                                   ("unaccounted", not (ff or tt or hh))):
                    if hit:
                        found[label].append(start + i)
        yield
    for label, pages in found.items():
        if pages and label != "unaccounted":
            v.append(f"{name} pool: pages {pages[:10]} are {label}")
    listed = free.count(1)
    total = listed + len(in_tree) + n_held
    if total != alloc.usable or found["unaccounted"] or outside:
        v.append(f"{name} pool: free {listed} + tree {len(in_tree)} + held "
                 f"{n_held} != capacity {alloc.usable}; unaccounted "
                 f"{found['unaccounted'][:10]}, outside the pool {sorted(outside)[:10]}")
