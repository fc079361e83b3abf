"""Lossless speculative acceptance for one step over a ragged batch (Leviathan et al. 2023).

Request i proposes ``k_i >= 0`` draft tokens, each sampled from the draft's processed distribution
``p_d``; the target scored all of them in one pass, giving its processed distribution ``p_t`` at
every draft position plus one more (the bonus position). Draft ``x`` is accepted with probability
``min(1, p_t(x) / p_d(x))``; at the first rejection the replacement is sampled from
``normalize(max(0, p_t - p_d))``; if all ``k_i`` are accepted the bonus token is sampled from the
extra target row. Every emitted token is then distributed exactly as target-only sampling.

Greedy needs no special path: at temperature 0 the processed target rows are one-hot at the target
argmax ``a``. A draft ``x == a`` has ``p_t(x) = 1`` and is always accepted (``u < 1 <= 1/p_d``);
``x != a`` has ``p_t(x) = 0`` and never is; the residual ``max(0, onehot(a) - p_d)`` is supported
on ``a`` alone, as is the bonus row. So the result is exactly "longest draft prefix matching the
target argmaxes, then the target's argmax", whatever the uniforms.

A deterministic proposer (n-gram lookup, greedy draft) passes ``draft_probs=None``: its proposal is
a point mass at the draft token, so acceptance is ``u < p_t(x)`` and the residual is ``p_t`` with
``x`` removed -- still lossless for a sampling target.
"""

from __future__ import annotations

import numpy as np

from mlc_spec.runtime.sampling import sample_from_probs


def rejection_sample(
    draft_tokens: np.ndarray,
    num_draft: np.ndarray,
    draft_probs: np.ndarray | None,
    target_probs: np.ndarray,
    accept_uniforms: np.ndarray,
    sample_uniforms: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Apply the acceptance rule to ``B`` requests; returns ``(num_accepted, output_tokens)``.

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
