"""The CPU append kernel (``compiler/cpu_kv_append.py``): each token's K and V into its slot of
one layer's pages, keys feature-major and values slot-major, bit for bit, and nothing else
written; on float16 pages each value rounded to nearest even, as numpy rounds it."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
import tvm.runtime

from mlc_spec.compiler.cpu_attention import PAGE
from mlc_spec.compiler.cpu_kv_append import append_kv


@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
@pytest.mark.parametrize("tokens", [1, 9, 40])
def test_append(tokens, kv_dtype):
    rng = np.random.default_rng(tokens)
    layers, layer, num_pages, h_kv, d = 3, 1, 8, 3, 64
    pages = rng.standard_normal((layers, num_pages, 2, h_kv, PAGE * d)).astype(kv_dtype)
    # values float16 rounds both ways, and ones past its range and below its normal numbers
    k, v = (rng.standard_normal((tokens, h_kv, d)).astype(np.float32) for _ in range(2))
    k.flat[:3] = [1 + 2**-11, 7e4, 3e-6]
    slots = rng.permutation(num_pages * PAGE)[:tokens].astype(np.int32)
    args = [tvm.runtime.tensor(a) for a in (pages, k, v, slots)]
    tvm.compile(append_kv(h_kv, d, "float32", kv_dtype), target="llvm")(*args, layer)
    expected = pages.copy()
    with np.errstate(over="ignore"):  # 7e4 is past float16's range: inf, as the kernel rounds
        k, v = k.astype(kv_dtype), v.astype(kv_dtype)
    for t, slot in enumerate(slots):
        page, at = expected[layer, slot // PAGE], slot % PAGE
        page[0, :, at::PAGE] = k[t]
        page[1, :, at * d : (at + 1) * d] = v[t]
    np.testing.assert_array_equal(args[0].numpy(), expected)
