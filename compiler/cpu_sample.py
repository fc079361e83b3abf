"""The sampler's inverse-CDF draw (``sample_from_probs``) on the CPU, in place of TVM's.

TVM's lowering writes a row's whole cumulative sum (a scan, one dependent add per token), then
reads it twice more (the first token above the threshold, the last positive one), a cost as
large as the softmax before it (docs/kernels.md). Here a row is read in blocks of ``BLOCK``
tokens, each summed in 16 lanes and then across them: a first pass adds the blocks up to the
row's total, the second adds them again until the threshold ``u * total`` falls within one,
whose tokens it then adds one by one. The token is the first whose running sum exceeds the
threshold, else the row's last positive one, as before; a sum grows only at a positive token,
so a zero-probability one is never drawn. The sums add in another order than a scan, so a draw
within rounding of a token's boundary may pick its neighbour; every row's arithmetic is the
same whatever the batch."""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .cpu_rule import each_row, per_vocabulary

LANES = 16
BLOCK = 16 * LANES


@per_vocabulary
def sample_rows(v: tirx.PrimExpr) -> tirx.PrimFunc:
    """(probs [n, v] float32, uniforms [n] float32) -> one token per row, int32 [n]."""
    blocks = v // BLOCK
    tail = blocks * BLOCK
    past = tirx.Cast("int32", v)  # no token found yet

    @T.macro
    def block_sum(probs, i, b, lanes, acc):
        """acc[0] = the sum of block b of row i: 16 lanes, then across them."""
        for lane in T.vectorized(LANES):
            lanes[lane] = probs[i, b * BLOCK + lane]
        for q in range(1, BLOCK // LANES):
            for lane in T.vectorized(LANES):
                lanes[lane] = lanes[lane] + probs[i, b * BLOCK + q * LANES + lane]
        acc[0] = lanes[0]
        for lane in range(1, LANES):
            acc[0] = acc[0] + lanes[lane]

    @T.macro
    def row(probs, uniforms, out, i):
        with T.sblock("row"):
            T.reads(probs[i, 0:v], uniforms[i])
            T.writes(out[i])
            lanes = T.sblock_alloc_buffer((LANES,), "float32", scope="local")
            block = T.sblock_alloc_buffer((1,), "float32", scope="local")
            run = T.sblock_alloc_buffer((2,), "float32", scope="local")  # total, running sum
            token = T.sblock_alloc_buffer((1,), "int32", scope="local")
            run[0] = T.float32(0)
            for b in range(blocks):
                block_sum(probs, i, b, lanes, block)
                run[0] = run[0] + block[0]
            for j in range(tail, v):
                run[0] = run[0] + probs[i, j]
            threshold: T.let[T.float32] = uniforms[i] * run[0]
            run[1] = T.float32(0)
            token[0] = past
            for b in range(blocks):
                if token[0] == past:
                    block_sum(probs, i, b, lanes, block)
                    if run[1] + block[0] > threshold:
                        for t in range(BLOCK):
                            p: T.let[T.float32] = probs[i, b * BLOCK + t]
                            run[1] = run[1] + p
                            if token[0] == past and run[1] > threshold:
                                token[0] = T.Cast("int32", b * BLOCK + t)
                    else:
                        run[1] = run[1] + block[0]
            for j in range(tail, v):
                run[1] = run[1] + probs[i, j]
                if token[0] == past and run[1] > threshold:
                    token[0] = T.Cast("int32", j)
            if token[0] == past:  # u * total at or past the last running sum: the last positive
                token[0] = 0
                for j in range(v):
                    if probs[i, j] > T.float32(0):
                        token[0] = T.Cast("int32", j)
            out[i] = token[0]

    @T.prim_func(s_tir=True)
    def sample_kernel(var_probs: T.handle, var_uniforms: T.handle, var_out: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        n = T.int64()
        probs = T.match_buffer(var_probs, (n, v), "float32")
        uniforms = T.match_buffer(var_uniforms, (n,), "float32")
        out = T.match_buffer(var_out, (n,), "int32")
        each_row(n, row, (probs, uniforms, out))

    return sample_kernel
