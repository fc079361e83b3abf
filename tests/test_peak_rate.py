"""The compute floor's probe (``scripts/peak_rate.py``) runs the integer dot product the int8
kernels use on this CPU, so that bench_cpu's floor is the kernels' own instruction at its peak."""

from __future__ import annotations

import pytest
from bench_scripts import script

from mlc_spec.compiler.int8_matmul import integer_dot
from mlc_spec.compiler.targets import make_target

benchdoc = script("benchdoc")
peak_rate = script("peak_rate")


def test_the_probe_runs_the_instruction_the_int8_kernels_use():
    dot = integer_dot(make_target("llvm"))
    if dot.vnni and dot.lanes == 8:
        pytest.skip("AVX-VNNI on 256 bits: the probe has no form of it")
    # The flags bench_cpu's compute floor passes it.
    probe = peak_rate.int8_instruction(set(benchdoc.lscpu_fields()["Flags"].split()))
    assert probe.op == ("vpdpbusd" if dot.vnni else "vpmaddubsw")
    assert probe.register == ("z" if dot.lanes == 16 else "y")
    assert probe.multiply_adds == 4 * dot.lanes
    assert peak_rate.measured_rate(probe, threads=1) > 1e9
