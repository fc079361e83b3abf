"""A speculation policy for tests: every sequence's k drawn at random each step."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mlc_spec.runtime.speculation import Candidate, Decision, StepCosts, StepShape


class RandomK:
    """k uniform in 0..cap per sequence and step; requests that pinned their k keep it. With
    several proposers (method auto), each sequence's proposer is drawn too. ``chunks``: the
    prompt tokens it was told ride in each step it weighed."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.chunks: list[int] = []

    def choose(
        self, batch: list[Candidate], costs: StepCosts, calibration: Sequence[float] = ()
    ) -> Decision:
        ks = [
            c.pinned if c.pinned is not None else int(self.rng.integers(0, c.cap + 1))
            for c in batch
        ]
        return Decision(ks, None, 0.0)

    def choose_methods(
        self,
        options: list[dict[str, Candidate]],
        costs: StepCosts,
        joining: int = 0,
        chunk: int = 0,
    ) -> tuple[Decision, list[str]]:
        self.chunks.append(chunk)
        methods = [list(o)[int(self.rng.integers(0, len(o)))] for o in options]
        return self.choose([o[m] for o, m in zip(options, methods, strict=True)], costs), methods


class Declines:
    """No drafts for automatic sequences; pinned ones keep theirs."""

    def choose_methods(
        self,
        options: list[dict[str, Candidate]],
        costs: StepCosts,
        joining: int = 0,
        chunk: int = 0,
    ) -> tuple[Decision, list[str]]:
        ks = [next(iter(o.values())).pinned or 0 for o in options]
        step = costs.predict(StepShape.of(ks, [0] * len(ks)))
        return Decision(ks, step, float(len(ks))), [next(iter(o)) for o in options]


class Marginal:
    """One draft for every automatic sequence that has one, each step, predicted to gain
    ``gain`` over the plain step."""

    def __init__(self, gain: float):
        self.gain = gain

    def choose_methods(
        self,
        options: list[dict[str, Candidate]],
        costs: StepCosts,
        joining: int = 0,
        chunk: int = 0,
    ) -> tuple[Decision, list[str]]:
        cands = [next(iter(o.values())) for o in options]
        ks = [c.pinned if c.pinned is not None else min(1, c.cap) for c in cands]
        step = costs.predict(StepShape.of(ks, [0] * len(ks)))
        decision = Decision(ks, step, float(len(ks)), gain=self.gain)
        return decision, [next(iter(o)) for o in options]


class Watching(Marginal):
    """``Marginal`` at a gain past any refresh, noting each step's rows and the sequences the
    scheduler expects to join them."""

    def __init__(self):
        super().__init__(gain=2.0)
        self.seen: list[tuple[int, int]] = []

    def choose_methods(
        self,
        options: list[dict[str, Candidate]],
        costs: StepCosts,
        joining: int = 0,
        chunk: int = 0,
    ) -> tuple[Decision, list[str]]:
        self.seen.append((len(options), joining))
        return super().choose_methods(options, costs, joining)
