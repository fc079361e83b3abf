"""The CPU sampling kernels behind every CPU artifact's sampled decoding.

The softmax (``compiler/cpu_probs.py``): the oracle's distribution for a fixed and a symbolic
vocabulary (shorter than a vector, a multiple of one, with a tail), masked tokens at 0, greedy
rows one-hot at the first maximum; each row's bits the same alone as in a batch; and a row that
neither top-k nor top-p cuts the same bits whichever sampling function its batch-mates'
parameters select. The inverse-CDF draw (``compiler/cpu_sample.py``): the oracle's token
wherever the draw is not within rounding of a boundary, never a zero-probability token, the
last positive one at the top, and each row's token the same alone as in a batch."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from compiled_sampling import cpu_sampler
from sampling_oracle import probs_from_logits, sample_from_probs
from tvm import tirx

from mlc_spec.compiler.cpu_probs import LANES, probs_rows
from mlc_spec.compiler.cpu_sample import BLOCK
from mlc_spec.runtime.params import SamplingParams

TEMPERATURES = (0.7, 1.0, 0.0, 1.3, 1.0, 0.5)


def _rows(v: int, rng: np.random.Generator) -> np.ndarray:
    x = rng.normal(0, 3, (len(TEMPERATURES), v)).astype(np.float32)
    x[0, : min(3, v - 1)] = -np.inf  # masked tokens
    x[2, [v - 1, 0]] = x[2].max() + 1  # the greedy row's maximum twice: the first is one-hot
    x[4] *= 40  # most of the row below exp's floor
    return x


@pytest.mark.parametrize("v", [9, LANES, 1000 + 7])
@pytest.mark.parametrize("fixed", [True, False])
def test_probs_match_the_oracle_and_each_row_alone(v: int, fixed: bool) -> None:
    sampler = cpu_sampler(v if fixed else None)
    x = _rows(v, np.random.default_rng(v))
    params = [SamplingParams(temperature=t) for t in TEMPERATURES]
    batch = sampler.probs(tvm.runtime.tensor(x), params).numpy()
    n = len(TEMPERATURES)
    reference = probs_from_logits(x, np.array(TEMPERATURES), np.zeros(n), np.ones(n))
    np.testing.assert_allclose(batch, reference, rtol=0, atol=2e-6)
    assert (batch[0, : min(3, v - 1)] == 0).all()
    np.testing.assert_array_equal(batch[2], np.eye(v, dtype=np.float32)[0])
    for i in range(n):
        alone = sampler.probs(tvm.runtime.tensor(x[i : i + 1]), params[i : i + 1]).numpy()
        np.testing.assert_array_equal(alone[0], batch[i])


@pytest.mark.parametrize(
    "mate",
    [SamplingParams(temperature=0.8, top_k=5), SamplingParams(temperature=0.8, top_p=0.9)],
    ids=["top-k", "top-p"],
)
def test_an_uncut_row_keeps_its_bits_beside_a_cut_one(mate: SamplingParams) -> None:
    """Beside a row that cuts, the batch takes the sorting function; the uncut row must still
    sample from the bits it gets alone, or its seed's draws could pick another token."""
    sampler = cpu_sampler(1000 + 7)
    x = _rows(1000 + 7, np.random.default_rng(1))[:2]
    plain = SamplingParams(temperature=0.8)
    alone = sampler.probs(tvm.runtime.tensor(x[:1]), [plain]).numpy()[0]
    beside = sampler.probs(tvm.runtime.tensor(x), [plain, mate]).numpy()
    np.testing.assert_array_equal(beside[0], alone)
    assert np.count_nonzero(beside[1]) < np.count_nonzero(beside[0])  # the mate did cut


@pytest.mark.parametrize("v", [7, BLOCK, 3 * BLOCK + 5])
def test_draws_match_the_oracle_away_from_rounding(v: int) -> None:
    sampler = cpu_sampler(v)
    rng = np.random.default_rng(v)
    rows = rng.dirichlet(np.full(v, 0.1), size=4).astype(np.float32)
    rows[:, 1::3] = 0  # zero-probability tokens among them
    probs = np.repeat(rows, 500, axis=0)
    u = rng.random(len(probs))
    u[:4] = np.nextafter(np.float32(1), np.float32(0))  # the top: the last positive token
    tokens = sampler.sample(tvm.runtime.tensor(probs), u)
    assert (probs[np.arange(len(u)), tokens] > 0).all()
    cdf = np.cumsum(probs.astype(np.float64), axis=1)
    draw = u[:, None] * cdf[:, -1:]
    clear = np.abs(cdf - draw).min(axis=1) > 1e-5 * cdf[:, -1]
    reference = sample_from_probs(probs.astype(np.float64), u)
    np.testing.assert_array_equal(tokens[clear], reference[clear])
    assert clear.mean() > 0.9
    last = v - 1 - np.argmax(probs[0, ::-1] > 0)
    assert tokens[0] == last
    for i in (0, 7, 600):
        alone = sampler.sample(tvm.runtime.tensor(probs[i : i + 1]), u[i : i + 1])
        assert alone[0] == tokens[i]


def test_row_kernels_are_built_once_per_fixed_vocabulary():
    """A fixed vocabulary's kernel is parsed once and shared; another size or type, or a
    symbolic vocabulary, gets its own."""
    kernel = probs_rows(tirx.const(300, "int64"))
    assert kernel.same_as(probs_rows(tirx.const(300, "int64")))
    assert not kernel.same_as(probs_rows(tirx.const(301, "int64")))
    assert not kernel.same_as(probs_rows(tirx.const(300, "int32")))
    v = tirx.Var("v", "int64")
    assert not probs_rows(v).same_as(probs_rows(v))
