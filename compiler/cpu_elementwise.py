"""A CPU schedule rule for elementwise kernels (``dlight.cpu`` has none): the fused
split + SiLU * up of the MLP, embedding lookups (dequantizing the rows they gather), RoPE.
Left unscheduled they run as one serial scalar loop nest (~6% of a prefill)."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.relax.analysis import has_reshape_pattern
from tvm.target import Target

from .cpu_rule import CPURule, find_block, serial_when_small

_LANES = 16


class CPUElementwise(CPURule):
    """Inline every producer into the last block, then run that block with its innermost
    axis vectorised (when its extent allows) and all the rest fused into one parallel loop,
    serial for small outputs (``serial_when_small``)."""

    def schedule(self, sch: s_tir.Schedule, func: tirx.PrimFunc, target: Target):
        root = find_block(sch, "root")  # none in an extern kernel (argsort, cumsum)
        blocks = sch.get_child_blocks(root) if root is not None else []
        if not blocks or not all(_is_spatial(sch, b) for b in blocks):
            return None
        try:
            for block in blocks[:-1]:
                sch.compute_inline(block)
        except Exception:  # noqa: BLE001 - e.g. a block with several consumers: leave as is
            return None
        loops = sch.get_loops(blocks[-1])
        if not loops:
            return None
        inner = sch.get(loops[-1]).extent
        if isinstance(inner, tirx.IntImm) and int(inner) % _LANES == 0 and int(inner) > _LANES:
            outer, lanes = sch.split(loops[-1], [None, _LANES])
            sch.vectorize(lanes)
            loops = [*loops[:-1], outer]
        sch.parallel(sch.fuse(*loops) if len(loops) > 1 else loops[0])
        # A reshape must keep the one-loop-nest form in which RewriteDataflowReshape finds it
        # and turns it into a view; any other kernel gets a serial copy for small outputs.
        return sch if has_reshape_pattern(func) else serial_when_small(sch)


def _is_spatial(sch: s_tir.Schedule, block) -> bool:
    """A block computing one element per spatial iteration: not a reduction, and not an opaque
    hand-written kernel (such as the KV cache's attention), which has no block iterators."""
    iter_vars = sch.get(block).iter_vars
    return bool(iter_vars) and all(iv.iter_type == tirx.IterVar.DataPar for iv in iter_vars)
