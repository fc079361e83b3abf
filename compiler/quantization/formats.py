"""The one group-quantized weight format of the compiler and models, in plain numpy.

A weight matrix [N, K] (N output rows, K the reduction axis) is stored as unsigned integer codes
of 4 or 8 bits packed into uint32 words, one float32 scale per group of ``group_size``
consecutive weights of a row and, for asymmetric formats, one float32 offset per group:

    w[n, k] = scale[n, g] * (c - zero)            symmetric, zero = 2**(bits - 1)
    w[n, k] = scale[n, g] * c + offset[n, g]      asymmetric, zero = 0

with g = k // group_size, computed in float32 in exactly that order. Every GGUF type that
``gguf_blocks`` maps loads into this rule without re-quantization, and the kernels decode the
same expression, so numpy, GGUF and the compiled model agree value for value.

GGUF's one-level types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) store their scale and minimum as
float16; formats with ``half_scales`` (named e.g. ``q8g32h``) keep them so, as the int8 kernel
reads them: 8.5 bits per 8-bit weight instead of 9, 5 per asymmetric 4-bit one instead of 6.

*Two-level* formats (``super_group`` > 0, named e.g. ``q4g32as256``; GGUF's Q4_K) store the
group scale and offset as small integers (uint8) under one float16 pair per super-group of
``super_group`` weights, as GGUF does:

    scale[n, g] = super_scale[n, s] * sc[n, g]     offset[n, g] = super_offset[n, s] * m[n, g]

with s = k // super_group, in float32: 4.625 bits per 4-bit weight instead of 6. GGUF's Q6_K
is the symmetric two-level ``q6g16s256``: 6-bit codes, int8 scales per 16 under one float16
per 256, 6.5625 bits per weight instead of the 10 of ``q8g16``. For GGUF's values (an f16 times an
integer below 2**8, times a code below 2**6) every product is exact in float32, so the weight
rounds once, at the sum, however a kernel orders or fuses these multiplications.

5- and 6-bit codes (GGUF's Q5_0/Q5_1 as ``q5g32``/``q5g32a``, Q6_K) are read by the int8
kernel only; every format has a *portable* one (``GroupFormat.portable``: one level, 4- or
8-bit codes) that every kernel reads and that ``to_portable`` converts to, value for value.
Their codes are stored in blocks of 32 / (bits - 4) codes: the low nibbles, packed as 4-bit
codes, then one word of the high bits, ordered for the int8 kernel: the highs of code
8w + 2b + o (w-th nibble word, byte b, o = 0 for the low nibble) sit at bit
8b + (bits - 4)(2w + o), so one shift and mask put the highs of the 4 codes that one nibble
mask extracts (even or odd k of a word) into byte b of a vector lane.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mlc_spec.models.quantized import SUPER_TYPE, codes_per_block, high_bit

# Rows per chunk when quantizing, so temporaries stay a few MB whatever the matrix size.
_CHUNK_ELEMENTS = 1 << 22


# Super-group sizes of two-level formats (GGUF's K-type super-block).
_SUPER_GROUPS = (256,)
# The two-level formats: (bits, group size, asymmetric) -> the type of their group integers
# (GGUF's Q4_K, and Q6_K with its signed sub-scales).
_TWO_LEVEL = {(4, 32, True): np.uint8, (6, 16, False): np.int8}


@dataclass(frozen=True)
class GroupFormat:
    """Code width, group size, whether groups carry an offset and, for a two-level format, the
    super-group size (0: one level); named like ``q4g32a`` or ``q4g32as256``."""

    bits: int
    group_size: int
    asymmetric: bool = False
    super_group: int = 0
    half_scales: bool = False

    def __post_init__(self) -> None:
        if self.bits not in (4, 5, 6, 8):
            raise ValueError(f"code width must be 4, 5, 6 or 8 bits, got {self.bits}")
        if self.group_size not in (16, 32):
            raise ValueError(f"group size must be 16 or 32, got {self.group_size}")
        kind = (self.bits, self.group_size, self.asymmetric)
        if self.super_group and (self.super_group not in _SUPER_GROUPS or kind not in _TWO_LEVEL):
            raise ValueError(f"two-level formats are q4g32as256 and q6g16s256; got {self.name}")
        if self.bits == 6 and not self.super_group:
            raise ValueError("6-bit codes exist only in the two-level format q6g16s256")
        if self.bits == 5 and self.group_size != 32:
            raise ValueError(f"5-bit codes come in groups of 32; got {self.name}")
        if self.half_scales and self.super_group:
            raise ValueError(f"float16 group scales are for one-level formats; got {self.name}")

    @property
    def group_type(self) -> type:
        """The numpy type of the stored group scales (and offsets)."""
        if self.super_group:
            return _TWO_LEVEL[(self.bits, self.group_size, self.asymmetric)]
        return np.float16 if self.half_scales else np.float32

    @property
    def name(self) -> str:
        two_level = f"s{self.super_group}" if self.super_group else ""
        half = "h" if self.half_scales else ""
        return f"q{self.bits}g{self.group_size}{'a' if self.asymmetric else ''}{two_level}{half}"

    @property
    def portable(self) -> GroupFormat:
        """The format every kernel reads that holds the same values: per-group scales and
        offsets as float32 (float16 ones widened), 5- and 6-bit codes widened to 8."""
        return GroupFormat(4 if self.bits == 4 else 8, self.group_size, self.asymmetric)

    @property
    def zero(self) -> int:
        """The code that decodes to zero in a symmetric format (0 when offsets do that job)."""
        return 0 if self.asymmetric else 1 << (self.bits - 1)

    @classmethod
    def parse(cls, name: str) -> GroupFormat:
        match = re.fullmatch(r"q(\d+)g(\d+)(a?)(?:s(\d+))?(h?)", name)
        if match is None:
            raise ValueError(
                f"not a group format name: {name!r} (expected e.g. q4g32, q8g16a, q4g32as256, "
                "q8g32h)"
            )
        return cls(int(match[1]), int(match[2]), bool(match[3]), int(match[4] or 0), bool(match[5]))


def _check_width(shape: tuple[int, ...], multiple: int, why: str) -> None:
    if len(shape) != 2:
        raise ValueError(f"a quantized weight must be 2-D [N, K], got shape {shape}")
    if shape[1] == 0 or shape[1] % multiple:
        raise ValueError(f"shape {shape}: the row length must be a positive multiple of {why}")


def _check_format_width(shape: tuple[int, ...], fmt: GroupFormat) -> None:
    multiple = max(fmt.group_size, codes_per_block(fmt.bits), fmt.super_group)
    _check_width(shape, multiple, f"{multiple} for {fmt.name}")


@dataclass(frozen=True)
class QuantizedTensor:
    """A [N, K] weight in ``fmt``: packed ``codes`` uint32 [N, K*bits/32], ``scales``
    [N, K/group_size] of ``fmt.group_type`` (float32, or float16 with ``half_scales``) and
    ``offsets`` like ``scales`` when ``fmt.asymmetric``, else None. Two-level: ``scales`` and
    ``offsets`` are small integers and ``super_scales`` / ``super_offsets`` (asymmetric only)
    float16 [N, K/super_group] (None in one-level formats)."""

    fmt: GroupFormat
    codes: np.ndarray
    scales: np.ndarray
    offsets: np.ndarray | None = None
    super_scales: np.ndarray | None = None
    super_offsets: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.codes.dtype != np.uint32 or self.codes.ndim != 2:
            raise ValueError(f"codes must be a 2-D uint32 array, got {self.codes.dtype}")
        _check_format_width(self.shape, self.fmt)
        n, k = self.shape
        groups = (n, k // self.fmt.group_size)
        group_type = self.fmt.group_type
        expected = {"scales": (groups, group_type)}
        if self.fmt.asymmetric:
            expected["offsets"] = (groups, group_type)
        if self.fmt.super_group:
            supers = (n, k // self.fmt.super_group)
            expected["super_scales"] = (supers, np.dtype(SUPER_TYPE))
            if self.fmt.asymmetric:
                expected["super_offsets"] = (supers, np.dtype(SUPER_TYPE))
        given = self.arrays()
        del given["codes"]
        if set(given) != set(expected):
            raise ValueError(
                f"{self.fmt.name} tensor needs exactly {', '.join(expected)}, "
                f"got {', '.join(given)}"
            )
        for what, (shape, dtype) in expected.items():
            if given[what].dtype != dtype or given[what].shape != shape:
                raise ValueError(
                    f"{self.fmt.name} tensor of shape {self.shape} needs {np.dtype(dtype)} {what} "
                    f"of shape {shape}, got {given[what].dtype} {given[what].shape}"
                )

    @property
    def shape(self) -> tuple[int, int]:
        return (self.codes.shape[0], self.codes.shape[1] * 32 // self.fmt.bits)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays().values())

    def arrays(self) -> dict[str, np.ndarray]:
        """The stored arrays by field name (each [N, X], row-major), those this format has."""
        fields = ("codes", "scales", "offsets", "super_scales", "super_offsets")
        return {f: getattr(self, f) for f in fields if getattr(self, f) is not None}


def _nibble_bytes(codes: np.ndarray) -> np.ndarray:
    """Codes below 16 [..., 2j] -> bytes [..., j]: even k in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << np.uint8(4))


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """Inverse of ``_nibble_bytes``."""
    codes = np.empty((*packed.shape[:-1], packed.shape[-1] * 2), dtype=np.uint8)
    codes[..., 0::2] = packed & np.uint8(0x0F)
    codes[..., 1::2] = packed >> np.uint8(4)
    return codes


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack codes [N, K] (0 <= c < 2**bits) into uint32 words [N, K*bits/32], little-endian
    along k: code k sits in word k // (32/bits) at bit (k % (32/bits)) * bits; 5- and 6-bit
    codes in blocks of nibble words and a word of highs (the module docstring)."""
    codes = np.asarray(codes)
    if bits not in (4, 5, 6, 8):
        raise ValueError(f"code width must be 4, 5, 6 or 8 bits, got {bits}")
    block = codes_per_block(bits)
    _check_width(codes.shape, block, f"{block} codes")
    if codes.size and (codes.min() < 0 or codes.max() >= 1 << bits):
        raise ValueError(f"codes must lie in [0, {(1 << bits) - 1}] for {bits}-bit packing")
    packed = codes.astype(np.uint8)
    if bits == 4:
        packed = _nibble_bytes(packed)
    elif bits != 8:
        blocks = packed.reshape(len(packed), -1, block)
        shifts = np.array([high_bit(bits, j) for j in range(block)], np.uint32)
        highs = (blocks >> np.uint8(4)).astype(np.uint32) << shifts
        high_word = np.bitwise_or.reduce(highs, axis=-1).astype("<u4")[..., None]
        low = _nibble_bytes(blocks & np.uint8(0x0F))
        packed = np.concatenate([low, high_word.view(np.uint8)], axis=-1).reshape(len(packed), -1)
    # Bytes in little-endian order within a word are exactly the layout above.
    return np.ascontiguousarray(packed).view("<u4").astype(np.uint32, copy=False)


def unpack_codes(words: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of ``pack_codes``: uint8 codes [N, K]."""
    words = np.ascontiguousarray(words, dtype=np.uint32)
    packed = words.astype("<u4", copy=False).view(np.uint8)
    if bits == 8:
        return packed.copy()
    if bits == 4:
        return _nibbles(packed)
    if bits not in (5, 6):
        raise ValueError(f"code width must be 4, 5, 6 or 8 bits, got {bits}")
    block = codes_per_block(bits)
    blocks = packed.reshape(len(packed), -1, block // 2 + 4)
    high_word = blocks[..., block // 2 :].copy().view("<u4").astype(np.uint32)
    shifts = np.array([high_bit(bits, j) for j in range(block)], np.uint32)
    highs = (high_word >> shifts) & np.uint32((1 << (bits - 4)) - 1)
    codes = _nibbles(blocks[..., : block // 2]) | (highs.astype(np.uint8) << np.uint8(4))
    return codes.reshape(len(packed), -1)


def to_portable(qt: QuantizedTensor) -> QuantizedTensor:
    """The tensor in its portable format (``GroupFormat.portable``): a two-level one's float32
    group scale and offset from its integers and super-group pair (the module docstring), 5-
    and 6-bit codes widened to 8 bits (c - zero kept); a portable one as it is."""
    fmt, portable = qt.fmt, qt.fmt.portable
    if fmt == portable:
        return qt
    scales, offsets = qt.scales, qt.offsets
    if fmt.half_scales:  # float16 -> float32 is exact
        scales = scales.astype(np.float32)
        offsets = None if offsets is None else offsets.astype(np.float32)
    if fmt.super_group:
        ratio = fmt.super_group // fmt.group_size

        def multiplied(supers: np.ndarray, small: np.ndarray) -> np.ndarray:
            return np.repeat(supers.astype(np.float32), ratio, axis=1) * small.astype(np.float32)

        scales = multiplied(qt.super_scales, qt.scales)
        offsets = None if qt.offsets is None else multiplied(qt.super_offsets, qt.offsets)
    codes = qt.codes
    if portable.bits != fmt.bits:  # widened a chunk of rows at a time: few-MB temporaries

        def widened(words: np.ndarray) -> np.ndarray:
            signed = unpack_codes(words, fmt.bits).astype(np.int16) - np.int16(fmt.zero)
            return pack_codes((signed + np.int16(portable.zero)).astype(np.uint8), portable.bits)

        n, k = qt.shape
        step = max(1, _CHUNK_ELEMENTS // k)
        codes = np.empty((n, k * portable.bits // 32), np.uint32)
        for i in range(0, n, step):
            codes[i : i + step] = widened(qt.codes[i : i + step])
    return QuantizedTensor(portable, codes, scales, offsets)


def dequantize(qt: QuantizedTensor) -> np.ndarray:
    """The float32 [N, K] weights, by the decoding rule in this module's docstring."""
    qt = to_portable(qt)
    fmt = qt.fmt
    n, k = qt.shape
    codes = unpack_codes(qt.codes, fmt.bits).reshape(n, k // fmt.group_size, fmt.group_size)
    scales = qt.scales[:, :, None]
    if qt.offsets is None:
        w = scales * (codes.astype(np.float32) - np.float32(fmt.zero))
    else:
        w = scales * codes.astype(np.float32) + qt.offsets[:, :, None]
    return w.reshape(n, k)


def take_rows(qt: QuantizedTensor, rows: np.ndarray) -> QuantizedTensor:
    """The tensor made of rows ``rows`` (any 1-D integer index, in that order)."""
    rows = np.asarray(rows)
    if rows.ndim != 1 or not np.issubdtype(rows.dtype, np.integer):
        raise ValueError(f"row index must be a 1-D integer array, got {rows.dtype} {rows.shape}")
    n = qt.shape[0]
    if rows.size and (rows.min() < -n or rows.max() >= n):
        raise ValueError(f"row index out of range for a tensor of {n} rows")
    return QuantizedTensor(qt.fmt, **{f: a[rows] for f, a in qt.arrays().items()})


def dequantize_rows(qt: QuantizedTensor, rows: np.ndarray) -> np.ndarray:
    """float32 rows ``rows`` of the tensor, shaped rows.shape + (K,): the reference for an
    embedding lookup in a quantized table."""
    rows = np.asarray(rows)
    return dequantize(take_rows(qt, rows.reshape(-1))).reshape(*rows.shape, qt.shape[1])


def permute_rows(qt: QuantizedTensor, index: np.ndarray) -> QuantizedTensor:
    """Row n of the result is row ``index[n]``; ``index`` must be a permutation of range(N)
    (llama.cpp stores llama's Q/K rows interleaved per head)."""
    index = np.asarray(index)
    if index.shape != (qt.shape[0],) or not np.array_equal(np.sort(index), np.arange(len(index))):
        raise ValueError(f"index is not a permutation of the {qt.shape[0]} rows")
    return take_rows(qt, index)


def quantize_symmetric(
    w: np.ndarray, bits: int, group_size: int = 32, half_scales: bool = False
) -> QuantizedTensor:
    """Symmetric group quantization of float weights (``--quantization q4`` / ``q8``).

    Per group, scale = absmax / (2**(bits-1) - 1) (rounded to float16 with ``half_scales``,
    as GGUF's Q4_0 / Q8_0 store it) and q = clip(rint(w / scale), -2**(bits-1), 2**(bits-1) - 1)
    with rint rounding half to even; the code is q + zero. So every weight is within scale/2 of
    its decoded value (float32 rounding aside), and an all-zero group gets scale 0 and code
    ``zero``, which decodes to exact zeros.
    """
    w = np.asarray(w, dtype=np.float32)
    fmt = GroupFormat(bits, group_size, half_scales=half_scales)
    _check_format_width(w.shape, fmt)
    n, k = w.shape
    max_int = (1 << (bits - 1)) - 1
    codes = np.empty((n, k), dtype=np.uint8)
    scales = np.empty((n, k // group_size), dtype=fmt.group_type)
    step = max(1, _CHUNK_ELEMENTS // k)
    for start in range(0, n, step):
        groups = w[start : start + step].reshape(-1, k // group_size, group_size)
        if not np.isfinite(groups).all():
            raise ValueError(f"cannot quantize a weight of shape {w.shape}: it has inf or nan")
        scale = np.abs(groups).max(axis=2) / np.float32(max_int)
        scale = scale.astype(fmt.group_type).astype(np.float32)  # the scale the codes decode by
        if not np.isfinite(scale).all():
            raise ValueError(f"cannot quantize a weight of shape {w.shape}: scales overflow")
        divisor = np.where(scale == 0, np.float32(1), scale)[:, :, None]
        q = np.clip(np.rint(groups / divisor), -max_int - 1, max_int)
        codes[start : start + step] = (q + np.float32(fmt.zero)).astype(np.uint8).reshape(-1, k)
        scales[start : start + step] = scale
    return QuantizedTensor(fmt, pack_codes(codes, bits), scales)


def concat_rows(parts: Sequence[QuantizedTensor]) -> QuantizedTensor:
    """Stack ``parts``, all in one format, along rows (fused q/k/v or gate/up). Parts in
    different formats are never widened to a common one: a fused weight keeps them apart
    (``compiler/quantization/plan.py``)."""
    if not parts:
        raise ValueError("concat_rows needs at least one tensor")
    widths = {p.shape[1] for p in parts}
    if len(widths) != 1:
        raise ValueError(f"cannot stack rows of different lengths {sorted(widths)}")
    formats = sorted({p.fmt.name for p in parts})
    if len(formats) != 1:
        raise ValueError(f"cannot stack rows of different formats {formats}")
    arrays = [p.arrays() for p in parts]
    return QuantizedTensor(
        parts[0].fmt, **{f: np.concatenate([a[f] for a in arrays]) for f in arrays[0]}
    )


def describe(param: QuantizedTensor | np.ndarray) -> dict:
    """The artifact config's record of one parameter: its format (a group format name or a
    float dtype), logical shape, and the [shape, dtype] of each stored tensor."""
    if isinstance(param, QuantizedTensor):
        tensors = {f: [list(a.shape), str(a.dtype)] for f, a in param.arrays().items()}
        return {"format": param.fmt.name, "shape": list(param.shape), "tensors": tensors}
    dtype = str(param.dtype)
    return {
        "format": dtype,
        "shape": list(param.shape),
        "tensors": {"data": [list(param.shape), dtype]},
    }
