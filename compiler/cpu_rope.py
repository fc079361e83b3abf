"""RoPE on the CPU: split a layer's fused QKV into q, k and v and rotate q and k, with each
position's cos/sin computed once.

TVM's ``fused_rope`` (``llama_rope_with_position_map``) computes ``pow``, ``cos`` and ``sin``
through libm for every element of every head, though the heads of a position share its angles
(docs/kernels.md for what that cost). This kernel evaluates TVM's own angle expressions
(``switch_rope_freq_func``) once per position and distinct angle into a table (features i and
i + d/2 share one where TVM's simplifier proves it), then rotates all heads with vector
arithmetic, so the angles are TVM's own (the test compares the two kernels). Short inputs
(decode, verify) run on the calling thread: a thread-pool launch costs more than the work.
Rotate-half layout over the whole head, default or llama3 frequencies (what ``models/config.py``
accepts).
"""

from __future__ import annotations

from typing import Any

import tvm
import tvm_ffi
from tvm import tirx
from tvm.relax.frontend.nn.llm.kv_cache import _prepare_yarn_rope_scaling
from tvm.relax.frontend.nn.llm.position_embedding import (
    switch_rope_freq_func,
)
from tvm.script import tirx as T
from tvm.sym.analyzer import Analyzer

SERIAL_BELOW = 8  # positions under which the kernel runs on the calling thread
_LANES = 16


def _half_periodic(freq, d: int, theta: float) -> bool:
    """Whether the angles of features i and i + d/2 are the same expressions (rotate-half RoPE:
    TVM's frequencies depend on i through ``i * 2 % d``), proved by TVM's simplifier."""
    i, pos = tirx.Var("i", "int32"), tirx.Var("pos", "float32")
    analyzer = Analyzer()
    analyzer.bind(i, tvm.ir.Range(0, d // 2))
    return all(
        tvm_ffi.structural_equal(
            analyzer.simplify(_angle(freq, pos, i, d, theta, trig)),
            analyzer.simplify(_angle(freq, pos, i + d // 2, d, theta, trig)),
        )
        for trig in ("cos", "sin")
    )


def _angle(freq, pos, i, d: int, theta: float, trig: str):
    """TVM's cos or sin of feature i's angle at position ``pos``."""
    cos, sin, lets = freq(pos, i, d, theta, "float32")
    expr = cos if trig == "cos" else sin
    for var, value in lets.items():
        expr = tirx.Let(var, value, expr)
    return expr


def _rope_row(theta: float, rope_scaling: dict[str, Any], h_q: int, h_kv: int, d: int, dtype):
    """A macro: split and rotate the fused QKV row of position ``s``."""
    half = d // 2
    lanes = next(n for n in (_LANES, 8, 4, 2, 1) if half % n == 0)
    freq = switch_rope_freq_func(rope_scaling)
    # Features i and i + half share their angle where TVM's expressions say so: half the pow,
    # cos and sin calls. (Unrolled, LLVM would fold the pows of constants, rounded unlike libm's
    # powf: 1e-4 apart from TVM's kernel at position 3000 with llama3 scaling.)
    angles = half if _half_periodic(freq, d, theta) else d

    def angle(pos, i, trig):
        return _angle(freq, T.cast(pos, "float32"), i, d, theta, trig)

    @T.macro
    def rope_row(qkv, position_map, q, k, v, s):
        with T.sblock("rope_row"):
            T.reads()
            T.writes()
            cos = T.sblock_alloc_buffer((angles,), "float32", scope="global")  # on the stack
            sin = T.sblock_alloc_buffer((angles,), "float32", scope="global")
            for i in range(angles):
                cos[i] = angle(position_map[s], i, "cos")
                sin[i] = angle(position_map[s], i, "sin")
            for h in range(h_q + h_kv):
                for c in range(half // lanes):
                    for lane in T.vectorized(lanes):
                        i: T.let[T.int32] = c * lanes + lane
                        x0: T.let[T.float32] = T.cast(qkv[s, h, i], "float32")
                        x1: T.let[T.float32] = T.cast(qkv[s, h, i + half], "float32")
                        if h < h_q:
                            q[s, h, i] = T.cast(cos[i] * x0 - sin[i] * x1, dtype)
                            q[s, h, i + half] = T.cast(
                                cos[(i + half) % angles] * x1 + sin[(i + half) % angles] * x0,
                                dtype,
                            )
                        else:
                            k[s, h - h_q, i] = T.cast(cos[i] * x0 - sin[i] * x1, dtype)
                            k[s, h - h_q, i + half] = T.cast(
                                cos[(i + half) % angles] * x1 + sin[(i + half) % angles] * x0,
                                dtype,
                            )
            for h in range(h_kv):
                for i in T.vectorized(d):
                    v[s, h, i] = qkv[s, h_q + h_kv + h, i]

    return rope_row


def rope_split(theta: float, rope_scaling: dict[str, Any], h_q: int, h_kv: int, d: int, dtype):
    """qkv [rows, h_q + 2 h_kv, d] and each row's position -> q [rows, h_q, d], k and v [rows,
    h_kv, d]; ``rope_scaling`` as ``models.config`` gives it (None: plain RoPE)."""
    rope_row = _rope_row(
        theta, _prepare_yarn_rope_scaling(rope_scaling or {}, theta), h_q, h_kv, d, dtype
    )

    @T.prim_func(s_tir=True)
    def rope_split_cpu(
        var_qkv: T.handle,
        var_position_map: T.handle,
        var_q: T.handle,
        var_k: T.handle,
        var_v: T.handle,
    ):
        T.func_attr({"tirx.is_scheduled": True, "op_pattern": 8})
        seq_len = T.int32()
        qkv = T.match_buffer(var_qkv, (seq_len, h_q + 2 * h_kv, d), dtype)
        position_map = T.match_buffer(var_position_map, (seq_len,), "int32")
        q = T.match_buffer(var_q, (seq_len, h_q, d), dtype)
        k = T.match_buffer(var_k, (seq_len, h_kv, d), dtype)
        v = T.match_buffer(var_v, (seq_len, h_kv, d), dtype)
        if seq_len < SERIAL_BELOW:
            for s in range(seq_len):
                rope_row(qkv, position_map, q, k, v, s)
        else:
            for s in T.parallel(seq_len):
                rope_row(qkv, position_map, q, k, v, s)

    return rope_split_cpu
