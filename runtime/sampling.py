"""Logits -> the distribution a request samples from, and inverse-CDF sampling from it.

Speculative acceptance needs the *processed* distributions themselves (not only a sampled token)
for both the target and the draft, so logits processing lives here once and both sides share it.
Everything is batched with per-row parameters. No randomness is drawn here: callers pass uniforms
drawn from each request's own ``np.random.Generator``, so a request's output depends only on its
seed, never on which other requests share the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .params import SamplingParams


def probs_from_logits(
    logits: np.ndarray, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray
) -> np.ndarray:
    """Return the float64 ``[N, V]`` distribution each row samples from; rows sum to 1.

    Per row, in vLLM/HF order: divide the logits by ``temperature``; keep the ``top_k`` largest
    (ties at the k-th value are all kept, as in HF/vLLM); softmax; keep the smallest set of
    highest-probability tokens whose mass reaches ``top_p`` (equal probabilities ordered by lower
    token id; the top token is always kept); renormalise.

    ``temperature == 0`` is greedy: the one-hot of ``np.argmax`` (lowest index on ties), with
    top-k/top-p irrelevant. ``top_k <= 0`` or ``>= V`` disables top-k; ``top_p == 1`` disables
    top-p. Parameters are ``[N]`` arrays (scalars broadcast); ``temperature >= 0``,
    ``0 < top_p <= 1``. ``-inf`` logits (masked tokens) get probability 0.
    """
    x = np.asarray(logits, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"logits must be [N, V], got shape {x.shape}")
    n, v = x.shape
    temperature = np.broadcast_to(np.asarray(temperature, dtype=np.float64), (n,))
    top_k = np.broadcast_to(np.asarray(top_k, dtype=np.int64), (n,))
    top_p = np.broadcast_to(np.asarray(top_p, dtype=np.float64), (n,))
    if (temperature < 0).any():
        raise ValueError("temperature must be >= 0")
    if ((top_p <= 0) | (top_p > 1)).any():
        raise ValueError("top_p must be in (0, 1]")

    greedy = temperature == 0
    x = x / np.where(greedy, 1.0, temperature)[:, None]

    use_k = (top_k > 0) & (top_k < v) & ~greedy
    if use_k.any():
        # Threshold at the k-th largest value; disabled rows take their minimum, masking nothing.
        kth_index = np.where(use_k, v - top_k, 0)[:, None]
        kth = np.take_along_axis(np.sort(x, axis=1), kth_index, axis=1)
        x = np.where(x < kth, -np.inf, x)

    probs = np.exp(x - x.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)

    use_p = (top_p < 1) & ~greedy
    if use_p.any():
        order = np.argsort(-probs, axis=1, kind="stable")
        sorted_probs = np.take_along_axis(probs, order, axis=1)
        mass_before = np.zeros_like(sorted_probs)
        np.cumsum(sorted_probs[:, :-1], axis=1, out=mass_before[:, 1:])
        # A token is needed while the strictly-more-probable ones have not yet reached top_p.
        keep = np.empty_like(mass_before, dtype=bool)
        np.put_along_axis(keep, order, mass_before < top_p[:, None], axis=1)
        probs = np.where(keep | ~use_p[:, None], probs, 0.0)
        probs /= probs.sum(axis=1, keepdims=True)

    rows = np.flatnonzero(greedy)
    if rows.size:
        probs[rows] = 0.0
        probs[rows, np.argmax(x[rows], axis=1)] = 1.0
    return probs


def sample_from_probs(probs: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    """Inverse-CDF sample one token per row of ``probs`` ``[N, V]``; returns int64 ``[N]``.

    ``uniforms`` ``[N]`` lie in [0, 1). Rows need only be non-negative with a positive sum: the
    uniform is scaled by the row's own cumulative total, so no normalisation rounding matters, and
    a zero-probability token is never returned (token j needs ``cdf[j-1] <= u * total < cdf[j]``,
    impossible when ``cdf[j] == cdf[j-1]``).
    """
    p = np.asarray(probs)
    u = np.asarray(uniforms, dtype=np.float64)
    if p.ndim != 2 or u.shape != (p.shape[0],):
        raise ValueError(f"need probs [N, V] and uniforms [N], got {p.shape} and {u.shape}")
    cdf = np.cumsum(p, axis=1, dtype=np.float64)
    token = (cdf <= (u * cdf[:, -1])[:, None]).sum(axis=1)
    # u < 1 already keeps token <= the last positive one; clamp so u == 1 cannot overrun either.
    last_positive = p.shape[1] - 1 - np.argmax(p[:, ::-1] > 0, axis=1)
    return np.minimum(token, last_positive).astype(np.int64)


def probs_for(logits: np.ndarray, params: Sequence[SamplingParams]) -> np.ndarray:
    """``probs_from_logits`` with each row's parameters taken from its request."""
    return probs_from_logits(
        logits,
        np.array([p.temperature for p in params], dtype=np.float64),
        np.array([p.top_k for p in params], dtype=np.int64),
        np.array([p.top_p for p in params], dtype=np.float64),
    )
