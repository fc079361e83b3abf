"""Automatic prefix caching: whole pages of K/V kept after their sequence ends, found again by the
tokens that wrote them.

A page's keys and values are a function of the tokens up to its end and nothing else: every row
is computed the same way whichever pass, chunk or batch it falls in (docs/exactness.md). So a new
sequence whose first ``n`` pages of tokens equal a cached chain can share those pages instead of
computing them, and its output is bit for bit the one it would have had without the cache.

The cache is a tree with one node per page, keyed by the page's tokens under its parent (a radix
tree at page granularity, exact: no hashes, so no collision can hand over wrong K/V). It holds
one reference on each of its pages in the page pool; a page that only the cache holds is free to
take back, least recently used leaf first, when the pool runs out of free pages. A page some
sequence uses is never evicted, and neither is a node with children (they would be lost with it).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence

import numpy as np


@dataclasses.dataclass(eq=False)
class _Node:
    page: int
    parent: _Node | None
    tokens: tuple[int, ...]
    last_used: int = 0
    children: dict[tuple[int, ...], _Node] = dataclasses.field(default_factory=dict)


class PrefixCache:
    def __init__(self, page_size: int):
        self.page_size = page_size
        self._root = _Node(-1, None, ())
        self._clock = itertools.count(1)
        self._by_page: dict[int, _Node] = {}
        # [page]: whether the cache holds it, for ``evictable`` to find the ones in use without
        # a walk over every cached page in Python (~0.15 ms a step with thousands cached).
        self._cached = np.zeros(0, bool)

    @property
    def num_pages(self) -> int:
        return len(self._by_page)

    def match(self, tokens: Sequence[int]) -> list[int]:
        """The pages of the longest cached chain that ``tokens`` start with, whole pages only;
        the chain counts as just used."""
        node, pages, now = self._root, [], next(self._clock)
        for chunk in self._chunks(tokens):
            node = node.children.get(chunk)
            if node is None:
                break
            node.last_used = now
            pages.append(node.page)
        return pages

    def store(self, tokens: Sequence[int], pages: Sequence[int]) -> list[int]:
        """Cache the whole pages of ``tokens`` (``pages[i]`` holds tokens ``i * page_size``
        onwards); returns the pages newly cached, on which the caller takes a reference. A page
        whose tokens are cached already stays with its sequence."""
        node, added, now = self._root, [], next(self._clock)
        for chunk, page in zip(self._chunks(tokens), pages, strict=False):
            child = node.children.get(chunk)
            if child is None:
                child = node.children[chunk] = self._by_page[page] = _Node(page, node, chunk)
                added.append(page)
                if page >= len(self._cached):
                    grown = np.zeros(max(page + 1, 2 * len(self._cached)), bool)
                    grown[: len(self._cached)] = self._cached
                    self._cached = grown
                self._cached[page] = True
            child.last_used = now
            node = child
        return added

    def evictable(self, refs: np.ndarray) -> int:
        """Pages eviction could take back: those in subtrees that no sequence uses (``refs``:
        each page's reference count, the cache's included). The pool asks before every step,
        so this walks up from the pages in use only, not over the whole tree: they and their
        ancestors stay, the rest can go."""
        if not self._by_page:
            return 0
        kept: set[int] = set()
        in_use = self._cached[: len(refs)] & (refs[: len(self._cached)] > 1)
        for page in np.flatnonzero(in_use).tolist():
            node = self._by_page[page]
            while node is not self._root and node.page not in kept:
                kept.add(node.page)
                node = node.parent
        return len(self._by_page) - len(kept)

    def evict(self, count: int, refs: np.ndarray) -> list[int]:
        """Drop up to ``count`` pages that only the cache holds, least recently used leaves
        first (a parent becomes a leaf once its children are gone); returns them for the caller
        to release."""
        dropped: list[int] = []
        while len(dropped) < count:
            leaves = [n for n in self._nodes() if not n.children and refs[n.page] == 1]
            if not leaves:
                break
            leaves.sort(key=lambda n: n.last_used)
            for leaf in leaves[: count - len(dropped)]:
                del leaf.parent.children[leaf.tokens]
                del self._by_page[leaf.page]
                self._cached[leaf.page] = False
                dropped.append(leaf.page)
        return dropped

    def _nodes(self) -> Iterator[_Node]:
        """Every node, each after its parent."""
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _chunks(self, tokens: Sequence[int]) -> Iterator[tuple[int, ...]]:
        size = self.page_size
        for start in range(0, len(tokens) - size + 1, size):
            yield tuple(tokens[start : start + size])
