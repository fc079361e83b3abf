"""``MarkNoAlias``: every PrimFunc that the pipeline leaves in a model's module is ``noalias``.
TVM 0.27's LLVM codegen applies the setting of the module's last function (by name) to all of
them, so one function without it (TVM's own KV-cache kernels, the VM's shape functions) made
every kernel reload its buffers after each store; no parity test would notice."""

from __future__ import annotations

from tiny_models import tiny_config
from tvm import tirx

from mlc_spec.compiler.pipeline import relax_pipeline
from mlc_spec.compiler.targets import make_target
from mlc_spec.models import LlamaForCausalLM, ModelConfig


def test_every_kernel_of_a_model_is_noalias():
    cfg = ModelConfig.from_hf(
        {**tiny_config("llama").to_dict(), "architectures": ["LlamaForCausalLM"]}
    )
    target = make_target("llvm")
    model = LlamaForCausalLM(cfg, target)
    mod, _ = model.export_tvm(spec=model.get_default_spec())
    with target:
        built = relax_pipeline(target, cfg.dtype, rope=(cfg.rope_theta, cfg.rope_scaling))(mod)
    kernels = {gv.name_hint: f for gv, f in built.functions_items() if isinstance(f, tirx.PrimFunc)}
    assert "tree_attn_paged_kv_cpu" in kernels  # one of TVM's kernels without the attribute
    assert [name for name, f in kernels.items() if not f.attrs.get("tirx.noalias", False)] == []
