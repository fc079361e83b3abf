"""Load-time measurement of forward-pass costs, so the policy has costs from the first step."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from ..kv_cache import PagedKVCache
from ..model import Model
from ..params import SamplingParams
from ..sampling import probs_for, sample_from_probs

# Tokens each throwaway sequence holds before the timed passes: attention over a short prompt.
CONTEXT_TOKENS = 32
_SAMPLED = SamplingParams(temperature=1.0)


def time_passes(
    model: Model,
    kv: PagedKVCache,
    function: str,
    passes: Sequence[Sequence[int]],
    chunk_size: int,
) -> list[float]:
    """Seconds of each pass of ``model.<function>`` (``decode``, ``prefill`` or
    ``evaluate_multi_query``) plus sampling from its logits, as a real step pays; ``passes[i]``
    lists the new tokens of each row. Runs on throwaway sequences in an empty cache, which hold
    ``CONTEXT_TOKENS`` each and are removed afterwards."""
    ids = list(range(max(len(p) for p in passes)))
    rng = np.random.default_rng(0)
    for seq_id in ids:
        kv.add_sequence(seq_id)
    try:
        context = [
            [(seq_id * 31 + j) % model.vocab_size for j in range(CONTEXT_TOKENS)] for seq_id in ids
        ]
        model.prefill_chunked(kv, ids, context, chunk_size)
        seconds = []
        for lengths in [passes[0], *passes]:  # the first, untimed: first-call costs
            rows = ids[: len(lengths)]
            start = time.perf_counter()
            if function == "decode":
                logits = model.decode(kv, rows, [1] * len(rows))
            else:
                logits = getattr(model, function)(kv, rows, [[1] * n for n in lengths])
            probs = probs_for(logits, [_SAMPLED] * len(logits))
            sample_from_probs(probs, rng.random(len(logits)))
            seconds.append(time.perf_counter() - start)
            for seq_id, n in zip(rows, lengths, strict=True):
                kv.popn(seq_id, n)
    finally:
        for seq_id in ids:
            kv.remove_sequence(seq_id)
    return seconds[1:]


def spread(tokens: int, max_per_row: int) -> list[int]:
    """``tokens`` over as few rows as hold at most ``max_per_row`` each, as evenly as possible."""
    rows = -(-tokens // max_per_row)
    base, extra = divmod(tokens, rows)
    return [base + 1] * extra + [base] * (rows - extra)
