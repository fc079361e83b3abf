"""The int8-activation matmul (``--activations int8``) against a numpy reference of the same
activation quantization and integer dot product, for every group format, every row tile and
every integer-dot instruction set this CPU runs; and the instructions LLVM emits for them."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from mlc_spec.compiler import int8_matmul
from mlc_spec.compiler.int8_matmul import (
    Int8Matmul,
    activation_group,
    integer_dot,
    matmul_func,
    sub_scaled,
)
from mlc_spec.compiler.pipeline import relax_pipeline
from mlc_spec.compiler.quantization import (
    GroupFormat,
    QuantizedTensor,
    pack_codes,
    to_portable,
    unpack_codes,
)
from mlc_spec.compiler.targets import make_target, vector_features
from mlc_spec.models.quantized import QuantizedLinear, to_panels

N, K = 128, 512  # two panels of 64 rows; 16 groups of 32, 2 super-groups of 256
# The formats only this kernel reads, after two that are neither; the first four beside
# portable twins (each its own layer, as two share q8g32). The f16-scale ones differ from
# their float32 form only by an exact conversion, so the reference alone checks them.
INT8_ONLY = [
    GroupFormat(4, 32, True, 256),
    GroupFormat(6, 16, super_group=256),
    GroupFormat(5, 32, half_scales=True),
    GroupFormat(5, 32, True, half_scales=True),
    GroupFormat(8, 32, half_scales=True),
    GroupFormat(4, 32, True, half_scales=True),
]
TWINNED = INT8_ONLY[:4]
FORMATS = [GroupFormat(4, 32), GroupFormat(8, 16, True), *INT8_ONLY]
FORMATS += [f.portable for f in TWINNED]
# (int8-only, its twin) layer indices.
PAIRS = [(2 + i, 2 + len(INT8_ONLY) + i) for i in range(len(TWINNED))]
# A twin is read with its int8-only format's activation groups, so that the two must agree bit
# for bit: a two-level Q4_K rounds per 32 where a one-level q4g32a (as from Q4_1) rounds per 16.
# Compiled models never read a twin with int8 activations (they keep the int8-only formats).
TWIN_GROUPS = {f.portable: activation_group(f) for f in TWINNED}
# Every exact pass (1..8 rows; Intel VNNI 1..9) and full passes with every rest.
ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 16, 40)
# The instruction sets named in the tests: AVX2 (vpmaddubsw), AVX-512BW (vpmaddubsw, 16 lanes).
NAMED_CPUS = ("x86-64-v3", "x86-64-v4")


def quantize_rows(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's activation quantization in numpy float32: per row and group, codes
    nearbyint(x * (127 / amax)) and scale amax / 127."""
    m, k = x.shape
    g = x.reshape(m, k // group, group)
    amax = np.abs(g).max(-1)
    inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    return np.rint(g * inv[..., None]).astype(np.int64), amax / np.float32(127)


def sub_scaled_rows(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """``quantize_rows`` as ``sub_scaled_quantize_func`` rounds before a two-level format: per
    256 values one amax, per group the scale amax / 127 halved e <= 3 times, e the most that
    keeps the group's codes within 127."""
    m, k = x.shape
    g = x.reshape(m, k // 256, 256 // group, group)
    amax_g = np.abs(g).max(-1)
    amax = amax_g.max(-1, keepdims=True)
    e = sum((amax_g * np.float32(1 << t) <= amax).astype(np.int32) for t in (1, 2, 3))
    inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    power = np.float32(2) ** e.astype(np.float32)
    codes = np.rint(g * (inv * power)[..., None]).astype(np.int64)
    scales = (amax / np.float32(127)) / power
    return codes.reshape(m, k // group, group), scales.reshape(m, k // group)


def reference(x: np.ndarray, w: QuantizedTensor, group: int, sub_scaled: bool) -> np.ndarray:
    """x @ W.T with x quantized as the kernel does it, per activation group of ``group``
    values (``sub_scaled``: as ``sub_scaled_rows``): exact integer dots per activation group,
    then (acc - zero * sum(xq)) * scale * xscale (+ offset * xscale * sum(xq)), in float64."""
    w = to_portable(w)
    fmt = w.fmt
    q, xs = sub_scaled_rows(x, group) if sub_scaled else quantize_rows(x, group)
    n, k = w.shape
    codes = unpack_codes(w.codes, fmt.bits).astype(np.int64).reshape(n, -1, group)
    acc = np.einsum("mgj,ngj->mng", q, codes)
    xsum = q.sum(-1)[:, None, :]
    split = fmt.group_size // group
    scales = np.repeat(w.scales.astype(np.float64), split, axis=1)
    term = (acc - fmt.zero * xsum) * scales * xs[:, None, :]
    if fmt.asymmetric:
        offsets = np.repeat(w.offsets.astype(np.float64), split, axis=1)
        term = term + offsets * xs[:, None, :] * xsum
    return term.sum(-1)


def _weight(fmt: GroupFormat, rng: np.random.Generator) -> QuantizedTensor:
    groups = (N, K // fmt.group_size)
    codes = rng.integers(0, 1 << fmt.bits, (N, K))
    codes[0] = (1 << fmt.bits) - 1  # with an all-ones input row: int16 sums at their largest
    if fmt.super_group:  # as Q4_K (6-bit sc, m) and Q6_K (int8 sc): integers under f16 values
        shape, parts = (N, K // fmt.super_group), 2 if fmt.asymmetric else 1
        f16 = [rng.uniform(-0.01, 0.01, shape).astype(np.float16) for _ in range(parts)]
        low, high = (0, 64) if fmt.asymmetric else (-128, 128)
        small = [rng.integers(low, high, groups).astype(fmt.group_type) for _ in range(parts)]
        names = ["scales", "offsets"][:parts] + ["super_scales", "super_offsets"][:parts]
        arrays = dict(zip(names, small + f16, strict=True))
        return QuantizedTensor(fmt, pack_codes(codes, fmt.bits), **arrays)
    scales = rng.uniform(0.01, 0.1, groups).astype(fmt.group_type)
    offsets = rng.normal(0, 0.2, groups).astype(fmt.group_type) if fmt.asymmetric else None
    return QuantizedTensor(fmt, pack_codes(codes, fmt.bits), scales, offsets)


class _Linears(nn.Module):
    """One quantized linear layer per format over the same input, outputs side by side."""

    def __init__(self, target: tvm.target.Target):
        kernel = Int8Matmul(target)
        self.layers = nn.ModuleList(
            [QuantizedLinear(nn.Linear(K, N, bias=False), fmt, kernel) for fmt in FORMATS]
        )

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        return op.concat([layer(x) for layer in self.layers], dim=-1)


def _inputs(rows: int, rng: np.random.Generator) -> np.ndarray:
    x = rng.normal(0, 1, (rows, K)).astype(np.float32)
    x[0, :32] = 0  # an all-zero group: scale 0
    x[1:-1] = 1  # activation codes all 127, where rows allow (the largest dots, above)
    x[-1, 40] = 50  # an outlier: the rest of its group rounds to few levels
    return x


# x86-64-v4 runs vpmaddubsw as x86-64-v3 does, on wider vectors; its instructions are checked
# by default (test_integer_dot_instructions_are_emitted), its numbers (40 s) with the heavy
# tests, or as native's on an AVX-512 CPU without VNNI.
@pytest.mark.parametrize(
    "cpu", ["native", "x86-64-v3", pytest.param("x86-64-v4", marks=pytest.mark.heavy)]
)
def test_int8_matmul_matches_numpy(cpu, monkeypatch):
    """native: VNNI where this CPU has it; x86-64-v3: AVX2 vpmaddubsw; x86-64-v4: AVX-512BW."""
    own = int8_matmul.activation_group
    monkeypatch.setattr(int8_matmul, "activation_group", lambda f: TWIN_GROUPS.get(f) or own(f))
    groups = [int8_matmul.activation_group(f) for f in FORMATS]
    target = make_target("llvm", cpu=cpu)
    if not set(vector_features(target)) <= set(vector_features(make_target("llvm"))):
        pytest.skip(f"this CPU cannot run {cpu} code")
    if cpu == "native":
        named = [
            c for c in NAMED_CPUS if integer_dot(make_target("llvm", cpu=c)) == integer_dot(target)
        ]
        if "x86-64-v3" in named:  # AVX2 alone: the same kernel as that run's
            pytest.skip("this CPU's integer dot product is x86-64-v3's")
    rng = np.random.default_rng(0)
    weights = [_weight(fmt, rng) for fmt in FORMATS]
    dot = integer_dot(target)
    integer = [sub_scaled(dot, fmt) for fmt in FORMATS]
    # Each weight only this kernel reads, in its portable format: equal outputs, bit for bit,
    # where both round activations alike (a sub-scaled two-level format does not).
    pairs = [(two, one) for two, one in PAIRS if not integer[two]]
    for two, one in PAIRS:
        weights[one] = to_portable(weights[two])
    mod, _ = _Linears(target).export_tvm(
        spec={"forward": {"x": nn.spec.Tensor(["m", K], "float32")}}
    )
    vm = relax.VirtualMachine(
        tvm.compile(mod, target=target, relax_pipeline=relax_pipeline(target, "float32")),
        tvm.cpu(),
    )
    params = [tvm.runtime.tensor(to_panels(t)) for w in weights for t in w.arrays().values()]
    for rows in ROWS:
        x = _inputs(rows, rng)
        out = vm["forward"](tvm.runtime.tensor(x), *params).numpy()
        ref = np.concatenate(
            [reference(x, *case) for case in zip(weights, groups, integer, strict=True)], axis=-1
        )
        np.testing.assert_allclose(out, ref, rtol=0, atol=2e-6 * np.abs(ref).max(), err_msg=rows)
        outs = out.reshape(rows, len(FORMATS), N)
        for two, one in pairs:
            np.testing.assert_array_equal(outs[:, two], outs[:, one], err_msg=rows)


@pytest.mark.parametrize(
    ("cpu", "instruction"),
    [("native", "vpdpbusd"), ("x86-64-v3", "vpmaddubsw"), ("x86-64-v4", "vpmaddubsw")],
)
def test_integer_dot_instructions_are_emitted(cpu, instruction):
    target = make_target("llvm", cpu=cpu)
    if cpu == "native" and "avx512vnni" not in tvm.target.codegen.llvm_get_cpu_features(target):
        pytest.skip("this CPU has no AVX-512 VNNI")
    # One format per decoding: nibbles, bytes, and a high-bit plane.
    for fmt in (GroupFormat(4, 32, True), GroupFormat(8, 16), GroupFormat(5, 32, half_scales=True)):
        func = matmul_func(integer_dot(target), fmt, N, K, 64).with_attr("global_symbol", "main")
        asm = tvm.compile(tvm.IRModule({"main": func}), target=target).mod.inspect_source("asm")
        assert instruction in asm, fmt.name


@pytest.mark.parametrize(
    ("cpu", "wide"), [("znver4", False), ("znver5", True), ("icelake-server", True)]
)
def test_only_zen4_keeps_the_narrow_avx512_sweeps(cpu, wide):
    """Zen 4 runs a 512-bit operation in two halves; the Xeon and Zen 5 (full width) take all 4
    vectors of a panel per sweep, in passes of up to 9 rows (docs/kernels.md)."""
    dot = integer_dot(make_target("llvm", cpu=cpu))
    assert dot.vnni and (dot.widths, dot.max_rows) == (((4,) * 9, 9) if wide else ((4, 4, 4, 2), 8))
