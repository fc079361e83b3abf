"""The Relax lowering pipeline per target: fuse, schedule every kernel, lower to the VM."""

from __future__ import annotations

import tvm
from tvm import relax as rx
from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from .cpu_argmax import UseCPUArgmaxKernel
from .cpu_elementwise import CPUElementwise
from .cpu_matmul import CPUMatmul
from .cpu_rms_norm import LEGALIZE as RMS_NORM_LEGALIZE
from .cpu_rule import SerialWhenSmall
from .cpu_silu import LEGALIZE as SILU_LEGALIZE
from .gpu_tensorize import SkipTensorize
from .gpu_unroll import UnrollInCompiler
from .noalias import SetNoAlias
from .vm_dedup import DedupVMObjects


class _Guarded(ScheduleRule):
    """A dlight rule whose analysis asserts on reads at data-dependent indices (the sampler's
    gathers, ``compiler/sampler.py``) instead of declining them: such a function is not the
    rule's kind, so the next rule gets it."""

    def __init__(self, rule: ScheduleRule):
        self.rule = rule

    def is_target_available(self, target: Target) -> bool:
        return self.rule.is_target_available(target)

    def apply(self, func, target: Target, tunable: bool):
        try:
            return self.rule.apply(func, target, tunable)
        except AssertionError:
            return None


def _schedule_rules(target: Target, unroll: bool = True) -> list[ScheduleRule]:
    if target.kind.name == "llvm":
        rules = [
            CPUMatmul(),
            dl.cpu.GEMV(),
            SerialWhenSmall(dl.cpu.Reduction()),  # RMS norms: one row per decode step
            CPUElementwise(),
        ]
    else:
        rules = [
            UnrollInCompiler(rule, unroll)
            for rule in (
                dl.gpu.Matmul(),
                dl.gpu.GEMV(),
                dl.gpu.LowBatchGEMV(),
                dl.gpu.Reduction(),
                dl.gpu.GeneralReduction(),
                dl.gpu.Fallback(),
            )
        ]
    return [_Guarded(rule) for rule in rules]


def relax_pipeline(
    target: Target, dtype: str, noalias: bool = True, unroll: bool = True
) -> tvm.transform.Pass:
    """Passes from the exported module to VM code. ``FuseTransposeMatmul`` first, so that a
    linear layer multiplies by its weight as stored instead of transposing it every call;
    ``DispatchSortScan`` gives the sampler's argsort and cumsum their CPU or GPU kernels; on
    the CPU, the sampler's argmax, SiLU and the RMS norms are vectorised (``cpu_argmax``,
    ``cpu_silu``, ``cpu_rms_norm``; the KV cache's kernels come with the model,
    ``cpu_kv_cache``), and every CPU kernel is compiled ``noalias``, or with ``noalias=False``
    (the int8-activation path) none is (``noalias.py``). On the GPU nvcc unrolls loops, or
    with ``unroll=False`` (the sampler) none is unrolled (``gpu_unroll.py``). On the CPU, where
    no CUDA graph hides the VM's bookkeeping, ``DedupVMObjects`` makes each shape and tensor
    view once per call (``vm_dedup.py``)."""
    is_gpu = target.kind.name != "llvm"
    passes = [
        *([] if is_gpu else [UseCPUArgmaxKernel()]),
        rx.transform.FuseTransposeMatmul(),
        rx.backend.DispatchSortScan(),
        rx.transform.LegalizeOps(None if is_gpu else {**SILU_LEGALIZE, **RMS_NORM_LEGALIZE}),
        rx.transform.AnnotateTIROpPattern(),
        rx.transform.FoldConstant(),
        rx.transform.FuseOps(),
        rx.transform.FuseTIR(),
        rx.transform.DeadCodeElimination(),
        *([SkipTensorize()] if is_gpu and dtype in ("float16", "bfloat16") else []),
        dl.ApplyDefaultSchedule(*_schedule_rules(target, unroll)),
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
        *([] if is_gpu else [DedupVMObjects(), SetNoAlias(noalias)]),
        rx.transform.AttachGlobalSymbol(),
    ]

    @tvm.transform.module_pass(opt_level=0, name="MLCSpecPipeline")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        with target:
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline
