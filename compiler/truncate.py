"""A model's first N layers as a self-draft (layer-skip speculation).

When no smaller model shares the target's vocabulary (SmolLM2-135M has none), the target's own
lower layers plus its final norm and head make a cheap draft that agrees with it often.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Mapping

from .errors import CompileError
from .sources import ModelSource

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class _FirstLayers(Mapping):
    """A mapping by tensor name without the tensors of layers ``>= num_layers`` (values still
    read lazily)."""

    def __init__(self, tensors: Mapping, num_layers: int):
        self._tensors = tensors
        self._names = {n for n in tensors if _kept(n, num_layers)}

    def __getitem__(self, name: str):
        if name not in self._names:
            raise KeyError(name)
        return self._tensors[name]

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def _kept(name: str, num_layers: int) -> bool:
    return (m := _LAYER.match(name)) is None or int(m.group(1)) < num_layers


def first_layers(source: ModelSource, num_layers: int) -> ModelSource:
    """The source's first ``num_layers`` layers, with its final norm and head; a GGUF keeps its
    tensors as stored, so ``--quantization as-source`` applies to the self-draft too."""
    total = int(source.config["num_hidden_layers"])
    if not 1 <= num_layers <= total:
        raise CompileError(f"--num-layers must be between 1 and {total}, got {num_layers}")
    config = {**source.config, "num_hidden_layers": num_layers}
    return dataclasses.replace(
        source,
        config=config,
        tensors=_FirstLayers(source.tensors, num_layers),
        stored=_FirstLayers(source.stored, num_layers),
        stored_formats={n: f for n, f in source.stored_formats.items() if _kept(n, num_layers)},
        stored_shapes={n: s for n, s in source.stored_shapes.items() if _kept(n, num_layers)},
    )
