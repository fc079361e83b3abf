"""Mark the VM's ``shape_func`` as ``tirx.noalias`` so LLVM keeps per-buffer alias info.

TVM's LLVM codegen attaches distinct alias scopes to buffers only when every PrimFunc of the
module is ``noalias``. The ``shape_func`` that ``VMShapeLower`` adds is not, so without this pass
every kernel treats all its buffers as possibly overlapping, and a matmul's accumulators are
stored back to memory after each FMA instead of staying in registers (2-3x slower prefill).
Safe: the shape function's only pointer argument is the VM's shape heap.
"""

from __future__ import annotations

import tvm
from tvm import tirx


@tvm.transform.module_pass(opt_level=0, name="MarkShapeFuncNoAlias")
class MarkShapeFuncNoAlias:
    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        for gv, func in list(mod.functions_items()):
            if isinstance(func, tirx.PrimFunc) and gv.name_hint == "shape_func":
                mod[gv] = func.with_attr("tirx.noalias", True)
        return mod
