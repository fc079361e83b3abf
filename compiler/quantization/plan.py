"""Which weights of a model are quantized, and how (``mlc-spec compile --quantization``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from itertools import groupby

from mlc_spec.models import hf_sources
from mlc_spec.models.quantized import Layout, Segment

from ..errors import CompileError
from .formats import GroupFormat

# ``as-source`` keeps each GGUF tensor's own quantization; ``q4``/``q8`` group-quantize float
# weights (symmetric, groups of 32); ``none`` keeps every weight in the model's float type.
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

    A fused weight (q/k/v, gate/up) whose parts the file stores in different formats is kept
    apart: one segment per run of parts in the same format (``segment_name``), each multiplied
    on its own. Promoting all to the narrowest common format would cost bytes every step read:
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
    if quantization == "as-source":
        for weight in weights:
            sources = hf_sources(weight)
            formats = [stored_formats.get(src) for src in sources]
            if any(f is None for f in formats):
                continue
            loaded = [f if int8_formats else f.portable for f in formats]
            pairs = zip(sources, loaded, strict=True)
            runs = [list(run) for _, run in groupby(pairs, key=lambda sf: sf[1])]
            if len(runs) == 1:
                plan[weight] = Quantize(loaded[0], as_stored=True)
                continue
            segments = []
            for run in runs:
                parts = tuple(src for src, _ in run)
                rows = sum(stored_shapes[src][0] for src in parts)
                segments.append(Quantize(run[0][1], True, parts, rows))
            total = sum(s.rows for s in segments)
            if total != weights[weight][0]:
                raise CompileError(
                    f"weights do not match the config: {', '.join(sources)} have {total} rows, "
                    f"expected {weights[weight][0]}"
                )
            plan.pop(weight, None)
            for i, segment in enumerate(segments):
                plan[segment_name(weight, i)] = segment
        return plan
    quantized = sorted(n for n, f in stored_formats.items() if f is not None)
    if quantized:
        raise CompileError(
            f"--quantization {quantization} re-quantizes float weights, but the source is "
            f"already quantized ({quantized[0]} is {stored_formats[quantized[0]].name}); "
            "use --quantization as-source"
        )
    fmt = GroupFormat(int(quantization[1:]), _GROUP_SIZE)
    for weight, (_, k) in weights.items():
        _check_groups(weight, k)
    return {weight: Quantize(fmt) for weight in weights}


def _check_groups(weight: str, k: int) -> None:
    """One line refusing a weight whose rows do not split into groups of ``_GROUP_SIZE``."""
    if k % _GROUP_SIZE:
        raise CompileError(f"{weight} has {k} columns, not a multiple of {_GROUP_SIZE}")


def requantize_lm_head(
    plan: Mapping[str, Quantize], weights: Mapping[str, tuple[int, int]], lm_head: str
) -> dict[str, Quantize]:
    """``plan`` with the LM head (the embedding table, where the model ties the two) symmetric
    group-quantized to ``lm_head`` from its float values, whatever the source stores. For a
    draft model: Qwen2.5-0.5B's head (151936 x 896, Q8_0) is a third of the bytes its decode
    step reads, and its argmax needs fewer bits. Lossy for this model alone: speculation
    verifies every draft token with the target."""
    if lm_head not in LM_HEAD_QUANTIZATIONS:
        raise CompileError(
            f"unknown LM head quantization {lm_head!r}; choose one of "
            f"{', '.join(LM_HEAD_QUANTIZATIONS)}"
        )
    name = next(n for n in _LM_HEADS if n in weights)
    _check_groups(name, weights[name][1])
    return {**plan, name: Quantize(GroupFormat(int(lm_head[1:]), _GROUP_SIZE))}
