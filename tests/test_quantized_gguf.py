"""GGUF files compiled as shipped (``--quantization as-source``): every supported block type,
mixed inside one fused matrix, runs exactly the model that transformers' dequantized reading
of the same file runs; unsupported types and inapplicable flags are refused cleanly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as T
from tiny_gguf import DIMS, LAYER_TYPES, write_mixed_gguf
from tiny_models import fake_quantize_activations, half_kv_cache, tiny_config

from mlc_spec.compiler.compile import compile_model
from mlc_spec.compiler.errors import CompileError
from mlc_spec.compiler.int8_matmul import activation_group, integer_dot, sub_scaled
from mlc_spec.compiler.options import CompileOptions
from mlc_spec.compiler.quantization import (
    GroupFormat,
    dequantize,
    format_of,
    quantize_symmetric,
)
from mlc_spec.compiler.quantization import plan as plan_module
from mlc_spec.compiler.quantization.plan import (
    Quantize,
    layer_layouts,
    plan_quantization,
    requantize_lm_head,
)
from mlc_spec.compiler.sources import load_source
from mlc_spec.compiler.targets import make_target
from mlc_spec.runtime.artifact import read_config
from mlc_spec.runtime.model import Model

# A fused weight whose parts the file stores in different formats is kept in segments, one
# per run of parts in one format (``weight.0``, ``weight.1``, ...), never promoted to a wider
# common format.
EXPECTED_FORMATS = {
    "model.embed_tokens.weight": "q8g32",
    "lm_head.weight": "q8g16",
    "model.layers.0.self_attn.qkv_proj.weight.0": "q4g32a",  # Q4_K q, k multiplied out
    "model.layers.0.self_attn.qkv_proj.weight.1": "q8g16",  # Q6_K v
    "model.layers.0.self_attn.o_proj.weight": "q8g32a",
    "model.layers.0.mlp.gate_up_proj.weight.0": "q4g32",  # Q4_0 gate
    "model.layers.0.mlp.gate_up_proj.weight.1": "q4g32a",  # Q4_1 up
    "model.layers.0.mlp.down_proj.weight": "q8g32",
    "model.layers.1.self_attn.qkv_proj.weight.0": "q8g32",  # Q8_0 q, Q5_0 k widened
    "model.layers.1.self_attn.qkv_proj.weight.1": "q8g32a",  # Q5_1 v
    "model.layers.1.self_attn.o_proj.weight": "float32",
    "model.layers.1.mlp.gate_up_proj.weight": "q4g32a",  # Q4_K gate and up
    "model.layers.1.mlp.down_proj.weight": "q8g16",
}


def _reference(path, arch: str, num_layers: int = DIMS["num_hidden_layers"]) -> torch.nn.Module:
    """transformers on the file's weights dequantized by the gguf package; its first
    ``num_layers`` layers."""
    config = tiny_config(arch, **{**DIMS, "num_hidden_layers": num_layers})
    hf = transformers.AutoModelForCausalLM.from_config(config).eval().float()
    tensors = load_source(path).tensors
    layer = {n: int(n.split(".")[2]) for n in tensors if n.startswith("model.layers.")}
    kept = [n for n in tensors if layer.get(n, 0) < num_layers]
    state = {name: torch.from_numpy(np.array(tensors[name])) for name in kept}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return hf


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_as_source_matches_transformers(tmp_path, arch):
    """Every tensor as shipped; llama's Q6_K LM head also with ``--lm-head-quantization q4``
    (as for a draft model): symmetric q4 groups of the file's dequantized values, which the
    reference gets too."""
    path = write_mixed_gguf(tmp_path / "tiny.gguf", arch)
    lm_head = "q4" if arch == "llama" else None
    artifact = compile_model(
        path, "llvm", tmp_path / "artifact", CompileOptions(lm_head=lm_head), show_progress=False
    )
    assert read_config(artifact)["quantization"] == "as-source"
    formats = _stored_formats(artifact)
    expected = dict(EXPECTED_FORMATS)
    if arch == "qwen2":
        del expected["lm_head.weight"]
        expected["model.embed_tokens.weight"] = "q8g32"
    else:
        expected["lm_head.weight"] = "q4g32"
    assert {w: formats[w] for w in expected} == expected
    assert "model.layers.0.self_attn.qkv_proj.weight" not in formats  # only its segments

    hf = _reference(path, arch)
    if lm_head is not None:
        head = hf.lm_head.weight.detach().numpy()
        requantized = dequantize(quantize_symmetric(head, 4))
        assert not np.array_equal(requantized, head)
        hf.lm_head.weight.data = torch.from_numpy(requantized)
    seq = np.random.default_rng(0).integers(0, DIMS["vocab_size"], 44)
    ref = _logits(hf, seq)[35:]
    ours = _our_logits(artifact, seq)
    assert np.abs(ours - ref).max() <= 1e-5 * np.abs(ref).max()  # float32 summation order only
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))


def test_gguf_int8_formats_equal_portable(tiny_gguf_int8, tmp_path, monkeypatch):
    """With int8 activations Q4_K and Q6_K stay two-level, Q5_0 keeps 5-bit codes and the
    one-level types their f16 scales, and they compute bit for bit the logits of the same file
    compiled with their portable formats (8-bit ``q8g32`` with float32 scales, one-level
    ``q4g32`` / ``q4g32a``, as the float path loads them): every product of their decoding is
    exact. Q4_K and Q6_K stay two-level in both: their activations round per 256 (with
    power-of-two steps per group on the vpmaddubsw path) or per group, where one-level formats
    round per 16, so their twins are pinned by test_int8_matmul where they exist. A Q4_K
    embedding table that the lookup decodes, a Q6_K LM head and down projection, a Q5_0 down
    projection."""
    path = tiny_gguf_int8.parent / "tiny.gguf"
    formats = _stored_formats(tiny_gguf_int8)
    assert formats["model.layers.0.mlp.down_proj.weight"] == "q5g32h"
    assert formats["model.layers.0.self_attn.qkv_proj.weight.0"] == "q4g32as256"  # Q4_K q, k
    assert formats["model.layers.0.self_attn.qkv_proj.weight.1"] == "q6g16s256"  # Q6_K v
    assert formats["model.layers.0.mlp.gate_up_proj.weight.0"] == "q4g32h"  # Q4_0 gate
    assert formats["model.layers.0.mlp.gate_up_proj.weight.1"] == "q4g32ah"  # Q4_1 up
    assert formats["model.layers.1.mlp.gate_up_proj.weight"] == "q4g32as256"
    assert formats["model.layers.1.mlp.down_proj.weight"] == "q6g16s256"
    assert formats["model.layers.1.self_attn.qkv_proj.weight.0"] == "q8g32h"  # Q8_0 q
    assert formats["model.layers.1.self_attn.qkv_proj.weight.1"] == "q5g32h"  # Q5_0 k
    assert formats["model.layers.1.self_attn.qkv_proj.weight.2"] == "q5g32ah"  # Q5_1 v
    assert formats["model.embed_tokens.weight"] == "q4g32as256"
    assert formats["lm_head.weight"] == "q6g16s256"

    two_level, load = {format_of(T.Q4_K), format_of(T.Q6_K)}, plan_module._load

    def portable(stored, cap, int8_formats):
        return load(stored, cap, int8_formats=stored in two_level)

    monkeypatch.setattr(plan_module, "_load", portable)
    widened = compile_model(
        path, "llvm", tmp_path / "portable", CompileOptions(activations="int8"), show_progress=False
    )
    stored = set(_stored_formats(widened).values())
    assert {"q4g32as256", "q6g16s256", "q4g32a", "q8g32"} <= stored
    assert not {"q5g32h", "q4g32h", "q4g32ah"} & stored
    seq = np.random.default_rng(0).integers(0, DIMS["vocab_size"], 44)
    np.testing.assert_array_equal(_our_logits(tiny_gguf_int8, seq), _our_logits(widened, seq))


def test_gguf_int8_tied_q6k_table_matches_transformers(tmp_path):
    """A tied Q6_K table with int8 activations (Qwen2.5's as shipped), decoded by the lookup
    and by the LM head alike, computes what transformers computes on the file's dequantized
    weights with each linear layer's input rounded to int8 as the kernel rounds it before its
    format (per 16 values; before Q4_K and Q6_K per group, or on the vpmaddubsw path per 256
    with power-of-two steps per group) and the keys and values to float16, as the artifact's
    KV cache holds them; the first layer only, to keep the suite short."""
    override = {"model.embed_tokens.weight": T.Q6_K}
    path = write_mixed_gguf(tmp_path / "tiny.gguf", "qwen2", override)
    artifact = compile_model(
        path,
        "llvm",
        tmp_path / "artifact",
        CompileOptions(activations="int8", num_layers=1),
        show_progress=False,
    )
    formats = _stored_formats(artifact)
    assert formats["model.embed_tokens.weight"] == "q6g16s256"
    assert "lm_head.weight" not in formats  # tied
    assert formats["model.layers.0.self_attn.qkv_proj.weight.1"] == "q6g16s256"  # Q6_K v

    types = {f"model.layers.0.{kind}": t for kind, t in LAYER_TYPES[0].items()}
    layers = {**types, "lm_head": T.Q6_K}
    dot = integer_dot(make_target("llvm"))
    groups = {name: _rounding(dot, format_of(t)) for name, t in layers.items()}
    hf = half_kv_cache(fake_quantize_activations(_reference(path, "qwen2", num_layers=1), groups))
    seq = np.random.default_rng(0).integers(0, DIMS["vocab_size"], 44)
    ref = _logits(hf, seq)[35:]
    ours = _our_logits(artifact, seq)
    # An activation on a rounding boundary can round the other way after float32 sums in
    # another order, and moves the positions after it: measured, the median entry is 3e-8 of
    # the largest logit off and the worst 1.7e-3; the reference rounding Q4_K's activations per
    # 16 instead of 32 misses by 6e-4 (median) and 3.6e-2 (worst).
    miss = np.abs(ours - ref) / np.abs(ref).max()
    assert np.median(miss) <= 1e-6
    assert miss.max() <= 5e-3
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))


def _rounding(dot, fmt) -> int | tuple[int, int]:
    """How ``dot`` rounds activations before ``fmt``, as ``fake_quantize_activations`` takes it."""
    return (fmt.group_size, fmt.super_group) if sub_scaled(dot, fmt) else activation_group(fmt)


def _stored_formats(artifact) -> dict[str, str]:
    return {p.weight: p.format for p in read_config(artifact)["params"]}


def test_plan_keeps_fused_parts_apart_by_loaded_format():
    """Segments follow the formats that load: Q5_0 q with Q8_0 k/v (Qwen2.5-0.5B Q4_K_M) are one
    8-bit matrix with float activations, a 5-bit and an 8-bit segment with int8 ones; each
    segment names its parts and rows."""
    q, k, v = (f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv")
    stored = {q: format_of(T.Q5_0), k: format_of(T.Q8_0), v: format_of(T.Q8_0)}
    shapes = {q: (64, 32), k: (16, 32), v: (16, 32)}
    weights = {"model.layers.0.self_attn.qkv_proj.weight": (96, 32)}
    portable = plan_quantization(weights, stored, shapes, "as-source")
    assert portable == {
        "model.layers.0.self_attn.qkv_proj.weight": Quantize(
            format_of(T.Q8_0).portable, as_stored=True
        )
    }
    apart = plan_quantization(weights, stored, shapes, "as-source", int8_formats=True)
    assert apart == {
        "model.layers.0.self_attn.qkv_proj.weight.0": Quantize(format_of(T.Q5_0), True, (q,), 64),
        "model.layers.0.self_attn.qkv_proj.weight.1": Quantize(format_of(T.Q8_0), True, (k, v), 32),
    }
    segments = layer_layouts(apart)["model.layers.0.self_attn.qkv_proj.weight"]
    assert [(s.rows, s.fmt.name) for s in segments] == [(64, "q5g32h"), (32, "q8g32h")]
    with pytest.raises(CompileError, match="have 96 rows, expected 80"):
        plan_quantization(
            {"model.layers.0.self_attn.qkv_proj.weight": (80, 32)},
            stored,
            shapes,
            "as-source",
            int8_formats=True,
        )


def test_plan_q4_caps_the_code_width():
    """``q4`` keeps the parts stored in 4 bits as they are and group-quantizes the wider ones
    (Q4_K q/k with a Q6_K v: Qwen2.5-1.5B Q4_K_M's), each run of parts its own segment; ``q8``
    keeps every quantized part and quantizes only float ones."""
    q, k, v = (f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv")
    stored = {q: format_of(T.Q4_K), k: format_of(T.Q4_K), v: format_of(T.Q6_K)}
    shapes = {q: (64, 256), k: (16, 256), v: (16, 256)}
    weights = {"model.layers.0.self_attn.qkv_proj.weight": (96, 256)}
    capped = plan_quantization(weights, stored, shapes, "q4", int8_formats=True)
    assert capped == {
        "model.layers.0.self_attn.qkv_proj.weight.0": Quantize(format_of(T.Q4_K), True, (q, k), 80),
        "model.layers.0.self_attn.qkv_proj.weight.1": Quantize(
            GroupFormat(4, 32, half_scales=True), False, (v,), 16
        ),
    }
    as_source = plan_quantization(weights, stored, shapes, "as-source", int8_formats=True)
    assert plan_quantization(weights, stored, shapes, "q8", int8_formats=True) == as_source
    with_float = plan_quantization(weights, {**stored, v: None}, shapes, "q8", int8_formats=True)
    assert with_float["model.layers.0.self_attn.qkv_proj.weight.1"] == Quantize(
        GroupFormat(8, 32, half_scales=True), False, (v,), 16
    )


def test_gguf_q4_requantizes_wider_tensors_and_matches_transformers(tmp_path):
    """``--quantization q4`` on a GGUF (for a draft model): the Q4_0/Q4_1/Q4_K tensors load as
    shipped, every wider or float one is group-quantized to symmetric q4 from the file's
    values; transformers on the file's values with those same re-quantized ones computes the
    same logits."""
    path = write_mixed_gguf(tmp_path / "tiny.gguf", "llama")
    artifact = compile_model(
        path, "llvm", tmp_path / "artifact", CompileOptions(quantization="q4"), show_progress=False
    )
    assert read_config(artifact)["quantization"] == "q4"
    formats = _stored_formats(artifact)
    expected = {
        "model.embed_tokens.weight": "q4g32",  # Q8_0
        "lm_head.weight": "q4g32",  # Q6_K
        "model.layers.0.self_attn.qkv_proj.weight.0": "q4g32a",  # Q4_K q, k as shipped
        "model.layers.0.self_attn.qkv_proj.weight.1": "q4g32",  # Q6_K v
        "model.layers.0.self_attn.o_proj.weight": "q4g32",  # Q5_K
        "model.layers.0.mlp.gate_up_proj.weight.0": "q4g32",  # Q4_0 gate as shipped
        "model.layers.0.mlp.gate_up_proj.weight.1": "q4g32a",  # Q4_1 up as shipped
        "model.layers.0.mlp.down_proj.weight": "q4g32",  # Q5_0
        "model.layers.1.self_attn.qkv_proj.weight": "q4g32",  # Q8_0, Q5_0, Q5_1: one run
        "model.layers.1.self_attn.o_proj.weight": "q4g32",  # F16
        "model.layers.1.mlp.gate_up_proj.weight": "q4g32a",  # Q4_K as shipped
        "model.layers.1.mlp.down_proj.weight": "q4g32",  # Q6_K
    }
    assert {w: formats.get(w) for w in expected} == expected

    hf = _reference(path, "llama")
    four_bit = {T.Q4_0, T.Q4_1, T.Q4_K}
    types = {
        f"model.layers.{i}.{kind}.weight": t
        for i, kinds in enumerate(LAYER_TYPES)
        for kind, t in kinds.items()
    }
    requantized = [n for n, t in types.items() if t not in four_bit]
    requantized += ["model.layers.1.self_attn.o_proj.weight"]  # F16, not in LAYER_TYPES
    requantized += ["model.embed_tokens.weight", "lm_head.weight"]
    params = dict(hf.named_parameters())
    for name in requantized:
        w = params[name].detach().numpy()
        params[name].data = torch.from_numpy(dequantize(quantize_symmetric(w, 4)))
    seq = np.random.default_rng(0).integers(0, DIMS["vocab_size"], 44)
    ref = _logits(hf, seq)[35:]
    ours = _our_logits(artifact, seq)
    assert np.abs(ours - ref).max() <= 1e-5 * np.abs(ref).max()  # float32 summation order only
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))


def _logits(hf: torch.nn.Module, seq: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.from_numpy(seq[None]).long()).logits[0].numpy()


def _our_logits(artifact, seq: np.ndarray) -> np.ndarray:
    """Logits of ``seq[35:]``: a prefill of 36 tokens, 2 decodes, then one multi-query pass."""
    model = Model(artifact)
    kv = model.create_kv_cache(max_batch_size=2, max_total_len=512, prefill_chunk_size=64)
    kv.add_sequence(0)
    return np.concatenate(
        [
            model.prefill(kv, [0], [seq[:36]]).numpy(),
            np.stack([model.decode(kv, [0], [t]).numpy()[0] for t in seq[36:38]]),
            model.evaluate_multi_query(kv, [0], [seq[38:]]).numpy(),
        ]
    )


def _refused(tmp_path, path, *fragments: str, **kwargs) -> None:
    out = tmp_path / "refused"
    with pytest.raises(CompileError) as info:
        compile_model(path, "llvm", out, CompileOptions(**kwargs), show_progress=False)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    assert not out.exists() and not list(tmp_path.glob(".refused*"))


def test_bad_quantization_requests_are_refused(tmp_path):
    path = write_mixed_gguf(tmp_path / "tiny.gguf", "llama")
    _refused(tmp_path, path, "unknown quantization 'q3'", quantization="q3")
    _refused(tmp_path, path, "unknown LM head quantization 'q2'", "q4, q8", lm_head="q2")
    unsupported = write_mixed_gguf(
        tmp_path / "q2k.gguf", "llama", {"model.layers.0.mlp.gate_proj.weight": T.Q2_K}
    )
    _refused(tmp_path, unsupported, "q2k.gguf", "blk.0.ffn_gate.weight", "Q2_K", "supported")


def test_requantize_lm_head_picks_the_head_or_the_tied_table():
    table, head = "model.embed_tokens.weight", "lm_head.weight"
    plan = {table: Quantize(format_of(T.Q8_0), as_stored=True)}
    untied = requantize_lm_head(plan, {table: (64, 32), head: (64, 32)}, "q4")
    assert untied == {**plan, head: Quantize(GroupFormat(4, 32))}
    tied = requantize_lm_head(plan, {table: (64, 32)}, "q8")
    assert tied == {table: Quantize(GroupFormat(8, 32))}
    with pytest.raises(CompileError, match="48 columns, not a multiple of 32"):
        requantize_lm_head({}, {head: (64, 48)}, "q4")
