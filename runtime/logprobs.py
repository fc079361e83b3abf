"""Log-probabilities of emitted tokens, as OpenAI's ``logprobs`` / ``top_logprobs`` report them.

They come from the target's raw logits (log-softmax before temperature, top-k and top-p, vLLM's
default), row by row: every emitted token, drafted-and-accepted or decoded alone, is scored by
the target row computed at its own position, so speculation does not change them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike


@dataclasses.dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob) of the most likely tokens, best first


def token_logprobs(logits: ArrayLike, tokens: Sequence[int], num_top: int) -> list[TokenLogprob]:
    """Score ``tokens[i]`` under row ``i`` of ``logits`` ``[len(tokens), V]`` and list each
    row's ``num_top`` most likely tokens. ``logits`` may be device rows (``rows.Rows``): they
    come to the host here, for the requests that ask, and only then."""
    x = np.asarray(logits, dtype=np.float64)
    peak = x.max(axis=1, keepdims=True)
    logp = x - (peak + np.log(np.exp(x - peak).sum(axis=1, keepdims=True)))
    kth = min(num_top, x.shape[1] - 1)
    top = np.argpartition(-logp, kth, axis=1)[:, :num_top] if num_top else None
    out = []
    for row, token in enumerate(tokens):
        best: list[tuple[int, float]] = []
        if top is not None:
            ids = sorted(top[row], key=lambda t: (-logp[row, t], t))
            best = [(int(t), float(logp[row, t])) for t in ids]
        out.append(TokenLogprob(int(token), float(logp[row, token]), best))
    return out
