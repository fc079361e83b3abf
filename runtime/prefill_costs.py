"""What a prompt chunk adds to the decode step it rides in, learnt from those steps, so that a
step can bound its chunk in time rather than in tokens.

A prompt token pays its share of the weights' work and its attention over the context before
it: a chunk of ``n`` tokens after ``c`` cached ones costs ``n (a + b (c + n / 2))`` seconds. On
2 cores SmolLM2 int8 pays about what a decoding row does at the start of a prompt and ~1 ms more
at 2,000 tokens of context, so a token budget that suits the start stalls the streams at the
end. ``a`` and ``b`` are fitted by least squares, recent steps weighing more, so the fit follows
the machine's load like the step costs do. Prefill passes of their own are left out: their
large chunks cost less per token, and with them in the fit the streams' median step ran ~1.5x
the allowance.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# Weight of each new pass in the fit's sums: the last ~20 passes dominate.
NEW_WEIGHT = 0.05
UNBOUNDED = 1 << 30  # tokens, where passes were measured to cost nothing


def features(chunks: Sequence[tuple[int, int]]) -> tuple[float, float]:
    """``(tokens, tokens x mean context)`` of a pass's ``(context, tokens)`` chunks: the
    terms that ``a`` and ``b`` multiply."""
    return (
        float(sum(n for _, n in chunks)),
        float(sum(n * (c + n / 2) for c, n in chunks)),
    )


class PrefillCosts:
    """The fit of ``seconds = a u + b v`` over passes with features ``(u, v)`` (``features``)."""

    def __init__(self):
        self._uu = self._uv = self._vv = self._ut = self._vt = 0.0

    def observe(self, chunks: Sequence[tuple[int, int]], seconds: float) -> None:
        u, v = features(chunks)
        if u <= 0 or seconds <= 0:  # a step's noise outweighed its chunk: nothing to learn
            return
        keep = 1 - NEW_WEIGHT
        self._uu = keep * self._uu + u * u
        self._uv = keep * self._uv + u * v
        self._vv = keep * self._vv + v * v
        self._ut = keep * self._ut + u * seconds
        self._vt = keep * self._vt + v * seconds

    def fit(self) -> tuple[float, float] | None:
        """``(a, b)``, neither below 0 (where the joint fit gives one below 0, the other term
        is fitted alone); ``b`` 0 while the passes cannot tell them apart (all at one context,
        say); None before any pass."""
        if self._uu <= 0:
            return None
        det = self._uu * self._vv - self._uv * self._uv
        if det > 1e-9 * self._uu * self._vv:
            a = (self._ut * self._vv - self._vt * self._uv) / det
            b = (self._vt * self._uu - self._ut * self._uv) / det
            if a >= 0 and b >= 0:
                return a, b
            if a < 0:
                return 0.0, max(self._vt / self._vv, 0.0)
        return max(self._ut / self._uu, 0.0), 0.0

    def most_tokens(self, context: int, seconds: float) -> int | None:
        """The largest chunk after ``context`` cached tokens predicted to take at most
        ``seconds``; None before any pass."""
        fitted = self.fit()
        if fitted is None:
            return None
        a, b = fitted
        linear = a + b * context
        if b == 0:
            return UNBOUNDED if linear == 0 else int(seconds / linear)
        # b/2 n^2 + (a + b c) n - seconds = 0
        return int((-linear + math.sqrt(linear * linear + 2 * b * seconds)) / b)
