"""Logits processing (temperature, top-k, top-p, greedy) and inverse-CDF sampling: the numpy
oracle and the compiled sampler (float32 on the device) pass the same checks; greedy exactly."""

from __future__ import annotations

import numpy as np
import pytest
import sampling_oracle
from stats import chi2_rejects


def close(actual: np.ndarray, expected) -> None:
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-7)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def one_row(
    sampling, logits: list[float], temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> np.ndarray:
    return sampling.probs_from_logits(np.array([logits], np.float32), temperature, top_k, top_p)[0]


def test_temperature_divides_logits(sampling) -> None:
    close(one_row(sampling, [1, 2, 3], temperature=2.0), softmax(np.array([0.5, 1, 1.5])))
    close(one_row(sampling, [1, 2, 3], temperature=0.5), softmax(np.array([2.0, 4, 6])))


def test_top_k_keeps_the_k_largest(sampling) -> None:
    e2, e3 = np.exp(2.0), np.exp(3.0)
    close(one_row(sampling, [1, 3, 2, 0], top_k=2), [0, e3, e2, 0] / (e2 + e3))
    for off in (0, -1, 4, 10):
        close(one_row(sampling, [1, 3, 2, 0], top_k=off), softmax(np.array([1.0, 3, 2, 0])))
    # Ties at the k-th value are all kept (HF/vLLM thresholding).
    close(one_row(sampling, [2, 1, 2, 0], top_k=1), [0.5, 0, 0.5, 0])


def test_top_p_keeps_smallest_set_reaching_mass(sampling) -> None:
    logits = np.log([0.5, 0.3, 0.15, 0.05]).tolist()
    close(one_row(sampling, logits, top_p=0.75), [0.625, 0.375, 0, 0])
    close(one_row(sampling, logits, top_p=0.85), [0.5, 0.3, 0.15, 0] / np.float64(0.95))
    close(one_row(sampling, logits, top_p=0.01), [1, 0, 0, 0])
    close(one_row(sampling, logits, top_p=1.0), [0.5, 0.3, 0.15, 0.05])
    # Mass exactly reaching top_p stops the set; equal probabilities go by lower token id.
    np.testing.assert_array_equal(one_row(sampling, [0, 0, 0, 0], top_p=0.5), [0.5, 0.5, 0, 0])


def test_order_is_temperature_then_top_k_then_top_p(sampling) -> None:
    logits = np.log([0.4, 0.3, 0.2, 0.1]).tolist()
    # Alone, top_p=0.5 keeps two tokens (0.4 < 0.5); after top_k=2 renormalises to [4/7, 3/7]
    # the first token alone reaches 0.5.
    close(one_row(sampling, logits, top_p=0.5), [4 / 7, 3 / 7, 0, 0])
    close(one_row(sampling, logits, top_k=2, top_p=0.5), [1, 0, 0, 0])
    # Temperature 0.5 squares the probabilities first: [16, 9, 4, 1] / 30, so 16/30 >= 0.5.
    close(one_row(sampling, logits, temperature=0.5, top_p=0.5), [1, 0, 0, 0])


def test_greedy_is_one_hot_of_argmax_with_lowest_index_on_ties(sampling) -> None:
    np.testing.assert_array_equal(one_row(sampling, [1, 3, 3, 0], temperature=0.0), [0, 1, 0, 0])
    np.testing.assert_array_equal(
        one_row(sampling, [1, 3, 3, 0], temperature=0.0, top_k=1, top_p=0.1), [0, 1, 0, 0]
    )


def test_compiled_greedy_equals_oracle_bit_for_bit(compiled_sampling) -> None:
    """Many ties (logits rounded to a coarse grid), -inf, greedy rows beside sampled ones: the
    argmax and the one-hot rows are exactly numpy's."""
    rng = np.random.default_rng(7)
    logits = np.round(rng.normal(size=(40, 300)), 1).astype(np.float32)
    logits[3, :] = logits[3].max()  # a row of nothing but ties
    logits[5, :100] = -np.inf
    temperature = np.where(np.arange(40) % 3 == 0, 0.8, 0.0)
    top_p = np.where(np.arange(40) % 2 == 0, 0.9, 1.0)
    expected = sampling_oracle.probs_from_logits(logits, temperature, 5, top_p)
    greedy = temperature == 0
    for top_k in (5, 0):  # with and without the sorting path
        got = compiled_sampling.probs_from_logits(logits, temperature, top_k, top_p)
        np.testing.assert_array_equal(got[greedy], expected[greedy])
    sampler = compiled_sampling.sampler
    argmax = sampler.argmax(compiled_sampling._tensor(logits))
    np.testing.assert_array_equal(argmax, np.argmax(logits, axis=1))
    assert argmax[3] == 0


def test_per_row_parameters_match_single_row_calls(sampling) -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 9)).astype(np.float32)
    logits[5, [0, 4]] = -np.inf  # masked tokens
    temperature = np.array([1.0, 0.0, 0.7, 1.3, 0.9, 1.0])
    top_k = np.array([0, 3, 4, 0, 2, 5])
    top_p = np.array([1.0, 0.5, 0.8, 0.6, 1.0, 0.9])
    probs = sampling.probs_from_logits(logits, temperature, top_k, top_p)
    assert probs.dtype == np.float64
    close(probs.sum(axis=1), 1.0)
    for i in range(6):
        alone = sampling.probs_from_logits(logits[i : i + 1], temperature[i], top_k[i], top_p[i])
        close(probs[i], alone[0])
    close(probs, sampling_oracle.probs_from_logits(logits, temperature, top_k, top_p))
    assert (probs[5, [0, 4]] == 0).all()
    assert np.count_nonzero(probs[2]) <= 4 and np.count_nonzero(probs[4]) == 2


@pytest.mark.parametrize(
    ("temperature", "top_p"), [(-0.1, 1.0), (1.0, 0.0), (1.0, 1.5)], ids=["neg-temp", "p0", "p>1"]
)
def test_invalid_parameters_raise(sampling, temperature: float, top_p: float) -> None:
    """The compiled path's parameters are ``SamplingParams``: refused there, before any call."""
    with pytest.raises(ValueError):
        sampling.probs_from_logits(np.zeros((1, 3), np.float32), temperature, 0, top_p)


def test_sample_never_picks_zero_probability_tokens(sampling) -> None:
    probs = np.tile(np.array([0.0, 0.3, 0.0, 1e-300, 0.7, 0.0, 0.0]), (4, 1))
    below_one = np.nextafter(1.0, 0.0)
    edges = sampling.sample_from_probs(probs, np.array([0.0, below_one, 0.3, 1.0]))
    np.testing.assert_array_equal(edges, [1, 4, 4, 4])
    u = np.random.default_rng(1).random(10_000)
    # float32 rows that do not sum exactly to one exercise the scaling by the row's own total.
    rough = np.tile((probs[0] * 1.001).astype(np.float32), (u.size, 1))
    for p in (np.tile(probs[0], (u.size, 1)), rough):
        tokens = sampling.sample_from_probs(p, u)
        assert tokens.dtype == np.int64
        assert (p[np.arange(u.size), tokens] > 0).all()


def test_sample_follows_the_distribution(sampling) -> None:
    probs = np.array([0.1, 0.0, 0.25, 0.4, 0.05, 0.2])
    n = 20_000
    tokens = sampling.sample_from_probs(np.tile(probs, (n, 1)), np.random.default_rng(2).random(n))
    counts = np.bincount(tokens, minlength=probs.size)
    assert not chi2_rejects(counts, probs)
    # The check has power: a mildly different distribution is rejected.
    assert chi2_rejects(counts, np.array([0.12, 0.0, 0.23, 0.4, 0.05, 0.2]))
