"""Top-k without a sort (``compiler/cpu_top_k.py``): the CPU artifact's
``probs_from_logits_top_candidates`` gives the sort path's probabilities bit for bit wherever it
says a row fits, says so for every row a top-k set of at most ``TOP_CANDIDATES`` tokens
decides, and the sampler falls back to the sort where ties run past the candidates."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from compiled_sampling import cpu_sampler

from mlc_spec.runtime.artifact import MAX_TREE_WIDTH, TOP_CANDIDATES
from mlc_spec.runtime.params import SamplingParams
from mlc_spec.runtime.sampler import PROBS_TOP_CANDIDATES, PROBS_TOP_KP, Sampler

_SAMPLERS: dict = {}


def _sampler(vocab: int | None):
    """Compiled for any vocabulary (None) or for one, as an artifact's are (vectorised rows)."""
    if vocab not in _SAMPLERS:
        _SAMPLERS[vocab] = cpu_sampler(vocab)
    return _SAMPLERS[vocab]


def _rows(rng: np.random.Generator, n: int, vocab: int, trial: int) -> list[np.ndarray]:
    logits = rng.normal(0, 3, (n, vocab)).astype(np.float32)
    if trial % 3 == 1:
        logits = np.round(logits)  # ties everywhere, the k-th value's included
    if trial % 3 == 2:
        logits[:, vocab // 2 :] = -np.inf  # a draft's head scoring only some ids
    return [
        logits,
        rng.choice([0, 0.5, 0.7, 1.0, 1.7], n).astype(np.float32),
        rng.integers(1, min(TOP_CANDIDATES, vocab - 1) + 1, n).astype(np.int32),
        rng.choice([1.0, 0.95, 0.8, 0.3], n).astype(np.float32),
    ]


def _fits(logits: np.ndarray, temperature: np.ndarray, top_k: np.ndarray) -> list[int]:
    """Greedy rows, and rows with fewer values at or above their k-th largest than there are
    candidates, or no more values than candidates."""
    fits = []
    for row, t, k in zip(logits, temperature, top_k, strict=True):
        x = row / np.float32(t) if t else row
        kth = np.sort(x)[::-1][k - 1]
        fits.append(int(t == 0 or len(x) < TOP_CANDIDATES or np.sum(x >= kth) < TOP_CANDIDATES))
    return fits


@pytest.mark.parametrize("compiled,vocab", [(None, 64), (None, 1000), (1000, 1000)])
def test_the_candidates_give_the_sorts_probabilities(compiled, vocab):
    """64 ids: fewer than the candidates, the row is placed whole."""
    rng = np.random.default_rng(vocab)
    fn = _sampler(compiled)._fn
    for trial in range(30):
        rows = _rows(rng, int(rng.integers(1, 6)), vocab, trial)
        args = [tvm.runtime.tensor(a) for a in rows]
        probs, fits = (t.numpy() for t in fn[PROBS_TOP_CANDIDATES](*args))
        assert fits.tolist() == _fits(*rows[:3])
        sorted_probs = fn[PROBS_TOP_KP](*args).numpy()
        assert np.array_equal(probs[fits == 1], sorted_probs[fits == 1])


def test_ties_past_the_candidates_fall_back_to_the_sort():
    """300 ids of one value: the 5th largest is tied far past the candidates, so the row does
    not fit, and ``Sampler.probs`` returns the sort's answer (all 300 kept)."""
    sampler = _sampler(1000)
    logits = np.zeros((2, 1000), np.float32)
    logits[:, :300] = 4.0
    logits[1, 7] = 9.0  # the second row's top-5 set has ties too, still past the candidates
    tensor = tvm.runtime.tensor(logits)
    params = [SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=0.5, top_k=5)]
    args = [([1.0, 0.5], np.float32), ([5, 5], np.int32), ([1.0, 1.0], np.float32)]
    _, fits = sampler._fn[PROBS_TOP_CANDIDATES](
        tensor, *(tvm.runtime.tensor(np.array(a, dtype)) for a, dtype in args)
    )
    assert fits.numpy().tolist() == [0, 0]
    probs = sampler.probs(tensor, params).numpy()
    assert np.count_nonzero(probs[0]) == 300 and np.count_nonzero(probs[1]) == 300
    sort_only = Sampler(
        {k: f for k, f in sampler._fn.items() if k != PROBS_TOP_CANDIDATES}, sampler.device
    )
    assert np.array_equal(probs, sort_only.probs(tensor, params).numpy())


@pytest.mark.parametrize("vocab", [None, 5, 300])
def test_top_tokens_are_the_most_probable_in_order(vocab):
    """A draft tree's expansion (``top_tokens``): each row's MAX_TREE_WIDTH most probable tokens,
    ties by lower id, with their softmax probabilities; -1 and 0 past a row shorter than that."""
    rng = np.random.default_rng(5)
    v = vocab or 1000
    logits = np.round(rng.normal(0, 2, (6, v))).astype(np.float32)  # ties among the top
    logits[1, : v // 2] = -np.inf
    tokens, probs = _sampler(vocab).top_tokens(tvm.runtime.tensor(logits))
    order = np.argsort(-logits, axis=1, kind="stable")[:, :MAX_TREE_WIDTH]
    width = min(v, MAX_TREE_WIDTH)
    np.testing.assert_array_equal(tokens[:, :width], order)
    np.testing.assert_array_equal(tokens[:, width:], -1)
    exact = np.exp(logits - logits.max(1, keepdims=True))
    exact /= exact.sum(1, keepdims=True)
    np.testing.assert_allclose(probs[:, :width], np.take_along_axis(exact, order, 1), rtol=1e-5)
    np.testing.assert_array_equal(probs[:, width:], 0)
