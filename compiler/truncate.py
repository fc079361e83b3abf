"""A model's first N layers as a self-draft (layer-skip speculation).

When no smaller model shares the target's vocabulary (SmolLM2-135M has none), the target's own
lower layers plus its final norm and head make a cheap draft that agrees with it often.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

import numpy as np

from .errors import CompileError
from .sources import ModelSource

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class _FirstLayers(Mapping[str, np.ndarray]):
    """The source tensors without those of layers ``>= num_layers`` (still read lazily)."""

    def __init__(self, tensors: Mapping[str, np.ndarray], num_layers: int):
        self._tensors = tensors
        self._names = {
            n for n in tensors if (m := _LAYER.match(n)) is None or int(m.group(1)) < num_layers
        }

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._names:
            raise KeyError(name)
        return self._tensors[name]

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def first_layers(source: ModelSource, num_layers: int) -> ModelSource:
    total = int(source.config["num_hidden_layers"])
    if not 1 <= num_layers <= total:
        raise CompileError(f"--num-layers must be between 1 and {total}, got {num_layers}")
    config = {**source.config, "num_hidden_layers": num_layers}
    return ModelSource(
        config=config,
        tensors=_FirstLayers(source.tensors, num_layers),
        source_hash=source.source_hash,
        path=source.path,
        chat_template=source.chat_template,
    )
