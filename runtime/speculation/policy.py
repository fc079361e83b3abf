"""The choice of k: per sequence and step, the draft counts that maximise the batch's goodput.

Goodput is expected emitted tokens per second of the step: sum_i E(alpha_i, k_i) / T(k), with
E(alpha, k) = 1 + sum_{j<k} c_j alpha^(j+1) and T the step time predicted from measured costs;
c_j <= 1 calibrates the estimates by draft position against what chosen drafts made
(``AcceptanceEstimator.calibration``). For a fixed total number of drafts, sum_i E is largest
when each next draft goes to the sequence whose next draft has the highest chance of being
emitted, c_k alpha_i^(k_i+1). So
the policy adds drafts in that order, one at a time, predicts each resulting step, and keeps the
best; all-zero (the plain decode path) is one of the candidates. Costs are a step function of the
pass sizes, so the search goes on past a dip, until even every draft still queued, emitted, could
not pay for the step already reached: a step never costs less for another draft. Under load that
ends the search within a few drafts, instead of one prediction per draft the batch could take
(at 8 rows, 0.1-0.2 ms a step for a decision that was almost always "none").

A draft model must first read what a sequence made while it did not draft (its prompt, at the
start). That one-time cost serves the rest of the reply, so each token the sequence emits while
drafting carries its share: the cost over the tokens it has left (beside a model-free proposer,
over those that one is not expected to draft). A short reply after a long prompt then starts
drafting only if its acceptance pays for the catch-up too.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence

from .costs import REFERENCE_CONTEXT, STEADY_CATCH_UP, StepCosts, StepShape

# Most tokens a catch-up is spread over: a reply seldom runs to a large max_tokens, and a cost
# spread over tokens that never come would be charged too little.
HORIZON_TOKENS = 256
# The least goodput over the step without the policy's drafts that makes drafting worth it.
# Predicted steps come within a few percent of measured ones (docs/benchmarks.md, the serving
# run's "predicted / measured"), so a predicted gain below that is noise, and drafting on one
# costs what the prediction missed: SmolLM2 int8 in the server at 4-16 streams expected ~1.0x
# from its drafts and ran at 0.90-1.01x no speculation (the run written by 87192f5's code, in
# b83352a's docs/benchmarks.md). With this margin those cells read 0.95-1.06x.
MIN_GAIN = 0.05
# Drafts predicted to gain less than this over the plain step give way to a plain step once the
# plain price is stale (``StepCosts.plain_is_stale``): a plain price 7-10% too high let drafts
# through that gained 5-10% as predicted and ran at 0.92-0.96x plain (SmolLM2 int8, 8 streams,
# 2026-11-28). Past this margin no such error flips the choice, and no step is lost measuring.
REFRESH_BELOW = 1.25


@dataclasses.dataclass
class Candidate:
    """One sequence as the policy sees it."""

    cap: int  # most drafts it may take this step (engine maximum, tokens left)
    pinned: int | None  # k fixed by the request (already capped); None: the policy chooses
    acceptance: float  # estimated alpha
    catch_up: int = 1  # tokens the draft model reads before its first draft
    tokens_left: int = HORIZON_TOKENS  # tokens the request may still emit
    context: int = REFERENCE_CONTEXT  # tokens in its KV cache, which its tokens attend over
    free: bool = False  # drafts with the model-free proposer beside a draft model (``auto``)
    # Its proposer's calibration (``AcceptanceEstimator.calibration``); None: the batch's.
    calibration: Sequence[float] | None = None
    width: int = 1  # drafts per position: a draft tree's nodes per depth
    # The share of its next tokens this proposer would draft for: a draft model beside a
    # model-free proposer drafts only the text that one leaves it (``Coverage``).
    served: float = 1.0


@dataclasses.dataclass
class Decision:
    num_draft: list[int]
    predicted_seconds: float | None  # None until the costs of such a step were measured
    expected_tokens: float
    # predicted_seconds with catch-ups spread, not whole, and less a riding chunk's price
    charged_seconds: float | None = None
    gain: float = 1.0  # predicted goodput over the step without the policy's drafts


def expected_tokens(alpha: float, k: int, calibration: Sequence[float] = ()) -> float:
    """Tokens a step emits for a sequence with k drafts: accepted drafts plus the target's own,
    the (j+1)-th draft's chance alpha^(j+1) scaled by ``calibration[j]`` (1 past its end)."""
    return 1.0 + sum(_factor(calibration, j) * alpha ** (j + 1) for j in range(k))


def _factor(calibration: Sequence[float], j: int) -> float:
    return calibration[j] if j < len(calibration) else 1.0


class GoodputPolicy:
    def choose(
        self,
        batch: list[Candidate],
        costs: StepCosts,
        calibration: Sequence[float] = (),
        joining: int = 0,
        chunk: int = 0,
    ) -> Decision:
        """The draft counts for ``batch`` with the most expected tokens per (charged) second,
        ``chunk`` prompt tokens riding in its pass whatever it drafts. ``joining``: sequences
        expected to join the batch soon (``Scheduler._joining``); a catch-up is paid only if
        the batch they make repays it (``_lasts``)."""
        best = self._choose(batch, costs, calibration, chunk)
        starting = [
            i
            for i, (c, k) in enumerate(zip(batch, best.num_draft, strict=True))
            if k and c.pinned is None and c.catch_up > STEADY_CATCH_UP
        ]
        if not joining or not starting or self._lasts(batch, costs, calibration, joining, starting):
            return best
        held = [dataclasses.replace(c, cap=0) if i in starting else c for i, c in enumerate(batch)]
        return self._choose(held, costs, calibration, chunk)

    def _lasts(
        self,
        batch: list[Candidate],
        costs: StepCosts,
        calibration: Sequence[float],
        joining: int,
        starting: list[int],
    ) -> bool:
        """Whether the ``starting`` sequences would still pay for their catch-ups, spread as
        in ``_choose``, once ``joining`` plain rows join the batch: where the catch-ups are
        repaid. At 3 rows the Qwen pair's drafts paid for three prompts' catch-ups (1.0 s),
        and at the 4 rows of the next step they no longer did, so the catch-ups bought one
        step of drafts (0.95x no speculation, 2026-11-28)."""
        newcomers = [Candidate(cap=0, pinned=None, acceptance=0.0)] * joining
        later = self._choose(batch + newcomers, costs, calibration)
        return any(later.num_draft[i] for i in starting)

    def _choose(
        self,
        batch: list[Candidate],
        costs: StepCosts,
        calibration: Sequence[float] = (),
        chunk: int = 0,
    ) -> Decision:
        num_draft = [c.pinned if c.pinned is not None else 0 for c in batch]
        catch_up = [c.catch_up for c in batch]
        calibrations = [calibration if c.calibration is None else c.calibration for c in batch]
        # Per sequence: its catch-up's whole cost, and that cost per token it has left.
        once = [0.0 if c.free else costs.draft.catch_up_seconds(c.catch_up) or 0.0 for c in batch]
        share = [
            once[i] / max(1.0, c.served * min(c.tokens_left, HORIZON_TOKENS))
            for i, c in enumerate(batch)
        ]
        emitted = [
            expected_tokens(c.acceptance, k, cal)
            for c, k, cal in zip(batch, num_draft, calibrations, strict=True)
        ]
        drafting = [i for i, k in enumerate(num_draft) if k]
        shape = StepShape.of(
            num_draft,
            catch_up,
            [c.context for c in batch],
            [c.free for c in batch],
            [c.width for c in batch],
            chunk,
        )
        tokens = sum(emitted)
        whole = sum(once[i] for i in drafting)  # paid in this step
        step = costs.predict(shape)
        # A riding chunk's price beside the plain step is the chunk's, not the tokens': charged
        # to them, it dilutes what drafts add, and drafts that cost more per token than plain
        # decoding look like a gain (SmolLM2 int8, ShareGPT at 4 streams: 43-48 steps drafted
        # beside 7-13-token chunks at 1-2 rows).
        riding = 0.0
        if chunk and step is not None:
            alone = costs.predict(dataclasses.replace(shape, chunk=0))
            riding = 0.0 if alone is None else max(0.0, step - alone)
        spread = sum(share[i] * emitted[i] for i in drafting)
        best = base = _decision(num_draft, step, whole, spread, tokens, riding)
        # The gain a draft must promise: MIN_GAIN, over what drafting steps realize of theirs.
        needed = (1 + MIN_GAIN) / costs.realized.shrink()
        # Next drafts by their chance to be emitted: c_k alpha^(k+1) for the (k+1)-th.
        chance = [c.acceptance for c in batch]  # alpha^(k+1), uncalibrated
        queue = [
            (-_factor(calibrations[i], 0) * c.acceptance, i)
            for i, c in enumerate(batch)
            if c.pinned is None and c.cap > 0
        ]
        if step is None or not queue:
            return best
        heapq.heapify(queue)
        # Tokens the queued drafts could still add, uncalibrated (calibration only lowers it).
        left = sum(
            sum(c.acceptance ** (j + 1) for j in range(c.cap)) for c in batch if c.pinned is None
        )
        while queue:
            gain, i = heapq.heappop(queue)  # minus the new draft's chance to be emitted
            left -= chance[i]
            if num_draft[i] == 0:  # starts drafting: its catch-up, and its one emitted token
                whole += once[i]
                spread += share[i]
            c = batch[i]
            shape.add_draft(num_draft[i], catch_up[i], c.context, c.free, c.width)
            num_draft[i] += 1
            tokens -= gain
            spread -= gain * share[i]
            if num_draft[i] < batch[i].cap:
                chance[i] *= batch[i].acceptance
                heapq.heappush(queue, (-_factor(calibrations[i], num_draft[i]) * chance[i], i))
            step = costs.predict(shape)
            if step is None:
                continue
            candidate = _decision(num_draft, step, whole, spread, tokens, riding)
            if tokens * best.charged_seconds > best.expected_tokens * candidate.charged_seconds:
                best = candidate
            if (tokens + left) / candidate.charged_seconds <= max(
                _goodput(best), needed * _goodput(base)
            ):
                break  # no later candidate can be chosen
        if base.charged_seconds is not None and best is not base:
            gain = (best.expected_tokens * base.charged_seconds) / (
                base.expected_tokens * best.charged_seconds
            )
            if gain < needed:
                return base
            best.gain = gain
        return best

    def choose_methods(
        self,
        options: list[dict[str, Candidate]],
        costs: StepCosts,
        joining: int = 0,
        chunk: int = 0,
    ) -> tuple[Decision, list[str]]:
        """Each sequence's proposer as well as its draft count, where sequences have several
        (``options[i]`` by method, each candidate with its own acceptance, catch-up and
        calibration): the best of ``choose`` over the assignments that give every sequence the
        same proposer where it has it, and the one that gives each sequence its likeliest
        first draft. At one sequence that is every assignment."""
        assignments = [
            tuple(method if method in o else next(iter(o)) for o in options)
            for method in dict.fromkeys(m for o in options for m in o)
        ]
        assignments.append(
            tuple(max(o, key=lambda m, o=o: (o[m].cap > 0) * o[m].acceptance) for o in options)
        )
        best: tuple[Decision, list[str]] | None = None
        for methods in dict.fromkeys(assignments):
            batch = [o[m] for o, m in zip(options, methods, strict=True)]
            decision = self.choose(batch, costs, joining=joining, chunk=chunk)
            if best is None or _faster(decision, best[0]):
                best = decision, list(methods)
        return best


def refreshes_plain(decision: Decision, costs: StepCosts, rows: int) -> bool:
    """Whether a step of ``rows`` sequences goes plain instead of ``decision``'s drafts, so that
    the plain price they were weighed against is measured again (``REFRESH_BELOW``)."""
    return decision.gain < REFRESH_BELOW and costs.plain_is_stale(rows)


def _goodput(decision: Decision) -> float:
    return decision.expected_tokens / decision.charged_seconds


def _faster(a: Decision, b: Decision) -> bool:
    """``a`` expects more tokens per (charged) second than ``b``."""
    if a.charged_seconds is None:
        return False
    if b.charged_seconds is None:
        return True
    return a.expected_tokens * b.charged_seconds > b.expected_tokens * a.charged_seconds


def _decision(
    num_draft: list[int],
    step: float | None,
    whole: float,
    spread: float,
    tokens: float,
    riding: float = 0.0,
) -> Decision:
    """A choice with its step time: the catch-ups whole as predicted, spread as charged, and
    the riding chunk's price charged to no one."""
    if step is None:
        return Decision(list(num_draft), None, tokens)
    return Decision(list(num_draft), step + whole, tokens, step + spread - riding)
