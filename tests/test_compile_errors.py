"""Bad input to ``mlc-spec compile``: one clear line, non-zero exit, nothing left behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from mlc_spec.cli import build_parser, main
from mlc_spec.compiler.options import CompileOptions
from mlc_spec.compiler.staging import staged
from mlc_spec.compiler.targets import ATTENTION, TARGETS, cpu_name, host_target, vector_features
from mlc_spec.runtime.artifact import ACTIVATIONS, CONFIG_FILE, ArtifactError, missing_cpu_features
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


def test_existing_output_is_left_alone(checkpoint, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, message = _compile(capsys, str(checkpoint), "--target", "llvm", "-o", str(out))
    assert code != 0 and "already exists" in message
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_a_killed_compiles_leftovers_go_with_the_next_compile(tmp_path):
    """A compile killed outright leaves its staging directory behind; the next compile to the
    same place removes it, but not one that a running compile is writing."""
    finished = subprocess.Popen(["true"])
    finished.wait()
    dead = tmp_path / f".out.partial-{finished.pid}"
    running = tmp_path / f".out.partial-{os.getppid()}"
    for staging in (dead, running):
        staging.mkdir()
        (staging / "params.safetensors").write_bytes(b"half")
    with staged(tmp_path / "out") as staging:
        (staging / "params.safetensors").write_bytes(b"whole")
    assert sorted(p.name for p in tmp_path.iterdir()) == [running.name, "out"]
    assert (tmp_path / "out" / "params.safetensors").read_bytes() == b"whole"


def test_a_terminated_compile_leaves_nothing(tmp_path):
    """SIGTERM (a service stopping, a timeout) while an artifact is written: exit status 143,
    no artifact and no staging directory."""
    script = (
        "import sys, time; from pathlib import Path; "
        "from mlc_spec.compiler.staging import staged\n"
        "with staged(Path(sys.argv[1])) as staging:\n"
        "    (staging / 'model.so').write_bytes(b'half')\n"
        "    time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "out")])
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".out.partial-*/model.so")) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 143
    assert list(tmp_path.iterdir()) == []


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


# Flags refused before the model is read, each with the one line that refuses it.
REFUSED_BEFORE_READING = {
    "unknown target": ("metal", [], "unknown target 'metal'; choose one of llvm, cuda"),
    "unknown CPU": (
        "llvm",
        ["--cpu", "pentium-9000"],
        "unknown CPU 'pentium-9000' (e.g. native, x86-64-v3, x86-64-v4)",
    ),
    "unknown quantization": (
        "llvm",
        ["--quantization", "q3"],
        "unknown quantization 'q3'; choose one of as-source, q4, q8, none",
    ),
    "unknown LM head quantization": (
        "cuda",
        ["--lm-head-quantization", "q2"],
        "unknown LM head quantization 'q2'; choose one of q4, q8",
    ),
    "unknown activations": (
        "llvm",
        ["--activations", "int4"],
        "unknown activations 'int4'; choose one of float, int8",
    ),
    "unknown KV cache dtype": (
        "llvm",
        ["--kv-cache-dtype", "int8"],
        "unknown KV cache dtype 'int8'; choose one of float32, float16",
    ),
    "unknown dtype": (
        "cuda",
        ["--dtype", "float8"],
        "dtype 'float8' is not supported on cuda; choose float16 or bfloat16 or float32",
    ),
    "int8 on a CPU without AVX2": (
        "llvm",
        ["--activations", "int8", "--cpu", "x86-64"],
        "--activations int8 needs a CPU with AVX2 or newer (see --cpu)",
    ),
    # Flags that do not apply to the target: refused, never silently ignored.
    "cpu for cuda": (
        "cuda",
        ["--cpu", "native"],
        "--cpu is built for --target llvm only, not cuda",
    ),
    "int8 activations for cuda": (
        "cuda",
        ["--activations", "int8"],
        "--activations int8 is built for --target llvm only, not cuda",
    ),
    "cut head for cuda": (
        "cuda",
        ["--lm-head-vocab", "8"],
        "--lm-head-vocab is built for --target llvm only, not cuda",
    ),
    "KV cache dtype for cuda": (
        "cuda",
        ["--kv-cache-dtype", "float16"],
        "--kv-cache-dtype is built for --target llvm only, not cuda",
    ),
    "cuda arch for llvm": (
        "llvm",
        ["--cuda-arch", "sm_80"],
        "--cuda-arch is built for --target cuda only, not llvm",
    ),
    "flashinfer for llvm": (
        "llvm",
        ["--attention", "flashinfer"],
        "attention 'flashinfer' is not supported on llvm; choose cpu",
    ),
    "tir for llvm": (
        "llvm",
        ["--attention", "tir"],
        "attention 'tir' is not supported on llvm; choose cpu",
    ),
    "cpu attention for cuda": (
        "cuda",
        ["--attention", "cpu"],
        "attention 'cpu' is not supported on cuda; choose flashinfer or tir",
    ),
    "float16 for llvm": (
        "llvm",
        ["--dtype", "float16"],
        "dtype 'float16' is not supported on llvm; choose float32",
    ),
    "bfloat16 for llvm": (
        "llvm",
        ["--dtype", "bfloat16"],
        "dtype 'bfloat16' is not supported on llvm; choose float32",
    ),
}


@pytest.mark.parametrize("case", REFUSED_BEFORE_READING)
def test_flag_is_refused_before_the_model_is_read(case, tmp_path, capsys):
    """The model path does not exist: had the model been read first, that would be the error.
    Nothing is written beside the output either."""
    target, flags, expected = REFUSED_BEFORE_READING[case]
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    args = [str(tmp_path / "no-model"), "--target", target, *flags, "-o", str(outputs / "out")]
    assert main(["compile", *args]) == 1
    assert capsys.readouterr().err.splitlines() == [f"mlc-spec compile: error: {expected}"]
    assert list(outputs.iterdir()) == []


def test_int8_activations_without_quantized_weights(checkpoint, tmp_path, capsys):
    """Known only once the weights are planned: still before anything is written."""
    out = tmp_path / "out"
    code, message = _compile(
        capsys, str(checkpoint), "--target", "llvm", "--activations", "int8", "-o", str(out)
    )
    assert code == 1
    assert message.endswith(
        "--activations int8 applies to quantized weights; --quantization none leaves this model "
        "with none"
    ), message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_validate_fills_in_the_targets_defaults():
    assert CompileOptions().validate("llvm") == CompileOptions(
        dtype="float32", cpu="native", attention="cpu"
    )
    assert CompileOptions().validate("cuda") == CompileOptions(
        dtype="float16", cuda_arch="sm_90", attention="flashinfer"
    )
    given = CompileOptions(
        dtype="bfloat16", cuda_arch="sm_80", attention="tir", quantization="q4", lm_head="q8"
    )
    assert given.validate("cuda") == given


def test_source_defaults_fill_only_what_was_not_given():
    hf = SimpleNamespace(stored_formats={}, source_hash="0" * 64)
    gguf = SimpleNamespace(stored_formats={"w": None}, source_hash="0" * 64)
    options = CompileOptions().validate("llvm")
    target = options.tvm_target("llvm")
    filled = options.with_source_defaults(hf, target)
    assert filled.quantization == "none" and filled.activations in ACTIVATIONS
    assert filled.kv_cache_dtype == "float32"  # float activations: the model's float type
    assert options.with_source_defaults(gguf, target).quantization == "as-source"
    int8 = CompileOptions(quantization="q8", activations="int8").validate("llvm")
    assert int8.with_source_defaults(hf, target).kv_cache_dtype == "float16"  # as llama.cpp's
    given = CompileOptions(quantization="q8", activations="int8", kv_cache_dtype="float32")
    assert given.validate("llvm").with_source_defaults(hf, target) == given.validate("llvm")
    cuda = CompileOptions().validate("cuda")
    assert cuda.with_source_defaults(hf, cuda.tvm_target("cuda")).kv_cache_dtype is None


@pytest.mark.parametrize("attention", sorted({a for t in TARGETS for a in ATTENTION[t]}))
def test_every_targets_attention_is_a_choice(attention):
    args = ["compile", "m", "--target", "llvm", "-o", "o", "--attention", attention]
    assert build_parser().parse_args(args).attention == attention


def test_the_command_line_loads_no_tvm_for_its_choices():
    """``generate`` and ``serve`` parse the same command line on TVM's runtime alone."""
    script = "import sys, mlc_spec.cli as c; c.build_parser(); print('tvm' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.stdout.strip() == "False", proc.stderr


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


def test_artifact_with_an_unknown_kv_cache_dtype_is_refused(tiny_llama, tmp_path):
    """Its pages would be allocated in a type its kernels do not read."""
    artifact = Path(shutil.copytree(tiny_llama.artifact, tmp_path / "artifact"))
    config_path = artifact / CONFIG_FILE
    config = json.loads(config_path.read_text())
    assert config["kv_cache_dtype"] == "float32"  # float activations: the model's type
    config["kv_cache_dtype"] = "float8"
    config_path.write_text(json.dumps(config))
    with pytest.raises(ArtifactError, match="has unknown kv_cache_dtype 'float8'"):
        Model(artifact)


def test_missing_cpu_features_reads_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx avx2 fma avx512f avx512_vnni\n")
    assert missing_cpu_features(["avx2", "avx512vnni", "avx512bw"], cpuinfo) == ["avx512bw"]


AVX2 = "avx avx2 f16c fma"
AVX512 = "avx512bw avx512dq avx512f avx512vl"


@pytest.mark.parametrize(
    ("flags", "features", "name"),
    [
        (AVX2, AVX2, "znver4-no-avx512bw-no-avx512dq-no-avx512f-no-avx512vl-no-avx512vnni"),
        (f"{AVX2} {AVX512} avx512_vnni", f"{AVX2} {AVX512} avx512vnni", "znver4"),
    ],
)
def test_native_target_drops_extensions_the_cpu_does_not_report(tmp_path, flags, features, name):
    """A VM may name its CPU a Zen 4 and mask AVX-512 off: native code must not use it."""
    import tvm

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: fpu {flags}\n")
    mtriple = tvm.target.Target.from_device("cpu").attrs["mtriple"]
    host = tvm.target.Target({"kind": "llvm", "mcpu": "znver4", "mtriple": mtriple})
    target = host_target(host, cpuinfo)
    assert vector_features(target) == sorted(features.split())
    assert cpu_name(target) == name


def test_weights_convert_while_tvm_compiles_and_a_failed_build_stops_them(
    checkpoint, tmp_path, monkeypatch
):
    """The build waits until the weights have started converting (it would wait forever were
    they converted first); when it then fails, the conversion stops at its next weight, and
    nothing is left behind."""
    import threading

    from mlc_spec.compiler import compile as compiling
    from mlc_spec.compiler.errors import CompileError

    started, converted = threading.Event(), []
    convert = compiling.convert_parameters

    def converting(*args):
        for item in convert(*args):
            started.set()
            converted.append(item[0])
            time.sleep(0.2)
            yield item

    def failing_build(*args):
        assert started.wait(60), "the build ran before the weights started converting"
        raise CompileError("TVM failed to compile for llvm: a test's failure")

    monkeypatch.setattr(compiling, "convert_parameters", converting)
    monkeypatch.setattr(compiling, "_build", failing_build)
    with pytest.raises(CompileError, match="a test's failure"):
        compiling.compile_model(checkpoint, "llvm", tmp_path / "out", show_progress=False)
    assert 1 <= len(converted) <= 2  # of the tiny model's 21 tensors
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


@pytest.mark.parametrize(
    ("signum", "raised"), [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, SystemExit)]
)
def test_a_signal_during_tvms_build_stops_the_compile_as_itself(
    signum, raised, checkpoint, tmp_path, monkeypatch
):
    """TVM hands an exception raised in its callbacks back as a RuntimeError: Ctrl-C or
    SIGTERM while it builds still ends the compile as an interrupt (exit 130 or 143), not as a
    compile error, and leaves nothing behind."""
    from mlc_spec.compiler import compile as compiling

    def interrupted_build(*args, **kwargs):
        try:
            os.kill(os.getpid(), signum)
            time.sleep(5)
        except BaseException as err:  # what TVM's FFI does with it
            raise RuntimeError(str(err)) from None
        raise AssertionError("no signal arrived")

    monkeypatch.setattr(compiling.tvm, "compile", interrupted_build)
    with pytest.raises(raised):
        compiling.compile_model(checkpoint, "llvm", tmp_path / "out", show_progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
