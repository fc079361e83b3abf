"""Suffix decoding: drafts from suffix trees over this request's prompt and output, and over
earlier requests' outputs (runtime/suffix_cache.py), whichever expects more accepted tokens."""

from __future__ import annotations

import numpy as np

from ..request import Sequence
from ..suffix_cache import SuffixCache, SuffixTree
from .model_free import ModelFreeProposer


class SuffixProposer(ModelFreeProposer):
    """Like prompt lookup, but a draft follows the most frequent continuation of the
    best-matching suffix rather than the latest one, runs as long as its estimated chance holds
    (``min_token_prob``; at most ``max_spec_factor`` times the match's length), and may come
    from another request."""

    method = "suffix"

    def __init__(
        self, max_depth: int, max_spec_factor: float, min_token_prob: float, cache_bytes: int
    ):
        super().__init__()
        self.max_depth, self.max_spec_factor = max_depth, max_spec_factor
        self.min_token_prob = min_token_prob
        self.cache = SuffixCache(max_depth, cache_bytes)
        self._trees: dict[int, SuffixTree] = {}  # seq_id -> its prompt and output so far

    def _lookup(self, seq: Sequence, k: int) -> np.ndarray:
        tree = self._trees.get(seq.seq_id)
        if tree is None:
            tree = self._trees[seq.seq_id] = SuffixTree(self.max_depth)
        tree.extend(0, seq.tokens[tree.num_tokens(0) :])
        context = np.asarray(seq.tokens[-(self.max_depth - 1) :], dtype=np.int32)
        own = tree.speculate(context, k, self.max_spec_factor, self.min_token_prob)
        shared = self.cache.speculate(context, k, self.max_spec_factor, self.min_token_prob)
        return (shared if shared[2] > own[2] else own)[0]

    def remove(self, seq: Sequence) -> None:
        """A finished sequence's output goes into the shared cache (an aborted one's does not:
        it may be cut anywhere); a preempted one keeps its tree for when it comes back."""
        super().remove(seq)
        if seq.finished:
            self._trees.pop(seq.seq_id, None)
            if seq.finish_reason != "abort":
                self.cache.add(seq.tokens[seq.num_prompt :])

    def metrics(self) -> dict:
        return {"suffix_cache": self.cache.metrics()}
