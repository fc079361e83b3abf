"""Speculation counters (per sequence and engine-wide), the speculation policy's decisions
against the measured step times, and where the time goes.

Counters mirror vLLM's ``spec_decode`` metrics (drafts, draft tokens, accepted tokens,
accepted per position) so dashboards built for vLLM read the same figures.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

# Decode steps whose decisions ``SpeculationLog`` keeps in full.
RECENT_STEPS = 64


@dataclasses.dataclass
class SpecStats:
    num_drafts: int = 0  # verification steps that checked at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)
    steps_by_k: list[int] = dataclasses.field(default_factory=list)  # [k]: decode steps given k

    def record_choice(self, k: int, steps: int = 1) -> None:
        """``steps`` decode steps were planned with ``k`` drafts (the proposer may have found
        fewer)."""
        if k >= len(self.steps_by_k):
            self.steps_by_k += [0] * (k + 1 - len(self.steps_by_k))
        self.steps_by_k[k] += steps

    def record(self, num_proposed: int, num_accepted: int) -> None:
        if num_proposed == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        self._grow(num_proposed)
        for pos in range(num_accepted):
            self.accepted_per_position[pos] += 1

    def merge(self, other: SpecStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self._grow(len(other.accepted_per_position))
        for pos, count in enumerate(other.accepted_per_position):
            self.accepted_per_position[pos] += count
        for k, steps in enumerate(other.steps_by_k):
            self.record_choice(k, steps)

    def _grow(self, positions: int) -> None:
        missing = positions - len(self.accepted_per_position)
        if missing > 0:
            self.accepted_per_position += [0] * missing

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification step: accepted drafts plus the target's own."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def to_dict(self) -> dict:
        return {
            **dataclasses.asdict(self),
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
        }


@dataclasses.dataclass
class StepRecord:
    """One decode step: what the policy chose for each sequence and why, and how long it took."""

    sequences: list[str]  # "request_id" or "request_id/index" for n > 1
    num_draft: list[int]
    acceptance: list[float]  # the estimates the choice was made with
    predicted_seconds: float | None
    measured_seconds: float
    expected_tokens: float  # emitted tokens the choice expected, by the estimates
    emitted_tokens: int  # accepted drafts plus one per sequence: what the step made
    methods: list[str] = dataclasses.field(default_factory=list)  # the proposer per sequence


class SpeculationLog:
    """Per decode step: the k chosen per sequence and predicted versus measured step time; the
    last ``RECENT_STEPS`` in full, totals over all."""

    def __init__(self) -> None:
        self.recent: collections.deque[StepRecord] = collections.deque(maxlen=RECENT_STEPS)
        self.num_steps = 0
        self.steps_by_k = SpecStats()  # engine-wide count of sequence-steps per chosen k
        # Sequence-steps that drafted, per proposer (method ``auto`` chooses among several).
        self.steps_by_method: collections.Counter[str] = collections.Counter()
        self.num_predicted = 0  # steps that had a prediction
        self.predicted_seconds = 0.0  # over those steps
        self.measured_seconds = 0.0  # ... the same steps, measured
        self.absolute_error_seconds = 0.0
        self.expected_tokens = 0.0  # over the steps that had a prediction
        self.emitted_tokens = 0  # ... the same steps

    def record(self, step: StepRecord) -> None:
        self.recent.append(step)
        self.num_steps += 1
        for k in step.num_draft:
            self.steps_by_k.record_choice(k)
        # A step planned without the policy (nothing to draft) names no methods.
        drafted = zip(step.methods, step.num_draft, strict=False)
        self.steps_by_method.update(m for m, k in drafted if k)
        if step.predicted_seconds is not None:
            self.num_predicted += 1
            self.predicted_seconds += step.predicted_seconds
            self.measured_seconds += step.measured_seconds
            self.absolute_error_seconds += abs(step.predicted_seconds - step.measured_seconds)
            self.expected_tokens += step.expected_tokens
            self.emitted_tokens += step.emitted_tokens

    def to_dict(self) -> dict:
        return {
            "num_steps": self.num_steps,
            "sequence_steps_by_k": self.steps_by_k.steps_by_k,
            "drafting_sequence_steps_by_method": dict(self.steps_by_method),
            "num_predicted": self.num_predicted,
            "predicted_seconds": self.predicted_seconds,
            "measured_seconds": self.measured_seconds,
            "absolute_error_seconds": self.absolute_error_seconds,
            "expected_tokens": self.expected_tokens,
            "emitted_tokens": self.emitted_tokens,
            "recent": [dataclasses.asdict(r) for r in self.recent],
        }


class Timers:
    """Seconds spent per phase (schedule, execute, commit, process; within execute: draft,
    decode, verify, sample) and how often it ran, accumulated over steps."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - t0
            self.calls[phase] += 1
