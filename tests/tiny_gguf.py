"""Writing small GGUF files for tests, the way llama.cpp's converter lays them out: float
tensors as given, or raw quantized blocks of any GGUF type; and a tiny model mixing every
supported type."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
import transformers
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from tiny_models import tiny_config

CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"

_HF_TO_GGUF = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# gguf's Python package has no quantizer for the K types: random blocks with finite f16 super
# scales at these byte offsets stand in for them.
_K_TYPE_F16_OFFSETS = {T.Q2_K: (80, 82), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's permute() for Q/K (the direction a real file went)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_name(hf_name: str) -> str:
    stem, suffix = hf_name.rsplit(".", 1)
    if stem.startswith("model.layers."):
        layer, rest = stem.removeprefix("model.layers.").split(".", 1)
        return f"blk.{layer}.{_HF_TO_GGUF[rest]}.{suffix}"
    return f"{_HF_TO_GGUF[stem]}.{suffix}"


def quantized_blocks(w: np.ndarray, ggml_type: T, rng: np.random.Generator) -> np.ndarray:
    """Raw blocks of ``ggml_type`` for a [N, K] weight: ``w`` quantized where gguf can, random
    valid blocks of the right size for the K types."""
    if ggml_type not in _K_TYPE_F16_OFFSETS:
        return gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), ggml_type)
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    blocks = rng.integers(0, 256, (w.size // block_size, type_size), dtype=np.uint8)
    for offset in _K_TYPE_F16_OFFSETS[ggml_type]:
        d = (rng.standard_normal(len(blocks)) * 0.01).astype(np.float16)
        blocks[:, offset : offset + 2] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(w.shape[0], -1)


def write_gguf(
    path: Path,
    arch: str,
    dims: dict,
    state: dict[str, np.ndarray],
    types: dict[str, T] | None = None,
    seed: int = 0,
    floats: dict[str, float] | None = None,
    **meta,
) -> None:
    """A GGUF file of architecture ``arch`` with Hugging Face config ``dims`` and tensors
    ``state`` (Hugging Face names, float32); ``types`` stores some of them quantized (by HF
    name); ``floats``: more metadata keys, as float32. Llama Q/K rows are permuted as
    llama.cpp's converter does before quantizing."""
    types = types or {}
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(dims["num_hidden_layers"])
    writer.add_context_length(dims["max_position_embeddings"])
    writer.add_embedding_length(dims["hidden_size"])
    writer.add_feed_forward_length(dims["intermediate_size"])
    writer.add_head_count(dims["num_attention_heads"])
    writer.add_head_count_kv(dims["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(meta.get("rope_theta", 10000.0))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(dims["vocab_size"])])
    writer.add_token_types([1] * dims["vocab_size"])
    writer.add_token_scores([0.0] * dims["vocab_size"])
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)
    for key, value in (floats or {}).items():
        writer.add_float32(key, value)
    heads = {"attn_q": dims["num_attention_heads"], "attn_k": dims["num_key_value_heads"]}
    for name, w in state.items():
        name_in_file = gguf_name(name)
        kind = name_in_file.split(".")[-2]
        if arch == "llama" and kind in heads:
            w = llama_cpp_permute(w, heads[kind])
        if name in types:
            blocks = quantized_blocks(w, types[name], rng)
            writer.add_tensor(name_in_file, blocks, raw_dtype=types[name])
        else:
            writer.add_tensor(name_in_file, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# K-type super-blocks are 256 weights long, so every reduction axis is 256 here.
DIMS = dict(
    hidden_size=256,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=320,
    max_position_embeddings=256,
)
LAYER_TYPES = [
    {  # fused parts in different formats: q/k Q4_K and v Q6_K, gate Q4_0 and up Q4_1
        "self_attn.q_proj": T.Q4_K,
        "self_attn.k_proj": T.Q4_K,
        "self_attn.v_proj": T.Q6_K,
        "self_attn.o_proj": T.Q5_K,
        "mlp.gate_proj": T.Q4_0,
        "mlp.up_proj": T.Q4_1,
        "mlp.down_proj": T.Q5_0,
    },
    {  # o_proj stays float (F16 in the file); gate/up Q4_K stay two-level; q Q8_0 and k Q5_0
        # load alike with float activations (8-bit, k widened), apart with int8 ones
        "self_attn.q_proj": T.Q8_0,
        "self_attn.k_proj": T.Q5_0,
        "self_attn.v_proj": T.Q5_1,
        "mlp.gate_proj": T.Q4_K,
        "mlp.up_proj": T.Q4_K,
        "mlp.down_proj": T.Q6_K,
    },
]


def write_mixed_gguf(path: Path, arch: str, override: dict[str, T] | None = None) -> Path:
    """A tiny random model of ``DIMS`` with every supported tensor type (``LAYER_TYPES``, Q8_0
    embeddings, a Q6_K LM head unless tied), fused parts of mixed types among them; ``override``
    changes some tensors' types (by Hugging Face name)."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(tiny_config(arch, **DIMS)).eval().float()
    state = {k: (0.05 * torch.randn_like(v)).numpy() for k, v in hf.state_dict().items()}
    types = {"model.embed_tokens.weight": T.Q8_0, "lm_head.weight": T.Q6_K}
    for layer, kinds in enumerate(LAYER_TYPES):
        for kind, ggml_type in kinds.items():
            types[f"model.layers.{layer}.{kind}.weight"] = ggml_type
    state["model.layers.1.self_attn.o_proj.weight"] = state[
        "model.layers.1.self_attn.o_proj.weight"
    ].astype(np.float16)
    if arch == "qwen2":  # tied: the file has no output tensor
        del state["lm_head.weight"]
    types.update(override or {})
    write_gguf(path, arch, DIMS, state, types)
    return path
