"""Matching a token sequence against the tree: the longest usable prefix under the SWA rule."""

from __future__ import annotations

from array import array
from typing import Any

from .node import EMPTY, Node
from .page_ids import PageIds
from .results import MatchResult


class Matching:
    """The match half of :class:`~daemon.tree.radix.RadixTree` (a mixin: it
    shares the tree's state)."""

    # ------------------------------------------------------------------ match

    def match(self, namespace: str, tokens: bytes, *, lock: bool = False, tag: Any = None
              ) -> MatchResult:
        """Longest usable cached prefix of ``tokens``; refreshes recency along the path."""
        ns = self.namespaces.get(namespace) or self.namespace(namespace)
        pb = self.page_bytes
        n_pages = len(tokens) // pb
        window = self.window or 0
        swa = self.swa_enabled
        node = ns.root
        off = 0
        path: list[Node] = []
        host_path: list[Node] = []
        best_i = -1  # index in path of the best end; -1: the root
        best_m = 0  # pages of path[best_i] that are matched
        run = 0
        tomb = False
        dev_off = 0
        children = node.children
        end = n_pages * pb
        while off < end and children:
            child = children.get(tokens[off : off + pb])
            if child is None:
                break
            ct = child.tokens
            lc = len(ct)
            if lc <= end - off and tokens.startswith(ct, off):  # the whole node matches
                mb = lc  # matched bytes
            else:
                mb = self._matched_pages(child, tokens, off, n_pages - off // pb) * pb
            if child.full is None:
                if child.host is None:
                    break
                host_path.append(child)
            else:
                path.append(child)
                dev_off = off + mb
                if not swa:
                    best_i, best_m = len(path) - 1, mb // pb
                elif child.swa is None:
                    tomb = True
                    run = 0
                else:
                    run += mb >> 2  # tokens
                    if not tomb or run >= window:
                        best_i, best_m = len(path) - 1, mb // pb
            off += mb
            if mb < lc:
                break
            children = child.children
        if best_i >= 0:
            best = path[best_i]
            if best_m * pb < len(best.tokens):
                best = self._split(best, best_m)
                path[best_i] = best
            usable = path[: best_i + 1]
        else:
            best = ns.root
            usable = []
        clock = self._clock
        for n in path:
            if n.ts != clock:
                self._touch(n)
        for n in host_path:
            if n.ts != clock:
                self._touch(n)
        if swa:
            self._touch_window(usable)
        for n in usable:
            n.hits += 1
        full_pages = self.page_ids.join_matched([n.full for n in usable])
        swa_pages = self._window_swa(usable) if swa else EMPTY
        prefix_len = best.depth
        host_len = 0
        if host_path or (swa and best_i + 1 < len(path) and any(
                n.host_swa is not None for n in path[best_i + 1 :])):
            end = self.usable_end(self.walk(namespace, tokens))
            host_len = max(0, end * self.page_size - prefix_len)
        receipt = self._lock(best, tag) if lock else None
        return MatchResult(
            prefix_len,
            full_pages,
            swa_pages,
            best.id,
            dev_off // 4,
            host_len,
            receipt,
        )

    def _window_swa(self, path: list[Node]) -> array:
        need = self.window_pages
        parts: list[PageIds] = []
        for n in reversed(path):
            if need <= 0:
                break
            s = n.swa
            if s is None:
                break
            parts.append(s if len(s) <= need else s[len(s) - need :])
            need -= len(s)
        parts.reverse()
        return self.page_ids.join_matched(parts)

    def is_usable_end(self, node: Node) -> bool:
        """Whether a match may end at ``node`` (docs/design.md, the SWA rule of a match)."""
        if node.full is None:
            return False
        if not self.swa_enabled or node.parent is None:
            return True
        run = 0
        n = node
        while n.parent is not None:
            if n.swa is None:
                return False
            run += len(n.tokens) // 4
            if run >= self.window:
                return True
            n = n.parent
        return True
