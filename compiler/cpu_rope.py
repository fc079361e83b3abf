"""The KV cache's RoPE kernel on the CPU, with each position's cos/sin computed once.

TVM's ``fused_rope`` (``llama_rope_with_position_map``) splits the fused QKV into q, k and v and
rotates q and k, computing ``pow``, ``cos`` and ``sin`` through libm for every element of every
head, though the heads of a position share its angles: 1.5 ms of a SmolLM2 layer's 128-token
prefill (1 thread), more than the vectorised attention kernels (``cpu_attention``). This
kernel evaluates TVM's own angle expressions (``switch_rope_freq_func``) once per position and
distinct angle into a table (features i and i + d/2 share one where TVM's simplifier proves it),
then rotates all heads with vector arithmetic, so the angles are TVM's own (the test compares
the two kernels). Short inputs (decode, verify) run on the calling thread: a thread-pool launch
costs more than the work.

``UseCPURopeKernel`` swaps it in only where TVM's kernel for the same parameters is structurally
equal to the module's ``fused_rope`` (default rotate-half layout over the whole head), so a
RoPE variant it does not cover keeps TVM's kernel.
"""

from __future__ import annotations

from typing import Any

import tvm
import tvm_ffi
from tvm import tirx
from tvm.relax.frontend.nn.llm.kv_cache import _prepare_yarn_rope_scaling
from tvm.relax.frontend.nn.llm.position_embedding import (
    llama_rope_with_position_map,
    switch_rope_freq_func,
)
from tvm.script import tirx as T
from tvm.sym.analyzer import Analyzer

NAME = "fused_rope"  # TVM's RoPE kernel in an exported module
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
    def rope_row(qkv, position_map, q, k, v, apply_rope, s):
        with T.sblock("rope_row"):
            T.reads()
            T.writes()
            cos = T.sblock_alloc_buffer((angles,), "float32", scope="global")  # on the stack
            sin = T.sblock_alloc_buffer((angles,), "float32", scope="global")
            for i in range(angles):  # apply_rope == 0: the identity rotation
                cos[i] = T.if_then_else(apply_rope > 0, angle(position_map[s], i, "cos"), 1.0)
                sin[i] = T.if_then_else(apply_rope > 0, angle(position_map[s], i, "sin"), 0.0)
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
    """The kernel, with the signature of TVM's ``fused_rope`` (the KV cache's f_split_rotary)."""
    rope_row = _rope_row(theta, rope_scaling, h_q, h_kv, d, dtype)

    @T.prim_func(s_tir=True)
    def fused_rope(
        var_qkv: T.handle,  # [seq_len, h_q + 2 h_kv, d]
        var_position_map: T.handle,  # [seq_len]
        var_q: T.handle,  # [seq_len, h_q, d]
        var_k: T.handle,  # [seq_len, h_kv, d]
        var_v: T.handle,  # [seq_len, h_kv, d]
        apply_rope: T.int64,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        seq_len = T.int32()
        position_offset = T.int32()
        qkv = T.match_buffer(var_qkv, (seq_len, h_q + 2 * h_kv, d), dtype)
        position_map = T.match_buffer(
            var_position_map, (seq_len,), "int32", elem_offset=position_offset
        )
        q = T.match_buffer(var_q, (seq_len, h_q, d), dtype)
        k = T.match_buffer(var_k, (seq_len, h_kv, d), dtype)
        v = T.match_buffer(var_v, (seq_len, h_kv, d), dtype)
        if seq_len < SERIAL_BELOW:
            for s in range(seq_len):
                rope_row(qkv, position_map, q, k, v, apply_rope, s)
        else:
            for s in T.parallel(seq_len):
                rope_row(qkv, position_map, q, k, v, apply_rope, s)

    return fused_rope


@tvm.transform.module_pass(opt_level=0, name="UseCPURopeKernel")
class UseCPURopeKernel:
    """Swap in ``rope_split`` for the KV cache's RoPE kernel that ``models/llama.py`` builds
    with these parameters (TVM's kernel for them must equal the module's)."""

    def __init__(self, theta: float, rope_scaling: dict[str, Any] | None):
        self.theta = theta
        self.rope_scaling = _prepare_yarn_rope_scaling(rope_scaling or {}, theta)

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        gv = next((g for g in mod.get_global_vars() if g.name_hint == NAME), None)
        if gv is None or self.rope_scaling.get("rope_type") in ("gptj", "longrope"):
            return mod
        q, k = (p.ty for p in mod[gv].params[2:4])
        h_q, h_kv, d, dtype = int(q.shape[1]), int(k.shape[1]), int(q.shape[2]), str(q.dtype)
        tvm_kernel = llama_rope_with_position_map(
            self.theta, 1, d, h_q, h_kv, dtype, self.rope_scaling, d
        )
        if d % 2 or not tvm_ffi.structural_equal(mod[gv], tvm_kernel):
            return mod
        mod[gv] = rope_split(self.theta, self.rope_scaling, h_q, h_kv, d, dtype)
        return mod
