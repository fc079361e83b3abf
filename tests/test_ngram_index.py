"""Prompt-lookup index: native incremental index vs the numpy scan vs a brute-force oracle."""

from __future__ import annotations

import numpy as np
import pytest

from mlc_spec.runtime.ngram_index import NgramIndex, propose_numpy

CONFIGS = [(1, 1, 1), (1, 3, 5), (2, 4, 8), (3, 3, 2), (1, 6, 16)]  # (min_n, max_n, k)


def brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Spec written as plainly as possible, independent of both implementations."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n > length:
            continue
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):  # latest earlier occurrence first
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def random_tokens(rng: np.random.Generator, length: int, vocab: int) -> np.ndarray:
    return rng.integers(0, vocab, size=length).astype(np.int64)


def text_like_tokens(rng: np.random.Generator, length: int) -> np.ndarray:
    """Zipf-distributed 'words' with frequent copies of earlier spans, like code or chat."""
    out: list[int] = []
    while len(out) < length:
        if len(out) > 16 and rng.random() < 0.4:
            span = int(rng.integers(3, 16))
            start = int(rng.integers(0, len(out) - span))
            out.extend(out[start : start + span])
        else:
            out.extend(int(t) for t in np.minimum(rng.zipf(1.3, size=4), 5000))
    return np.array(out[:length], dtype=np.int64)


def check_incremental(tokens: np.ndarray, chunks: list[int], min_n: int, max_n: int, k: int):
    index = NgramIndex(min_n, max_n)
    pos = 0
    for size in chunks:
        index.extend(tokens[pos : pos + size])
        pos += size
        assert len(index) == index.size() == pos
        got = index.propose(k)
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, propose_numpy(tokens[:pos], k, min_n, max_n))
    assert pos == tokens.size


@pytest.mark.parametrize(("min_n", "max_n", "k"), CONFIGS)
@pytest.mark.parametrize("vocab", [2, 3, 8])
def test_one_token_at_a_time_small_vocab(min_n, max_n, k, vocab):
    rng = np.random.default_rng(vocab * 100 + max_n)
    tokens = random_tokens(rng, 400, vocab)
    check_incremental(tokens, [1] * tokens.size, min_n, max_n, k)


@pytest.mark.parametrize(("min_n", "max_n", "k"), CONFIGS)
def test_chunked_text_like(min_n, max_n, k):
    rng = np.random.default_rng(max_n * 10 + k)
    tokens = text_like_tokens(rng, 3000)
    chunks = []
    while sum(chunks) < tokens.size:
        chunks.append(min(int(rng.integers(0, 40)), tokens.size - sum(chunks)))
    check_incremental(tokens, chunks, min_n, max_n, k)


@pytest.mark.parametrize(("min_n", "max_n", "k"), CONFIGS)
def test_numpy_matches_brute_force(min_n, max_n, k):
    rng = np.random.default_rng(k)
    for tokens in [random_tokens(rng, 150, 3), text_like_tokens(rng, 150)]:
        for end in range(tokens.size + 1):
            prefix = tokens[:end]
            expected = brute_force(prefix.tolist(), k, min_n, max_n)
            assert propose_numpy(prefix, k, min_n, max_n).tolist() == expected


@pytest.mark.parametrize(
    ("tokens", "min_n", "max_n", "k", "expected"),
    [
        ([], 1, 3, 4, []),  # empty history
        ([7], 1, 3, 4, []),  # a single token has no earlier occurrence
        ([1, 2, 3, 4], 1, 3, 4, []),  # no repeat at all
        ([1, 2, 3, 1, 2], 1, 2, 3, [3, 1, 2]),  # match at the very start
        ([1, 2, 3, 1, 2], 1, 2, 10, [3, 1, 2]),  # continuation shorter than k
        ([1, 2, 3, 1, 2], 1, 2, 0, []),  # k = 0
        ([3, 5, 3, 6, 3], 1, 1, 2, [6, 3]),  # the latest earlier occurrence wins
        ([7, 1, 9, 4, 1, 8, 7, 1], 1, 2, 2, [9, 4]),  # the longest n wins over a later 1-gram
        ([7, 1, 9, 4, 1, 8, 7, 1], 1, 1, 2, [8, 7]),
        ([1, 2, 3, 9, 3], 1, 3, 5, [9, 3]),  # falls back from n=3 and n=2 to n=1
        ([1, 2, 3, 9, 3], 2, 3, 5, []),  # ... but not below min_n
        ([1, 1, 1, 1], 2, 2, 3, [1]),  # overlapping occurrence
        ([0, 2**31 - 1, 0], 1, 1, 3, [2**31 - 1, 0]),  # extreme ids
    ],
)
def test_hand_written(tokens, min_n, max_n, k, expected):
    assert propose_numpy(np.array(tokens, dtype=np.int64), k, min_n, max_n).tolist() == expected
    index = NgramIndex(min_n, max_n)
    index.extend(tokens)
    assert index.propose(k).tolist() == expected


def test_accepts_int_array_likes():
    index = NgramIndex(1, 2)
    index.extend([5, 6])
    index.extend((7,))
    index.extend(np.array([5], dtype=np.uint8))
    index.extend([])  # numpy makes this float64; empty is fine regardless of dtype
    index.extend(np.arange(6, 8, dtype=np.int64)[::-1])  # non-contiguous: 7, 6
    assert len(index) == 6
    assert index.propose(4).tolist() == [7, 5, 7, 6]  # (7, 6) is new, so n=1: 6 at position 1
    assert (index.min_n, index.max_n) == (1, 2)


@pytest.mark.parametrize(
    "bad",
    [[-1], [2**31], np.array([2**63], dtype=np.uint64), [1.5], np.zeros((2, 2), np.int32), "ab"],
)
def test_bad_tokens_raise_and_leave_history_unchanged(bad):
    index = NgramIndex(1, 2)
    index.extend([1, 2, 1])
    with pytest.raises(ValueError):
        index.extend([3, *bad] if isinstance(bad, list) else bad)
    assert len(index) == 3
    assert index.propose(2).tolist() == [2, 1]
    with pytest.raises(ValueError):
        propose_numpy(np.asarray(bad), 2, 1, 2)


@pytest.mark.parametrize(("min_n", "max_n"), [(0, 2), (-1, 1), (3, 2)])
def test_bad_n_raise(min_n, max_n):
    with pytest.raises(ValueError, match="min_n|max_n"):
        NgramIndex(min_n, max_n)
    with pytest.raises(ValueError, match="min_n|max_n"):
        propose_numpy(np.array([1, 1]), 1, min_n, max_n)


def test_negative_k_raises():
    index = NgramIndex(1, 2)
    index.extend([1, 1])
    with pytest.raises(ValueError, match="k must be"):
        index.propose(-1)
    with pytest.raises(ValueError, match="k must be"):
        propose_numpy(np.array([1, 1]), -1, 1, 2)
