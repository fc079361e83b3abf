"""Linear and embedding layers over weights stored in panels, quantized or float, and the model
rewrite that installs them.

A quantized weight [N, K] is stored as its integer codes packed into 32-bit words along K,
one float32 (or GGUF's float16) scale per group of ``group_size`` columns and, for asymmetric
formats, one offset per group likewise; or, in a two-level format, both as small integers
under a float16 pair per super-group (``compiler/quantization/formats.py`` defines the
formats). The layers dequantize inside the kernel that uses the weight: the matmul's TE
computes the weight from its codes, and the CPU schedule (``compiler/cpu_matmul.py``) inlines
that computation into the matmul's inner loop, so no float copy of a weight is ever written to
memory. A float weight (format ``None``) can take the same panel layout, so that on the CPU it
gets the same kernels.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

# A panel weight's parameters: a quantized one's, in the order the layers declare them, or a
# float one's single tensor.
PANEL_SUFFIXES = ("codes", "scales", "offsets", "super_scales", "super_offsets", "panels")

# The type of a two-level format's super-group scales and offsets: GGUF's own f16, exact.
SUPER_TYPE = "float16"

# Output rows per panel, the first that divides N (every Llama/Qwen2 shape takes 64).
PANEL_WIDTHS = (64, 32, 16, 8, 1)


def to_panels(array: np.ndarray) -> np.ndarray:
    """Row-major [N, X] (codes, scales or offsets of the format) -> panels [N/P, X, P]."""
    n, x = array.shape
    panel = panel_width(n)
    return np.ascontiguousarray(array.reshape(n // panel, panel, x).transpose(0, 2, 1))


class GroupFormat(Protocol):
    """What the layers need to know of a format (``compiler.quantization.GroupFormat``)."""

    bits: int
    group_size: int
    asymmetric: bool
    super_group: int

    @property
    def zero(self) -> int:
        """The code that decodes to zero in a symmetric format (0 for an asymmetric one)."""
        ...

    @property
    def group_type(self) -> type:
        """The numpy type of the stored group scales (and offsets)."""
        ...


@dataclass(frozen=True)
class Segment:
    """A run of a fused weight's rows stored in a format of its own (the source stores the
    fused parts in different formats, ``compiler.quantization.plan``)."""

    rows: int
    fmt: GroupFormat


# What ``quantize_layers`` installs for one weight: a format (None: float), or segments.
Layout = GroupFormat | None | tuple[Segment, ...]


class ActivationMatmul(Protocol):
    """Another kernel for x @ W.T with a quantized W, that quantizes x too (the compiler's
    int8-activation matmul, ``compiler/int8_matmul.py``); returns float32."""

    def __call__(self, x: nn.Tensor, weight: QuantizedWeight, name: str) -> nn.Tensor: ...


def panel_width(rows: int) -> int:
    """Output rows per panel of the stored layout (see ``QuantizedWeight``)."""
    return next((p for p in PANEL_WIDTHS if rows % p == 0), 1)


def _group_scale_offset(fmt: GroupFormat, tensors: list[te.Tensor], p, g, r) -> tuple:
    """The float32 scale and offset (None if symmetric) of group g at (panel p, row r of it):
    read, or for a two-level format multiplied from its integers and super-group pair."""
    scales = tensors[1]
    offsets = tensors[2] if fmt.asymmetric else None
    if not fmt.super_group:  # float32, or float16 widened exactly
        scale = scales[p, g, r].astype("float32")
        return scale, (offsets[p, g, r].astype("float32") if offsets is not None else None)
    super_scales = tensors[-2 if fmt.asymmetric else -1]
    s = g // (fmt.super_group // fmt.group_size)
    scale = super_scales[p, s, r].astype("float32") * scales[p, g, r].astype("float32")
    if offsets is None:
        return scale, None
    return scale, tensors[-1][p, s, r].astype("float32") * offsets[p, g, r].astype("float32")


def codes_per_block(bits: int) -> int:
    """Codes in the shortest run of whole uint32 words of a ``bits``-bit code layout: one word
    of 4- or 8-bit codes; for 5- and 6-bit codes, 32 / (bits - 4) of them stored as that many
    nibbles, then one word of their high bits (``compiler/quantization/formats.py``)."""
    return 32 // bits if bits in (4, 8) else 32 // (bits - 4)


def high_bit(bits: int, j):
    """Where the high bits of code j (an int, or a TIR expression) of a 5- or 6-bit block sit
    in the block's last word: code 8w + 2b + o (nibble word w, byte b, o = 1 for a high nibble)
    at bit 8b + (bits - 4)(2w + o)."""
    return 8 * ((j % 8) // 2) + (bits - 4) * (2 * (j // 8) + j % 2)


def _bits(word, shift, width: int):
    """``width`` bits of a uint32 ``word`` from bit ``shift`` on."""
    return (word >> shift.astype("uint32")) & tirx.const((1 << width) - 1, "uint32")


def _code_at(fmt: GroupFormat, codes: te.Tensor, p, col, r):
    """The code of column ``col`` at (panel p, row r of it), as ``pack_codes`` stores it: 5-
    and 6-bit codes in blocks of nibble words and a word of their high bits."""
    block = codes_per_block(fmt.bits)
    if fmt.bits in (4, 8):
        return _bits(codes[p, col // block, r], (col % block) * fmt.bits, fmt.bits)
    first, j = col // block * (block // 8 + 1), col % block
    low = _bits(codes[p, first + j // 8, r], (j % 8) * 4, 4)
    high = _bits(codes[p, first + block // 8, r], high_bit(fmt.bits, j), fmt.bits - 4)
    return low | (high << tirx.const(4, "uint32"))


def _weight_at(fmt: GroupFormat | None, tensors: list[te.Tensor], row, col):
    """The float32 weight at (row, col) of the logical [N, K] matrix, read from the panel
    layout; quantized ones as ``compiler.quantization.formats.dequantize`` defines it."""
    panel = tensors[0].shape[2]
    p, r = row // panel, row % panel
    if fmt is None:
        return tensors[0][p, col, r].astype("float32")
    code = _code_at(fmt, tensors[0], p, col, r).astype("float32")
    scale, offset = _group_scale_offset(fmt, tensors, p, col // fmt.group_size, r)
    if offset is not None:
        return scale * code + offset
    return scale * (code - tirx.const(float(fmt.zero), "float32"))


def quantized_matmul(
    x: nn.Tensor, weight: QuantizedWeight, out_dtype: str, name: str = "quantized_matmul"
) -> nn.Tensor:
    """x [.., m, K] @ W.T -> [.., m, N], W dequantized on the fly (or read, if float).

    Two TE stages: ``dequantize`` (the weight, elementwise) feeding ``NT_matmul`` (the
    reduction). The CPU schedule recognises that pair, inlines the first into the second and
    applies its matmul schedule, so the weight is decoded in registers as it streams.
    """
    fmt, (n, k) = weight.fmt, weight.shape

    def compute(x_te: te.Tensor, *tensors: te.Tensor):
        w = te.compute(
            (n, k),
            lambda i, j: _weight_at(fmt, list(tensors), i, j),
            "dequantize",
            attrs={"panel": tensors[0].shape[2], "codes_per_word": weight.codes_per_word},
        )
        r = te.reduce_axis((0, k), "k")
        *lead, _ = x_te.shape
        out = te.compute(
            (*lead, n),
            lambda *idx: te.sum(x_te[(*idx[:-1], r)].astype("float32") * w[idx[-1], r], axis=r),
            "NT_matmul",
        )
        if out_dtype == "float32":
            return out
        return te.compute(out.shape, lambda *idx: out[idx].astype(out_dtype), "cast")

    return op.tensor_expr_op(compute, name, [x, *weight.tensors()])


class QuantizedWeight(nn.Module):
    """The parameters of one [N, K] weight stored in panels of P output rows, k-major inside a
    panel: a quantized weight's ``codes`` [N/P, K*bits/32, P], ``scales`` and ``offsets``
    [N/P, K/group, P] (small integers in a two-level format, with float16 ``super_scales``
    and, if asymmetric, ``super_offsets`` [N/P, K/super_group, P]), or a float weight's
    ``panels`` [N/P, K, P] (``fmt`` None). One loaded
    vector then holds the same code word of P consecutive output rows, so the CPU kernel
    vectorises along the output and streams each panel front to back (``to_panels`` makes this
    layout from the row-major one)."""

    def __init__(self, n: int, k: int, fmt: GroupFormat | None):
        self.fmt, self.shape, panel = fmt, (n, k), panel_width(n)
        self.codes = self.scales = self.offsets = self.panels = None
        self.super_scales = self.super_offsets = None
        if fmt is None:
            self.codes_per_word = 1
            self.panels = nn.Parameter((n // panel, k, panel), "float32")
            return
        # Codes per block of whole words: the float schedule decodes a block per inner loop.
        self.codes_per_word = codes_per_block(fmt.bits)
        block = max(fmt.group_size, fmt.super_group, self.codes_per_word)
        if k % block:
            raise ValueError(f"{k} columns are not a multiple of the {fmt.name} block {block}")
        groups = (n // panel, k // fmt.group_size, panel)
        group_type = str(np.dtype(fmt.group_type))
        self.codes = nn.Parameter((n // panel, k * fmt.bits // 32, panel), "uint32")
        self.scales = nn.Parameter(groups, group_type)
        self.offsets = nn.Parameter(groups, group_type) if fmt.asymmetric else None
        if fmt.super_group:
            supers = (n // panel, k // fmt.super_group, panel)
            self.super_scales = nn.Parameter(supers, SUPER_TYPE)
            if fmt.asymmetric:
                self.super_offsets = nn.Parameter(supers, SUPER_TYPE)

    def tensors(self) -> list[nn.Tensor]:
        """The parameters in the order of ``PANEL_SUFFIXES`` (those this format has)."""
        found = (
            self.codes,
            self.scales,
            self.offsets,
            self.super_scales,
            self.super_offsets,
            self.panels,
        )
        return [t for t in found if t is not None]

    def to(self, dtype: str | None = None) -> None:
        """Codes and scales keep their storage types whatever the model's float type."""


def _matmul(
    x: nn.Tensor,
    weight: QuantizedWeight,
    out_dtype: str,
    name: str,
    activation_matmul: ActivationMatmul | None,
) -> nn.Tensor:
    """x @ W.T by ``activation_matmul`` for a quantized weight (float32 out: it is for llvm,
    whose models are float32), else with float activations."""
    if activation_matmul is not None and weight.fmt is not None:
        return activation_matmul(x, weight, name)
    return quantized_matmul(x, weight, out_dtype, name)


class QuantizedLinear(nn.Module):
    """``nn.Linear`` with a quantized weight (the bias, if any, stays in the model's type); a
    weight in segments is an ``nn.ModuleList`` of them (parameters ``weight.0.codes``, ...),
    whose products are concatenated."""

    def __init__(
        self,
        linear: nn.Linear,
        layout: Layout,
        activation_matmul: ActivationMatmul | None = None,
    ):
        self.out_dtype = linear.weight.dtype
        k = linear.in_features
        if isinstance(layout, tuple):
            if sum(s.rows for s in layout) != linear.out_features:
                raise ValueError(
                    f"segments of {[s.rows for s in layout]} rows do not make {linear.out_features}"
                )
            self.weight = nn.ModuleList([QuantizedWeight(s.rows, k, s.fmt) for s in layout])
        else:
            self.weight = QuantizedWeight(linear.out_features, k, layout)
        self.bias = linear.bias
        self.activation_matmul = activation_matmul

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        segments = self.weight if isinstance(self.weight, nn.ModuleList) else [self.weight]
        outs = [
            _matmul(x, w, self.out_dtype, "quantized_matmul", self.activation_matmul)
            for w in segments
        ]
        y = outs[0] if len(outs) == 1 else op.concat(outs, dim=-1)
        return y + self.bias if self.bias is not None else y


class QuantizedEmbedding(nn.Module):
    """``nn.Embedding`` over a quantized table: a lookup decodes only the rows it gathers, and
    a tied LM head multiplies by the same codes (``project``), so the table exists once."""

    def __init__(
        self,
        embedding: nn.Embedding,
        fmt: GroupFormat | None,
        activation_matmul: ActivationMatmul | None = None,
    ):
        self.out_dtype = embedding.weight.dtype
        self.weight = QuantizedWeight(embedding.num, embedding.dim, fmt)
        self.activation_matmul = activation_matmul

    def forward(self, ids: nn.Tensor) -> nn.Tensor:
        fmt, (_, dim) = self.weight.fmt, self.weight.shape
        flat = op.reshape(ids, (-1,))

        def compute(ids_te: te.Tensor, *tensors: te.Tensor):
            return te.compute(
                (ids_te.shape[0], dim),
                lambda t, j: _weight_at(fmt, list(tensors), ids_te[t], j).astype(self.out_dtype),
                "embedding_lookup",
            )

        rows = op.tensor_expr_op(compute, "quantized_take", [flat, *self.weight.tensors()])
        return op.reshape(rows, (*ids.shape, dim))

    def project(self, h: nn.Tensor) -> nn.Tensor:
        """h @ table.T: the tied LM head."""
        return _matmul(h, self.weight, "float32", "quantized_lm_head", self.activation_matmul)


def quantizable_weights(model: nn.Module) -> dict[str, tuple[int, int]]:
    """The weights ``quantize_layers`` can quantize: every linear and embedding weight, by
    parameter name, with its logical shape [N, K] (K is the reduction axis)."""
    found: dict[str, tuple[int, int]] = {}

    class _Find(nn.Mutator):
        def visit_module(self, name: str, node: nn.Module):
            if isinstance(node, nn.Linear):
                found[f"{name}.weight"] = (node.out_features, node.in_features)
            elif isinstance(node, nn.Embedding):
                found[f"{name}.weight"] = (node.num, node.dim)
            return self.visit(name, node)

    _Find().visit("", model)
    return found


def quantize_layers(
    model: nn.Module,
    formats: Mapping[str, Layout],
    activation_matmul: ActivationMatmul | None = None,
) -> nn.Module:
    """Swap every ``nn.Linear`` / ``nn.Embedding`` whose ``<path>.weight`` is in ``formats``
    for its panel form (an ``nn.Mutator`` model rewrite, as MLC-LLM does it): quantized, with
    parameters ``<path>.weight.codes`` / ``.scales`` / ``.offsets``, float (format None), with
    ``<path>.weight.panels``, or a linear weight in segments (``QuantizedLinear``).
    ``activation_matmul`` multiplies by the quantized ones instead of the float-activation
    kernel (e.g. with int8 activations)."""

    class _Rewrite(nn.Mutator):
        def visit_module(self, name: str, node: nn.Module):
            weight = f"{name}.weight"
            if weight in formats and isinstance(node, nn.Linear):
                return QuantizedLinear(node, formats[weight], activation_matmul)
            if weight in formats and isinstance(node, nn.Embedding):
                return QuantizedEmbedding(node, formats[weight], activation_matmul)
            return self.visit(name, node)

    return _Rewrite().visit("", model)
