"""Which weights of a model are quantized, and how (``mlc-spec compile --quantization``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from mlc_spec.models import hf_sources

from ..errors import CompileError
from .formats import GroupFormat

# ``as-source`` keeps each GGUF tensor's own quantization; ``q4``/``q8`` group-quantize float
# weights (symmetric, groups of 32); ``none`` keeps every weight in the model's float type.
QUANTIZATIONS = ("as-source", "q4", "q8", "none")
_GROUP_SIZE = 32


@dataclass(frozen=True)
class Quantize:
    """How one weight is stored in panels (``models/quantized.py``): re-encoded exactly from
    the tensors as the file stores them (``as_stored``), group-quantized from its float values,
    or (``fmt`` None) kept float."""

    fmt: GroupFormat | None
    as_stored: bool = False


def plan_quantization(
    weights: Mapping[str, tuple[int, int]],
    stored_formats: Mapping[str, GroupFormat | None],
    quantization: str,
    float_panels: bool = False,
    int8_formats: bool = False,
) -> dict[str, Quantize]:
    """The storage of each linear and embedding weight (``weights``: name -> [N, K]); weights
    left out keep the plain float layout. ``stored_formats`` gives the source tensors' own
    formats by Hugging Face name (empty for a float source). ``float_panels`` puts the float
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
            formats = [stored_formats.get(src) for src in hf_sources(weight)]
            if all(f is not None for f in formats):
                fmt = GroupFormat.common(formats)
                plan[weight] = Quantize(fmt if int8_formats else fmt.portable, as_stored=True)
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
        if k % _GROUP_SIZE:
            raise CompileError(f"{weight} has {k} columns, not a multiple of {_GROUP_SIZE}")
    return {weight: Quantize(fmt) for weight in weights}
