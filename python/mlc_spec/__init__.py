"""mlc-spec: compiler-based speculative decoding on Apache TVM Relax."""

from __future__ import annotations

import os

# TVM's CPU thread pool reads this once, at first use, and otherwise ran one thread here:
# default to every core this process may use (a user's own setting wins).
os.environ.setdefault("TVM_NUM_THREADS", str(len(os.sched_getaffinity(0))))

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "SpeculativeConfig", "__version__"]


def __getattr__(name: str):
    # Lazy, so ``import mlc_spec.compiler`` does not load the runtime and the tokenizer stack.
    if name in ("LLM", "SamplingParams", "SpeculativeConfig"):
        from mlc_spec.runtime import llm, params

        return getattr(llm if name == "LLM" else params, name)
    raise AttributeError(name)
