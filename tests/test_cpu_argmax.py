"""The CPU argmax kernel (``compiler/cpu_argmax.py``) that every artifact's greedy sampler uses:
``np.argmax`` exactly, lowest index on ties, for a fixed vocabulary and a symbolic one, shorter
than a vector, a multiple of it and with a tail, for one row (the calling thread) and several
(the thread pool)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import te, topi
from tvm.runtime.vm import VirtualMachine

from mlc_spec.compiler.cpu_argmax import LANES, NAME, UseCPUArgmaxKernel, argmax_rows
from mlc_spec.compiler.pipeline import relax_pipeline
from mlc_spec.compiler.sampler import attach_sampler
from mlc_spec.compiler.targets import make_target

F32 = "float32"


def _argmax_tokens(vocab_size: int | None):
    target = make_target("llvm")
    mod = attach_sampler(tvm.IRModule(), vocab_size)
    vm = VirtualMachine(
        tvm.compile(mod, target, relax_pipeline=relax_pipeline(target, F32)), tvm.cpu()
    )
    return vm["argmax_tokens"]


def _hard_rows(v: int, rng: np.random.Generator) -> np.ndarray:
    """Random rows, and rows whose maximum sits where a lane-wise kernel could go wrong."""
    rows = rng.normal(size=(12, v)).astype(np.float32)
    rows[1, [v - 1, 0]] = 50  # tie between the first and the last element
    rows[2, v - 1] = 50  # in the tail (or the last lane)
    rows[3, :] = -np.inf  # nothing but -inf: index 0
    rows[4, :] = 1.5  # nothing but ties: index 0
    rows[5, [min(LANES + 3, v - 1), 3 % v]] = 50  # same lane, earlier vector first
    rows[6, [min(LANES + 1, v - 1), 2 % v]] = 50  # lanes 1 and 2: the lower index wins
    rows[7, v // 2] = np.float32(3e38)
    rows[8, :] = np.round(rows[8], 0)  # coarse grid: many ties
    rows[9, :] = -0.0
    rows[9, v // 3] = 0.0  # -0 == +0: the first zero
    return rows


@pytest.mark.parametrize("v", [9, LANES, 300, 1000 + 7])
@pytest.mark.parametrize("fixed", [True, False])
def test_argmax_equals_numpy(v: int, fixed: bool) -> None:
    argmax_tokens = _argmax_tokens(v if fixed else None)
    rows = _hard_rows(v, np.random.default_rng(v))
    for batch in (rows, rows[2:3], rows[5:6]):
        got = argmax_tokens(tvm.runtime.tensor(batch)).numpy()
        np.testing.assert_array_equal(got, np.argmax(batch, axis=1))


def test_swaps_only_the_samplers_argmax() -> None:
    """The sampler's argmax becomes the kernel; a function of that name computing something else
    (here the last index on ties) is left as it is."""
    mod = attach_sampler(tvm.IRModule(), 300)
    swapped = UseCPUArgmaxKernel()(mod)
    expected = argmax_rows(mod[NAME].params[0].ty.shape[1])
    assert tvm_ffi.structural_equal(swapped[NAME], expected, map_free_vars=True)

    x = te.placeholder((te.var("n", "int64"), 300), F32, "logits")
    last = topi.argmax(x, axis=1, select_last_index=True)  # int64, the last index on ties
    other = tvm.IRModule({NAME: te.create_prim_func([x, last], index_dtype_override="int64")})
    assert tvm_ffi.structural_equal(UseCPUArgmaxKernel()(other)[NAME], other[NAME])
