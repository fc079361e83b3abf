"""How likely each sequence's next draft token is to be accepted.

The model is geometric: each draft token is accepted with probability alpha, given the ones before
it were, so k drafts yield (1 - alpha^(k+1)) / (1 - alpha) tokens. A step that accepted ``a`` of
``k`` drafts saw ``a`` acceptances and, if ``a < k``, one rejection.

Per sequence, alpha is the engine-wide rate (pooled over the per-position counts) used as a prior
worth ``PRIOR_WEIGHT`` draft tokens, updated by the sequence's own counts.

Where evidence is scarce the estimate is optimistic, an upper bound rather than a guess: the
engine-wide rate counts ``OPTIMISM`` phantom draft tokens, all accepted, on top of the checked
ones. Its bonus over the measured rate, OPTIMISM x (1 - rate) / (checked + OPTIMISM), shrinks as
drafts are checked. Without it a policy that drafts only where drafting pays never measures the
acceptance it needs: no drafts, no evidence.

Every count fades each step, so an estimate follows a text that changes character, and without
fresh evidence it drifts back to the prior, and the prior back to the optimistic bound: speculation
that was switched off gets tried again, rarely (the engine-wide counts fade slowly), and only where
it could pay at all.

The estimates are calibrated against what the chosen drafts made, by draft position. Choosing
drafts by estimate favours the sequences whose estimate is high by chance, and the geometric model
prices a first draft like the later ones, though a first draft is the likeliest to be rejected
(n-gram lookups on SmolLM2: 42% of first drafts accepted, 77-95% of the later ones given the ones
before). Uncalibrated, the drafting steps of SmolLM2 int8 at 8 rows expected 5.3 accepted drafts
and made 4.3, and the policy drafted where a plain decode was as fast. ``calibration()[j]`` is
the ratio of accepted to expected (j+1)-th drafts, at most 1: a correction that only ever lowers
what drafting is expected to make keeps the policy from trusting a lucky streak.

A draft model is estimated otherwise (``steady``): its acceptance is a property of the model pair
and the kind of text, which a sequence's last few steps tell little more about than the
engine-wide rate, so that rate weighs ``STEADY_PRIOR_WEIGHT`` draft tokens, and no calibration
applies. A draft model's later drafts are accepted about as often as its first (given the ones
before), so there is no position effect to correct; what calibration measured for it was its own
estimates' noise (the policy drafts more where an estimate is high by chance), and lowering every
estimate for that, a new sequence's included, kept automatic k well below a fixed k on chat text
(the Qwen pair, 2026-11-28: docs/benchmarks.md, serving).
"""

from __future__ import annotations

# A sequence's own counts fade by this factor per step: half-life ~3 steps, so after a long run of
# fully accepted drafts a string of rejections brings the estimate below 0.5 within ~10 steps.
SEQUENCE_DECAY = 0.8
# The engine-wide counts fade more slowly: half-life ~140 steps.
ENGINE_DECAY = 0.995
# The engine-wide prior counts as this many draft tokens against a sequence's own evidence.
PRIOR_WEIGHT = 2.0
# ... for a draft model (``steady``): its estimates then follow a sequence's own run of
# rejections less, and draw less of the policy's drafting to where they are high by chance.
STEADY_PRIOR_WEIGHT = 8.0
# Phantom accepted draft tokens in the engine-wide rate. Before any evidence the rate is 1, so
# the policy drafts wherever drafting could pay at all. A realistic guess does not do: at 0.7 the
# Qwen 1.5B/0.5B pair (int8 activations, batch 1) never drafted, though it accepts 80-100% of
# drafts on code. 4 tokens: a rejection of the very first draft leaves the rate at 0.8, not 0, and
# a step of 16 sequences checks 16 tokens or more, after which the bonus is at most (1 - rate) / 5.
# Where drafting does not pay, the fading counts bring a try back every ~75 steps at batch 1 (one
# draft) and every ~500 at batch 16 (tests/test_speculation_policy.py simulates both).
OPTIMISM = 4.0
# Calibration starts at 1 as if this many expected drafts per position had all been made, and
# drifts back to 1 as its evidence fades (at ``ENGINE_DECAY``).
CALIBRATION_PRIOR = 4.0


class AcceptanceEstimator:
    def __init__(self, steady: bool = False) -> None:
        self.steady = steady  # a draft model's: a stronger prior and no calibration
        self.tested: list[float] = []  # [j]: draft tokens at position j that were checked
        self.accepted: list[float] = []  # [j]: ... and accepted
        self._own: dict[int, list[float]] = {}  # seq_id -> [accepted, rejected], fading
        self.expected: list[float] = []  # [j]: (j+1)-th drafts the estimates expected accepted
        self.made: list[float] = []  # [j]: ... and were
        # The engine-wide prior and calibration, worked out once per change of the counts: the
        # policy asks for them per sequence and step (16 times a step at 16 rows).
        self._pooled: tuple[float, tuple[float, ...]] | None = None

    def _engine_wide(self) -> tuple[float, tuple[float, ...]]:
        if self._pooled is None:
            prior = (sum(self.accepted) + OPTIMISM) / (sum(self.tested) + OPTIMISM)
            calibration = tuple(
                min(1.0, (m + CALIBRATION_PRIOR) / (e + CALIBRATION_PRIOR))
                for m, e in zip(self.made, self.expected, strict=True)
            )
            self._pooled = prior, calibration
        return self._pooled

    def prior(self) -> float:
        """Engine-wide acceptance, pooled over positions, with ``OPTIMISM`` phantom acceptances."""
        return self._engine_wide()[0]

    def estimate(self, seq_id: int, prior: float | None = None) -> float:
        """The sequence's own counts against a prior worth ``PRIOR_WEIGHT`` draft tokens
        (``STEADY_PRIOR_WEIGHT`` for a draft model): the proposer's own estimate for its drafts
        where it has one (suffix decoding's match statistics), else the engine-wide rate."""
        accepted, rejected = self._own.get(seq_id, (0.0, 0.0))
        prior = self.prior() if prior is None else prior
        weight = STEADY_PRIOR_WEIGHT if self.steady else PRIOR_WEIGHT
        return (accepted + weight * prior) / (accepted + rejected + weight)

    def per_position(self) -> list[float]:
        """Engine-wide acceptance of position j given positions before it were accepted."""
        return [a / t if t else 0.0 for a, t in zip(self.accepted, self.tested, strict=True)]

    def calibration(self) -> tuple[float, ...]:
        """Per draft position j, what the (j+1)-th drafts made against what their estimates
        expected, at most 1; positions past the list: 1 (every position for a draft model)."""
        return self._engine_wide()[1]

    def fade(self, seq_ids: list[int]) -> None:
        """One step passed for these sequences (whether they drafted or not)."""
        self._pooled = None
        self.tested = [t * ENGINE_DECAY for t in self.tested]
        self.accepted = [a * ENGINE_DECAY for a in self.accepted]
        self.expected = [e * ENGINE_DECAY for e in self.expected]
        self.made = [m * ENGINE_DECAY for m in self.made]
        for seq_id in seq_ids:
            own = self._own.get(seq_id)
            if own is not None:
                own[0] *= SEQUENCE_DECAY
                own[1] *= SEQUENCE_DECAY

    def observe(self, seq_id: int, proposed: int, accepted: int, estimate: float) -> None:
        """A step's outcome for ``seq_id``: ``accepted`` of ``proposed`` drafts, chosen with
        acceptance ``estimate``."""
        if proposed == 0:
            return
        self._pooled = None
        if not self.steady:  # a draft model's calibration stays empty: every position 1
            missing = proposed - len(self.expected)
            if missing > 0:
                self.expected += [0.0] * missing
                self.made += [0.0] * missing
            for j in range(proposed):
                self.expected[j] += estimate ** (j + 1)
            for j in range(accepted):
                self.made[j] += 1
        checked = min(accepted + 1, proposed)  # positions up to and including the first reject
        missing = checked - len(self.tested)
        if missing > 0:
            self.tested += [0.0] * missing
            self.accepted += [0.0] * missing
        for j in range(checked):
            self.tested[j] += 1
        for j in range(accepted):
            self.accepted[j] += 1
        own = self._own.setdefault(seq_id, [0.0, 0.0])
        own[0] += accepted
        own[1] += accepted < proposed

    def forget(self, seq_id: int) -> None:
        self._own.pop(seq_id, None)

    def __len__(self) -> int:
        """Sequences with a history of their own."""
        return len(self._own)
