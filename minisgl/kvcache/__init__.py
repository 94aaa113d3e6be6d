"""The paged KV cache pool, its sizing, the allocators for pages and table_idx values, and the radix
tree of cached prefixes over the pages."""

from minisgl.kvcache.allocator import PageAllocator, TableIdxAllocator
from minisgl.kvcache.pool import BaseKVCachePool, MHAKVCachePool, bytes_per_page
from minisgl.kvcache.radix import RadixCache

__all__ = [
    "BaseKVCachePool",
    "MHAKVCachePool",
    "PageAllocator",
    "RadixCache",
    "TableIdxAllocator",
    "bytes_per_page",
]
