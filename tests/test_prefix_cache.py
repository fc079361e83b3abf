"""Automatic prefix caching: the page tree alone, and the engine's outputs with the cache on
against off (every comparison exact)."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import VOCAB

from mlc_spec import LLM, SamplingParams
from mlc_spec.runtime.prefix_cache import PrefixCache

PAGE = 4


def test_whole_pages_are_matched_along_the_exact_tokens():
    cache = PrefixCache(PAGE)
    assert cache.store(list(range(10)), [7, 8, 9]) == [7, 8]  # the partial third page stays out
    assert cache.match(list(range(12))) == [7, 8]
    assert cache.match([0, 1, 2, 3, 4, 5, 6, 99]) == [7]  # the second page's tokens differ
    assert cache.match([1, 2, 3, 4]) == []
    # A page whose tokens are cached already stays with its sequence; a new branch is added.
    assert cache.store([0, 1, 2, 3, 9, 9, 9, 9], [5, 6]) == [6]
    assert cache.match([0, 1, 2, 3, 9, 9, 9, 9, 1]) == [7, 6]
    assert cache.num_pages == 3


def test_eviction_takes_unused_leaves_least_recently_used_first():
    cache = PrefixCache(PAGE)
    refs = np.zeros(8, np.int32)  # reference counts by page
    for pages, first in (([1, 2], 0), ([3, 4], 100), ([5], 200)):
        tokens = list(range(first, first + PAGE * len(pages)))
        for page in cache.store(tokens, pages):
            refs[page] = 1  # the cache's reference only
    refs[5] = 2  # a running sequence uses page 5
    refs[2] = 2  # and one page 2, which keeps its parent, page 1, too
    assert cache.evictable(refs) == 2
    refs[2] = 1
    cache.match(list(range(PAGE * 2)))  # the first chain was just used
    assert cache.evictable(refs) == 4  # pages 1-4; 5 is in use
    assert cache.evict(1, refs) == [4]  # the least recently used leaf
    assert cache.evict(3, refs) == [3, 2, 1]  # a parent goes once it is a leaf
    assert cache.evict(5, refs) == [] and cache.num_pages == 1
    assert cache.match(list(range(200, 204))) == [5]


def test_evictable_pages_match_a_walk_over_the_whole_tree():
    """Random stores, uses and evictions (pages going back to sequences after): the pages
    eviction could take back are those whose subtree no sequence uses, as a walk over every
    cached page finds them."""
    rng = np.random.default_rng(0)
    cache, refs = PrefixCache(PAGE), np.zeros(64, np.int32)
    free = list(range(64))
    for _ in range(300):
        if rng.random() < 0.5 and len(free) >= 3:
            tokens = rng.integers(0, 3, PAGE * 3).tolist()  # 3 symbols: chains share prefixes
            pages = [free.pop() for _ in range(3)]
            for page in pages:
                refs[page] = 1
            stored = cache.store(tokens, pages)
            free += [p for p in pages if p not in stored]
        else:
            evicted = cache.evict(int(rng.integers(1, 3)), refs)
            refs[evicted] = 0
            free += evicted
        unused = np.array(free, int)
        refs[unused] = 0
        refs[rng.choice(unused, min(len(free), 4), replace=False)] = 2  # sequences' own pages
        cached = np.array(list(cache._by_page), int)
        refs[cached] = 1
        refs[rng.choice(cached, min(len(cached), 3), replace=False)] = 2  # in use
        in_use = {int(p) for p in cached if refs[p] > 1}
        kept = set()
        for page in in_use:
            node = cache._by_page[page]
            while node.page != -1:
                kept.add(node.page)
                node = node.parent
        assert cache.evictable(refs) == len(cached) - len(kept)


def _prompts() -> list[list[int]]:
    """Six prompts sharing a 40-token prefix (2.5 pages of 16), each with its own tail."""
    shared = list(np.random.default_rng(0).integers(3, VOCAB, 40))
    return [
        shared + list(np.random.default_rng(i + 1).integers(3, VOCAB, 5 + 3 * i)) for i in range(6)
    ]


def _params() -> list[SamplingParams]:
    greedy = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)] * 4
    sampled = [
        SamplingParams(max_tokens=24, temperature=0.8, seed=i, ignore_eos=True) for i in range(2)
    ]
    return greedy + sampled


def _run_twice(llm: LLM) -> list:
    """The prompts, then the same prompts again: the second round finds the first's pages."""
    return [llm.generate(_prompts(), _params()) for _ in range(2)]


@pytest.mark.parametrize(
    "speculative",
    [None, {"method": "ngram", "num_speculative_tokens": 3}, "draft", "auto"],
    ids=["plain", "ngram", "draft", "auto"],
)
def test_outputs_are_identical_with_the_cache_on_and_off(target, tiny_llama_draft, speculative):
    """Greedy and seeded sampled tokens, and greedy logprobs. With automatic k only the greedy
    outputs: a seeded sample's draws follow the k chosen, which follow step timings."""
    kwargs: dict = {"speculative": speculative}
    if speculative == "draft":
        kwargs = {
            "draft_model": tiny_llama_draft.artifact,
            "speculative": {"method": "draft", "num_speculative_tokens": 3},
        }
    elif speculative == "auto":
        kwargs = {"speculative": {"method": "ngram", "num_speculative_tokens": "auto"}}
    cached = LLM(target.artifact, **kwargs)
    plain = LLM(target.artifact, enable_prefix_caching=False, **kwargs)
    for with_cache, without in zip(_run_twice(cached), _run_twice(plain), strict=True):
        for a, b, params in zip(with_cache, without, _params(), strict=True):
            if speculative == "auto" and not params.greedy:
                continue
            x, y = a.outputs[0], b.outputs[0]
            assert x.token_ids == y.token_ids
            if x.logprobs is not None:
                assert np.array_equal(
                    [t.logprob for t in x.logprobs], [t.logprob for t in y.logprobs]
                )
    # A new tail after the shared prefix finds its two whole pages; a prompt seen before, every
    # whole page before its last token (60 tokens: 3 pages).
    fresh, seen = _prompts()[0][:40] + [7, 8, 9], _prompts()[5]
    assert [r.num_cached_tokens for r in cached.generate([fresh, seen])] == [32, 48]
    assert all(r.num_cached_tokens == 0 for r in plain.generate(_prompts()[:2]))
    engine = cached.engine
    found = cached.metrics()["prefix_cache"]
    assert 0 < found["hit_tokens"] < found["query_tokens"]
    assert engine.kv.available_pages() == engine.capacity_pages  # cached pages count as free
    if speculative == "draft":
        assert engine.proposer.kv.prefix.num_pages > 0  # the draft's cache keeps pages too


def test_a_full_cache_evicts_cached_pages_and_never_used_ones(tiny_llama):
    """A cache of 12 pages: every new prompt needs pages that only the prefix cache holds, so
    it evicts; outputs stay those of an engine without the cache, and nothing leaks."""
    rng = np.random.default_rng(5)
    prompts = [list(rng.integers(3, VOCAB, 30)) for _ in range(8)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    small = LLM(tiny_llama.artifact, max_batch_size=2, max_total_len=192)
    plain = LLM(
        tiny_llama.artifact, max_batch_size=2, max_total_len=192, enable_prefix_caching=False
    )
    for _ in range(2):
        outs = small.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == [
            o.outputs[0].token_ids for o in plain.generate(prompts, params)
        ]
    kv = small.engine.kv
    assert kv.prefix.num_pages > 0 and kv.available_pages() == small.engine.capacity_pages
    assert kv.prefix.num_pages <= small.engine.capacity_pages
