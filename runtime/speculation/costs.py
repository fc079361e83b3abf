"""Step-time models measured in this process, never assumed.

A CPU forward pass costs a step function of its token count: the matmul kernels pick a row tile
by size (float weights: ``M_TILES`` in ``compiler/cpu_matmul.py``, then a packed GEMM; int8
activations: a tile per row count up to ``IntegerDot.max_rows`` in ``compiler/int8_matmul.py``),
so every size keeps a measured running mean of its own rather than a fitted line. Tables start
from a warm-up at load time and follow every real step after that, so they track the load of the
machine.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Sequence

from .acceptance import ENGINE_DECAY

# Context tokens each sequence holds in the load-time passes. Attention makes a pass dearer with
# the context its tokens attend over (SmolLM2 int8, 16 rows on 2 cores: a decode step costs
# 16.9 ms at 32 tokens of context each, 26.5 ms at 256 and 36.8 ms at 512), so the tables hold
# passes at this context and ``StepCosts.attention`` prices the context beyond it.
REFERENCE_CONTEXT = 32
# Weight of a new measurement in a running mean: a change of load shows within ~5 steps, one
# noisy step moves an estimate by a fifth of its error.
NEW_WEIGHT = 0.2
# Verify steps at a row count after which its plain pass's price is stale: only plain steps
# measure it, and a policy that keeps drafting stops taking them (``policy.refreshes_plain``).
STALE_AFTER = 16
# Weight of a plain pass measured once its price was stale: the estimate had no news for that
# long, so the measurement counts for more than a routine one.
STALE_WEIGHT = 0.5


class RunningMean:
    """An exponential running mean; ``None`` until the first measurement."""

    def __init__(self, value: float | None = None):
        self.value = value

    def observe(self, x: float, weight: float = NEW_WEIGHT) -> None:
        self.value = x if self.value is None else self.value + weight * (x - self.value)


class CostTable:
    """Seconds of one pass by its size (tokens or rows).

    An unmeasured size costs what the nearest measured larger size costs (a pass is never cheaper
    than a smaller one, and padding to the next tile is the common reason for a step); past the
    largest measured size the cost grows in proportion.
    """

    def __init__(self, seconds: dict[int, float] | None = None):
        self._mean = {size: RunningMean(s) for size, s in (seconds or {}).items()}
        self._sizes = sorted(self._mean)

    def observe(self, size: int, seconds: float, weight: float = NEW_WEIGHT) -> None:
        if size not in self._mean:
            self._mean[size] = RunningMean()
            bisect.insort(self._sizes, size)
        self._mean[size].observe(seconds, weight)

    def predict(self, size: int) -> float | None:
        if size <= 0:
            return 0.0
        if not self._sizes:
            return None
        mean = self._mean.get(size)
        if mean is not None:
            return mean.value
        i = bisect.bisect_left(self._sizes, size)
        if i < len(self._sizes):
            return self._mean[self._sizes[i]].value
        largest = self._sizes[-1]
        return self._mean[largest].value * size / largest

    def to_dict(self) -> dict[int, float]:
        return {size: self._mean[size].value for size in self._sizes}


# Tokens a draft model's first pass reads per sequence in steady state: the pending token, and
# after a bonus token the last draft as well. More is a one-time catch-up (the prompt, or tokens
# made while the sequence did not draft) that serves every later step, so the policy spreads its
# cost (``DraftCosts.catch_up_seconds``) over the tokens the sequence has left; charging it all
# to one step would keep a step-by-step policy from ever starting to draft after a long prompt.
STEADY_CATCH_UP = 2


@dataclasses.dataclass
class Attended:
    """The context a target pass attends over beyond ``REFERENCE_CONTEXT`` per token (below
    it: less than 0), summed over each sequence's first token (``rows``) and over its further
    tokens, its drafts (``drafts``): those read the keys and values the first one brought into
    the cache, and cost less (SmolLM2 int8 at 512 tokens: ~2.6 and ~0.6 us a token of context)."""

    rows: int = 0
    drafts: int = 0

    @classmethod
    def of(cls, contexts: Sequence[int], num_draft: Sequence[int] | None = None) -> Attended:
        """Rows holding ``contexts[i]`` tokens with ``num_draft[i]`` drafts (default none)."""
        beyond = [c - REFERENCE_CONTEXT for c in contexts]
        drafts = num_draft or [0] * len(contexts)
        return cls(sum(beyond), sum(k * b for k, b in zip(drafts, beyond, strict=True)))


@dataclasses.dataclass
class StepShape:
    """What a decode step's cost depends on: its rows, the tokens the draft reads in its first
    pass (at most ``STEADY_CATCH_UP`` per sequence), ``drafting[j]``, the rows of the draft
    model's (j+1)-th pass (``drafting[0]``: the sequences drafting; a chain adds a row per
    further draft, a tree its ``width`` nodes per further depth), ``free``, how many draft
    with the model-free proposer beside a draft model (method ``auto``), ``drafts`` the
    target verifies in all, the context its rows and its drafts attend over
    (``Attended``), and ``chunk``, the prompt tokens riding in the target's pass (no logits:
    priced as drafts, an LM head row too dear each)."""

    rows: int
    catch_up: int = 0
    drafting: list[int] = dataclasses.field(default_factory=list)
    free: int = 0
    drafts: int = 0
    attended: Attended = dataclasses.field(default_factory=Attended)
    chunk: int = 0

    def add_draft(
        self,
        k_before: int,
        catch_up: int,
        context: int = REFERENCE_CONTEXT,
        free: bool = False,
        width: int = 1,
    ) -> None:
        """One more draft position (``width`` drafts: a tree's nodes at a depth) for a
        sequence that had ``k_before`` and holds ``context`` tokens, from the model-free
        proposer beside the model where ``free``."""
        if free:
            self.free += k_before == 0
        else:
            if k_before == 0:
                self.catch_up += min(catch_up, STEADY_CATCH_UP)
            if k_before == len(self.drafting):
                self.drafting.append(0)
            self.drafting[k_before] += 1 if k_before == 0 else width
        self.drafts += width
        self.attended.drafts += width * (context - REFERENCE_CONTEXT)

    @classmethod
    def of(
        cls,
        num_draft: Sequence[int],
        catch_up: Sequence[int],
        contexts: Sequence[int] | None = None,
        free: Sequence[bool] | None = None,
        widths: Sequence[int] | None = None,
        chunk: int = 0,
    ) -> StepShape:
        contexts = contexts or [REFERENCE_CONTEXT] * len(num_draft)
        free = free or [False] * len(num_draft)
        widths = widths or [1] * len(num_draft)
        shape = cls(len(num_draft), attended=Attended.of(contexts), chunk=chunk)
        for k, c, context, f, w in zip(num_draft, catch_up, contexts, free, widths, strict=True):
            for j in range(k):
                shape.add_draft(j, c, context, f, w)
        return shape


@dataclasses.dataclass
class Attention:
    """Seconds a pass pays per token of context beyond ``REFERENCE_CONTEXT``: for a row's first
    token, and for each of its drafts. Measured at load with automatic speculation
    (``warm_up.attention_costs``); 0 otherwise, and the tables then hold passes at the
    contexts steps ran at."""

    row: float = 0.0
    draft: float = 0.0

    def seconds(self, attended: Attended) -> float:
        return self.row * attended.rows + self.draft * attended.drafts


@dataclasses.dataclass
class DraftCosts:
    """What proposing costs. A draft model runs a first pass over what it has not read yet (by
    tokens) and one pass per further draft token (by rows still drafting); everything else (the
    n-gram lookup, a model's Python and sampling glue) is a cost per drafting sequence."""

    model: bool
    first: CostTable = dataclasses.field(default_factory=CostTable)
    next: CostTable = dataclasses.field(default_factory=CostTable)
    per_sequence: RunningMean = dataclasses.field(default_factory=lambda: RunningMean(0.0))

    def catch_up_seconds(self, tokens: int) -> float | None:
        """What a first pass reading ``tokens`` for a sequence costs beyond a steady one's: paid
        once when the sequence starts drafting after its prompt or a pause."""
        if not self.model or tokens <= STEADY_CATCH_UP:
            return 0.0
        whole, steady = self.first.predict(tokens), self.first.predict(STEADY_CATCH_UP)
        if whole is None or steady is None:
            return None
        return max(0.0, whole - steady)

    def predict(self, shape: StepShape) -> float | None:
        if not shape.drafting:
            return 0.0
        seconds = shape.drafting[0] * (self.per_sequence.value or 0.0)
        if not self.model:
            return seconds
        first = self.first.predict(shape.catch_up)
        if first is None:
            return None
        seconds += first
        for rows in itertools.islice(shape.drafting, 1, None):
            passed = self.next.predict(rows)
            if passed is None:
                return None
            seconds += passed
        return seconds


# ``Realized`` starts as if this many expected tokens of each kind of step had been made as
# predicted, and drifts back there as its evidence fades, so drafting declined on it is tried
# again.
REALIZED_PRIOR = 32.0


class Realized:
    """What steps made against their prediction, drafting steps and plain ones apart: emitted
    tokens at the predicted time (scaled by predicted over measured seconds) against expected
    tokens, fading each step as the engine-wide acceptance counts do (``ENGINE_DECAY``).
    Drafts are chosen where estimates are high, and estimates high by chance gather
    there: SmolLM2 int8 at 8 rows on ShareGPT, with per-position calibration, expected 12.2
    tokens from its drafting steps and made 11.3, 3% slower than predicted, while plain steps
    came within 2%; the drafts the policy saw as a 12% gain gained 2%, and automatic
    speculation took 1.10x the time of none. The policy lowers a drafting candidate's gain by
    ``shrink``."""

    def __init__(self) -> None:
        self._sums = {True: [0.0, 0.0], False: [0.0, 0.0]}  # drafted -> [expected, realized]

    def observe(
        self, drafted: bool, expected: float, emitted: int, predicted: float, measured: float
    ) -> None:
        for sums in self._sums.values():
            sums[0] *= ENGINE_DECAY
            sums[1] *= ENGINE_DECAY
        sums = self._sums[drafted]
        sums[0] += expected
        sums[1] += emitted * predicted / measured

    def shrink(self) -> float:
        """Drafting steps' realized share of their predicted goodput over plain steps', at
        most 1."""
        (de, dr), (pe, pr) = self._sums[True], self._sums[False]
        drafting = (dr + REALIZED_PRIOR) / (de + REALIZED_PRIOR)
        plain = (pr + REALIZED_PRIOR) / (pe + REALIZED_PRIOR)
        return min(1.0, drafting / plain)


@dataclasses.dataclass
class StepCosts:
    """Predicted seconds of a decode step: the target pass with its sampling, the proposer, and
    the rest of the step (appending tokens, stop checks, detokenising) per row.

    A plain decode of r rows costs ``decode`` by rows. A verify pass costs by its tokens t and
    its rows r both: its matmuls follow t (tiled by row count) while attention and the KV
    cache's work follow the sequences, so 16 tokens over 8 sequences cost more than over 2.
    A table by tokens alone, timed over few rows, priced SmolLM2's verify passes at 8 rows 13%
    too cheap, and the policy drafted where it lost. Load time measures ``verify`` on one
    sequence by tokens; a shape no step has run yet costs ``verify[t] + decode[r] -
    verify[r]``: one sequence's t tokens, plus what r sequences cost beyond one sequence's r
    tokens (within 6% of the measured passes on average, at 2..8 rows). Every shape that steps
    run keeps a running mean of its own in ``shapes`` (rows, then tokens), starting from that
    prediction, so one unlucky step does not price a shape out for good.

    A plain decode is never priced dearer than what a verify pass of as many rows that steps
    have run implies (its cost less its extra tokens'): those keep being measured, so this
    corrects a decode cost that load inflated at warm-up while the policy, believing it,
    stopped taking the plain path. Nor is it priced below one sequence's pass of as many
    tokens, which costs less than as many sequences: one sequence's extra tokens, subtracted
    from a wide pass over few sequences, cost more than those sequences' own, and on SmolLM2's
    editing workload a decode of 4 rows came out at 0.4 ms against 6 measured, after which the
    policy declined 48 drafts at acceptance 1 and never drafted again.

    That bound subtracts load-time differences, which may not hold for a server's batches: with
    SmolLM2 int8 at 8 streams a decode price stayed 7-10% above measured through ~100 drafting
    steps. So a row count's price counts as stale after ``STALE_AFTER`` verify passes without a
    plain one (``plain_is_stale``), the policy then steps plain where its margin is thin
    (``policy.refreshes_plain``), and that measurement weighs ``STALE_WEIGHT``. A price that
    only load time measured is stale from the start: the Qwen pair's plain step of 4 rows came
    out 5-7% above what steps measured, enough to start its draft model on 4 prompts whose
    catch-ups (0.55 s) the drafts never repaid.

    The sum prices a shape no step has run only as well as load-time passes stand for a
    server's: at 8 rows a server's steps came out up to 1.3x that estimate (SmolLM2 int8,
    under streaming and admission). A shape's first measurement against its estimate feeds
    ``estimate_bias``, a running ratio that then scales every shape not yet run, so the many
    shapes of a batch that a policy tries once are not each priced too cheap on first try.
    """

    decode: CostTable
    verify: CostTable
    draft: DraftCosts
    per_row: RunningMean = dataclasses.field(default_factory=lambda: RunningMean(0.0))
    # Method ``auto``: the model-free proposer beside the draft model (``draft``), per drafting
    # sequence (``StepShape.free``).
    free: DraftCosts | None = None
    attention: Attention = dataclasses.field(default_factory=Attention)
    shapes: dict[int, dict[int, RunningMean]] = dataclasses.field(default_factory=dict)
    estimate_bias: RunningMean = dataclasses.field(default_factory=lambda: RunningMean(1.0))
    # Per row count: verify passes run since a step last measured its plain pass.
    unrefreshed: dict[int, int] = dataclasses.field(default_factory=dict)
    realized: Realized = dataclasses.field(default_factory=Realized)

    def predict(self, shape: StepShape) -> float | None:
        target = self.target(shape.rows, shape.rows + shape.drafts + shape.chunk)
        draft = self.draft.predict(shape)
        if target is None or draft is None:
            return None
        rest = shape.rows * (self.per_row.value or 0.0)
        if shape.free:
            rest += shape.free * (self.free.per_sequence.value or 0.0)
        return target + self.attention.seconds(shape.attended) + draft + rest

    def plain(self, contexts: Sequence[int]) -> float | None:
        """A plain decode pass of sequences holding ``contexts`` tokens."""
        decode = self.target(len(contexts), len(contexts))
        return None if decode is None else decode + self.attention.seconds(Attended.of(contexts))

    def plain_is_stale(self, rows: int) -> bool:
        """Whether ``STALE_AFTER`` verify passes of ``rows`` sequences ran since a plain one,
        or no step has measured a plain one yet."""
        return self.unrefreshed.get(rows, STALE_AFTER) >= STALE_AFTER

    def target(self, rows: int, tokens: int) -> float | None:
        """The target pass over ``rows`` sequences and ``tokens`` tokens (a decode where they
        are equal), sampling included."""
        seen = self.shapes.get(rows, {})
        if tokens == rows:
            decode, floor = self.decode.predict(rows), self.verify.predict(rows) or 0.0
            extras = {t: self._extra(rows, t) for t in seen}
            implied = [
                max(m.value - extras[t], floor) for t, m in seen.items() if extras[t] is not None
            ]
            return decode if decode is None or not implied else min(decode, *implied)
        if tokens in seen:
            return seen[tokens].value
        estimate = self._estimate(rows, tokens)
        return None if estimate is None else estimate * self.estimate_bias.value

    def _estimate(self, rows: int, tokens: int) -> float | None:
        """A verify pass from the tables: ``rows`` decoded, plus ``tokens - rows`` more."""
        decode, extra = self.decode.predict(rows), self._extra(rows, tokens)
        return None if decode is None or extra is None else decode + extra

    def _extra(self, rows: int, tokens: int) -> float | None:
        """What ``tokens - rows`` more tokens add to a pass of ``rows`` sequences."""
        whole, part = self.verify.predict(tokens), self.verify.predict(rows)
        return None if whole is None or part is None else whole - part

    def observe_target(
        self, rows: int, tokens: int, seconds: float, attended: Attended | None = None
    ) -> None:
        """A target pass's time, entered at the reference context."""
        seconds -= self.attention.seconds(attended or Attended())
        if tokens == rows:
            stale = self.plain_is_stale(rows)
            self.decode.observe(rows, seconds, STALE_WEIGHT if stale else NEW_WEIGHT)
            self.unrefreshed[rows] = 0
            return
        self.unrefreshed[rows] = self.unrefreshed.get(rows, STALE_AFTER) + 1
        seen = self.shapes.setdefault(rows, {})
        if tokens not in seen:
            seen[tokens] = RunningMean(self.target(rows, tokens))
            estimate = self._estimate(rows, tokens)
            if estimate:
                self.estimate_bias.observe(seconds / estimate)
        seen[tokens].observe(seconds)

    def to_dict(self) -> dict:
        return {
            "decode_by_rows": self.decode.to_dict(),
            "verify_one_sequence_by_tokens": self.verify.to_dict(),
            "verify_by_rows_x_tokens": {
                f"{r}x{t}": m.value
                for r, seen in sorted(self.shapes.items())
                for t, m in sorted(seen.items())
            },
            "draft_first_pass_by_tokens": self.draft.first.to_dict(),
            "draft_next_pass_by_rows": self.draft.next.to_dict(),
            "propose_per_sequence": self.draft.per_sequence.value,
            "model_free_propose_per_sequence": self.free and self.free.per_sequence.value,
            "unrun_shape_bias": self.estimate_bias.value,
            "rest_per_row": self.per_row.value,
            "attention_per_context_token": dataclasses.asdict(self.attention),
        }
