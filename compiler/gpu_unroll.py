"""Keep TVM from writing GPU loops out iteration by iteration in the CUDA source.

``dlight.gpu.GeneralReduction`` marks each thread's reduction loop ``pragma_unroll_explicit``
with a step limit of 256, so TVM copies the loop body once per iteration. Over a 49,152-token
vocabulary that is 192 copies per loop: SmolLM2's sampler came to 7.3 MB of CUDA source, which
nvcc compiles (on the GPU machine, each time an artifact loads) in 40 s. With the flag off, TVM
writes the loop once under ``#pragma unroll`` (0.2 MB); nvcc still unrolls it fully, 15 s. The
sampler's loops stream a vocabulary row from memory, where unrolling buys nothing, so they
lose the pragma altogether (1 s). Each thread adds its terms in the same order either way: the
same bits.
"""

from __future__ import annotations

from tvm import s_tir
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

EXPLICIT = "pragma_unroll_explicit"
MAX_STEP = "pragma_auto_unroll_max_step"


class UnrollInCompiler(ScheduleRule):
    """``rule``'s schedules with unrolling left to nvcc, or with ``unroll=False`` to none."""

    def __init__(self, rule: ScheduleRule, unroll: bool = True):
        self.rule = rule
        self.unroll = unroll

    def is_target_available(self, target: Target) -> bool:
        return self.rule.is_target_available(target)

    def apply(self, func, target: Target, tunable: bool):
        scheduled = self.rule.apply(func, target, tunable)
        for sch in scheduled if isinstance(scheduled, list) else [scheduled]:
            if isinstance(sch, s_tir.Schedule):
                self._rewrite(sch, get_root_block(sch))
        return scheduled

    def _rewrite(self, sch: s_tir.Schedule, parent) -> None:
        for block in sch.get_child_blocks(parent):
            for loop in sch.get_loops(block):
                annotations = sch.get(loop).annotations
                if EXPLICIT in annotations:
                    sch.unannotate(loop, EXPLICIT)
                    if self.unroll:
                        sch.annotate(loop, EXPLICIT, 0)
                if MAX_STEP in annotations and not self.unroll:
                    sch.unannotate(loop, MAX_STEP)
            self._rewrite(sch, block)
