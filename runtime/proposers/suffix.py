"""Suffix decoding: drafts from suffix trees over this request's prompt and output, and over
earlier requests' outputs (runtime/suffix_cache.py), whichever expects more accepted tokens."""

from __future__ import annotations

import numpy as np

from ..request import Sequence
from ..suffix_cache import SuffixCache, SuffixTree
from .model_free import ModelFreeProposer

# Tokens of an earlier output that a reply's end must repeat for that output's statistics to price
# its drafts (``SuffixProposer.chance``).
COPY_MATCH = 8


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
        self._chances: dict[int, float] = {}  # seq_id -> its last lookup's chance per draft

    def _lookup(self, seq: Sequence, k: int) -> np.ndarray:
        tree = self._trees.get(seq.seq_id)
        if tree is None:
            tree = self._trees[seq.seq_id] = SuffixTree(self.max_depth)
        tree.extend(0, seq.tokens[tree.num_tokens(0) :])
        own = tree.speculate_tail(0, k, self.max_spec_factor, self.min_token_prob)
        context = np.asarray(seq.tokens[-(self.max_depth - 1) :], dtype=np.int32)
        shared = self.cache.speculate(context, k, self.max_spec_factor, self.min_token_prob)
        earlier = len(shared[0]) > 0 and shared[2] >= own[2]  # a tie: the longer evidence
        drafts, chances, _, matched = shared if earlier else own
        if earlier and matched >= COPY_MATCH:
            # the per-draft chance whose powers give the walk's last chance
            self._chances[seq.seq_id] = float(chances[-1]) ** (1 / len(chances))
        else:
            self._chances.pop(seq.seq_id, None)
        return drafts

    def chance(self, seq: Sequence) -> float | None:
        """Where the drafts follow an earlier output that the reply repeats (its last
        ``COPY_MATCH`` tokens or more), how often that output's matched text went on as drafted:
        1 for an exact copy. The engine-wide rate may have fallen with other replies' rejected
        drafts and kept the policy from drafting a copy whole (a second round of the same
        requests drafted nothing for ~24 steps, tests/test_speculation_greedy.py). Shorter
        matches, and the request's own text, keep the learnt rate: a phrase seen once reads 1
        too, and is rarely repeated whole."""
        return self._chances.get(seq.seq_id)

    def remove(self, seq: Sequence) -> None:
        """A finished sequence's output goes into the shared cache (an aborted one's does not:
        it may be cut anywhere); a preempted one keeps its tree for when it comes back."""
        super().remove(seq)
        self._chances.pop(seq.seq_id, None)
        if seq.finished:
            self._trees.pop(seq.seq_id, None)
            if seq.finish_reason != "abort":
                self.cache.add(seq.tokens[seq.num_prompt :])

    def metrics(self) -> dict:
        return {"suffix_cache": self.cache.metrics()}
