"""Speculation counters (per sequence and engine-wide) and where the time goes.

Counters mirror vLLM's ``spec_decode`` metrics (drafts, draft tokens, accepted tokens,
accepted per position) so dashboards built for vLLM read the same figures.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager


@dataclasses.dataclass
class SpecStats:
    num_drafts: int = 0  # verification steps that checked at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)

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


class Timers:
    """Seconds spent per phase (prefill, draft, verify, sample), accumulated over steps."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - t0
