"""The ``TOP_CANDIDATES`` largest scaled logits of each row, in a stable descending order, on
the CPU: what top-k sampling needs, without sorting the whole vocabulary.

TVM's CPU argsort sorts all 152k logits of a Qwen row (~16 ms a row on 2 Zen 4 cores), and
``probs_from_logits_top_kp`` paid that for every sampled row of every step, draft rows
included. One pass per row keeps the largest values seen in a small sorted buffer instead
(~0.2 ms): an element enters only when it beats the buffer's last, and is inserted after the
equal values already there, so the buffer is exactly the first entries of the stable
descending argsort (ties: lower index first).
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from mlc_spec.runtime.artifact import TOP_CANDIDATES

from .cpu_rule import each_row, per_vocabulary


@per_vocabulary
def top_candidates(v: tirx.PrimExpr, width: int = TOP_CANDIDATES) -> tirx.PrimFunc:
    """x [n, v] float32 -> the indices of each row's ``width`` largest values [n, width] int32,
    in the order of a stable descending sort; -1 past the row's end where ``v < width``."""

    @T.macro
    def row(x, out, i):
        with T.sblock("row"):
            T.reads(x[i, 0:v])
            T.writes(out[i, 0:width])
            best = T.sblock_alloc_buffer((width,), "float32", scope="local")
            count = T.sblock_alloc_buffer((1,), "int32", scope="local")
            at = T.sblock_alloc_buffer((1,), "int32", scope="local")
            for p in range(width):
                best[p] = T.min_value("float32")
                out[i, p] = -1
            count[0] = 0
            for j in range(v):
                value: T.let[T.float32] = x[i, j]
                if count[0] < width or value > best[width - 1]:
                    if count[0] < width:
                        at[0] = count[0]
                        count[0] = count[0] + 1
                    else:
                        at[0] = width - 1
                    # Move smaller values down one place; equal ones (lower indices) stay ahead.
                    while at[0] > 0 and best[T.max(at[0] - 1, 0)] < value:
                        best[at[0]] = best[at[0] - 1]
                        out[i, at[0]] = out[i, at[0] - 1]
                        at[0] = at[0] - 1
                    best[at[0]] = value
                    out[i, at[0]] = T.Cast("int32", j)

    @T.prim_func(s_tir=True)
    def top_candidates_kernel(var_x: T.handle, var_out: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        n = T.int64()
        x = T.match_buffer(var_x, (n, v), "float32")
        out = T.match_buffer(var_out, (n, width), "int32")
        each_row(n, row, (x, out))

    return top_candidates_kernel
