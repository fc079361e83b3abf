"""Keep ``dlight.gpu.Matmul`` off its tensor-core path for half-precision models.

In TVM 0.27.0.post1 the rule's ``MatmulTensorization`` branch (taken for float16/bfloat16 on
sm >= 70) segfaults inside s_tir ``Tensorize`` for the shapes of these models; the
``dlight.do_not_tensorize`` attribute makes the rule use its SIMT schedule instead. The
pipeline adds this pass only for 16-bit models, so float32 builds are unaffected.
"""

from __future__ import annotations

import tvm
from tvm import tirx


@tvm.transform.module_pass(opt_level=0, name="SkipTensorize")
class SkipTensorize:
    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        for gv, func in list(mod.functions_items()):
            if isinstance(func, tirx.PrimFunc):
                mod[gv] = func.with_attr("dlight.do_not_tensorize", True)
        return mod
