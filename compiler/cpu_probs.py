"""The sampler's temperature softmax (``probs``) on the CPU, vectorised, in place of TVM's.

TVM lowers ``sampler._probs`` as one pass over a row per stage (scale, maximum, shift,
exponential, floor, sum, division, and an argmax and a select for greedy rows), each a scalar
loop on one thread: a visible share of every decode step that samples rather than takes the
argmax, over a vocabulary of 50-150k tokens (docs/kernels.md). Here a row takes three vector
passes: the maximum of its logits (for a positive temperature the maximum of the scaled logits
too, division being monotonic), then ``exp(x / T - max / T)`` (``vector_exp.exp``, 0 below
``EXP_FLOOR`` as before) stored and summed in 16 lanes, then the division by the sum. A greedy
row (temperature 0) is the one-hot of its first maximum. ``exp_rows`` is the first two passes
alone, the exponentials that top-k and top-p keep or cut (``sampler._cut``). Rows run on the
thread pool when there are several; every row's arithmetic is the same whatever the batch.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .cpu_rule import each_row, per_vocabulary
from .vector_exp import exp

LANES = 16
# exp(-87) ~ 1.6e-38, the smallest normal float32: below it a token's probability is 0.
EXP_FLOOR = -87.0


def _passes(v: tirx.PrimExpr):
    """The row passes both kernels share, for rows of ``v`` values: ``row_max`` (acc[0] = the
    row's maximum: 16 lanes, then the lanes and the tail) and ``exps`` (out = the floored
    ``exp(x / scale - peak)``, acc[1] = their sum, in 16 lanes then across them)."""
    vectors = v // LANES
    tail = vectors * LANES

    @T.macro
    def row_max(x, i, lanes, acc):
        acc[0] = x[i, 0]
        if vectors > 0:
            for lane in T.vectorized(LANES):
                lanes[lane] = x[i, lane]
            for j in range(1, vectors):
                for lane in T.vectorized(LANES):
                    lanes[lane] = T.max(lanes[lane], x[i, j * LANES + lane])
            for lane in range(LANES):
                acc[0] = T.max(acc[0], lanes[lane])
        for j in range(tail, v):
            acc[0] = T.max(acc[0], x[i, j])

    @T.macro
    def exps(x, scale, peak, out, i, lanes, acc):
        acc[1] = T.float32(0)
        if vectors > 0:
            for lane in T.vectorized(LANES):
                lanes[lane] = T.float32(0)
            for j in range(vectors):
                for lane in T.vectorized(LANES):
                    d: T.let[T.float32] = x[i, j * LANES + lane] / scale - peak
                    e: T.let[T.float32] = T.Select(d > T.float32(EXP_FLOOR), exp(d), T.float32(0))
                    out[i, j * LANES + lane] = e
                    lanes[lane] = lanes[lane] + e
            for lane in range(LANES):
                acc[1] = acc[1] + lanes[lane]
        for j in range(tail, v):
            d: T.let[T.float32] = x[i, j] / scale - peak
            e: T.let[T.float32] = T.Select(d > T.float32(EXP_FLOOR), exp(d), T.float32(0))
            out[i, j] = e
            acc[1] = acc[1] + e

    return row_max, exps


@per_vocabulary
def probs_rows(v: tirx.PrimExpr) -> tirx.PrimFunc:
    """(logits [n, v], temperature [n]) float32 -> probs [n, v] float32."""
    vectors = v // LANES
    tail = vectors * LANES
    past = tirx.Cast("int32", v)  # an index past the row: none found yet
    row_max, exps = _passes(v)

    @T.macro
    def row(logits, temperature, out, i):
        with T.sblock("row"):
            T.reads(logits[i, 0:v], temperature[i])
            T.writes(out[i, 0:v])
            lanes = T.sblock_alloc_buffer((LANES,), "float32", scope="local")
            index = T.sblock_alloc_buffer((LANES,), "int32", scope="local")
            acc = T.sblock_alloc_buffer((2,), "float32", scope="local")
            first = T.sblock_alloc_buffer((1,), "int32", scope="local")
            row_max(logits, i, lanes, acc)
            if temperature[i] == T.float32(0):
                # One-hot of the first maximum (np.argmax's index).
                first[0] = past
                if vectors > 0:
                    for lane in T.vectorized(LANES):
                        index[lane] = past
                    for j in range(vectors):
                        for lane in T.vectorized(LANES):
                            index[lane] = T.Select(
                                logits[i, j * LANES + lane] == acc[0] and index[lane] == past,
                                T.Cast("int32", j * LANES + lane),
                                index[lane],
                            )
                    for lane in range(LANES):
                        first[0] = T.min(first[0], index[lane])
                for j in range(tail, v):
                    if logits[i, j] == acc[0] and first[0] == past:
                        first[0] = T.Cast("int32", j)
                for j in range(vectors):
                    for lane in T.vectorized(LANES):
                        out[i, j * LANES + lane] = T.Select(
                            T.Cast("int32", j * LANES + lane) == first[0],
                            T.float32(1),
                            T.float32(0),
                        )
                for j in range(tail, v):
                    out[i, j] = T.Select(T.Cast("int32", j) == first[0], T.float32(1), T.float32(0))
            else:
                exps(logits, temperature[i], acc[0] / temperature[i], out, i, lanes, acc)
                for j in range(vectors):
                    for lane in T.vectorized(LANES):
                        out[i, j * LANES + lane] = out[i, j * LANES + lane] / acc[1]
                for j in range(tail, v):
                    out[i, j] = out[i, j] / acc[1]

    @T.prim_func(s_tir=True)
    def probs_kernel(var_logits: T.handle, var_temperature: T.handle, var_out: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        n = T.int64()
        logits = T.match_buffer(var_logits, (n, v), "float32")
        temperature = T.match_buffer(var_temperature, (n,), "float32")
        out = T.match_buffer(var_out, (n, v), "float32")
        each_row(n, row, (logits, temperature, out))

    return probs_kernel


@per_vocabulary
def exp_rows(v: tirx.PrimExpr) -> tirx.PrimFunc:
    """x [n, v] float32 -> the floored ``exp(x - max(row))`` [n, v] float32 (``sampler._row_exp``),
    what the top-k / top-p functions keep or cut."""
    row_max, exps = _passes(v)

    @T.macro
    def row(x, out, i):
        with T.sblock("row"):
            T.reads(x[i, 0:v])
            T.writes(out[i, 0:v])
            lanes = T.sblock_alloc_buffer((LANES,), "float32", scope="local")
            acc = T.sblock_alloc_buffer((2,), "float32", scope="local")
            row_max(x, i, lanes, acc)
            exps(x, T.float32(1), acc[0], out, i, lanes, acc)

    @T.prim_func(s_tir=True)
    def exp_kernel(var_x: T.handle, var_out: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        n = T.int64()
        x = T.match_buffer(var_x, (n, v), "float32")
        out = T.match_buffer(var_out, (n, v), "float32")
        each_row(n, row, (x, out))

    return exp_kernel
