"""A draft whose LM head scores only the first N token ids (``mlc-spec compile --lm-head-vocab``).

A draft's LM head over a large vocabulary is a large part of each of its steps (Qwen2.5-Coder-
0.5B's 151936 x 896, ~22% of a step even at 4 bits), yet BPE gives the frequent tokens the low
ids: of HumanEval's prompt tokens, 1.5% have Qwen ids >= 65536 and none >= 100000. The model
gives the ids past N a logit of -inf (``LlamaForCausalLM._logits``), so the runtime, its
samplers and the rejection sampler see the whole vocabulary and the draft never proposes those
ids; the target verifies every token, so speculation stays lossless.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping

import numpy as np

from mlc_spec.models import ModelConfig

from .errors import CompileError
from .quantization import QuantizedTensor
from .sources import ModelSource

_HEAD, _TABLE = "lm_head.weight", "model.embed_tokens.weight"


def first_rows(tensor: QuantizedTensor | np.ndarray, rows: int) -> QuantizedTensor | np.ndarray:
    """The first ``rows`` rows of a float or group-quantized weight (each row stored apart)."""
    if isinstance(tensor, QuantizedTensor):
        return dataclasses.replace(tensor, **{k: v[:rows] for k, v in tensor.arrays().items()})
    return tensor[:rows]


class _WithHead(Mapping):
    """The tensors by name, with ``lm_head.weight`` the first ``rows`` rows of ``head`` (the
    head itself, or the table it is tied to); values still read lazily."""

    def __init__(self, tensors: Mapping, head: str, rows: int):
        self._tensors, self._head, self._rows = tensors, head, rows

    def __getitem__(self, name: str):
        if name == _HEAD:
            return first_rows(self._tensors[self._head], self._rows)
        return self._tensors[name]

    def __contains__(self, name: object) -> bool:
        return name == _HEAD or name in self._tensors

    def __iter__(self) -> Iterator[str]:
        yield from self._tensors
        if _HEAD not in self._tensors:
            yield _HEAD

    def __len__(self) -> int:
        return len(self._tensors) + (_HEAD not in self._tensors)


def head_vocab(source: ModelSource, cfg: ModelConfig, rows: int) -> tuple[ModelSource, ModelConfig]:
    """The source and config with an LM head of the first ``rows`` token ids: the source's head
    cut, or where the model ties it to the embedding, a head of its own cut from the table
    (which stays whole for the lookup)."""
    if not 1 <= rows < cfg.vocab_size:
        raise CompileError(
            f"--lm-head-vocab must be between 1 and {cfg.vocab_size - 1} (the vocabulary has "
            f"{cfg.vocab_size} ids), got {rows}"
        )
    head = _TABLE if cfg.tie_word_embeddings else _HEAD
    formats, shapes = dict(source.stored_formats), dict(source.stored_shapes)
    if head in formats:
        formats[_HEAD] = formats[head]
    if head in shapes:
        shapes[_HEAD] = (rows, *shapes[head][1:])
    source = dataclasses.replace(
        source,
        tensors=_WithHead(source.tensors, head, rows),
        stored=_WithHead(source.stored, head, rows) if head in source.stored else source.stored,
        stored_formats=formats,
        stored_shapes=shapes,
    )
    return source, dataclasses.replace(cfg, tie_word_embeddings=False, lm_head_vocab=rows)
