"""Prompt lookup: drafts copied from the latest earlier occurrence of the context's suffix."""

from __future__ import annotations

import time

import numpy as np

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
        # seq_id -> (context length, drafts): the lookup ``available`` made for this step.
        self._looked_up: dict[int, tuple[int, np.ndarray]] = {}

    def available(self, seq: Sequence, k: int) -> int:
        """Looks up now (it costs microseconds) and keeps the drafts for ``propose``."""
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
        index = self._index.get(seq.seq_id)
        if index is None:  # not ``setdefault``: building a native index costs ~0.1 ms
            index = self._index[seq.seq_id] = NgramIndex(self.min_n, self.max_n)
        index.extend(seq.tokens[len(index) :])
        return index.propose(k)

    def warm_up(self, max_rows: int) -> None:
        """Nothing to measure ahead: the lookup's cost is measured per call, and tiny."""

    def on_verified(self, seqs: list[Sequence], proposed: list[int], accepted: list[int]) -> None:
        """Nothing to roll back: the index only ever sees the sequence's accepted tokens."""

    def remove(self, seq: Sequence) -> None:
        self._index.pop(seq.seq_id, None)
        self._looked_up.pop(seq.seq_id, None)
