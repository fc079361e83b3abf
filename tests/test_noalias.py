"""``SetNoAlias``: every PrimFunc that the pipeline leaves in a model's module has the same
``tirx.noalias`` setting. TVM 0.27's LLVM codegen applies the setting of the module's last
function (by name) to all of them, so one function without it (TVM's own KV-cache kernels,
the VM's shape functions) made a float artifact's matmuls store their accumulators after
each multiply-add (2x slower prefill); no parity test would notice."""

from __future__ import annotations

import pytest
from tiny_models import lowered_tiny_llama
from tvm import tirx


@pytest.mark.parametrize("noalias", [True, False])
def test_every_kernel_of_a_model_has_one_noalias_setting(noalias):
    built = lowered_tiny_llama(noalias)
    kernels = {gv.name_hint: f for gv, f in built.functions_items() if isinstance(f, tirx.PrimFunc)}
    # the VM's shape functions come without the attribute, the KV cache's kernels and the
    # scheduled matmuls with their own
    assert any(name.startswith("shape_func") for name in kernels), sorted(kernels)
    assert {"paged_attention_cpu", "kv_append_cpu", "rope_split_cpu"} <= kernels.keys()
    settings = {name: bool(f.attrs.get("tirx.noalias", False)) for name, f in kernels.items()}
    assert {name for name, value in settings.items() if value != noalias} == set()
