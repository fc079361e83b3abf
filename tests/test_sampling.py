"""Logits processing (temperature, top-k, top-p, greedy) and inverse-CDF sampling."""

from __future__ import annotations

import numpy as np
import pytest
from stats import chi2_rejects

from mlc_spec.runtime.sampling import probs_from_logits, sample_from_probs


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def one_row(
    logits: list[float], temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> np.ndarray:
    return probs_from_logits(np.array([logits], np.float32), temperature, top_k, top_p)[0]


def test_temperature_divides_logits() -> None:
    np.testing.assert_allclose(
        one_row([1, 2, 3], temperature=2.0), softmax(np.array([0.5, 1, 1.5]))
    )
    np.testing.assert_allclose(one_row([1, 2, 3], temperature=0.5), softmax(np.array([2.0, 4, 6])))


def test_top_k_keeps_the_k_largest() -> None:
    e2, e3 = np.exp(2.0), np.exp(3.0)
    np.testing.assert_allclose(one_row([1, 3, 2, 0], top_k=2), [0, e3, e2, 0] / (e2 + e3))
    for off in (0, -1, 4, 10):
        np.testing.assert_allclose(
            one_row([1, 3, 2, 0], top_k=off), softmax(np.array([1.0, 3, 2, 0]))
        )
    # Ties at the k-th value are all kept (HF/vLLM thresholding).
    np.testing.assert_allclose(one_row([2, 1, 2, 0], top_k=1), [0.5, 0, 0.5, 0])


def test_top_p_keeps_smallest_set_reaching_mass() -> None:
    logits = np.log([0.5, 0.3, 0.15, 0.05]).tolist()
    np.testing.assert_allclose(one_row(logits, top_p=0.75), [0.625, 0.375, 0, 0])
    np.testing.assert_allclose(one_row(logits, top_p=0.85), [0.5, 0.3, 0.15, 0] / np.float64(0.95))
    np.testing.assert_allclose(one_row(logits, top_p=0.01), [1, 0, 0, 0])
    np.testing.assert_allclose(one_row(logits, top_p=1.0), [0.5, 0.3, 0.15, 0.05], rtol=1e-6)
    # Mass exactly reaching top_p stops the set; equal probabilities go by lower token id.
    np.testing.assert_array_equal(one_row([0, 0, 0, 0], top_p=0.5), [0.5, 0.5, 0, 0])


def test_order_is_temperature_then_top_k_then_top_p() -> None:
    logits = np.log([0.4, 0.3, 0.2, 0.1]).tolist()
    # Alone, top_p=0.5 keeps two tokens (0.4 < 0.5); after top_k=2 renormalises to [4/7, 3/7]
    # the first token alone reaches 0.5.
    np.testing.assert_allclose(one_row(logits, top_p=0.5), [4 / 7, 3 / 7, 0, 0], rtol=1e-6)
    np.testing.assert_allclose(one_row(logits, top_k=2, top_p=0.5), [1, 0, 0, 0])
    # Temperature 0.5 squares the probabilities first: [16, 9, 4, 1] / 30, so 16/30 >= 0.5.
    np.testing.assert_allclose(one_row(logits, temperature=0.5, top_p=0.5), [1, 0, 0, 0])


def test_greedy_is_one_hot_of_argmax_with_lowest_index_on_ties() -> None:
    np.testing.assert_array_equal(one_row([1, 3, 3, 0], temperature=0.0), [0, 1, 0, 0])
    np.testing.assert_array_equal(
        one_row([1, 3, 3, 0], temperature=0.0, top_k=1, top_p=0.1), [0, 1, 0, 0]
    )


def test_per_row_parameters_match_single_row_calls() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 9)).astype(np.float32)
    logits[5, [0, 4]] = -np.inf  # masked tokens
    temperature = np.array([1.0, 0.0, 0.7, 1.3, 0.9, 1.0])
    top_k = np.array([0, 3, 4, 0, 2, 5])
    top_p = np.array([1.0, 0.5, 0.8, 0.6, 1.0, 0.9])
    probs = probs_from_logits(logits, temperature, top_k, top_p)
    assert probs.dtype == np.float64
    np.testing.assert_allclose(probs.sum(axis=1), 1.0)
    for i in range(6):
        expected = probs_from_logits(logits[i : i + 1], temperature[i], top_k[i], top_p[i])[0]
        np.testing.assert_array_equal(probs[i], expected)
    assert (probs[5, [0, 4]] == 0).all()
    assert np.count_nonzero(probs[2]) <= 4 and np.count_nonzero(probs[4]) == 2


@pytest.mark.parametrize(
    ("temperature", "top_p"), [(-0.1, 1.0), (1.0, 0.0), (1.0, 1.5)], ids=["neg-temp", "p0", "p>1"]
)
def test_invalid_parameters_raise(temperature: float, top_p: float) -> None:
    with pytest.raises(ValueError):
        probs_from_logits(np.zeros((1, 3), np.float32), temperature, 0, top_p)


def test_sample_never_picks_zero_probability_tokens() -> None:
    probs = np.tile(np.array([0.0, 0.3, 0.0, 1e-300, 0.7, 0.0, 0.0]), (4, 1))
    below_one = np.nextafter(1.0, 0.0)
    edges = sample_from_probs(probs, np.array([0.0, below_one, 0.3, 1.0]))
    np.testing.assert_array_equal(edges, [1, 4, 4, 4])
    u = np.random.default_rng(1).random(10_000)
    # float32 rows that do not sum exactly to one exercise the scaling by the row's own total.
    rough = np.tile((probs[0] * 1.001).astype(np.float32), (u.size, 1))
    for p in (np.tile(probs[0], (u.size, 1)), rough):
        tokens = sample_from_probs(p, u)
        assert tokens.dtype == np.int64
        assert (p[np.arange(u.size), tokens] > 0).all()


def test_sample_follows_the_distribution() -> None:
    probs = np.array([0.1, 0.0, 0.25, 0.4, 0.05, 0.2])
    n = 20_000
    tokens = sample_from_probs(np.tile(probs, (n, 1)), np.random.default_rng(2).random(n))
    counts = np.bincount(tokens, minlength=probs.size)
    assert not chi2_rejects(counts, probs)
    # The check has power: a mildly different distribution is rejected.
    assert chi2_rejects(counts, np.array([0.12, 0.0, 0.23, 0.4, 0.05, 0.2]))
