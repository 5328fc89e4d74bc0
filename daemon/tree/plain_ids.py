"""The tree's default page-id codec: every list kept as the caller gave it.

Apart from page_ids.py (the codec protocol and the forms the tree reads) because its verdict on
a caller's ids is the byte scan of id_checks.py, which itself reads those forms."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

from .id_checks import page_id_verdict
from .page_ids import PageIds, concat_pages


class PlainPageIds:
    """The tree's default codec: ids kept as the caller gave them."""

    min_ids = sys.maxsize
    listed_bytes = 0

    def compact(self, ids: array) -> PageIds:
        return ids

    def in_use(self, ids: PageIds) -> PageIds:
        return ids

    def join(self, parts: Sequence[PageIds]) -> array:
        return concat_pages(parts)

    join_matched = join

    def id_verdict(self, ids: Sequence[int]) -> tuple[bool, bool]:
        return page_id_verdict(ids)
