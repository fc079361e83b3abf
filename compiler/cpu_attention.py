"""Vectorised CPU attention kernels for TVM's paged KV cache, in place of TVM's own.

TVM 0.27 gives the ``llvm`` KV cache scalar attention kernels: one key and one feature at a
time, the decode kernel on one thread and the ragged prefill kernel on one thread per sequence.
With its RoPE kernel (``cpu_rope``) they took ~18% of a 128-token SmolLM2 prefill and ~25% of a
decode step at context 128 (``scripts/profile_step.py``, 1 thread); these kernels are 5-10x
faster per call (``tests/test_cpu_attention.py`` checks them). The kernels here take
the same arguments in the same order, because the KV cache calls them by position
(``src/runtime/vm/attn_backend.h``), so ``UseCPUAttentionKernels`` simply swaps them into the
module that ``TIRPagedKVCache`` built.

The decode and ragged kernels attend each (query row, head) pair on its own: one online
softmax over its keys, 16 keys (one page) at a time. A chunk computes its dot products side by
side, independent FMA chains, and adds up their partial sums with one transposing tree of
shuffles (``transpose_sum``) that leaves key r's score in lane r; a short ragged chunk too (a
verify step's new keys: with one horizontal sum per key, the ragged kernel took 1.1-1.2x as
long for 2-9 new rows of SmolLM2's heads, 2 threads, 2026-11-24). Only a chunk that raises the
running max rescales what was summed, and the running sum is kept per lane, so a chunk's one
horizontal reduction is its max. Values are added with one vector FMA per key. The thread pool
splits the work over (head, block of query rows).

The paged prefill kernel, which a verify step runs over each sequence's prefix (K + 1 rows
against the same pages), puts query vectors in vector lanes instead: a sequence's new rows
times the query heads of one KV head make tiles of ``lanes`` query vectors, lane i of every
vector belonging to query vector i. A task transposes its tile's queries once
(``qt[feature, lane]``) and, per page, computes the scores of 8 keys at a time (4 with
AVX2's 16 registers) in two accumulator vectors per key, each a chain of multiply-adds of a
query feature vector by that key's feature (broadcast from the page) over half the features
(one chain over all of them rounded the 9-row logits of a parity test just past its float32
tolerance); keeps the running max, rescale and sum lane by lane, with no horizontal reduction
or branch; and adds the values 8 output features at a time the same way. Each key and value
is read once per tile instead of once per row and head, and every multiply-add chain has 7 or
more independent neighbours. When no sequence has more than ``lanes / 2`` query vectors (2
rows of SmolLM2), tiles would be mostly empty lanes and too few tasks for the threads, so each
(row, head) is a task, as in the decode kernel. The one-pair-at-a-time form is latency bound:
on a 2-core AVX-512 Xeon it ran at a sixth of the cores' multiply-add rate, and this kernel
took 0.57-0.84x its time for 4-9 rows of SmolLM2's and Qwen2.5's heads at context 133
(``scripts/bench_attention.py``; 1 row: still the decode kernel).

Scores are kept in base 2 (scaled by log2 e) with TVM's conventions for the log-sum-exp
output, so TVM's merge kernel combines a prefix's and a chunk's attention. Only the KV cache's
``RopeMode.NORMAL`` is supported (RoPE applied before the cache), which is what
``models/llama.py`` builds; other modes fail with a clear assertion.
"""

from __future__ import annotations

import math

import tvm
from tvm import tirx
from tvm.script import tirx as T

from .cpu_rule import float_lanes
from .vector_exp import exp2

PAGE = 16  # tokens per KV page, the size TVM 0.27's page kernels are generated for
ROWS_PER_TASK = 8  # query rows one prefill task attends, one row at a time
LANES = PAGE  # vector lanes of a dot product and of a chunk's scores; head sizes: multiples
_EMPTY = -5e4  # TVM's running max before any key: a row with no keys merges with weight 0
_MASKED = -1e30  # the score of a key past a chunk's end: weight 2**(-1e30 - max) = 0
FEATURES = 8  # output features a values pass accumulates: 8 vectors hide an FMA's latency
_LOG2E = math.log2(math.e)


def _halves(src: tirx.Buffer, i: int, s: int) -> tirx.PrimExpr:
    """One level of ``transpose_sum``: vectors i and i + s of ``src``, whose lanes hold partial
    sums in runs of 2s lanes per key, added pairwise into one vector with runs of s lanes per
    key: vector i's keys take the first half of each run of 2s lanes, vector i + s's the
    second."""
    x = src.vload([i * LANES], f"float32x{LANES}")
    y = src.vload([(i + s) * LANES], f"float32x{LANES}")
    first = [lane % (2 * s) < s for lane in range(LANES)]
    near = [lane if f else LANES + lane for lane, f in enumerate(first)]
    far = [lane + s if f else LANES + lane - s for lane, f in enumerate(first)]
    return tirx.Shuffle([x, y], near) + tirx.Shuffle([x, y], far)


def _butterfly(src: tirx.Buffer, op) -> tirx.PrimExpr:
    """``op`` over the first LANES lanes of ``src`` (a sum or max): 4 shuffle-and-op steps,
    leaving the result in every lane; lane 0 returned."""
    x = src.vload([0], f"float32x{LANES}")
    for step in (8, 4, 2, 1):
        x = op(x, tirx.Shuffle([x], [lane ^ step for lane in range(LANES)]))
    return tirx.Shuffle([x], [0])


def _transposed(vectors: list) -> list:
    """The square matrix whose rows are ``vectors`` (as many as their lanes), transposed:
    log2(lanes) rounds of two-vector shuffles, each swapping the off-diagonal blocks of every
    diagonal block twice its size, each result bound once."""
    n = len(vectors)
    s = n // 2
    while s:
        swapped = list(vectors)
        for i in (i for i in range(n) if not i & s):
            pair = [vectors[i], vectors[i + s]]
            swapped[i] = T.Bind(tirx.Shuffle(pair, [p + n - s if p & s else p for p in range(n)]))
            swapped[i + s] = T.Bind(
                tirx.Shuffle(pair, [p + n if p & s else p + s for p in range(n)])
            )
        vectors = swapped
        s //= 2
    return vectors


def _queries_in_lanes(q, qt, tile: tuple, fb, group: int, lanes: int, scale) -> None:
    """Features ``fb * lanes`` on of a tile's query vectors, times ``scale``, into ``qt`` with
    query vector i in lane i (zeros past the tile's ``n_vec``): one vector load per query
    vector and an in-register transpose. Written lane by lane, LLVM made the copy scatters,
    ~15% of an 8-row SmolLM2 verify's attention."""
    row0, first, n_vec, qo_len, g = tile
    f32 = f"float32x{lanes}"
    vectors = []
    for i in range(lanes):
        row = T.min((first + i) // group, qo_len - 1)  # a row that exists, past n_vec too
        v = q.vload([row0 + row, g * group + (first + i) % group, fb * lanes], f"{q.dtype}x{lanes}")
        scaled = T.Cast(f32, v) * tirx.Broadcast(scale, lanes)
        vectors.append(T.Select(i < n_vec, scaled, tirx.Broadcast(T.float32(0), lanes)))
    for f, features in enumerate(_transposed(vectors)):
        T.buffer_store(qt, features, [T.ramp((fb * lanes + f) * lanes, 1, lanes)])


def _outputs_from_lanes(output, ot, total, tile: tuple, fb, group: int, lanes: int) -> None:
    """Features ``fb * lanes`` on of a tile's outputs: ``ot``'s lanes divided by their running
    sums (zeros where a lane saw no key), transposed in registers back to one vector per
    query vector, stored for the tile's ``n_vec`` query vectors."""
    row0, first, n_vec, g = tile
    f32, zero = f"float32x{lanes}", tirx.Broadcast(T.float32(0), lanes)
    sums = total.vload([0], f32)
    seen = sums > zero
    inverse = T.Bind(T.Select(seen, tirx.Broadcast(T.float32(1), lanes) / sums, zero))
    vectors = [
        T.Select(seen, ot.vload([(fb * lanes + f) * lanes], f32) * inverse, zero)
        for f in range(lanes)
    ]
    for i, features in enumerate(_transposed(vectors)):
        with T.If(i < n_vec), T.Then():
            index = [row0 + (first + i) // group, g * group + (first + i) % group]
            value = T.Cast(f"{output.dtype}x{lanes}", features)
            T.buffer_store(output, value, [*index, T.ramp(fb * lanes, 1, lanes)])


def _row_macros(d: int, dtype: str):
    """The steps of one (query row, head) online softmax over the ``state`` buffers that the
    kernel allocates (``_state``): the scaled query, the running output, a chunk's scores, the
    scalars (running max, chunk max, rescale), a chunk's 16 dot products and their
    transposing sum, and the running sum per lane.

    ``start`` loads the query; ``chunk`` folds in ``n`` <= 16 keys whose K rows start at
    ``k_base`` and V rows at ``v_base`` of the flat buffers, ``stride`` elements apart;
    ``finish`` writes the row's output and base-2 log-sum-exp."""
    vecs = d // LANES

    @T.macro
    def start(q, row, h, scale, state):
        q_loc, o_loc, s_loc, st, dots, red, lsum = state
        for c in T.unroll(vecs):
            for lane in T.vectorized(LANES):
                q_loc[c * LANES + lane] = T.cast(q[row, h, c * LANES + lane], "float32") * scale
                o_loc[c * LANES + lane] = T.float32(0)
        for lane in T.vectorized(LANES):
            lsum[lane] = T.float32(0)
        st[0] = T.float32(_EMPTY)

    @T.macro
    def partial_dot(kf, k_row, q_loc, out, at):
        """The query times the K row at ``k_row``: LANES partial sums into ``out[at:]``."""
        for lane in T.vectorized(LANES):
            out[at + lane] = T.float32(0)
        for c in T.unroll(vecs):
            for lane in T.vectorized(LANES):
                out[at + lane] = out[at + lane] + q_loc[c * LANES + lane] * T.cast(
                    kf[k_row + c * LANES + lane], "float32"
                )

    @T.macro
    def add_value(vf, v_row, weight, o_loc):
        for c in T.unroll(vecs):
            for lane in T.vectorized(LANES):
                o_loc[c * LANES + lane] = o_loc[c * LANES + lane] + weight * T.cast(
                    vf[v_row + c * LANES + lane], "float32"
                )

    @T.macro
    def update(vf, v_base, stride, n, state):
        """Fold a chunk's scores ``s_loc`` (masked past ``n``) into the running softmax and
        add its first ``n`` V rows."""
        q_loc, o_loc, s_loc, st, dots, red, lsum = state
        st[2] = _butterfly(s_loc, T.max)
        if st[2] > st[0]:  # a new running max: rescale what was summed so far
            st[3] = exp2(st[0] - st[2])
            st[0] = st[2]
            for lane in T.vectorized(LANES):
                lsum[lane] = lsum[lane] * st[3]
            for c in T.unroll(vecs):
                for lane in T.vectorized(LANES):
                    o_loc[c * LANES + lane] = o_loc[c * LANES + lane] * st[3]
        for lane in T.vectorized(PAGE):
            s_loc[lane] = exp2(s_loc[lane] - st[0])
            lsum[lane] = lsum[lane] + s_loc[lane]
        if n == PAGE:
            for r in T.unroll(PAGE):
                add_value(vf, v_base + r * stride, s_loc[r], o_loc)
        else:
            for r in range(n):
                add_value(vf, v_base + r * stride, s_loc[r], o_loc)

    @T.macro
    def transpose_sum(dots, red):
        """``dots`` holds LANES vectors of partial sums, key r's in vector r; leaves key r's
        total in lane r of ``red[0:LANES]`` (4 levels of ``_halves``, ping-ponging)."""
        for i in T.unroll(8):
            red[T.ramp(i * LANES, 1, LANES)] = _halves(dots, i, 8)
        for i in T.unroll(4):
            dots[T.ramp(i * LANES, 1, LANES)] = _halves(red, i, 4)
        for i in T.unroll(2):
            red[T.ramp(i * LANES, 1, LANES)] = _halves(dots, i, 2)
        red[T.ramp(0, 1, LANES)] = _halves(red, 0, 1)

    @T.macro
    def chunk(kf, vf, k_base, v_base, stride, n, state, whole: bool):
        """Fold in ``n`` <= 16 keys, their dot products side by side and summed by one
        transposing tree, the slots past ``n`` masked. ``whole``: all 16 K rows may be read (a
        page); else only the first ``n`` are, and the slots past them hold what they held
        (``clear_dots`` before a row's first chunk), which only their own masked lanes see."""
        q_loc, o_loc, s_loc, st, dots, red, lsum = state
        if whole:
            for r in T.unroll(PAGE):
                partial_dot(kf, k_base + r * stride, q_loc, dots, r * LANES)
        else:
            for r in range(n):
                partial_dot(kf, k_base + r * stride, q_loc, dots, r * LANES)
        transpose_sum(dots, red)
        for lane in T.vectorized(PAGE):
            s_loc[lane] = T.Select(lane < n, red[lane], T.float32(_MASKED))
        update(vf, v_base, stride, n, state)

    @T.macro
    def clear_dots(state):
        """Zeros in the dot-product slots, which a short chunk leaves as they were."""
        q_loc, o_loc, s_loc, st, dots, red, lsum = state
        for r in range(PAGE):
            for lane in T.vectorized(LANES):
                dots[r * LANES + lane] = T.float32(0)

    @T.macro
    def finish(output, lse, row, h, state):
        q_loc, o_loc, s_loc, st, dots, red, lsum = state
        st[1] = _butterfly(lsum, tirx.Add)
        if st[1] > T.float32(0):
            st[2] = T.float32(1) / st[1]
            for c in T.unroll(vecs):
                for lane in T.vectorized(LANES):
                    output[row, h, c * LANES + lane] = T.cast(
                        o_loc[c * LANES + lane] * st[2], dtype
                    )
            lse[row, h] = st[0] + T.log2(st[1])
        else:
            for c in T.unroll(vecs):
                for lane in T.vectorized(LANES):
                    output[row, h, c * LANES + lane] = T.cast(T.float32(0), dtype)
            lse[row, h] = T.float32(_EMPTY)

    return start, chunk, clear_dots, finish


def _state(d: int):
    """The per-row buffers of ``_row_macros``, allocated in the calling block (on the stack)."""
    return (
        T.sblock_alloc_buffer((d,), "float32", scope="global"),
        T.sblock_alloc_buffer((d,), "float32", scope="global"),
        T.sblock_alloc_buffer((PAGE,), "float32", scope="global"),
        T.sblock_alloc_buffer((4,), "float32", scope="global"),
        T.sblock_alloc_buffer((PAGE * LANES,), "float32", scope="global"),
        T.sblock_alloc_buffer((PAGE * LANES,), "float32", scope="global"),
        T.sblock_alloc_buffer((LANES,), "float32", scope="global"),
    )


def _tiles(rows):
    """Blocks of ``ROWS_PER_TASK`` query rows. Tasks go head by head, so that each thread's
    contiguous share of them holds whole heads, and as much causal work as the others."""
    return (rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK


def _kv_limit(causal, kv_len, qo_len, local_row):
    """Keys a query row sees: all ``kv_len``, or with ``causal`` those up to its own position
    (the new rows are the last ``qo_len`` of the ``kv_len``), as TVM's ``_causal_mask``."""
    seen = T.if_then_else(causal > 0, T.min(kv_len, kv_len - qo_len + local_row + 1), kv_len)
    return T.max(seen, 0)


def _paged_kv_len(page_indptr, length_info, seq):
    """Tokens in a sequence's pages: all but the last page are full."""
    num_pages = page_indptr[seq + 1] - page_indptr[seq]
    return T.if_then_else(num_pages > 0, (num_pages - 1) * PAGE + length_info[seq], 0)


def _paged_row(h_kv: int, h_q: int, d: int, dtype: str):
    """A macro: one (query row, head) over the first ``limit`` keys in sequence ``seq``'s
    pages. ``io`` holds the kernel's buffers, the page pool as one ``flat`` buffer."""
    start, chunk, _, finish = _row_macros(d, dtype)
    group, v_offset = h_q // h_kv, h_kv * PAGE * d  # a page holds all heads' K, then their V

    @T.macro
    def attend(io, row, h, seq, limit, scale, state):
        q, flat, page_indptr, page_values, output, lse = io
        start(q, row, h, scale, state)
        for p in range((limit + PAGE - 1) // PAGE):
            base = (page_values[page_indptr[seq] + p] * 2 * h_kv + h // group) * PAGE * d
            n = T.min(PAGE, limit - p * PAGE)
            chunk(flat, flat, base, base + v_offset, d, n, state, whole=True)
        finish(output, lse, row, h, state)

    return attend


@T.macro
def _locate(q_indptr, batch, row, seq):
    """``seq[0]`` = the sequence that query ``row`` belongs to."""
    seq[0] = 0
    for s in range(batch):
        if q_indptr[s + 1] <= row:
            seq[0] = s + 1


@T.macro
def _by_rows(q_indptr, batch, rows, h_q, d, attend_row, ins):
    """One task per (query head, block of ``ROWS_PER_TASK`` rows) of ``rows``:
    ``attend_row(ins, row, h, sequence, q_indptr, state)`` for each of its rows."""
    for task in T.parallel(h_q * _tiles(rows)):
        with T.sblock("attn"):
            T.reads()  # opaque: the regions depend on lengths read inside
            T.writes()
            state = _state(d)
            seq = T.sblock_alloc_buffer((1,), "int32", scope="global")
            h: T.let[T.int32] = task // _tiles(rows)
            row0: T.let[T.int32] = task % _tiles(rows) * ROWS_PER_TASK
            for row in range(row0, T.min(row0 + ROWS_PER_TASK, rows)):
                _locate(q_indptr, batch, row, seq)
                attend_row(ins, row, h, seq[0], q_indptr, state)


def attention_decode(h_kv: int, h_q: int, d: int, dtype: str) -> tirx.PrimFunc:
    """One new token per sequence against its pages (it was appended before attention)."""
    attend = _paged_row(h_kv, h_q, d, dtype)

    @T.prim_func(s_tir=True)
    def batch_decode_paged_kv_cpu(
        var_q: T.handle,  # [batch, h_q, d]
        var_pages: T.handle,  # [max_num_pages, 2, h_kv, PAGE, d]
        var_page_indptr: T.handle,  # [batch + 1]
        var_page_values: T.handle,  # [nnz_pages]
        var_length_info: T.handle,  # [batch]: tokens in each sequence's last page
        var_k_rope_pos_offset: T.handle,
        var_q_rope_position: T.handle,
        var_output: T.handle,  # [batch, h_q, d]
        var_lse: T.handle,  # [batch, h_q]
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        batch, nnz_pages, max_num_pages = T.int32(), T.int32(), T.int32()
        offsets = [T.int32() for _ in range(5)]
        q = T.match_buffer(var_q, (batch, h_q, d), dtype)
        pages = T.match_buffer(var_pages, (max_num_pages, 2, h_kv, PAGE, d), dtype)
        page_indptr = T.match_buffer(var_page_indptr, (batch + 1,), "int32", elem_offset=offsets[0])
        page_values = T.match_buffer(var_page_values, (nnz_pages,), "int32", elem_offset=offsets[1])
        length_info = T.match_buffer(var_length_info, (batch,), "int32", elem_offset=offsets[2])
        T.match_buffer(var_k_rope_pos_offset, (batch,), "int32", elem_offset=offsets[3])
        T.match_buffer(var_q_rope_position, (batch,), "int32", elem_offset=offsets[4])
        output = T.match_buffer(var_output, (batch, h_q, d), dtype)
        lse = T.match_buffer(var_lse, (batch, h_q), "float32")
        flat = T.decl_buffer((max_num_pages * 2 * h_kv * PAGE * d,), dtype, data=pages.data)
        io = (q, flat, page_indptr, page_values, output, lse)
        assert rotary_mode == 0, "the CPU attention kernels support RoPE before the cache only"
        for task in T.parallel(batch * h_q):
            with T.sblock("attn"):
                T.reads()  # opaque: the regions depend on lengths read inside
                T.writes()
                state = _state(d)
                b: T.let[T.int32] = task // h_q
                h: T.let[T.int32] = task % h_q
                limit: T.let[T.int32] = _paged_kv_len(page_indptr, length_info, b)
                scale = sm_scale * _LOG2E
                attend(io, b, h, b, limit, scale, state)

    return batch_decode_paged_kv_cpu


def attention_prefill_paged(h_kv: int, h_q: int, d: int, dtype: str, lanes: int) -> tirx.PrimFunc:
    """New tokens of each sequence against the prefix in its pages (appended after), a tile of
    ``lanes`` query vectors per task (see the module's docstring): the float32 lanes of the
    CPU's vectors, 16 with AVX-512 and 8 with AVX2."""
    group = h_q // h_kv
    v_offset = h_kv * PAGE * d  # a page holds all heads' K, then their V
    pass_keys = 8 if lanes == 16 else 4  # keys a scores pass adds up: 2 accumulators each
    half = d // 2
    attend = _paged_row(h_kv, h_q, d, dtype)

    @T.macro
    def paged_row(ins, row, h, b, q_indptr, state):
        """One (row, head) against its sequence's prefix, for ``_by_rows``."""
        io, page_indptr, length_info, causal, scale = ins
        qo_len: T.let[T.int32] = q_indptr[b + 1] - q_indptr[b]
        kv_len: T.let[T.int32] = _paged_kv_len(page_indptr, length_info, b)
        attend(io, row, h, b, _kv_limit(causal, kv_len, qo_len, row - q_indptr[b]), scale, state)

    def tiles(qo_len):
        return (qo_len * group + lanes - 1) // lanes

    @T.macro
    def locate(q_indptr, batch, tile, at):
        """``at`` = (sequence, its tile) of a KV head's ``tile``-th tile over all sequences."""
        at[0] = -1
        at[1] = tile
        for s in range(batch):
            if at[0] < 0:
                if at[1] < tiles(q_indptr[s + 1] - q_indptr[s]):
                    at[0] = s
                else:
                    at[1] = at[1] - tiles(q_indptr[s + 1] - q_indptr[s])

    @T.macro
    def scores(qt, flat, base, key0, position, lim, p, acc):
        """Rows ``key0`` .. ``key0 + pass_keys`` of ``p``: those keys' scores (the keys at
        ``position`` on in the sequence), each the sum of two chains of multiply-adds, over
        the first and the second half of the features (``acc``: two buffers of
        ``pass_keys`` vectors, each under TVM's 1 KB stack limit); a key at or past a lane's
        ``lim`` is masked."""
        for j in T.unroll(pass_keys):
            for lane in T.vectorized(lanes):
                acc[0][j * lanes + lane] = T.float32(0)
                acc[1][j * lanes + lane] = T.float32(0)
        for f in range(half):
            for j in T.unroll(pass_keys):
                for lane in T.vectorized(lanes):
                    acc[0][j * lanes + lane] = acc[0][j * lanes + lane] + qt[
                        f * lanes + lane
                    ] * T.cast(flat[base + (key0 + j) * d + f], "float32")
                    acc[1][j * lanes + lane] = acc[1][j * lanes + lane] + qt[
                        (half + f) * lanes + lane
                    ] * T.cast(flat[base + (key0 + j) * d + half + f], "float32")
        for j in T.unroll(pass_keys):
            for lane in T.vectorized(lanes):
                p[(key0 + j) * lanes + lane] = T.Select(
                    position + j < lim[lane],
                    acc[0][j * lanes + lane] + acc[1][j * lanes + lane],
                    T.float32(_MASKED),
                )

    @T.macro
    def softmax(p, state):
        """Fold a page's scores into the running max and sum; ``p`` becomes the keys' weights
        and ``rescale`` what the outputs so far are multiplied by."""
        top, total, new_top, rescale = state
        for lane in T.vectorized(lanes):
            new_top[lane] = top[lane]
        for j in T.unroll(PAGE):
            for lane in T.vectorized(lanes):
                new_top[lane] = T.max(new_top[lane], p[j * lanes + lane])
        for lane in T.vectorized(lanes):
            rescale[lane] = exp2(top[lane] - new_top[lane])
            top[lane] = new_top[lane]
            total[lane] = total[lane] * rescale[lane]
        for j in T.unroll(PAGE):
            for lane in T.vectorized(lanes):
                p[j * lanes + lane] = exp2(p[j * lanes + lane] - top[lane])
                total[lane] = total[lane] + p[j * lanes + lane]

    @T.macro
    def add_value(flat, v_base, p, acc, f0, j):
        """Key ``j``'s value features ``f0`` .. ``f0 + FEATURES``, times its weights."""
        for i in T.unroll(FEATURES):
            for lane in T.vectorized(lanes):
                acc[i * lanes + lane] = acc[i * lanes + lane] + p[j * lanes + lane] * T.cast(
                    flat[v_base + j * d + f0 + i], "float32"
                )

    @T.macro
    def values(ot, flat, v_base, keys, p, rescale, acc):
        """The outputs, rescaled, plus the first ``keys`` value rows weighted by ``p``."""
        for fb in range(d // FEATURES):
            for i in T.unroll(FEATURES):
                for lane in T.vectorized(lanes):
                    acc[i * lanes + lane] = ot[(fb * FEATURES + i) * lanes + lane] * rescale[lane]
            if keys == PAGE:
                for j in T.unroll(PAGE):
                    add_value(flat, v_base, p, acc, fb * FEATURES, j)
            else:  # the sequence's last page: no value row past its keys is read
                for j in range(keys):
                    add_value(flat, v_base, p, acc, fb * FEATURES, j)
            for i in T.unroll(FEATURES):
                for lane in T.vectorized(lanes):
                    ot[(fb * FEATURES + i) * lanes + lane] = acc[i * lanes + lane]

    @T.macro
    def start_tile(q, row0, first, n_vec, g, limits, scale, qt, ot, lim, top, total):
        """The tile's queries transposed and scaled (lanes past ``n_vec``: zeros, no keys),
        each lane's keys, and an empty running softmax."""
        causal, kv_len, qo_len = limits
        for lane in range(lanes):
            lim[lane] = 0
            if lane < n_vec:
                lim[lane] = _kv_limit(causal, kv_len, qo_len, (first + lane) // group)
        for fb in range(d // lanes):
            _queries_in_lanes(q, qt, (row0, first, n_vec, qo_len, g), fb, group, lanes, scale)
        for f in range(d):
            for lane in T.vectorized(lanes):
                ot[f * lanes + lane] = T.float32(0)
        for lane in T.vectorized(lanes):
            top[lane] = T.float32(_EMPTY)
            total[lane] = T.float32(0)

    @T.macro
    def finish_tile(output, lse, row0, first, n_vec, g, ot, top, total):
        """Each query vector's output and base-2 log-sum-exp (zeros and ``_EMPTY`` for one
        that saw no key)."""
        for fb in range(d // lanes):
            _outputs_from_lanes(output, ot, total, (row0, first, n_vec, g), fb, group, lanes)
        for lane in range(n_vec):
            row: T.let[T.int32] = row0 + (first + lane) // group
            h: T.let[T.int32] = g * group + (first + lane) % group
            if total[lane] > T.float32(0):
                lse[row, h] = top[lane] + T.log2(total[lane])
            else:
                lse[row, h] = T.float32(_EMPTY)

    @T.prim_func(s_tir=True)
    def batch_prefill_paged_kv_cpu(
        var_q: T.handle,  # [total_len, h_q, d]
        var_q_indptr: T.handle,  # [batch + 1]
        var_pages: T.handle,  # [max_num_pages, 2, h_kv, PAGE, d]
        var_page_indptr: T.handle,  # [batch + 1]
        var_page_values: T.handle,  # [nnz_pages]
        var_length_info: T.handle,  # [batch]: tokens in each sequence's last page
        var_k_rope_pos_offset: T.handle,
        var_q_rope_position: T.handle,
        var_output: T.handle,  # [total_len, h_q, d]
        var_lse: T.handle,  # [total_len, h_q]
        causal: T.int32,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        batch, total_len, nnz_pages, max_num_pages = T.int32(), T.int32(), T.int32(), T.int32()
        offsets = [T.int32() for _ in range(6)]
        q = T.match_buffer(var_q, (total_len, h_q, d), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch + 1,), "int32", elem_offset=offsets[0])
        pages = T.match_buffer(var_pages, (max_num_pages, 2, h_kv, PAGE, d), dtype)
        page_indptr = T.match_buffer(var_page_indptr, (batch + 1,), "int32", elem_offset=offsets[1])
        page_values = T.match_buffer(var_page_values, (nnz_pages,), "int32", elem_offset=offsets[2])
        length_info = T.match_buffer(var_length_info, (batch,), "int32", elem_offset=offsets[3])
        T.match_buffer(var_k_rope_pos_offset, (batch,), "int32", elem_offset=offsets[4])
        T.match_buffer(var_q_rope_position, (total_len,), "int32", elem_offset=offsets[5])
        output = T.match_buffer(var_output, (total_len, h_q, d), dtype)
        lse = T.match_buffer(var_lse, (total_len, h_q), "float32")
        flat = T.decl_buffer((max_num_pages * 2 * h_kv * PAGE * d,), dtype, data=pages.data)
        io = (q, flat, page_indptr, page_values, output, lse)
        assert rotary_mode == 0, "the CPU attention kernels support RoPE before the cache only"
        count = T.alloc_buffer((2,), "int32", scope="global")  # tiles per KV head; most rows
        count[0] = 0
        count[1] = 0
        for s in range(batch):
            count[0] = count[0] + tiles(q_indptr[s + 1] - q_indptr[s])
            count[1] = T.max(count[1], q_indptr[s + 1] - q_indptr[s])
        if count[1] * group * 2 <= lanes:  # tiles would be mostly empty: one (row, head) a task
            ins = (io, page_indptr, length_info, causal, sm_scale * _LOG2E)
            _by_rows(q_indptr, batch, total_len, h_q, d, paged_row, ins)
        else:
            for task in T.parallel(h_kv * count[0]):
                with T.sblock("attn"):
                    T.reads()  # opaque: the regions depend on lengths read inside
                    T.writes()
                    qt = T.sblock_alloc_buffer((d * lanes,), "float32", scope="local")
                    ot = T.sblock_alloc_buffer((d * lanes,), "float32", scope="local")
                    p = T.sblock_alloc_buffer((PAGE * lanes,), "float32", scope="global")
                    # "global": under 1 KB, so on the stack and in registers (``scores``)
                    acc = (
                        T.sblock_alloc_buffer((pass_keys * lanes,), "float32", scope="global"),
                        T.sblock_alloc_buffer((pass_keys * lanes,), "float32", scope="global"),
                    )
                    sums = T.sblock_alloc_buffer((FEATURES * lanes,), "float32", scope="global")
                    top = T.sblock_alloc_buffer((lanes,), "float32", scope="global")
                    total = T.sblock_alloc_buffer((lanes,), "float32", scope="global")
                    new_top = T.sblock_alloc_buffer((lanes,), "float32", scope="global")
                    rescale = T.sblock_alloc_buffer((lanes,), "float32", scope="global")
                    lim = T.sblock_alloc_buffer((lanes,), "int32", scope="global")
                    at = T.sblock_alloc_buffer((2,), "int32", scope="global")
                    g: T.let[T.int32] = task // count[0]
                    locate(q_indptr, batch, task % count[0], at)
                    b: T.let[T.int32] = at[0]
                    first: T.let[T.int32] = at[1] * lanes  # the tile's first query vector
                    row0: T.let[T.int32] = q_indptr[b]
                    qo_len: T.let[T.int32] = q_indptr[b + 1] - row0
                    n_vec: T.let[T.int32] = T.min(qo_len * group - first, lanes)
                    kv_len: T.let[T.int32] = _paged_kv_len(page_indptr, length_info, b)
                    # keys the tile reads: those of its last query vector's row, which sees the most
                    last_row: T.let[T.int32] = (first + n_vec - 1) // group
                    seen: T.let[T.int32] = _kv_limit(causal, kv_len, qo_len, last_row)
                    limits = (causal, kv_len, qo_len)
                    start_tile(
                        q, row0, first, n_vec, g, limits, sm_scale * _LOG2E, qt, ot, lim, top, total
                    )
                    for pg in range((seen + PAGE - 1) // PAGE):
                        page: T.let[T.int32] = page_values[page_indptr[b] + pg]
                        base: T.let[T.int32] = (page * 2 * h_kv + g) * PAGE * d
                        for part in T.unroll(PAGE // pass_keys):
                            key0 = part * pass_keys
                            scores(qt, flat, base, key0, pg * PAGE + key0, lim, p, acc)
                        softmax(p, (top, total, new_top, rescale))
                        keys = T.min(PAGE, seen - pg * PAGE)
                        values(ot, flat, base + v_offset, keys, p, rescale, sums)
                    finish_tile(output, lse, row0, first, n_vec, g, ot, top, total)

    return batch_prefill_paged_kv_cpu


def attention_prefill_ragged(h_kv: int, h_q: int, d: int, dtype: str) -> tirx.PrimFunc:
    """New tokens of each sequence against the new tokens' own keys and values."""
    start, chunk, clear_dots, finish = _row_macros(d, dtype)
    group = h_q // h_kv

    @T.macro
    def ragged_row(ins, row, h, b, q_indptr, state):
        """One (row, head) against its sequence's new keys, for ``_by_rows``."""
        q, k_flat, v_flat, kv_indptr, output, lse, causal, scale = ins
        first: T.let[T.int32] = kv_indptr[b]
        qo_b: T.let[T.int32] = q_indptr[b + 1] - q_indptr[b]
        limit = _kv_limit(causal, kv_indptr[b + 1] - first, qo_b, row - q_indptr[b])
        start(q, row, h, scale, state)
        clear_dots(state)
        for p in range((limit + PAGE - 1) // PAGE):
            base = ((first + p * PAGE) * h_kv + h // group) * d
            n = T.min(PAGE, limit - p * PAGE)
            if n == PAGE:
                chunk(k_flat, v_flat, base, base, h_kv * d, n, state, whole=True)
            else:
                chunk(k_flat, v_flat, base, base, h_kv * d, n, state, whole=False)
        finish(output, lse, row, h, state)

    @T.prim_func(s_tir=True)
    def batch_prefill_ragged_kv_cpu(
        var_q: T.handle,  # [qo_len, h_q, d]
        var_q_indptr: T.handle,  # [batch + 1]
        var_k: T.handle,  # [kv_len, h_kv, d]
        var_v: T.handle,  # [kv_len, h_kv, d]
        var_kv_indptr: T.handle,  # [batch + 1]
        var_q_rope_position: T.handle,
        var_k_rope_pos_offset: T.handle,
        var_output: T.handle,  # [qo_len, h_q, d]
        var_lse: T.handle,  # [qo_len, h_q]
        causal: T.int32,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        batch, qo_len, kv_len = T.int32(), T.int32(), T.int32()
        offsets = [T.int32() for _ in range(4)]
        q = T.match_buffer(var_q, (qo_len, h_q, d), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch + 1,), "int32", elem_offset=offsets[0])
        k = T.match_buffer(var_k, (kv_len, h_kv, d), dtype)
        v = T.match_buffer(var_v, (kv_len, h_kv, d), dtype)
        kv_indptr = T.match_buffer(var_kv_indptr, (batch + 1,), "int32", elem_offset=offsets[1])
        T.match_buffer(var_q_rope_position, (qo_len,), "int32", elem_offset=offsets[2])
        T.match_buffer(var_k_rope_pos_offset, (batch,), "int32", elem_offset=offsets[3])
        output = T.match_buffer(var_output, (qo_len, h_q, d), dtype)
        lse = T.match_buffer(var_lse, (qo_len, h_q), "float32")
        k_flat = T.decl_buffer((kv_len * h_kv * d,), dtype, data=k.data)
        v_flat = T.decl_buffer((kv_len * h_kv * d,), dtype, data=v.data)
        assert rotary_mode == 0, "the CPU attention kernels support RoPE before the cache only"
        ins = (q, k_flat, v_flat, kv_indptr, output, lse, causal, sm_scale * _LOG2E)
        _by_rows(q_indptr, batch, qo_len, h_q, d, ragged_row, ins)

    return batch_prefill_ragged_kv_cpu


# The KV cache's llvm kernels, by their names in an exported module -> (kernel factory, index
# of the parameter holding the KV heads, and its axis of them).
KERNELS = {
    "batch_decode_paged_kv_cpu": (attention_decode, 1, 2),
    "batch_prefill_paged_kv_cpu": (attention_prefill_paged, 2, 2),
    "batch_prefill_ragged_kv": (attention_prefill_ragged, 2, 1),
}


@tvm.transform.module_pass(opt_level=0, name="UseCPUAttentionKernels")
class UseCPUAttentionKernels:
    """Replace TVM's scalar CPU attention kernels in a module by this file's, sized from the
    buffers of the kernels they replace (query heads and head size from the query, KV heads
    from the pages or keys) and for ``target``'s vectors; for head sizes that are multiples of
    ``LANES``."""

    def __init__(self, target: tvm.target.Target):
        self.lanes = float_lanes(target)

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        for gv, func in list(mod.functions_items()):
            if gv.name_hint not in KERNELS or not isinstance(func, tirx.PrimFunc):
                continue
            make, kv_param, kv_axis = KERNELS[gv.name_hint]
            q = func.params[0].ty  # a buffer type: shape and dtype
            if int(q.shape[2]) % LANES:
                continue  # an unusual head size keeps TVM's kernel
            h_kv = int(func.params[kv_param].ty.shape[kv_axis])
            shape = (h_kv, int(q.shape[1]), int(q.shape[2]), str(q.dtype))
            lanes = {"lanes": self.lanes} if make is attention_prefill_paged else {}
            mod[gv] = make(*shape, **lanes)
        return mod
