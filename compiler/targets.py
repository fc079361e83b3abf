"""Compilation targets by name.

TVM and the runtime are imported where a target is built or read, not here: the command line
reads these tables for its choices without loading TVM (``generate`` and ``serve`` run on its
runtime alone, and ``--help`` stays instant).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .errors import CompileError

if TYPE_CHECKING:
    from tvm.target import Target

TARGETS = ("llvm", "cuda")
DEFAULT_CUDA_ARCH = "sm_90"
DEFAULT_CPU = "native"
DEFAULT_DTYPE = {"llvm": "float32", "cuda": "float16"}
ALLOWED_DTYPES = {"llvm": ("float32",), "cuda": ("float16", "bfloat16", "float32")}
# Attention kernels of the paged KV cache; the first is the default. On the CPU: this package's
# (``cpu_kv_cache``); on CUDA, in TVM's KV cache object: FlashInfer's, or "tir", TVM's own.
ATTENTION = {"llvm": ("cpu",), "cuda": ("flashinfer", "tir")}


def make_target(name: str, cuda_arch: str = DEFAULT_CUDA_ARCH, cpu: str = DEFAULT_CPU) -> Target:
    """``llvm`` compiles for ``cpu``: ``native`` is this machine's CPU (its vector extensions
    included), or an LLVM CPU name such as ``x86-64-v3`` (AVX2 + FMA, any x86-64 CPU since
    2015) for an artifact that runs elsewhere. ``cuda`` cross-compiles for ``cuda_arch`` with
    generic x86-64 host code, no GPU needed (TVM 0.27 accepts only the dict form)."""
    import tvm
    from tvm.target import Target

    if name == "llvm":
        host = Target.from_device("cpu")
        if cpu == "native":
            return host_target(host)
        if not tvm.target.codegen.llvm_is_valid_cpu(cpu, host.mtriple):
            raise CompileError(f"unknown CPU {cpu!r} (e.g. native, x86-64-v3, x86-64-v4)")
        return Target({"kind": "llvm", "mcpu": cpu, "mtriple": host.mtriple})
    if name == "cuda":
        return Target({"kind": "cuda", "arch": cuda_arch}, host={"kind": "llvm"})
    raise CompileError(f"unknown target {name!r}; choose one of {', '.join(TARGETS)}")


def host_target(host: Target, cpuinfo: Path = Path("/proc/cpuinfo")) -> Target:
    """``host`` (this machine as LLVM names it) less the vector extensions the CPU does not
    report. LLVM infers them from the CPU's name, but a virtual machine may present a Zen 4
    (``znver4``, AVX-512) with AVX-512 masked off, and code built for the name alone dies with
    an illegal instruction; turning off ``avx512f`` turns off every AVX-512 extension."""
    from tvm.target import Target

    from mlc_spec.runtime.artifact import missing_cpu_features

    missing = missing_cpu_features(vector_features(host), cpuinfo)
    if not missing:
        return host
    return Target(
        {
            "kind": "llvm",
            "mcpu": host.attrs["mcpu"],
            "mtriple": host.attrs["mtriple"],
            "mattr": [f"-{feature}" for feature in missing],
        }
    )


def cpu_name(target: Target) -> str:
    """An llvm target's CPU as artifact caches key it: LLVM's name, plus the extensions turned
    off (``host_target``), so that two hosts of one name but different extensions never share
    an artifact."""
    off = [attr[1:] for attr in target.attrs.get("mattr", []) if attr.startswith("-")]
    return "-no-".join([str(target.attrs["mcpu"]), *off])


def vector_features(target: Target) -> list[str]:
    """The x86 vector extensions an llvm artifact's kernels may use (LLVM's names), recorded in
    the artifact so the runtime can refuse a CPU that lacks one instead of crashing."""
    import tvm

    from mlc_spec.runtime.artifact import CPU_FEATURE_FLAGS

    if target.kind.name != "llvm":
        return []
    features = set(tvm.target.codegen.llvm_get_cpu_features(target))
    return sorted(features & set(CPU_FEATURE_FLAGS))
