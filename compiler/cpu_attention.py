"""A CPU schedule rule for the paged KV cache's attention kernels.

TVM writes its CPU attention kernels (prefill over pages, over the ragged new chunk, tree
attention, decode) as one opaque ``attn`` block inside serial loops over query heads or
sequences, and leaves them unscheduled: prefill attention then runs on one core (~31% of a
prefill on 2 cores). Each iteration of that outermost loop writes its own rows of the output
from block-local buffers, so the loop runs in parallel as it is."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target


class CPUAttention(ScheduleRule):
    def is_target_available(self, target: Target) -> bool:
        return target.kind.name == "llvm"

    def apply(self, func, target: Target, _tunable: bool):
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        sch = s_tir.Schedule(func)
        try:
            block = sch.get_sblock("attn")
        except Exception:  # noqa: BLE001 - no such block: not an attention kernel
            return None
        loops = sch.get_loops(block)
        if not loops or sch.get(block).iter_vars:
            return None
        sch.parallel(loops[0])
        return sch
