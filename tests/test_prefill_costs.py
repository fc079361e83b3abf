"""The chunk cost model: seconds(n, c) = n (a + b (c + n / 2)) fitted to measured passes."""

from __future__ import annotations

import numpy as np

from mlc_spec.runtime.prefill_costs import PrefillCosts


def test_the_fit_recovers_the_costs_and_bounds_the_chunk():
    costs, rng = PrefillCosts(), np.random.default_rng(0)
    a, b = 1.5e-4, 4e-7
    assert costs.fit() is None and costs.most_tokens(0, 1.0) is None
    for _ in range(40):
        chunks = [(int(rng.integers(0, 2000)), int(rng.integers(1, 64))) for _ in range(2)]
        costs.observe(chunks, sum(n * (a + b * (c + n / 2)) for c, n in chunks))
    assert np.allclose(costs.fit(), (a, b), rtol=1e-9)
    n = costs.most_tokens(2000, 0.014)

    def seconds(tokens: int) -> float:
        return tokens * (a + b * (2000 + tokens / 2))

    assert seconds(n) <= 0.014 < seconds(n + 1)


def test_passes_at_one_context_give_a_per_token_cost():
    costs = PrefillCosts()
    costs.observe([(0, 64)], 0.010)
    costs.observe([(0, 32)], 0.005)
    a, b = costs.fit()
    assert b == 0 and np.isclose(a, 0.010 / 64)
    assert costs.most_tokens(500, 0.010) == 64
