"""Host-side allocators: KV pages and table_idx values (rows of the page table). Both free what they gave out."""

from __future__ import annotations


class PageAllocator:
    """Hands out page indices in [0, num_pages); the dummy page `num_pages` is never handed out."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() gives low pages first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(
                f"out of KV cache pages: {n} needed, {len(self._free)} of {self.num_pages} free. "
                "Finish or free requests first, or give the KV cache more memory "
                "(memory_ratio, cpu_kv_budget_gib or num_page_override)."
            )
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for page in pages:
            if page not in self._used:
                raise ValueError(f"page {page} is not allocated; it cannot be freed twice")
            self._used.remove(page)
            self._free.append(page)


class TableIdxAllocator:
    """Hands out table_idx values (page-table rows) in [0, max_running_req); `max_running_req` is the
    dummy request's."""

    def __init__(self, max_running_req: int) -> None:
        self.max_running_req = max_running_req
        self._free = list(range(max_running_req - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise RuntimeError(
                f"all {self.max_running_req} page-table rows (max_running_req={self.max_running_req}) are "
                "in use; free a finished request first or raise max_running_req"
            )
        return self._free.pop()

    def free(self, table_idx: int) -> None:
        if table_idx in self._free or not 0 <= table_idx < self.max_running_req:
            raise ValueError(f"table_idx {table_idx} is not allocated; it cannot be freed twice")
        self._free.append(table_idx)
