"""Prompt-lookup (n-gram) drafting: propose draft tokens by copying from the context.

If the last ``n`` tokens already occurred earlier in the context, the tokens that followed them
are a good guess for what comes next (code edits, quoting, repeated boilerplate). Drafts cost no
model call, so they are a free draft source for speculative decoding.

:class:`NgramIndex` is the incremental native index used while decoding: O(max_n) per appended
token and O(k + max_n) per proposal, however long the context. :func:`propose_numpy` is the
straightforward O(context) search with the same semantics; it serves as the reference in tests and
the baseline in ``scripts/bench_ngram.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ._ngram import NgramIndex as _NativeNgramIndex

__all__ = ["NgramIndex", "propose_numpy"]


class NgramIndex:
    """Token history with an incremental n-gram index for prompt-lookup drafting.

    A proposal looks for the longest suffix of ``n`` tokens, ``max_n >= n >= min_n``, that occurred
    earlier in the history and returns up to ``k`` tokens that followed its latest earlier
    occurrence (the most recent context is usually the most relevant).
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        """Raises ``ValueError`` unless ``1 <= min_n <= max_n``."""
        self._native = _NativeNgramIndex(min_n, max_n)

    @property
    def min_n(self) -> int:
        """Shortest suffix length that may be matched."""
        return self._native.min_n

    @property
    def max_n(self) -> int:
        """Longest suffix length tried (first, as longer matches predict better)."""
        return self._native.max_n

    def extend(self, tokens: np.ndarray | Sequence[int]) -> None:
        """Appends token ids (any 1-D integer array-like) to the history.

        Raises ``ValueError`` for ids outside ``[0, 2**31 - 1]`` or non-integer input; the history
        is then left unchanged.
        """
        self._native.extend(tokens)

    def propose(self, k: int) -> np.ndarray:
        """Returns up to ``k`` draft tokens (int32, possibly empty); ``k < 0`` is a ValueError."""
        return self._native.propose(k)

    def size(self) -> int:
        """Number of tokens in the history."""
        return self._native.size()

    def __len__(self) -> int:
        return self._native.size()


def propose_numpy(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> np.ndarray:
    """Same proposal as :meth:`NgramIndex.propose` for history ``tokens``, by scanning it all.

    Vectorised but O(len(tokens) * max_n) per call; see the module docstring for its uses.
    """
    if min_n < 1:
        raise ValueError(f"min_n must be >= 1, got {min_n}")
    if max_n < min_n:
        raise ValueError(f"max_n must be >= min_n, got min_n={min_n}, max_n={max_n}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got {tokens.ndim} dims")
    if tokens.size and tokens.dtype.kind not in "iu":
        raise ValueError(f"tokens must have an integer dtype, got {tokens.dtype}")
    if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(np.int32).max):
        raise ValueError("token ids must be in [0, 2**31 - 1]")
    length = tokens.size
    if k == 0:
        return np.empty(0, np.int32)
    for n in range(max_n, min_n - 1, -1):
        # Candidate starts i with i + n <= length - 1: the occurrence ends before the last token.
        num_starts = length - n
        if num_starts <= 0:
            continue
        match = np.ones(num_starts, dtype=bool)
        for j in range(n):
            match &= tokens[j : j + num_starts] == tokens[length - n + j]
        starts = np.flatnonzero(match)
        if starts.size:
            follow = starts[-1] + n
            return tokens[follow : follow + k].astype(np.int32)
    return np.empty(0, np.int32)
