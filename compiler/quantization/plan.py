"""Which weights of a model are quantized, and how (``mlc-spec compile --quantization``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import groupby

from mlc_spec.models import hf_sources
from mlc_spec.models.quantized import Layout, Segment

from ..errors import CompileError
from .formats import GroupFormat

# ``as-source`` keeps each GGUF tensor's own quantization; ``q4``/``q8`` group-quantize (symmetric,
# groups of 32) every weight not already stored in at most 4/8 bits; ``none`` keeps every weight in
# the model's float type.
QUANTIZATIONS = ("as-source", "q4", "q8", "none")
# ``--lm-head-quantization``: the LM head group-quantized anew, whatever the file stores.
LM_HEAD_QUANTIZATIONS = ("q4", "q8")
_GROUP_SIZE = 32
# The LM head's weight, or where the model ties it to the embedding, the table.
_LM_HEADS = ("lm_head.weight", "model.embed_tokens.weight")


@dataclass(frozen=True)
class Quantize:
    """How one weight is stored in panels (``models/quantized.py``): re-encoded exactly from
    the tensors as the file stores them (``as_stored``), group-quantized from its float values,
    or (``fmt`` None) kept float. A segment of a fused weight (see ``plan_quantization``) names
    its source tensors and its row count; a whole weight leaves both to ``hf_sources``."""

    fmt: GroupFormat | None
    as_stored: bool = False
    sources: tuple[str, ...] = ()
    rows: int = 0


def segment_name(weight: str, index: int) -> str:
    """The stored name of segment ``index`` of a fused weight kept apart by format; the model
    rewrite declares the segments so (``models.quantized.QuantizedLinear``)."""
    return f"{weight}.{index}"


def layer_layouts(plan: Mapping[str, Quantize]) -> dict[str, Layout]:
    """What ``models.quantized.quantize_layers`` takes from a plan: per weight its format, or
    for a weight kept apart by format its segments (rows, format), in order."""
    layouts: dict[str, Layout] = {}
    for name, how in plan.items():
        if not how.sources:
            layouts[name] = how.fmt
            continue
        weight = name.rpartition(".")[0]
        layouts[weight] = (*layouts.get(weight, ()), Segment(how.rows, how.fmt))
    return layouts


def plan_quantization(
    weights: Mapping[str, tuple[int, int]],
    stored_formats: Mapping[str, GroupFormat | None],
    stored_shapes: Mapping[str, tuple[int, ...]],
    quantization: str,
    float_panels: bool = False,
    int8_formats: bool = False,
) -> dict[str, Quantize]:
    """The storage of each linear and embedding weight (``weights``: name -> [N, K]); weights
    left out keep the plain float layout. ``stored_formats`` and ``stored_shapes`` give the
    source tensors' own formats and shapes by Hugging Face name (empty for a float source).

    ``as-source`` loads each quantized source tensor as stored and leaves a weight with a
    float part float. ``q4`` / ``q8`` cap the code width: a tensor the file stores in at most
    that many bits still loads as stored, and any other (float, or wider codes) is
    group-quantized from its values. For a draft model that caps its bytes per step:
    Qwen2.5-0.5B's Q4_K_M file stores most of its layers as 5-bit Q5_0 (its width, 896, is no
    multiple of Q4_K's 256).

    A fused weight (q/k/v, gate/up) whose parts load in different formats is kept apart: one
    segment per run of parts in the same format (``segment_name``), each multiplied on its
    own. Promoting all to the narrowest common format would cost bytes every step read:
    Qwen2.5-1.5B Q4_K_M's Q4_K q/k with a Q6_K v, as 8-bit codes with offsets per 16, read 40
    MB more per decode step than the three as shipped. ``float_panels`` puts the float
    weights in panels too (the CPU kernels want them so). ``int8_formats`` keeps the stored
    formats that only the int8-activation kernel reads (two-level Q4_K and Q6_K, 5-bit Q5_0 and
    Q5_1) as they are; otherwise they load in their portable format (``GroupFormat.portable``):
    the float-activation kernels decode a two-level group scale per weight, not per group, and
    decoded Qwen2.5-1.5B 1.24x slower (docs/quantization.md)."""
    if quantization not in QUANTIZATIONS:
        raise CompileError(
            f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATIONS)}"
        )
    plan = {w: Quantize(None) for w in weights} if float_panels else {}
    if quantization == "none":
        return plan
    cap = None if quantization == "as-source" else _group_format(quantization, int8_formats)
    for weight, (rows, k) in weights.items():
        sources = hf_sources(weight)
        loads = [_load(stored_formats.get(src), cap, int8_formats) for src in sources]
        if None in loads:
            continue
        if any(not how.as_stored for how in loads):
            _check_groups(weight, k)
        runs = [list(run) for _, run in groupby(zip(sources, loads, strict=True), lambda s: s[1])]
        if len(runs) == 1:
            plan[weight] = loads[0]
            continue
        segments = []
        for run in runs:
            parts = tuple(src for src, _ in run)
            segment_rows = sum(stored_shapes[src][0] for src in parts)
            segments.append(dataclasses.replace(run[0][1], sources=parts, rows=segment_rows))
        total = sum(s.rows for s in segments)
        if total != rows:
            raise CompileError(
                f"weights do not match the config: {', '.join(sources)} have {total} rows, "
                f"expected {rows}"
            )
        plan.pop(weight, None)
        for i, segment in enumerate(segments):
            plan[segment_name(weight, i)] = segment
    return plan


def _load(
    stored: GroupFormat | None, cap: GroupFormat | None, int8_formats: bool
) -> Quantize | None:
    """How one source tensor loads: as stored (in its portable format unless ``int8_formats``)
    if quantized in at most ``cap``'s bits (any, for ``as-source``: ``cap`` None), else
    quantized to ``cap``; None for a float tensor under ``as-source``."""
    if stored is not None and (cap is None or stored.bits <= cap.bits):
        return Quantize(stored if int8_formats else stored.portable, as_stored=True)
    return None if cap is None else Quantize(cap)


def _group_format(quantization: str, int8_formats: bool) -> GroupFormat:
    """The format that ``q4`` / ``q8`` group-quantize to: symmetric per 32, with float16 scales
    where the int8 kernel reads it (GGUF's Q4_0 / Q8_0: 4.5 bits per 4-bit weight, not 5)."""
    return GroupFormat(int(quantization[1:]), _GROUP_SIZE, half_scales=int8_formats)


def _check_groups(weight: str, k: int) -> None:
    """One line refusing a weight whose rows do not split into groups of ``_GROUP_SIZE``."""
    if k % _GROUP_SIZE:
        raise CompileError(f"{weight} has {k} columns, not a multiple of {_GROUP_SIZE}")


def requantize_lm_head(
    plan: Mapping[str, Quantize],
    weights: Mapping[str, tuple[int, int]],
    lm_head: str,
    int8_formats: bool = False,
) -> dict[str, Quantize]:
    """``plan`` with the LM head (the embedding table, where the model ties the two) symmetric
    group-quantized to ``lm_head`` from its float values, whatever the source stores. For a
    draft model: Qwen2.5-0.5B's head (151936 x 896, Q8_0) is a third of the bytes its decode
    step reads, and its argmax needs fewer bits. Lossy for this model alone: speculation
    verifies every draft token with the target. ``int8_formats``: float16 scales, as ``q4``."""
    if lm_head not in LM_HEAD_QUANTIZATIONS:
        raise CompileError(
            f"unknown LM head quantization {lm_head!r}; choose one of "
            f"{', '.join(LM_HEAD_QUANTIZATIONS)}"
        )
    name = next(n for n in _LM_HEADS if n in weights)
    _check_groups(name, weights[name][1])
    return {**plan, name: Quantize(_group_format(lm_head, int8_formats))}
