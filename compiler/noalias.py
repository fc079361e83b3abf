"""Give every PrimFunc of the module the same ``tirx.noalias`` setting, chosen per artifact.

TVM 0.27's LLVM codegen declares a module's functions in name order and generates the bodies of
all of them with the noalias setting of the last one declared (``is_restricted_`` in
``CodeGenLLVM::DeclareFunctionInternal``), so one function decides for all: the VM's shape
functions and most hand-written kernels (``cpu_rule.scheduled_prim_func``, the KV cache's
append, RoPE) come without the attribute. Without it, LLVM treats all of a kernel's buffers as
possibly overlapping, and the scheduled float matmuls store their accumulators back to memory
after each multiply-add, much slower in prefill and verification. With it, LLVM keeps the int8
matmul's activation broadcasts of one group live across its sweep's vectors and spills them,
slowing large verify batches (docs/kernels.md). So float artifacts are built with it and
int8-activation ones without, everywhere alike. Safe: every function gets a distinct tensor per
buffer parameter (the VM its shape heap; the KV cache kernels the page pool, page tables and
outputs).
"""

from __future__ import annotations

import tvm
from tvm import tirx


@tvm.transform.module_pass(opt_level=0, name="SetNoAlias")
class SetNoAlias:
    def __init__(self, noalias: bool):
        self.noalias = noalias

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        for gv, func in list(mod.functions_items()):
            if isinstance(func, tirx.PrimFunc):
                if self.noalias:
                    mod[gv] = func.with_attr("tirx.noalias", True)
                elif "tirx.noalias" in func.attrs:
                    mod[gv] = func.without_attr("tirx.noalias")
        return mod
