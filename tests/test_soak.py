"""`mlc-spec serve` soaked for 10 minutes (scripts/soak_serve.py): nothing lost or garbled, no
5xx, idle after every wave, RSS flat, a clean SIGTERM. Runs only with MLC_SPEC_RUN_SOAK=1."""

from __future__ import annotations

import pytest
from bench_scripts import script


@pytest.mark.soak
def test_ten_minutes_of_mixed_load_then_sigterm():
    result = script("soak_serve").soak(minutes=10)
    assert result.failures() == [], result.tally.counts
