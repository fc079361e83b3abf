"""The CPU attention kernels (``compiler/cpu_attention.py``) against a numpy reference, called
the way the KV cache calls them: ragged batches, pages scattered over the pool, a last page
partly used, sequences without a prefix, causal and not. Unused page slots hold NaN, so a
kernel that reads past a sequence's keys fails. The whole model is covered against
transformers by ``test_model_parity.py``."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
import tvm.runtime
from tiny_models import tiny_config

from mlc_spec.compiler.cpu_attention import (
    KERNELS,
    PAGE,
    UseCPUAttentionKernels,
    attention_decode,
    attention_prefill_paged,
    attention_prefill_ragged,
)
from mlc_spec.compiler.targets import make_target
from mlc_spec.models import LlamaForCausalLM, ModelConfig

SM_SCALE = 0.3
EMPTY_LSE = -5e4
# (KV heads, query heads, head size): the tiny test models, SmolLM2, Qwen2.5-1.5B.
SHAPES = [(2, 4, 16), (3, 9, 64), (2, 12, 128)]


def _reference(q, k, v, causal: bool):
    """Softmax attention of ``q`` [n, h_q, d] over ``k``/``v`` [m, h_kv, d]; the new rows are
    the last n of the m keys. Returns the output and the base-2 log-sum-exp per row and head."""
    n, h_q, _ = q.shape
    m, h_kv, _ = k.shape
    out = np.zeros(q.shape, np.float64)
    lse = np.full((n, h_q), EMPTY_LSE)
    for h in range(h_q):
        s = q[:, h].astype(np.float64) @ k[:, h // (h_q // h_kv)].T.astype(np.float64) * SM_SCALE
        for row in range(n):
            seen = min(m, m - n + row + 1) if causal else m
            if seen <= 0:
                continue
            top = s[row, :seen].max()
            p = np.exp(s[row, :seen] - top)
            out[row, h] = p @ v[:seen, h // (h_q // h_kv)] / p.sum()
            lse[row, h] = (top + np.log(p.sum())) / np.log(2)
    return out, lse


def _build(kernel):
    return tvm.compile(kernel, target="llvm")


def _t(array):
    return tvm.runtime.tensor(np.ascontiguousarray(array))


def _paged(rng, kv_lens, h_kv, d):
    """A page pool holding each sequence's keys and values on randomly chosen pages."""
    num_pages = sum(-(-n // PAGE) for n in kv_lens) + 3
    pool = np.full((num_pages, 2, h_kv, PAGE, d), np.nan, np.float32)
    order = rng.permutation(num_pages)
    indptr, values, last, kvs = [0], [], [], []
    for n in kv_lens:
        pages = [int(p) for p in order[len(values) : len(values) + -(-n // PAGE)]]
        k, v = rng.standard_normal((2, n, h_kv, d)).astype(np.float32)
        for j in range(n):
            pool[pages[j // PAGE], 0, :, j % PAGE] = k[j]
            pool[pages[j // PAGE], 1, :, j % PAGE] = v[j]
        values += pages
        indptr.append(len(values))
        last.append(n - (len(pages) - 1) * PAGE if pages else 0)
        kvs.append((k, v))
    arrays = [np.array(x, np.int32) for x in (indptr, values or [0], last)]
    return pool, arrays, kvs


def _call(f, *args):
    f(*args)
    return [a.numpy() for a in args if isinstance(a, tvm.runtime.Tensor)]


def _check(out, lse, refs, row_ranges):
    for (ref_out, ref_lse), (a, b) in zip(refs, row_ranges, strict=True):
        np.testing.assert_allclose(out[a:b], ref_out, atol=2e-5, rtol=1e-4)
        np.testing.assert_allclose(lse[a:b], ref_lse, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("h_kv,h_q,d", SHAPES)
def test_decode(h_kv, h_q, d):
    rng = np.random.default_rng(0)
    kv_lens = [1, 16, 17, 45]
    pool, (indptr, values, last), kvs = _paged(rng, kv_lens, h_kv, d)
    q = rng.standard_normal((len(kv_lens), h_q, d)).astype(np.float32)
    zeros = np.zeros(len(kv_lens), np.int32)
    out, lse = np.zeros_like(q), np.zeros((len(kv_lens), h_q), np.float32)
    args = [_t(x) for x in (q, pool, indptr, values, last, zeros, zeros, out, lse)]
    res = _call(_build(attention_decode(h_kv, h_q, d, "float32")), *args, 0, 1.0, 1e4, SM_SCALE)
    refs = [_reference(q[i : i + 1], k, v, causal=True) for i, (k, v) in enumerate(kvs)]
    _check(res[-2], res[-1], refs, [(i, i + 1) for i in range(len(kv_lens))])


@pytest.mark.parametrize("h_kv,h_q,d", SHAPES)
@pytest.mark.parametrize("causal", [0, 1])
@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize("q_lens", [[3, 1, 9, 20], [2, 1, 2, 1]], ids=["tiles", "few-rows"])
def test_prefill_paged(h_kv, h_q, d, causal, lanes, q_lens):
    """New rows against each sequence's prefix; one sequence has none (its rows get zeros and
    an lse that gives them no weight when merged). A sequence's query vectors (its rows x the
    query heads of a KV head) make one tile of ``lanes`` or several, the last one partial, and
    a task finds its sequence past the tiles of earlier ones. With at most ``lanes / 2`` per
    sequence each (row, head) is a task of its own instead: ``few-rows`` for the tiny and the
    SmolLM2 heads at 16 lanes, for the tiny ones at 8."""
    rng = np.random.default_rng(1)
    kv_lens = [0, 5, 16, 33]
    pool, (indptr, values, last), kvs = _paged(rng, kv_lens, h_kv, d)
    q_indptr = np.cumsum([0, *q_lens]).astype(np.int32)
    q = rng.standard_normal((q_indptr[-1], h_q, d)).astype(np.float32)
    out, lse = np.zeros_like(q), np.zeros((len(q), h_q), np.float32)
    rope = np.zeros(len(q), np.int32)
    args = [
        _t(x)
        for x in (q, q_indptr, pool, indptr, values, last, np.zeros(4, np.int32), rope, out, lse)
    ]
    kernel = _build(attention_prefill_paged(h_kv, h_q, d, "float32", lanes))
    res = _call(kernel, *args, causal, 0, 1.0, 1e4, SM_SCALE)
    ranges = list(zip(q_indptr[:-1], q_indptr[1:], strict=True))
    refs = [
        _reference(q[a:b], k, v, bool(causal)) for (a, b), (k, v) in zip(ranges, kvs, strict=True)
    ]
    _check(res[-2], res[-1], refs, ranges)


@pytest.mark.parametrize("h_kv,h_q,d", SHAPES)
@pytest.mark.parametrize("causal", [0, 1])
def test_prefill_ragged(h_kv, h_q, d, causal):
    rng = np.random.default_rng(2)
    lens = [1, 7, 16, 40]
    indptr = np.cumsum([0, *lens]).astype(np.int32)
    q = rng.standard_normal((indptr[-1], h_q, d)).astype(np.float32)
    k, v = rng.standard_normal((2, indptr[-1], h_kv, d)).astype(np.float32)
    out, lse = np.zeros_like(q), np.zeros((len(q), h_q), np.float32)
    rope = np.zeros(len(q), np.int32)
    args = [_t(x) for x in (q, indptr, k, v, indptr, rope, np.zeros(4, np.int32), out, lse)]
    kernel = _build(attention_prefill_ragged(h_kv, h_q, d, "float32"))
    res = _call(kernel, *args, causal, 0, 1.0, 1e4, SM_SCALE)
    ranges = list(zip(indptr[:-1], indptr[1:], strict=True))
    refs = [_reference(q[a:b], k[a:b], v[a:b], bool(causal)) for a, b in ranges]
    _check(res[-2], res[-1], refs, ranges)


def test_inline_rope_is_refused():
    f = _build(attention_decode(2, 4, 16, "float32"))
    rng = np.random.default_rng(3)
    pool, (indptr, values, last), _ = _paged(rng, [4], 2, 16)
    q = rng.standard_normal((1, 4, 16)).astype(np.float32)
    zeros = np.zeros(1, np.int32)
    args = [_t(x) for x in (q, pool, indptr, values, last, zeros, zeros, np.zeros_like(q))]
    with pytest.raises(Exception, match="RoPE before the cache"):
        f(*args, _t(np.zeros((1, 4), np.float32)), 1, 1.0, 1e4, SM_SCALE)


def test_the_kv_cache_gets_these_kernels():
    """The pass finds TVM's kernels by name in an exported model: a renamed one would silently
    keep TVM's scalar kernel, which the parity tests would not notice."""
    cfg = ModelConfig.from_hf(
        {**tiny_config("llama").to_dict(), "architectures": ["LlamaForCausalLM"]}
    )
    model = LlamaForCausalLM(cfg, make_target("llvm"))
    mod, _ = model.export_tvm(spec=model.get_default_spec())
    tvm_kernels = {name: mod[name] for name in KERNELS}
    swapped = UseCPUAttentionKernels(make_target("llvm"))(mod)
    for name, kernel in tvm_kernels.items():
        assert not swapped[name].same_as(kernel), name
