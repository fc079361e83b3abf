"""A CPU schedule rule for the ``NT_matmul`` kernels of the linear layers
(C[.., m, n] = sum_k A[.., m, k] * W[n, k], plus a fused elementwise epilogue).

``dlight.cpu`` ships GEMV and Reduction rules but none for matmul; without this rule every
linear layer runs TVM's naive loop nest, an order of magnitude slower (docs/kernels.md). On the
CPU every weight is stored in panels of 64 output rows, k-major (``models/quantized.py``):
quantized codes, or float32. The kernel's ``dequantize`` stage computes the weight from that
storage, and is fused into this schedule so that no float copy of a weight is written. ``m``
(tokens) is symbolic, so one kernel serves decode (m = 1), verification and draft batches
(m = 2..16) and prefill (m >= 32), which want different loop nests; the rule schedules each
and branches on m at run time:

* small m, *panel GEMV*: vectorised along n. Each loaded vector holds one code word of 16
  consecutive output rows; it is decoded in registers and FMA'd with A[m, k] broadcast for every
  row of the m tile (1, 2, 3, 4, 5, 6, 8, 12 or 16 rows, as many as the accumulator registers
  hold), so up to 16 rows read each weight once.
* large m, *GEMM*: per panel, W is decoded once into a float [k, 64] scratch tile and reused by
  every m tile: the inner loop broadcasts A[m, k] and FMAs it with 4 contiguous vectors of the
  tile into 6 x 64 register accumulators (24 FMAs per 10 loads, FMA bound).

Both pad m to their m tile with ``pad_einsum`` (A is copied to a padded buffer, the result is
written back with bounds checks) so that the reduction loops carry no per-iteration tail
predicate and the accumulator tile has a static shape that LLVM keeps in registers.
"""

from __future__ import annotations

from tvm import IRModule, s_tir, tirx
from tvm.target import Target

from .cpu_rule import CPURule, find_block, float_lanes

# Row tiles of the panel GEMV, each used for m up to its size (beyond the last: that size), as
# far as the accumulator registers hold them: verify and draft batches of up to 16 rows decode
# and read each weight vector once.
M_TILES = (1, 2, 3, 4, 5, 6, 8, 12, 16)


def _const(x) -> int | None:
    return int(x) if isinstance(x, (int, tirx.IntImm)) else None


def _largest_divisor(n: int, candidates: tuple[int, ...]) -> int:
    return next((c for c in candidates if n % c == 0), 1)


def _vector_shape(target: Target) -> tuple[int, int]:
    """(float32 lanes of one vector register, vector registers for accumulators)."""
    lanes = float_lanes(target)
    return lanes, 24 if lanes == 16 else 12


def _branch_on_m(func, m, small: dict, gemm, gemm_min_m: int) -> s_tir.Schedule:
    """One kernel for a symbolic m: if-else over the separately scheduled bodies (small-m
    tiles by size, then the GEMM for m >= gemm_min_m)."""
    tiles = sorted(small)
    body = small[tiles[-1]].mod["main"].body
    if gemm is not None:
        body = tirx.IfThenElse(m >= gemm_min_m, gemm.mod["main"].body, body)
    for tile in reversed(tiles[:-1]):
        body = tirx.IfThenElse(m <= tile, small[tile].mod["main"].body, body)
    root = s_tir.SBlockRealize([], True, s_tir.SBlock([], [], [], "root", body))
    # The bodies come from the same ``func`` and share its loop and block variables.
    merged = s_tir.transform.ConvertSSA()(IRModule({"main": func.with_body(root)}))
    return s_tir.Schedule(merged)


def _weight_producers(sch: s_tir.Schedule, block) -> list:
    """Blocks computing the weight that ``block`` reads (a quantized weight's ``dequantize``);
    the padding blocks of the activations are not among them."""
    weight = sch.get(block).reads[-1].source
    return [p for p in sch.get_producers(block) if sch.get(p).writes[0].source.same_as(weight)]


class CPUMatmul(CPURule):
    """Vectorised, register-blocked, multi-threaded schedule for NT matmul on ``llvm``."""

    def __init__(self, gemm_min_m: int = 32, gemm_tile: tuple[int, int] = (6, 64), lanes: int = 16):
        self.gemm_min_m, self.gemm_tile, self.lanes = gemm_min_m, gemm_tile, lanes

    def schedule(self, sch: s_tir.Schedule, func: tirx.PrimFunc, target: Target):
        block = find_block(sch, "NT_matmul")
        if block is None:
            return None
        loops = sch.get_loops(block)
        if len(loops) != 4 or len(sch.get_consumers(block)) > 1:
            return None
        i0, i1, n, k = (sch.get(rv).extent for rv in loops)
        n_ext, k_ext = _const(n), _const(k)
        if n_ext is None or k_ext is None:
            return None
        if not _weight_producers(sch, block):
            return None  # not a linear layer's weight in panels (none on llvm)
        m = i0 * i1
        m_ext = _const(m)
        lanes, registers = _vector_shape(target)
        tiles = tuple(t for t in M_TILES if t <= registers)
        gemm_ok = n_ext % self.gemm_tile[1] == 0 and k_ext % self.lanes == 0
        if m_ext is not None:
            if gemm_ok and m_ext >= self.gemm_min_m:
                return self._gemm(func)
            tile = next((t for t in tiles if m_ext <= t), tiles[-1])
            return self._panel_gemv(func, tile, lanes, registers)
        small = {t: self._panel_gemv(func, t, lanes, registers) for t in tiles}
        return _branch_on_m(func, m, small, self._gemm(func) if gemm_ok else None, self.gemm_min_m)

    def _panel_gemv(self, func, m_tile: int, lanes: int, registers: int) -> s_tir.Schedule:
        """Vectorised along n: each loaded vector of codes (one word per output column) is
        decoded in registers and FMA'd with A[m, k] broadcast, for every row of the m tile."""
        sch = s_tir.Schedule(func)
        block = sch.get_sblock("NT_matmul")
        (decode,) = _weight_producers(sch, block)
        panel = int(sch.get(decode).annotations["panel"])
        per_word = int(sch.get(decode).annotations["codes_per_word"])
        write_back, (i0, i1, i2, k) = self._pad_m(sch, block, m_tile)
        sch.compute_inline(decode)
        vectors = _largest_divisor(panel // lanes, tuple(range(registers // m_tile, 0, -1)))
        mo, mi = sch.split(sch.fuse(i0, i1), [None, m_tile])
        no, nv, nl = sch.split(i2, [None, vectors, lanes])
        kw, kj = sch.split(k, [None, per_word])
        sch.reorder(no, mo, kw, kj, mi, nv, nl)
        sch.set_scope(block, 0, "local")
        sch.reverse_compute_at(write_back, mo, preserve_unit_loops=True)
        sch.vectorize(sch.get_loops(write_back)[-1])
        sch.vectorize(nl)
        sch.unroll(nv)
        sch.unroll(mi)
        sch.unroll(kj)
        # Parallel over panels only: fusing in the symbolic m loop would make the accumulator
        # tile's region unprovable, and the accumulators would live in memory.
        sch.parallel(no)
        sch.decompose_reduction(block, kw)
        return sch

    @staticmethod
    def _pad_m(sch: s_tir.Schedule, block, m_tile: int):
        """Pad m (the symbolic one of the two leading axes, e.g. the batch in decode) to a
        multiple of ``m_tile``, with the epilogue folded into the write-back block.
        Returns (write-back block, loops of the matmul block)."""
        epilogue = sch.get_consumers(block)
        if m_tile == 1:  # nothing to pad; stage the result if there is no epilogue to do it
            return (epilogue or [sch.cache_write(block, 0, "local")])[0], sch.get_loops(block)
        i0, i1 = (_const(sch.get(rv).extent) for rv in sch.get_loops(block)[:2])
        pad_i0 = i1 is not None and i0 is None
        sch.pad_einsum(block, [m_tile, 1, 1, 1] if pad_i0 else [1, m_tile, 1, 1])
        (write_back,) = sch.get_consumers(block)
        if epilogue:
            sch.reverse_compute_inline(epilogue[0])
        return write_back, sch.get_loops(block)

    def _gemm(self, func) -> s_tir.Schedule:
        sch = s_tir.Schedule(func)
        block = sch.get_sblock("NT_matmul")
        m_tile, n_tile = self.gemm_tile
        lanes = self.lanes
        write_back, (i0, i1, i2, k) = self._pad_m(sch, block, m_tile)
        mo, mi = sch.split(sch.fuse(i0, i1), [None, m_tile])
        no, ni = sch.split(i2, [None, n_tile])
        nv, nl = sch.split(ni, [None, lanes])
        sch.reorder(no, mo, k, mi, nv, nl)
        # Pack W[no-tile, :] as [k, n_tile], once per n tile, ahead of all m tiles (a quantized
        # weight is decoded into this float tile, once per call).
        packed = sch.cache_read(block, 1, "global")
        for producer in _weight_producers(sch, packed):
            sch.compute_inline(producer)
        sch.transform_layout(block, ("read", 1), lambda n, kk: (n // n_tile, kk, n % n_tile))
        sch.compute_at(packed, no)
        # Transpose in lanes x lanes blocks, storing vectors along n.
        pn, pk = sch.get_loops(packed)[-2:]
        pno, pni = sch.split(pn, [None, lanes])
        pko, pki = sch.split(pk, [None, lanes])
        sch.reorder(pko, pno, pki, pni)
        sch.unroll(pki)
        sch.vectorize(pni)
        sch.set_scope(block, 0, "local")
        sch.reverse_compute_at(write_back, mo)
        sch.vectorize(sch.get_loops(write_back)[-1])
        sch.vectorize(nl)
        sch.unroll(nv)
        sch.unroll(mi)
        sch.parallel(no)
        sch.decompose_reduction(block, k)
        return sch
