"""The model description shared by the compiler and the artifact: one dataclass, read from a
Hugging Face ``config.json``-style dict (GGUF metadata is mapped to the same dict first)."""

from __future__ import annotations

import dataclasses
from typing import Any

from mlc_spec.errors import UserError

# Hugging Face ``architectures`` entry -> model family implemented in ``models/``.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}

SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")


class ConfigError(UserError):
    """A model configuration that no model in ``models/`` can represent."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes and numerics of a decoder-only transformer of the Llama family."""

    family: str
    hf_architecture: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    context_length: int
    tie_word_embeddings: bool
    attention_bias: bool
    dtype: str = "float32"
    # Token ids the LM head scores, the first ones (``--lm-head-vocab``, for a draft); None: all.
    lm_head_vocab: int | None = None

    @classmethod
    def from_hf(cls, hf: dict[str, Any], dtype: str = "float32") -> ModelConfig:
        """Validate and normalise a Hugging Face config dict; raise ConfigError on anything
        this project does not implement (rather than compiling a model that silently differs)."""
        archs = hf.get("architectures") or []
        known = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
        if not known:
            raise ConfigError(
                f"unsupported architecture {archs or hf.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if dtype not in SUPPORTED_DTYPES:
            raise ConfigError(f"unsupported dtype {dtype!r}; choose one of {SUPPORTED_DTYPES}")
        arch = known[0]
        try:
            hidden = int(hf["hidden_size"])
            n_heads = int(hf["num_attention_heads"])
            cfg = cls(
                family=SUPPORTED_ARCHITECTURES[arch],
                hf_architecture=arch,
                hidden_size=hidden,
                num_hidden_layers=int(hf["num_hidden_layers"]),
                num_attention_heads=n_heads,
                num_key_value_heads=int(hf.get("num_key_value_heads") or n_heads),
                head_dim=int(hf.get("head_dim") or hidden // n_heads),
                intermediate_size=int(hf["intermediate_size"]),
                vocab_size=int(hf["vocab_size"]),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope_theta=float(_rope_theta(hf)),
                rope_scaling=_rope_scaling(hf),
                context_length=int(hf.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                attention_bias=bool(
                    hf.get("attention_bias", SUPPORTED_ARCHITECTURES[arch] == "qwen2")
                ),
                dtype=dtype,
            )
        except KeyError as err:
            raise ConfigError(f"config is missing {err.args[0]!r}") from None
        cfg._check(hf)
        return cfg

    def _check(self, hf: dict[str, Any]) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"unsupported hidden_act {hf['hidden_act']!r} (only silu)")
        window = hf.get("sliding_window")
        if window and hf.get("use_sliding_window", True) and window < self.context_length:
            raise ConfigError(
                f"sliding-window attention ({window} < context {self.context_length}) "
                "is not supported"
            )
        if hf.get("mlp_bias"):
            raise ConfigError("MLP biases are not supported")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls)})


def _rope_theta(hf: dict[str, Any]) -> float:
    # transformers 5 moved rope_theta into rope_parameters.
    params = hf.get("rope_parameters") or {}
    return hf.get("rope_theta") or params.get("rope_theta") or 10000.0


def _rope_scaling(hf: dict[str, Any]) -> dict[str, Any] | None:
    """Return a rope-scaling dict in the form TVM's RoPE functions take (in TVM's KV cache on
    CUDA, in ``compiler/cpu_rope.py`` on the CPU), or None for plain RoPE."""
    scaling = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    kind = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("rope_theta", None)
    if kind == "default":
        return None
    if kind != "llama3":
        raise ConfigError(f"unsupported rope scaling {kind!r} (supported: llama3)")
    need = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in need if k not in scaling]
    if missing:
        raise ConfigError(f"llama3 rope scaling is missing {missing}")
    return {"rope_type": "llama3", **{k: float(scaling[k]) for k in need}}
