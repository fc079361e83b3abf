"""The real SmolLM2-135M-Instruct: compiled greedy generation equals transformers' token for
token, on the same GGUF file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from bench_scripts import script
from tokenizers import Tokenizer

from mlc_spec.runtime.model import Model

pytestmark = pytest.mark.slow
transformers_cache = script("transformers_cache")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]
NEW_TOKENS = 32


def _greedy(model: Model, prompt: list[int]) -> list[int]:
    kv = model.create_kv_cache(max_batch_size=1, max_total_len=512, prefill_chunk_size=128)
    kv.add_sequence(0)
    out = [int(model.sampler.argmax(model.prefill(kv, [0], [prompt]))[0])]
    while len(out) < NEW_TOKENS:
        out.append(int(model.sampler.argmax(model.decode(kv, [0], [out[-1]]))[0]))
    return out


@torch.no_grad()
def _hf_greedy(hf: torch.nn.Module, prompt: list[int]) -> list[int]:
    """Plain argmax decoding with transformers' KV cache (no logits processors, no EOS stop)."""
    cache = transformers_cache.cache_argument(hf, transformers.DynamicCache(config=hf.config))
    out = hf(torch.tensor([prompt]), use_cache=True, **cache)
    tokens = [int(out.logits[0, -1].argmax())]
    while len(tokens) < NEW_TOKENS:
        out = hf(torch.tensor([[tokens[-1]]]), use_cache=True, **cache)
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def test_greedy_generation_matches_transformers(smollm2, smollm2_hf):
    model = Model(smollm2)
    tokenizer = Tokenizer.from_file(str(smollm2 / "tokenizer.json"))
    for text in PROMPTS:
        prompt = tokenizer.encode(text).ids
        assert _greedy(model, prompt) == _hf_greedy(smollm2_hf, prompt), text


def test_prefill_logits_close_to_transformers(smollm2, smollm2_hf):
    model = Model(smollm2)
    prompt = Tokenizer.from_file(str(smollm2 / "tokenizer.json")).encode(PROMPTS[0]).ids
    kv = model.create_kv_cache(max_batch_size=1, max_total_len=512, prefill_chunk_size=128)
    kv.add_sequence(0)
    ours = model.evaluate_multi_query(kv, [0], [prompt]).numpy()
    with torch.no_grad():
        ref = smollm2_hf(torch.tensor([prompt])).logits[0].numpy()
    assert np.abs(ours - ref).max() < 1e-3 * np.abs(ref).max()
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))
