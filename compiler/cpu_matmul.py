"""A CPU schedule rule for the ``NT_matmul`` blocks that ``FuseTransposeMatmul`` produces
(C[.., m, n] = sum_k A[.., m, k] * W[n, k], plus a fused elementwise epilogue).

``dlight.cpu`` ships GEMV and Reduction rules but none for matmul; without this rule every
linear layer runs TVM's naive loop nest (~20x slower). Strategy: tile (m, n) into blocks that
run in parallel, n outermost; split k into vector lanes and ``rfactor`` them so the inner loop is a
contiguous vector FMA into MT x NT accumulators held in registers, then one horizontal sum per
output plus the epilogue while the tile is hot.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target


def _const(x) -> int | None:
    return int(x) if isinstance(x, (int, tirx.IntImm)) else None


def _largest_divisor(n: int, candidates: tuple[int, ...]) -> int:
    return next((c for c in candidates if n % c == 0), 1)


class CPUMatmul(ScheduleRule):
    """Register-blocked, vectorised, multi-threaded schedule for NT matmul on ``llvm``."""

    def __init__(self, m_tile: int = 2, n_tile: int = 8, lanes: int = 16):
        self.m_tile, self.n_tile, self.lanes = m_tile, n_tile, lanes

    def is_target_available(self, target: Target) -> bool:
        return target.kind.name == "llvm"

    def apply(self, func, target: Target, _tunable: bool):
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        sch = s_tir.Schedule(func)
        try:
            block = sch.get_sblock("NT_matmul")
        except Exception:  # noqa: BLE001 - no such block: not ours to schedule
            return None
        loops = sch.get_loops(block)
        if len(loops) != 4:
            return None
        i0, i1, i2, k = loops
        n_ext, k_ext = _const(sch.get(i2).extent), _const(sch.get(k).extent)
        consumers = sch.get_consumers(block)
        if n_ext is None or k_ext is None or len(consumers) > 1:
            return None
        # Without an epilogue the write-back after rfactor has no guard for the m tail: stage
        # the result through a local buffer that is copied out with bounds checks.
        staged = not consumers
        if staged:
            consumers = [sch.cache_write(block, 0, "local")]
        lanes = _largest_divisor(k_ext, (self.lanes, 8, 4))
        n_tile = _largest_divisor(n_ext, (self.n_tile, 2))
        m_tile = self.m_tile
        m_ext = _const(sch.get(i0).extent * sch.get(i1).extent)
        if m_ext is not None and m_ext < m_tile:
            m_tile = _largest_divisor(m_ext, (4, 3, 2))

        m = sch.fuse(i0, i1)
        mo, mi = sch.split(m, [None, m_tile])
        no, ni = sch.split(i2, [None, n_tile])
        ko, ki = sch.split(k, [None, lanes])
        # n tiles outermost: one tile of W (n_tile rows) stays in L1 while every m tile uses it.
        sch.reorder(no, mo, ko, mi, ni, ki)
        partial = sch.rfactor(ki, 3)
        # After rfactor the loop handles above belong to the write-back block; the partial-sum
        # block has fresh loops, named ax<i> after its i-th block iter (ki, i0, mi, ni, ko).
        sch.compute_at(partial, mo, preserve_unit_loops=True)
        sch.reverse_compute_at(consumers[0], mo, preserve_unit_loops=True)
        sch.set_scope(partial, 0, "local")
        if not staged:
            sch.set_scope(block, 0, "local")
        role = {}
        for rv in sch.get_loops(partial):
            name = sch.get(rv).loop_var.name
            if name.startswith("ax") and name[2:].isdigit():
                role[("ki", "i0", "mi", "ni", "ko")[int(name[2:])]] = rv
        sch.reorder(role["ko"], role["i0"], role["mi"], role["ni"], role["ki"])
        # Vectorise and unroll before decompose_reduction, which leaves an update block that
        # these primitives refuse.
        sch.vectorize(role["ki"])
        sch.unroll(role["ni"])
        sch.unroll(role["mi"])
        sch.parallel(sch.fuse(no, mo))
        sch.decompose_reduction(partial, role["ko"])
        return sch
