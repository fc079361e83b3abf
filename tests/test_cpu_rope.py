"""The CPU RoPE kernel (``compiler/cpu_rope.py``) against TVM's own ``fused_rope`` on the same
inputs: short (serial) and long (parallel) inputs, default and llama3 scaling. The whole model
is covered against transformers by ``test_model_parity.py``."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
import tvm.runtime
from tvm.relax.frontend.nn.llm.kv_cache import _prepare_yarn_rope_scaling
from tvm.relax.frontend.nn.llm.position_embedding import (
    llama_rope_with_position_map,
    switch_rope_freq_func,
)

from mlc_spec.compiler.cpu_rope import SERIAL_BELOW, _half_periodic, rope_split

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _run(kernel, qkv, positions, h_q, h_kv, *scalars):
    f = tvm.compile(kernel, target="llvm")
    n, _, d = qkv.shape
    outs = [np.zeros((n, h, d), np.float32) for h in (h_q, h_kv, h_kv)]
    args = [tvm.runtime.tensor(x) for x in (qkv, positions, *outs)]
    f(*args, *scalars)
    return [a.numpy() for a in args[2:]]


@pytest.mark.parametrize("scaling", [{}, LLAMA3])
@pytest.mark.parametrize("seq_len", [3, SERIAL_BELOW + 13])
def test_matches_tvm_rope(scaling, seq_len):
    h_q, h_kv, d, theta = 9, 3, 64, 100000.0
    rng = np.random.default_rng(0)
    qkv = rng.standard_normal((seq_len, h_q + 2 * h_kv, d)).astype(np.float32)
    positions = rng.integers(0, 3000, seq_len).astype(np.int32)
    ours = _run(rope_split(theta, scaling, h_q, h_kv, d, "float32"), qkv, positions, h_q, h_kv)
    tvm_rope = llama_rope_with_position_map(
        theta, 1, d, h_q, h_kv, "float32", _prepare_yarn_rope_scaling(scaling, theta), d
    )
    theirs = _run(tvm_rope, qkv, positions, h_q, h_kv, 1)  # 1: apply RoPE
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("scaling", "shared"), [({}, True), (LLAMA3, True), ({"rope_type": "gptj"}, False)]
)
def test_features_i_and_i_plus_half_share_an_angle_only_where_proved(scaling, shared):
    """Rotate-half RoPE computes half the angles; GPT-J's interleaved pairs have no such
    period, and the simplifier must not claim one."""
    freq = switch_rope_freq_func(scaling)
    assert _half_periodic(freq, 64, 10000.0) is shared
