"""The sampler's greedy ``argmax`` on the CPU, vectorised, in place of TVM's.

TVM's argmax reduces a row one element at a time, value and index carried through two selects,
on one thread for all rows: over a 152k-token vocabulary a visible share of a verify call
(docs/kernels.md). Here 16 lanes keep each its own first maximum over every 16th element, the
lanes are merged (highest value, then lowest index) and the tail past the last full vector (the
whole row if it is shorter than one) is scanned; rows run on the thread pool when there are
several. The result is ``np.argmax``'s for rows without NaN: the lowest index on ties, also in
a row of nothing but -inf (TVM's gives -1).

``UseCPUArgmaxKernel`` swaps it in only where the module's ``argmax`` is the sampler's
(``compiler/sampler.py``), checked structurally, whatever its vocabulary size.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import te, tirx
from tvm.script import tirx as T

from .cpu_rule import each_row, per_vocabulary
from .sampler import argmax

NAME = argmax.__name__  # the sampler's PrimFunc (``emit_te`` names it after the function)
LANES = 16


@per_vocabulary
def argmax_rows(v: tirx.PrimExpr) -> tirx.PrimFunc:
    """logits [n, v] float32 -> the index of each row's first maximum, int32 [n]."""
    vectors = v // LANES

    @T.macro
    def row(logits, out, i):
        with T.sblock("row"):
            T.reads(logits[i, 0:v])
            T.writes(out[i])
            best = T.sblock_alloc_buffer((LANES,), "float32", scope="local")
            index = T.sblock_alloc_buffer((LANES,), "int32", scope="local")
            top = T.sblock_alloc_buffer((1,), "float32", scope="local")
            at = T.sblock_alloc_buffer((1,), "int32", scope="local")
            top[0] = logits[i, 0]
            at[0] = 0
            if vectors > 0:
                for lane in T.vectorized(LANES):
                    best[lane] = logits[i, lane]
                    index[lane] = T.int32(lane)
                for j in range(1, vectors):
                    for lane in T.vectorized(LANES):
                        x: T.let[T.float32] = logits[i, j * LANES + lane]
                        index[lane] = T.Select(
                            x > best[lane], T.Cast("int32", j * LANES + lane), index[lane]
                        )
                        best[lane] = T.Select(x > best[lane], x, best[lane])
                top[0] = best[0]
                at[0] = index[0]
                for lane in range(1, LANES):
                    if best[lane] > top[0] or (best[lane] == top[0] and index[lane] < at[0]):
                        top[0] = best[lane]
                        at[0] = index[lane]
            for j in range(vectors * LANES, v):
                if logits[i, j] > top[0]:
                    top[0] = logits[i, j]
                    at[0] = T.Cast("int32", j)
            out[i] = at[0]

    @T.prim_func(s_tir=True)
    def argmax_kernel(var_logits: T.handle, var_out: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        n = T.int64()
        logits = T.match_buffer(var_logits, (n, v), "float32")
        out = T.match_buffer(var_out, (n,), "int32")
        each_row(n, row, (logits, out))

    return argmax_kernel


@tvm.transform.module_pass(opt_level=0, name="UseCPUArgmaxKernel")
class UseCPUArgmaxKernel:
    """Swap in ``argmax_rows`` for the module's ``argmax`` where that is the sampler's: equal to
    what ``sampler.argmax`` builds for the same logits shape (as ``emit_te`` does)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        gv = next((g for g in mod.get_global_vars() if g.name_hint == NAME), None)
        if gv is None or not isinstance(mod[gv], tirx.PrimFunc):
            return mod
        shape = mod[gv].params[0].ty.shape
        logits = te.placeholder(shape, "float32", "logits")
        sampler_kernel = te.create_prim_func(
            [logits, argmax(logits)], index_dtype_override="int64"
        ).without_attr("global_symbol")
        if not tvm_ffi.structural_equal(mod[gv], sampler_kernel, map_free_vars=True):
            return mod
        mod[gv] = argmax_rows(shape[1])
        return mod
