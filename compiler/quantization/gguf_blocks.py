"""GGUF tensors into the group format, exactly: no re-quantization, no float copy.

Each supported block type is a sum of groups of 32 (16 for Q6_K) weights that share a scale and,
for the ``_1`` and ``_K`` types, a minimum. K-type super-blocks carry 6- or 8-bit sub-scales;
multiplied out (``d * sc``, ``-(dmin * m)``) they are the per-group scale and offset, computed
with the same float32 operations as ``gguf.quants``, so ``dequantize(from_gguf(...))`` equals
``gguf.quants.dequantize(...)`` value for value. Q4_K and Q6_K keep them as stored instead,
in the two-level formats (Q4_K: sc and m as uint8 under d and -dmin; Q6_K: 6-bit codes, int8
sc under d), which decode to the same values; Q5_0 and Q5_1 keep their 5-bit codes, and the
one-level types their float16 scales and minimums (``half_scales``).
Block layouts follow ``gguf/quants.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .formats import GroupFormat, QuantizedTensor, pack_codes

T = GGMLQuantizationType
# Blocks decoded per step, so temporaries stay a few MB whatever the tensor size.
_CHUNK_BLOCKS = 1 << 15

# A decoder turns blocks uint8 [B, type_size] into codes uint8 [B, block_size] in element order
# and the format's other arrays per block by ``QuantizedTensor`` field: scales [B, groups per
# block], offsets likewise when asymmetric, super_scales / super_offsets [B, 1] when two-level.
_Decoded = tuple[np.ndarray, dict[str, np.ndarray]]


class UnsupportedTensorType(ValueError):
    """A GGUF tensor type with no exact mapping to the group format."""


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The f16 at byte ``start`` of each block, as stored: float16 [B, 1]."""
    return blocks[:, start : start + 2].copy().view(np.float16)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes [..., 32*j] -> codes [..., 2, 32*j]: low nibbles first, then high nibbles."""
    return np.stack([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-2)


def _scaled(codes: np.ndarray, scales: np.ndarray, offsets: np.ndarray | None = None) -> _Decoded:
    """A one-level format's decoding."""
    return codes, {"scales": scales} | ({} if offsets is None else {"offsets": offsets})


def _q4_0(blocks: np.ndarray) -> _Decoded:
    return _scaled(_nibbles(blocks[:, 2:]).reshape(len(blocks), 32), _f16(blocks, 0))


def _q4_1(blocks: np.ndarray) -> _Decoded:
    codes = _nibbles(blocks[:, 4:]).reshape(len(blocks), 32)
    return _scaled(codes, _f16(blocks, 0), _f16(blocks, 2))


def _five_bit(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1 codes 0..31: low nibbles from ``qs``, bit 4 of element i is bit i of ``qh``."""
    high = np.unpackbits(qh, axis=-1, bitorder="little")
    return _nibbles(qs).reshape(len(qs), 32) | (high << np.uint8(4))


def _q5_0(blocks: np.ndarray) -> _Decoded:
    return _scaled(_five_bit(blocks[:, 2:6], blocks[:, 6:]), _f16(blocks, 0))  # zero 16


def _q5_1(blocks: np.ndarray) -> _Decoded:
    return _scaled(_five_bit(blocks[:, 4:8], blocks[:, 8:]), _f16(blocks, 0), _f16(blocks, 2))


def _q8_0(blocks: np.ndarray) -> _Decoded:
    return _scaled(blocks[:, 2:] ^ np.uint8(0x80), _f16(blocks, 0))  # int8 q -> q + 128


def _k_scales(blocks: np.ndarray) -> dict[str, np.ndarray]:
    """Q4_K/Q5_K in two levels: the 6-bit sc and m of each 32 (from their 12 packed bytes)
    under d and -dmin."""
    packed = blocks[:, 4:16].reshape(len(blocks), 3, 4)
    d, m, m_d = packed[:, 0], packed[:, 1], packed[:, 2]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return {
        "scales": sc,
        "offsets": mins,
        "super_scales": _f16(blocks, 0),
        "super_offsets": -_f16(blocks, 2),
    }


def _q4_k(blocks: np.ndarray) -> _Decoded:
    codes = _nibbles(blocks[:, 16:].reshape(len(blocks), 4, 32)).reshape(len(blocks), 256)
    return codes, _k_scales(blocks)


def _q5_k(blocks: np.ndarray) -> _Decoded:
    low = _nibbles(blocks[:, 48:].reshape(len(blocks), 4, 32)).reshape(len(blocks), 8, 32)
    qh = blocks[:, 16:48].reshape(len(blocks), 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]
    codes = low | ((qh & np.uint8(1)) << np.uint8(4))
    k = _k_scales(blocks)  # multiplied out: two-level formats hold 4-bit codes only
    return _scaled(
        codes.reshape(len(blocks), 256),
        k["super_scales"].astype(np.float32) * k["scales"].astype(np.float32),
        k["super_offsets"].astype(np.float32) * k["offsets"].astype(np.float32),
    )


def _q6_k(blocks: np.ndarray) -> _Decoded:
    n = len(blocks)
    low = _nibbles(blocks[:, :128].reshape(n, 2, 64)).reshape(n, 8, 32)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]
    high = (blocks[:, 128:192].reshape(n, 2, 1, 32) >> shifts).reshape(n, 8, 32) & np.uint8(3)
    codes = low | (high << np.uint8(4))  # q + 32: the format's zero is 32
    sc = blocks[:, 192:208].view(np.int8)
    return codes.reshape(n, 256), {"scales": sc, "super_scales": _f16(blocks, 208)}


_DECODERS: dict[GGMLQuantizationType, tuple[GroupFormat, Callable[[np.ndarray], _Decoded]]] = {
    T.Q4_0: (GroupFormat(4, 32, half_scales=True), _q4_0),
    T.Q4_1: (GroupFormat(4, 32, asymmetric=True, half_scales=True), _q4_1),
    T.Q4_K: (GroupFormat(4, 32, asymmetric=True, super_group=256), _q4_k),
    T.Q8_0: (GroupFormat(8, 32, half_scales=True), _q8_0),
    T.Q5_0: (GroupFormat(5, 32, half_scales=True), _q5_0),
    T.Q5_1: (GroupFormat(5, 32, asymmetric=True, half_scales=True), _q5_1),
    T.Q5_K: (GroupFormat(8, 32, asymmetric=True), _q5_k),
    T.Q6_K: (GroupFormat(6, 16, super_group=256), _q6_k),
}
_FLOATS = (T.F32, T.F16, T.BF16)
SUPPORTED_TYPES = (*_DECODERS, *_FLOATS)


def format_of(ggml_type: GGMLQuantizationType | int) -> GroupFormat | None:
    """The group format a GGUF tensor type loads as; None for F32/F16/BF16 (loaded as float32).
    Raises UnsupportedTensorType, naming the type, for any other."""
    ggml_type = T(ggml_type)
    if ggml_type in _FLOATS:
        return None
    if ggml_type not in _DECODERS:
        names = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise UnsupportedTensorType(
            f"GGUF tensor type {ggml_type.name} is not supported (supported: {names})"
        )
    return _DECODERS[ggml_type][0]


def _float(raw: np.ndarray, ggml_type: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    if ggml_type == T.F32:
        return raw.view(np.float32).reshape(shape)
    if ggml_type == T.F16:
        return raw.view(np.float16).astype(np.float32).reshape(shape)
    return (raw.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32).reshape(shape)


def from_gguf(
    data: np.ndarray, ggml_type: GGMLQuantizationType | int, shape: tuple[int, ...]
) -> QuantizedTensor | np.ndarray:
    """One GGUF tensor: ``data`` as ``GGUFReader`` gives it (``tensor.data``), ``shape`` in numpy
    order (``tuple(reversed(tensor.shape))``). Quantized types give a QuantizedTensor [N, K] in
    the format above; F32/F16/BF16 give a float32 array. Raises UnsupportedTensorType for any
    other type, ValueError when ``data`` does not hold exactly ``shape``'s blocks."""
    ggml_type = T(ggml_type)
    fmt = format_of(ggml_type)
    shape = tuple(int(d) for d in shape)
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    if not shape or shape[-1] % block_size:
        raise ValueError(
            f"GGUF {ggml_type.name} tensor of shape {shape}: the row length must be a multiple "
            f"of its block size {block_size}"
        )
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    expected = int(np.prod(shape)) // block_size * type_size
    if raw.size != expected:
        raise ValueError(
            f"GGUF {ggml_type.name} tensor of shape {shape} needs {expected} bytes, "
            f"got {raw.size}: the file is truncated or corrupt"
        )
    if fmt is None:
        return _float(raw, ggml_type, shape)
    if len(shape) != 2:
        raise ValueError(f"GGUF {ggml_type.name} tensor of shape {shape}: expected 2-D [N, K]")
    decode = _DECODERS[ggml_type][1]
    n, k = shape
    blocks = raw.reshape(-1, type_size)
    words = np.empty(n * k * fmt.bits // 32, dtype=np.uint32)
    others: dict[str, list[np.ndarray]] = {}
    words_per_block = block_size * fmt.bits // 32
    for start in range(0, len(blocks), _CHUNK_BLOCKS):
        codes, arrays = decode(blocks[start : start + _CHUNK_BLOCKS])
        for field, array in arrays.items():
            others.setdefault(field, []).append(array)
        stop = start + len(codes)
        words[start * words_per_block : stop * words_per_block] = pack_codes(
            codes.reshape(1, -1), fmt.bits
        ).reshape(-1)
    return QuantizedTensor(
        fmt,
        words.reshape(n, -1),
        **{field: np.concatenate(parts).reshape(n, -1) for field, parts in others.items()},
    )
