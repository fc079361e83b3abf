"""The one small interface every draft source implements (as vLLM v1's ``spec_decode``)."""

from __future__ import annotations

import abc
import dataclasses

import numpy as np

from ..request import Sequence


@dataclasses.dataclass
class Proposal:
    """Draft tokens per sequence (each at most the number asked for, possibly none) and the
    distributions they were sampled from, or ``None`` when the proposer is deterministic."""

    tokens: list[np.ndarray]
    probs: list[np.ndarray] | None


class Proposer(abc.ABC):
    @abc.abstractmethod
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposal:
        """Guess up to ``num_tokens[i]`` tokens following ``seqs[i].tokens``."""

    @abc.abstractmethod
    def on_verified(self, seqs: list[Sequence], proposed: list[int], accepted: list[int]) -> None:
        """The target accepted ``accepted[i]`` of ``proposed[i]`` drafts: roll back the rest."""

    @abc.abstractmethod
    def remove(self, seq: Sequence) -> None:
        """Forget a finished or preempted sequence."""
