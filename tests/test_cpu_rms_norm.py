"""RMS norm on the CPU (``compiler/cpu_rms_norm.py``) through the compile pipeline, against TVM's
own legalization on the same inputs (float32 summation order apart), on the calling thread and
on the pool; every row's output independent of the row count, which greedy speculation's
losslessness needs (a verified row bit for bit a decoded one); and TVM's kernel kept where the
width is not a multiple of the vector lanes."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax as rx
from tvm.relax.frontend import nn
from tvm.runtime.vm import VirtualMachine

from mlc_spec.compiler.cpu_rms_norm import LEGALIZE
from mlc_spec.compiler.cpu_rule import SERIAL_BELOW_ELEMENTS
from mlc_spec.compiler.pipeline import relax_pipeline
from mlc_spec.compiler.targets import make_target


class _Norm(nn.Module):
    def __init__(self, width: int):
        self.norm = nn.RMSNorm(width, -1, 1e-5, bias=False)

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        return self.norm(x)


def _module(width: int) -> tvm.IRModule:
    spec = {"forward": {"x": nn.spec.Tensor((1, "n", width), "float32")}}
    return _Norm(width).export_tvm(spec)[0]


def _compiled(width: int, pipeline):
    target = make_target("llvm")
    executable = tvm.compile(_module(width), target, relax_pipeline=pipeline(target))
    return VirtualMachine(executable, tvm.cpu())["forward"]


def _ours(target):
    return relax_pipeline(target, "float32")


def _tvms(target):
    return tvm.transform.Sequential([rx.transform.LegalizeOps(), relax_pipeline(target, "float32")])


def _run(forward, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    return forward(tvm.runtime.tensor(x), tvm.runtime.tensor(weight)).numpy()


@pytest.mark.parametrize("width", [576, 80])
def test_matches_tvm_and_rows_are_independent(width):
    rng = np.random.default_rng(0)
    ours = _compiled(width, _ours)
    tvms = _compiled(width, _tvms)
    weight = rng.normal(size=width).astype(np.float32)
    many = 2 * SERIAL_BELOW_ELEMENTS // width + 3  # on the thread pool
    x = (rng.normal(size=(1, many, width)) * rng.uniform(0.01, 30, size=(1, many, 1))).astype(
        np.float32
    )
    got = _run(ours, x, weight)
    np.testing.assert_allclose(got, _run(tvms, x, weight), rtol=2e-6, atol=1e-6)
    for rows in (1, 5, 8):  # decode, verify: on the calling thread
        np.testing.assert_array_equal(_run(ours, x[:, :rows], weight), got[:, :rows])


def test_width_off_the_lanes_keeps_tvms_kernel():
    with make_target("llvm"):  # 16 float lanes with AVX-512, 8 without: 84 is neither
        lowered = rx.transform.LegalizeOps(LEGALIZE)(_module(84))
    kernels = [f for f in lowered.functions.values() if not isinstance(f, rx.Function)]
    assert kernels and not any("tirx.is_scheduled" in (f.attrs or {}) for f in kernels)
