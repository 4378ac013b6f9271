"""The radix cache against a naive reference, under random operation sequences."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baton.common.cache.allocator import PageAllocator
from baton.common.cache.radix import RadixCache

PAGE = 2
ALPHABET = st.integers(0, 2)  # few symbols, so keys share prefixes often


class Reference:
    """Token prefixes present, as a set of page-aligned tuples."""

    def __init__(self) -> None:
        self.keys: set[tuple[int, ...]] = set()

    def insert(self, tokens: list[int]) -> None:
        for i in range(PAGE, len(tokens) + 1, PAGE):
            self.keys.add(tuple(tokens[:i]))

    def match_len(self, tokens: list[int]) -> int:
        best = 0
        for i in range(PAGE, len(tokens) + 1, PAGE):
            if tuple(tokens[:i]) in self.keys:
                best = i
        return best


ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.lists(ALPHABET, min_size=0, max_size=8)),
        st.tuples(st.just("match"), st.lists(ALPHABET, min_size=0, max_size=8)),
        st.tuples(st.just("lock"), st.lists(ALPHABET, min_size=0, max_size=8)),
        st.tuples(st.just("unlock"), st.integers(0, 10)),
        st.tuples(st.just("evict"), st.integers(1, 6)),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_radix_matches_reference(sequence) -> None:  # type: ignore[no-untyped-def]
    alloc = PageAllocator(200)
    tree = RadixCache(PAGE, alloc.free)
    ref = Reference()
    locked: list = []
    for op, arg in sequence:
        if op == "insert":
            tokens = arg[: len(arg) - len(arg) % PAGE]
            pages = alloc.alloc(len(tokens) // PAGE)
            already = tree.insert(tokens, pages)
            assert already == ref.match_len(tokens)
            alloc.free(pages[: already // PAGE])  # the caller's duplicates
            ref.insert(tokens)
        elif op == "match":
            pages, _ = tree.match_prefix(arg)
            assert len(pages) * PAGE == ref.match_len(arg)
        elif op == "lock":
            pages, node = tree.match_prefix(arg)
            tree.lock(node)
            locked.append((node, list(arg[: len(pages) * PAGE]), pages))
        elif op == "unlock" and locked:
            node, _, _ = locked.pop(arg % len(locked))
            tree.unlock(node)
        elif op == "evict":
            tree.evict(arg)
            # rebuild the reference: whatever survived
            ref.keys = {k for k in ref.keys if len(tree.match_prefix(list(k))[0]) * PAGE == len(k)}
        # a locked prefix is never evicted, and still maps to the same pages
        for _node, tokens, pages in locked:
            now, _ = tree.match_prefix(tokens)
            assert now == pages
        tree.check_integrity()
        owned = tree.owned_pages()
        assert not any(alloc.is_free(p) for p in owned)
        assert len(owned) + alloc.num_free == 200
    for node, _, _ in locked:
        tree.unlock(node)
    tree.reset()
    assert alloc.num_free == 200
