"""The CPU attention kernel (``compiler/cpu_attention.py``) against a numpy reference, called the
way a CPU artifact's layers call it: new rows of several sequences after their K/V were
appended, pages scattered over a pool of two layers, a last page partly used. Unused page slots
hold NaN, so a kernel that reads a key past a row's position, or a value it should not, fails.
And the property the kernel exists for: a row's output is bit for bit the same however many
rows, of however many sequences, the call has. The whole model is covered against transformers
by ``test_model_parity.py``."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
import tvm.runtime

from mlc_spec.compiler.cpu_attention import PAGE, paged_attention
from mlc_spec.compiler.targets import make_target

LAYERS, LAYER = 2, 1
# (KV heads, query heads, head size): the tiny test models, SmolLM2, Qwen2.5-1.5B.
SHAPES = [(2, 4, 16), (3, 9, 64), (2, 12, 128)]
# The pages' float types (``mlc-spec compile --kv-cache-dtype``).
KV_DTYPES = ["float32", "float16"]


def _reference(q, k, v):
    """Softmax attention of ``q`` [h_q, d] over ``k``/``v`` [m, h_kv, d], in float64."""
    h_q, d = q.shape
    group = h_q // k.shape[1]
    out = np.zeros((h_q, d))
    for h in range(h_q):
        s = k[:, h // group].astype(np.float64) @ q[h].astype(np.float64) * d**-0.5
        p = np.exp(s - s.max())
        out[h] = p @ v[:, h // group] / p.sum()
    return out


class _Pool:
    """A page pool of ``LAYERS`` layers holding each sequence's K/V on shuffled pages."""

    def __init__(self, rng, lengths, h_kv, d, dtype, given=None):
        """Random K/V of ``lengths`` tokens per sequence, or the ``given`` (k, v) pairs, on
        pages of ``dtype``; ``kv`` holds them as the pages do."""
        given = given or [rng.standard_normal((2, n, h_kv, d)).astype(np.float32) for n in lengths]
        given = [(k.astype(dtype).astype(np.float32), v.astype(dtype).astype(np.float32))
                 for k, v in given]  # fmt: skip
        num_pages = sum(-(-len(k) // PAGE) for k, _ in given) + 3
        self.pages = np.full((LAYERS, num_pages, 2, h_kv, PAGE * d), np.nan, dtype)
        order = [int(p) for p in rng.permutation(num_pages)]
        self.tables, self.kv = [], []
        for k, v in given:
            n = len(k)
            table = [order.pop() for _ in range(-(-n // PAGE))]
            for j in range(n):
                page, slot = self.pages[LAYER, table[j // PAGE]], j % PAGE
                page[0, :, slot::PAGE] = k[j]  # keys feature-major
                page[1, :, slot * d : (slot + 1) * d] = v[j]  # values slot-major
            self.tables.append(table)
            self.kv.append((k, v))

    def attend(self, f, q, rows, paths=None):
        """``rows``: (sequence, position) of each query row, grouped by sequence; ``paths``:
        per row, where its last positions' keys are (a draft tree's path), or none."""
        paths = paths or [[] for _ in rows]
        path_indptr = np.cumsum([0] + [len(p) for p in paths])
        path_positions = [p for path in paths for p in path] or [0]
        seqs = list(dict.fromkeys(s for s, _ in rows))
        q_indptr = np.cumsum([0] + [sum(s == t for t, _ in rows) for s in seqs])
        page_indptr = np.cumsum([0] + [len(self.tables[s]) for s in seqs])
        values = [p for s in seqs for p in self.tables[s]]
        positions = [p for _, p in rows]
        ints = [
            np.asarray(a, np.int32)
            for a in (q_indptr, page_indptr, values, positions, path_indptr, path_positions)
        ]
        out = tvm.runtime.tensor(np.zeros_like(q))
        f(*(tvm.runtime.tensor(a) for a in (q, self.pages, *ints)), LAYER, out)
        return out.numpy()


@pytest.fixture(
    scope="module",
    params=[(shape, kv) for shape in SHAPES for kv in KV_DTYPES],
    ids=lambda p: "x".join(map(str, p[0])) + f"-{p[1]}",
)
def kernel(request):
    """((KV heads, query heads, head size), the compiled kernel, its pages' dtype)."""
    (h_kv, h_q, d), kv = request.param
    kernel = paged_attention(h_kv, h_q, d, "float32", kv).with_attr("global_symbol", "main")
    compiled = tvm.compile(tvm.IRModule({"main": kernel}), target=make_target("llvm"))
    return (h_kv, h_q, d), compiled, kv


def test_matches_the_reference(kernel):
    """Decode rows (a page's first key, a full page, one past), verify rows within and across
    pages, a prompt's rows from position 0."""
    (h_kv, h_q, d), f, kv = kernel
    rng = np.random.default_rng(0)
    pool = _Pool(rng, [1, 16, 17, 45, 40], h_kv, d, kv)
    rows = [
        (0, 0),
        (1, 15),
        (2, 16),
        *[(3, p) for p in range(30, 45)],
        *[(4, p) for p in range(40)],
    ]
    q = rng.standard_normal((len(rows), h_q, d)).astype(np.float32)
    out = pool.attend(f, q, rows)
    for i, (s, p) in enumerate(rows):
        k, v = pool.kv[s]
        np.testing.assert_allclose(out[i], _reference(q[i], k[: p + 1], v[: p + 1]), atol=2e-5)


def test_a_row_is_the_same_in_any_call(kernel):
    """Each row alone (a decode step), then all in one call with other sequences' rows (a
    verify batch and a prompt), then one sequence's rows in blocks of other sizes: equal bits."""
    (h_kv, h_q, d), f, kv = kernel
    rng = np.random.default_rng(1)
    pool = _Pool(rng, [37, 60, 9], h_kv, d, kv)
    rows = [*[(0, p) for p in range(20, 37)], *[(1, p) for p in range(44, 60)], (2, 8)]
    q = rng.standard_normal((len(rows), h_q, d)).astype(np.float32)
    alone = np.stack([pool.attend(f, q[i : i + 1], [r])[0] for i, r in enumerate(rows)])
    together = pool.attend(f, q, rows)
    np.testing.assert_array_equal(together, alone)
    for block in (2, 5, 16):
        starts = range(0, 17, block)
        parts = [
            pool.attend(f, q[a : min(a + block, 17)], rows[a : min(a + block, 17)]) for a in starts
        ]
        np.testing.assert_array_equal(np.concatenate(parts), alone[:17])


@pytest.fixture
def thread_pool():
    """Sets the thread pool's size for a test, then gives it back to ``TVM_NUM_THREADS``."""
    configure = tvm.get_global_func("runtime.config_threadpool")
    yield lambda threads: configure(1, threads)  # 1: TVM's default affinity mode
    configure(1, 0)


def test_every_thread_count_runs_every_task_once(kernel, thread_pool):
    """The threads share the tasks out by cost: decode rows at short contexts beside a prompt
    chunk at a long one (a chunk's tasks cost the most) and a verify block. On 1 to 5 threads
    every row matches the reference, with the same bits."""
    (h_kv, h_q, d), f, kv = kernel
    rng = np.random.default_rng(3)
    pool = _Pool(rng, [5, 20, 33, 300, 3, 50], h_kv, d, kv)
    rows = [(0, 4), (1, 19), (2, 32), *[(3, p) for p in range(290, 300)], (4, 2)]
    rows += [(5, p) for p in range(45, 50)]
    q = rng.standard_normal((len(rows), h_q, d)).astype(np.float32)
    outputs = []
    for threads in range(1, 6):
        thread_pool(threads)
        outputs.append(pool.attend(f, q, rows))
    for i, (s, p) in enumerate(rows):
        k, v = pool.kv[s]
        np.testing.assert_allclose(
            outputs[0][i], _reference(q[i], k[: p + 1], v[: p + 1]), atol=2e-5
        )
    for out in outputs[1:]:
        np.testing.assert_array_equal(out, outputs[0])


def test_a_tree_row_is_the_decode_row_of_its_path(kernel):
    """A draft tree of 11 nodes appended after a 29-token context (its nodes crossing a page
    boundary): each node's row attends to the context and its own path, and equals bit for bit
    the row of a sequence holding that path in order; a sibling's key is NaN-free but wrong, so
    reading one fails the comparison."""
    (h_kv, h_q, d), f, kv = kernel
    rng = np.random.default_rng(2)
    context, parents = 29, [-1, 0, 0, 1, 1, 2, 3, 3, 5, 8, 9]  # node 0 is the pending token
    pool = _Pool(rng, [context + len(parents)], h_kv, d, kv)
    depth = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    q = rng.standard_normal((len(parents), h_q, d)).astype(np.float32)
    paths = []
    for node in range(len(parents)):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        paths.append([context + n for n in reversed(path)])
    rows = [(0, context + depth[n]) for n in range(len(parents))]
    tree = pool.attend(f, q, rows, paths)
    k, v = pool.kv[0]
    for node, path in enumerate(paths):
        keys = np.concatenate([k[:context], k[path]])
        values = np.concatenate([v[:context], v[path]])
        chain = _Pool(rng, [], h_kv, d, kv, given=[(keys, values)])
        decoded = chain.attend(f, q[node : node + 1], [(0, context + depth[node])])[0]
        np.testing.assert_array_equal(tree[node], decoded)
        np.testing.assert_allclose(tree[node], _reference(q[node], keys, values), atol=2e-5)
