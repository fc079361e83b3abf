"""Compilation targets by name."""

from __future__ import annotations

from tvm.target import Target

from .errors import CompileError

TARGETS = ("llvm", "cuda")
DEFAULT_DTYPE = {"llvm": "float32", "cuda": "float16"}
ALLOWED_DTYPES = {"llvm": ("float32",), "cuda": ("float16", "bfloat16", "float32")}
# Attention kernels of the paged KV cache; the first is the default. "tir" is TVM's own.
ATTENTION = {"llvm": ("tir",), "cuda": ("flashinfer", "tir")}


def make_target(name: str, cuda_arch: str = "sm_90") -> Target:
    """``llvm`` compiles for this machine's CPU (its vector extensions included); ``cuda``
    cross-compiles for ``cuda_arch`` with generic x86-64 host code, no GPU needed (TVM 0.27
    accepts only the dict form of a CUDA target)."""
    if name == "llvm":
        return Target.from_device("cpu")
    if name == "cuda":
        return Target({"kind": "cuda", "arch": cuda_arch}, host={"kind": "llvm"})
    raise CompileError(f"unknown target {name!r}; choose one of {', '.join(TARGETS)}")


def check_dtype(target_name: str, dtype: str) -> None:
    if dtype not in ALLOWED_DTYPES[target_name]:
        raise CompileError(
            f"dtype {dtype!r} is not supported on {target_name}; "
            f"choose one of {', '.join(ALLOWED_DTYPES[target_name])}"
        )


def check_attention(target_name: str, attention: str) -> None:
    if attention not in ATTENTION[target_name]:
        raise CompileError(
            f"attention {attention!r} is not supported on {target_name}; "
            f"choose {' or '.join(ATTENTION[target_name])}"
        )
