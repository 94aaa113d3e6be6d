"""The radix prefix cache (`minisgl.scheduler.radix`): a property test against a brute-force model, and
unit tests for the edge cases."""

from __future__ import annotations

import ast
import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minisgl.scheduler import radix
from minisgl.scheduler.radix import RadixCache

Key = tuple[int, ...]


# -- the model ---------------------------------------------------------------------------------------


@dataclass
class Model:
    """The cache as a dict of cached page-aligned prefixes, one page each: prefix (tokens up to the end
    of a page) -> the page id holding that last page, with a reference count and a recency stamp per
    prefix. A model handle is (prefix, birth of that prefix); it is stale once the prefix was evicted."""

    ps: int
    page: dict[Key, int] = field(default_factory=dict)
    refs: dict[Key, int] = field(default_factory=dict)
    stamp: dict[Key, int] = field(default_factory=dict)
    born: dict[Key, int] = field(default_factory=dict)
    clock: int = 0
    births: int = 0

    def prefixes(self, tokens: list[int]) -> list[Key]:
        return [tuple(tokens[: i * self.ps]) for i in range(1, len(tokens) // self.ps + 1)]

    def cached_prefixes(self, tokens: list[int]) -> list[Key]:
        out = []
        for prefix in self.prefixes(tokens):
            if prefix not in self.page:
                break
            out.append(prefix)
        return out

    def handle(self, key: Key) -> tuple[Key, int]:
        return key, self.born.get(key, 0)

    def match(self, tokens: list[int]) -> tuple[list[int], tuple[Key, int]]:
        self.clock += 1
        path = self.cached_prefixes(tokens)
        for prefix in path:
            self.stamp[prefix] = self.clock
        return [self.page[p] for p in path], self.handle(path[-1] if path else ())

    def insert(self, tokens: list[int], pages: list[int]) -> tuple[int, list[int], tuple[Key, int]]:
        self.clock += 1
        prefixes = self.prefixes(tokens)
        cached = self.cached_prefixes(tokens)
        for prefix, page in zip(prefixes[len(cached) :], pages[len(cached) :]):
            self.births += 1
            self.page[prefix], self.refs[prefix], self.born[prefix] = page, 0, self.births
        for prefix in prefixes:
            self.stamp[prefix] = self.clock
        duplicates = [page for page, p in zip(pages, cached) if page != self.page[p]]
        return len(cached), duplicates, self.handle(prefixes[-1] if prefixes else ())

    def is_stale(self, handle: tuple[Key, int]) -> bool:
        key, born = handle
        return bool(key) and self.born.get(key) != born

    def add_ref(self, handle: tuple[Key, int], delta: int) -> None:
        key, _ = handle
        for i in range(1, len(key) // self.ps + 1):
            self.refs[key[: i * self.ps]] += delta

    def eviction_order(self) -> list[Key]:
        """Every unreferenced prefix in the order LRU-of-unreferenced-leaves evicts them, one page at
        a time."""
        remaining = set(self.page)
        order = []
        while True:
            leaves = [
                p
                for p in remaining
                if self.refs[p] == 0
                and not any(len(q) == len(p) + self.ps and q[: len(p)] == p for q in remaining)
            ]
            if not leaves:
                return order
            oldest = min(self.stamp[p] for p in leaves)
            # every match/insert stamps one root-to-node path, so no two leaves share a stamp
            assert sum(self.stamp[p] == oldest for p in leaves) == 1
            victim = next(p for p in leaves if self.stamp[p] == oldest)
            order.append(victim)
            remaining.remove(victim)

    def remove(self, freed: list[int]) -> None:
        by_page = {page: prefix for prefix, page in self.page.items()}
        for page in freed:
            prefix = by_page[page]
            assert self.refs[prefix] == 0, f"page {page} of a referenced prefix was evicted"
            for table in (self.page, self.refs, self.stamp, self.born):
                del table[prefix]


# -- the property test -------------------------------------------------------------------------------

# a token sequence: (base, cut, pages, tail) is the first `cut` pages of an earlier sequence (picked by
# `base`; none when negative) followed by `pages` (each int picks one of three page patterns) and a
# partial page `tail`, so that sequences share prefixes and diverge at any page, often inside a node
SEQUENCE = st.tuples(
    st.integers(-1, 20),
    st.integers(0, 5),
    st.lists(st.integers(0, 2), max_size=3),
    st.lists(st.integers(0, 1), max_size=3),
)
# an operation: its kind (weighted: inserts and matches grow the tree, clear is rare), a sequence, a
# number (which handle to lock or unlock, how many pages to evict), how many matched pages an insert
# reuses (None: it does not match first) and whether a match or an insert also locks
KINDS = ["insert"] * 5 + ["match"] * 4 + ["lock"] * 3 + ["unlock"] * 3 + ["evict"] * 3 + ["clear"]
OPS = st.tuples(
    st.sampled_from(KINDS), SEQUENCE, st.integers(0, 50), st.sampled_from([None, 0, 1, 99]), st.booleans()
)


def page_patterns(ps: int) -> tuple[list[int], ...]:
    """Three pages that share leading tokens, so that pages differ inside, not only at their start."""
    return [0] * ps, [0] * (ps - 1) + [1], [1] + [0] * (ps - 1)


class Harness:
    """Runs each operation on the tree and the model and compares them; also keeps the caller's side:
    a free list of page ids that are not in the tree."""

    def __init__(self, ps: int) -> None:
        self.tree, self.model = RadixCache(ps), Model(ps)
        self.free: list[int] = []
        self.allocated = 0
        self.handles: list[tuple[radix.RadixNode, tuple[Key, int]]] = []
        self.locked: list[tuple[radix.RadixNode, tuple[Key, int]]] = []
        self.sequences: list[list[int]] = []  # the page choices of every sequence so far

    def tokens(self, sequence: tuple[int, int, list[int], list[int]]) -> list[int]:
        base, cut, pages, tail = sequence
        choices = (
            self.sequences[base % len(self.sequences)][:cut] if base >= 0 and self.sequences else []
        ) + pages
        self.sequences.append(choices)
        patterns, ps = page_patterns(self.model.ps), self.model.ps
        return [t for c in choices for t in patterns[c]] + tail[: ps - 1]

    def alloc(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            if self.free:
                out.append(self.free.pop(0))
            else:
                out.append(self.allocated)
                self.allocated += 1
        return out

    def give_back(self, pages: list[int]) -> None:
        held = set(self.model.page.values())
        for page in pages:
            assert page not in self.free, f"page {page} freed twice"
            assert page not in held, f"page {page} is both held by the tree and freed"
            self.free.append(page)

    def match(self, tokens: list[int], lock: bool) -> list[int]:
        got = self.tree.match(tokens, lock=lock)
        pages, handle = self.model.match(tokens)
        assert got.pages == pages
        assert got.num_tokens == len(pages) * self.model.ps
        if pages:
            assert got.handle.pages[-1] == pages[-1]  # the handle ends at the match's last page
        self.handles.append((got.handle, handle))
        if lock:
            self.model.add_ref(handle, +1)
            self.locked.append((got.handle, handle))
        return pages

    def insert(self, tokens: list[int], reuse: int | None, lock: bool) -> None:
        n = len(tokens) // self.model.ps
        matched = self.match(tokens, lock=False)[: reuse or 0] if reuse is not None else []
        pages = matched + self.alloc(n - len(matched))
        got = self.tree.insert(tokens, pages, lock=lock)
        num_cached, duplicates, handle = self.model.insert(tokens, pages)
        assert (got.num_cached_pages, got.duplicate_pages) == (num_cached, duplicates)
        assert set(pages[num_cached:]) <= set(self.tree.held_pages())
        self.give_back(duplicates)
        self.handles.append((got.handle, handle))
        if lock:
            self.model.add_ref(handle, +1)
            self.locked.append((got.handle, handle))

    def lock(self, index: int) -> None:
        if not self.handles:
            return
        tree_handle, handle = self.handles[index % len(self.handles)]
        if self.model.is_stale(handle):
            with pytest.raises(ValueError, match="stale handle"):
                self.tree.lock(tree_handle)
            return
        self.tree.lock(tree_handle)
        self.model.add_ref(handle, +1)
        self.locked.append((tree_handle, handle))

    def unlock(self, index: int) -> None:
        if not self.locked:
            return
        tree_handle, handle = self.locked.pop(index % len(self.locked))
        self.tree.unlock(tree_handle)
        self.model.add_ref(handle, -1)

    def evict(self, n: int) -> None:
        order = [self.model.page[p] for p in self.model.eviction_order()]
        stamps = {self.model.page[p]: self.model.stamp[p] for p in self.model.page}
        freed = self.tree.evict(n)
        assert len(freed) == len(set(freed))
        assert len(freed) >= min(n, len(order))  # at least n, unless fewer are evictable
        assert set(freed) == set(order[: len(freed)])  # exactly the least recently used leaves
        if len(freed) > n > 0:  # overshoot only to finish the node that crossed n (one stamp)
            assert {stamps[page] for page in order[n - 1 : len(freed)]} == {stamps[order[n - 1]]}
        if n == 0:
            assert freed == []
        self.model.remove(freed)
        self.give_back(freed)

    def clear(self) -> None:
        expected = {page for p, page in self.model.page.items() if self.model.refs[p] == 0}
        freed = self.tree.clear()
        assert len(freed) == len(set(freed)) and set(freed) == expected
        self.model.remove(freed)
        self.give_back(freed)

    def check(self) -> None:
        model, tree = self.model, self.tree
        held = tree.held_pages()
        assert len(held) == len(set(held))
        assert set(held) == set(model.page.values())
        assert set(held).isdisjoint(self.free)
        assert set(held) | set(self.free) == set(range(self.allocated))
        assert all(p[: -model.ps] in model.page for p in model.page if len(p) > model.ps)  # prefix-closed
        assert tree.num_pages == len(model.page)
        assert tree.num_referenced_pages == sum(r > 0 for r in model.refs.values())
        assert tree.num_evictable_pages == sum(r == 0 for r in model.refs.values())
        assert tree.clock == model.clock

    def run(self, op: tuple) -> None:
        kind, sequence, number, reuse, lock = op
        if kind == "insert":
            self.insert(self.tokens(sequence), reuse, lock)
        elif kind == "match":
            self.match(self.tokens(sequence), lock)
        elif kind == "evict":
            self.evict(number % 7)
        elif kind == "clear":
            self.clear()
        else:
            getattr(self, kind)(number)
        self.check()


@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,  # the same examples on every run
    database=None,  # nothing written to .hypothesis/
    suppress_health_check=[HealthCheck.too_slow],
)
@given(ps=st.sampled_from([1, 2, 4]), ops=st.lists(OPS, min_size=10, max_size=60))
def test_radix_cache_matches_a_brute_force_model(ps: int, ops: list[tuple]) -> None:
    harness = Harness(ps)
    for op in ops:
        harness.run(op)
    while harness.locked:  # everything unlocked, clear gives back every page
        harness.unlock(0)
        harness.check()
    harness.clear()
    harness.check()
    assert harness.tree.num_pages == 0 and sorted(harness.free) == list(range(harness.allocated))


# -- unit tests --------------------------------------------------------------------------------------


def test_prefix_shorter_than_a_page_matches_nothing() -> None:
    tree = RadixCache(4)
    inserted = tree.insert([1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11])  # the tail 9 is not cached
    assert inserted.handle.tokens == (1, 2, 3, 4, 5, 6, 7, 8) and inserted.handle.pages == [10, 11]
    short = tree.match([1, 2, 3])
    assert (short.pages, short.num_tokens) == ([], 0)
    tree.lock(short.handle)  # the root: nothing to count
    assert tree.num_referenced_pages == 0
    partial = tree.match([1, 2, 3, 4, 5, 6, 7])  # the second page is incomplete
    assert (partial.pages, partial.num_tokens) == ([10], 4)
    result = tree.insert([1, 2, 3], [])
    assert (result.num_cached_pages, result.duplicate_pages, tree.num_pages) == (0, [], 2)
    assert tree.match([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]).pages == [10, 11]


def test_exactly_one_page() -> None:
    tree = RadixCache(4)
    result = tree.insert([1, 2, 3, 4], [7])
    assert result.num_cached_pages == 0 and result.handle.pages == [7]
    assert tree.match([1, 2, 3, 4]).pages == [7]
    assert tree.match([1, 2, 3, 4, 9]).num_tokens == 4
    assert tree.match([1, 2, 3, 5]).pages == []  # differs in the last token of the page
    assert tree.match([2, 2, 3, 4]).pages == []
    assert (tree.num_pages, tree.num_nodes) == (1, 1)


def test_match_ending_inside_a_node_splits_it() -> None:
    tree = RadixCache(2)
    tree.insert([1, 2, 3, 4, 5, 6], [1, 2, 3])
    assert tree.num_nodes == 1
    match = tree.match([1, 2, 3, 4, 5, 9])  # diverges inside the third page
    assert (match.pages, match.num_tokens) == ([1, 2], 4)
    assert tree.num_nodes == 2 and match.handle.pages == [1, 2] and match.handle.tokens == (1, 2, 3, 4)
    tree.lock(match.handle)
    assert (tree.num_referenced_pages, tree.num_evictable_pages) == (2, 1)
    assert tree.evict(10) == [3]  # only the unreferenced lower part
    assert tree.match([1, 2, 3, 4, 5, 6]).pages == [1, 2]
    tree.unlock(match.handle)
    assert sorted(tree.clear()) == [1, 2] and tree.num_pages == 0


def test_split_keeps_a_locked_handle_valid() -> None:
    tree = RadixCache(1)
    handle = tree.insert([1, 2, 3], [10, 11, 12], lock=True).handle
    tree.match([1, 2])  # splits the node the handle is
    assert handle.tokens == (3,) and handle.pages == [12]
    assert tree.evict(3) == [] and tree.num_referenced_pages == 3
    tree.unlock(handle)
    assert tree.num_referenced_pages == 0
    assert tree.evict(1) == [12]  # the lower part is the leaf, evicted first


def test_insert_of_a_partially_cached_path() -> None:
    tree = RadixCache(2)
    tree.insert([1, 1, 2, 2], [1, 2])
    # fresh pages for the whole sequence: the first is a duplicate of the tree's page 1
    result = tree.insert([1, 1, 3, 3], [5, 6])
    assert (result.num_cached_pages, result.duplicate_pages) == (1, [5])
    assert result.handle.pages == [6] and sorted(tree.held_pages()) == [1, 2, 6]
    # pages from a match are the tree's own: not duplicates
    match = tree.match([1, 1, 2, 2, 4, 4])
    assert match.pages == [1, 2]
    result = tree.insert([1, 1, 2, 2, 4, 4], match.pages + [9])
    assert (result.num_cached_pages, result.duplicate_pages) == (2, [])
    assert tree.match([1, 1, 2, 2, 4, 4]).pages == [1, 2, 9]
    # a fully cached sequence: nothing new, the caller's page is a duplicate
    result = tree.insert([1, 1], [20])
    assert (result.num_cached_pages, result.duplicate_pages, result.handle.pages) == (1, [20], [1])
    assert sorted(tree.held_pages()) == [1, 2, 6, 9]
    # one ending inside a node splits it, so that the handle ends there
    tree.insert([7, 7, 8, 8], [30, 31])
    nodes = tree.num_nodes
    result = tree.insert([7, 7, 9], [40])
    assert (result.num_cached_pages, result.duplicate_pages, result.handle.pages) == (1, [40], [30])
    assert tree.num_nodes == nodes + 1 and tree.num_pages == 6
    assert tree.match([7, 7, 8, 8]).pages == [30, 31]


def test_lock_and_unlock_count_along_the_path() -> None:
    tree = RadixCache(1)
    tree.insert([1, 2, 3], [1, 2, 3])
    tree.insert([1, 2, 4], [1, 2, 4])  # splits: [1, 2] -> {[3], [4]}
    deep = tree.match([1, 2, 3]).handle
    tree.lock(deep)
    tree.lock(deep)
    other = tree.match([1, 2, 4], lock=True).handle
    parent = deep.parent
    assert parent is not None and parent is other.parent
    assert (deep.ref_count, other.ref_count, parent.ref_count) == (2, 1, 3)
    assert (tree.num_referenced_pages, tree.num_evictable_pages) == (4, 0)
    assert tree.evict(4) == []
    tree.unlock(other)
    assert tree.evict(4) == [4]
    tree.unlock(deep)
    assert tree.evict(4) == [] and parent.ref_count == 1
    tree.unlock(deep)
    assert (deep.ref_count, parent.ref_count, tree.num_referenced_pages) == (0, 0, 0)
    with pytest.raises(ValueError, match="ref_count is 0"):
        tree.unlock(deep)
    assert tree.evict(1) == [3]  # the leaf first, then its parent, a node at a time
    assert tree.evict(1) == [1, 2]


def test_clear_leaves_referenced_nodes_in_place() -> None:
    tree = RadixCache(2)
    kept = tree.insert([1, 1, 2, 2], [1, 2], lock=True).handle
    tree.insert([1, 1, 2, 2, 3, 3], [1, 2, 3])
    tree.insert([5, 5], [5])
    tree.insert([1, 1, 6, 6], [1, 6])
    assert sorted(tree.clear()) == [3, 5, 6]
    assert sorted(tree.held_pages()) == [1, 2] and tree.num_pages == tree.num_referenced_pages == 2
    assert tree.match([1, 1, 2, 2, 3, 3]).pages == [1, 2]
    tree.unlock(kept)
    assert sorted(tree.clear()) == [1, 2] and tree.num_pages == 0 and tree.num_nodes == 0


def test_evict_takes_the_least_recently_used_leaf_first() -> None:
    tree = RadixCache(1)
    tree.insert([1, 1], [10, 11])
    tree.insert([2], [20])
    tree.insert([3, 3, 3], [30, 31, 32])
    tree.match([1])  # splits [1, 1]; its upper page is newer now, its lower page is not
    assert tree.evict(1) == [11]
    assert tree.evict(1) == [20]
    assert tree.evict(1) == [30, 31, 32]  # a whole node, more than asked
    assert tree.evict(0) == []
    assert tree.evict(5) == [10] and tree.num_pages == 0


def test_stale_heap_entries_do_not_change_the_order() -> None:
    """Hundreds of touches leave stale heap entries (and rebuilds); the order is still LRU."""
    tree = RadixCache(1)
    for leaf in range(50):
        tree.insert([leaf], [leaf])
    rng = random.Random(0)
    last_touch = {leaf: leaf for leaf in range(50)}
    for step in range(1000):
        leaf = rng.randrange(50)
        tree.match([leaf])
        last_touch[leaf] = 50 + step
    freed = [page for _ in range(50) for page in tree.evict(1)]
    assert freed == sorted(range(50), key=last_touch.__getitem__)


def run_workload(seed: int) -> list:
    """A scheduler-like mix of operations; returns everything the tree answered."""
    rng, tree, answers, locked, next_page = random.Random(seed), RadixCache(2), [], [], 0
    for _ in range(400):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(12))]
        action = rng.random()
        if action < 0.4:
            match = tree.match(tokens, lock=True)
            locked.append(match.handle)
            pages = match.pages + list(range(next_page, next_page + len(tokens) // 2 - len(match.pages)))
            next_page += len(pages)
            result = tree.insert(tokens, pages)
            answers.append(("insert", match.pages, result.num_cached_pages, result.duplicate_pages))
        elif action < 0.6 and locked:
            tree.unlock(locked.pop(rng.randrange(len(locked))))
        elif action < 0.8:
            answers.append(("evict", tree.evict(rng.randrange(4))))
        else:
            answers.append(("match", tree.match(tokens).pages))
    return answers


def test_same_operations_give_the_same_evictions() -> None:
    first, second = run_workload(7), run_workload(7)
    assert first == second
    assert sum(len(a[1]) for a in first if a[0] == "evict") > 20  # the workload does evict
    assert first != run_workload(8)


def test_bad_input_raises_value_error_naming_the_value() -> None:
    for page_size in (0, -1):
        with pytest.raises(ValueError, match=f"got {page_size}"):
            RadixCache(page_size)
    tree = RadixCache(2)
    with pytest.raises(ValueError, match="got 1 pages for 5 tokens.*exactly 2"):
        tree.insert([1, 2, 3, 4, 5], [1])
    with pytest.raises(ValueError, match=r"repeated page ids \[4\]"):
        tree.insert([1, 2, 3, 4], [4, 4])
    tree.insert([1, 2], [8])
    with pytest.raises(ValueError, match="page id 8 at position 1"):
        tree.insert([3, 4, 5, 6], [9, 8])
    assert tree.held_pages() == [8]  # a refused insert caches nothing
    with pytest.raises(ValueError, match="got -1"):
        tree.evict(-1)
    handle = tree.match([1, 2]).handle
    with pytest.raises(ValueError, match="ref_count is 0"):
        tree.unlock(handle)
    assert tree.evict(1) == [8]
    with pytest.raises(ValueError, match="stale handle"):
        tree.lock(handle)  # evicted
    with pytest.raises(ValueError, match="stale handle"):
        RadixCache(2).lock(RadixCache(2).insert([1, 2], [1]).handle)  # another tree's


def test_the_module_does_not_import_torch() -> None:
    tree = ast.parse(Path(radix.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert imported and not any(name.split(".")[0] in ("torch", "minisgl") for name in imported)
