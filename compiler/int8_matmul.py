"""Linear layers with int8 activations on the CPU (``mlc-spec compile --activations int8``).

With float activations, m rows cost m x (parameters) FMAs, so verifying a few draft tokens is
compute bound at several decode steps. As llama.cpp does, this path quantizes each activation
row per weight group (symmetric int8: scale = amax / 127, codes rounded to nearest even) and
multiplies the weight codes by it with integer dot products: ``vpdpbusd`` (AVX-512 VNNI,
AVX-VNNI), or ``vpmaddubsw`` + ``vpmaddwd`` (AVX-512BW, AVX2), 4 multiply-adds per 32-bit lane
and instruction against an FMA's one.

Two kernels per linear layer, written by hand as TIR with TVM's IR builder:

* ``quantize_activations``: x [M, K] float32 -> int8 codes [M, K], scales float32 [M, K/group]
  and per group what the matmul needs of the code sum, ready to use (``quantize_func``). For
  4-, 5- and 6-bit weights the codes of every 8 columns are stored even columns first (0, 2,
  4, 6, 1, 3, 5, 7), the order of a weight word's nibbles: the low nibbles (even k) and the high
  nibbles (odd k) of 16 output rows, masked out of one vector of code words, each meet 4
  consecutive activation bytes broadcast to every lane (5- and 6-bit codes get their high bits
  from a word of their own, ``compiler/quantization/formats.py``).
* ``int8_matmul`` over the panels of ``models/quantized.py`` (64 output rows, k-major): per
  group, acc = sum((code - zero) * xq) in int32, exactly (the integer dot starts at
  -zero * sum(xq)); then out = fma(acc, scale * xscale, out), and for asymmetric formats
  out = fma(offset, xscale * sum(xq), out). Each vector of code words is decoded once and
  applied to every row of an m tile, so a call reads each weight block once per tile. The
  kernel serves every m, prefill included: one arithmetic for every row, whatever the batch,
  keeps verified rows bit-identical to decoded ones (greedy speculation stays lossless) and
  gives prefill the cheaper integer arithmetic too. A two-level format's group scale and
  offset are multiplied from their small integers in the kernel, once per group and vector.

Each extra row of a verify batch costs its integer dots plus this per-group epilogue, so the
epilogue is kept to one conversion, one multiply and one or two FMAs per vector: the zero
point rides in the dot's start value and the offset's factor comes precomputed per row.

``vpmaddubsw`` adds two u8 x s8 products in saturating int16, so on that path 8-bit codes are
split into nibbles, whose dot products ``vpmaddwd`` weights by 1 and 16; 5- and 6-bit codes
stay whole (a pair sum is at most 2 x 63 x 127), with fewer pair sums added in int16 before
``vpmaddwd`` widens them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache

import numpy as np
import tvm
from tvm import tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op
from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder
from tvm.target import Target

from mlc_spec.models.quantized import SUPER_TYPE, GroupFormat, QuantizedWeight, panel_width

from .cpu_rule import for_each_row, scheduled_prim_func
from .errors import CompileError
from .vector_reduce import horizontal, tree

_NIBBLES = 0x0F0F0F0F
_LOW_BITS = 0x01010101
_INT8_MAX = 127.0
_INT16_MAX = 32767
# How far ahead of a sweep's reads its code lines are prefetched: into L2 from DRAM, and from
# there into L1. Both kinds are spread over the rows' arithmetic of a group rather than asked for
# together: a burst of a group's lines (until 2026-11-24 one 4 KB burst into L1) filled the L1
# miss buffers and held the core until they drained, so that memory and arithmetic took turns.
# On a 2-core AVX-512 Xeon (2026-11-24, ``scripts/bench_kernel.py``, SmolLM2's layers alone),
# with the rows' dots advancing together (``IntegerDot.accumulate``), this kernel took
# 0.85-0.89x the former one's time at 1 row and 0.80-0.84x at 4-8 rows; L2 distances of 4-16 KB
# and L1 distances of 0.5-2 KB did alike. The prefetch change alone, in the whole SmolLM2 int8
# model (``scripts/bench_ab.py``, 15 rounds): prefill 0.96x, verify 8 tokens 0.98x, verify 2
# 1.03x, decode and verify 4 within 1.5%. Asking for the group scales' and offsets' lines as
# well, at the same distance, gave (``scripts/bench_ab.py``, 30 rounds, 2026-11-24) prefill
# 0.94-0.95x with decode and verify 0.97-1.00x on that Xeon, and decode 0.93-0.97x, verify 2-4
# tokens 0.93-0.98x, verify 8 1.00x in an AVX2 (x86-64-v3) build.
_PREFETCH_L2_BYTES = 4096
_PREFETCH_L1_BYTES = 1024
_CACHE_LINE_BYTES = 64


def _int16_sums(code_bits: int) -> int:
    """How many vpmaddubsw pair sums of codes of ``code_bits`` bits x int8 activations (in
    [-127, 127]) int16 holds added up: 8 for nibbles, 4 for 5-bit and 2 for 6-bit codes."""
    return _INT16_MAX // (2 * ((1 << code_bits) - 1) * int(_INT8_MAX))


@dataclass(frozen=True)
class IntegerDot:
    """One CPU's integer dot product: ``lanes`` int32 lanes per vector register,
    ``widths[r - 1]`` the vectors of a panel that one sweep takes for r rows (1 beyond the
    tuple), ``max_rows`` rows a kernel pass takes at most (each row's address is one offset
    from a base, so the general registers hold), and the LLVM intrinsics computing per lane
    the sum of 4 u8 x s8 products: ``vnni`` (vpdpbusd, acc + dot, exact), or ``maddubs``
    (vpmaddubsw: pair sums, saturating int16) followed by ``maddwd`` (vpmaddwd: int16 pairs
    -> int32).

    The widths keep a sweep's int32 and float32 accumulators of every row and the decoded
    codes in registers where they fit: 2 x rows x width + 6 <= 32 with AVX-512. AVX2 has 16,
    yet on Zen 3 sweeps of 4, 4, 2, 2 vectors for 1-4 rows took 0.81-0.93x the time of that
    rule's 4, 2, 1, 1 at 3-4 rows, even at 2 (Qwen2.5-1.5B's Q4_K gate/up and Q6_K down
    alone): a spilled accumulator costs less than a code vector decoded once more per sweep.
    AVX-VNNI (16 registers too) keeps the rule, unmeasured.
    """

    lanes: int
    widths: tuple[int, ...]
    max_rows: int
    vnni: str | None = None
    maddubs: str | None = None
    maddwd: str | None = None

    def decode(self, words: list, bits: int) -> list[tuple]:
        """The vectors of code words of one group -> its parts (codes, column of their first
        activation in the group, weight). 4-bit words give low nibbles (even k) and high
        nibbles (odd k, 4 bytes on in the interleaved activations). 8-bit words on the
        vpmaddubsw path give their nibbles, weighted 1 and 16, so that no int16 pair sum
        saturates. 5- and 6-bit groups (words of low nibbles, then one of high bits, see
        ``compiler/quantization/formats.py``) add to each nibble part its highs, shifted to
        bit 4 on of each byte: whole codes, one dot product per 4 columns on either path."""
        if bits in (5, 6):
            nibble_words = len(words) - 1
            return [part for i in range(2 * nibble_words) for part in self._plane(words, i, bits)]
        parts = []
        for w, word in enumerate(words):
            if bits == 8 and self.vnni:
                parts.append((word, 4 * w, 1))
                continue
            lo = T.Bind(word & self._i32_const(_NIBBLES))
            hi = T.Bind((word >> self._i32_const(4)) & self._i32_const(_NIBBLES))
            if bits == 4:
                parts += [(lo, 8 * w, 1), (hi, 8 * w + 4, 1)]
            else:
                parts += [(lo, 4 * w, 1), (hi, 4 * w, 16)]
        return parts

    def _plane(self, words: list, i: int, bits: int) -> list[tuple]:
        """Part i (even, then odd k of each nibble word) of a 5- or 6-bit group: its highs sit
        at bits (bits - 4) * i on of each byte of the last word (``models.quantized.high_bit``)."""
        extra = bits - 4
        low, column = words[i // 2], 8 * (i // 2) + 4 * (i % 2)
        if i % 2:
            low = low >> self._i32_const(4)
        nibbles = low & self._i32_const(_NIBBLES)
        mask = ((1 << extra) - 1) * _LOW_BITS
        shift = 4 - extra * i
        highs = words[-1] << self._i32_const(shift) if shift > 0 else words[-1]
        highs = highs >> self._i32_const(-shift) if shift < 0 else highs
        return [(T.Bind(nibbles | (highs & self._i32_const(mask << 4))), column, 1)]

    def accumulate(self, starts: list, rows: list[list[tuple]], bits: int) -> list:
        """Per row, its ``starts`` entry (int32 lanes) plus the exact int32 sum of weight x
        dot(codes, x) over its parts (codes, x: an int32 of 4 int8 activations, broadcast to
        every lane; weight) of a ``bits``-bit format's group; every row has the same codes. With
        vpdpbusd the rows' chains advance together, one part at a time: row after row, each
        chain of dependent dots (5 cycles apiece) outran what the core's scheduler could hold,
        and 8 rows took 1.3x as long (weights in cache). vpmaddubsw pair sums are added in int16
        (as many as cannot saturate, ``_int16_sums``) and widened by vpmaddwd, row by row."""
        if not self.vnni:
            return [
                self._pair_chain(start, parts, bits)
                for start, parts in zip(starts, rows, strict=True)
            ]
        accs = list(starts)
        for j in range(len(rows[0])):
            for r, parts in enumerate(rows):
                codes, x, _ = parts[j]
                dot = T.call_llvm_pure_intrin(self.i32, self.vnni, accs[r], *self._bytes(codes, x))
                accs[r] = T.Bind(dot)
        return accs

    def _pair_chain(self, start, parts: list[tuple], bits: int):
        acc = start
        n = _int16_sums(bits if bits in (5, 6) else 4)
        for weight in sorted({w for _, _, w in parts}):
            sums = [self._pair_sums(c, x) for c, x, w in parts if w == weight]
            for i in range(0, len(sums), n):
                acc = acc + self._madd(tree(lambda a, b: a + b, sums[i : i + n]), weight)
        return acc

    def _bytes(self, codes, x) -> tuple:
        """The byte vectors of codes and of x broadcast (LLVM 21+ types both ``vXi8``)."""
        i8 = f"int8x{4 * self.lanes}"
        return T.reinterpret(i8, codes), T.reinterpret(i8, tirx.Broadcast(x, self.lanes))

    def _pair_sums(self, codes, x):
        return T.call_llvm_pure_intrin(
            f"int16x{2 * self.lanes}", self.maddubs, *self._bytes(codes, x)
        )

    def _madd(self, pairs, weight: int):
        w = tirx.Broadcast(tirx.const(weight, "int16"), 2 * self.lanes)
        return T.call_llvm_pure_intrin(self.i32, self.maddwd, pairs, w)

    def fma(self, a, b, c):
        """a * b + c on float32 lanes, rounded once: always fused, so every kernel branch (and
        so every row count) rounds alike."""
        return T.call_llvm_pure_intrin(self.f32, f"llvm.fma.v{self.lanes}f32", a, b, c)

    @property
    def i32(self) -> str:
        return f"int32x{self.lanes}"

    @property
    def f32(self) -> str:
        return f"float32x{self.lanes}"

    def _i32_const(self, value: int):
        return tirx.Broadcast(tirx.const(value, "int32"), self.lanes)


# (LLVM CPU features, integer dot) from best to worst.
_INTEGER_DOTS = (
    (
        ("avx512vnni", "avx512bw"),
        IntegerDot(16, (4, 4, 4, 2), 8, vnni="llvm.x86.avx512.vpdpbusd.512"),
    ),
    (
        ("avx512bw",),
        IntegerDot(
            16,
            (4, 4, 4, 2),
            8,
            maddubs="llvm.x86.avx512.pmaddubs.w.512",
            maddwd="llvm.x86.avx512.pmaddw.d.512",
        ),
    ),
    (("avxvnni",), IntegerDot(8, (4, 2, 1, 1), 4, vnni="llvm.x86.avx512.vpdpbusd.256")),
    (
        ("avx2",),
        IntegerDot(
            8, (4, 4, 2, 2), 4, maddubs="llvm.x86.avx2.pmadd.ub.sw", maddwd="llvm.x86.avx2.pmadd.wd"
        ),
    ),
)


# AVX-512 VNNI sweeps on CPUs other than AMD's (LLVM names them znver*): all 4 vectors of a
# panel for up to 8 rows. On a 2-core AVX-512 Xeon (2026-11-23, ``scripts/bench_kernel.py``,
# Qwen2.5-1.5B's Q4_K and Q6_K layers alone) they took 0.47-0.72x the time of the Zen 4 widths
# at 4-8 rows: there a spilled accumulator costs less than a vector decoded again. Without a
# code prefetch (then one 4 KB burst into L1) Q4_1 was 1.1-1.3x faster with 2 vectors at 4-7
# rows; with it, 2 and 4 are within a few percent for every format but Q6_K, where 4 wins
# (``bench_kernel.py --widths 2,4``, docs/benchmarks.md). With today's prefetches and rows
# advancing together, 4 vectors still took 0.80-0.92x the time of 2 at 8 rows of SmolLM2's
# layers (``--widths 1,2,4``).
_WIDE_SWEEPS = (4,) * 8


def integer_dot(target: Target) -> IntegerDot:
    """The best integer dot product of ``target``'s CPU; CompileError where it has none."""
    features = set(tvm.target.codegen.llvm_get_cpu_features(target))
    for needs, dot in _INTEGER_DOTS:
        if features.issuperset(needs):
            amd = str(target.attrs.get("mcpu", "")).startswith("znver")
            if dot.vnni and dot.lanes == 16 and not amd:
                return replace(dot, widths=_WIDE_SWEEPS)
            return dot
    raise CompileError("--activations int8 needs a CPU with AVX2 or newer (see --cpu)")


class Int8Matmul:
    """x @ W.T with x quantized to int8 per row and group, for one CPU target: the layers'
    ``matmul`` for quantized weights (``models.quantized.quantize_layers``)."""

    def __init__(self, target: Target):
        self.dot = integer_dot(target)

    def __call__(self, x: nn.Tensor, weight: QuantizedWeight, name: str) -> nn.Tensor:
        (n, k), fmt = weight.shape, weight.fmt
        rows = op.reshape(x, (-1, k))
        m, groups = rows.shape[0], k // fmt.group_size
        xq, xs, xsum = op.tensor_ir_op(
            quantize_func(k, fmt.group_size, interleave=fmt.bits != 8, zero=fmt.zero),
            f"{name}_quantize_x",
            [rows],
            [
                nn.Tensor.placeholder((m, k), "int8"),
                nn.Tensor.placeholder((m, groups), "float32"),
                nn.Tensor.placeholder((m, groups), _sums_dtype(fmt.zero)),
            ],
        )
        out = op.tensor_ir_op(
            matmul_func(self.dot, fmt, n, k, panel_width(n)),
            f"{name}_int8",
            [xq, xs, xsum, *weight.tensors()],
            nn.Tensor.placeholder((m, n), "float32"),
        )
        return op.reshape(out, (*x.shape[:-1], n))


def _slot(j: int, interleave: bool) -> int:
    """Where column j of a group is stored: with ``interleave``, each 8 columns even first."""
    if not interleave:
        return j
    block, i = divmod(j, 8)
    return 8 * block + (i // 2 if i % 2 == 0 else 4 + i // 2)


def _spread(items: list, slots: int) -> list[list]:
    """``items`` in order, cut into ``slots`` runs whose lengths differ by at most one."""
    return [items[s * len(items) // slots : (s + 1) * len(items) // slots] for s in range(slots)]


def _sums_dtype(zero: int) -> str:
    """The type of ``quantize_func``'s code sums for a weight format with this ``zero``."""
    return "int32" if zero else "float32"


@cache
def quantize_func(k: int, group: int, interleave: bool, zero: int) -> tirx.PrimFunc:
    """x [M, k] float32 -> (codes int8 [M, k], scales [M, k/group], sums [M, k/group]): per
    row and group, scale = amax / 127 and code = nearbyint(x * (127 / amax)), 0 for an
    all-zero group; ``interleave`` orders each 8 columns even first (module docstring).

    The sums are what the matmul needs of sum(codes) for a weight format whose code ``zero``
    decodes to 0, ready to use: -zero * sum(codes) (int32), where the integer dot of a group
    starts so that it comes out as sum((weight code - zero) * code); for asymmetric formats
    (zero 0), sum(codes) * scale (float32), which each group's offset multiplies."""
    groups = k // group
    with IRBuilder() as ib, scheduled_prim_func():
        m = T.int64()
        x = T.match_buffer(T.arg("x", T.handle()), (m, k), "float32")
        xq = T.match_buffer(T.arg("xq", T.handle()), (m, k), "int8")
        xs = T.match_buffer(T.arg("xs", T.handle()), (m, groups), "float32")
        xsum = T.match_buffer(T.arg("xsum", T.handle()), (m, groups), _sums_dtype(zero))

        def quantize_row(r) -> None:
            with T.serial(0, groups) as g:
                v = T.Bind(x.vload([r, g * group], f"float32x{group}"))
                amax = T.Bind(horizontal(T.max, T.abs(v), group))
                zero_f = T.float32(0)
                inv = T.Bind(T.Select(amax > zero_f, T.float32(_INT8_MAX) / amax, zero_f))
                rounded = T.nearbyint(v * tirx.Broadcast(inv, group))
                codes = T.Bind(T.Cast(f"int32x{group}", rounded))
                order = sorted(range(group), key=lambda j: _slot(j, interleave))
                stored = tirx.Shuffle([T.Cast(f"int8x{group}", codes)], order)
                T.buffer_store(xq, stored, [r, T.ramp(g * group, 1, group)])
                scale = T.Bind(amax / T.float32(_INT8_MAX))
                T.buffer_store(xs, scale, [r, g])
                total = T.Bind(horizontal(lambda a, b: a + b, codes, group))
                if zero:
                    T.buffer_store(xsum, total * T.int32(-zero), [r, g])
                else:
                    T.buffer_store(xsum, T.Cast("float32", total) * scale, [r, g])

        for_each_row(m, m * k, quantize_row)  # prefill's rows on the thread pool
    return ib.get()


@cache
def matmul_func(dot: IntegerDot, fmt: GroupFormat, n: int, k: int, panel: int) -> tirx.PrimFunc:
    """out [M, n] float32 from ``quantize_func``'s outputs and a weight [n, k] in panels of
    ``panel`` rows in format ``fmt``: one kernel, branching on M over the row tiles."""
    lanes = dot.lanes
    words_per_group = fmt.group_size * fmt.bits // 32
    groups, vectors, panels = k // fmt.group_size, panel // lanes, n // panel
    largest = dot.max_rows
    f32 = dot.f32

    with IRBuilder() as ib, scheduled_prim_func():
        m = T.int64()
        xq = T.match_buffer(T.arg("xq", T.handle()), (m, k), "int8")
        xs = T.match_buffer(T.arg("xs", T.handle()), (m, groups), "float32")
        xsum = T.match_buffer(T.arg("xsum", T.handle()), (m, groups), _sums_dtype(fmt.zero))
        codes = T.arg("codes", T.buffer((panels, groups * words_per_group, panel), "uint32"))
        group_type = str(np.dtype(fmt.group_type))
        scales = T.arg("scales", T.buffer((panels, groups, panel), group_type))
        offsets = (
            T.arg("offsets", T.buffer((panels, groups, panel), group_type))
            if fmt.asymmetric
            else None
        )
        if fmt.super_group:
            supers = (panels, k // fmt.super_group, panel)
            super_scales = T.arg("super_scales", T.buffer(supers, SUPER_TYPE))
            if fmt.asymmetric:
                super_offsets = T.arg("super_offsets", T.buffer(supers, SUPER_TYPE))
        out = T.match_buffer(T.arg("out", T.handle()), (m, n), "float32")

        def widened(buffer, index: list):
            """One vector of float32 lanes from ``buffer``, converted from its type (float16
            and small integers convert exactly)."""
            dtype = str(buffer.dtype)
            if dtype == "float32":
                return buffer.vload(index, f32)
            return T.Cast(f32, buffer.vload(index, f"{dtype}x{lanes}"))

        def scale_offset(p, g, lane0) -> tuple:
            """Group g's scale and offset (None if symmetric) vectors, lanes from ``lane0``:
            loaded, or for a two-level format multiplied from its integers and its
            super-group's float16, widened (exact products: the one-level format's values)."""
            if not fmt.super_group:
                offset = widened(offsets, [p, g, lane0]) if offsets is not None else None
                return widened(scales, [p, g, lane0]), offset
            s = g // (fmt.super_group // fmt.group_size)

            def times(supers, small):
                return widened(supers, [p, s, lane0]) * widened(small, [p, g, lane0])

            if offsets is None:
                return times(super_scales, scales), None
            return times(super_scales, scales), times(super_offsets, offsets)

        def x_word(row, column):
            """4 activation codes from ``column`` on, as one int32."""
            return T.reinterpret("int32", xq.vload([row, column], "int8x4"))

        def group_parts(p, g, lane0) -> list[tuple]:
            """The decoded code vectors of group g, lanes from ``lane0``, with the column
            of their first activation and their weight."""
            words = [
                T.Bind(
                    T.reinterpret(
                        dot.i32,
                        codes.vload([p, g * words_per_group + w, lane0], f"uint32x{lanes}"),
                    )
                )
                for w in range(words_per_group)
            ]
            return [
                (part, g * fmt.group_size + column, weight)
                for part, column, weight in dot.decode(words, fmt.bits)
            ]

        def group_terms(p, g, v, i: int, rows: int, base, acc_load, acc_store, ahead) -> None:
            """Adds group g of vector v of panel p, times rows base .. base + rows - 1 (all
            valid), to their accumulators (slot i of each row's): the group's code vectors are
            loaded and decoded once for all the rows. ``ahead[r]``: the prefetches to ask for
            beside row r's epilogue."""
            lane0 = v * lanes
            parts = group_parts(p, g, lane0)
            scale, offset = scale_offset(p, g, lane0)
            scale = T.Bind(scale)
            offset = T.Bind(offset) if offset is not None else None
            starts = [
                tirx.Broadcast(xsum[base + r, g] if fmt.zero else T.int32(0), lanes)
                for r in range(rows)
            ]
            words = [[(c, x_word(base + r, col), w) for c, col, w in parts] for r in range(rows)]
            sums = dot.accumulate(starts, words, fmt.bits)
            for r in range(rows):
                for call in ahead[r]:
                    T.evaluate(call)
                row = base + r
                ints = T.Cast(f32, sums[r])
                xscale = scale * tirx.Broadcast(xs[row, g], lanes)
                value = dot.fma(ints, xscale, acc_load(r, i))
                if offset is not None:
                    value = dot.fma(offset, tirx.Broadcast(xsum[row, g], lanes), value)
                acc_store(r, i, value)

        def prefetches(p, g, first, width: int) -> list:
            """Calls asking for the code lines that this sweep reads ``_PREFETCH_L2_BYTES`` on
            from group g's (into L2) and ``_PREFETCH_L1_BYTES`` on (into L1), alternating; one
            64-byte line per word and vector, and the lines of the same group's scales and
            offsets, separate streams. The hardware prefetchers stop at 4 KB pages and fall
            behind once several rows' arithmetic runs between the loads; past the last group
            the address lies in the next panel or past the buffer, where a prefetch does
            nothing."""

            def ask(distance: int, locality: int) -> list:
                ahead = -(-distance // (words_per_group * width * lanes * 4))
                lines = [
                    codes[p, (g + ahead) * words_per_group + w, (first + i) * lanes]
                    for i in range(width)
                    for w in range(words_per_group)
                ]
                for small in (scales, offsets):
                    if small is None:
                        continue
                    step = max(1, _CACHE_LINE_BYTES // np.dtype(str(small.dtype)).itemsize)
                    lines += [
                        small[p, g + ahead, first * lanes + lane]
                        for lane in range(0, width * lanes, step)
                    ]
                return [
                    T.call_llvm_intrin(
                        "void", "llvm.prefetch.p0", T.address_of(line), 0, locality, 1
                    )
                    for line in lines
                ]  # read, the cache level (3: L1, 2: L2), data

            pairs = zip(ask(_PREFETCH_L2_BYTES, 2), ask(_PREFETCH_L1_BYTES, 3), strict=True)
            return [call for pair in pairs for call in pair]

        def in_registers(p, first, width: int, rows: int, base) -> None:
            """Rows base .. base + rows - 1 times ``width`` vectors of panel p from vector
            ``first`` on, over all groups, their accumulators in registers."""
            # "global": under 1 KB (every tile here) TVM keeps it on the stack, where LLVM
            # holds it in registers; "local" cost a TVMBackendAllocWorkspace call per panel,
            # ~11% of Qwen2.5-1.5B's gate/up projection at m = 1.
            acc = T.alloc_buffer((rows * width * lanes,), "float32", scope="global")

            def load(r, i):
                return acc.vload([(r * width + i) * lanes], f32)

            def store(r, i, value) -> None:
                T.buffer_store(acc, value, [T.ramp((r * width + i) * lanes, 1, lanes)])

            for r in range(rows):
                for i in range(width):
                    store(r, i, tirx.Broadcast(T.float32(0), lanes))
            with T.serial(0, groups) as g:
                asks = _spread(prefetches(p, g, first, width), width * rows)
                for i in range(width):
                    ahead = asks[i * rows : (i + 1) * rows]
                    group_terms(p, g, first + i, i, rows, base, load, store, ahead)
            for r in range(rows):
                for i in range(width):
                    column = T.ramp(p * panel + (first + i) * lanes, 1, lanes)
                    T.buffer_store(out, load(r, i), [base + r, column])

        def exact(rows: int) -> None:
            """m == rows <= the largest tile: every weight vector read once per call. A panel
            is swept once per ``dot.widths`` of its vectors (all 4 AVX-512 vectors for 1-3
            rows, 2 for 4), and one vector per sweep from 5 rows on: two vectors' decoded
            codes (16 registers for 4-bit) and their rows' accumulators crowd the 32
            registers, and Qwen2.5-1.5B
            verified 5 and 6 tokens 14-16% faster with one (4-bit gate/up alone: 20-35%;
            docs/quantization.md). On Zen 4 these sweeps took 0.69-0.95x the time of one sweep
            over all vectors accumulating in the L1 cache, for 4-6 rows of Qwen2.5-1.5B's
            shapes; on an AVX-512 Xeon sweeps of all 4 vectors up to 8 rows were faster
            (``_WIDE_SWEEPS``). The threads share the (panel, sweep) pairs rather than the
            panels, so that an odd number of panels (9 for SmolLM2's 576 rows) splits evenly:
            SmolLM2 decoded 8% faster on an AVX2 Zen 3 (docs/quantization.md)."""
            most = dot.widths[rows - 1] if rows <= len(dot.widths) else 1
            width = max(w for w in range(1, most + 1) if vectors % w == 0)
            sweeps = vectors // width
            with T.parallel(0, panels * sweeps) as unit:
                in_registers(unit // sweeps, unit % sweeps * width, width, rows, 0)

        def tiled() -> None:
            """m > the largest tile: per vector of a panel (the threads share the (panel,
            vector) pairs), full tiles, then the rest as one exact tile."""
            full = (m // largest) * largest
            with T.parallel(0, panels * vectors) as unit:
                p, v = unit // vectors, unit % vectors
                with T.serial(0, m // largest) as mo:
                    in_registers(p, v, 1, largest, mo * largest)
                chain(m - full, list(range(1, largest)), lambda r: in_registers(p, v, 1, r, full))

        def chain(value, cases: list[int], body) -> None:
            """if value == cases[0]: body(cases[0]) elif ...: one branch per case."""
            if not cases:
                return
            with T.If(value == cases[0]):
                with T.Then():
                    body(cases[0])
                if len(cases) > 1:
                    with T.Else():
                        chain(value, cases[1:], body)

        def dispatch() -> None:
            with T.If(m <= largest):
                with T.Then():
                    chain(m, list(range(1, largest + 1)), exact)
                with T.Else():
                    tiled()

        with T.sblock("root"):
            dispatch()
    return ib.get()
