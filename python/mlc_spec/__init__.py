"""mlc-spec: compiler-based speculative decoding on Apache TVM Relax."""

from __future__ import annotations

import os

# TVM's CPU thread pool reads this once, at first use, and otherwise ran one thread here:
# default to every core this process may use (a user's own setting wins).
_cores = len(os.sched_getaffinity(0))
os.environ.setdefault("TVM_NUM_THREADS", str(_cores))
# TVM pins its threads to the machine's first cores whatever this process's CPU mask says (a
# pool of one: core 0), so processes sharing a machine (replicas, test workers, a ``taskset``)
# pile onto the same cores: pin only where the pool spans the whole machine.
_threads = os.environ["TVM_NUM_THREADS"]
if min(_cores, int(_threads) if _threads.isdigit() else _cores) < (os.cpu_count() or 1):
    os.environ.setdefault("TVM_BIND_THREADS", "0")

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "SpeculativeConfig", "__version__"]


def __getattr__(name: str):
    # Lazy, so ``import mlc_spec.compiler`` does not load the runtime and the tokenizer stack.
    if name in ("LLM", "SamplingParams", "SpeculativeConfig"):
        from mlc_spec.runtime import llm, params

        return getattr(llm if name == "LLM" else params, name)
    raise AttributeError(name)
