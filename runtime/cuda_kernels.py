"""The CUDA device for an artifact: its architecture checked against the GPU's, and its TIR
kernels compiled for that GPU when the library loads.

A CUDA artifact is cross-compiled on a machine that may have no GPU, so TVM keeps its TIR
kernels as CUDA source and the CUDA runtime asks ``tvm_callback_cuda_compile`` for machine code
when the library loads. TVM's own callback needs its compiler library (to read the current
target), which the runtime does not load, so this module registers its own: nvcc with the flags
TVM's callback passes, for this GPU's architecture, cached on disk by the source's hash (a
SmolLM2 artifact's kernels take ~5 s of nvcc; the next load reads them back).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import tvm
import tvm.runtime
import tvm_ffi

from mlc_spec.paths import cache_dir

from .artifact import ArtifactError

# TVM's nvcc flags (tvm.support.nvcc), fast math included: kernels as a full TVM builds them.
NVCC_FLAGS = (
    "--fatbin",
    "-O3",
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_OPERATORS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT162_OPERATORS__",
    "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
    "--expt-relaxed-constexpr",
    "--expt-extended-lambda",
    "--use_fast_math",
    "--ptxas-options=--register-usage-level=10",
)
# sm_90 -> major 9, minor 0; a letter (sm_90a) marks code for that architecture alone.
CUDA_ARCH = re.compile(r"sm_(\d+)(\d)([a-z]?)")


def cuda_device(target_spec: str) -> tvm.runtime.Device:
    """The GPU, once it runs what an artifact built for ``target_spec`` holds, with the kernel
    compiler registered for it."""
    no_gpu = "this artifact was compiled for CUDA, but no CUDA GPU is visible"
    lib = Path(tvm.__file__).parent / "lib" / "libtvm_runtime_cuda.so"
    try:
        if lib.exists():  # runtime-only TVM does not load its CUDA device API by itself
            ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    except OSError as err:  # e.g. no libcuda.so.1: no NVIDIA driver on this machine
        raise ArtifactError(f"{no_gpu} ({err})") from None
    dev = tvm.cuda(0)
    if not dev.exist:
        raise ArtifactError(no_gpu)
    gpu_arch = "sm_" + dev.compute_version.replace(".", "")
    built_for = CUDA_ARCH.search(target_spec)
    if built_for and not runs_on(built_for.group(0), gpu_arch):
        raise ArtifactError(
            f"this artifact was compiled for {built_for.group(0)}, but this GPU "
            f"({dev.device_name}) is {gpu_arch}; compile it with --cuda-arch {gpu_arch}"
        )
    tvm_ffi.register_global_func(
        "tvm_callback_cuda_compile", compile_callback(gpu_arch), override=True
    )
    return dev


def compile_callback(gpu_arch: str) -> Callable[..., bytes]:
    """TVM's compile callback: for the GPU found when an artifact loads, or, where a full TVM
    compiles for a CUDA target in the same process later, for that target's architecture."""

    def compile_cuda(code: str, *_: object) -> bytes:
        return compile_kernels(code, _compiling_for() or gpu_arch)

    return compile_cuda


def _compiling_for() -> str | None:
    """The architecture of the CUDA target TVM is compiling for, if any: none when a library
    loads, nor ever with the runtime-only TVM, which cannot read the current target."""
    try:
        from tvm.target import Target

        target = Target.current(allow_none=True)
    except (AttributeError, ImportError):  # the runtime-only TVM has no TargetCurrent
        return None
    arch = getattr(target, "arch", None) if target is not None else None
    return arch if isinstance(arch, str) and CUDA_ARCH.fullmatch(arch) else None


def runs_on(built_for: str, gpu_arch: str) -> bool:
    """Whether machine code for ``built_for`` runs on a GPU of ``gpu_arch``: the same major
    version and no newer minor one; a lettered architecture (sm_90a) only on itself."""
    built, gpu = CUDA_ARCH.fullmatch(built_for), CUDA_ARCH.fullmatch(gpu_arch)
    if built is None or gpu is None:
        raise ValueError(f"cannot read CUDA architectures {built_for!r}, {gpu_arch!r}")
    if built.group(3):
        return built.group(1, 2) == gpu.group(1, 2)
    return built.group(1) == gpu.group(1) and int(built.group(2)) <= int(gpu.group(2))


def compile_kernels(code: str, arch: str) -> bytes:
    """A fatbin of ``code`` for ``arch``, from the disk cache or nvcc."""
    key = hashlib.sha256("\0".join((arch, *NVCC_FLAGS, code)).encode()).hexdigest()
    cached = cache_dir() / "cuda-kernels" / f"{key}.fatbin"
    if cached.exists():
        return cached.read_bytes()
    with tempfile.TemporaryDirectory() as tmp:
        source, out = Path(tmp) / "kernels.cu", Path(tmp) / "kernels.fatbin"
        source.write_text(code)
        gencode = f"arch=compute_{arch[3:]},code={arch}"
        done = subprocess.run(
            [_nvcc(), *NVCC_FLAGS, "-gencode", gencode, "-o", str(out), str(source)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise ArtifactError(f"nvcc failed on this artifact's kernels: {done.stderr[-2000:]}")
        fatbin = out.read_bytes()
    cached.parent.mkdir(parents=True, exist_ok=True)
    staged = cached.with_suffix(f".{os.getpid()}.tmp")
    staged.write_bytes(fatbin)
    staged.replace(cached)  # atomic: a concurrent load reads a whole file or none
    return fatbin


def _nvcc() -> str:
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    for nvcc in (shutil.which("nvcc"), f"{home}/bin/nvcc"):
        if nvcc and Path(nvcc).is_file():
            return nvcc
    raise ArtifactError(
        "a CUDA artifact's kernels are compiled for this GPU when it first loads, with nvcc; "
        "found none (install the CUDA toolkit, or set CUDA_HOME)"
    )
