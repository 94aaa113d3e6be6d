"""The paged KV cache pool, its sizing, and the allocators for pages and page-table rows."""

from minisgl.kvcache.allocator import PageAllocator, SlotAllocator
from minisgl.kvcache.pool import BaseKVCachePool, MHAKVCachePool, bytes_per_page

__all__ = ["BaseKVCachePool", "MHAKVCachePool", "PageAllocator", "SlotAllocator", "bytes_per_page"]
