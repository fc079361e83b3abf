"""A CUDA artifact's TIR kernels compiled for the GPU when it loads (runtime/cuda_kernels.py):
which GPUs an artifact runs on, and the nvcc compile with its disk cache."""

from __future__ import annotations

import shutil

import pytest
import tvm

from mlc_spec.runtime import cuda_kernels
from mlc_spec.runtime.artifact import ArtifactError
from mlc_spec.runtime.cuda_kernels import compile_kernels, runs_on

KERNEL = 'extern "C" __global__ void add_one(float* x) { x[threadIdx.x] += 1.0f; }\n'
FATBIN_MAGIC = bytes.fromhex("50ed55ba")


@pytest.mark.parametrize(
    ("built_for", "gpu", "runs"),
    [
        ("sm_90", "sm_90", True),
        ("sm_80", "sm_86", True),  # newer minor version, same major
        ("sm_86", "sm_80", False),
        ("sm_80", "sm_90", False),  # machine code does not cross major versions
        ("sm_90", "sm_100", False),
        ("sm_100", "sm_90", False),
        ("sm_90a", "sm_90", True),
        ("sm_90a", "sm_91", False),  # architecture-specific code runs on its own only
    ],
)
def test_which_gpus_an_artifact_runs_on(built_for, gpu, runs):
    assert runs_on(built_for, gpu) is runs


needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")


@needs_nvcc
def test_kernels_compile_once_per_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("MLC_SPEC_CACHE", str(tmp_path))
    fatbin = compile_kernels(KERNEL, "sm_90")
    assert fatbin.startswith(FATBIN_MAGIC)
    assert len(list((tmp_path / "cuda-kernels").glob("*.fatbin"))) == 1
    # The second load reads the cache: no nvcc needed.
    monkeypatch.setenv("PATH", "")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "none"))
    assert compile_kernels(KERNEL, "sm_90") == fatbin
    with pytest.raises(ArtifactError, match="with nvcc; found none"):
        compile_kernels(KERNEL, "sm_80")


@needs_nvcc
def test_nvcc_errors_name_the_cause(tmp_path, monkeypatch):
    monkeypatch.setenv("MLC_SPEC_CACHE", str(tmp_path))
    with pytest.raises(ArtifactError, match="nvcc failed.*undefined_name"):
        compile_kernels(KERNEL.replace("1.0f", "undefined_name"), "sm_90")
    assert not list((tmp_path / "cuda-kernels").glob("*"))


def test_kernels_compile_for_the_gpu_unless_tvm_compiles_for_a_target(monkeypatch):
    """Loading an artifact compiles for the GPU found; a full TVM compiling for a CUDA target in
    the same process afterwards still gets that target's architecture."""
    seen = []
    monkeypatch.setattr(cuda_kernels, "compile_kernels", lambda code, arch: seen.append(arch))
    compile_cuda = cuda_kernels.compile_callback("sm_90")
    compile_cuda(KERNEL)
    with tvm.target.Target({"kind": "cuda", "arch": "sm_80"}):
        compile_cuda(KERNEL)
    assert seen == ["sm_90", "sm_80"]
