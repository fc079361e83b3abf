"""Greedy losslessness on the real SmolLM2-135M-Instruct: speculative output (draft model and
prompt lookup, several k) equals target-only output over a batch of mixed prompt lengths."""

from __future__ import annotations

import pytest

from mlc_spec import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "def fibonacci(n):",
    "<|im_start|>user\nWrite a Python function that reverses a string, then explain it."
    "<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. "
    "The quick brown fox",
]
PARAMS = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(smollm2) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in LLM(smollm2).generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize(
    ("method", "k"), [("ngram", 2), ("ngram", 5), ("draft", 2), ("draft", 4), ("self", 3)]
)
def test_speculation_is_lossless(smollm2, smollm2_first_layers, reference, method, k):
    draft = {"draft": smollm2_first_layers, "self": smollm2}.get(method)
    spec = {"method": "ngram" if method == "ngram" else "draft", "num_speculative_tokens": k}
    llm = LLM(smollm2, draft_model=draft, speculative=spec)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)] == reference
    stats = llm.metrics()
    assert stats["num_draft_tokens"] > 0
    if method == "self":
        assert stats["acceptance_rate"] == 1.0
    assert llm.engine.kv.available_pages() == llm.engine.capacity_pages


@pytest.mark.parametrize(("method", "k"), [("ngram", 5), ("draft", 4)])
def test_int8_speculation_is_lossless(smollm2_int8, smollm2_first_layers, method, k):
    """With int8 activations too: the same engine's plain decoding, token for token."""
    plain = [o.outputs[0].token_ids for o in LLM(smollm2_int8).generate(PROMPTS, PARAMS)]
    draft = smollm2_first_layers if method == "draft" else None
    spec = {"method": method, "num_speculative_tokens": k}
    llm = LLM(smollm2_int8, draft_model=draft, speculative=spec)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)] == plain
    assert llm.metrics()["num_accepted_tokens"] > 0
