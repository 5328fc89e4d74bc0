"""Insertion of computed KV: new nodes, overlaps with cached ones, and the engine's composite
end-of-step calls."""

from __future__ import annotations

from array import array
from typing import Any

from .errors import BadArgument, ReceiptError
from .hashing import HASH_BYTES, block_hashes
from .id_checks import all_zero, distinct_ids, distinct_nonzero, page_id_verdict
from .node import Node, Receipt
from .page_ids import PageIds
from .results import InsertResult


class Insertion:
    """The insert half of :class:`~daemon.tree.radix.RadixTree` (a mixin: it
    shares the tree's state)."""

    # ------------------------------------------------------------------ insert

    def insert(
        self,
        namespace: str,
        tokens: bytes,
        full_pages: array,
        swa_pages: array | None,
        prev_prefix_len: int = 0,
        swa_evicted_len: int = 0,
        *,
        lock: bool = False,
        tag: Any = None,
        trusted: bool = False,
    ) -> InsertResult:
        """Hand computed pages to the tree.

        ``tokens`` is the sequence (its unaligned tail is ignored). ``full_pages`` and
        ``swa_pages`` cover the pages [prev_prefix_len, aligned end): the caller's own pages. The
        tree already owns [0, prev_prefix_len). ``swa_pages[i]`` is 0 exactly for the pages below
        ``swa_evicted_len`` (the caller already freed their SWA). Every caller page in
        [prev_prefix_len, inserted_len) is consumed: adopted by the tree or freed as a duplicate
        of the tree's canonical page. Pages beyond ``inserted_len`` stay the caller's (that
        happens when none of them would have live SWA at the end of the path: a tombstone leaf is
        never created).

        ``trusted``: the caller has already proved what the tree would check of each id (distinct
        live pages of its own, zeros exactly below the SWA frontier), as
        :class:`daemon.model_cache.ModelCache` does before it calls: the counts and offsets are
        still checked, the ids are not checked again (at a page of one token those checks cost
        more than the insert).
        """
        ns = self.namespaces.get(namespace) or self.namespace(namespace)
        P = self.page_size
        pb = self.page_bytes
        n = len(tokens) // pb
        prev, f = self._check_insert_args(n, full_pages, swa_pages, prev_prefix_len,
                                          swa_evicted_len, trusted)
        swa = self.swa_enabled
        # a path whose new part would end without live SWA takes no new device pages
        adopt = (not swa) or f < n
        node = ns.root
        i = 0
        overlap = 0
        out_full: list[PageIds] = []
        out_swa: list[PageIds] = []
        to_free_full = array("i")
        to_free_swa = array("i")
        path: list[Node] = []
        while i < n and node.children:
            child = node.children.get(tokens[i * pb : (i + 1) * pb])
            if child is None:
                break
            ct = child.tokens
            lc = len(ct)
            if lc <= (n - i) * pb and tokens.startswith(ct, i * pb):  # the whole node
                m = lc // pb
            else:
                m = self._matched_pages(child, tokens, i * pb, n - i)
            if i < prev < i + m:
                m = prev - i  # process the tree-owned part and the caller's part separately
            e = i + m
            if e < prev and m * pb < lc:
                raise BadArgument(
                    f"prev_prefix_len={prev * P} is longer than the cached prefix "
                    f"({e * P} tokens) of this sequence (lock the prefix you reuse)")
            if e <= prev:
                if child.full is None:
                    raise BadArgument(
                        f"prev_prefix_len={prev * P} claims pages the tree holds on device, but "
                        f"tokens [{i * P}, {e * P}) are not on device (lock the prefix you reuse)")
                overlap = e
            elif child.full is None and not adopt:
                break
            if m * pb < lc:
                child = self._split(child, m)
            if e > prev:
                cf = full_pages[i - prev : e - prev]
                cs = swa_pages[i - prev : e - prev] if swa else None
                if child.full is not None:
                    overlap = e
                    out_full.append(child.full)
                    if swa:
                        out_swa.append(child.swa if child.swa is not None else cs)
                    child = self._merge_into_device(child, i, e, f, cf, cs, to_free_full,
                                                    to_free_swa)
                else:
                    out_full.append(cf)
                    if swa:
                        out_swa.append(cs)
                    self._unevict(child, i, e, f, cf, cs)
            path.append(child)
            node = child
            i = e
        if i < prev:
            raise BadArgument(f"prev_prefix_len={prev * P} is longer than the cached prefix "
                              f"({i * P} tokens) of this sequence (lock the prefix you reuse)")
        # nothing may change before this point: every refusal above leaves the tree as it was
        self._advance((n - prev) * P)
        if i < n and adopt:
            cf = full_pages[i - prev :]
            cs = swa_pages[i - prev :] if swa else None
            new = self._append(node, tokens, i, n, f, cf, cs)
            out_full.append(cf)  # join copies: the result never shares the nodes' arrays
            if swa:
                out_swa.append(cs)
            path.extend(new)
            node = new[-1]
            i = n
        clock = self._clock
        for nn in path:
            if nn.ts != clock:
                self._touch(nn)
            nn.hits += 1
        if swa:
            self._touch_window(path)
        if to_free_full:
            self.sink.free_full(to_free_full)
        if to_free_swa:
            self.sink.free_swa(to_free_swa)
        receipt = self._lock(node, tag) if lock else None
        return InsertResult(
            overlap * P,
            i * P,
            self.page_ids.join(out_full),
            self.page_ids.join(out_swa) if swa else array("i"),
            node.id,
            receipt,
        )

    def _check_insert_args(
        self, n: int, full_pages: Any, swa_pages: Any, prev_prefix_len: Any, swa_evicted_len: Any,
        trusted: bool = False,
    ) -> tuple[int, int]:
        P = self.page_size
        if not isinstance(prev_prefix_len, int) or prev_prefix_len < 0 or prev_prefix_len % P:
            raise BadArgument(f"prev_prefix_len must be a non-negative multiple of page_size {P}, "
                              f"got {prev_prefix_len!r}")
        if prev_prefix_len > n * P:
            raise BadArgument(f"prev_prefix_len={prev_prefix_len} is beyond the page-aligned "
                              f"length {n * P} of the sequence")
        if not isinstance(swa_evicted_len, int) or swa_evicted_len < 0 or swa_evicted_len % P:
            raise BadArgument(f"swa_evicted_len must be a non-negative multiple of page_size {P}, "
                              f"got {swa_evicted_len!r}")
        prev = prev_prefix_len // P
        # a frontier past the end means every SWA page was freed: cap it (never a cursor overrun)
        f = min(swa_evicted_len // P, n)
        if not self.swa_enabled:
            f = 0
        want = n - prev
        if len(full_pages) != want:
            raise BadArgument(f"full_pages has {len(full_pages)} ids; pages [{prev}, {n}) "
                              f"need {want}")
        if self.swa_enabled:
            if swa_pages is None or len(swa_pages) != want:
                got = None if swa_pages is None else len(swa_pages)
                raise BadArgument(f"swa_pages has {got} ids; pages [{prev}, {n}) need {want}")
            if trusted:
                return prev, f
            # whole-list checks: at a page of one token a request carries thousands of ids, and
            # a Python step per id (a set, min()) was most of an insert; the codec's verdict
            # reads them as bytes (daemon.tree.id_checks) or with vector code
            k = max(0, min(f - prev, want))  # the caller's pages below the SWA frontier
            if k and not all_zero(swa_pages[:k]):
                j = next(j for j in range(k) if swa_pages[j] != 0)
                raise BadArgument(f"swa_pages[{j}] must be 0: page {prev + j} is below "
                                  f"swa_evicted_len={swa_evicted_len}")
            if k < want:
                positive, distinct = self._id_verdict(swa_pages[k:])
                if not positive:
                    j = next(j for j in range(k, want) if swa_pages[j] <= 0)
                    raise BadArgument(f"swa_pages[{j}] must be a page id: page {prev + j} is at "
                                      f"or after swa_evicted_len={swa_evicted_len}")
                if not distinct:
                    raise BadArgument("swa_pages must be distinct page ids")
        elif swa_pages:
            raise BadArgument("this model has no sliding-window layers: swa_pages must be empty")
        if want and not trusted and self._id_verdict(full_pages) != (True, True):
            raise BadArgument("full_pages must be distinct page ids > 0")
        return prev, f

    def _id_verdict(self, ids: Any) -> tuple[bool, bool]:
        """``(every id > 0, no id twice)``: a long list by the codec (it may read it with
        vector code), a short one by the byte scan, which costs less there than vector calls."""
        codec = self.page_ids
        return codec.id_verdict(ids) if len(ids) >= codec.min_ids else page_id_verdict(ids)

    def _merge_into_device(
        self, child: Node, i: int, e: int, f: int, cf: array, cs: array | None,
        to_free_full: array, to_free_swa: array,
    ) -> Node:
        """Overlap with a device node: free the caller's duplicates, revive a tombstone if the
        caller brings live SWA for it. Returns the node that ends at ``e``."""
        to_free_full.extend(cf)
        if cs is None:
            return child
        if child.swa is not None:
            to_free_swa.extend(p for p in cs if p)
            return child
        # tombstone: three cases by where the caller's SWA frontier falls
        if f >= e:
            return child  # the caller's SWA for this span is gone too (cs is all 0)
        if f > i:
            self._split(child, f - i)  # upper [i, f) stays a tombstone
            cs = cs[f - i :]
        child.swa = cs
        child.swa_ts = self._clock
        self._dense_ids(child)
        np_ = len(cs)
        if child.swa_lock:  # pragma: no cover - tombstones are never SWA-locked
            raise AssertionError(f"SWA-locked tombstone {child!r}")
        self._count_swa(child, np_)
        child.ns.swa_pages += np_
        self._requeue(child)
        return child

    def _count_swa(self, n: Node, np_: int) -> None:
        """New live SWA pages of ``n``: protected when a lock or a pin guards it."""
        if n.swa_lock or n.pin:
            self.swa_protected += np_
        else:
            self.swa_evictable += np_

    def _unevict(self, child: Node, i: int, e: int, f: int, cf: array, cs: array | None) -> None:
        """A host-only node gets device pages again from the caller's fresh copy."""
        if cs is not None and i < f < e:
            up = self._split(child, f - i)
            self._set_device(up, cf[: f - i], None)
            self._set_device(child, cf[f - i :], cs[f - i :])
        else:
            live = cs is not None and f <= i
            self._set_device(child, cf, cs if live else None)

    def _set_device(self, n: Node, full: array, swa: array | None) -> None:
        """Give ``n`` device pages. It keeps ``full`` and ``swa``, not copies: callers pass fresh
        arrays that nothing else keeps (at a page of one token each copy is one more pass over
        thousands of ids)."""
        n.full = full
        n.swa = swa
        self._dense_ids(n)
        n.ts = n.swa_ts = self._clock
        np_ = len(full)
        if n.full_lock or n.pin:
            self.full_protected += np_
        else:
            self.full_evictable += np_
        n.ns.full_pages += np_
        if swa is not None:
            self._count_swa(n, np_)
            n.ns.swa_pages += np_
        n.parent.dev_children += 1
        self._requeue(n)
        self._requeue(n.parent)

    def _append(
        self, parent: Node, tokens: bytes, i: int, n: int, f: int, cf: array, cs: array | None
    ) -> list[Node]:
        """New nodes for pages [i, n): a tombstone part below the frontier, then a live leaf."""
        pb = self.page_bytes
        bp = self.block_pages
        seg = tokens[i * pb : n * pb]
        hashes = block_hashes(*self.chain_state(parent), seg, self.block_bytes)
        out: list[Node] = []
        cuts = [i, n]
        if cs is not None and i < f < n:
            cuts = [i, f, n]
        cur = parent
        for a, b in zip(cuts, cuts[1:], strict=False):
            nd = Node(self._new_id(), cur, parent.ns, seg[(a - i) * pb : (b - i) * pb],
                      hashes[(a // bp - i // bp) * HASH_BYTES : (b // bp - i // bp) * HASH_BYTES])
            if cur.children is None:
                cur.children = {}
            cur.children[nd.tokens[:pb]] = nd
            self.nodes[nd.id] = nd
            live = cs is not None and a >= f
            whole = b - a == len(cf)  # the common case: one node takes the caller's whole slice
            self._set_device(nd, cf if whole else cf[a - i : b - i],
                             (cs if whole else cs[a - i : b - i]) if live else None)
            out.append(nd)
            cur = nd
        return out

    # ------------------------------------------------------------------ composite engine steps

    def cache_finished(
        self, namespace: str, tokens: bytes, full_pages: array, swa_pages: array | None,
        prev_prefix_len: int, swa_evicted_len: int, receipt: Receipt | None,
        trusted: bool = False,
    ) -> InsertResult:
        """End of a request: insert what it computed, free the rest of its pages, drop its lock.

        ``full_pages``/``swa_pages`` cover [prev_prefix_len, ceil(len(tokens) / page)), so they
        include the unaligned tail page, which is never cached. ``trusted``: as for insert.
        """
        n, cf, cs, tf, ts_ = self._split_tail(tokens, full_pages, swa_pages, prev_prefix_len,
                                              trusted)
        if receipt is not None and not receipt.active:
            raise ReceiptError("this lock was already released")
        res = self.insert(namespace, tokens[: n * self.page_bytes], cf, cs, prev_prefix_len,
                          swa_evicted_len, trusted=trusted)
        left = res.inserted_len // self.page_size - prev_prefix_len // self.page_size
        rest_full = array("i", cf[left:]) + tf if left < len(cf) else tf
        rest_swa = array("i")
        if cs is not None and left < len(cs):
            rest_swa.extend(p for p in cs[left:] if p)
        if ts_:
            rest_swa.extend(p for p in ts_ if p)
        if rest_full:
            self.sink.free_full(rest_full)
        if rest_swa:
            self.sink.free_swa(rest_swa)
        if receipt is not None:
            self.unlock(receipt)
        return res

    def cache_unfinished(
        self, namespace: str, tokens: bytes, full_pages: array, swa_pages: array | None,
        prev_prefix_len: int, swa_evicted_len: int, receipt: Receipt | None, tag: Any = None,
        trusted: bool = False,
    ) -> InsertResult:
        """After a prefill chunk: insert, move the lock to the new end, keep the unaligned tail.

        The result's receipt replaces ``receipt``; its ``inserted_len`` is the next call's
        ``prev_prefix_len``. Pages past ``inserted_len`` (the tail page included) stay the caller's.
        ``trusted``: as for insert.
        """
        n, cf, cs, _tf, _ts = self._split_tail(tokens, full_pages, swa_pages, prev_prefix_len,
                                               trusted)
        if receipt is not None and not receipt.active:
            raise ReceiptError("this lock was already released")
        res = self.insert(namespace, tokens[: n * self.page_bytes], cf, cs, prev_prefix_len,
                          swa_evicted_len, lock=True, tag=tag, trusted=trusted)
        if receipt is not None:
            self.unlock(receipt)
        return res

    def _split_tail(
        self, tokens: bytes, full_pages: array, swa_pages: array | None, prev_prefix_len: int,
        trusted: bool = False,
    ) -> tuple[int, array, array | None, array, array]:
        P = self.page_size
        n = len(tokens) // self.page_bytes
        total = -(-(len(tokens) // 4) // P)
        if not isinstance(prev_prefix_len, int) or prev_prefix_len < 0:
            raise BadArgument(
                f"prev_prefix_len must be a non-negative int, got {prev_prefix_len!r}")
        prev = prev_prefix_len // P
        want = total - prev
        if len(full_pages) != want:
            raise BadArgument(f"full_pages has {len(full_pages)} ids; pages [{prev}, {total}) "
                              f"(the unaligned tail page included) need {want}")
        if self.swa_enabled and (swa_pages is None or len(swa_pages) != want):
            got = None if swa_pages is None else len(swa_pages)
            raise BadArgument(f"swa_pages has {got} ids; pages [{prev}, {total}) need {want}")
        k = max(0, n - prev)
        cs = swa_pages[:k] if self.swa_enabled else None
        ts_ = swa_pages[k:] if self.swa_enabled else array("i")
        tf = full_pages[k:]
        if trusted:
            return n, full_pages[:k], cs, array("i", tf), array("i", ts_)
        if ts_ and min(ts_) < 0:
            raise BadArgument("swa_pages ids must be >= 0")
        if tf and min(tf) <= 0:
            raise BadArgument("full_pages must be page ids > 0")
        # the tail is split off before insert() checks its range: check the whole lists here
        if len(full_pages) > 1 and not distinct_ids(full_pages):
            raise BadArgument("full_pages must be distinct page ids")
        if self.swa_enabled and len(swa_pages) > 1 and not distinct_nonzero(swa_pages):
            raise BadArgument("swa_pages must be distinct page ids")
        return n, full_pages[:k], cs, array("i", tf), array("i", ts_)
