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
    """How one weight becomes quantized: re-encoded exactly from the tensors as the file
    stores them (``as_stored``), or group-quantized from its float values."""

    fmt: GroupFormat
    as_stored: bool


def plan_quantization(
    weights: Mapping[str, tuple[int, int]],
    stored_formats: Mapping[str, GroupFormat | None],
    quantization: str,
) -> dict[str, Quantize]:
    """The format of each quantizable weight (``weights``: name -> [N, K], the model's linear
    and embedding weights); weights left out stay float. ``stored_formats`` gives the source
    tensors' own formats by Hugging Face name (empty for a float source)."""
    if quantization not in QUANTIZATIONS:
        raise CompileError(
            f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATIONS)}"
        )
    if quantization == "none":
        return {}
    if quantization == "as-source":
        plan = {}
        for weight in weights:
            formats = [stored_formats.get(src) for src in hf_sources(weight)]
            if all(f is not None for f in formats):
                plan[weight] = Quantize(GroupFormat.common(formats), as_stored=True)
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
    return {weight: Quantize(fmt, as_stored=False) for weight in weights}
