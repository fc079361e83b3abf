"""Source tensors (Hugging Face names and layouts) -> the compiled model's parameters."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

import ml_dtypes
import numpy as np

from mlc_spec.models import hf_sources

from .errors import CompileError

# Source tensors that carry no parameter of ours (precomputed RoPE tables).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

_NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def convert_parameters(
    expected: Sequence[tuple[str, tuple[int, ...]]],
    tensors: Mapping[str, np.ndarray],
    dtype: str,
    tie_word_embeddings: bool,
    on_progress: Callable[[int, int], None] | None = None,
) -> Iterator[tuple[str, np.ndarray]]:
    """Yield each parameter of the model, in order, fused and cast to ``dtype``.

    Raises CompileError naming the first tensor that is missing, has the wrong shape, or is
    left over (weights that do not match the config must never compile into a wrong model).
    """
    used: set[str] = set()
    for i, (name, shape) in enumerate(expected):
        parts = []
        for src in hf_sources(name):
            if src not in tensors:
                raise CompileError(f"weights do not match the config: tensor {src!r} is missing")
            parts.append(np.asarray(tensors[src]))
            used.add(src)
        array = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
        if tuple(array.shape) != tuple(shape):
            what = name if len(parts) == 1 else f"{name} (from {', '.join(hf_sources(name))})"
            raise CompileError(
                f"weights do not match the config: {what} has shape {tuple(array.shape)}, "
                f"expected {tuple(shape)}"
            )
        yield name, np.ascontiguousarray(array.astype(_NUMPY_DTYPES[dtype], copy=False))
        if on_progress:
            on_progress(i + 1, len(expected))
    leftover = [
        n
        for n in tensors
        if n not in used
        and not n.endswith(_IGNORED_SUFFIXES)
        and not (tie_word_embeddings and n == "lm_head.weight")
    ]
    if leftover:
        raise CompileError(
            f"weights do not match the config: unexpected tensor {sorted(leftover)[0]!r} "
            f"({len(leftover)} unused)"
        )
