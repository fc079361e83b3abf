"""Model definitions: what a model is, with no I/O and no target-specific code."""

from .config import SUPPORTED_ARCHITECTURES, ConfigError, ModelConfig
from .llama import LlamaForCausalLM, hf_sources

# Qwen2 is the Llama decoder with QKV bias (``ModelConfig.attention_bias``); both families share
# one implementation rather than two copies that differ by a flag.
MODEL_CLASSES = {"llama": LlamaForCausalLM, "qwen2": LlamaForCausalLM}

__all__ = [
    "MODEL_CLASSES",
    "SUPPORTED_ARCHITECTURES",
    "ConfigError",
    "LlamaForCausalLM",
    "ModelConfig",
    "hf_sources",
]
