"""The KV page pool: a free list and a reference count per page.

The device holds the pool the model's KV cache spec declares, `num_pages` pages of `page_size`
token slots each (the runner owns the bytes). This class owns only the bookkeeping: which pages are free and how
many holders each used page has. A page is held by the requests whose page tables list it and by the
prefix-cache node that stores it; it returns to the free list when the last holder lets go.

Page 0 is the null page (jengine.models.kv_cache.NULL_PAGE): padding writes land there, so it is never
handed out. The free list is FIFO: a page freed now is reused last, which keeps a retracted request's
fresh pages distinct from the ones it gave back (the byte-copy oracle would prove less otherwise).
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from jengine.models.kv_cache import NULL_PAGE


class KVManager:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages}: the pool needs the null page and at least one more")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(p for p in range(num_pages) if p != NULL_PAGE)
        self._refs = [0] * num_pages
        # Called with a page count when the free list runs short (the prefix cache's evict).
        self.evict_hook: Callable[[int], int] | None = None

    # -- capacity --------------------------------------------------------------------------------
    @property
    def capacity_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity_pages - self.num_free

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # -- allocation ------------------------------------------------------------------------------
    def alloc(self, n: int) -> list[int] | None:
        """n fresh pages (refcount 1), evicting unreferenced cache entries if needed; None if the
        pool cannot supply them even then (nothing is taken in that case)."""
        if n <= 0:
            return []
        if len(self._free) < n and self.evict_hook is not None:
            self.evict_hook(n - len(self._free))
        if len(self._free) < n:
            return None
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            if self._refs[p] <= 0:
                raise RuntimeError(f"incref of free page {p}")
            self._refs[p] += 1

    def decref(self, pages: list[int]) -> None:
        for p in pages:
            if self._refs[p] <= 0:
                raise RuntimeError(f"decref of free page {p}")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def check_consistent(self) -> None:
        """Every page is either free (refcount 0, in the free list once) or held. For tests."""
        free = list(self._free)
        assert len(free) == len(set(free)), "page twice in the free list"
        assert NULL_PAGE not in free and self._refs[NULL_PAGE] == 0, "null page handed out"
        for p in range(1, self.num_pages):
            assert (self._refs[p] == 0) == (p in set(free)), f"page {p} refcount {self._refs[p]}"
