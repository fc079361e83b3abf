"""RMS norm for the CPU as vector arithmetic (``LEGALIZE``, given to ``LegalizeOps``).

TVM legalizes ``rms_norm`` to a row sum of squares taken one element at a time, a chain of
dependent adds that no schedule vectorises, paid twice per layer and once more per step
(docs/kernels.md). Here a row's squares are summed in ``CHAINS`` independent vector
accumulators, added up as a tree, and the row is scaled with the same formula as TVM's
(``rsqrt(sum / n + eps) * x * weight``, in float32). Each row gets the same arithmetic whatever
the row count, so verified rows stay bit-identical to decoded ones; rows run on the calling
thread below ``SERIAL_BELOW_ELEMENTS`` outputs, as the scheduled kernels do.
"""

from __future__ import annotations

import math

import tvm
from tvm import relax as rx
from tvm import tirx
from tvm.relax.transform.legalize_ops.nn import _nn_rms_norm
from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder

from .cpu_rule import float_lanes, for_each_row, scheduled_prim_func
from .vector_reduce import horizontal, tree

CHAINS = 4  # independent accumulators: an add's latency over its throughput


def rms_norm_func(rank: int, n: int, eps: float, dtype: str, lanes: int) -> tirx.PrimFunc:
    """out = rms_norm(x) * weight over the last axis of x [..., n] (``rank`` >= 2 axes), for n a
    multiple of ``lanes``."""
    chunks = n // lanes
    f32 = f"float32x{lanes}"
    with IRBuilder() as ib, scheduled_prim_func():
        dims = [T.int64() for _ in range(rank - 1)]
        x = T.match_buffer(T.arg("x", T.handle()), (*dims, n), dtype)
        weight = T.match_buffer(T.arg("weight", T.handle()), (n,), dtype)
        out = T.match_buffer(T.arg("out", T.handle()), (*dims, n), dtype)
        rows = math.prod(dims)

        def load(buffer, index: list):
            vector = buffer.vload(index, f"{dtype}x{lanes}")
            return vector if dtype == "float32" else T.Cast(f32, vector)

        def norm_row(r) -> None:
            index = []
            for extent in reversed(dims):  # row r's indices, last axis fastest
                index.insert(0, tirx.floormod(r, extent))
                r = tirx.floordiv(r, extent)
            acc = T.alloc_buffer((CHAINS * lanes,), "float32", scope="global")  # on the stack
            used = min(CHAINS, chunks)
            for j in range(used):
                T.buffer_store(
                    acc, tirx.Broadcast(T.float32(0), lanes), [T.ramp(j * lanes, 1, lanes)]
                )

            def add_square(j: int, chunk) -> None:
                v = T.Bind(load(x, [*index, chunk * lanes]))
                total = acc.vload([j * lanes], f32) + v * v
                T.buffer_store(acc, total, [T.ramp(j * lanes, 1, lanes)])

            with T.serial(0, chunks // used) as i:
                for j in range(used):
                    add_square(j, i * used + j)
            for j in range(chunks % used):
                add_square(j, chunks - chunks % used + j)
            sums = [acc.vload([j * lanes], f32) for j in range(used)]
            total = T.Bind(horizontal(lambda a, b: a + b, tree(lambda a, b: a + b, sums), lanes))
            scale = T.Bind(T.float32(1) / T.sqrt(total / T.float32(n) + T.float32(eps)))
            with T.serial(0, chunks) as c:
                value = tirx.Broadcast(scale, lanes) * load(x, [*index, c * lanes])
                value = value * load(weight, [c * lanes])
                value = value if dtype == "float32" else T.Cast(f"{dtype}x{lanes}", value)
                T.buffer_store(out, value, [*index, T.ramp(c * lanes, 1, lanes)])

        for_each_row(rows, rows * n, norm_row)
    return ib.get()


def _legalize_rms_norm(bb: rx.BlockBuilder, call: rx.Call) -> rx.Expr:
    """This file's kernel for a norm over the last axis of rows (2 or more axes) whose width is a
    multiple of the CPU's float lanes; TVM's legalization for any other."""
    x, weight = call.args
    rank, shape = x.ty.ndim, x.ty.shape  # ndim -1: unknown
    if rank < 2 or shape is None:
        return _nn_rms_norm(bb, call)
    lanes = float_lanes(tvm.target.Target.current())
    axes = [int(a) % rank for a in call.attrs.axes]
    n = shape[-1]
    if axes != [rank - 1] or not isinstance(n, tirx.IntImm) or int(n) % lanes:
        return _nn_rms_norm(bb, call)
    dtype = str(x.ty.dtype)
    func = rms_norm_func(rank, int(n), float(call.attrs.epsilon), dtype, lanes)
    gv = bb.add_func(func, "rms_norm")
    return rx.call_tir(gv, [x, weight], x.ty)


LEGALIZE = {"relax.nn.rms_norm": _legalize_rms_norm}
