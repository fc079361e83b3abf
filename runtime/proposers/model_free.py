"""What the proposers without a model share: drafts looked up in an index of the sequence's
tokens (and, for suffix decoding, of earlier outputs), at no cost worth pricing ahead."""

from __future__ import annotations

import abc
import time

import numpy as np

from ..request import Sequence
from ..speculation import DraftCosts
from .base import Proposal, Proposer


class ModelFreeProposer(Proposer):
    """The lookup ``available`` makes to tell the policy what there is to draft is kept and
    handed to ``propose`` in the same step. Deterministic drafts: acceptance uses the target's
    probabilities alone."""

    def __init__(self) -> None:
        self.costs = DraftCosts(model=False)
        # seq_id -> (context length, drafts): the lookup ``available`` made for this step.
        self._looked_up: dict[int, tuple[int, np.ndarray]] = {}

    @abc.abstractmethod
    def _lookup(self, seq: Sequence, k: int) -> np.ndarray:
        """Up to ``k`` drafts following ``seq.tokens`` (tens of microseconds at most)."""

    def available(self, seq: Sequence, k: int) -> int:
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

    def warm_up(self, max_rows: int) -> None:
        """Nothing to measure ahead: the lookup's cost is measured per call, and small."""

    def on_verified(self, seqs: list[Sequence], proposed: list[int], kept: list[list[int]]) -> None:
        """Nothing to roll back: the indexes only ever see accepted tokens."""

    def remove(self, seq: Sequence) -> None:
        self._looked_up.pop(seq.seq_id, None)
