"""The one small interface every draft source implements (as vLLM v1's ``spec_decode``)."""

from __future__ import annotations

import abc
import dataclasses

import numpy as np

from ..request import Sequence
from ..sampler import DraftProbs
from ..speculation import DraftCosts


@dataclasses.dataclass
class Proposal:
    """Draft tokens per sequence (each at most the number asked for, possibly none) and the
    distributions they were sampled from, kept on the device, or ``None`` when the proposal is
    deterministic (a point mass at each draft). ``parents``, for a draft tree: each draft's
    parent, 0 for the sequence's pending token and j for its j-th draft (``None``: chains,
    draft j's parent being j - 1; a sequence's ``None`` in the list: its drafts are a chain)."""

    tokens: list[np.ndarray]
    probs: DraftProbs | None
    parents: list[np.ndarray | None] | None = None


class Proposer(abc.ABC):
    """A proposer measures its own costs into ``costs`` as it runs, for the speculation policy."""

    method: str  # its name in ``SpeculativeConfig.method`` and ``speculative_method``
    costs: DraftCosts
    width = 1  # drafts a step verifies per draft position (a tree's nodes per depth)

    def by_method(self) -> dict[str, Proposer]:
        """The proposers the policy chooses among, by method (this one alone, but for
        ``auto``)."""
        return {self.method: self}

    @abc.abstractmethod
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposal:
        """Guess up to ``num_tokens[i]`` (>= 1) tokens following ``seqs[i].tokens``."""

    @abc.abstractmethod
    def on_verified(self, seqs: list[Sequence], proposed: list[int], kept: list[list[int]]) -> None:
        """Of ``proposed[i]`` drafts the target accepted those at ``kept[i]`` (numbered from 1
        in the proposal's order: a chain's first few, a tree's path): roll back the rest."""

    @abc.abstractmethod
    def remove(self, seq: Sequence) -> None:
        """Forget a finished or preempted sequence."""

    def available(self, seq: Sequence, k: int) -> int:
        """How many of ``k`` drafts ``seq`` would get now (a model always drafts k); lets the
        policy plan with what a free proposer has to offer."""
        return k

    def chance(self, seq: Sequence) -> float | None:
        """The proposer's own estimate of the acceptance of the drafts ``available`` found for
        ``seq`` (None: none; the policy learns it from verified drafts alone)."""
        return None

    def catch_up(self, seq: Sequence) -> int:
        """Tokens a draft model reads for ``seq`` before drafting (none without a model)."""
        return 0

    def metrics(self) -> dict:
        """What the proposer reports beside the engine's counters (its caches' sizes)."""
        return {}

    @abc.abstractmethod
    def warm_up(self, max_rows: int) -> None:
        """Measure ``costs`` for batches of up to ``max_rows`` before the first request."""
