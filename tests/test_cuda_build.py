"""``--target cuda`` cross-compiles on a machine without a GPU (CI has none), with TVM's TIR
attention or FlashInfer's. FlashInfer's kernels are built with nvcc on first use and cached on
disk (``$MLC_SPEC_CACHE/flashinfer``); CI starts without that cache, so the FlashInfer builds
run with the heavy tests, and TIR attention's by default."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
from pathlib import Path

import pytest
import tvm
from compiled_sampling import compile_sampler
from tiny_models import make_tiny_model, save_tiny_checkpoint, tiny_config

from mlc_spec.cli import main
from mlc_spec.compiler import flashinfer
from mlc_spec.compiler.compile import compile_model
from mlc_spec.compiler.errors import CompileError
from mlc_spec.compiler.options import CompileOptions
from mlc_spec.runtime.artifact import (
    CONFIG_FILE,
    LIBRARY_FILE,
    SAMPLER_FUNCTIONS,
    SAMPLER_LIBRARY_FILE,
    ArtifactError,
)
from mlc_spec.runtime.model import Model


def _check_artifact(out: Path, dtype: str, attention: str) -> None:
    config = json.loads((out / CONFIG_FILE).read_text())
    assert config["target"] == "cuda" and config["model"]["dtype"] == dtype
    assert config["attention"] == attention
    assert '"arch":"sm_90"' in config["target_spec"].replace(" ", "")
    library = (out / LIBRARY_FILE).read_bytes()
    assert library.count(b"__global__") > 10  # the CUDA kernels
    assert config["sampler_functions"] == list(SAMPLER_FUNCTIONS)
    sampler = (out / SAMPLER_LIBRARY_FILE).read_bytes()
    assert b"argsort_kernel" in sampler and b"num_accepted_kernel" in sampler


# The sampler's kernels: sort and scan from DispatchSortScan, the rest scheduled by dlight.
SAMPLER_KERNELS = (
    "argsort",
    "gpu_2d_continuous_cumsum",
    "argmax",
    "probs",
    "kept_probs",
    "inverse_cdf",
    "num_accepted",
    "last_distribution",
    "emitted",
)


def _run(*command: str | Path) -> str:
    return subprocess.run(
        [str(c) for c in command], capture_output=True, text=True, check=True
    ).stdout


@pytest.mark.parametrize(
    ("dtype", "quantization"), [("float16", None), ("bfloat16", None), ("float16", "q4")]
)
def test_tiny_model_cross_compiles_with_tir_attention(tiny_llama, tmp_path, dtype, quantization):
    """Quantized weights too: dequantize fused into dlight's GPU matmul/GEMV schedules."""
    out = compile_model(
        tiny_llama.checkpoint,
        "cuda",
        tmp_path / "cuda",
        CompileOptions(dtype=dtype, attention="tir", quantization=quantization),
        show_progress=False,
    )
    _check_artifact(out, dtype, "tir")
    formats = {p["format"] for p in json.loads((out / CONFIG_FILE).read_text())["params"]}
    assert ("q4g32" in formats) == (quantization == "q4")
    if not tvm.cuda(0).exist:
        with pytest.raises(ArtifactError, match="no CUDA GPU"):
            Model(out)


def test_sampler_functions_cross_compile_for_cuda(tmp_path):
    """Sampling and verification alone, as every artifact carries them, built for sm_90."""
    executable = compile_sampler("cuda")
    text = executable.as_text()
    assert all(f"@{name}:" in text for name in SAMPLER_FUNCTIONS)
    executable.export_library(str(tmp_path / "sampler.so"))
    library = (tmp_path / "sampler.so").read_bytes()
    for kernel in SAMPLER_KERNELS:
        assert f" {kernel}_kernel(".encode() in library, kernel


def test_sampler_loops_stay_rolled_in_the_cuda_source(tmp_path):
    """The GPU machine compiles this source with nvcc each time an artifact loads: SmolLM2's
    vocabulary written out loop by loop was 7.3 MB and 40 s of nvcc (``gpu_unroll.py``)."""
    compile_sampler("cuda", vocab_size=49152).export_library(str(tmp_path / "sampler.so"))
    library = (tmp_path / "sampler.so").read_bytes()
    assert b"#pragma unroll\n" not in library  # (``#pragma unroll 1`` marks while loops)
    assert len(library) < 1_000_000


def test_flashinfer_attention_is_rejected_for_llvm(tiny_llama, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["compile", str(tiny_llama.checkpoint), "--target", "llvm", "--attention", "flashinfer"]
    assert main([*args, "-o", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "mlc-spec compile: error: attention 'flashinfer' is not supported on llvm; choose cpu"
    ]
    assert list(tmp_path.iterdir()) == []


def test_flashinfer_rejects_head_dim_it_has_no_kernels_for(tiny_llama, tmp_path):
    """The tiny Llama's head dim is 16; FlashInfer has kernels for 64, 128 and 256."""
    with pytest.raises(CompileError, match="head dims 64, 128, 256; this model has 16"):
        compile_model(tiny_llama.checkpoint, "cuda", tmp_path / "out", show_progress=False)
    assert list(tmp_path.iterdir()) == []


def _kernel_objects() -> dict[Path, int]:
    """FlashInfer's float16, head-dim-64 objects (SmolLM2's shapes) and their mtimes."""
    from flashinfer.jit import env

    pattern = "batch_*_tvm_dtype_q_float16_*_qk_head_dim_64_*/*.o"
    return {p: p.stat().st_mtime_ns for p in env.FLASHINFER_JIT_DIR.glob(pattern)}


def _plan_parameters(source: str) -> list[str]:
    signature = re.search(r"BatchPrefillWithKVCachePlan\(([^)]*)\)", source)
    return [p.strip() for p in signature[1].split(",")]


def test_flashinfer_prefill_plan_takes_the_arguments_tvm_passes():
    """TVM 0.27's KV cache calls FlashInfer's prefill plan with 19 arguments; 0.6.16 added a
    20th, and the call failed on the GPU ("Expected 20 but got 19 arguments")."""
    spec = importlib.util.find_spec("flashinfer")
    if spec is None:
        pytest.skip("needs the cuda extra: pip install 'mlc-spec[cuda]'")
    csrc = Path(spec.submodule_search_locations[0]) / "data" / "csrc"
    for name in ("batch_prefill.cu", "batch_prefill_jit_binding.cu"):  # definition, declaration
        shipped = (csrc / name).read_text()
        assert len(_plan_parameters(shipped)) == 20
        rewritten = flashinfer._with_tvm_plan_signature(shipped)
        assert len(_plan_parameters(rewritten)) == 19
        assert _plan_parameters(rewritten)[-1].startswith("int64_t num_colocated_ctas")
    definition = flashinfer._with_tvm_plan_signature((csrc / "batch_prefill.cu").read_text())
    assert "const int64_t uniform_q_len = 0;" in definition


@pytest.fixture(scope="module")
def tiny_flashinfer(tmp_path_factory) -> Path:
    """The tiny Llama with head dim 64 compiled for cuda float16 with the default attention,
    FlashInfer; it builds (once per machine) the kernels SmolLM2-135M uses too."""
    # Not importorskip: flashinfer must be first imported by the compiler, which configures it.
    if importlib.util.find_spec("flashinfer") is None:
        pytest.skip("needs the cuda extra: pip install 'mlc-spec[cuda]'")
    root = tmp_path_factory.mktemp("tiny_head_dim_64")
    hf = save_tiny_checkpoint(make_tiny_model(tiny_config("llama", head_dim=64)), root / "hf")
    return compile_model(hf, "cuda", root / "artifact", show_progress=False)


@pytest.mark.heavy  # nvcc builds FlashInfer's kernels first: ~2.5 min of a fresh 2-core machine
def test_tiny_model_cross_compiles_with_flashinfer_attention(tiny_flashinfer):
    _check_artifact(tiny_flashinfer, "float16", "flashinfer")
    library = tiny_flashinfer / LIBRARY_FILE
    exports = _run("nm", "-D", "--defined-only", library)
    for name in ("batch_prefill_paged_run", "batch_prefill_ragged_run", "batch_decode_run"):
        assert f"__tvm_ffi_{name}" in exports
    # Nothing of FlashInfer's left to resolve at load time, and the CUDA runtime it calls linked.
    assert "flashinfer" not in _run("nm", "-D", "-C", "--undefined-only", library)
    assert "libcudart.so" in _run("readelf", "-d", library)


@pytest.mark.heavy  # ~5 min each; the tiny models cover both attention kernels by default
def test_smollm2_cross_compiles_with_tir_attention(smollm2_gguf, tmp_path):
    out = compile_model(
        smollm2_gguf,
        "cuda",
        tmp_path / "cuda",
        CompileOptions(attention="tir"),
        show_progress=False,
    )
    _check_artifact(out, "float16", "tir")


@pytest.mark.heavy
def test_smollm2_reuses_the_cached_flashinfer_kernels(tiny_flashinfer, smollm2_gguf, tmp_path):
    """Same head dim and dtype as the tiny model: nothing is rebuilt."""
    before = _kernel_objects()
    assert len(before) > 10
    out = compile_model(smollm2_gguf, "cuda", tmp_path / "cuda", show_progress=False)
    _check_artifact(out, "float16", "flashinfer")
    assert _kernel_objects() == before
