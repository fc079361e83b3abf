"""``serial_when_small``: CPU norms and elementwise kernels get a serial copy of their body for
small outputs (a decode row), while a reshape keeps the form in which Relax turns it into a
view. Numerics of both branches are covered by ``test_model_parity.py``: the tiny models'
decode rows take the serial branch, the 200-token llama3 test the parallel one."""

from __future__ import annotations

import tvm
from tvm import relax as rx
from tvm import tirx
from tvm.relax.analysis import has_reshape_pattern
from tvm.relax.frontend import nn
from tvm.s_tir import dlight as dl

from mlc_spec.compiler.pipeline import _schedule_rules
from mlc_spec.compiler.targets import make_target


class _NormSiluReshape(nn.Module):
    def __init__(self):
        self.norm = nn.RMSNorm(576, -1, 1e-5, bias=False)

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        return nn.op.reshape(nn.op.silu(self.norm(x)) * x, (-1, 9, 64))


def test_small_outputs_get_a_serial_branch_and_reshapes_stay_views():
    target = make_target("llvm")
    model = _NormSiluReshape()
    spec = {"x": nn.spec.Tensor(["n", 576], "float32"), "$": {"param_mode": "packed"}}
    mod, _ = model.export_tvm(spec={"forward": spec})
    passes = [
        rx.transform.LegalizeOps(),
        rx.transform.AnnotateTIROpPattern(),
        rx.transform.FuseOps(),
        rx.transform.FuseTIR(),
        dl.ApplyDefaultSchedule(*_schedule_rules(target)),
    ]
    with target:
        mod = tvm.transform.Sequential(passes)(mod)
    kernels = {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}
    reshapes = [f for name, f in kernels.items() if name.startswith("reshape")]
    others = [f for name, f in kernels.items() if not name.startswith("reshape")]
    assert reshapes and all(has_reshape_pattern(f) for f in reshapes)
    assert others
    for f in others:
        root = f.body.block.body
        assert isinstance(root, tirx.IfThenElse)
        assert root.then_case.kind == tirx.ForKind.SERIAL
        assert root.else_case.kind == tirx.ForKind.PARALLEL
