"""Micro-benchmark of the radix tree core: match, lock/unlock, insert, evict, memory per token.

Usage (from the repository root)::

    python bench/tree_bench.py [--quick] [--json out.json]
    python bench/tree_bench.py --baseline REF [--page-sizes 1,16,64] [--quick]

Every figure is measured twice, for page_size 64 and for page_size 1, both with a sliding window
of 128 tokens; the figure names carry the suffix ``_p64`` / ``_p1``. Times are per call, taken
with ``time.perf_counter_ns`` around the one tree call (nothing else in the timed region), after a
warm-up, with the garbage collector off during the timing loops.

The cached state is shaped like a chat/agent server's: 8 system prompts of 1024 tokens, a few
hundred 4096-token sequences behind them (a quarter are second turns that share their first 2048
tokens with an earlier sequence), a few 32768-token documents, and a third of the sequences
inserted with ``swa_evicted_len`` (their decode freed the SWA KV below the last window), so
matches walk across SWA tombstones. Sequences enter the tree the way an engine puts them there:
match+lock, allocate pages for the uncached part, insert, unlock.

The daemon compacts cold nodes' page ids while idle (docs/design.md): ``idle_compact_*`` time
that pass on the populated tree, ``match_4k_cold`` / ``match_4k_rewarmed`` the first and the
next match through nodes it compacted; bytes per cached token is measured after it, and
``bytes_per_cached_token_with_host`` again with a host copy of every node (write-through, with
SWA windows). ``match_4k_host`` times a match whose path is on host only (every device page
evicted after the copies): what a scheduler asks before a load.

``--baseline REF`` compares with the tree of git ``REF`` (``daemon/tree`` exported with ``git
archive`` and imported under another name) in this process: both trees populated alike, then
insert_4k, match_4k_churn and lock_unlock_churn timed on each in turns, operation by operation
(separate runs on this shared machine moved by up to 1.7x between runs of the same code), and
bytes per cached token of each, and match_4k_host on each in turns; it prints them side by
side with the ratio.

``run(quick, extra=None)`` returns the flat dict of figures (``extra``: a zero-argument callable
returning more figures to merge in, e.g. the multi-turn replay); ``main(argv)`` also prints the
table and writes ``--json``.
"""

from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import argparse  # noqa: E402
import gc  # noqa: E402
import importlib.util  # noqa: E402
import inspect  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
import tracemalloc  # noqa: E402
from array import array  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

from bench._common import export_ref, write_json  # noqa: E402
from daemon.gpu.allocator import PageAllocator, PairedAllocator  # noqa: E402
from daemon.gpu.page_runs import PageRunList, PageRuns, cold_after_tokens  # noqa: E402
from daemon.tree import RadixTree  # noqa: E402
from daemon.tree.page_ids import LeadingZeros  # noqa: E402

WINDOW = 128
PAGE_SIZES = (64, 1)
NS = "bench"
VOCAB = 151_000  # token ids drawn from [1, VOCAB)
SYS_LEN = 1024  # shared system prompt
N_SYS = 8
SEQ_LEN = 4096
TURN2_SHARED = 2048  # a second turn shares this much with its first turn
LONG_LEN = 32768
MEM_TOKENS = 1_000_000  # cached (distinct) tokens for bytes_per_cached_token
MEM_TOKENS_P1_QUICK = 250_000
ORDER = [  # table order of the figures of one page size
    "match_4k_p50_us", "match_4k_p99_us", "match_4k_churn_p50_us", "match_32k_p50_us",
    "lock_unlock_p50_us", "lock_unlock_churn_p50_us", "insert_4k_p50_us",
    "insert_4k_trusted_p50_us", "evict_page_p50_us", "idle_compact_nodes",
    "idle_compact_us_per_node", "match_4k_cold_p50_us", "match_4k_rewarmed_p50_us",
    "match_4k_host_p50_us",
    "bytes_per_cached_token", "bytes_per_cached_token_ntokens",
    "bytes_per_cached_token_with_host",
]


# ---------------------------------------------------------------------------------------- sizes


@dataclass(frozen=True)
class Sizes:
    populated_seqs: int  # 4k sequences in the tree that match/lock/insert run against
    populated_long: int  # 32k sequences in it
    match_4k_iters: int
    match_32k_iters: int
    lock_iters: int
    insert_iters: dict[int, int]  # per page size
    evict_seqs: int  # 4k sequences in the tree that is evicted
    mem_tokens: dict[int, int]  # per page size
    warmup: int


QUICK = Sizes(
    populated_seqs=240, populated_long=4, match_4k_iters=10000, match_32k_iters=1000,
    lock_iters=10000, insert_iters={64: 1000, 16: 500, 1: 150}, evict_seqs=256,
    mem_tokens={64: MEM_TOKENS, 16: MEM_TOKENS, 1: MEM_TOKENS_P1_QUICK}, warmup=200,
)
FULL = Sizes(
    populated_seqs=320, populated_long=8, match_4k_iters=30000, match_32k_iters=4000,
    lock_iters=30000, insert_iters={64: 5000, 16: 2000, 1: 600}, evict_seqs=768,
    mem_tokens={64: MEM_TOKENS, 16: MEM_TOKENS, 1: MEM_TOKENS}, warmup=1000,
)


# ---------------------------------------------------------------------------------------- workload


class Workload:
    """Deterministic token sequences with shared prefixes (int32 little-endian bytes)."""

    def __init__(self, page_size: int, seed: int = 1):
        self.P = page_size
        self.rng = random.Random(seed)
        self.sys = [self.rand(SYS_LEN) for _ in range(N_SYS)]
        self.k = 0
        self.firsts: list[bytes] = []  # first turns, for second turns to continue

    def rand(self, n: int) -> bytes:
        return array("i", self.rng.choices(range(1, VOCAB), k=n)).tobytes()

    def swa_frontier(self, n_tokens: int) -> int:
        """swa_evicted_len of a request whose decode freed the SWA below its last window."""
        return max(0, (n_tokens - WINDOW) // self.P * self.P)

    def next_seq(self) -> tuple[bytes, int]:
        """(tokens, swa_evicted_len) of the next 4k sequence."""
        k = self.k
        self.k += 1
        if k >= 2 * N_SYS and k % 4 == 3 and self.firsts:
            first = self.firsts[self.rng.randrange(len(self.firsts))]
            toks = first[: TURN2_SHARED * 4] + self.rand(SEQ_LEN - TURN2_SHARED)
        else:
            toks = self.sys[k % N_SYS] + self.rand(SEQ_LEN - SYS_LEN)
            self.firsts.append(toks)
            if len(self.firsts) > 64:
                self.firsts.pop(0)
        # the first sequence behind each system prompt is live; then every third one is tombstoned
        tomb = k >= N_SYS and k % 3 == 2
        return toks, (self.swa_frontier(len(toks) // 4) if tomb else 0)

    def long_seq(self, i: int) -> tuple[bytes, int]:
        toks = self.sys[i % N_SYS] + self.rand(LONG_LEN - SYS_LEN)
        return toks, (self.swa_frontier(LONG_LEN) if i % 2 else 0)

    def fresh_4k(self, i: int) -> bytes:
        return self.sys[i % N_SYS] + self.rand(SEQ_LEN - SYS_LEN)


def new_tree(tree_cls: type, page_size: int, alloc: PairedAllocator) -> RadixTree:
    """A tree built as the daemon builds it (daemon/model_cache.py): cold nodes keep their page
    ids as runs, where the tree takes a codec for them (a baseline tree older than that does
    not)."""
    if "page_ids" not in inspect.signature(tree_cls).parameters:
        return tree_cls(page_size, WINDOW, alloc)
    tree = tree_cls(page_size, WINDOW, alloc, page_ids=PageRuns())
    tree.compact_after = cold_after_tokens(alloc.full.capacity, page_size)
    return tree


def idle(tree: RadixTree) -> None:
    """What the daemon does while no request waits: cold nodes' page ids to their runs (a tree
    older than that has nothing to do)."""
    if hasattr(tree, "compact_cold"):
        while tree.compact_cold(len(tree.nodes), len(tree.nodes)):
            pass


def _alloc(tree: RadixTree, alloc: PairedAllocator, n: int) -> tuple[array, array]:
    """n pages of each pool, evicting cached pages first if a pool is short (as ModelCache.alloc
    does)."""
    need_full = max(0, n - alloc.full.available)
    need_swa = max(0, n - alloc.swa.available)
    if need_full or need_swa:
        tree.evict(need_full, need_swa, reason="alloc")
    return alloc.alloc(n)


def engine_insert(tree: RadixTree, alloc: PairedAllocator, tokens: bytes, swa_evicted_len: int
                  ) -> int:
    """Put a finished request into the tree as an engine would; returns the matched prefix."""
    P = tree.page_size
    n = len(tokens) // 4 // P
    m = tree.match(NS, tokens, lock=True)
    prev = m.prefix_len // P
    full, swa = _alloc(tree, alloc, n - prev)
    f = min(swa_evicted_len // P, n)
    z = max(0, f - prev)
    if z:  # the decode already gave these SWA pages back
        alloc.free_swa(swa[:z])
        swa[:z] = array("i", bytes(4 * z))
    res = tree.insert(NS, tokens, full, swa, prev * P, swa_evicted_len)
    left = res.inserted_len // P - prev
    if left < n - prev:  # pages the tree did not take stay the caller's
        alloc.free_full(full[left:])
        rest = array("i", (p for p in swa[left:] if p))
        if rest:
            alloc.free_swa(rest)
    tree.unlock(m.receipt)
    return m.prefix_len


@dataclass
class Populated:
    tree: RadixTree
    alloc: PairedAllocator
    wl: Workload
    seqs: list[bytes] = field(default_factory=list)  # cached 4k sequences
    longs: list[bytes] = field(default_factory=list)  # cached 32k sequences


def populate(page_size: int, n_seqs: int, n_long: int, headroom: float = 1.3,
             seed: int = 1, tree_cls: type = RadixTree) -> Populated:
    """A tree holding n_seqs 4k sequences and n_long 32k ones, in a pool with some headroom."""
    P = page_size
    # distinct pages: system prompts, 3k (first turns) or 2k (second turns) per sequence, longs
    est = N_SYS * SYS_LEN + n_seqs * (SEQ_LEN - SYS_LEN) + n_long * (LONG_LEN - SYS_LEN)
    cap = int(est * headroom) // P + 2 * LONG_LEN // P + 2
    alloc = PairedAllocator(cap, cap)
    tree = new_tree(tree_cls, P, alloc)
    wl = Workload(P, seed)
    pop = Populated(tree, alloc, wl)
    for i in range(n_seqs):
        toks, f = wl.next_seq()
        engine_insert(tree, alloc, toks, f)
        pop.seqs.append(toks)
        if n_long and i % max(1, n_seqs // n_long) == n_seqs // (2 * n_long):
            j = len(pop.longs)
            if j < n_long:
                ltoks, lf = wl.long_seq(j)
                engine_insert(tree, alloc, ltoks, lf)
                pop.longs.append(ltoks)
    while len(pop.longs) < n_long:
        ltoks, lf = wl.long_seq(len(pop.longs))
        engine_insert(tree, alloc, ltoks, lf)
        pop.longs.append(ltoks)
    return pop


def cached_tokens(tree: RadixTree) -> int:
    return tree.device_pages()[0] * tree.page_size


# ---------------------------------------------------------------------------------------- timing


def _pct(samples: list[int], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of nanosecond samples, in microseconds."""
    s = sorted(samples)
    i = min(len(s) - 1, max(0, int(round(q / 100 * len(s) + 0.5)) - 1))
    return s[i] / 1000.0


def _usable(tree: RadixTree, seqs: list[bytes], want: int) -> list[bytes]:
    """The sequences whose whole length matches (the cached prompts to time)."""
    out = [t for t in seqs if tree.match(NS, t).prefix_len == want]
    if not out:
        raise RuntimeError(f"no cached prompt of {want} tokens matches in full")
    return out


def bench_idle(pop: Populated) -> dict[str, float]:
    """What the daemon's idle work (:func:`idle`) costs and what it does to a match, on the
    populated tree:

    - ``idle_compact_nodes`` and ``idle_compact_us_per_node``: the nodes whose page ids the idle
      pass compacted, and its time per node (event-loop time the daemon spends only while no
      request waits); absent for a tree without that work;
    - ``match_4k_cold_p50_us``: the first match of one of the oldest cached 4k sequences after
      the pass (the first use of nodes long unused: recency updates, memory not in the CPU's
      caches, and where compacted, ids listed from their runs and expanded back to arrays), and
      ``match_4k_rewarmed_p50_us``: the next match of the same sequences. A baseline tree gives
      both too, so the difference that compaction makes is the ratio of the cold figures.
    """
    tree = pop.tree
    out: dict[str, float] = {}
    if hasattr(tree, "compact_cold"):
        before = tree.stats["compacted_nodes"]
        t = time.perf_counter_ns()
        idle(tree)
        spent = time.perf_counter_ns() - t
        compacted = tree.stats["compacted_nodes"] - before
        out["idle_compact_nodes"] = float(compacted)
        if compacted:
            out["idle_compact_us_per_node"] = spent / compacted / 1000
    # the oldest sequences are the cold ones: a match of each, twice, in the same order (those
    # cached whole count)
    clock = time.perf_counter_ns
    times: list[list[int]] = [[], []]
    gc.disable()
    for s in pop.seqs[:200]:
        for rnd in (0, 1):
            t0 = clock()
            r = tree.match(NS, s)
            times[rnd].append(clock() - t0)
        if r.prefix_len != SEQ_LEN:
            del times[0][-1], times[1][-1]
    gc.enable()
    if times[0]:
        out["match_4k_cold_p50_us"] = _pct(times[0], 50)
        out["match_4k_rewarmed_p50_us"] = _pct(times[1], 50)
    return out


def bench_match(pop: Populated, sz: Sizes) -> dict[str, float]:
    """match_4k_p50/p99, match_32k_p50: tree.match of a cached prompt, rotating over them."""
    tree = pop.tree
    match = tree.match
    out: dict[str, float] = {}
    for name, seqs, want, iters in (
        ("match_4k", pop.seqs, SEQ_LEN, sz.match_4k_iters),
        ("match_32k", pop.longs, LONG_LEN, sz.match_32k_iters),
    ):
        prompts = _usable(tree, seqs, want)
        k = len(prompts)
        for i in range(sz.warmup):
            match(NS, prompts[i % k])
        samples = [0] * iters
        clock = time.perf_counter_ns
        gc.collect()
        gc.disable()
        try:
            for i in range(iters):
                t = prompts[i % k]
                t0 = clock()
                match(NS, t)
                samples[i] = clock() - t0
        finally:
            gc.enable()
        out[f"{name}_p50_us"] = _pct(samples, 50)
        if name == "match_4k":
            out[f"{name}_p99_us"] = _pct(samples, 99)
        r = match(NS, prompts[0])
        assert r.prefix_len == want, (name, r.prefix_len)
    return out


def bench_lock(pop: Populated, sz: Sizes) -> dict[str, float]:
    """lock_unlock: tree.lock(node_id) + tree.unlock(receipt) on the end of a cached 4k path."""
    tree = pop.tree
    prompts = _usable(tree, pop.seqs, SEQ_LEN)
    ids = [tree.match(NS, t).node_id for t in prompts]
    k = len(ids)
    lock, unlock = tree.lock, tree.unlock
    for i in range(sz.warmup):
        unlock(lock(ids[i % k]))
    samples = [0] * sz.lock_iters
    clock = time.perf_counter_ns
    gc.collect()
    gc.disable()
    try:
        for i in range(sz.lock_iters):
            nid = ids[i % k]
            t0 = clock()
            unlock(lock(nid))
            samples[i] = clock() - t0
    finally:
        gc.enable()
    return {"lock_unlock_p50_us": _pct(samples, 50)}


def bench_insert(pop: Populated, sz: Sizes) -> dict[str, float]:
    """insert_4k: tree.insert of a fresh 4k sequence behind a cached 1k system prompt.

    Outside the timed region, as the engine would: match+lock the prefix, allocate the pages for
    the new 3k tokens (evicting old cached sequences when the pool is short), and afterwards
    unlock. The pool is bounded, so the tree stays at a steady size.

    The same loop also times a match of a hot cached 4k prompt and a lock+unlock of its end
    (``*_churn`` figures): one of each per insert, the mix of a serving engine, where every match
    follows some insert (the tight loops of bench_match/bench_lock never see the recency clock
    move between calls).
    """
    tree, alloc, wl = pop.tree, pop.alloc, pop.wl
    P = tree.page_size
    n = SEQ_LEN // P
    iters = sz.insert_iters[P]
    warm = min(sz.warmup, max(10, iters // 5))
    hot = _usable(tree, pop.seqs, SEQ_LEN)[:16]
    ins: list[int] = []
    mat: list[int] = []
    lck: list[int] = []
    prefix_misses = hot_misses = 0
    clock = time.perf_counter_ns
    match, lock, unlock, insert = tree.match, tree.lock, tree.unlock, tree.insert
    # every other insert as ModelCache makes it (ids already checked), where the tree can
    # be told so; ``trusted`` is absent from baseline trees older than it
    can_trust = "trusted" in inspect.signature(insert).parameters
    ins_trusted: list[int] = []
    gc.collect()
    for i in range(warm + iters):
        toks = wl.fresh_4k(i)
        h = hot[i % len(hot)]
        gc.disable()
        t0 = clock()
        r = match(NS, h)
        t1 = clock()
        nid = r.node_id
        t2 = clock()
        unlock(lock(nid))
        t3 = clock()
        gc.enable()
        m = match(NS, toks, lock=True)
        prev = m.prefix_len // P
        full, swa = _alloc(tree, alloc, n - prev)
        gc.disable()
        trusted = can_trust and i % 2 == 1
        t4 = clock()
        if trusted:
            res = insert(NS, toks, full, swa, prev * P, 0, trusted=True)
        else:
            res = insert(NS, toks, full, swa, prev * P, 0)
        t5 = clock()
        gc.enable()
        unlock(m.receipt)
        assert res.inserted_len == SEQ_LEN
        if i >= warm:
            (ins_trusted if trusted else ins).append(t5 - t4)
            mat.append(t1 - t0)
            lck.append(t3 - t2)
            prefix_misses += m.prefix_len < SYS_LEN
            hot_misses += r.prefix_len != SEQ_LEN
    if prefix_misses or hot_misses:
        print(f"  note: p{P} insert loop: {prefix_misses}/{len(ins)} inserts did not reuse the 1k "
              f"prefix, {hot_misses}/{len(ins)} hot matches were short", file=sys.stderr)
    out = {"insert_4k_trusted_p50_us": _pct(ins_trusted, 50)} if ins_trusted else {}
    return out | {
        "insert_4k_p50_us": _pct(ins, 50),
        "match_4k_churn_p50_us": _pct(mat, 50),
        "lock_unlock_churn_p50_us": _pct(lck, 50),
    }


def bench_evict(page_size: int, sz: Sizes, tree_cls: type = RadixTree) -> dict[str, float]:
    """evict_page: tree.evict(full_pages=N) over a large populated tree, per page freed.

    N is 16384 tokens' worth of pages (a few LRU leaves per call); batches stop when a tenth of
    the tree is left, so every timed call works on a large tree.
    """
    pop = populate(page_size, sz.evict_seqs, 0, headroom=1.05, seed=2, tree_cls=tree_cls)
    tree = pop.tree
    batch = 16384 // page_size
    start = tree.device_pages()[0]
    per_page: list[int] = []
    clock = time.perf_counter_ns
    gc.collect()
    gc.disable()
    try:
        while tree.device_pages()[0] > start // 10:
            t0 = clock()
            res = tree.evict(full_pages=batch)
            dt = clock() - t0
            if res.full_pages == 0:
                break
            per_page.append(dt // res.full_pages)
    finally:
        gc.enable()
    return {"evict_page_p50_us": _pct(per_page, 50)}


def ids_bytes(ids: Sequence[int]) -> int:
    """Page ids of a node: an array's payload, or the whole of a compact form (a range, a
    PageRunList with its two arrays of bounds, host SWA ids without their leading zeros)."""
    if isinstance(ids, array):
        return 4 * len(ids)
    if isinstance(ids, LeadingZeros):
        return sys.getsizeof(ids) + 4 * len(ids.tail)
    if isinstance(ids, PageRunList):
        return sys.getsizeof(ids) + sys.getsizeof(ids.starts) + sys.getsizeof(ids.ends)
    return sys.getsizeof(ids)


def held_bytes(tree: RadixTree, allocs: list[PageAllocator]) -> dict[str, int]:
    """The payload bytes the tree and its allocators keep, by kind (what bytes per cached token
    is made of before object headers and slack): token ids, block hashes, page ids of each pool
    and host slot ids in the nodes, and the allocators' state bytes and free lists."""
    nodes = list(tree.nodes.values())
    return {
        "token ids": sum(len(n.tokens) for n in nodes),
        "hashes": sum(len(n.hashes) for n in nodes),
        "full ids": sum(ids_bytes(n.full) for n in nodes if n.full is not None),
        "SWA ids": sum(ids_bytes(n.swa) for n in nodes if n.swa is not None),
        "host ids": sum(ids_bytes(n.host) for n in nodes
                        if n.host is not None and n.parent is not None),
        "host SWA ids": sum(ids_bytes(n.host_swa) for n in nodes if n.host_swa is not None),
        "allocator states": sum(a.capacity for a in allocs),
        # (a baseline's allocators list every free page)
        "allocator free lists": sum(getattr(a, "free_list_bytes", 4 * a.available)
                                    for a in allocs),
    }


def copy_to_host(tree: RadixTree, host: PageAllocator, host_swa: PageAllocator) -> None:
    """What write-through leaves: a host copy of every node on device (parents first, as the
    tiers make them: host copies are prefix-closed), with SWA copies of the trailing window of
    a node whose SWA is live (daemon/tier_jobs.py ``plan_backup``: 0 for the other pages)."""
    stack = [ns.root for ns in tree.namespaces.values()]
    wp = tree.window_pages
    while stack:
        n = stack.pop()
        if n.parent is not None and n.full is not None and n.host is None:
            k = len(n.full)
            swa = None
            if n.swa is not None:
                swa = array("i", bytes(4 * max(0, k - wp)))
                swa += host_swa.alloc(min(k, wp))
            tree.set_host(n.id, host.alloc(k), swa)
        if n.host is not None and n.children:
            stack.extend(n.children.values())


def host_hit_tree(page_size: int, tree_cls: type) -> tuple[RadixTree, list[bytes]]:
    """200 cached 4k sequences backed up to host as write-through does (with SWA windows),
    every device page then evicted: a tree whose every node is on host only, and the
    sequences."""
    P = page_size
    wl = Workload(P, seed=5)
    n = 200
    cap = (n + 2) * SEQ_LEN // P + 2
    alloc = PairedAllocator(cap, cap)
    tree = new_tree(tree_cls, P, alloc)
    host, host_swa = PageAllocator(cap, "host pool"), PageAllocator(cap // 4, "host SWA pool")
    seqs = []
    for _ in range(n):
        toks, f = wl.next_seq()
        engine_insert(tree, alloc, toks, f)
        copy_to_host(tree, host, host_swa)
        seqs.append(toks)
    idle(tree)
    tree.evict(full_pages=tree.full_evictable)
    return tree, seqs


def bench_host_hits(page_size: int, classes: dict[str, type]) -> dict[str, dict[str, float]]:
    """``match_4k_host_p50_us`` per side of ``classes``: a match of a sequence whose pages are
    all on host (:func:`host_hit_tree`), what a scheduler asks before a load. The SWA rule reads
    each node's host SWA ids, thousands a node at a page of one token. The trees are matched in
    turns, each sequence on every side, after a warm-up pass of the same."""
    built = {side: host_hit_tree(page_size, cls) for side, cls in classes.items()}
    seqs = next(iter(built.values()))[1]  # one seed: the same sequences on every side
    clock = time.perf_counter_ns
    times: dict[str, list[int]] = {side: [] for side in built}
    gc.disable()
    for timed in (False, True):
        for s in seqs:
            for side, (tree, _) in built.items():
                t0 = clock()
                tree.match(NS, s)
                if timed:
                    times[side].append(clock() - t0)
    gc.enable()
    return {side: {"match_4k_host_p50_us": _pct(t, 50)} for side, t in times.items()}


def bench_memory(page_size: int, tokens: int, tree_cls: type = RadixTree, host: bool = False
                 ) -> dict[str, float]:
    """bytes_per_cached_token: tracemalloc snapshot difference around building tree+allocators.

    Tokens ids, page hashes, page ids, nodes, queues, allocator state; no KV tensors (no pools).
    The pools are sized to the content (plus one sequence), the SWA pool as large as the full one.
    Divided by the distinct tokens cached on device. Measured after the daemon's idle work (cold
    nodes' page ids kept as runs; nodes used within the last half pool of churn keep arrays).
    ``host``: every node also has a host copy (write-through, the daemon's default), from a host
    pool as large as the full one, with SWA copies of its trailing window from a host SWA pool a
    quarter of that (the ratio of the daemon's defaults): bytes_per_cached_token_with_host.
    """
    P = page_size
    wl = Workload(P, seed=3)  # its system prompts exist before the first snapshot
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        cap = (tokens + 2 * SEQ_LEN) // P + 2
        alloc = PairedAllocator(cap, cap)
        host_pool = PageAllocator(cap, "host pool") if host else None
        # a quarter of the host pool, as the daemon's defaults (host_pages, host_swa_pages)
        host_swa_pool = PageAllocator(cap // 4, "host SWA pool") if host else None
        tree = new_tree(tree_cls, P, alloc)
        while cached_tokens(tree) < tokens:
            toks, f = wl.next_seq()
            engine_insert(tree, alloc, toks, f)
            if host_pool is not None:
                copy_to_host(tree, host_pool, host_swa_pool)  # type: ignore[arg-type]
        idle(tree)
        del toks
        wl.firsts.clear()  # the workload's own copies of first turns are not the tree's
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    stats = after.compare_to(before, "filename")
    total = sum(s.size_diff for s in stats)
    n_tok = cached_tokens(tree)
    by_file = {}
    for s in stats:
        name = os.path.basename(s.traceback[0].filename)
        by_file[name] = by_file.get(name, 0) + s.size_diff
    top = sorted(by_file.items(), key=lambda kv: -kv[1])[:5]
    label = f"p{P} memory{' with host copies' if host else ''}"
    print(f"  {label}: {total / 1e6:.1f} MB for {n_tok} cached tokens, {len(tree.nodes)} "
          "nodes; by allocating file: "
          + ", ".join(f"{k} {v / n_tok:.2f}" for k, v in top) + " B/token", file=sys.stderr)
    allocs = [a for a in (alloc.full, alloc.swa, host_pool, host_swa_pool) if a is not None]
    held = held_bytes(tree, allocs)
    print(f"  {label}: what is held: "
          + ", ".join(f"{k} {v / n_tok:.2f}" for k, v in held.items())
          + f", the rest (objects, headers, slack) {(total - sum(held.values())) / n_tok:.2f} "
          "B/token", file=sys.stderr)
    del tree, alloc, allocs, host_pool, host_swa_pool
    if host:
        return {"bytes_per_cached_token_with_host": total / n_tok}
    return {"bytes_per_cached_token": total / n_tok, "bytes_per_cached_token_ntokens": n_tok}


# ---------------------------------------------------------------------------------------- driver


def run_page_size(page_size: int, sz: Sizes, tree_cls: type = RadixTree) -> dict[str, float]:
    t = time.perf_counter()
    pop = populate(page_size, sz.populated_seqs, sz.populated_long, tree_cls=tree_cls)
    print(f"  p{page_size}: populated {len(pop.tree.nodes)} nodes, "
          f"{cached_tokens(pop.tree)} cached tokens in {time.perf_counter() - t:.1f} s",
          file=sys.stderr)
    out: dict[str, float] = {}
    out.update(bench_match(pop, sz))
    out.update(bench_lock(pop, sz))
    out.update(bench_insert(pop, sz))
    out.update(bench_idle(pop))
    del pop
    out.update(bench_evict(page_size, sz, tree_cls))
    out.update(bench_memory(page_size, sz.mem_tokens[page_size], tree_cls))
    out.update(bench_memory(page_size, sz.mem_tokens[page_size], tree_cls, host=True))
    out.update(bench_host_hits(page_size, {"this": tree_cls})["this"])
    print(f"  p{page_size}: done in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    keys = sorted(out, key=lambda k: ORDER.index(k) if k in ORDER else len(ORDER))
    return {f"{k}_p{page_size}": out[k] for k in keys}


def run(quick: bool, extra: Callable[[], dict[str, float]] | None = None) -> dict[str, float]:
    """All figures, flat: ``{name_p64: value, name_p1: value, ...}``.

    ``extra``: a zero-argument callable returning more figures (e.g. the multi-turn replay,
    plugged in by its owner); they are merged in last.
    """
    sz = QUICK if quick else FULL
    figures: dict[str, float] = {}
    for P in PAGE_SIZES:
        print(f"tree_bench: page_size {P}, window {WINDOW}{' (quick)' if quick else ''}",
              file=sys.stderr)
        figures.update(run_page_size(P, sz))
    # ---- hook: figures from other benchmarks (not this module's) ------------------------------
    if extra is not None:
        figures.update(extra())
    return figures


# ---------------------------------------------------------------------------------------- table

# targets (page_size 64) and the SGLang 0.5.23 Python-core reference on the same shapes
TARGETS = {
    "match_4k_p50_us_p64": ("<=", 20.0),
    "lock_unlock_p50_us_p64": ("<=", 6.0),
    "insert_4k_p50_us_p64": ("<=", 150.0),
    "bytes_per_cached_token_p64": ("<=", 6.0),
    "multiturn_pressure_late_hit_rate": (">=", 0.3),
    "multiturn_swa_peak_ratio_free_vs_nofree": ("<=", 0.25),
    "multiturn_roomy_gap_to_ideal": ("<=", 0.01),
}
SGLANG = {
    "match_4k_p50_us_p64": 56.0,
    "lock_unlock_p50_us_p64": 19.0,
    "insert_4k_p50_us_p64": 725.0,
    "bytes_per_cached_token_p64": 10.4,
}


def _unit(name: str) -> str:
    base = name.rsplit("_p", 1)[0] if name.endswith(("_p64", "_p1")) else name
    if base.endswith("_us"):
        return "us"
    if base.endswith("_seconds"):
        return "s"
    if base.startswith("bytes_per_cached_token") and not base.endswith("_ntokens"):
        return "B/token"
    if base.endswith("_ntokens"):
        return "tokens"
    return ""


def _fmt(v: float) -> str:
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer() and abs(v) >= 1000):
        return f"{int(v):,}"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def format_table(figures: dict[str, float], quick: bool = False) -> str:
    rows = [("figure", "value", "unit", "target", "", "sglang")]
    for name, v in figures.items():
        tgt = TARGETS.get(name)
        status = ""
        if tgt is not None and isinstance(v, (int, float)):
            met = v <= tgt[1] if tgt[0] == "<=" else v >= tgt[1]
            status = "ok" if met else "MISS"
        ref = SGLANG.get(name)
        rows.append((name, _fmt(v), _unit(name), f"{tgt[0]} {tgt[1]:g}" if tgt else "",
                     status, f"{ref:g}" if ref is not None else ""))
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for j, r in enumerate(rows):
        lines.append("  ".join((c.ljust(w[i]) if i in (0, 2, 4) else c.rjust(w[i]))
                               for i, c in enumerate(r)).rstrip())
        if j == 0:
            lines.append("  ".join("-" * x for x in w))
    notes = [f"page_size 64 and 1, sliding window {WINDOW}; targets and the SGLang reference "
             "apply to page_size 64"]
    n1 = figures.get("bytes_per_cached_token_ntokens_p1")
    if n1 is not None and n1 < MEM_TOKENS:
        notes.append(f"bytes_per_cached_token_p1 measured on {int(n1):,} cached tokens "
                     f"(quick mode; full mode uses >= {MEM_TOKENS:,})")
    if quick:
        notes.append("quick mode: fewer iterations; percentiles are noisier")
    return "\n".join(lines + [""] + ["note: " + n for n in notes])


def tree_class_at(root: str) -> type:
    """``RadixTree`` of the checkout at ``root``: its ``daemon/tree`` package (pure, importing
    nothing else of the project) loaded under its own module name."""
    pkg = os.path.join(root, "daemon", "tree")
    name = "radixd_baseline_tree"
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(pkg, "__init__.py"), submodule_search_locations=[pkg])
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod.RadixTree


def interleaved(page_size: int, sz: Sizes, classes: dict[str, type]) -> dict[str, dict]:
    """insert_4k, match_4k_churn (p50, p99) and lock_unlock_churn (each right after an insert, as
    in :func:`bench_insert`) of each tree class, taken in turns: both
    trees are populated alike in this process, and every iteration times the same operation on
    each (the order flipping each time), so a machine that gets busier or quieter, or a heap
    laid out better for whichever ran first, weighs on both sides alike. Where a tree takes
    ``trusted`` (ids already checked, as ModelCache calls it), every other insert uses it."""
    P = page_size
    n = SEQ_LEN // P
    pops = {side: populate(P, sz.populated_seqs, sz.populated_long, tree_cls=cls)
            for side, cls in classes.items()}
    hot = {side: _usable(pop.tree, pop.seqs, SEQ_LEN)[:16] for side, pop in pops.items()}
    trust = {side: "trusted" in inspect.signature(pop.tree.insert).parameters
             for side, pop in pops.items()}
    # the match and lock each follow an insert: the *_churn figures of bench_insert
    names = ("insert_4k", "insert_4k_trusted", "match_4k_churn", "lock_unlock_churn")
    samples: dict[str, dict[str, list[int]]] = {side: {k: [] for k in names} for side in pops}
    iters = sz.insert_iters[P]
    warm = min(sz.warmup, max(10, iters // 5))
    clock = time.perf_counter_ns
    for i in range(warm + iters):
        for side in list(pops)[:: 1 if i % 2 else -1]:
            tree, alloc, wl = pops[side].tree, pops[side].alloc, pops[side].wl
            h = hot[side][i % len(hot[side])]
            toks = wl.fresh_4k(i)
            m = tree.match(NS, toks, lock=True)
            prev = m.prefix_len // P
            full, swa = _alloc(tree, alloc, n - prev)
            trusted = trust[side] and i % 2 == 1
            kw = {"trusted": True} if trusted else {}
            gc.disable()
            t0 = clock()
            tree.insert(NS, toks, full, swa, prev * P, 0, **kw)
            t1 = clock()
            r = tree.match(NS, h)
            t2 = clock()
            tree.unlock(tree.lock(r.node_id))
            t3 = clock()
            gc.enable()
            tree.unlock(m.receipt)
            if i >= warm:
                got = samples[side]
                got["insert_4k_trusted" if trusted else "insert_4k"].append(t1 - t0)
                got["match_4k_churn"].append(t2 - t1)
                got["lock_unlock_churn"].append(t3 - t2)
    out: dict[str, dict] = {}
    for side, got in samples.items():
        out[side] = {f"{k}_p50_us": _pct(v, 50) for k, v in got.items() if v}
        out[side]["match_4k_churn_p99_us"] = _pct(got["match_4k_churn"], 99)
        out[side].update(bench_idle(pops[side]))
    return out


def compare(ref: str, page_sizes: list[int], quick: bool) -> dict[str, float]:
    """This checkout's tree against the tree of git ``ref``, in this process: the latencies
    taken in turns (:func:`interleaved`), bytes per cached token measured for each (the same
    deterministic workload); printed side by side with the ratio."""
    sz = QUICK if quick else FULL
    classes = {"base": tree_class_at(export_ref(ref)), "this": RadixTree}
    out: dict[str, float] = {}
    rows = []
    for P in page_sizes:
        print(f"tree_bench: page_size {P}, {ref} and this checkout in turns", file=sys.stderr)
        figs = interleaved(P, sz, classes)
        for side, cls in classes.items():
            figs[side].update(bench_memory(P, sz.mem_tokens[P], cls))
            figs[side].update(bench_memory(P, sz.mem_tokens[P], cls, host=True))
        for side, hits in bench_host_hits(P, classes).items():
            figs[side].update(hits)
        for k, v in figs["this"].items():
            b = figs["base"].get(k)
            out[f"{k}_p{P}"] = v
            if b is not None:
                out[f"base_{k}_p{P}"] = b
            rows.append((f"{k}_p{P}", _fmt(b) if b is not None else "-", _fmt(v),
                         f"{v / b:.2f}" if b else ""))
    head = ("figure", ref, "this", "this/base")
    w = [max(len(r[i]) for r in [head] + rows) for i in range(4)]
    for j, r in enumerate([head] + rows):
        print("  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(r)))
        if j == 0:
            print("  ".join("-" * x for x in w))
    return out


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations (under a minute)")
    ap.add_argument("--json", metavar="PATH", help="write the figures as a flat JSON object")
    ap.add_argument("--baseline", metavar="REF",
                    help="compare with the tree of this git ref, in this process, in turns")
    ap.add_argument("--page-sizes", default="64,1", help="with --baseline: page sizes to run")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.page_sizes.split(",") if x.isdigit()]
    if len(sizes) != len(args.page_sizes.split(",")) or not set(sizes) <= set(FULL.insert_iters):
        ap.error(f"--page-sizes: a comma-separated list of {sorted(FULL.insert_iters)}, got "
                 f"{args.page_sizes!r}")
    t = time.perf_counter()
    if args.baseline:
        figures = compare(args.baseline, sizes, args.quick)
        print(f"total {time.perf_counter() - t:.1f} s")
        if args.json:
            write_json(args.json, figures)
        return figures
    from bench import multiturn

    def replay() -> dict[str, float]:
        mt = multiturn.figures(quick=args.quick)
        mt["multiturn_roomy_gap_to_ideal"] = round(
            mt["multiturn_ideal_hit_rate"] - mt["multiturn_hit_rate"], 4)
        return mt

    figures = run(args.quick, extra=replay)
    print(format_table(figures, args.quick))
    print(f"total {time.perf_counter() - t:.1f} s")
    if args.json:
        write_json(args.json, figures)
    return figures


if __name__ == "__main__":
    main()
