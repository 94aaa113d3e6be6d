"""The paged KV cache pool, its sizing, and the allocators for pages and table_idx values."""

from minisgl.kvcache.allocator import PageAllocator, TableIdxAllocator
from minisgl.kvcache.pool import BaseKVCachePool, MHAKVCachePool, bytes_per_page

__all__ = [
    "BaseKVCachePool",
    "MHAKVCachePool",
    "PageAllocator",
    "TableIdxAllocator",
    "bytes_per_page",
]
