"""Compiled prefill / decode / evaluate_multi_query against Hugging Face transformers on the
same weights, and the KV-cache operations speculation relies on (verify == decodes, popn)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tiny_models import VOCAB, hf_logits

from mlc_spec.runtime.model import Model

TOL = 1e-4


def _assert_close(ours: np.ndarray, ref: np.ndarray) -> None:
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() <= TOL
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))


TINY = ["tiny_llama", "tiny_qwen2", "tiny_llama_q4", "tiny_qwen2_q8"]


@pytest.fixture(params=TINY)
def tiny(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(params=[*TINY, "tiny_llama_q4_int8"])
def any_tiny(request):
    """Also int8 activations, which no transformers model computes exactly: the KV-cache
    operations speculation relies on must hold for them too."""
    return request.getfixturevalue(request.param)


def _cache(model: Model):
    return model.create_kv_cache(max_batch_size=8, max_total_len=2048, prefill_chunk_size=256)


def test_logits_match_transformers(tiny):
    model = Model(tiny.artifact)
    seq = np.random.default_rng(1).integers(0, VOCAB, 48)
    ref = hf_logits(tiny.hf, seq)
    kv = _cache(model)
    kv.add_sequence(0)
    prefill = model.prefill(kv, [0], [seq[:30]]).numpy()
    decodes = np.stack([model.decode(kv, [0], [t]).numpy()[0] for t in seq[30:38]])
    verify = model.evaluate_multi_query(kv, [0], [seq[38:]]).numpy()
    _assert_close(prefill, ref[29:30])
    _assert_close(decodes, ref[30:38])
    _assert_close(verify, ref[38:])
    kv.add_sequence(1)  # 48 rows at once: the matmuls' GEMM path
    _assert_close(model.evaluate_multi_query(kv, [1], [seq]).numpy(), ref)


def test_ragged_prefill_and_batched_decode_match_transformers(tiny):
    model = Model(tiny.artifact)
    rng = np.random.default_rng(2)
    seqs = [rng.integers(0, VOCAB, n) for n in (5, 17, 33)]
    kv = _cache(model)
    for i in range(3):
        kv.add_sequence(i)
    last = model.prefill(kv, [0, 1, 2], [s[:-1] for s in seqs]).numpy()
    step = model.decode(kv, [0, 1, 2], [int(s[-1]) for s in seqs]).numpy()
    for i, s in enumerate(seqs):
        ref = hf_logits(tiny.hf, s)
        _assert_close(last[i : i + 1], ref[-2:-1])
        _assert_close(step[i : i + 1], ref[-1:])


@pytest.mark.parametrize("draft_lens", [(1, 4, 6), (2, 3, 7), (5, 5, 6)])
def test_multi_query_equals_single_decodes_ragged(any_tiny, draft_lens):
    """A ragged batch verified at once equals K decodes per sequence; 11, 12 and 16 rows in
    all cover the matmuls' small-m row tiles (and their padding) beyond the decode path."""
    model = Model(any_tiny.artifact)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, VOCAB, n) for n in (9, 21, 14)]
    drafts = [rng.integers(0, VOCAB, k) for k in draft_lens]
    kv = _cache(model)
    for i, p in enumerate(prompts):
        kv.add_sequence(i)
        kv.add_sequence(10 + i)
        model.prefill(kv, [i, 10 + i], [p, p])
    verified = model.evaluate_multi_query(kv, [0, 1, 2], drafts).numpy()
    singles = [model.decode(kv, [10 + i], [t]).numpy()[0] for i, d in enumerate(drafts) for t in d]
    np.testing.assert_allclose(verified, np.stack(singles), atol=1e-5)
    lengths = [len(p) + len(d) for p, d in zip(prompts, drafts, strict=True)]
    assert [kv.sequence_length(i) for i in range(3)] == lengths


@pytest.fixture(params=["q4", "gguf"])
def int8_artifact(request) -> Path:
    """int8 activations over q4 weights, and over a GGUF's every tensor type (two-level Q4_K
    among them)."""
    if request.param == "q4":
        return request.getfixturevalue("tiny_llama_q4_int8").artifact
    return request.getfixturevalue("tiny_gguf_int8")


def test_int8_rows_without_a_prefix_equal_decodes_bit_for_bit(int8_artifact):
    """With int8 activations every kernel but attention computes a row the same way whatever the
    number of rows, so 40 new tokens of a fresh sequence (one ragged attention pass, no prefix
    to merge; the matmuls' m >= 32 regime) give exactly the logits of a prefill of one token and
    39 decodes. A verify after a
    prefix is not bit-exact: TVM's KV cache merges a prefix pass and a new-token pass there
    (docs/quantization.md)."""
    model = Model(int8_artifact)
    tokens = np.random.default_rng(5).integers(0, VOCAB, 40)
    kv = _cache(model)
    kv.add_sequence(0)
    kv.add_sequence(1)
    at_once = model.evaluate_multi_query(kv, [0], [tokens]).numpy()
    model.prefill(kv, [1], [tokens[:1]])
    decoded = [model.decode(kv, [1], [int(t)]).numpy()[0] for t in tokens[1:]]
    np.testing.assert_array_equal(at_once[1:], np.stack(decoded))


def test_popn_rollback_equals_never_decoded(any_tiny):
    model = Model(any_tiny.artifact)
    rng = np.random.default_rng(4)
    # 14 + 5 tokens fill one 16-token page and start another; the rollback crosses back.
    prompt, draft, nxt = rng.integers(0, VOCAB, 14), rng.integers(0, VOCAB, 5), 7
    kv = _cache(model)
    kv.add_sequence(0)
    kv.add_sequence(1)
    model.prefill(kv, [0, 1], [prompt, prompt])
    model.evaluate_multi_query(kv, [0], [draft])
    kv.popn(0, 3)  # keep 2 of 5 draft tokens
    assert kv.sequence_length(0) == len(prompt) + 2
    after_rollback = model.decode(kv, [0], [nxt]).numpy()
    model.evaluate_multi_query(kv, [1], [draft[:2]])
    never_decoded = model.decode(kv, [1], [nxt]).numpy()
    np.testing.assert_allclose(after_rollback, never_decoded, atol=1e-5)


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    from conftest import TinyModel

    scaling = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    tiny = TinyModel(tmp_path, "llama", seed=5, rope_parameters=scaling)
    model = Model(tiny.artifact)
    seq = np.random.default_rng(5).integers(0, VOCAB, 200)  # past the original context
    kv = _cache(model)
    kv.add_sequence(0)
    ours = model.evaluate_multi_query(kv, [0], [seq]).numpy()
    _assert_close(ours, hf_logits(tiny.hf, seq))
