"""A CPU schedule rule for the paged KV cache's attention kernels.

TVM writes its CPU attention kernels (prefill over pages, over the ragged new chunk, tree
attention, decode) as one opaque ``attn`` block inside serial loops over query heads or
sequences, and leaves them unscheduled: prefill attention then runs on one core (~31% of a
prefill on 2 cores). Each iteration of that outermost loop writes its own rows of the output
from block-local buffers, so the loop runs in parallel as it is."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.target import Target

from .cpu_rule import CPURule, find_block


class CPUAttention(CPURule):
    def schedule(self, sch: s_tir.Schedule, func: tirx.PrimFunc, target: Target):
        block = find_block(sch, "attn")
        if block is None:
            return None
        loops = sch.get_loops(block)
        if not loops or sch.get(block).iter_vars:
            return None
        sch.parallel(loops[0])
        return sch
