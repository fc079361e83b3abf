"""Sampling and speculative verification through the artifact's compiled functions
(``compiler/sampler.py``): logits and probabilities stay on the device, and only token ids and
accepted counts come back to the host.

The host sends each row's parameters and the uniforms drawn from each request's own generator,
the same draws in the same order as before sampling moved to the device, so a seed keeps its
meaning. A batch of greedy rows needs only the argmax: no probabilities are formed at all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import tvm
import tvm.runtime

from .artifact import CPU_SAMPLER_FUNCTIONS, SAMPLER_FUNCTIONS, TOP_CANDIDATES
from .kv_cache import host_tensor
from .params import SamplingParams
from .rows import take

ARGMAX, PROBS, PROBS_TOP_KP, SAMPLE, VERIFY_SAMPLED, VERIFY_POINT, MASK = SAMPLER_FUNCTIONS
PROBS_TOP_CANDIDATES, TOP_TOKENS = CPU_SAMPLER_FUNCTIONS

# Uniforms travel as float32, where a float64 draw just below 1 rounds up to 1: clamp below it.
_BELOW_ONE = np.nextafter(np.float32(1), np.float32(0))


@dataclasses.dataclass
class DraftProbs:
    """The distributions drafts were sampled from, kept on the device: ``data`` ``[rows, V]``
    and, per sequence, the row of ``data`` each of its drafts was sampled from, or None where
    its drafts are point masses (a model-free proposer's, beside a draft model's)."""

    data: tvm.runtime.Tensor
    rows: list[np.ndarray | None]

    def first(self, counts: Sequence[int]) -> DraftProbs:
        """The rows of each sequence's first ``counts[i]`` drafts."""
        return DraftProbs(
            self.data,
            [None if r is None else r[:c] for r, c in zip(self.rows, counts, strict=True)],
        )


class Sampler:
    """The compiled sampling functions of one loaded artifact (``functions`` by name)."""

    def __init__(self, functions: Mapping[str, Callable], device: tvm.runtime.Device):
        self._fn, self.device = functions, device
        self._host = device.dlpack_device_type() == tvm.cpu().dlpack_device_type()

    def _put(self, values, dtype: type) -> tvm.runtime.Tensor:
        """Per-row parameters as a tensor; on the CPU through ``host_tensor``, a sampled step's
        two or three of them being a visible share of its host time otherwise."""
        array = np.ascontiguousarray(values, dtype=dtype)
        return host_tensor(array) if self._host else tvm.runtime.tensor(array, self.device)

    def _uniforms(self, uniforms) -> tvm.runtime.Tensor:
        return self._put(np.minimum(np.asarray(uniforms, np.float32), _BELOW_ONE), np.float32)

    def mask(self, logits: tvm.runtime.Tensor, bitmask: np.ndarray) -> tvm.runtime.Tensor:
        """A copy of ``logits`` with -inf at the tokens each row's bitmask disallows
        (``[N, ceil(V / 32)]`` int32, a grammar's; ``runtime/structured_output.py``)."""
        return self._fn[MASK](logits, self._put(bitmask, np.int32))

    # ---- one token per row ---------------------------------------------------------------
    def argmax(self, logits: tvm.runtime.Tensor) -> np.ndarray:
        """Each row's greedy token (lowest index on ties), int64."""
        return self._fn[ARGMAX](logits).numpy().astype(np.int64)

    def probs(
        self, logits: tvm.runtime.Tensor, params: Sequence[SamplingParams]
    ) -> tvm.runtime.Tensor:
        """The distribution each row samples from, on the device ``[N, V]``: temperature, then
        top-k and top-p (sorting only when some sampled row uses them, and not even then where
        every sampled row's top-k is small and the artifact can do without); greedy rows
        one-hot."""
        vocab = logits.shape[1]
        temperature = self._put([p.temperature for p in params], np.float32)
        sampled = [p for p in params if not p.greedy]
        if not any(0 < p.top_k < vocab or p.top_p < 1 for p in sampled):
            return self._fn[PROBS](logits, temperature)
        args = (
            logits,
            temperature,
            self._put([p.top_k for p in params], np.int32),
            self._put([p.top_p for p in params], np.float32),
        )
        small = all(0 < p.top_k <= TOP_CANDIDATES and p.top_k < vocab for p in sampled)
        if small and PROBS_TOP_CANDIDATES in self._fn:
            probs, fits = self._fn[PROBS_TOP_CANDIDATES](*args)
            if fits.numpy().all():  # else ties at a k-th value run past the candidates
                return probs
        return self._fn[PROBS_TOP_KP](*args)

    def top_tokens(self, logits: tvm.runtime.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """Each row's ``MAX_TREE_WIDTH`` most probable tokens, most probable first, and their
        probabilities at temperature 1 (CPU artifacts): ``([N, W] int64, [N, W] float64)``."""
        tokens, probs = self._fn[TOP_TOKENS](logits)
        return tokens.numpy().astype(np.int64), probs.numpy().astype(np.float64)

    def sample(self, probs: tvm.runtime.Tensor, uniforms: np.ndarray) -> np.ndarray:
        """Inverse-CDF samples, one per row with its own uniform in [0, 1), int64."""
        return self._fn[SAMPLE](probs, self._uniforms(uniforms)).numpy().astype(np.int64)

    def sample_logits(
        self,
        logits: tvm.runtime.Tensor,
        params: Sequence[SamplingParams],
        uniforms: np.ndarray,
    ) -> np.ndarray:
        """One token per row of ``logits`` with that row's parameters and uniform."""
        if all(p.greedy for p in params):
            return self.argmax(logits)
        return self.sample(self.probs(logits, params), uniforms)

    # ---- verification --------------------------------------------------------------------
    def verify(
        self,
        logits: tvm.runtime.Tensor,
        params: Sequence[SamplingParams],
        drafts: Sequence[np.ndarray],
        draft_probs: DraftProbs | None,
        uniforms: Sequence[np.ndarray],
    ) -> tuple[np.ndarray, np.ndarray]:
        """Accept each sequence's drafts against the target's ``logits`` (``k_i + 1`` rows per
        sequence, concatenated): ``(accepted per sequence, emitted tokens concatenated)``, the
        emitted ones being each sequence's accepted drafts then one corrected or bonus token.
        ``uniforms[i]`` holds ``k_i`` acceptance uniforms then the last token's.

        Greedy sequences alone: the longest draft prefix matching the target's argmaxes, then
        the argmax after it (what rejection sampling gives with one-hot rows, whatever the
        uniforms or the draft's distributions)."""
        if all(p.greedy for p in params):
            return _longest_matching_prefix(self.argmax(logits), drafts)
        row_params = [p for p, d in zip(params, drafts, strict=True) for _ in range(len(d) + 1)]
        return self.verify_probs(
            self.probs(logits, row_params),
            drafts,
            draft_probs,
            np.concatenate([u[:-1] for u in uniforms]),
            np.array([u[-1] for u in uniforms]),
        )

    def verify_probs(
        self,
        target_probs: tvm.runtime.Tensor,
        drafts: Sequence[np.ndarray],
        draft_probs: DraftProbs | None,
        accept_uniforms: np.ndarray,
        sample_uniforms: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Rejection sampling with a bonus token over processed target rows (``verify``'s
        layout); ``draft_probs`` ``None`` for a deterministic proposer (a point mass)."""
        num_draft = np.array([len(d) for d in drafts], dtype=np.int64)
        b = num_draft.size
        if not num_draft.any():  # nothing to accept: every sequence samples its one row
            return np.zeros(b, np.int64), self.sample(target_probs, sample_uniforms)
        if draft_probs is not None and any(r is None for r in draft_probs.rows):
            return self._verify_mixed(
                target_probs, drafts, draft_probs, accept_uniforms, sample_uniforms
            )
        offsets = np.concatenate([[0], np.cumsum(num_draft)])
        args = [
            self._put(np.concatenate(drafts), np.int32),
            self._put(offsets, np.int32),
            self._uniforms(accept_uniforms),
            self._uniforms(sample_uniforms),
            target_probs,
        ]
        if draft_probs is None:
            accepted, tokens = self._fn[VERIFY_POINT](*args)
        else:
            rows = self._put(np.concatenate(draft_probs.rows), np.int32)
            accepted, tokens = self._fn[VERIFY_SAMPLED](*args, rows, draft_probs.data)
        accepted, tokens = accepted.numpy().astype(np.int64), tokens.numpy().astype(np.int64)
        starts = offsets[:-1] + np.arange(b)
        emitted = [tokens[s : s + a + 1] for s, a in zip(starts, accepted, strict=True)]
        return accepted, np.concatenate(emitted)

    def _verify_mixed(
        self,
        target_probs: tvm.runtime.Tensor,
        drafts: Sequence[np.ndarray],
        draft_probs: DraftProbs,
        accept_uniforms: np.ndarray,
        sample_uniforms: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """``verify_probs`` where some sequences' drafts are point masses and others' were
        sampled: each group by its own rule, every sequence with its own rows and uniforms."""
        num_draft = [len(d) for d in drafts]
        first_row = np.cumsum([0] + [k + 1 for k in num_draft])
        first_uniform = np.cumsum([0, *num_draft])
        accepted, emitted = np.zeros(len(drafts), np.int64), [None] * len(drafts)
        for point in (True, False):
            group = [i for i, r in enumerate(draft_probs.rows) if (r is None) == point]
            if not group:
                continue
            rows = [r for i in group for r in range(first_row[i], first_row[i + 1])]
            uniforms = [accept_uniforms[first_uniform[i] : first_uniform[i + 1]] for i in group]
            own, tokens = self.verify_probs(
                take(target_probs, rows),
                [drafts[i] for i in group],
                None
                if point
                else DraftProbs(draft_probs.data, [draft_probs.rows[i] for i in group]),
                np.concatenate(uniforms),
                sample_uniforms[group],
            )
            for i, a, out in zip(
                group, own, np.split(tokens, np.cumsum(own + 1)[:-1]), strict=True
            ):
                accepted[i], emitted[i] = a, out
        return accepted, np.concatenate(emitted)


def _longest_matching_prefix(
    best: np.ndarray, drafts: Sequence[np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    accepted, emitted, start = [], [], 0
    for d in drafts:
        k = len(d)
        target = best[start : start + k + 1]
        a = int(np.argmin(np.append(np.asarray(d) == target[:k], False)))
        accepted.append(a)
        emitted.append(target[: a + 1])
        start += k + 1
    return np.array(accepted, dtype=np.int64), np.concatenate(emitted)
