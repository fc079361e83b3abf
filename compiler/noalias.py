"""Mark every PrimFunc of the module ``tirx.noalias``, so that LLVM keeps per-buffer alias info.

TVM 0.27's LLVM codegen declares a module's functions in name order and generates the bodies
of all of them with the noalias setting of the last one declared (``is_restricted_`` in
``CodeGenLLVM::DeclareFunctionInternal``). One function without the attribute, and every
kernel treats all its buffers as possibly overlapping: accumulators are stored back to memory
after each multiply-add instead of staying in registers (2-3x slower prefill matmuls, 1.5-2x
slower attention). The functions without it are the VM's shape functions and symbolic-shape
helpers, and the KV cache's tree-attention, sliding-window, merge and page-copy kernels.
Safe: each gets a distinct tensor per buffer parameter (the VM its shape heap; the KV cache
its pages, index arrays, and output buffers).
"""

from __future__ import annotations

import tvm
from tvm import tirx


@tvm.transform.module_pass(opt_level=0, name="MarkNoAlias")
class MarkNoAlias:
    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        for gv, func in list(mod.functions_items()):
            if isinstance(func, tirx.PrimFunc) and not func.attrs.get("tirx.noalias", False):
                mod[gv] = func.with_attr("tirx.noalias", True)
        return mod
