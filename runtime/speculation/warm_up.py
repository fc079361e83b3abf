"""Load-time measurement of forward-pass costs, so the policy has costs from the first step."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import numpy as np

from ..kv_cache import PagedKVCache
from ..model import Model
from ..params import SamplingParams
from .costs import REFERENCE_CONTEXT, Attention, CostTable

# Context that attention is timed at besides the reference: the tokens a served sequence holds
# while it decodes, prompt and answer, is several hundred.
LONG_CONTEXT = 512
# Pass sizes timed at load time: every size up to FINE_SIZES (the small-batch matmul tiles make
# each of them a step of its own), then every COARSE_STRIDE-th. An unmeasured size is charged
# what the next measured one costs, and real steps time the sizes they run, so the coarse part
# costs the policy little, while timing every size of a big model's widest verify passes (up to
# batch x (K + 1) tokens) would take minutes at load.
FINE_SIZES = 32
COARSE_STRIDE = 8
# Largest verify pass timed at load: from about here a pass runs the matmuls' full row tiles and
# costs in proportion to its tokens, as ``CostTable`` prices the sizes past the largest measured.
# A batch of 16 with 12 drafts each (suffix decoding's cap) would otherwise time passes up to 208
# tokens, ~25 s more of a Qwen2.5-1.5B server's load on 2 cores.
LARGEST_TIMED = 128
# A draft's catch-ups (one sequence reading its prompt) are timed every this many tokens up to a
# prefill chunk: few passes, and in that range a pass costs close to its token count.
CATCH_UP_STRIDE = 64
# Sweeps over the sizes; each size keeps its fastest. Other load only ever adds time, and a burst
# of it at load time would otherwise stick: an overrated plain decode makes the policy draft
# where it should not, and a path it does not take is never measured again.
SWEEPS = 2
_SAMPLED = SamplingParams(temperature=1.0)


def time_passes(
    model: Model,
    kv: PagedKVCache,
    function: str,
    passes: Sequence[Sequence[int]],
    chunk_size: int,
    context: int = REFERENCE_CONTEXT,
) -> list[float | None]:
    """Seconds of each pass of ``model.<function>`` (``decode``, ``prefill`` or
    ``evaluate_multi_query``) plus sampling from its logits, as a real step pays; ``passes[i]``
    lists the new tokens of each row. Runs on throwaway sequences in the empty cache, holding
    ``context`` tokens each where the cache has room (else none), removed afterwards; a pass
    the cache cannot hold is not run (``None``). The fastest of ``SWEEPS`` sweeps over all
    passes."""
    ids = list(range(max(len(p) for p in passes)))

    def fits(context: int, lengths: Sequence[int]) -> bool:
        need = sum(-(-(context + n) // kv.page_size) for n in lengths)
        return need <= kv.available_pages()

    widest = [max(p[i] if i < len(p) else 0 for p in passes) for i in ids]
    context = context if fits(context, widest) else 0
    rng = np.random.default_rng(0)
    for seq_id in ids:
        kv.add_sequence(seq_id)
    try:
        if context:
            tokens = [[(i * 31 + j) % model.vocab_size for j in range(context)] for i in ids]
            model.prefill_chunked(kv, ids, tokens, chunk_size)
        seconds: list[float | None] = []
        for lengths in [passes[0], *passes * SWEEPS]:  # the first, untimed: first-call costs
            if not fits(0, lengths):
                seconds.append(None)
                continue
            rows = ids[: len(lengths)]
            start = time.perf_counter()
            if function == "decode":
                logits = model.decode(kv, rows, [1] * len(rows))
            else:
                logits = getattr(model, function)(kv, rows, [[1] * n for n in lengths])
            n = logits.shape[0]
            model.sampler.sample_logits(logits, [_SAMPLED] * n, rng.random(n))
            seconds.append(time.perf_counter() - start)
            for seq_id, n in zip(rows, lengths, strict=True):
                kv.popn(seq_id, n)
    finally:
        for seq_id in ids:
            kv.remove_sequence(seq_id)
    timed = seconds[1:]
    sweeps = [timed[i * len(passes) : (i + 1) * len(passes)] for i in range(SWEEPS)]
    return [None if None in times else min(times) for times in zip(*sweeps, strict=True)]


def attention_costs(
    model: Model, kv: PagedKVCache, rows: int, width: int, chunk_size: int
) -> Attention:
    """What a pass pays per token of context beyond the reference (``Attention``): ``rows``
    decode rows, and a verify of ``width`` tokens of one sequence against one token, each timed
    at ``REFERENCE_CONTEXT`` and at up to ``LONG_CONTEXT`` tokens per sequence (what the cache
    holds); none where it holds too little to tell."""
    long = min(LONG_CONTEXT, (kv.available_pages() // rows - 1) * kv.page_size)
    if long < 4 * REFERENCE_CONTEXT or width < 2:
        return Attention()

    def added(function: str, passes: list[list[int]]) -> list[float] | None:
        """Per pass: seconds per token of context beyond the reference, per sequence. The
        reference passes are timed again, right beside the long ones, though the tables hold
        them: a difference of passes timed seconds apart drifted with the host (the draft rate
        of SmolLM2 int8 ranged 0.06-1.5 us over three loads, against 0.5-0.9 paired)."""
        near = time_passes(model, kv, function, passes, chunk_size, REFERENCE_CONTEXT)
        far = time_passes(model, kv, function, passes, chunk_size, long)
        if None in near or None in far:
            return None
        beyond = long - REFERENCE_CONTEXT
        return [max(0.0, f - n) / beyond for n, f in zip(near, far, strict=True)]

    decode = added("decode", [[1] * rows])
    verify = added("evaluate_multi_query", [[1], [width]])
    if decode is None or verify is None:
        return Attention()
    return Attention(decode[0] / rows, max(0.0, verify[1] - verify[0]) / (width - 1))


def sizes(smallest: int, largest: int) -> list[int]:
    """The pass sizes to time at load, from ``smallest`` to ``largest`` tokens (or rows)."""
    fine = range(smallest, min(largest, FINE_SIZES) + 1)
    coarse = range(FINE_SIZES + COARSE_STRIDE, largest, COARSE_STRIDE)
    return sorted({*fine, *coarse, largest}) if largest >= smallest else []


def spread(tokens: int, max_per_row: int) -> list[int]:
    """``tokens`` over as few rows as hold at most ``max_per_row`` each, as evenly as possible."""
    rows = -(-tokens // max_per_row)
    base, extra = divmod(tokens, rows)
    return [base + 1] * extra + [base] * (rows - extra)


def record(table: CostTable, sizes: Iterable[int], seconds: Iterable[float | None]) -> None:
    """Enter the measured passes into ``table`` (those that did not run are left out)."""
    for size, s in zip(sizes, seconds, strict=True):
        if s is not None:
            table.observe(size, s)
