"""Several proposers in one engine, the policy choosing each sequence's per step
(``GoodputPolicy.choose_methods``): method ``auto`` (suffix decoding and a draft model), and a
draft model's chains and trees (a tree width with automatic k)."""

from __future__ import annotations

from ..request import Sequence
from ..sampler import DraftProbs
from .base import Proposal, Proposer


class AutoProposer(Proposer):
    """Hands each sequence to the proposer the scheduler chose for it this step
    (``Sequence.draft_method``) and merges their proposals into one verify pass: a draft
    model's sampled drafts keep their distributions, the model-free proposer's are point
    masses. A proposer that skipped steps of a sequence sees what they made when it drafts
    again: the draft model catches up (the policy prices that), a suffix tree extends itself
    from the sequence's tokens."""

    method = "auto"

    def __init__(self, proposers: dict[str, Proposer]):
        self._proposers = proposers
        # The step's ``draft`` costs are the draft model's; the model-free proposer's are
        # ``StepCosts.free`` (engine.py).
        self.costs = max(proposers.values(), key=lambda p: p.costs.model).costs

    def by_method(self) -> dict[str, Proposer]:
        return dict(self._proposers)

    def _groups(self, seqs: list[Sequence]) -> dict[str, list[int]]:
        groups: dict[str, list[int]] = {}
        for i, seq in enumerate(seqs):
            groups.setdefault(seq.draft_method, []).append(i)
        return groups

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposal:
        tokens, rows, data = [None] * len(seqs), [None] * len(seqs), None
        parents: list = [None] * len(seqs)
        for method, group in self._groups(seqs).items():
            proposal = self._proposers[method].propose(
                [seqs[i] for i in group], [num_tokens[i] for i in group]
            )
            for j, i in enumerate(group):
                tokens[i] = proposal.tokens[j]
                if proposal.probs is not None:
                    data, rows[i] = proposal.probs.data, proposal.probs.rows[j]
                if proposal.parents is not None:
                    parents[i] = proposal.parents[j]
        trees = parents if any(p is not None for p in parents) else None
        return Proposal(tokens, None if data is None else DraftProbs(data, rows), trees)

    def on_verified(self, seqs: list[Sequence], proposed: list[int], kept: list[list[int]]) -> None:
        for method, group in self._groups(seqs).items():
            self._proposers[method].on_verified(
                [seqs[i] for i in group], [proposed[i] for i in group], [kept[i] for i in group]
            )

    def remove(self, seq: Sequence) -> None:
        for proposer in self._proposers.values():
            proposer.remove(seq)  # the draft model's chains and trees share one: it forgets once

    def warm_up(self, max_rows: int) -> None:
        for proposer in self._proposers.values():
            proposer.warm_up(max_rows)

    def metrics(self) -> dict:
        return {k: v for p in self._proposers.values() for k, v in p.metrics().items()}
