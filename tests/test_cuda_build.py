"""``--target cuda`` cross-compiles on a machine without a GPU (CI has none)."""

from __future__ import annotations

import json

import pytest
import tvm

from mlc_spec.compiler.compile import compile_model
from mlc_spec.runtime.artifact import CONFIG_FILE, LIBRARY_FILE, ArtifactError
from mlc_spec.runtime.model import Model


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_tiny_model_cross_compiles_for_cuda(tiny_llama, tmp_path, dtype):
    out = compile_model(
        tiny_llama.checkpoint, "cuda", tmp_path / "cuda", dtype=dtype, show_progress=False
    )
    config = json.loads((out / CONFIG_FILE).read_text())
    assert config["target"] == "cuda" and config["model"]["dtype"] == dtype
    assert '"arch":"sm_90"' in config["target_spec"].replace(" ", "")
    assert (out / LIBRARY_FILE).read_bytes().count(b"__global__") > 10  # the CUDA kernels
    if not tvm.cuda(0).exist:
        with pytest.raises(ArtifactError, match="no CUDA GPU"):
            Model(out)
