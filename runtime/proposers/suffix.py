"""Suffix decoding: drafts from suffix trees over this request's prompt and output, and over
earlier requests' outputs (runtime/suffix_cache.py), whichever expects more accepted tokens."""

from __future__ import annotations

import time

import numpy as np

from ..request import Sequence
from ..speculation import DraftCosts
from ..suffix_cache import SuffixCache, SuffixTree
from .base import Proposal, Proposer


class SuffixProposer(Proposer):
    """No model, like prompt lookup, but a draft follows the most frequent continuation of the
    best-matching suffix rather than the latest one, runs as long as its estimated chance holds
    (``min_token_prob``; at most ``max_spec_factor`` times the match's length), and may come
    from another request. Deterministic, so acceptance uses the target's probabilities alone."""

    def __init__(
        self, max_depth: int, max_spec_factor: float, min_token_prob: float, cache_bytes: int
    ):
        self.max_depth, self.max_spec_factor = max_depth, max_spec_factor
        self.min_token_prob = min_token_prob
        self.cache = SuffixCache(max_depth, cache_bytes)
        self.costs = DraftCosts(model=False)
        self._trees: dict[int, SuffixTree] = {}  # seq_id -> its prompt and output so far
        # seq_id -> (context length, drafts): the lookup ``available`` made for this step.
        self._looked_up: dict[int, tuple[int, np.ndarray]] = {}

    def available(self, seq: Sequence, k: int) -> int:
        """Looks up now (tens of microseconds) and keeps the drafts for ``propose``."""
        drafts = self._lookup(seq, k)
        self._looked_up[seq.seq_id] = (len(seq.tokens), drafts)
        return len(drafts)

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposal:
        start = time.perf_counter()
        drafts = []
        for seq, k in zip(seqs, num_tokens, strict=True):
            length, found = self._looked_up.pop(seq.seq_id, (-1, None))
            fresh = length == len(seq.tokens) and len(found) >= k
            drafts.append(found[:k] if fresh else self._lookup(seq, k))
        self.costs.per_sequence.observe((time.perf_counter() - start) / len(seqs))
        return Proposal(tokens=drafts, probs=None)

    def _lookup(self, seq: Sequence, k: int) -> np.ndarray:
        tree = self._trees.get(seq.seq_id)
        if tree is None:
            tree = self._trees[seq.seq_id] = SuffixTree(self.max_depth)
        tree.extend(0, seq.tokens[tree.num_tokens(0) :])
        context = np.asarray(seq.tokens[-(self.max_depth - 1) :], dtype=np.int32)
        own = tree.speculate(context, k, self.max_spec_factor, self.min_token_prob)
        shared = self.cache.speculate(context, k, self.max_spec_factor, self.min_token_prob)
        return (shared if shared[2] > own[2] else own)[0]

    def warm_up(self, max_rows: int) -> None:
        """Nothing to measure ahead: the lookup's cost is measured per call, and small."""

    def on_verified(self, seqs: list[Sequence], proposed: list[int], accepted: list[int]) -> None:
        """Nothing to roll back: the trees only ever see accepted tokens."""

    def remove(self, seq: Sequence) -> None:
        """A finished sequence's output goes into the shared cache (an aborted one's does not:
        it may be cut anywhere); a preempted one keeps its tree for when it comes back."""
        if seq.finished:
            self._trees.pop(seq.seq_id, None)
            if seq.finish_reason != "abort":
                self.cache.add(seq.tokens[seq.num_prompt :])
        self._looked_up.pop(seq.seq_id, None)

    def metrics(self) -> dict:
        return {"suffix_cache": self.cache.metrics()}
