"""The CPU's attention over the paged KV cache: one kernel for every forward pass.

A CPU artifact's KV cache is a page pool that the runtime manages (``runtime/kv_cache.py``);
each layer appends the new tokens' keys and values first (``cpu_kv_append``) and then attends
with this kernel, so decode, verification and prefill all run the same code. Each (query row,
head) pair is one online softmax over the keys of its sequence up to the row's own position,
one page (16 keys) at a time, in page order, and no step of it depends on what else the call
computes. That is what makes a token's attention, and so its logits and the K/V of the layers
above, bit for bit the same whether it was decoded alone, in a batch, at any offset of a verify
block or inside a prompt. (TVM's own KV cache attends a verify block's new tokens and the
earlier pages in two passes and merges them, which rounds differently from decode's one pass:
a verify row was up to 5.5e-5 from the decode row of the same token with float activations,
0.45 once int8 activations amplified it.)

A page stores its keys feature-major (``PAGE`` slots of feature 0, then of feature 1, ...) and
its values slot-major, so a page's 16 scores are the lanes of one vector: each is the sum of
``CHAINS`` fused multiply-add chains over a quarter of the features (a query feature broadcast
times that feature's vector of 16 keys), added as (0 + 1) + (2 + 3). The query heads of a KV
head (a GQA group) share each key vector. A page's max is one horizontal reduction; only a page
that raises the running max rescales what was summed; the running sum is kept per lane, and
each value row is added with one fused multiply-add per vector. Keys past a row's position are
masked (their lanes may hold anything, even NaN: a lane never reaches another) and their values
are not read. Pages may hold float16 (``--kv-cache-dtype``, the default with int8
activations): each key and value vector becomes float32 as it loads and the arithmetic is the
same, so a decode row's pages, which come from memory in a model's layer, take half the bytes.

A row of a draft tree (``runtime/draft_tree.py``) attends to the keys of its own path through
the tree, not to every token before it in the pass: a path of ``m`` keys maps the row's last
``m`` positions to where those keys were appended. A page that holds a mapped position is
gathered lane by lane (lane = position mod 16, as in the page decode would have written) and
then goes through the same arithmetic, so a tree row is bit for bit the decode row of its path.

The threads share out (query row, KV head) tasks, even in a decode step: in a model's layer
the pages come from memory, and two threads' reads overlap (run alone, with the pages in cache,
one thread was faster below ~150 page visits). Each thread takes one contiguous run of the
tasks, cut by their cost in page visits, so that a prompt chunk's rows at a long context do
not all land on one thread, as they did when the pool cut the task list by count. Within a
sequence the tasks go KV head by KV head, so that the rows of a verify block or of a prompt
chunk read one head's pages one after another, from cache after the first (docs/kernels.md).
Each task asks for the next page's lines while it works on one. Scores are in base 2 (the query
is scaled by log2 e), so every exponential is an ``exp2`` (``vector_exp``).
"""

from __future__ import annotations

import math

import numpy as np
from tvm import tirx
from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder

from .cpu_rule import scheduled_prim_func
from .vector_exp import exp2
from .vector_reduce import horizontal

PAGE = 16  # tokens per KV page: one vector of 16 float32 lanes per feature
CHAINS = 4  # multiply-add chains per score, each over a quarter of the features
_START = -5e4  # the running max before any key: the first page's rescale multiplies zeros
_MASKED = -1e30  # the score of a key past a row's position: weight 2**(-1e30 - max) = 0
# Query heads that share a pass over a page's key vectors: their chains (CHAINS vectors each)
# and the key vector fit in AVX-512's 32 registers.
SHARED_HEADS = 4
_F32 = f"float32x{PAGE}"


def page_layout(h_kv: int, d: int) -> tuple[int, int]:
    """Offsets in one layer's page (``[2, h_kv, PAGE * d]``) of KV head 0's keys (feature-major:
    element f * PAGE + slot) and of its values (slot-major: slot * d + f); head g's are
    ``g * PAGE * d`` further on."""
    return 0, h_kv * PAGE * d


def _fma(a, b, c):
    """a * b + c on PAGE float32 lanes, rounded once, whatever LLVM would contract."""
    return T.call_llvm_pure_intrin(_F32, f"llvm.fma.v{PAGE}f32", a, b, c)


def _store(buffer: tirx.Buffer, at, value) -> None:
    T.buffer_store(buffer, value, [T.ramp(at, 1, PAGE)])


def paged_attention(
    h_kv: int, h_q: int, d: int, dtype: str, kv_dtype: str | None = None
) -> tirx.PrimFunc:
    """Attention of each new row (its K/V already appended) over its sequence's pages.

    ``q`` [rows, h_q, d] in ``dtype``; ``pages`` [layers, num_pages, 2, h_kv, PAGE * d]
    (``page_layout``) in ``kv_dtype`` (default ``dtype``), read as float32, of
    which ``layer``'s; sequence s has rows ``q_indptr[s]`` .. ``q_indptr[s + 1]`` and pages
    ``page_values[page_indptr[s]:page_indptr[s + 1]]``; a row attends to the keys at positions
    0 .. ``positions[row]`` of its sequence, of which the last ``path_indptr[row + 1] -
    path_indptr[row]`` are at the sequence positions ``path_positions[path_indptr[row]:...]``
    (a draft tree's path; none for a chain, decode or prefill). Writes ``output`` [rows, h_q,
    d]."""
    group, span, vecs = h_q // h_kv, d // CHAINS, d // PAGE
    _, v_offset = page_layout(h_kv, d)
    # log2(e) / sqrt(d), rounded once: the query's scale for base-2 scores
    scale = T.float32(float(np.float32(np.float32(d**-0.5) * np.float32(math.log2(math.e)))))
    passes = [range(i, min(i + SHARED_HEADS, group)) for i in range(0, group, SHARED_HEADS)]
    kv_dtype = kv_dtype or dtype

    with IRBuilder() as ib, scheduled_prim_func():
        rows, batch_plus_1, nnz, path_nnz = T.int32(), T.int32(), T.int32(), T.int32()
        layers, num_pages = T.int64(), T.int64()
        q = T.match_buffer(T.arg("q", T.handle()), (rows, h_q, d), dtype)
        pages = T.match_buffer(
            T.arg("pages", T.handle()), (layers, num_pages, 2, h_kv, PAGE * d), kv_dtype
        )
        q_indptr = T.match_buffer(T.arg("q_indptr", T.handle()), (batch_plus_1,), "int32")
        page_indptr = T.match_buffer(T.arg("page_indptr", T.handle()), (batch_plus_1,), "int32")
        page_values = T.match_buffer(T.arg("page_values", T.handle()), (nnz,), "int32")
        positions = T.match_buffer(T.arg("positions", T.handle()), (rows,), "int32")
        path_indptr = T.match_buffer(T.arg("path_indptr", T.handle()), (rows + 1,), "int32")
        path_positions = T.match_buffer(T.arg("path_positions", T.handle()), (path_nnz,), "int32")
        layer = T.arg("layer", T.int64())
        output = T.match_buffer(T.arg("output", T.handle()), (rows, h_q, d), dtype)
        flat = T.decl_buffer((layers * num_pages * 2 * h_kv * PAGE * d,), kv_dtype, data=pages.data)

        def vec(buffer, at):
            value = buffer.vload([at], f"{buffer.dtype}x{PAGE}")
            return value if buffer.dtype == "float32" else T.Cast(_F32, value)

        def attend(row, g, sequence) -> None:
            """One query row and KV head, over the pages of the row's ``sequence``."""
            with T.sblock("attn"):
                T.reads()  # opaque: the regions depend on lengths read inside
                T.writes()
                # One buffer per head and chain set: TVM keeps buffers under 1 KB on the
                # stack (and LLVM in registers), larger ones cost a workspace allocation.
                qv = [T.sblock_alloc_buffer((d,), "float32", scope="global") for _ in range(group)]
                o = [T.sblock_alloc_buffer((d,), "float32", scope="global") for _ in range(group)]
                s = T.sblock_alloc_buffer((group * PAGE,), "float32", scope="global")
                lsum = T.sblock_alloc_buffer((group * PAGE,), "float32", scope="global")
                top = T.sblock_alloc_buffer((group,), "float32", scope="global")
                acc = [
                    T.sblock_alloc_buffer((CHAINS * PAGE,), "float32", scope="global")
                    for _ in range(SHARED_HEADS)
                ]
                # Where a gathered page's lanes come from: each key's first feature, each value
                k_src = T.sblock_alloc_buffer((PAGE,), "int64", scope="global")
                v_src = T.sblock_alloc_buffer((PAGE,), "int64", scope="global")
                lanes = T.sblock_alloc_buffer((PAGE,), "float32", scope="global")  # a key vector
                keys = T.Bind(positions[row] + 1)
                first = T.Bind(page_indptr[sequence])
                for i in range(group):
                    for c in range(vecs):
                        head = q.vload([row, g * group + i, c * PAGE], f"{dtype}x{PAGE}")
                        _store(qv[i], c * PAGE, T.Cast(_F32, head) * tirx.Broadcast(scale, PAGE))
                        _store(o[i], c * PAGE, tirx.Broadcast(T.float32(0), PAGE))
                    _store(lsum, i * PAGE, tirx.Broadcast(T.float32(0), PAGE))
                    T.buffer_store(top, T.float32(_START), [i])
                last = T.Bind((keys + PAGE - 1) // PAGE - 1)
                path = T.Bind(path_indptr[row])
                mapped = T.Bind(keys - (path_indptr[row + 1] - path))  # the first path position
                with T.serial(0, last + 1) as p:
                    n = T.Bind(T.min(PAGE, keys - p * PAGE))
                    with T.If(T.And(mapped < keys, mapped < (p + 1) * PAGE)):
                        with T.Then():
                            gather(p, n, first, g, mapped, path, k_src, v_src)

                            def key_at(line):
                                with T.serial(0, PAGE) as lane:
                                    key = flat[k_src[lane] + line]
                                    T.buffer_store(lanes, T.Cast("float32", key), [lane])
                                return vec(lanes, 0)

                            for heads in passes:
                                scores(key_at, n, heads, qv, acc, s, None)
                            for i in range(group):
                                fold(lambda j: v_src[j], n, i, s, o, lsum, top)
                        with T.Else():
                            k_base = T.Bind(block(page_values[first + p], g))
                            ahead = T.Bind(block(page_values[first + T.min(p + 1, last)], g))

                            def key_at(line):
                                return vec(flat, k_base + line)

                            for pass_, heads in enumerate(passes):
                                scores(key_at, n, heads, qv, acc, s, ahead if pass_ == 0 else None)
                            for i in range(group):
                                fold(lambda j: k_base + v_offset + j * d, n, i, s, o, lsum, top)
                for i in range(group):
                    inverse = T.Bind(T.float32(1) / horizontal(tirx.Add, vec(lsum, i * PAGE), PAGE))
                    for c in range(vecs):
                        value = vec(o[i], c * PAGE) * tirx.Broadcast(inverse, PAGE)
                        T.buffer_store(
                            output,
                            T.Cast(f"{dtype}x{PAGE}", value),
                            [row, g * group + i, T.ramp(c * PAGE, 1, PAGE)],
                        )

        def gather(p, n, first, g, mapped, path, k_src, v_src) -> None:
            """Where the keys and values of positions ``p * PAGE`` + lane are for a row whose
            positions from ``mapped`` on are at ``path_positions[path:]``; masked lanes (from
            ``n`` on) repeat the last key, so that every lane reads memory the pool holds."""
            with T.serial(0, PAGE) as lane:
                at = T.Bind(p * PAGE + T.min(lane, n - 1))
                where = T.Bind(
                    T.if_then_else(at < mapped, at, path_positions[path + T.max(at - mapped, 0)])
                )
                base = T.Bind(block(page_values[first + where // PAGE], g))
                T.buffer_store(k_src, base + T.cast(where % PAGE, "int64"), [lane])
                T.buffer_store(v_src, base + v_offset + T.cast(where % PAGE * d, "int64"), [lane])

        def block(page, g):
            """Where KV head g's keys start in ``layer``'s ``page``."""
            return ((layer * num_pages + T.cast(page, "int64")) * 2 * h_kv + g) * PAGE * d

        def prefetch(at) -> None:
            line = T.address_of(flat[at])
            T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", line, 0, 3, 1))

        def scores(key_at, n, heads: range, qv, acc, s, ahead) -> None:
            """``s[i]``: query head i's scores of the page's keys (those past ``n`` masked), for
            the heads in ``heads``, which share each key vector. With ``ahead``, the key and
            value lines of the next page (at ``ahead``) are asked for, one of each per key
            vector: on the KV head's 2 x d lines of each page, which are not in cache in a
            model's layer, the hardware prefetchers start cold."""
            for i in range(len(heads)):
                for c in range(CHAINS):
                    _store(acc[i], c * PAGE, tirx.Broadcast(T.float32(0), PAGE))
            with T.serial(0, span) as f:
                for c in range(CHAINS):
                    line = (c * span + f) * PAGE
                    if ahead is not None:
                        prefetch(ahead + line)
                        prefetch(ahead + v_offset + line)
                    keys = T.Bind(key_at(line))
                    for i, head in enumerate(heads):
                        query = tirx.Broadcast(qv[head][c * span + f], PAGE)
                        _store(acc[i], c * PAGE, _fma(query, keys, vec(acc[i], c * PAGE)))
            valid = T.ramp(0, 1, PAGE) < tirx.Broadcast(n, PAGE)
            for i, head in enumerate(heads):
                chains = [vec(acc[i], c * PAGE) for c in range(CHAINS)]
                total = (chains[0] + chains[1]) + (chains[2] + chains[3])
                masked = tirx.Broadcast(T.float32(_MASKED), PAGE)
                _store(s, head * PAGE, T.Select(valid, total, masked))

        def fold(value_at, n, i: int, s, o, lsum, top) -> None:
            """Query head i's page: its scores into the running softmax, its first ``n`` value
            rows (value row j at ``value_at(j)``) into the running output."""
            most = T.Bind(horizontal(T.max, vec(s, i * PAGE), PAGE))
            with T.If(most > top[i]), T.Then():  # a new running max: rescale the sums so far
                rescale = T.Bind(tirx.Broadcast(exp2(top[i] - most), PAGE))
                T.buffer_store(top, most, [i])
                _store(lsum, i * PAGE, vec(lsum, i * PAGE) * rescale)
                for c in range(vecs):
                    _store(o[i], c * PAGE, vec(o[i], c * PAGE) * rescale)
            with T.vectorized(0, PAGE) as lane:
                at = i * PAGE + lane
                T.buffer_store(s, exp2(s[at] - top[i]), [at])
                T.buffer_store(lsum, lsum[at] + s[at], [at])
            with T.serial(0, n) as j:  # the row's last page: only the values up to it
                add_value(value_at(j), i, j, s, o[i])

        def add_value(v_row, i: int, j, s, out) -> None:
            """Value row j (at ``v_row``) times query head i's weight of it, added to ``out``."""
            weight = tirx.Broadcast(s[i * PAGE + j], PAGE)
            for c in range(vecs):
                value = vec(flat, v_row + c * PAGE)
                _store(out, c * PAGE, _fma(weight, value, vec(out, c * PAGE)))

        def cost(row):
            """A task's work in page visits, one more for its set-up: what balances threads."""
            return T.cast((positions[row] + PAGE) // PAGE + 1, "int64")

        def tasks(visit) -> None:
            """``visit(row, g, sequence)`` for every task, in the order the threads share out:
            sequence by sequence, and within a sequence KV head by KV head."""
            with (
                T.serial(0, batch_plus_1 - 1) as b,
                T.serial(0, h_kv) as g,
                T.serial(q_indptr[b], q_indptr[b + 1]) as row,
            ):
                visit(row, g, b)

        with T.sblock("root"):
            counted = T.alloc_buffer((1,), "int64", scope="global")
            T.buffer_store(counted, T.int64(0), [0])

            def count(row, g, b):
                T.buffer_store(counted, counted[0] + cost(row), [0])

            tasks(count)
            total = T.Bind(counted[0])
            threads = T.Bind(T.cast(T.call_packed("runtime.NumThreads"), "int64"))
            # Thread i (the calling thread is 0) runs the tasks whose cost midpoint falls in the
            # i-th share of the total, a midpoint on a boundary going to the lower share. The
            # stride pattern hands iteration i of the parallel loop to thread i.
            with (
                T.attr(0, "pragma_parallel_launch_point", 1),
                T.attr(0, "pragma_parallel_stride_pattern", 1),
                T.parallel(0, threads) as slot,
                T.sblock("slot"),
            ):
                before = T.sblock_alloc_buffer((1,), "int64", scope="global")
                T.buffer_store(before, T.int64(0), [0])

                def run(row, g, b):
                    c = T.Bind(cost(row))
                    middle = 2 * before[0] + c
                    with T.If((middle * threads - 1) // (2 * total) == slot), T.Then():
                        attend(row, g, b)
                    T.buffer_store(before, before[0] + c, [0])

                tasks(run)
    return ib.get()
