"""Source tensors (Hugging Face names and layouts) -> the compiled model's parameters."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np

from mlc_spec.models import hf_sources
from mlc_spec.models.quantized import PANEL_SUFFIXES, to_panels
from mlc_spec.runtime.artifact import NUMPY_DTYPES

from .errors import CompileError
from .quantization import QuantizedTensor, concat_rows, quantize_symmetric, to_portable
from .quantization.plan import Quantize
from .sources import ModelSource

# Source tensors that carry no parameter of ours (precomputed RoPE tables).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def convert_parameters(
    expected: Sequence[tuple[str, tuple[int, ...]]],
    source: ModelSource,
    dtype: str,
    tie_word_embeddings: bool,
    plan: Mapping[str, Quantize],
    on_progress: Callable[[int, int], None] | None = None,
) -> Iterator[tuple[str, np.ndarray]]:
    """Yield each parameter of the model, in order: float weights fused and cast to ``dtype``;
    weights in ``plan`` (by weight name) in panels, as the format's arrays if quantized.

    Raises CompileError naming the first tensor that is missing, has the wrong shape, or is
    left over (weights that do not match the config must never compile into a wrong model).
    """
    used: set[str] = set()

    def parts(name: str, tensors: Mapping[str, object]) -> list:
        """The source tensors of ``name``: a segment's own (``Quantize.sources``), else the
        Hugging Face parameters fused into it."""
        found = []
        for src in (plan[name].sources if name in plan else ()) or hf_sources(name):
            if src not in tensors:
                raise CompileError(f"weights do not match the config: tensor {src!r} is missing")
            found.append(tensors[src])
            used.add(src)
        return found

    def floats(name: str) -> np.ndarray:
        found = [np.asarray(p) for p in parts(name, source.tensors)]
        array = found[0] if len(found) == 1 else np.concatenate(found, axis=0)
        return array.astype(NUMPY_DTYPES[dtype], copy=False)

    current: tuple[str, dict] | None = None  # one panel weight's tensors at a time
    for i, (name, shape) in enumerate(expected):
        weight, _, suffix = name.rpartition(".")
        if suffix in PANEL_SUFFIXES and weight in plan:
            if current is None or current[0] != weight:
                if plan[weight].fmt is None:
                    current = (weight, {"panels": floats(weight)})
                else:
                    current = (weight, _quantized(weight, plan[weight], source, parts).arrays())
            array = to_panels(current[1][suffix])
            what = f"{name} (of {weight})"
        else:
            array = floats(name)
            sources = hf_sources(name)
            what = name if len(sources) == 1 else f"{name} (from {', '.join(sources)})"
        if tuple(array.shape) != tuple(shape):
            raise CompileError(
                f"weights do not match the config: {what} has shape {tuple(array.shape)}, "
                f"expected {tuple(shape)}"
            )
        yield name, np.ascontiguousarray(array)
        if on_progress:
            on_progress(i + 1, len(expected))
    leftover = [
        n
        for n in source.tensors
        if n not in used
        and not n.endswith(_IGNORED_SUFFIXES)
        and not (tie_word_embeddings and n == "lm_head.weight")
    ]
    if leftover:
        raise CompileError(
            f"weights do not match the config: unexpected tensor {sorted(leftover)[0]!r} "
            f"({len(leftover)} unused)"
        )


def _quantized(
    weight: str, how: Quantize, source: ModelSource, parts: Callable[..., list]
) -> QuantizedTensor:
    """The weight in format ``how.fmt``: its fused parts re-encoded exactly from the file's
    own quantization, or its float values group-quantized."""
    if how.as_stored:
        stored = parts(weight, source.stored)
        if not all(isinstance(p, QuantizedTensor) for p in stored):
            raise CompileError(f"{weight}: mixes float and quantized source tensors")
        return concat_rows([p if p.fmt == how.fmt else to_portable(p) for p in stored])
    floats = [np.asarray(p, dtype=np.float32) for p in parts(weight, source.tensors)]
    w = floats[0] if len(floats) == 1 else np.concatenate(floats, axis=0)
    return quantize_symmetric(w, how.fmt.bits, how.fmt.group_size, how.fmt.half_scales)
