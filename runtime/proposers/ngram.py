"""Prompt lookup: drafts copied from the latest earlier occurrence of the context's suffix."""

from __future__ import annotations

import time

from ..ngram_index import NgramIndex
from ..request import Sequence
from ..speculation import DraftCosts
from .base import Proposal, Proposer


class NgramProposer(Proposer):
    """No model: the native index is extended with each sequence's new tokens and answers in
    O(match) per step. Deterministic, so acceptance uses the target's probabilities alone."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.costs = DraftCosts(model=False)
        self._index: dict[int, NgramIndex] = {}

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposal:
        start = time.perf_counter()
        drafts = []
        for seq, k in zip(seqs, num_tokens, strict=True):
            index = self._index.setdefault(seq.seq_id, NgramIndex(self.min_n, self.max_n))
            index.extend(seq.tokens[len(index) :])
            drafts.append(index.propose(k))
        self.costs.per_sequence.observe((time.perf_counter() - start) / len(seqs))
        return Proposal(tokens=drafts, probs=None)

    def warm_up(self, max_rows: int) -> None:
        """Nothing to measure ahead: the lookup's cost is measured per call, and tiny."""

    def on_verified(self, seqs: list[Sequence], proposed: list[int], accepted: list[int]) -> None:
        """Nothing to roll back: the index only ever sees the sequence's accepted tokens."""

    def remove(self, seq: Sequence) -> None:
        self._index.pop(seq.seq_id, None)
