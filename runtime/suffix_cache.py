"""The cross-request side of suffix decoding: earlier requests' outputs in one suffix tree,
within a memory bound, least recently used first out.

Agents and editing tools send the same context again and get much the same answer back: a new
reply often repeats an earlier one. SuffixDecoding (arXiv 2411.04975) drafts from a tree over
earlier outputs as well as over the request's own prompt; vLLM ships it as method ``suffix``.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import threading
from collections.abc import Sequence

import numpy as np

from ._suffix import SuffixTree

__all__ = ["SuffixCache", "SuffixTree", "Speculation"]

# What a speculation returns: draft tokens, the chance that each draft and those before it are
# right, their sum (the expected number accepted), and how many context tokens were matched.
Speculation = tuple[np.ndarray, np.ndarray, float, int]


class SuffixCache:
    """Finished outputs in a :class:`SuffixTree`. An output equal to a cached one refreshes it
    rather than counting twice; past ``max_bytes`` of live nodes the least recently added or
    refreshed outputs are evicted. Safe to share between threads."""

    def __init__(self, max_depth: int, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.tree = SuffixTree(max_depth)
        self.max_bytes = max_bytes
        self.evictions = 0
        self._docs: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def add(self, tokens: Sequence[int] | np.ndarray) -> None:
        ids = np.asarray(tokens, dtype=np.int64)
        if not ids.size:
            return
        digest = hashlib.blake2b(ids.tobytes(), digest_size=16).digest()
        with self._lock:
            if digest in self._docs:
                self._docs.move_to_end(digest)
                return
            doc = self._docs[digest] = next(self._ids)
            self.tree.extend(doc, ids)
            while self._docs and self.tree.live_bytes > self.max_bytes:
                _, oldest = self._docs.popitem(last=False)
                self.tree.remove(oldest)
                self.evictions += 1

    def speculate(
        self, context: np.ndarray, max_tokens: int, max_spec_factor: float, min_token_prob: float
    ) -> Speculation:
        return self.tree.speculate(context, max_tokens, max_spec_factor, min_token_prob)

    def metrics(self) -> dict:
        return {
            "documents": self.tree.num_documents,
            "nodes": self.tree.num_nodes,
            "bytes": self.tree.live_bytes,
            "max_bytes": self.max_bytes,
            "evictions": self.evictions,
        }
