"""SiLU for the CPU as vector arithmetic (``LEGALIZE``, given to ``LegalizeOps``).

TVM lowers SiLU's sigmoid through ``exp``, which LLVM turns into one libm call per lane, every
layer and step, over the MLP's whole width (docs/kernels.md). Here it is a few vector
instructions per 16 elements (``vector_exp.exp``, within 3 float32 ulps of the exact SiLU, as
torch's), the same for every row count."""

from __future__ import annotations

from tvm import relax as rx
from tvm import te, tirx
from tvm.script import tirx as T

from .vector_exp import exp


def _silu_of(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """x * sigmoid(x) with e = exp(-|x|) <= 1, so that 2**n never overflows: sigmoid is
    1 / (1 + e) for x >= 0 and e / (1 + e) below."""
    e = exp(-T.abs(x))
    one = T.float32(1)
    return x * tirx.Select(x >= T.float32(0), one, e) / (one + e)


def _silu(x: te.Tensor) -> te.Tensor:
    """In float32 whatever ``x``'s float type."""
    return te.compute(
        x.shape, lambda *i: T.Cast(x.dtype, _silu_of(T.Cast("float32", x(*i)))), name="silu"
    )


def _legalize_silu(bb: rx.BlockBuilder, call: rx.Call) -> rx.Expr:
    return bb.call_te(_silu, call.args[0], primfunc_name_hint="silu")


LEGALIZE = {"relax.nn.silu": _legalize_silu}
