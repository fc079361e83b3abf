"""The artifact format: the files ``mlc-spec compile`` writes and the runtime reads.

An artifact directory holds everything needed to run the model with TVM's runtime alone:
``model.so`` (the model's compiled functions), ``sampler.so`` (sampling and verification),
``params.safetensors`` (converted weights, in the order the functions take them), the tokenizer
files and ``mlc-spec-config.json`` describing the rest.

The sampler is a library of its own because TVM 0.27 compiles every function of a library with
one ``noalias`` setting (``compiler/noalias.py``): int8-activation models need it off, and
without it the sampler's row softmax took 5-19 ms at 2-8 rows instead of 0.2-0.9 ms
(docs/kernels.md).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from mlc_spec.errors import UserError

CONFIG_FILE = "mlc-spec-config.json"
LIBRARY_FILE = "model.so"
SAMPLER_LIBRARY_FILE = "sampler.so"
WEIGHTS_FILE = "params.safetensors"
FORMAT_VERSION = 8
# How the linear layers treat activations (``mlc-spec compile --activations``): ``float``, or
# ``int8``, quantized per row and weight group for integer dot products with quantized weights.
ACTIVATIONS = ("float", "int8")
# Sampling and verification on the device, in ``sampler.so`` (compiler/sampler.py builds them,
# runtime/sampler.py calls them); in this order.
SAMPLER_FUNCTIONS = (
    "argmax_tokens",
    "probs_from_logits",
    "probs_from_logits_top_kp",
    "sample_from_probs",
    "verify_sampled_draft",
    "verify_point_draft",
    "apply_token_bitmask",
)
# CPU artifacts also have top-k without a sort: exact where each row's top-k set lies within
# its TOP_CANDIDATES largest logits (it says so per row; the runtime falls back otherwise), and
# each row's MAX_TREE_WIDTH most probable tokens, which a draft tree's node expands.
CPU_SAMPLER_FUNCTIONS = ("probs_from_logits_top_candidates", "top_tokens")
TOP_CANDIDATES = 128
MAX_TREE_WIDTH = 8
MODEL_FUNCTIONS = ("prefill", "decode", "evaluate_multi_query")
# How the model functions reach their KV cache: "pages", a page pool and page tables passed in
# (CPU artifacts; ``runtime/kv_cache.py`` keeps the tables), or "tvm", TVM's KV cache object,
# made by the artifact's ``create_paged_kv_cache`` (CUDA).
KV_CACHES = ("pages", "tvm")
# The float types a CPU artifact's KV pages may hold (``mlc-spec compile --kv-cache-dtype``).
KV_CACHE_DTYPES = ("float32", "float16")


def functions(kv_cache: str) -> tuple[str, ...]:
    """The functions ``model.so`` of an artifact with this kind of KV cache exports, in order."""
    creates = ("create_paged_kv_cache",) if kv_cache == "tvm" else ()
    return (*MODEL_FUNCTIONS, *creates)


def sampler_functions(kv_cache: str) -> tuple[str, ...]:
    """The functions ``sampler.so`` exports, in order."""
    return (*SAMPLER_FUNCTIONS, *(CPU_SAMPLER_FUNCTIONS if kv_cache == "pages" else ()))


# Storage dtypes of parameters: float weights, and the codes and scales of quantized ones
# (uint8, int8: a two-level format's group scales and offsets).
NUMPY_DTYPES = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
    "uint32": np.uint32,
    "uint8": np.uint8,
    "int8": np.int8,
}


# x86 vector extensions an llvm artifact records (LLVM's names) -> /proc/cpuinfo's flag names.
CPU_FEATURE_FLAGS = {
    "avx": "avx",
    "avx2": "avx2",
    "fma": "fma",
    "f16c": "f16c",
    "avx512f": "avx512f",
    "avx512bw": "avx512bw",
    "avx512dq": "avx512dq",
    "avx512vl": "avx512vl",
    "avx512vnni": "avx512_vnni",
    "avxvnni": "avx_vnni",
}


def missing_cpu_features(required: list[str], cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str]:
    """The recorded vector extensions this CPU lacks (none where /proc/cpuinfo is absent)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return []
    flags = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
    return [f for f in required if CPU_FEATURE_FLAGS.get(f, f) not in flags]


@dataclass(frozen=True)
class ParamRecord:
    """One parameter the compiled functions take, in order: its stored tensor and what it is
    part of. A float weight is one tensor (``format`` = its dtype); a quantized weight is two to
    five, ``<weight>.codes`` / ``.scales`` / ``.offsets`` / ``.super_scales`` /
    ``.super_offsets`` as its format has them, each with ``format`` = the group format's name
    (e.g. ``q4g32a``, ``q4g32as256``, see ``compiler/quantization``) and ``layout`` =
    ``panels``."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    weight: str
    format: str
    layout: str = "rows"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "shape": list(self.shape)}

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> ParamRecord:
        try:
            param = cls(**{**record, "shape": tuple(int(d) for d in record["shape"])})
        except (TypeError, KeyError, ValueError) as err:
            raise ArtifactError(f"malformed parameter record {record!r}: {err}") from None
        if param.dtype not in NUMPY_DTYPES:
            raise ArtifactError(f"parameter {param.name} has unknown dtype {param.dtype!r}")
        return param


class ArtifactError(UserError):
    """A directory that is not a usable mlc-spec artifact."""


def read_config(artifact_dir: str | Path) -> dict[str, Any]:
    """Read and sanity-check an artifact's config, with errors that name what is wrong."""
    root = Path(artifact_dir)
    path = root / CONFIG_FILE
    if not path.is_file():
        raise ArtifactError(f"{root} is not an mlc-spec artifact (no {CONFIG_FILE})")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ArtifactError(f"{path} is unreadable: {err}") from None
    if config.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(
            f"{path} has format version {config.get('format_version')}, "
            f"this mlc-spec reads {FORMAT_VERSION}"
        )
    if config.get("kv_cache") not in KV_CACHES:
        raise ArtifactError(f"{path} has unknown kv_cache {config.get('kv_cache')!r}")
    if config.get("activations") not in ACTIVATIONS:
        raise ArtifactError(f"{path} has unknown activations {config.get('activations')!r}")
    if config["kv_cache"] == "pages" and config.get("kv_cache_dtype") not in KV_CACHE_DTYPES:
        raise ArtifactError(f"{path} has unknown kv_cache_dtype {config.get('kv_cache_dtype')!r}")
    for name in (LIBRARY_FILE, SAMPLER_LIBRARY_FILE, WEIGHTS_FILE):
        if not (root / name).is_file():
            raise ArtifactError(f"artifact {root} is incomplete: {name} is missing")
    config["params"] = [ParamRecord.from_json(p) for p in config.get("params", [])]
    return config
