"""Sampling and speculative verification as Relax functions of the artifact, so that logits never
leave the device: only token ids and accepted counts come back to the host.

Every function is batched with per-row parameters over a symbolic vocabulary and is lowered by
the same pipeline as the model (``DispatchSortScan`` there gives argsort and cumsum their CPU or
GPU kernels); on the CPU the softmax and the draw are vectorised kernels of their own
(``cpu_probs``, ``cpu_sample``). No randomness is drawn here: the host passes uniforms in
[0, 1) drawn from each request's own generator. The numpy reference is ``tests/sampling_oracle.py``.

``argmax_tokens(logits)``
    greedy tokens, the lowest index on ties.
``probs_from_logits(logits, temperature)``
    softmax of ``logits / temperature``; rows with ``temperature == 0`` are the one-hot of the
    argmax. The runtime calls this when no row of the batch uses top-k or top-p (no sort).
``probs_from_logits_top_kp(logits, temperature, top_k, top_p)``
    the same, with top-k (ties at the k-th value kept; ``top_k <= 0`` or ``>= V``: off) and then
    top-p (the smallest set of most probable tokens reaching ``top_p``, ties ordered by lower
    token id, the top token always kept), renormalised.
``probs_from_logits_top_candidates(logits, temperature, top_k, top_p)`` (CPU artifacts)
    ``(probs, fits)``: the same probabilities, bit for bit, for rows whose top-k set lies within
    their ``TOP_CANDIDATES`` largest logits (``fits[i]`` 1; greedy rows always fit), found
    without a sort (``cpu_top_k``); the runtime calls it when every sampled row has
    ``0 < top_k <= TOP_CANDIDATES`` and falls back to the sort where a row does not fit.
``top_tokens(logits)`` (CPU artifacts)
    ``(tokens, probs)``: each row's ``MAX_TREE_WIDTH`` most probable tokens (ties: lower index
    first) and their probabilities at temperature 1, what a draft tree expands a node with.
``apply_token_bitmask(logits, bitmask)``
    ``logits`` with -inf where a row's bitmask (xgrammar's: bit ``j % 32`` of word ``j // 32``
    of a row, ``[n, ceil(V / 32)]`` int32) disallows token ``j``: a grammar's constraint.
``sample_from_probs(probs, uniforms)``
    inverse-CDF sampling scaled by each row's own total; a zero-probability token is never
    returned.
``verify_sampled_draft(draft_tokens, draft_offsets, accept_uniforms, sample_uniforms,
target_probs, draft_rows, draft_probs)``, ``verify_point_draft`` (the same without the last two:
a deterministic proposer, whose proposal is a point mass)
    rejection sampling with a bonus token (Leviathan et al. 2023) over a ragged batch: request
    ``i`` drafted ``draft_tokens[draft_offsets[i]:draft_offsets[i + 1]]``, and its target rows
    are ``draft_offsets[i] + i`` onwards (one more than its drafts); draft ``t`` was sampled from
    ``draft_probs[draft_rows[t]]``. Returns the accepted count per request and, per target row,
    the emitted token (accepted drafts, then the corrected or bonus token, then -1).
"""

from __future__ import annotations

import tvm
from tvm import relax as rx
from tvm import te, tirx, topi
from tvm.script import tirx as T

from mlc_spec.runtime.artifact import (
    CPU_SAMPLER_FUNCTIONS,
    MAX_TREE_WIDTH,
    SAMPLER_FUNCTIONS,
    TOP_CANDIDATES,
)

from .cpu_probs import exp_rows, probs_rows
from .cpu_sample import sample_rows

ARGMAX, PROBS, PROBS_TOP_KP, SAMPLE, VERIFY_SAMPLED, VERIFY_POINT, MASK = SAMPLER_FUNCTIONS
PROBS_TOP_CANDIDATES, TOP_TOKENS = CPU_SAMPLER_FUNCTIONS

F32, I32 = "float32", "int32"
_ZERO = tirx.const(0, F32)
# exp(-87) ~ 1.6e-38, the smallest normal float32: below it a token's probability is 0.
_EXP_FLOOR = tirx.const(-87.0, F32)


def attach_sampler(
    mod: tvm.IRModule, vocab_size: int | None = None, cpu: bool = False
) -> tvm.IRModule:
    """``mod`` plus the sampling functions (an empty module gives them alone), for a vocabulary
    of ``vocab_size`` tokens (any size with ``None``), and for a ``cpu`` target the CPU ones
    (``CPU_SAMPLER_FUNCTIONS``). A known size lets the CPU schedules vectorise the row loops."""
    bb = rx.BlockBuilder(mod)
    v = vocab_size
    _add_argmax(bb, v)
    _add_probs(bb, v, cpu)
    _add_probs_top_kp(bb, v, cpu)
    _add_sample(bb, v, cpu)
    _add_verify(bb, v, VERIFY_SAMPLED, cpu, sampled_draft=True)
    _add_verify(bb, v, VERIFY_POINT, cpu, sampled_draft=False)
    _add_mask(bb, v)
    if cpu:
        _add_probs_top_candidates(bb, v)
        _add_top_tokens(bb, v)
    return bb.finalize()


def _add_argmax(bb: rx.BlockBuilder, vocab_size: int | None) -> None:
    n, v = _sizes("n", vocab_size)
    logits = _arg("logits", [n, v], F32)
    _function(bb, ARGMAX, [logits], lambda: _te(bb, argmax, logits))


def _add_probs(bb: rx.BlockBuilder, vocab_size: int | None, cpu: bool) -> None:
    n, v = _sizes("n", vocab_size)
    logits, temperature = _arg("logits", [n, v], F32), _arg("temperature", [n], F32)
    _function(bb, PROBS, [logits, temperature], lambda: _plain(bb, logits, temperature, cpu))


def _add_probs_top_kp(bb: rx.BlockBuilder, vocab_size: int | None, cpu: bool) -> None:
    params = _cut_params(vocab_size)
    _function(bb, PROBS_TOP_KP, params, lambda: _top_kp(bb, *params, cpu=cpu))


def _add_probs_top_candidates(bb: rx.BlockBuilder, vocab_size: int | None) -> None:
    params = _cut_params(vocab_size)
    n, v = params[0].ty.shape
    _function(bb, PROBS_TOP_CANDIDATES, params, lambda: _top_candidates(bb, n, v, *params))


def _add_top_tokens(bb: rx.BlockBuilder, vocab_size: int | None) -> None:
    from .cpu_top_k import top_candidates  # noqa: PLC0415 - its TVMScript needs the vocab

    n, v = _sizes("n", vocab_size)
    logits = _arg("logits", [n, v], F32)

    def body() -> rx.Expr:
        kernel = top_candidates(v, MAX_TREE_WIDTH).with_attr("global_symbol", "top_tree_tokens")
        kernel = bb.add_func(kernel, "top_tree_tokens")
        tokens = bb.emit(rx.call_tir(kernel, [logits], rx.TensorType([n, MAX_TREE_WIDTH], I32)))
        probs = _te(bb, _softmax, logits)
        gather = bb.add_func(_gather_rows(v, MAX_TREE_WIDTH), "gather_rows")
        picked = rx.call_tir(gather, [probs, tokens], rx.TensorType([n, MAX_TREE_WIDTH], F32))
        return rx.Tuple([tokens, bb.emit(picked)])

    _function(bb, TOP_TOKENS, [logits], body)


def _softmax(logits: te.Tensor) -> te.Tensor:
    e = _row_exp(logits)
    n, v = e.shape
    k = te.reduce_axis((0, v), name="k")
    total = te.compute((n,), lambda i: te.sum(e[i, k], axis=k), name="total")
    return te.compute(e.shape, lambda i, j: e[i, j] / total[i], name="softmax")


def _gather_rows(v: tirx.PrimExpr, width: int) -> tirx.PrimFunc:
    """x [n, v], columns [n, width] -> x at each row's columns (0 where a column is -1). Its
    reads depend on the data, so it is a kernel of its own, not a TE gather."""

    @T.prim_func(s_tir=True)
    def gather_rows(var_x: T.handle, var_columns: T.handle, var_out: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "op_pattern": 8})
        n = T.int64()
        x = T.match_buffer(var_x, (n, v), F32)
        columns = T.match_buffer(var_columns, (n, width), I32)
        out = T.match_buffer(var_out, (n, width), F32)
        for i in range(n):
            with T.sblock("row"):
                T.reads(x[i, 0:v], columns[i, 0:width])
                T.writes(out[i, 0:width])
                for j in range(width):
                    column: T.let[T.int32] = columns[i, j]
                    out[i, j] = T.if_then_else(column >= 0, x[i, T.max(column, 0)], T.float32(0))

    return gather_rows


def _cut_params(vocab_size: int | None) -> list[rx.Var]:
    """logits [n, V], and each row's temperature, top_k and top_p."""
    n, v = _sizes("n", vocab_size)
    return [
        _arg("logits", [n, v], F32),
        _arg("temperature", [n], F32),
        _arg("top_k", [n], I32),
        _arg("top_p", [n], F32),
    ]


def _add_sample(bb: rx.BlockBuilder, vocab_size: int | None, cpu: bool) -> None:
    n, v = _sizes("n", vocab_size)
    probs, uniforms = _arg("probs", [n, v], F32), _arg("uniforms", [n], F32)
    _function(bb, SAMPLE, [probs, uniforms], lambda: _sample(bb, probs, uniforms, cpu))


def _add_mask(bb: rx.BlockBuilder, vocab_size: int | None) -> None:
    n, v, w = _sizes("n", vocab_size, "w")
    logits, bitmask = _arg("logits", [n, v], F32), _arg("bitmask", [n, w], I32)
    _function(bb, MASK, [logits, bitmask], lambda: _te(bb, _masked, logits, bitmask))


def _masked(logits: te.Tensor, bitmask: te.Tensor) -> te.Tensor:
    """-inf where bit ``j % 32`` of ``bitmask[i, j // 32]`` is 0 (xgrammar's token bitmask)."""

    def keep(i, j):
        word = bitmask[i, j // 32]
        allowed = tirx.bitwise_and(tirx.shift_right(word, _i32(j % 32)), 1) == 1
        return tirx.Select(allowed, logits[i, j], tirx.const(float("-inf"), F32))

    return te.compute(logits.shape, keep, name="masked")


def _add_verify(
    bb: rx.BlockBuilder, vocab_size: int | None, name: str, cpu: bool, sampled_draft: bool
) -> None:
    t, b, r, d, v = _sizes("t", "b", "r", "d", vocab_size)
    params = [
        _arg("draft_tokens", [t], I32),
        _arg("draft_offsets", [b + 1], I32),
        _arg("accept_uniforms", [t], F32),
        _arg("sample_uniforms", [b], F32),
        _arg("target_probs", [r, v], F32),
    ]
    if sampled_draft:
        params += [_arg("draft_rows", [t], I32), _arg("draft_probs", [d, v], F32)]
    _function(bb, name, params, lambda: _verify(bb, cpu, *params))


def _sizes(*dims: str | int | None) -> list[tirx.PrimExpr]:
    """Symbolic dimensions by name; the vocabulary's fixed where known (``None``: symbolic)."""
    return [
        tirx.const(d, "int64") if isinstance(d, int) else tirx.Var(d or "v", "int64") for d in dims
    ]


def _arg(name: str, shape: list, dtype: str) -> rx.Var:
    return rx.Var(name, rx.TensorType(shape, dtype))


def _function(bb: rx.BlockBuilder, name: str, params: list[rx.Var], body) -> None:
    with bb.function(name, params):
        with bb.dataflow():
            out = bb.emit_output(body())
        bb.emit_func_output(out)


def _te(bb: rx.BlockBuilder, fn, *args: rx.Expr) -> rx.Var:
    return bb.emit_te(fn, *args, primfunc_name_hint=fn.__name__.strip("_"))


def _i32(value) -> tirx.PrimExpr:
    return tirx.Cast(I32, value)


# ---- logits -> probabilities -----------------------------------------------------------------


def argmax(x: te.Tensor) -> te.Tensor:
    """Per-row argmax as int32, the first index on ties (on the CPU, ``cpu_argmax`` swaps in a
    vectorised kernel)."""
    index = topi.argmax(x, axis=1, select_last_index=False)
    return te.compute(index.shape, lambda i: _i32(index[i]), name="argmax_i32")


def _scaled(logits: te.Tensor, temperature: te.Tensor) -> te.Tensor:
    """``logits / temperature``; greedy rows (temperature 0) as they are."""
    one = tirx.const(1, F32)
    return te.compute(
        logits.shape,
        lambda i, j: logits[i, j] / tirx.Select(temperature[i] == 0, one, temperature[i]),
        name="scaled",
    )


def _greedy_rows(
    probs: te.Tensor, logits: te.Tensor, temperature: te.Tensor, best: te.Tensor | None = None
) -> te.Tensor:
    """Rows with temperature 0 replaced by the one-hot of the logits' argmax (``best`` where
    it was computed apart)."""
    best = argmax(logits) if best is None else best
    one, zero = tirx.const(1, F32), tirx.const(0, F32)
    return te.compute(
        probs.shape,
        lambda i, j: tirx.Select(
            temperature[i] == 0, tirx.Select(best[i] == j, one, zero), probs[i, j]
        ),
        name="greedy_rows",
    )


def _row_exp(x: te.Tensor) -> te.Tensor:
    """``exp(x - max(row))`` by TVM's polynomial exp, which vectorises (``te.exp`` is a scalar
    libm call per element on CPU) and is float32-accurate; exactly 0 far below the maximum,
    where it would clamp instead, so that masked (-inf) tokens keep probability 0."""
    n, v = x.shape
    k = te.reduce_axis((0, v), name="k")
    peak = te.compute((n,), lambda i: te.max(x[i, k], axis=k), name="peak")
    shifted = topi.fast_exp(te.compute(x.shape, lambda i, j: x[i, j] - peak[i], name="shifted"))
    return te.compute(
        x.shape,
        lambda i, j: tirx.Select(x[i, j] - peak[i] > _EXP_FLOOR, shifted[i, j], _ZERO),
        name="row_exp",
    )


def _probs(logits: te.Tensor, temperature: te.Tensor) -> te.Tensor:
    e = _row_exp(_scaled(logits, temperature))
    n, v = e.shape
    k = te.reduce_axis((0, v), name="k")
    total = te.compute((n,), lambda i: te.sum(e[i, k], axis=k), name="total")
    probs = te.compute(e.shape, lambda i, j: e[i, j] / total[i], name="softmax")
    return _greedy_rows(probs, logits, temperature)


def _plain(bb: rx.BlockBuilder, logits: rx.Var, temperature: rx.Var, cpu: bool) -> rx.Var:
    """``_probs``; on the CPU the vectorised kernel of ``cpu_probs`` instead."""
    if not cpu:
        return _te(bb, _probs, logits, temperature)
    n, v = logits.ty.shape
    kernel = bb.add_func(probs_rows(v), "probs_rows")
    return bb.emit(rx.call_tir(kernel, [logits, temperature], rx.TensorType([n, v], F32)))


def _uncut_as_plain(
    bb: rx.BlockBuilder,
    cut: rx.Var,
    logits: rx.Var,
    temperature: rx.Var,
    top_k: rx.Var,
    top_p: rx.Var,
) -> rx.Var:
    """On the CPU, rows that neither top-k nor top-p cuts take ``_plain``'s bits: a request
    then samples from the same probabilities whichever function its batch-mates' parameters
    select, as its seed's draws require; ``_plain`` rounds otherwise than ``_cut``."""
    plain = _plain(bb, logits, temperature, cpu=True)

    def rows(plain, cut, top_k, top_p):
        v = plain.shape[1]

        def value(i, j):
            off = tirx.all(tirx.any(top_k[i] <= 0, top_k[i] >= _i32(v)), top_p[i] >= 1)
            return tirx.Select(off, plain[i, j], cut[i, j])

        return te.compute(plain.shape, value, name="uncut_as_plain")

    return _te(bb, rows, plain, cut, top_k, top_p)


def _top_kp(
    bb: rx.BlockBuilder,
    logits: rx.Var,
    temperature: rx.Var,
    top_k: rx.Var,
    top_p: rx.Var,
    cpu: bool,
) -> rx.Var:
    """One stable descending argsort serves both cuts: top-k reads the k-th value, top-p the
    cumulative mass in that order."""
    x = _te(bb, _scaled, logits, temperature)
    order = bb.emit(rx.op.argsort(x, axis=1, descending=True, dtype=I32))
    probs = _cut(bb, logits, x, order, temperature, top_k, top_p, cpu)
    if not cpu:
        return probs
    return _uncut_as_plain(bb, probs, logits, temperature, top_k, top_p)


def _top_candidates(
    bb: rx.BlockBuilder,
    n: tirx.PrimExpr,
    v: tirx.PrimExpr,
    logits: rx.Var,
    temperature: rx.Var,
    top_k: rx.Var,
    top_p: rx.Var,
) -> rx.Expr:
    """``_top_kp`` over the first ``TOP_CANDIDATES`` places of the order, found without a sort.
    Where the top-k set lies within them, every place after it holds zero mass in the full
    order, so the cumulative sums, the top-p cut and the kept tokens are the same values."""
    from .cpu_top_k import top_candidates  # noqa: PLC0415 - its TVMScript needs the vocab

    x = _te(bb, _scaled, logits, temperature)
    kernel = bb.add_func(top_candidates(v), "top_candidates")
    order = bb.emit(rx.call_tir(kernel, [x], rx.TensorType([n, TOP_CANDIDATES], I32)))
    probs = _cut(bb, logits, x, order, temperature, top_k, top_p, cpu=True)
    return rx.Tuple([probs, _te(bb, _fits, x, order, temperature, top_k)])


def _cut(bb, logits, x, order, temperature, top_k, top_p, cpu: bool) -> rx.Var:
    """Top-k and top-p with ``order``: a stable descending argsort of ``x``, whole or its first
    places (-1 past the row's end). On the CPU the row's exponentials and the greedy rows'
    argmax come from vector kernels (``cpu_probs.exp_rows``, ``cpu_argmax``) in place of
    TVM's scalar passes over the row; both functions that cut go through here, so they keep
    giving a row that fits the same bits."""
    if cpu:
        from .cpu_argmax import argmax_rows  # noqa: PLC0415 - it imports this module's argmax

        n, v = logits.ty.shape
        exps = bb.add_func(exp_rows(v), "exp_rows")
        e = bb.emit(rx.call_tir(exps, [x], rx.TensorType([n, v], F32)))
        # Unnamed: the pipeline swaps the same kernel in for the sampler's own argmax too.
        argmaxes = bb.add_func(argmax_rows(v).without_attr("global_symbol"), "argmax_rows")
        best = bb.emit(rx.call_tir(argmaxes, [logits], rx.TensorType([n], I32)))
    else:
        e, best = _te(bb, _row_exp, x), None
    sorted_exp = _te(bb, _sorted_exp, x, e, order, temperature, top_k)
    cdf = bb.emit(rx.op.cumsum(sorted_exp, axis=1))
    return _te(bb, _kept_probs, logits, x, e, order, temperature, top_k, top_p, cdf, best)


def _kth(x: te.Tensor, order: te.Tensor, temperature: te.Tensor, top_k: te.Tensor) -> te.Tensor:
    """Each row's k-th largest scaled logit, or the lowest float where top-k is off."""
    n, v = x.shape
    width = order.shape[1]

    def kth(i):
        on = tirx.all(top_k[i] > 0, top_k[i] < _i32(v), temperature[i] != 0)
        col = tirx.max(tirx.min(top_k[i] - 1, _i32(width) - 1), 0)
        return tirx.Select(on, x[i, tirx.max(order[i, col], 0)], tirx.min_value(F32))

    return te.compute((n,), kth, name="kth")


def _fits(x: te.Tensor, order: te.Tensor, temperature: te.Tensor, top_k: te.Tensor) -> te.Tensor:
    """1 where the row's top-k set lies within ``order``'s places: greedy rows, rows that order
    whole, and rows whose last place holds a value below the k-th (every value not placed is
    at most it); 0 elsewhere (top-k off or beyond the places, or ties at the k-th value
    running past them)."""
    n, width = order.shape
    kth = _kth(x, order, temperature, top_k)

    def fits(i):
        last = order[i, width - 1]
        on = tirx.all(top_k[i] > 0, top_k[i] <= _i32(width), top_k[i] < _i32(x.shape[1]))
        within = tirx.any(last < 0, x[i, tirx.max(last, 0)] < kth[i])
        return tirx.Select(tirx.any(temperature[i] == 0, tirx.all(on, within)), 1, 0)

    return te.compute((n,), lambda i: _i32(fits(i)), name="fits")


def _sorted_exp(
    x: te.Tensor, e: te.Tensor, order: te.Tensor, temperature: te.Tensor, top_k: te.Tensor
) -> te.Tensor:
    """``exp(x - max)`` in descending order, zero below the k-th value (and past the row)."""
    kth = _kth(x, order, temperature, top_k)

    def value(i, j):
        t = order[i, j]
        safe = tirx.max(t, 0)
        return tirx.Select(tirx.all(t >= 0, x[i, safe] >= kth[i]), e[i, safe], _ZERO)

    return te.compute(order.shape, value, name="sorted_exp")


def _kept_probs(
    logits: te.Tensor,
    x: te.Tensor,
    e: te.Tensor,
    order: te.Tensor,
    temperature: te.Tensor,
    top_k: te.Tensor,
    top_p: te.Tensor,
    cdf: te.Tensor,
    best: te.Tensor | None = None,
) -> te.Tensor:
    """Top-k and top-p applied in token order, renormalised.

    Sorted position ``j`` is kept while the mass strictly before it is below ``top_p``: a prefix
    of length ``L``. In token order that prefix is every token above the cut value ``x[cut]``
    plus, at the cut value, the tokens with ids up to the cut's own (the sort is stable)."""
    n, v = x.shape
    width = order.shape[1]
    kth = _kth(x, order, temperature, top_k)
    j = te.reduce_axis((0, width), name="j")

    def num_kept(i):
        before = cdf[i, tirx.max(j.var - 1, 0)]
        keep = tirx.any(j.var == 0, before < top_p[i] * cdf[i, width - 1])
        return te.sum(tirx.Select(keep, 1, 0), axis=j)

    length = te.compute((n,), num_kept, name="num_kept")

    def kept_exp(i, t):
        value, cut = x[i, t], tirx.max(order[i, tirx.max(length[i], 1) - 1], 0)
        use_p = tirx.all(top_p[i] < 1, temperature[i] != 0)
        in_p = tirx.any(tirx.Not(use_p), value > x[i, cut], tirx.all(value == x[i, cut], t <= cut))
        keep = tirx.all(value >= kth[i], in_p)
        return tirx.Select(keep, e[i, t], _ZERO)

    kept = te.compute(x.shape, kept_exp, name="kept_exp")
    k = te.reduce_axis((0, v), name="k")
    total = te.compute((n,), lambda i: te.sum(kept[i, k], axis=k), name="kept_total")
    probs = te.compute(x.shape, lambda i, t: kept[i, t] / total[i], name="kept_probs")
    return _greedy_rows(probs, logits, temperature, best)


# ---- probabilities -> tokens -----------------------------------------------------------------


def _sample(bb: rx.BlockBuilder, probs: rx.Var, uniforms: rx.Var, cpu: bool) -> rx.Var:
    """Inverse-CDF draws; on the CPU the blocked kernel of ``cpu_sample`` instead."""
    if cpu:
        n, v = probs.ty.shape
        kernel = bb.add_func(sample_rows(v), "sample_rows")
        return bb.emit(rx.call_tir(kernel, [probs, uniforms], rx.TensorType([n], I32)))
    cdf = bb.emit(rx.op.cumsum(probs, axis=1))
    return _te(bb, _inverse_cdf, probs, cdf, uniforms)


def _inverse_cdf(probs: te.Tensor, cdf: te.Tensor, uniforms: te.Tensor) -> te.Tensor:
    """The first token of positive probability whose cumulative mass exceeds ``u * total``
    (so that rounding in a parallel scan can never pick a zero), else the last positive one."""
    n, v = probs.shape
    j = te.reduce_axis((0, v), name="j")
    k = te.reduce_axis((0, v), name="k")
    first = te.compute(
        (n,),
        lambda i: te.min(
            tirx.Select(
                tirx.all(cdf[i, j] > uniforms[i] * cdf[i, v - 1], probs[i, j] > 0),
                _i32(j.var),
                _i32(v),
            ),
            axis=j,
        ),
        name="first_above",
    )
    last = te.compute(
        (n,),
        lambda i: te.max(tirx.Select(probs[i, k] > 0, _i32(k.var), 0), axis=k),
        name="last_positive",
    )
    return te.compute((n,), lambda i: tirx.min(first[i], last[i]), name="sampled")


# ---- verification ----------------------------------------------------------------------------


def _verify(
    bb: rx.BlockBuilder,
    cpu: bool,
    draft_tokens: rx.Var,
    offsets: rx.Var,
    accept_u: rx.Var,
    sample_u: rx.Var,
    target_probs: rx.Var,
    draft_rows: rx.Var | None = None,
    draft_probs: rx.Var | None = None,
) -> rx.Tuple:
    draft = [] if draft_rows is None else [draft_rows, draft_probs]
    accepted = _te(bb, _num_accepted, draft_tokens, offsets, accept_u, target_probs, *draft)
    last = _te(bb, _last_distribution, draft_tokens, offsets, accepted, target_probs, *draft)
    token = _sample(bb, last, sample_u, cpu)
    emitted = _te(bb, _emitted, draft_tokens, offsets, accepted, token, target_probs)
    return rx.Tuple([accepted, emitted])


def _draft_prob(draft_rows, draft_probs, t, token) -> tirx.PrimExpr:
    """The draft's probability of ``token`` at draft ``t``: 1 for a point-mass proposal."""
    if draft_rows is None:
        return tirx.const(1, F32)
    return draft_probs[draft_rows[t], token]


def _num_accepted(draft_tokens, offsets, accept_u, target_probs, draft_rows=None, draft_probs=None):
    """Per request, the first draft position ``j`` rejected (``u * p_d(x) >= p_t(x)``), or its
    draft count: a minimum over positions, so no loop carries state."""
    (b1,), (t,) = offsets.shape, draft_tokens.shape
    j = te.reduce_axis((0, t + 1), name="j")

    def first_rejected(i):
        k = offsets[i + 1] - offsets[i]
        d = tirx.min(offsets[i] + _i32(j.var), _i32(t) - 1)  # clamped: read only when j < k
        x = draft_tokens[d]
        p_t = target_probs[d + _i32(i), x]
        rejected = accept_u[d] * _draft_prob(draft_rows, draft_probs, d, x) >= p_t
        stop = tirx.any(_i32(j.var) >= k, rejected)
        return te.min(tirx.Select(stop, _i32(j.var), k), axis=j)

    return te.compute((b1 - 1,), first_rejected, name="num_accepted")


def _last_distribution(
    draft_tokens, offsets, accepted, target_probs, draft_rows=None, draft_probs=None
):
    """What each request's last token is sampled from: after a rejection the residual
    ``max(0, p_t - p_d)`` (unnormalised; the target row itself if rounding left it no mass),
    else the bonus row."""
    (b,), (t,), (_, v) = accepted.shape, draft_tokens.shape, target_probs.shape
    zero = tirx.const(0, F32)

    def row(i):
        return offsets[i] + _i32(i) + accepted[i]

    def rejected_draft(i):
        return tirx.min(offsets[i] + accepted[i], _i32(t) - 1)

    def residual(i, w):
        p_t = target_probs[row(i), w]
        d = rejected_draft(i)
        if draft_rows is None:
            p_d = tirx.Select(draft_tokens[d] == _i32(w), tirx.const(1, F32), zero)
        else:
            p_d = draft_probs[draft_rows[d], w]
        rejected = accepted[i] < offsets[i + 1] - offsets[i]
        return tirx.Select(rejected, tirx.max(p_t - p_d, zero), p_t)

    res = te.compute((b, v), residual, name="residual")
    w = te.reduce_axis((0, v), name="w")
    mass = te.compute((b,), lambda i: te.sum(res[i, w], axis=w), name="residual_mass")
    return te.compute(
        (b, v),
        lambda i, x: tirx.Select(mass[i] > zero, res[i, x], target_probs[row(i), x]),
        name="last_distribution",
    )


def _emitted(draft_tokens, offsets, accepted, token, target_probs):
    """Per target row: the accepted drafts of its request, then its last token, then -1."""
    (b,), (t,), (r, _) = accepted.shape, draft_tokens.shape, target_probs.shape
    q = te.reduce_axis((0, b), name="q")
    # Request q's rows end at offsets[q + 1] + q + 1: row s belongs to the requests ending at or
    # before it, counted.
    owner = te.compute(
        (r,),
        lambda s: te.sum(tirx.Select(offsets[q + 1] + _i32(q) + 1 <= _i32(s), 1, 0), axis=q),
        name="owner",
    )

    def emitted(s):
        i = owner[s]
        pos = _i32(s) - offsets[i] - i
        draft = draft_tokens[tirx.min(offsets[i] + pos, _i32(t) - 1)]
        return tirx.Select(pos < accepted[i], draft, tirx.Select(pos == accepted[i], token[i], -1))

    return te.compute((r,), emitted, name="emitted")
