"""The compute floor's probe (``scripts/peak_rate.py``) runs the integer dot product the int8
kernels use, so that bench_cpu's floor is the kernels' own instruction at its peak."""

from __future__ import annotations

import pytest
from bench_scripts import script

from mlc_spec.compiler.int8_matmul import _INTEGER_DOTS, integer_dot
from mlc_spec.compiler.targets import make_target

peak_rate = script("peak_rate")


@pytest.mark.parametrize(
    "dot", [dot for _, dot in _INTEGER_DOTS], ids=lambda d: f"{d.instruction}-{d.lanes}"
)
def test_each_integer_dot_has_its_own_probe(dot):
    probe = peak_rate.int8_instruction(dot.instruction, dot.lanes)
    if dot.vnni and dot.lanes == 8:  # AVX-VNNI on 256 bits: the probe has no form of it
        assert probe is None
        return
    assert probe.op == dot.instruction
    assert probe.register == ("z" if dot.lanes == 16 else "y")
    assert probe.multiply_adds == 4 * dot.lanes


def test_the_probe_of_this_cpus_kernels_runs():
    dot = integer_dot(make_target("llvm"))
    probe = peak_rate.int8_instruction(dot.instruction, dot.lanes)
    if probe is None:
        pytest.skip("AVX-VNNI on 256 bits: the probe has no form of it")
    assert peak_rate.measured_rate(probe, threads=1) > 1e9
