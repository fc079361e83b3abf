"""``--lm-head-vocab N``: a head scoring only the first N token ids gives them the whole model's
logits and every other id -inf, from a float, group-quantized or GGUF source, tied or not; a
draft compiled so keeps speculation lossless (greedy here; sampled in
test_speculation_sampling.py)."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_gguf import write_mixed_gguf
from tiny_models import VOCAB

from mlc_spec import LLM, SamplingParams
from mlc_spec.compiler.compile import compile_model
from mlc_spec.compiler.errors import CompileError
from mlc_spec.compiler.options import CompileOptions
from mlc_spec.runtime.artifact import read_config
from mlc_spec.runtime.model import Model

ROWS = VOCAB // 2


def _logits(artifact, tokens) -> np.ndarray:
    """Logits of every token of ``tokens`` as one new sequence [len, VOCAB]."""
    model = Model(artifact)
    kv = model.create_kv_cache(max_batch_size=1, max_total_len=256, prefill_chunk_size=64)
    kv.add_sequence(0)
    return model.evaluate_multi_query(kv, [0], [tokens]).numpy()


def _assert_trimmed(full: np.ndarray, trimmed: np.ndarray) -> None:
    np.testing.assert_allclose(trimmed[:, :ROWS], full[:, :ROWS], rtol=1e-5, atol=1e-5)
    assert np.all(trimmed[:, ROWS:] == -np.inf)


@pytest.mark.parametrize(
    "fixture,quantization",
    [("tiny_llama", None), ("tiny_qwen2", None), ("tiny_qwen2_q8", "q8")],
    ids=["untied", "tied", "tied-q8-table"],
)
def test_head_scores_the_first_ids_as_the_whole_model(request, tmp_path, fixture, quantization):
    tiny = request.getfixturevalue(fixture)
    trimmed = compile_model(
        tiny.checkpoint,
        "llvm",
        tmp_path / "trimmed",
        CompileOptions(quantization=quantization, lm_head_vocab=ROWS),
        show_progress=False,
    )
    tokens = list(np.random.default_rng(0).integers(0, VOCAB, 20))
    _assert_trimmed(_logits(tiny.artifact, tokens), _logits(trimmed, tokens))
    assert read_config(trimmed)["model"]["lm_head_vocab"] == ROWS


def test_head_cut_from_a_gguf_as_stored(tmp_path):
    """The first layer only: the head's cut does not depend on the layers, their kernels'
    compile is most of the time."""
    path = write_mixed_gguf(tmp_path / "tiny.gguf", "llama")
    full, trimmed = (
        compile_model(
            path,
            "llvm",
            tmp_path / name,
            CompileOptions(lm_head_vocab=rows, num_layers=1),
            show_progress=False,
        )
        for name, rows in (("full", None), ("trimmed", ROWS))
    )
    tokens = list(np.random.default_rng(1).integers(0, VOCAB, 12))
    _assert_trimmed(_logits(full, tokens), _logits(trimmed, tokens))


def test_trimmed_draft_is_lossless(tiny_llama, tiny_llama_draft, tmp_path):
    draft = compile_model(
        tiny_llama_draft.checkpoint, "llvm", tmp_path / "draft", CompileOptions(lm_head_vocab=ROWS),
        show_progress=False,
    )  # fmt: skip
    rng = np.random.default_rng(2)
    prompts = [list(rng.integers(0, VOCAB, n)) for n in (4, 11, 30)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    def token_ids(llm: LLM) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    speculative = {"method": "draft", "num_speculative_tokens": 3}
    llm = LLM(tiny_llama.artifact, draft_model=draft, speculative=speculative)
    assert token_ids(llm) == token_ids(LLM(tiny_llama.artifact))
    # Half the ids are beyond the draft: some drafts are accepted, others cannot be.
    assert 0.05 < llm.metrics()["acceptance_rate"] < 0.95


@pytest.mark.parametrize("rows", [0, VOCAB])
def test_a_head_of_no_ids_or_all_ids_is_refused(tiny_llama, tmp_path, rows):
    with pytest.raises(CompileError, match=f"--lm-head-vocab must be between 1 and {VOCAB - 1}"):
        compile_model(
            tiny_llama.checkpoint, "llvm", tmp_path / "out", CompileOptions(lm_head_vocab=rows),
            show_progress=False,
        )  # fmt: skip
    assert not any(tmp_path.iterdir())


def test_a_cut_head_is_refused_for_cuda(tiny_llama, tmp_path):
    with pytest.raises(CompileError, match="--lm-head-vocab is built for --target llvm only"):
        compile_model(
            tiny_llama.checkpoint, "cuda", tmp_path / "out", CompileOptions(lm_head_vocab=ROWS),
            show_progress=False,
        )  # fmt: skip
    assert not any(tmp_path.iterdir())
