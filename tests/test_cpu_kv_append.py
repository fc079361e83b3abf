"""The KV cache's append kernel on the CPU (``compiler/cpu_kv_append.py``) against TVM's own on
the same inputs, pages bit for bit, and swapped into a model's module. The whole model is covered
against transformers by ``test_model_parity.py``."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
import tvm.runtime
from tiny_models import tiny_config
from tvm.relax.frontend.nn.llm.kv_cache import _kv_cache_transpose_append

from mlc_spec.compiler.cpu_kv_append import UseCPUAppendKernel, transpose_append
from mlc_spec.compiler.targets import make_target
from mlc_spec.models import LlamaForCausalLM, ModelConfig


def _call(kernel, *arrays):
    f = tvm.compile(kernel, target="llvm")
    args = [tvm.runtime.tensor(a) for a in arrays]
    f(*args)
    return [a.numpy() for a in args]


@pytest.mark.parametrize("tokens", [1, 9, 40])
def test_append_matches_tvm(tokens):
    rng = np.random.default_rng(tokens)
    h_kv, d = 3, 64
    pages = rng.standard_normal((8, 2, h_kv, 16, d)).astype(np.float32)
    k, v = (rng.standard_normal((tokens, h_kv, d)).astype(np.float32) for _ in range(2))
    slots = rng.permutation(8 * 16)[:tokens].astype(np.int32)
    slots[1::4] = -1  # not stored
    ours = _call(transpose_append(h_kv, d, "float32"), pages, k, v, slots)[0]
    theirs = _call(_kv_cache_transpose_append(h_kv, d, "float32"), pages, k, v, slots)[0]
    np.testing.assert_array_equal(ours, theirs)
    assert not np.array_equal(ours, pages)


def test_a_model_gets_it():
    hf = {**tiny_config("llama").to_dict(), "architectures": ["LlamaForCausalLM"]}
    cfg = ModelConfig.from_hf(hf)
    model = LlamaForCausalLM(cfg, make_target("llvm"))
    mod, _ = model.export_tvm(spec=model.get_default_spec())
    name = "tir_kv_cache_transpose_append"
    before = mod[name]
    swapped = UseCPUAppendKernel()(mod)
    assert swapped[name].attrs.get("tirx.is_scheduled") and not swapped[name].same_as(before)
