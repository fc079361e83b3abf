"""The chunk sizer: grows a chunk that fitted its allowance, shrinks one that did not, each at
most by a factor a step."""

from __future__ import annotations

import numpy as np

from mlc_spec.runtime.chunk_sizer import FIRST_CHUNK, MAX_GROWTH, MAX_SHRINK, ChunkSizer


def test_a_chunk_that_fits_grows_and_one_that_overruns_shrinks_in_proportion():
    sizer = ChunkSizer()
    assert sizer.size() == FIRST_CHUNK
    sizer.ran(8, added=0.004, allowance=0.005)  # room for 1.25x: at least a token more
    assert sizer.size() == 10
    sizer.ran(10, added=0.001, allowance=0.005)  # room for 5x: at most double
    assert sizer.size() == 10 * MAX_GROWTH
    sizer.ran(20, added=0.010, allowance=0.005)  # twice the allowance: half the tokens
    assert sizer.size() == 10
    sizer.ran(10, added=1.0, allowance=0.005)  # a step slowed by more than its chunk
    assert sizer.size() == 10 * MAX_SHRINK
    sizer.ran(5, added=1.0, allowance=0.005)
    sizer.ran(2, added=1.0, allowance=0.005)  # never below a token
    assert sizer.size() == 1
    sizer.ran(1, added=-0.001, allowance=0.005)  # the step's noise outweighed the chunk
    assert sizer.size() == 2


def test_a_chunk_cut_short_raises_the_size_only_past_itself():
    sizer = ChunkSizer()
    sizer.ran(3, added=0.001, allowance=0.005)  # the prompt's last 3 tokens
    assert sizer.size() == FIRST_CHUNK
    sizer.ran(3, added=0.004, allowance=0.002)  # ... yet too dear: the size follows them
    assert sizer.size() == 1


def test_steps_settle_near_their_allowance_when_the_pass_costs_more_than_its_tokens():
    """A pass that pays 5 ms for any chunk and 1 ms a token, against a 10 ms allowance (so at
    most 5 tokens), with the step's noise: after a few steps the chunks stay at 3-6 tokens,
    their median at 5, and no step overruns by more than a token and the noise."""
    rng, sizer, allowance = np.random.default_rng(0), ChunkSizer(), 0.010
    sizes, overruns = [], []
    for _ in range(200):
        n = sizer.size()
        added = 0.005 + 0.001 * n + rng.normal(0, 2e-4)
        sizer.ran(n, added, allowance)
        sizes.append(n)
        overruns.append(added - allowance)
    assert min(sizes[10:]) >= 3 and max(sizes[10:]) <= 6 and np.median(sizes) == 5
    assert max(overruns[10:]) <= 0.001 + 3 * 2e-4
