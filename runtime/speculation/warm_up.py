"""Load-time measurement of forward-pass costs, so the policy has costs from the first step."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

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
# A draft's catch-ups (one sequence reading its prompt) are timed every this many tokens up to
# LARGEST_CATCH_UP (or a prefill chunk), and priced in proportion beyond it, as ``CostTable``
# does past its largest size: from there a pass costs close to its token count. The Qwen 0.5B
# draft: 3.04, 3.09, 3.23 and 3.38 ms a token at 64, 128, 256 and 512 tokens, so a 512-token
# catch-up is priced 4% under, and the README pair's load takes 15 s instead of 27.
CATCH_UP_STRIDE = 64
LARGEST_CATCH_UP = 256
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
    widest = [max(p[i] if i < len(p) else 0 for p in passes) for i in range(max(map(len, passes)))]
    with _sequences(kv, len(widest)) as ids:
        _grow(model, kv, ids, context if _fits(kv, context, widest) else 0, chunk_size)
        return _sweeps(model, kv, function, passes, ids)


def attention_costs(
    model: Model, kv: PagedKVCache, rows: int, width: int, chunk_size: int
) -> Attention:
    """What a pass pays per token of context beyond the reference (``Attention``): ``rows``
    decode rows, and a verify of ``width`` tokens of one sequence against one token, each timed
    at ``REFERENCE_CONTEXT`` and at up to ``LONG_CONTEXT`` tokens per sequence (what the cache
    holds); none where it holds too little to tell. The same sequences serve both functions and
    grow from one context to the other (``_grow``: on the CPU the long context repeats the
    reference one's pages; four sets of prefilled sequences took 10.3 s of Qwen2.5-1.5B's load
    at batch 1). The reference passes are timed again, right beside the long ones, though the
    tables hold them: a difference of passes timed seconds apart drifted with the host (the
    draft rate of SmolLM2 int8 ranged 0.06-1.5 us over three loads, against 0.5-0.9 paired)."""
    long = min(LONG_CONTEXT, (kv.available_pages() // rows - 1) * kv.page_size)
    if long < 4 * REFERENCE_CONTEXT or width < 2:
        return Attention()
    functions = (("decode", [[1] * rows]), ("evaluate_multi_query", [[1], [width]]))
    timed = []  # per context, per function, per pass
    with _sequences(kv, rows) as ids:
        for context in (REFERENCE_CONTEXT, long):
            _grow(model, kv, ids, context, chunk_size)
            timed.append([_sweeps(model, kv, f, passes, ids) for f, passes in functions])
    if any(None in times for at_context in timed for times in at_context):
        return Attention()
    (near_decode, near_verify), (far_decode, far_verify) = timed
    beyond = long - REFERENCE_CONTEXT

    def added(near: list[float], far: list[float]) -> list[float]:
        """Per pass: seconds per token of context beyond the reference."""
        return [max(0.0, f - n) / beyond for n, f in zip(near, far, strict=True)]

    decode, verify = added(near_decode, far_decode), added(near_verify, far_verify)
    return Attention(decode[0] / rows, max(0.0, verify[1] - verify[0]) / (width - 1))


def _fits(kv: PagedKVCache, context: int, lengths: Sequence[int]) -> bool:
    """Whether the cache has the pages for sequences of ``context`` + ``lengths[i]`` tokens."""
    need = sum(-(-(context + n) // kv.page_size) for n in lengths)
    return need <= kv.available_pages()


@contextmanager
def _sequences(kv: PagedKVCache, n: int) -> Iterator[list[int]]:
    """``n`` throwaway sequences in the empty cache, removed afterwards."""
    ids = list(range(n))
    for seq_id in ids:
        kv.add_sequence(seq_id)
    try:
        yield ids
    finally:
        for seq_id in ids:
            kv.remove_sequence(seq_id)


def _grow(model: Model, kv: PagedKVCache, ids: list[int], context: int, chunk_size: int) -> None:
    """Each sequence up to ``context`` tokens where the cache can copy pages: the first's whole
    pages repeated (prefilled while it holds none), the others copies of its pages, so each row
    still reads pages of its own, as distinct contexts are read (prefilling 480 more tokens took
    ~5 s of Qwen2.5-1.5B's load, prefilling each of a server's 8 rows 43 s); else each
    prefilled."""
    first, behind = ids[0], [seq_id for seq_id in ids[1:] if kv.sequence_length(seq_id) < context]
    if not kv.repeat_sequence(first, context):
        _prefill(model, kv, [first], context, chunk_size)
    for seq_id in behind:
        kv.remove_sequence(seq_id)
        if not kv.copy_sequence(first, seq_id):
            kv.add_sequence(seq_id)
    _prefill(model, kv, behind, context, chunk_size)


def _prefill(model: Model, kv: PagedKVCache, ids: list[int], context: int, chunk_size: int) -> None:
    """Sequences ``ids`` prefilled up to ``context`` tokens, where they hold fewer."""
    tokens = {
        seq_id: [(seq_id * 31 + j) % model.vocab_size for j in range(length, context)]
        for seq_id in ids
        if (length := kv.sequence_length(seq_id)) < context
    }
    if tokens:
        model.prefill_chunked(kv, list(tokens), list(tokens.values()), chunk_size)


def _sweeps(
    model: Model, kv: PagedKVCache, function: str, passes: Sequence[Sequence[int]], ids: list[int]
) -> list[float | None]:
    """``time_passes``' timing on sequences ``ids``, each pass's tokens taken back after it."""
    rng = np.random.default_rng(0)
    seconds: list[float | None] = []
    for lengths in [passes[0], *passes * SWEEPS]:  # the first, untimed: first-call costs
        if not _fits(kv, 0, lengths):
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
    timed = seconds[1:]
    sweeps = [timed[i * len(passes) : (i + 1) * len(passes)] for i in range(SWEEPS)]
    return [None if None in times else min(times) for times in zip(*sweeps, strict=True)]


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
