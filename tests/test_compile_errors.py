"""Bad input to ``mlc-spec compile``: one clear line, non-zero exit, nothing left behind."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mlc_spec.cli import main
from mlc_spec.runtime.artifact import CONFIG_FILE, ArtifactError, missing_cpu_features
from mlc_spec.runtime.model import Model


@pytest.fixture
def checkpoint(tiny_llama, tmp_path) -> Path:
    """A private copy of the tiny checkpoint that a test may damage."""
    return Path(shutil.copytree(tiny_llama.checkpoint, tmp_path / "hf"))


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


DAMAGE = {
    "unknown architecture": (
        lambda p: _edit_config(p, architectures=["GPT2LMHeadModel"], model_type="gpt2"),
        "unsupported architecture",
    ),
    "missing weights": (lambda p: (p / "model.safetensors").unlink(), "safetensors"),
    "corrupt weights": (lambda p: _truncate(p / "model.safetensors"), "model.safetensors"),
    "config does not match weights": (
        lambda p: _edit_config(p, intermediate_size=96),
        "weights do not match the config",
    ),
    "missing config": (lambda p: (p / "config.json").unlink(), "config.json"),
}


def _compile(capsys, *args: str) -> tuple[int, str]:
    code = main(["compile", *args])
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


@pytest.mark.parametrize("case", DAMAGE)
def test_damaged_source_is_rejected(case, checkpoint, tmp_path, capsys):
    damage, expected = DAMAGE[case]
    damage(checkpoint)
    out = tmp_path / "out"
    code, message = _compile(capsys, str(checkpoint), "--target", "llvm", "-o", str(out))
    assert code != 0
    assert message.startswith("mlc-spec compile: error:") and expected in message, message
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no partial artifact


def test_unknown_target(checkpoint, tmp_path, capsys):
    code, message = _compile(
        capsys, str(checkpoint), "--target", "metal", "-o", str(tmp_path / "out")
    )
    assert code != 0 and "unknown target 'metal'" in message
    assert not (tmp_path / "out").exists()


def test_wrong_dtype_for_target(checkpoint, tmp_path, capsys):
    code, message = _compile(
        capsys,
        str(checkpoint),
        "--target",
        "llvm",
        "--dtype",
        "float16",
        "-o",
        str(tmp_path / "out"),
    )
    assert code != 0 and "not supported on llvm" in message


def test_existing_output_is_left_alone(checkpoint, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, message = _compile(capsys, str(checkpoint), "--target", "llvm", "-o", str(out))
    assert code != 0 and "already exists" in message
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_missing_model_path_from_the_shell(tmp_path):
    """The installed console entry point: exit status 1, one line, no traceback."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlc_spec.cli",
            "compile",
            str(tmp_path / "nope"),
            "--target",
            "llvm",
            "-o",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"mlc-spec compile: error: model path {tmp_path / 'nope'} does not exist"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--cpu", "pentium-9000"], "unknown CPU 'pentium-9000'"),
        (["--quantization", "q3"], "unknown quantization 'q3'"),
        (["--activations", "int4"], "unknown activations 'int4'; choose one of float, int8"),
        (["--activations", "int8"], "--activations int8 applies to quantized weights"),
        (
            ["--activations", "int8", "--quantization", "q4", "--cpu", "x86-64"],
            "needs a CPU with AVX2 or newer",
        ),
    ],
)
def test_bad_cpu_quantization_or_activations(checkpoint, tmp_path, capsys, flags, expected):
    out = tmp_path / "out"
    code, message = _compile(capsys, str(checkpoint), "--target", "llvm", *flags, "-o", str(out))
    assert code == 1 and expected in message, message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_int8_activations_need_llvm(checkpoint, tmp_path, capsys):
    out = tmp_path / "out"
    code, message = _compile(
        capsys, str(checkpoint), "--target", "cuda", "--activations", "int8", "-o", str(out)
    )
    assert code == 1 and "--activations int8 applies to --target llvm only" in message, message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_artifact_for_a_cpu_without_its_vector_extensions_is_refused(tiny_llama, tmp_path):
    """An llvm artifact records the vector extensions it was built with; a CPU lacking one
    gets a clear error, not an illegal-instruction crash."""
    artifact = Path(shutil.copytree(tiny_llama.artifact, tmp_path / "artifact"))
    config_path = artifact / CONFIG_FILE
    config = json.loads(config_path.read_text())
    assert "avx2" in config["cpu_features"]  # x86-64 CI machines have it
    config["cpu_features"].append("avx512vnni-from-the-future")
    config_path.write_text(json.dumps(config))
    with pytest.raises(ArtifactError, match="avx512vnni-from-the-future, which this CPU lacks"):
        Model(artifact)


def test_missing_cpu_features_reads_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx avx2 fma avx512f avx512_vnni\n")
    assert missing_cpu_features(["avx2", "avx512vnni", "avx512bw"], cpuinfo) == ["avx512bw"]
