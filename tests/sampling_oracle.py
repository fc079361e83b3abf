"""The numpy reference the compiled sampler (``compiler/sampler.py``) is checked against, in
float64: logits -> the distribution a request samples from, inverse-CDF sampling from it, and
lossless speculative acceptance over a ragged batch.

Speculative acceptance needs the *processed* distributions themselves (not only a sampled token)
for both the target and the draft, so logits processing lives here once and both sides share it.
Everything is batched with per-row parameters. No randomness is drawn here: callers pass uniforms
drawn from each request's own ``np.random.Generator``, so a request's output depends only on its
seed, never on which other requests share the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mlc_spec.runtime.params import SamplingParams


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


def rejection_sample(
    draft_tokens: np.ndarray,
    num_draft: np.ndarray,
    draft_probs: np.ndarray | None,
    target_probs: np.ndarray,
    accept_uniforms: np.ndarray,
    sample_uniforms: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Apply the acceptance rule to ``B`` requests; returns ``(num_accepted, output_tokens)``.

    Lossless speculative acceptance for one step over a ragged batch (Leviathan et al. 2023).

    Request i proposes ``k_i >= 0`` draft tokens, each sampled from the draft's processed
    distribution ``p_d``; the target scored all of them in one pass, giving its processed
    distribution ``p_t`` at every draft position plus one more (the bonus position). Draft ``x`` is
    accepted with probability ``min(1, p_t(x) / p_d(x))``; at the first rejection the replacement is
    sampled from ``normalize(max(0, p_t - p_d))``; if all ``k_i`` are accepted the bonus token is
    sampled from the extra target row. Every emitted token is then distributed exactly as
    target-only sampling.

    Greedy needs no special path: at temperature 0 the processed target rows are one-hot at the
    target argmax ``a``. A draft ``x == a`` has ``p_t(x) = 1`` and is always accepted (``u < 1 <=
    1/p_d``); ``x != a`` has ``p_t(x) = 0`` and never is; the residual ``max(0, onehot(a) - p_d)``
    is supported on ``a`` alone, as is the bonus row. So the result is exactly "longest draft prefix
    matching the target argmaxes, then the target's argmax", whatever the uniforms.

    A deterministic proposer (n-gram lookup, greedy draft) passes ``draft_probs=None``: its proposal
    is a point mass at the draft token, so acceptance is ``u < p_t(x)`` and the residual is ``p_t``
    with ``x`` removed -- still lossless for a sampling target.

    Inputs (``T = sum(k_i)``): ``num_draft`` ``[B]`` int = ``k_i``; ``draft_tokens`` ``[T]`` int,
    concatenated per request; ``draft_probs`` ``[T, V]`` (row j: the distribution draft token j was
    sampled from) or ``None`` for a deterministic proposer; ``target_probs`` ``[T + B, V]``, ``k_i +
    1`` consecutive rows per request; ``accept_uniforms`` ``[T]`` and ``sample_uniforms`` ``[B]`` in
    [0, 1), drawn by the caller from each request's own generator.

    Outputs, both int64: ``num_accepted`` ``[B]`` in ``0..k_i``; ``output_tokens``
    ``[sum(num_accepted + 1)]``, per request its accepted drafts then exactly one corrected or
    bonus token, concatenated (split with ``np.cumsum(num_accepted + 1)[:-1]``).
    """
    num_draft = np.asarray(num_draft, dtype=np.int64)
    draft_tokens = np.asarray(draft_tokens, dtype=np.int64)
    accept_uniforms = np.asarray(accept_uniforms, dtype=np.float64)
    if num_draft.ndim != 1 or (num_draft < 0).any():
        raise ValueError("num_draft must be a 1-D array of non-negative counts")
    b, t = num_draft.shape[0], int(num_draft.sum())
    if draft_tokens.shape != (t,) or accept_uniforms.shape != (t,):
        raise ValueError(f"draft_tokens and accept_uniforms must have shape ({t},)")
    if target_probs.ndim != 2 or target_probs.shape[0] != t + b:
        raise ValueError(f"target_probs must be [{t + b}, V], got {target_probs.shape}")
    v = target_probs.shape[1]
    if draft_probs is not None and draft_probs.shape != (t, v):
        raise ValueError(f"draft_probs must be [{t}, {v}], got {draft_probs.shape}")

    req = np.repeat(np.arange(b), num_draft)  # request of each draft token
    draft_start = np.cumsum(num_draft) - num_draft
    pos = np.arange(t) - draft_start[req]  # position of each draft within its request
    # Request i's target rows start at draft_start[i] + i (one extra row per earlier request).
    p_t = target_probs[np.arange(t) + req, draft_tokens]
    p_d = 1.0 if draft_probs is None else draft_probs[np.arange(t), draft_tokens]
    accepted = accept_uniforms * p_d < p_t  # u < p_t / p_d without dividing; p_t == 0 never passes

    # First rejection per request, on a grid whose padding (and extra last column) rejects.
    grid = np.zeros((b, int(num_draft.max(initial=0)) + 1), dtype=bool)
    grid[req, pos] = accepted
    num_accepted = np.argmin(grid, axis=1)

    # The last token comes from the target row at position num_accepted: the bonus row as is, or,
    # after a rejection, the residual there (sample_from_probs needs no normalisation).
    dist = np.array(target_probs[draft_start + np.arange(b) + num_accepted], dtype=np.float64)
    rejected = np.flatnonzero(num_accepted < num_draft)
    rejected_draft = draft_start[rejected] + num_accepted[rejected]
    if draft_probs is None:
        p_d_rows = np.zeros((rejected.size, v))
        p_d_rows[np.arange(rejected.size), draft_tokens[rejected_draft]] = 1.0
    else:
        p_d_rows = draft_probs[rejected_draft]
    residual = np.maximum(dist[rejected] - p_d_rows, 0.0)
    # Exactly, a rejection implies p_t(x) < p_d(x), so the residual has mass; only rounding or
    # inconsistent inputs can empty it, and then the target row itself is the safe choice.
    has_mass = residual.sum(axis=1) > 0
    dist[rejected[has_mass]] = residual[has_mass]
    last = sample_from_probs(dist, sample_uniforms)

    num_emitted = num_accepted + 1
    out_start = np.cumsum(num_emitted) - num_emitted
    output_tokens = np.empty(int(num_emitted.sum()), dtype=np.int64)
    kept = pos < num_accepted[req]
    output_tokens[out_start[req[kept]] + pos[kept]] = draft_tokens[kept]
    output_tokens[out_start + num_accepted] = last
    return num_accepted, output_tokens
