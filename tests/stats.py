"""Goodness-of-fit checks shared by the losslessness tests (no scipy needed)."""

from __future__ import annotations

import numpy as np

# Upper 1e-4 quantile of the standard normal.
Z_1E4 = 3.7190164854556804


def chi2_critical(df: int) -> float:
    """Upper 1e-4 chi-square quantile by Wilson-Hilferty ((X/df)^(1/3) ~ N(1 - a, a), a = 2/(9df)).

    Against the exact quantile it errs high by 2.7% at df = 4 and under 1% for df >= 15, i.e.
    slightly conservative, which keeps the seeded tests from being flaky while leaving plenty of
    power (the broken samplers below overshoot it by orders of magnitude).
    """
    a = 2.0 / (9.0 * df)
    return float(df * (1.0 - a + Z_1E4 * np.sqrt(a)) ** 3)


def chi2_rejects(counts: np.ndarray, probs: np.ndarray) -> bool:
    """Chi-square goodness of fit at alpha ~1e-4; a count in a zero-probability cell rejects."""
    if counts[probs == 0].any():
        return True
    expected = counts.sum() * probs
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    return float(((obs - exp) ** 2 / exp).sum()) > chi2_critical(obs.size - 1)
