"""The Relax lowering pipeline per target: fuse, schedule every kernel, lower to the VM."""

from __future__ import annotations

import tvm
from tvm import relax as rx
from tvm.s_tir import dlight as dl
from tvm.target import Target

from .cpu_attention import CPUAttention
from .cpu_elementwise import CPUElementwise
from .cpu_matmul import CPUMatmul
from .gpu_tensorize import SkipTensorize
from .noalias import MarkShapeFuncNoAlias


def _schedule_rules(target: Target) -> list:
    if target.kind.name == "llvm":
        return [CPUMatmul(), dl.cpu.GEMV(), dl.cpu.Reduction(), CPUElementwise(), CPUAttention()]
    return [
        dl.gpu.Matmul(),
        dl.gpu.GEMV(),
        dl.gpu.LowBatchGEMV(),
        dl.gpu.Reduction(),
        dl.gpu.GeneralReduction(),
        dl.gpu.Fallback(),
    ]


def relax_pipeline(target: Target, dtype: str) -> tvm.transform.Pass:
    """Passes from the exported module to VM code. ``FuseTransposeMatmul`` first, so that a
    linear layer multiplies by its weight as stored instead of transposing it every call."""
    is_gpu = target.kind.name != "llvm"
    passes = [
        rx.transform.FuseTransposeMatmul(),
        rx.transform.LegalizeOps(),
        rx.transform.AnnotateTIROpPattern(),
        rx.transform.FoldConstant(),
        rx.transform.FuseOps(),
        rx.transform.FuseTIR(),
        rx.transform.DeadCodeElimination(),
        *([SkipTensorize()] if is_gpu and dtype in ("float16", "bfloat16") else []),
        dl.ApplyDefaultSchedule(*_schedule_rules(target)),
        rx.transform.RewriteDataflowReshape(),
        rx.transform.ToNonDataflow(),
        rx.transform.RemovePurityChecking(),
        rx.transform.CallTIRRewrite(),
        rx.transform.StaticPlanBlockMemory(),
        *([rx.transform.RewriteCUDAGraph()] if is_gpu else []),
        rx.transform.LowerAllocTensor(),
        rx.transform.KillAfterLastUse(),
        rx.transform.LowerRuntimeBuiltin(),
        rx.transform.ComputePrimValue(),
        rx.transform.VMShapeLower(),
        MarkShapeFuncNoAlias(),
        rx.transform.AttachGlobalSymbol(),
    ]

    @tvm.transform.module_pass(opt_level=0, name="MLCSpecPipeline")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        with target:
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline
