"""Prompt lookup: drafts copied from the latest earlier occurrence of the context's suffix."""

from __future__ import annotations

import numpy as np

from ..ngram_index import NgramIndex
from ..request import Sequence
from .model_free import ModelFreeProposer


class NgramProposer(ModelFreeProposer):
    """The native index is extended with each sequence's new tokens and answers in O(match)
    per step."""

    method = "ngram"

    def __init__(self, min_n: int, max_n: int):
        super().__init__()
        self.min_n, self.max_n = min_n, max_n
        self._index: dict[int, NgramIndex] = {}

    def _lookup(self, seq: Sequence, k: int) -> np.ndarray:
        index = self._index.get(seq.seq_id)
        if index is None:  # not ``setdefault``: building a native index costs ~0.1 ms
            index = self._index[seq.seq_id] = NgramIndex(self.min_n, self.max_n)
        index.extend(seq.tokens[len(index) :])
        return index.propose(k)

    def remove(self, seq: Sequence) -> None:
        super().remove(seq)
        self._index.pop(seq.seq_id, None)
