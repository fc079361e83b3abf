"""Linear layers with int8 activations on the CPU (``mlc-spec compile --activations int8``).

With float activations, m rows cost m x (parameters) FMAs, so verifying a few draft tokens is
compute bound at several decode steps. As llama.cpp does, this path quantizes each activation
row in groups (symmetric int8: scale = amax / 127, codes rounded to nearest even; groups of 16
values, or a two-level format's weight group, ``activation_group``) and multiplies the weight
codes by it with integer dot products: ``vpdpbusd`` (AVX-512 VNNI, AVX-VNNI), or ``vpmaddubsw``
+ ``vpmaddwd`` (AVX-512BW, AVX2), 4 multiply-adds per 32-bit lane and instruction against an
FMA's one.

Two kernels per linear layer, written by hand as TIR with TVM's IR builder:

* ``quantize_activations``: x [M, K] float32 -> int8 codes [M, K], scales float32 per group
  and what the matmul needs of the code sums, ready to use (``quantize_func``). For
  4-, 5- and 6-bit weights the codes of every 8 columns are stored even columns first (0, 2,
  4, 6, 1, 3, 5, 7), the order of a weight word's nibbles: the low nibbles (even k) and the high
  nibbles (odd k) of 16 output rows, masked out of one vector of code words, each meet 4
  consecutive activation bytes broadcast to every lane (5- and 6-bit codes get their high bits
  from a word of their own, ``compiler/quantization/formats.py``).
* ``int8_matmul`` over the panels of ``models/quantized.py`` (64 output rows, k-major): per
  activation group, acc = sum((code - zero) * xq) in int32, exactly (the integer dot starts at
  -zero * sum(xq)); then per weight group out = fma(sum(acc * xscale), scale, out), and for
  asymmetric formats out = fma(offset, sum(xscale * sum(xq)), out). Each vector of code words
  is decoded once and applied to every row of an m tile, so a call reads each weight block
  once per tile. The kernel serves every m, prefill included: one arithmetic for every row,
  whatever the batch, keeps verified rows bit-identical to decoded ones (greedy speculation
  stays lossless) and gives prefill the cheaper integer arithmetic too. A two-level format's
  group scale and offset are multiplied from their small integers in the kernel, once per group
  and vector.

Each extra row of a verify batch costs its integer dots plus this per-group epilogue, so the
epilogue is kept to a conversion and a multiply-add per activation group and vector, one more
multiply-add for an offset: the zero point rides in the dot's start value and the offset's
factor comes precomputed per row.

Two-level formats (GGUF's Q4_K, Q6_K) on the vpmaddubsw path drop that epilogue to one per
super-group of 256 (``sub_scaled``): their group scales and offsets are small integers, which
vpmaddwd applies as it widens the pair sums, if the activations of a super-group share one float
scale. So they are rounded per 256 values, as llama.cpp's Q8_K, each group with that scale
halved up to 3 times (a shift of its int32 sum) where its values allow
(``sub_scaled_quantize_func``); a row's groups then add up exactly in int32, and the offsets' or
zero point's term comes from the codes' sums, two groups per vpmaddwd, once per super-group.
vpdpbusd, whose int32 dots only a vpmulld could scale, keeps the per-group epilogue: the two
paths round activations differently there, each row-invariant.

``vpmaddubsw`` adds two u8 x s8 products in saturating int16, so on that path 8-bit codes are
split into nibbles, whose dot products ``vpmaddwd`` weights by 1 and 16; 5- and 6-bit codes
stay whole (a pair sum is at most 2 x 63 x 127), with fewer pair sums added in int16 before
``vpmaddwd`` widens them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache

import numpy as np
import tvm
from tvm import relax as rx
from tvm import tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op
from tvm.relax.frontend.nn.core import wrap_nested
from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder
from tvm.target import Target

from mlc_spec.models.quantized import SUPER_TYPE, GroupFormat, QuantizedWeight, panel_width

from .cpu_rule import for_each_row, root_block, scheduled_prim_func
from .errors import CompileError
from .vector_reduce import horizontal

_NIBBLES = 0x0F0F0F0F
_LOW_BITS = 0x01010101
_INT8_MAX = 127.0
_INT16_MAX = 32767
# How far ahead of a sweep's reads its code lines, and its group scales' and offsets' lines, are
# prefetched: into L2 from DRAM, and from there into L1. The asks are spread over the rows'
# epilogues of a group rather than made together: one burst of a group's lines filled the L1 miss
# buffers and held the core until they drained, so that memory and arithmetic took turns; spread
# out, they overlap. Nearby distances did alike (docs/kernels.md).
_PREFETCH_L2_BYTES = 4096
_PREFETCH_L1_BYTES = 1024
_CACHE_LINE_BYTES = 64
# Activations are rounded per 16 values with one scale each before one-level weight formats,
# finer than their groups of 32, where llama.cpp rounds per 32 (Q8_0, Q8_1): rounded per 32, our
# SmolLM2 int8 KL from the float model only tied llama.cpp's, per 16 it is about half. Before
# two-level formats (GGUF's K types), where llama.cpp rounds per 256 (Q8_K), per weight group:
# already a fraction of llama.cpp's KL, and a 32-weight group then takes one int32 dot and one
# conversion instead of two, which at 9 rows and more, where the epilogue's vector operations
# bound the kernel, is 7-10% of a Q4_K layer's time (docs/kernels.md, docs/quantization.md).
_ACTIVATION_GROUP = 16
# Before two-level formats on the vpmaddubsw path (``sub_scaled``), a row's 256 values share one
# float scale, as llama.cpp's Q8_K, but each weight group of them is rounded with that scale
# halved up to this many times where its own largest value allows, so that a group without the
# super-group's outliers keeps up to 3 more bits. Its codes' sum times 2^3 stays in int16 for
# vpmaddwd (32 x 127 x 8 < 2^15), and a super-group's total in int32 (Q6_K's, at most 16 x 128
# x 32 x 127 x 16 x 8 < 2^31, where its unsigned codes' running sum may wrap: int32 adds are
# exact modulo 2^32, so the total, which fits, comes out right).
_SUB_SCALE_SHIFTS = 3


def activation_group(fmt: GroupFormat) -> int:
    """How many activation values of a row share one int8 scale before a weight in ``fmt``:
    the weight group for a two-level format, else ``_ACTIVATION_GROUP`` or the weight group
    where that is smaller. Not for ``sub_scaled`` kernels, which round otherwise."""
    if fmt.super_group:
        return fmt.group_size
    return min(fmt.group_size, _ACTIVATION_GROUP)


def sub_scaled(dot: IntegerDot, fmt: GroupFormat) -> bool:
    """Whether ``dot`` reads ``fmt`` with activations rounded per super-group with power-of-two
    steps per weight group (``sub_scaled_quantize_func``): two-level formats on the vpmaddubsw
    path, whose vpmaddwd then applies the group's integer scale for free, so that a group costs
    no float arithmetic. vpdpbusd gives int32 dots, which only a vpmulld could scale: VNNI
    keeps one float epilogue per group."""
    return bool(fmt.super_group) and dot.vnni is None


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
    yet sweeps wider than that rule allows (4, 4, 2, 2 vectors for 1-4 rows, not 4, 2, 1, 1)
    are faster there: a spilled accumulator costs less than a code vector decoded once more per
    sweep; and passes of up to 8 rows (one vector at 5-8), whose codes are decoded once for all
    8 rows of a verify (docs/kernels.md). AVX-VNNI (16 registers too) keeps the rule, unmeasured.
    """

    lanes: int
    widths: tuple[int, ...]
    max_rows: int
    vnni: str | None = None
    maddubs: str | None = None
    maddwd: str | None = None
    # ``widths`` for 8-bit codes where they differ: on vpmaddubsw each code word gives two
    # nibble parts, twice a 4-bit group's, so a wide sweep over several rows spills them
    # (docs/kernels.md).
    byte_widths: tuple[int, ...] | None = None

    def width(self, rows: int, bits: int) -> int:
        """The most vectors a sweep of ``rows`` rows takes of ``bits``-bit codes."""
        widths = self.byte_widths if bits == 8 and self.byte_widths else self.widths
        return widths[rows - 1] if rows <= len(widths) else 1

    @property
    def instruction(self) -> str:
        """The integer dot's instruction, which decides how activations round (``sub_scaled``)."""
        return "vpdpbusd" if self.vnni else "vpmaddubsw"

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
            lo = T.Bind(word & self.i32_const(_NIBBLES))
            hi = T.Bind((word >> self.i32_const(4)) & self.i32_const(_NIBBLES))
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
            low = low >> self.i32_const(4)
        nibbles = low & self.i32_const(_NIBBLES)
        mask = ((1 << extra) - 1) * _LOW_BITS
        shift = 4 - extra * i
        highs = words[-1] << self.i32_const(shift) if shift > 0 else words[-1]
        highs = highs >> self.i32_const(-shift) if shift < 0 else highs
        return [(T.Bind(nibbles | (highs & self.i32_const(mask << 4))), column, 1)]

    def accumulate(self, starts: list, rows: list[list[tuple]], bits: int, factor=None) -> list:
        """Per row, its ``starts`` entry (int32 lanes) plus the exact int32 sum of weight x
        dot(codes, x) over its parts (codes, x: an int32 of 4 int8 activations, broadcast to
        every lane; weight) of a ``bits``-bit format's group, times ``factor`` (int16 pairs,
        ``int16_pairs``) where given, which only vpmaddwd applies; every row has the same codes. The
        rows' chains advance together, one part at a time: row after row, each chain of
        dependent instructions outran what the core's scheduler could hold (docs/kernels.md).
        vpmaddubsw pair sums are added in int16, as many as cannot saturate (``_int16_sums``),
        and widened by vpmaddwd."""
        if not self.vnni:
            return self._pair_chains(starts, rows, bits, factor)
        assert factor is None, "vpdpbusd has no int16 stage to scale"
        accs = list(starts)
        for j in range(len(rows[0])):
            for r, parts in enumerate(rows):
                codes, x, _ = parts[j]
                dot = T.call_llvm_pure_intrin(self.i32, self.vnni, accs[r], *self._bytes(codes, x))
                accs[r] = T.Bind(dot)
        return accs

    def _pair_chains(self, starts: list, rows: list[list[tuple]], bits: int, factor) -> list:
        """``accumulate`` with vpmaddubsw: per run of parts of one weight that int16 holds
        added up, each row's pair sums, part by part across the rows, then each row's widened
        by vpmaddwd into its int32 accumulator."""
        n = _int16_sums(bits if bits in (5, 6) else 4)
        accs = list(starts)
        for weight in sorted({w for _, _, w in rows[0]}):
            same = [j for j, (_, _, w) in enumerate(rows[0]) if w == weight]
            for run in (same[i : i + n] for i in range(0, len(same), n)):
                pairs = [None] * len(rows)
                for j in run:
                    for r, parts in enumerate(rows):
                        codes, x, _ = parts[j]
                        s = self._pair_sums(codes, x)
                        pairs[r] = T.Bind(s if pairs[r] is None else pairs[r] + s)
                madds = [self._madd(p, weight, factor) for p in pairs]
                accs = [T.Bind(a + d) for a, d in zip(accs, madds, strict=True)]
        return accs

    def _bytes(self, codes, x) -> tuple:
        """The byte vectors of codes and of x broadcast (LLVM 21+ types both ``vXi8``)."""
        i8 = f"int8x{4 * self.lanes}"
        return T.reinterpret(i8, codes), T.reinterpret(i8, tirx.Broadcast(x, self.lanes))

    def _pair_sums(self, codes, x):
        return T.call_llvm_pure_intrin(
            f"int16x{2 * self.lanes}", self.maddubs, *self._bytes(codes, x)
        )

    def _madd(self, pairs, weight: int, factor=None):
        if factor is None:
            return self.madd(pairs, tirx.Broadcast(tirx.const(weight, "int16"), 2 * self.lanes))
        assert weight == 1, "a factor scales whole codes (two-level formats: 4 or 6 bits)"
        return self.madd(pairs, factor)

    def madd(self, a, b):
        """vpmaddwd: per int32 lane, the sum of its two int16 products of a and b, exactly."""
        return T.call_llvm_pure_intrin(self.i32, self.maddwd, a, b)

    def int16_pairs(self, low, high=None):
        """int32 lanes of small integers -> int16 lanes, low's then high's (low's again if
        None) in each int32 lane: vpmaddwd's factor."""
        high = low if high is None else high
        both = (low & self.i32_const(0xFFFF)) | T.shift_left(high, self.i32_const(16))
        return T.reinterpret(f"int16x{2 * self.lanes}", both)

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

    def i32_const(self, value: int):
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
            8,
            (4, 4, 2, 2),
            8,
            maddubs="llvm.x86.avx2.pmadd.ub.sw",
            maddwd="llvm.x86.avx2.pmadd.wd",
            byte_widths=(4,),
        ),
    ),
)


# AVX-512 VNNI sweeps on CPUs other than Zen 4 (LLVM's znver4): all 4 vectors of a panel, in
# exact passes of up to 9 rows, so that a verify of 8 drafts is one pass rather than an 8-row
# tile of single vectors plus the rest. On the AVX-512 Xeon and Zen 5 measured, a spilled
# accumulator costs less than a vector decoded again, and with the prefetches and the rows'
# dots advancing together 4 vectors per sweep stay ahead of 2. Longer passes were faster still
# but compile time grows superlinearly with the pass (docs/kernels.md). Zen 4, which splits
# each 512-bit operation in two, keeps the widths and the 8-row passes measured on it.
_WIDE_SWEEPS = (4,) * 9


def integer_dot(target: Target) -> IntegerDot:
    """The best integer dot product of ``target``'s CPU; CompileError where it has none."""
    features = set(tvm.target.codegen.llvm_get_cpu_features(target))
    for needs, dot in _INTEGER_DOTS:
        if features.issuperset(needs):
            double_pumped = str(target.attrs.get("mcpu", "")) == "znver4"
            if dot.vnni and dot.lanes == 16 and not double_pumped:
                return replace(dot, widths=_WIDE_SWEEPS, max_rows=len(_WIDE_SWEEPS))
            return dot
    raise CompileError("--activations int8 needs a CPU with AVX2 or newer (see --cpu)")


class Int8Matmul:
    """x @ W.T with x quantized to int8 per row and group, for one CPU target: the layers'
    ``matmul`` for quantized weights (``models.quantized.quantize_layers``)."""

    def __init__(self, target: Target):
        self.dot = integer_dot(target)
        # The kernels already added to a module being built. BlockBuilder.add_func finds an
        # added kernel again by structural hash and comparison, ~15 ms a call for an int8
        # matmul (6 s of Qwen2.5-1.5B's graph build); each kernel here is one cached object.
        self._added: dict[tuple[rx.BlockBuilder, tirx.PrimFunc], tvm.ir.GlobalVar] = {}

    def __call__(self, x: nn.Tensor, weight: QuantizedWeight, name: str) -> nn.Tensor:
        (n, k), fmt = weight.shape, weight.fmt
        rows = op.reshape(x, (-1, k))
        m, group, sub = rows.shape[0], activation_group(fmt), sub_scaled(self.dot, fmt)
        if sub:
            func = sub_scaled_quantize_func(k, fmt.group_size, fmt.super_group)
        else:
            func = quantize_func(k, fmt.group_size, group, fmt.bits != 8, fmt.zero)
        activations = self._call_tir(
            func,
            f"{name}_quantize_x",
            [rows],
            [
                nn.Tensor.placeholder((m, k // per), dtype)
                for _, per, dtype in activation_layout(fmt, group, sub)
            ],
        )
        out = self._call_tir(
            matmul_func(self.dot, fmt, n, k, panel_width(n), group),
            f"{name}_int8",
            [*activations, *weight.tensors()],
            nn.Tensor.placeholder((m, n), "float32"),
        )
        return op.reshape(out, (*x.shape[:-1], n))

    def _call_tir(self, func: tirx.PrimFunc, name: str, args: list[nn.Tensor], out):
        """``op.tensor_ir_op(func, name, args, out)``, adding ``func`` to the module being
        built only once."""
        bb = rx.BlockBuilder.current()
        gvar = self._added.get((bb, func))
        if gvar is None:
            gvar = self._added[(bb, func)] = bb.add_func(func, name)
        types = [t._expr.ty for t in (out if isinstance(out, list) else [out])]
        return wrap_nested(bb.emit(rx.call_tir(gvar, [a._expr for a in args], types)), name=name)


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


def _sums_every(group: int, scaled: int, zero: int) -> int:
    """How many values of a row share one of ``quantize_func``'s code sums before weights in
    groups of ``group`` (activations in groups of ``scaled``): an activation group where the
    format's ``zero`` starts each integer dot, else (asymmetric) a weight group, whose offset
    the sum's factor multiplies."""
    return scaled if zero else group


def activation_layout(fmt: GroupFormat, group: int, sub: bool) -> list[tuple[str, int, str]]:
    """(name, values of a row per entry, type) of the quantized activations before ``fmt``, in
    the order the quantize function writes them and the matmul reads them: ``quantize_func``'s
    (activation groups of ``group``) or, ``sub``, ``sub_scaled_quantize_func``'s."""
    if sub:
        return [
            ("xq", 1, "int8"),
            ("xs", fmt.super_group, "float32"),
            ("xshift", fmt.group_size, "int32"),
            ("xsum", fmt.group_size, "int16"),
        ]
    sums = _sums_every(fmt.group_size, group, fmt.zero)
    return [("xq", 1, "int8"), ("xs", group, "float32"), ("xsum", sums, _sums_dtype(fmt.zero))]


def _inverse_scale(amax):
    """127 / amax, 0 for an all-zero group (its codes all 0)."""
    zero = T.float32(0)
    return T.Bind(T.Select(amax > zero, T.float32(_INT8_MAX) / amax, zero))


def _store_codes(xq: tirx.Buffer, r, column, v, inv, order: list[int]):
    """Codes nearbyint(v * inv) of one activation group, stored as int8 at (r, column) in
    ``order``; returned as int32 lanes (for their sum)."""
    lanes = len(order)
    codes = T.Bind(T.Cast(f"int32x{lanes}", T.nearbyint(v * tirx.Broadcast(inv, lanes))))
    stored = tirx.Shuffle([T.Cast(f"int8x{lanes}", codes)], order)
    T.buffer_store(xq, stored, [r, T.ramp(column, 1, lanes)])
    return codes


@cache
def quantize_func(k: int, group: int, scaled: int, interleave: bool, zero: int) -> tirx.PrimFunc:
    """x [M, k] float32 -> (codes int8 [M, k], scales [M, k/scaled], sums): per row and
    activation group of ``scaled`` values (weight groups of ``group`` hold whole ones), scale =
    amax / 127 and code = nearbyint(x * (127 / amax)), 0 for an all-zero group; ``interleave``
    orders each 8 columns even first (module docstring).

    The sums are what the matmul needs of sum(codes) for a weight format whose code ``zero``
    decodes to 0, ready to use: per activation group -zero * sum(codes) (int32, [M, k/scaled]),
    where its integer dot starts so that it comes out as sum((weight code - zero) * code); for
    asymmetric formats (zero 0), per weight group the sum over its activation groups of
    sum(codes) * scale (float32, [M, k/group]), which the group's offset multiplies."""
    groups, split = k // group, group // scaled
    sums = k // _sums_every(group, scaled, zero)
    with IRBuilder() as ib, scheduled_prim_func():
        m = T.int64()
        x = T.match_buffer(T.arg("x", T.handle()), (m, k), "float32")
        xq = T.match_buffer(T.arg("xq", T.handle()), (m, k), "int8")
        xs = T.match_buffer(T.arg("xs", T.handle()), (m, groups * split), "float32")
        xsum = T.match_buffer(T.arg("xsum", T.handle()), (m, sums), _sums_dtype(zero))
        order = sorted(range(scaled), key=lambda j: _slot(j, interleave))

        def quantize_row(r) -> None:
            with T.serial(0, groups) as g:
                offset_factor = None
                for h in range(split):
                    a = g * split + h
                    v = T.Bind(x.vload([r, a * scaled], f"float32x{scaled}"))
                    amax = T.Bind(horizontal(T.max, T.abs(v), scaled))
                    codes = _store_codes(xq, r, a * scaled, v, _inverse_scale(amax), order)
                    scale = T.Bind(amax / T.float32(_INT8_MAX))
                    T.buffer_store(xs, scale, [r, a])
                    total = T.Bind(horizontal(lambda a, b: a + b, codes, scaled))
                    if zero:
                        T.buffer_store(xsum, total * T.int32(-zero), [r, a])
                        continue
                    term = T.Cast("float32", total) * scale
                    offset_factor = term if offset_factor is None else offset_factor + term
                if not zero:
                    T.buffer_store(xsum, offset_factor, [r, g])

        for_each_row(m, m * k, quantize_row)  # prefill's rows on the thread pool
    return ib.get()


@cache
def sub_scaled_quantize_func(k: int, group: int, super_group: int) -> tirx.PrimFunc:
    """x [M, k] float32 -> (codes int8 [M, k], scales float32 [M, k/super_group], shifts int32
    [M, k/group], sums int16 [M, k/group]) for ``sub_scaled`` kernels: per row and super-group,
    amax its largest |x| and per weight group of ``group`` values e its largest e <=
    ``_SUB_SCALE_SHIFTS`` with amax_g * 2^e <= amax: code = nearbyint(x * (127 / amax) * 2^e),
    so that x = code * scale * 2^shift with scale = amax / 127 / 2^_SUB_SCALE_SHIFTS and shift =
    _SUB_SCALE_SHIFTS - e; sums = sum(codes) * 2^shift, what a group's offset or zero point
    multiplies. Codes in the order of ``quantize_func`` with interleave."""
    groups, per_super, top = k // group, super_group // group, _SUB_SCALE_SHIFTS
    with IRBuilder() as ib, scheduled_prim_func():
        m = T.int64()
        x = T.match_buffer(T.arg("x", T.handle()), (m, k), "float32")
        xq = T.match_buffer(T.arg("xq", T.handle()), (m, k), "int8")
        xs = T.match_buffer(T.arg("xs", T.handle()), (m, k // super_group), "float32")
        shifts = T.match_buffer(T.arg("xshift", T.handle()), (m, groups), "int32")
        sums = T.match_buffer(T.arg("xsum", T.handle()), (m, groups), "int16")
        order = sorted(range(group), key=lambda j: _slot(j, True))

        def quantize_row(r) -> None:
            with T.serial(0, k // super_group) as s:
                amaxes = T.alloc_buffer((per_super,), "float32", scope="global")
                with T.serial(0, per_super) as h:
                    v = x.vload([r, (s * per_super + h) * group], f"float32x{group}")
                    T.buffer_store(amaxes, horizontal(T.max, T.abs(v), group), [h])
                amax = T.Bind(amaxes[0])
                for h in range(1, per_super):
                    amax = T.Bind(T.max(amax, amaxes[h]))
                inv = _inverse_scale(amax)
                T.buffer_store(xs, amax / T.float32(_INT8_MAX * (1 << top)), [r, s])
                with T.serial(0, per_super) as h:
                    g = s * per_super + h
                    a = T.Bind(amaxes[h])
                    e = T.int32(0)
                    for step in range(1, top + 1):
                        e = T.Select(a * T.float32(1 << step) <= amax, T.int32(step), e)
                    e = T.Bind(e)
                    power = T.Cast("float32", T.shift_left(T.int32(1), e))
                    v = x.vload([r, g * group], f"float32x{group}")
                    codes = _store_codes(xq, r, g * group, v, T.Bind(inv * power), order)
                    shift = T.Bind(T.int32(top) - e)
                    T.buffer_store(shifts, shift, [r, g])
                    total = T.Bind(horizontal(lambda a, b: a + b, codes, group))
                    T.buffer_store(sums, T.Cast("int16", T.shift_left(total, shift)), [r, g])

        for_each_row(m, m * k, quantize_row)  # prefill's rows on the thread pool
    return ib.get()


@cache
def matmul_func(
    dot: IntegerDot, fmt: GroupFormat, n: int, k: int, panel: int, group: int | None = None
) -> tirx.PrimFunc:
    """out [M, n] float32 from ``quantize_func``'s outputs (activations rounded per ``group``
    values; default ``activation_group(fmt)``) and a weight [n, k] in panels of ``panel`` rows
    in format ``fmt``: one kernel, branching on M over the row tiles (``_Kernel.dispatch``)."""
    shape = _Shape.of(dot, fmt, n, k, panel, group or activation_group(fmt))
    with IRBuilder() as ib, scheduled_prim_func():
        kernel = _Kernel(dot, fmt, shape, _Params.declare(fmt, shape, n, k))
        with root_block():
            kernel.dispatch()
    return ib.get()


_Index = tirx.Expr | int  # a loop variable, an expression of them, or a constant


@dataclass(frozen=True)
class _Shape:
    """The static shape of one kernel: ``lanes`` per vector, ``panels`` panels of
    ``panel_rows`` rows, ``groups`` groups along k, ``words`` code words (uint32) per group and
    row, ``split`` activation groups of ``scaled`` values per group; ``sub_scaled``: the
    activations of ``sub_scaled_quantize_func`` instead (one group, one shift each)."""

    lanes: int
    panel_rows: int
    panels: int
    groups: int
    words: int
    split: int
    scaled: int
    sub_scaled: bool

    @classmethod
    def of(
        cls, dot: IntegerDot, fmt: GroupFormat, n: int, k: int, panel: int, group: int
    ) -> _Shape:
        words = fmt.group_size * fmt.bits // 32
        split = fmt.group_size // group
        groups, integer = k // fmt.group_size, sub_scaled(dot, fmt)
        return cls(dot.lanes, panel, n // panel, groups, words, split, group, integer)

    @property
    def vectors(self) -> int:
        """Vectors per panel."""
        return self.panel_rows // self.lanes


@dataclass(frozen=True)
class _Params:
    """The kernel's parameters, ``m`` (rows) symbolic; ``xshift`` for ``sub_scaled`` kernels,
    ``offsets`` for asymmetric formats, ``super_*`` for two-level ones (their group scales and
    offsets are small integers)."""

    m: tirx.Var
    xq: tirx.Buffer
    xs: tirx.Buffer
    xshift: tirx.Buffer | None
    xsum: tirx.Buffer
    codes: tirx.Buffer
    scales: tirx.Buffer
    offsets: tirx.Buffer | None
    super_scales: tirx.Buffer | None
    super_offsets: tirx.Buffer | None
    out: tirx.Buffer

    @classmethod
    def declare(cls, fmt: GroupFormat, shape: _Shape, n: int, k: int) -> _Params:
        """Declared in the IR builder's PrimFunc frame, in the order of the call's arguments."""
        m = T.int64()
        groups, per_group = shape.groups, (shape.panels, shape.groups, shape.panel_rows)
        activations = {
            name: T.match_buffer(T.arg(name, T.handle()), (m, k // per), dtype)
            for name, per, dtype in activation_layout(fmt, shape.scaled, shape.sub_scaled)
        }
        xq, xs, xsum = activations["xq"], activations["xs"], activations["xsum"]
        xshift = activations.get("xshift")
        words = (shape.panels, groups * shape.words, shape.panel_rows)
        codes = T.arg("codes", T.buffer(words, "uint32"))
        group_type = str(np.dtype(fmt.group_type))
        scales = T.arg("scales", T.buffer(per_group, group_type))
        offsets = T.arg("offsets", T.buffer(per_group, group_type)) if fmt.asymmetric else None
        super_scales = super_offsets = None
        if fmt.super_group:
            supers = (shape.panels, k // fmt.super_group, shape.panel_rows)
            super_scales = T.arg("super_scales", T.buffer(supers, SUPER_TYPE))
            if fmt.asymmetric:
                super_offsets = T.arg("super_offsets", T.buffer(supers, SUPER_TYPE))
        out = T.match_buffer(T.arg("out", T.handle()), (m, n), "float32")
        return cls(
            m, xq, xs, xshift, xsum, codes, scales, offsets, super_scales, super_offsets, out
        )


@dataclass(frozen=True)
class _Accumulators:
    """Accumulators (float32, or int32) of ``width`` vectors per row, slot i of row r at (r, i)."""

    buffer: tirx.Buffer
    width: int
    lanes: int

    @classmethod
    def alloc(cls, rows: int, width: int, lanes: int, dtype: str = "float32") -> _Accumulators:
        # "global": under 1 KB (every tile here) TVM keeps it on the stack, where LLVM holds it
        # in registers; "local" costs a TVMBackendAllocWorkspace call per pass (docs/kernels.md).
        return cls(T.alloc_buffer((rows * width * lanes,), dtype, scope="global"), width, lanes)

    def load(self, r: int, i: int) -> tirx.Expr:
        dtype = f"{self.buffer.dtype}x{self.lanes}"
        return self.buffer.vload([(r * self.width + i) * self.lanes], dtype)

    def clear(self) -> None:
        for slot in range(int(self.buffer.shape[0]) // self.lanes):
            zero = tirx.Broadcast(tirx.const(0, str(self.buffer.dtype)), self.lanes)
            T.buffer_store(self.buffer, zero, [T.ramp(slot * self.lanes, 1, self.lanes)])

    def store(self, r: int, i: int, value: tirx.Expr) -> None:
        T.buffer_store(
            self.buffer, value, [T.ramp((r * self.width + i) * self.lanes, 1, self.lanes)]
        )


@dataclass(frozen=True)
class _Kernel:
    """The pieces of ``matmul_func``'s body, top-down: ``dispatch`` picks ``exact`` or
    ``tiled`` passes by M, each pass (``in_registers``) adds up ``group_terms`` in registers,
    and those decode a group's codes once (``group_parts``, ``scale_offset``) for all rows."""

    dot: IntegerDot
    fmt: GroupFormat
    shape: _Shape
    params: _Params

    def dispatch(self) -> None:
        """M up to ``dot.max_rows``: one exact pass (a branch per M); beyond, ``tiled``."""
        m, largest = self.params.m, self.dot.max_rows
        with T.If(m <= largest):
            with T.Then():
                _chain(m, list(range(1, largest + 1)), self.exact)
            with T.Else():
                self.tiled()

    def exact(self, rows: int) -> None:
        """M == rows <= the largest tile: every weight vector read once per call. A panel is
        swept ``dot.width(rows, bits)`` of its vectors at a time (the largest
        divisor of its vectors up to that), so that a sweep's decoded codes and its rows'
        accumulators stay in registers: two vectors' decoded codes (16 registers for 4-bit) and
        their rows' accumulators crowd even AVX-512's 32 from 5 rows on. Sweeps in registers
        beat one sweep over all vectors accumulating in the L1 cache. The threads share the
        (panel, sweep) pairs rather than the panels, so that an odd number of panels (9 for
        SmolLM2's 576 rows) splits evenly (docs/kernels.md)."""
        vectors, panels = self.shape.vectors, self.shape.panels
        most = self.dot.width(rows, self.fmt.bits)
        width = max(w for w in range(1, most + 1) if vectors % w == 0)
        sweeps = vectors // width
        with T.parallel(0, panels * sweeps) as unit:
            self.in_registers(_Sweep(unit // sweeps, unit % sweeps * width, width, rows, 0))

    def tiled(self) -> None:
        """M > the largest tile: per vector of a panel (the threads share the (panel, vector)
        pairs), full tiles, then the rest as one exact tile."""
        m, largest, vectors = self.params.m, self.dot.max_rows, self.shape.vectors
        full = (m // largest) * largest
        with T.parallel(0, self.shape.panels * vectors) as unit:
            p, v = unit // vectors, unit % vectors
            with T.serial(0, m // largest) as mo:
                self.in_registers(_Sweep(p, v, 1, largest, mo * largest))
            rest = list(range(1, largest))
            _chain(m - full, rest, lambda r: self.in_registers(_Sweep(p, v, 1, r, full)))

    def in_registers(self, sweep: _Sweep) -> None:
        """``sweep`` over all groups, its accumulators in registers."""
        lanes, width, rows = self.shape.lanes, sweep.width, sweep.rows
        acc = _Accumulators.alloc(rows, width, lanes)
        acc.clear()
        if self.shape.sub_scaled:
            self.super_groups(sweep, acc)
        else:
            with T.serial(0, self.shape.groups) as g:
                self.each_vector(
                    sweep, g, lambda i, ahead: self.group_terms(sweep, g, i, acc, ahead)
                )
        for r in range(rows):
            for i in range(width):
                column = T.ramp(
                    sweep.panel * self.shape.panel_rows + (sweep.first + i) * lanes, 1, lanes
                )
                T.buffer_store(self.params.out, acc.load(r, i), [sweep.base + r, column])

    def group_terms(
        self, sweep: _Sweep, g: _Index, i: int, acc: _Accumulators, ahead: list[list]
    ) -> None:
        """Adds group g of the sweep's vector i, times its rows, to slot i of their
        accumulators: the group's code vectors are loaded and decoded once for all the rows,
        and dotted with each activation group of the rows apart (``_Shape.split``).
        ``ahead[r]``: the prefetches to ask for beside row r's epilogue."""
        lanes, xs, xsum, split = (
            self.shape.lanes,
            self.params.xs,
            self.params.xsum,
            self.shape.split,
        )
        p, base = sweep.panel, sweep.base
        lane0 = (sweep.first + i) * lanes
        parts = self.group_parts(p, g, lane0)
        scale, offset = self.scale_offset(p, g, lane0)
        scale = T.Bind(scale)
        offset = T.Bind(offset) if offset is not None else None
        scaled = self.shape.scaled
        sums = []  # [activation group][row]
        for h in range(split):
            a = g * split + h
            starts = [
                tirx.Broadcast(xsum[base + r, a] if self.fmt.zero else T.int32(0), lanes)
                for r in range(sweep.rows)
            ]
            mine = [
                (c, g * self.fmt.group_size + col, w) for c, col, w in parts if col // scaled == h
            ]
            words = [
                [(c, self.x_word(base + r, col), w) for c, col, w in mine]
                for r in range(sweep.rows)
            ]
            sums.append(self.dot.accumulate(starts, words, self.fmt.bits))
        for r in range(sweep.rows):
            for call in ahead[r]:
                T.evaluate(call)
            row = base + r
            # sum over h of ints_h * xscale_h, then times the weights' scale: one multiply-add
            # into the accumulator, one per further activation group.
            dots = [T.Cast(self.dot.f32, sums[h][r]) for h in range(split)]
            xscales = [tirx.Broadcast(xs[row, g * split + h], lanes) for h in range(split)]
            scaled_dots = dots[-1] * xscales[-1]
            for h in reversed(range(split - 1)):
                scaled_dots = self.dot.fma(dots[h], xscales[h], scaled_dots)
            value = self.dot.fma(scaled_dots, scale, acc.load(r, i))
            if offset is not None:
                value = self.dot.fma(offset, tirx.Broadcast(xsum[row, g], lanes), value)
            acc.store(r, i, value)

    def each_vector(self, sweep: _Sweep, g: _Index, add: Callable[[int, list[list]], None]) -> None:
        """``add(i, ahead)`` for each vector i of the sweep at group g, ``ahead[r]`` the
        prefetches to ask for beside row r's work: the group's asks spread over the sweep."""
        rows = sweep.rows
        asks = _spread(self.prefetches(sweep, g), sweep.width * rows)
        for i in range(sweep.width):
            add(i, asks[i * rows : (i + 1) * rows])

    def super_groups(self, sweep: _Sweep, acc: _Accumulators) -> None:
        """A ``sub_scaled`` sweep: per super-group, each row's exact int32 sum over its groups
        of scale x dot x 2^shift (``group_integers``), then one float epilogue with the term of
        the codes' sums (``code_sum_terms``): acc += (sum x d + term x dmin) x xscale, or with
        a zero point (sum - zero x term) x d x xscale."""
        fmt, lanes, rows, width = self.fmt, self.shape.lanes, sweep.rows, sweep.width
        p, per_super = sweep.panel, fmt.super_group // fmt.group_size
        dots = _Accumulators.alloc(rows, width, lanes, "int32")
        with T.serial(0, self.shape.groups // per_super) as s:
            dots.clear()
            with T.serial(0, per_super) as h:
                g = s * per_super + h
                self.each_vector(
                    sweep, g, lambda i, ahead: self.group_integers(sweep, g, i, dots, ahead)
                )
            for i in range(width):
                lane0 = (sweep.first + i) * lanes
                d = T.Bind(self.widened(self.params.super_scales, [p, s, lane0]))
                dmin = None
                if self.params.super_offsets is not None:
                    dmin = T.Bind(self.widened(self.params.super_offsets, [p, s, lane0]))
                terms = self.code_sum_terms(sweep, s, lane0)
                for r in range(rows):
                    xscale = tirx.Broadcast(self.params.xs[sweep.base + r, s], lanes)
                    total = dots.load(r, i)
                    if fmt.zero:
                        total = total - terms[r] * self.dot.i32_const(fmt.zero)
                    value = self.dot.fma(T.Cast(self.dot.f32, total), d * xscale, acc.load(r, i))
                    if dmin is not None:
                        value = self.dot.fma(T.Cast(self.dot.f32, terms[r]), dmin * xscale, value)
                    acc.store(r, i, value)

    def group_integers(
        self, sweep: _Sweep, g: _Index, i: int, dots: _Accumulators, ahead: list[list]
    ) -> None:
        """Adds group g of the sweep's vector i to slot i of its rows' int32 sums: vpmaddwd
        weights the rows' pair sums by the group's scale (``IntegerDot.accumulate``), and the
        row's shift (``sub_scaled_quantize_func``) follows. ``ahead[r]``: prefetches beside row
        r's."""
        lanes, params, fmt = self.shape.lanes, self.params, self.fmt
        p, base = sweep.panel, sweep.base
        lane0 = (sweep.first + i) * lanes
        parts = self.group_parts(p, g, lane0)
        pairs = T.Bind(self.dot.int16_pairs(self.small_integers(params.scales, p, g, lane0)))
        words = [
            [(c, self.x_word(base + r, g * fmt.group_size + col), w) for c, col, w in parts]
            for r in range(sweep.rows)
        ]
        zeros = [self.dot.i32_const(0)] * sweep.rows
        sums = self.dot.accumulate(zeros, words, fmt.bits, pairs)
        for r in range(sweep.rows):
            for call in ahead[r]:
                T.evaluate(call)
            shift = tirx.Broadcast(params.xshift[base + r, g], lanes)
            dots.store(r, i, dots.load(r, i) + T.shift_left(sums[r], shift))

    def code_sum_terms(self, sweep: _Sweep, s: _Index, lane0: _Index) -> list:
        """Per row, the sum over super-group s's groups of offset (or scale, with a zero point)
        x the row's code sum x 2^shift: vpmaddwd takes two groups at a time, their integers
        interleaved in each lane against the row's two sums as one int32, once per super-group
        rather than once per group in the loop carrying the dots."""
        params, per_super = self.params, self.fmt.super_group // self.fmt.group_size
        small = params.offsets if params.offsets is not None else params.scales
        first = s * per_super
        factors = []
        for j in range(0, per_super, 2):
            low, high = (
                self.small_integers(small, sweep.panel, first + j + t, lane0) for t in (0, 1)
            )
            factors.append(T.Bind(self.dot.int16_pairs(low, high)))
        terms = []
        for r in range(sweep.rows):
            total = None
            for t, factor in enumerate(factors):
                sums = T.reinterpret(
                    "int32", params.xsum.vload([sweep.base + r, first + 2 * t], "int16x2")
                )
                both = tirx.Broadcast(sums, self.shape.lanes)
                term = self.dot.madd(factor, T.reinterpret(f"int16x{2 * self.shape.lanes}", both))
                total = term if total is None else total + term
            terms.append(T.Bind(total))
        return terms

    def small_integers(self, buffer: tirx.Buffer, p: _Index, g: _Index, lane0: _Index):
        """A two-level format's group integers (scales or offsets) of group g, as int32 lanes."""
        dtype = f"{np.dtype(self.fmt.group_type)}x{self.shape.lanes}"
        return T.Cast(self.dot.i32, buffer.vload([p, g, lane0], dtype))

    def prefetches(self, sweep: _Sweep, g: _Index) -> list:
        """Calls asking for the lines that this sweep reads ``_PREFETCH_L2_BYTES`` of codes on
        from group g's (into L2) and ``_PREFETCH_L1_BYTES`` on (into L1), alternating. The
        hardware prefetchers stop at 4 KB pages and fall behind once several rows' arithmetic
        runs between the loads; past the last group the address lies in the next panel or past
        the buffer, where a prefetch does nothing."""
        into_l2 = self._prefetch(sweep, g, _PREFETCH_L2_BYTES, 2)
        into_l1 = self._prefetch(sweep, g, _PREFETCH_L1_BYTES, 3)
        return [call for pair in zip(into_l2, into_l1, strict=True) for call in pair]

    def _prefetch(self, sweep: _Sweep, g: _Index, distance: int, locality: int) -> list:
        """Prefetches (read, into cache level ``locality``: 3 L1, 2 L2, data) of the group
        ``distance`` code bytes of this sweep ahead: one line per word and vector, then the
        lines of the same group's scales and offsets and of a two-level format's super-group
        scales and offsets, separate streams. A panel reads few super-groups (6 for 1,536
        columns), too short a stream for the hardware prefetchers to follow: unasked, each was
        a miss that the arithmetic waited for (docs/kernels.md)."""
        lanes, words = self.shape.lanes, self.shape.words
        codes, scales, offsets = self.params.codes, self.params.scales, self.params.offsets
        p, first, width = sweep.panel, sweep.first, sweep.width
        ahead = -(-distance // (words * width * lanes * 4))
        lines = [
            codes[p, (g + ahead) * words + w, (first + i) * lanes]
            for i in range(width)
            for w in range(words)
        ]
        per_super = self.fmt.super_group // self.fmt.group_size if self.fmt.super_group else 1
        super_scales, super_offsets = self.params.super_scales, self.params.super_offsets
        for buffer, index in (
            (scales, g + ahead),
            (offsets, g + ahead),
            (super_scales, (g + ahead) // per_super),
            (super_offsets, (g + ahead) // per_super),
        ):
            if buffer is None:
                continue
            step = max(1, _CACHE_LINE_BYTES // np.dtype(str(buffer.dtype)).itemsize)
            lines += [
                buffer[p, index, first * lanes + lane] for lane in range(0, width * lanes, step)
            ]
        return [
            T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(line), 0, locality, 1)
            for line in lines
        ]

    def group_parts(self, p: _Index, g: _Index, lane0: _Index) -> list[tuple]:
        """The decoded code vectors of group g, lanes from ``lane0``, with the column of their
        first activation in the group and their weight."""
        lanes, words, codes = self.shape.lanes, self.shape.words, self.params.codes
        loaded = [
            T.Bind(
                T.reinterpret(
                    self.dot.i32, codes.vload([p, g * words + w, lane0], f"uint32x{lanes}")
                )
            )
            for w in range(words)
        ]
        return self.dot.decode(loaded, self.fmt.bits)

    def scale_offset(self, p: _Index, g: _Index, lane0: _Index) -> tuple:
        """Group g's scale and offset (None if symmetric) vectors, lanes from ``lane0``: loaded,
        or for a two-level format multiplied from its integers and its super-group's float16,
        widened (exact products: the one-level format's values)."""
        params, fmt = self.params, self.fmt
        if not fmt.super_group:
            offset = (
                self.widened(params.offsets, [p, g, lane0]) if params.offsets is not None else None
            )
            return self.widened(params.scales, [p, g, lane0]), offset
        s = g // (fmt.super_group // fmt.group_size)

        def times(supers: tirx.Buffer, small: tirx.Buffer) -> tirx.Expr:
            return self.widened(supers, [p, s, lane0]) * self.widened(small, [p, g, lane0])

        scale = times(params.super_scales, params.scales)
        if params.offsets is None:
            return scale, None
        return scale, times(params.super_offsets, params.offsets)

    def widened(self, buffer: tirx.Buffer, index: list) -> tirx.Expr:
        """One vector of float32 lanes from ``buffer``, converted from its type (float16 and
        small integers convert exactly)."""
        dtype = str(buffer.dtype)
        if dtype == "float32":
            return buffer.vload(index, self.dot.f32)
        return T.Cast(self.dot.f32, buffer.vload(index, f"{dtype}x{self.shape.lanes}"))

    def x_word(self, row: _Index, column: _Index) -> tirx.Expr:
        """4 activation codes from ``column`` on, as one int32."""
        return T.reinterpret("int32", self.params.xq.vload([row, column], "int8x4"))


@dataclass(frozen=True)
class _Sweep:
    """Rows base .. base + rows - 1 (all valid) times ``width`` vectors of ``panel`` from
    vector ``first`` on."""

    panel: _Index
    first: _Index
    width: int
    rows: int
    base: _Index


def _chain(value: tirx.Expr, cases: list[int], body: Callable[[int], None]) -> None:
    """if value == cases[0]: body(cases[0]) elif ...: one branch per case."""
    if not cases:
        return
    with T.If(value == cases[0]):
        with T.Then():
            body(cases[0])
        if len(cases) > 1:
            with T.Else():
                _chain(value, cases[1:], body)
