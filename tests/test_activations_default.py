"""Int8 activations become a file's default only where they were measured at least as faithful
to the float model as llama.cpp (``compiler/activations_default.py``), for its quantized weights
as shipped, on the CPU: the decision, and a compile that takes it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mlc_spec.compiler import activations_default
from mlc_spec.compiler import compile as compile_module
from mlc_spec.compiler.activations_default import Int8Fidelity
from mlc_spec.compiler.compile import compile_model
from mlc_spec.compiler.options import CompileOptions, default_activations
from mlc_spec.compiler.sources import sha256_files
from mlc_spec.compiler.targets import make_target
from mlc_spec.runtime.artifact import read_config

BOTH = ("vpdpbusd", "vpmaddubsw")
FAITHFUL = Int8Fidelity("faithful", int8_kl=dict.fromkeys(BOTH, 0.001), llamacpp_kl=0.002)
UNFAITHFUL = Int8Fidelity("unfaithful", int8_kl=dict.fromkeys(BOTH, 0.003), llamacpp_kl=0.002)


@pytest.fixture
def measured(monkeypatch):
    table = {"a" * 64: FAITHFUL, "b" * 64: UNFAITHFUL}
    for i, instruction in enumerate(BOTH):  # faithful with one instruction, unmeasured on the other
        table["de"[i] * 64] = Int8Fidelity("one", {instruction: 0.001}, llamacpp_kl=0.002)
    monkeypatch.setattr(activations_default, "MEASURED", table)
    return table


def test_int8_only_where_measured_faithful(measured):
    cpu = make_target("llvm")
    assert default_activations("a" * 64, "as-source", cpu) == "int8"
    assert default_activations("b" * 64, "as-source", cpu) == "float"  # less faithful
    assert default_activations("c" * 64, "as-source", cpu) == "float"  # never measured
    assert default_activations("a" * 64, "q4", cpu) == "float"  # not the weights measured
    assert default_activations("a" * 64, "as-source", make_target("cuda")) == "float"
    avx2 = make_target("llvm", cpu="x86-64-v3")  # vpmaddubsw: measured for "e" only
    assert default_activations("d" * 64, "as-source", avx2) == "float"
    assert default_activations("e" * 64, "as-source", avx2) == "int8"


class _Written(Exception):
    pass


def test_a_compile_takes_the_default(tiny_gguf_int8, monkeypatch, tmp_path):
    """The options compile_model writes the artifact with (stopped there: the kernels' compile
    is tested elsewhere), and nothing is left behind."""
    gguf = tiny_gguf_int8.parent / "tiny.gguf"
    monkeypatch.setattr(activations_default, "MEASURED", {sha256_files([gguf]): FAITHFUL})
    written = []

    def write(*args):
        written.append(next(a for a in args if isinstance(a, CompileOptions)))
        raise _Written

    monkeypatch.setattr(compile_module, "_write_artifact", write)
    with pytest.raises(_Written):
        compile_model(gguf, "llvm", tmp_path / "default", show_progress=False)
    assert [o.activations for o in written] == ["int8"]
    assert not any(tmp_path.iterdir())
    assert read_config(tiny_gguf_int8)["activations"] == "int8"  # a whole compile of the file


def test_a_given_choice_wins(measured):
    source = SimpleNamespace(source_hash="a" * 64, stored_formats={"w": "q4_k"})
    cpu = make_target("llvm")
    chosen = CompileOptions().validate("llvm").with_source_defaults(source, cpu)
    given = CompileOptions(activations="float").validate("llvm").with_source_defaults(source, cpu)
    assert (chosen.activations, given.activations) == ("int8", "float")
