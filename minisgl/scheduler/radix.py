"""A radix tree over KV-cache pages, in whole pages: the prefix cache behind `cache_type: radix`.

Pure Python (page ids and token ids are ints). Which pages `insert` hands to the tree, locking and the
deterministic (logical-clock) eviction: docs/prefix-cache.md#the-tree.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

__all__ = ["InsertResult", "Match", "RadixCache", "RadixNode"]


class RadixNode:
    """One run of whole pages in the tree; also the handle that `lock`/`unlock` take. Read-only for
    callers: `tokens` (a multiple of page_size ids), `pages` (one page id per page), `ref_count`,
    `last_access` (the clock value of the last match/insert through it)."""

    __slots__ = ("tokens", "pages", "parent", "children", "ref_count", "last_access", "seq")

    def __init__(
        self,
        tokens: tuple[int, ...],
        pages: list[int],
        parent: RadixNode | None,
        last_access: int,
        seq: int,
        ref_count: int = 0,
    ) -> None:
        self.tokens = tokens
        self.pages = pages
        self.parent = parent  # None for the root and for a node that was evicted
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.ref_count = ref_count
        self.last_access = last_access
        self.seq = seq  # creation order: the tie-breaker of eviction

    def __repr__(self) -> str:
        return (
            f"RadixNode(tokens={len(self.tokens)}, pages={self.pages}, ref_count={self.ref_count}, "
            f"last_access={self.last_access}, children={len(self.children)})"
        )


@dataclass(frozen=True)
class Match:
    """The longest cached prefix of a token sequence, in whole pages: its page ids in order, its length
    in tokens (`len(pages) * page_size`) and the handle to lock while using them (the root when
    nothing matched; locking the root does nothing)."""

    pages: list[int]
    num_tokens: int
    handle: RadixNode


@dataclass(frozen=True)
class InsertResult:
    """What `insert` did. `num_cached_pages`: how many leading pages of the inserted sequence the tree
    already held (it kept its own pages for them). `duplicate_pages`: those of the caller's first
    `num_cached_pages` pages that are not the tree's own, which stay the caller's to free. `handle`:
    the node that ends at the last inserted page (the root if no whole page was given)."""

    num_cached_pages: int
    duplicate_pages: list[int]
    handle: RadixNode


class RadixCache:
    """A radix tree of token ids over KV pages of `page_size` tokens (docs/prefix-cache.md)."""

    def __init__(self, page_size: int) -> None:
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        self._page_size = page_size
        self._clock = 0
        self._next_seq = 0
        self._root = self._new_node((), [], parent=None)
        self._held: set[int] = set()  # every page id the tree holds
        self._num_nodes = 0  # not counting the root
        self._num_referenced_pages = 0
        self._heap: list[tuple[int, int, int, RadixNode]] = []  # (last_access, seq, push id, node)
        self._pushes = 0

    # -- counters ---------------------------------------------------------------------------------

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def clock(self) -> int:
        """The logical time: the number of `match` and `insert` calls so far."""
        return self._clock

    @property
    def num_pages(self) -> int:
        """Pages the tree holds."""
        return len(self._held)

    @property
    def num_referenced_pages(self) -> int:
        """Pages held by nodes whose reference count is above zero."""
        return self._num_referenced_pages

    @property
    def num_evictable_pages(self) -> int:
        """Pages held by unreferenced nodes: what `clear` would free."""
        return len(self._held) - self._num_referenced_pages

    @property
    def num_nodes(self) -> int:
        """Nodes in the tree, not counting the root."""
        return self._num_nodes

    def held_pages(self) -> list[int]:
        """Every page id the tree holds, in depth-first order (for checks and debugging)."""
        return [page for node in self._nodes() for page in node.pages]

    # -- the operations -----------------------------------------------------------------------------

    def match(self, tokens: Sequence[int], *, lock: bool = False) -> Match:
        """The longest cached prefix of `tokens` in whole pages; stamps its path (splitting the last
        node when the prefix ends inside it) and, with `lock=True`, locks the returned handle."""
        key = self._key(tokens)
        node, used, pages = self._descend(key)
        node = self._split_at(node, used)
        self._touch(node)
        if lock:
            self.lock(node)
        return Match(pages=pages, num_tokens=len(pages) * self._page_size, handle=node)

    def insert(self, tokens: Sequence[int], pages: Sequence[int], *, lock: bool = False) -> InsertResult:
        """Caches the whole pages of `tokens`, held in `pages` (one page id per `page_size` tokens; a
        tail shorter than a page is ignored). Stamps the path and, with `lock=True`, locks the
        returned handle. Which pages the tree now owns: `InsertResult`, docs/prefix-cache.md."""
        num = len(tokens) // self._page_size
        if len(pages) != num:
            raise ValueError(
                f"insert got {len(pages)} pages for {len(tokens)} tokens; with page_size "
                f"{self._page_size} that needs exactly {num}"
            )
        key = self._key(tokens)
        node, used, cached = self._descend(key)
        k = len(cached)
        self._check_new_pages(pages, cached)
        node = self._split_at(node, used)
        if k < num:
            node = self._add_leaf(node, key[k * self._page_size :], list(pages[k:]))
        self._touch(node)
        if lock:
            self.lock(node)
        duplicates = [page for page, own in zip(pages[:k], cached) if page != own]
        return InsertResult(num_cached_pages=k, duplicate_pages=duplicates, handle=node)

    def lock(self, handle: RadixNode) -> None:
        """Increments the reference count of `handle` and of every node above it."""
        for node in self._path(handle):
            if node.ref_count == 0:
                self._num_referenced_pages += len(node.pages)
            node.ref_count += 1

    def unlock(self, handle: RadixNode) -> None:
        """Decrements the reference count of `handle` and of every node above it; a node that reaches
        zero becomes evictable (once it is a leaf)."""
        path = self._path(handle)
        if path and handle.ref_count < 1:
            raise ValueError(f"unlock of a handle whose ref_count is {handle.ref_count}: it is not locked")
        for node in path:
            node.ref_count -= 1
            if node.ref_count == 0:
                self._num_referenced_pages -= len(node.pages)
                self._push_if_evictable(node)

    def evict(self, num_pages: int) -> list[int]:
        """Removes unreferenced leaves, least recently used first, whole nodes at a time, until at
        least `num_pages` pages are freed (fewer if not that many are evictable). Returns the freed
        page ids, node by node, each node's pages in token order; they are the caller's again."""
        if num_pages < 0:
            raise ValueError(f"evict needs num_pages >= 0, got {num_pages}")
        freed: list[int] = []
        while len(freed) < num_pages and self._heap:
            stamp, _, _, node = heapq.heappop(self._heap)
            if not self._is_evictable_leaf(node) or node.last_access != stamp:
                continue  # a stale entry: the node changed since it was pushed
            freed.extend(node.pages)
            self._remove_leaf(node)
        return freed

    def clear(self) -> list[int]:
        """Evicts everything unreferenced (referenced nodes and their ancestors stay); returns the freed
        page ids."""
        return self.evict(self.num_evictable_pages)

    # -- internals --------------------------------------------------------------------------------

    def _key(self, tokens: Sequence[int]) -> tuple[int, ...]:
        """The whole pages of `tokens` as a tuple."""
        return tuple(tokens[: len(tokens) // self._page_size * self._page_size])

    def _new_node(
        self, tokens: tuple[int, ...], pages: list[int], parent: RadixNode | None, ref_count: int = 0
    ) -> RadixNode:
        self._next_seq += 1
        return RadixNode(tokens, pages, parent, self._clock, self._next_seq, ref_count)

    def _descend(self, key: tuple[int, ...]) -> tuple[RadixNode, int, list[int]]:
        """Follows `key` from the root without changing anything. Returns the deepest node reached, how
        many of its pages match (fewer than all when the match ends inside it) and the matched page
        ids."""
        ps = self._page_size
        node, offset, pages = self._root, 0, []
        while offset < len(key):
            child = node.children.get(key[offset : offset + ps])
            if child is None:
                break
            used = self._common_pages(child.tokens, key, offset)
            offset += used * ps
            if used < len(child.pages):
                pages.extend(child.pages[:used])
                return child, used, pages
            pages.extend(child.pages)
            node = child
        return node, len(node.pages), pages

    def _common_pages(self, tokens: tuple[int, ...], key: tuple[int, ...], offset: int) -> int:
        """How many whole pages of `tokens` equal `key` from `offset` on (the first one does: it is
        the child's key)."""
        ps = self._page_size
        if key[offset : offset + len(tokens)] == tokens:
            return len(tokens) // ps
        limit = min(len(tokens), len(key) - offset) // ps
        used = 1
        while used < limit:
            start = used * ps
            if tokens[start : start + ps] != key[offset + start : offset + start + ps]:
                break
            used += 1
        return used

    def _split_at(self, node: RadixNode, used: int) -> RadixNode:
        """Splits `node` after its first `used` pages and returns the node that ends there. The new
        upper node takes over `node`'s place, count and stamp; `node` keeps the lower part, so handles
        to it stay valid."""
        if used >= len(node.pages):
            return node
        ps, parent = self._page_size, node.parent
        assert parent is not None and used >= 1
        upper = self._new_node(node.tokens[: used * ps], node.pages[:used], parent, node.ref_count)
        upper.last_access = node.last_access
        parent.children[upper.tokens[:ps]] = upper
        node.tokens = node.tokens[used * ps :]
        node.pages = node.pages[used:]
        node.parent = upper
        upper.children[node.tokens[:ps]] = node
        self._num_nodes += 1
        return upper

    def _add_leaf(self, parent: RadixNode, tokens: tuple[int, ...], pages: list[int]) -> RadixNode:
        leaf = self._new_node(tokens, pages, parent)
        parent.children[tokens[: self._page_size]] = leaf
        self._held.update(pages)
        self._num_nodes += 1
        return leaf

    def _check_new_pages(self, pages: Sequence[int], cached: list[int]) -> None:
        """Refuses page ids that would be owned twice: repeated in `pages`, or held by the tree other
        than as the very page it already holds at that position."""
        if len(set(pages)) != len(pages):
            repeated = sorted({page for page in pages if pages.count(page) > 1})
            raise ValueError(f"insert got repeated page ids {repeated}")
        for index, page in enumerate(pages):
            own = cached[index] if index < len(cached) else None
            if page != own and page in self._held:
                raise ValueError(
                    f"insert got page id {page} at position {index}, which the tree already holds"
                )

    def _touch(self, node: RadixNode) -> None:
        """Advances the clock and stamps `node` and every node above it."""
        self._clock += 1
        walk: RadixNode | None = node
        while walk is not None and walk is not self._root:
            walk.last_access = self._clock
            walk = walk.parent
        self._push_if_evictable(node)

    def _path(self, handle: RadixNode) -> list[RadixNode]:
        """`handle` and the nodes above it, the root excluded; ValueError for a handle that is not in
        this tree (evicted, or from another tree)."""
        path: list[RadixNode] = []
        node = handle
        while node is not self._root:
            if node.parent is None:
                raise ValueError(f"stale handle {handle!r}: its node was evicted or is not in this tree")
            path.append(node)
            node = node.parent
        return path

    def _is_evictable_leaf(self, node: RadixNode) -> bool:
        return node.parent is not None and not node.children and node.ref_count == 0

    def _push_if_evictable(self, node: RadixNode) -> None:
        if not self._is_evictable_leaf(node):
            return
        if len(self._heap) > 2 * self._num_nodes + 64:
            self._rebuild_heap()  # also pushes `node`
            return
        self._pushes += 1
        heapq.heappush(self._heap, (node.last_access, node.seq, self._pushes, node))

    def _rebuild_heap(self) -> None:
        """Drops the stale entries: one entry per unreferenced leaf."""
        self._heap = []
        for node in self._nodes():
            if self._is_evictable_leaf(node):
                self._pushes += 1
                self._heap.append((node.last_access, node.seq, self._pushes, node))
        heapq.heapify(self._heap)

    def _remove_leaf(self, node: RadixNode) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[node.tokens[: self._page_size]]
        node.parent = None  # marks it evicted: its handle is stale now
        self._held.difference_update(node.pages)
        self._num_nodes -= 1
        self._push_if_evictable(parent)

    def _nodes(self) -> Iterator[RadixNode]:
        """Every node but the root, depth first, children in insertion order."""
        stack = list(reversed(self._root.children.values()))
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(node.children.values()))
