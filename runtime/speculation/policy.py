"""The choice of k: per sequence and step, the draft counts that maximise the batch's goodput.

Goodput is expected emitted tokens per second of the step: sum_i E(alpha_i, k_i) / T(k), with
E(alpha, k) = (1 - alpha^(k+1)) / (1 - alpha) and T the step time predicted from measured costs.
For a fixed total number of drafts, sum_i E is largest when each next draft goes to the sequence
whose next draft has the highest chance of being emitted, alpha_i^(k_i+1) (E is concave in k). So
the policy adds drafts in that order, one at a time, predicts each resulting step, and keeps the
best; all-zero (the plain decode path) is one of the candidates. Costs are a step function of the
pass sizes, so every total is evaluated rather than stopping at the first dip.
"""

from __future__ import annotations

import dataclasses
import heapq

from .costs import StepCosts, StepShape


@dataclasses.dataclass
class Candidate:
    """One sequence as the policy sees it."""

    cap: int  # most drafts it may take this step (engine maximum, tokens left)
    pinned: int | None  # k fixed by the request (already capped); None: the policy chooses
    acceptance: float  # estimated alpha
    catch_up: int = 1  # tokens the draft model reads before its first draft


@dataclasses.dataclass
class Decision:
    num_draft: list[int]
    predicted_seconds: float | None  # None until the costs of such a step were measured
    expected_tokens: float


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a step emits for a sequence with k drafts: accepted drafts plus the target's own."""
    return k + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class GoodputPolicy:
    def choose(self, batch: list[Candidate], costs: StepCosts) -> Decision:
        num_draft = [c.pinned if c.pinned is not None else 0 for c in batch]
        catch_up = [c.catch_up for c in batch]
        shape = StepShape.of(num_draft, catch_up)
        pairs = zip(batch, num_draft, strict=True)
        tokens = sum(expected_tokens(c.acceptance, k) for c, k in pairs)
        seconds = costs.predict(shape)
        best = Decision(list(num_draft), seconds, tokens)
        # Next drafts by their chance to be emitted: alpha^(k+1) for the (k+1)-th.
        queue = [(-c.acceptance, i) for i, c in enumerate(batch) if c.pinned is None and c.cap > 0]
        if seconds is None or not queue:
            return best
        heapq.heapify(queue)
        while queue:
            gain, i = heapq.heappop(queue)
            shape.add_draft(num_draft[i], catch_up[i])
            num_draft[i] += 1
            tokens -= gain  # minus the chance the new draft is emitted: -alpha^k for the k-th
            if num_draft[i] < batch[i].cap:
                heapq.heappush(queue, (gain * batch[i].acceptance, i))
            seconds = costs.predict(shape)
            if (
                seconds is not None
                and tokens * best.predicted_seconds > best.expected_tokens * seconds
            ):
                best = Decision(list(num_draft), seconds, tokens)
        return best
