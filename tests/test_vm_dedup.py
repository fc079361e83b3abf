"""``DedupVMObjects``: a model's VM functions make each shape, tensor view and reshape once per
call and kill nothing before its last use, and a function computes the same bits with and
without the pass."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tiny_models import lowered_tiny_llama
from tvm import relax as rx
from tvm.script import ir as I  # noqa: N812 - TVMScript's own spelling
from tvm.script import relax as R  # noqa: N812
from tvm.script import tirx as T  # noqa: N812

from mlc_spec.compiler import pipeline
from mlc_spec.compiler.targets import make_target
from mlc_spec.compiler.vm_dedup import _KILL, _RESHAPE, _builtin, _reusable_key, _vars


def _without_dedup(monkeypatch) -> None:
    identity = tvm.transform.module_pass(lambda mod, _ctx: mod, opt_level=0, name="Identity")
    monkeypatch.setattr(pipeline, "DedupVMObjects", lambda: identity)


def _faults(func: rx.Function) -> list[str]:
    """What the pass rules out: a repeated object, a reshape of a reshape, a kill of a
    parameter's item, a kill before a use."""
    bindings = [b for block in func.body.blocks for b in block.bindings]
    faults, seen, killed = [], set(), set()
    reshapes = {b.var for b in bindings if _builtin(b.value) == _RESHAPE}
    params = set(func.params)
    items = {
        b.var
        for b in bindings
        if isinstance(b.value, rx.TupleGetItem) and b.value.tuple_value in params
    }
    for b in bindings:
        key = _reusable_key(b.value)
        if key is not None and key in seen:
            faults.append(f"made again: {key}")
        if key is not None:
            seen.add(key)
        if _builtin(b.value) == _RESHAPE and b.value.args[0] in reshapes:
            faults.append(f"reshape of a reshape: {b.var}")
        if isinstance(b.value, rx.Call) and b.value.op == _KILL:
            (dead,) = b.value.args
            if dead in items:
                faults.append(f"kills a parameter's item: {dead}")
            killed.add(dead)
        elif any(used in killed for used in _vars(b.value)):
            faults.append(f"used after its kill: {b.var}")
    return faults


def test_a_model_makes_each_vm_object_once_per_call(monkeypatch):
    mod = lowered_tiny_llama(noalias=False)
    calls = {}
    for name in ("prefill", "decode", "evaluate_multi_query"):
        assert _faults(mod[name]) == [], name
        calls[name] = sum(len(block.bindings) for block in mod[name].body.blocks)
    _without_dedup(monkeypatch)
    before = lowered_tiny_llama(noalias=False)
    assert _faults(before["decode"]) != []  # the check can fail: without the pass it does
    for name, count in calls.items():
        total = sum(len(block.bindings) for block in before[name].body.blocks)
        assert count < 0.7 * total, name  # two layers here; SmolLM2 decode: 0.25x


@I.ir_module
class _Chains:
    @R.function
    def main(
        x: R.Tensor(("n", 8), "float32"),
        w: R.Tuple(R.Tensor((8, 8), "float32"), R.Tensor((8, 8), "float32")),
    ) -> R.Tensor(("n", 8), "float32"):
        n = T.int64()
        with R.dataflow():
            h = R.matmul(x, w[0])
            h = R.reshape(R.reshape(R.reshape(h, (n, 2, 4)), (n * 2, 4)), (n, 8))
            h = R.add(R.nn.silu(h), x)
            g = R.matmul(h, w[1])
            g = R.reshape(R.reshape(g, (n, 4, 2)), (n, 8))
            out = R.add(R.nn.silu(g), h)
            R.output(out)
        return out


@pytest.mark.parametrize("rows", [1, 5])
def test_a_function_computes_the_same_bits_with_and_without_the_pass(monkeypatch, rows):
    target = make_target("llvm")
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, 8), dtype=np.float32)
    w = [rng.standard_normal((8, 8), dtype=np.float32) for _ in range(2)]

    def run() -> np.ndarray:
        built = tvm.compile(
            _Chains, target=target, relax_pipeline=pipeline.relax_pipeline(target, "float32")
        )
        vm = rx.VirtualMachine(built, tvm.cpu())
        args = [tvm.runtime.tensor(a) for a in (x, *w)]
        return vm["main"](args[0], tvm.runtime.convert(args[1:])).numpy()

    deduped = run()
    _without_dedup(monkeypatch)
    assert np.array_equal(deduped, run())
