"""Tiny random Hugging Face checkpoints (Llama, Qwen2) for parity tests: the transformers
model itself is the reference, and its saved directory is what ``mlc-spec compile`` reads."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch
import transformers
import tvm
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from mlc_spec.compiler.cpu_kv_cache import CPUKVCache
from mlc_spec.compiler.pipeline import relax_pipeline
from mlc_spec.compiler.targets import make_target
from mlc_spec.models import LlamaForCausalLM, ModelConfig

VOCAB = 320
BOS, EOS = 1, 2


def tiny_config(family: str, **overrides) -> transformers.PretrainedConfig:
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        bos_token_id=BOS,
        eos_token_id=EOS,
        tie_word_embeddings=family == "qwen2",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    kwargs.update(overrides)
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[family]
    return cls(**kwargs)


def lowered_tiny_llama(noalias: bool) -> tvm.IRModule:
    """A tiny Llama's module through the CPU pipeline (``relax_pipeline``), not built: the VM
    code and kernels a compile would build, for tests of the pipeline's own passes."""
    cfg = ModelConfig.from_hf(
        {**tiny_config("llama").to_dict(), "architectures": ["LlamaForCausalLM"]}
    )
    target = make_target("llvm")
    model = LlamaForCausalLM(cfg, target, CPUKVCache(cfg))
    mod, _ = model.export_tvm(spec=model.get_default_spec())
    with target:
        return relax_pipeline(target, cfg.dtype, noalias=noalias)(mod)


def make_tiny_model(config: transformers.PretrainedConfig, seed: int = 0) -> torch.nn.Module:
    """Random weights large enough that the logits are far from uniform (argmax is stable)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval().float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.15)
    return model


def perturbed_copy(model: torch.nn.Module, scale: float, seed: int = 1) -> torch.nn.Module:
    """A draft that agrees with ``model`` often but not always: its weights plus noise."""
    torch.manual_seed(seed)
    draft = transformers.AutoModelForCausalLM.from_config(model.config).eval().float()
    draft.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(scale * torch.randn_like(p))
    return draft


def quantize_dequantize(
    model: torch.nn.Module, bits: int, half_scales: bool = False
) -> torch.nn.Module:
    """A copy of ``model`` whose linear and embedding weights went through symmetric group-32
    quantization and back: the float model a q4/q8 artifact of ``model`` computes (with int8
    activations, whose q4/q8 keep float16 scales: ``half_scales``)."""
    from mlc_spec.compiler.quantization import dequantize, quantize_symmetric

    copy = transformers.AutoModelForCausalLM.from_config(model.config).eval().float()
    copy.load_state_dict(model.state_dict())
    with torch.no_grad():
        for module in copy.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                w = module.weight.numpy()
                qt = quantize_symmetric(w, bits, half_scales=half_scales)
                module.weight.copy_(torch.from_numpy(dequantize(qt)))
    return copy


def fake_quantize_activations(
    model: torch.nn.Module, group: int | Mapping[str, int | tuple[int, int]] = 16
) -> torch.nn.Module:
    """``model`` with the input of every linear layer quantized to int8 per row and group of
    ``group`` and back (scale amax / 127, round half to even): the float model that an
    ``--activations int8`` artifact of it computes with integer dot products, which round per
    16 values, or per weight group before two-level formats (``int8_matmul.activation_group``).
    A pair (group, super-group) rounds as ``int8_matmul.sub_scaled_quantize_func`` does: one
    amax per super-group, halved up to 3 times per group where the group's values allow. A
    mapping gives each layer (by module name) its own group; layers it does not name keep float
    inputs, as float weights do."""

    def rounded(g: torch.Tensor, amax: torch.Tensor, power: torch.Tensor) -> torch.Tensor:
        inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
        return torch.round(g * (inv * power)) * (amax / 127 / power)

    def quantizer(size: int | tuple[int, int]) -> Callable:
        def quantize(_module: torch.nn.Module, args: tuple) -> tuple:
            x = args[0]
            if isinstance(size, tuple):
                group, super_group = size
                shape = (*x.shape[:-1], x.shape[-1] // super_group, super_group // group, group)
                g = x.reshape(shape)
                amax_g = g.abs().amax(-1, keepdim=True)
                amax = amax_g.amax(-2, keepdim=True)
                e = sum((amax_g * 2**t <= amax).to(x.dtype) for t in (1, 2, 3))
                return rounded(g, amax, 2**e).reshape(x.shape), *args[1:]
            g = x.reshape(*x.shape[:-1], x.shape[-1] // size, size)
            amax = g.abs().amax(-1, keepdim=True)
            return rounded(g, amax, torch.ones_like(amax)).reshape(x.shape), *args[1:]

        return quantize

    for name, module in model.named_modules():
        size = group.get(name) if isinstance(group, Mapping) else group
        if isinstance(module, torch.nn.Linear) and size is not None:
            module.register_forward_pre_hook(quantizer(size))
    return model


def half_kv_cache(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with each layer's keys (after RoPE) and values rounded to float16 and back
    before attention: the float model that an artifact with a float16 KV cache computes
    (``--kv-cache-dtype float16``, the default with int8 activations)."""
    implementation = model.config._attn_implementation
    assert implementation in ("sdpa", None), f"{implementation} attention is not wrapped here"

    def attention(module, query, key, value, *args, **kwargs):
        key, value = key.half().float(), value.half().float()
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    transformers.AttentionInterface.register("half_kv_cache", attention)
    model.set_attn_implementation("half_kv_cache")
    return model


def save_tiny_checkpoint(model: torch.nn.Module, out_dir: Path) -> Path:
    """Save weights, config and a word-level tokenizer over the same vocabulary."""
    model.save_pretrained(out_dir)
    vocab = {"<unk>": 0, "<s>": BOS, "</s>": EOS}
    vocab.update({f"w{i}": i for i in range(3, model.config.vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(out_dir)
    return out_dir


def hf_logits(model: torch.nn.Module, tokens: np.ndarray) -> np.ndarray:
    """Logits of every position of one sequence, [len, vocab]."""
    with torch.no_grad():
        return model(torch.from_numpy(np.asarray(tokens)[None]).long()).logits[0].numpy()
