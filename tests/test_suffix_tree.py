"""Suffix trees for suffix decoding: the native tree against a brute-force count over the
documents, through appends in pieces, removals, and the shared cache's memory bound."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from mlc_spec.runtime.proposers.suffix import COPY_MATCH, SuffixProposer
from mlc_spec.runtime.speculation import AcceptanceEstimator
from mlc_spec.runtime.suffix_cache import SuffixCache, SuffixTree


def occurrences(docs: list[list[int]], w: list[int]) -> int:
    """Positions where ``w`` starts, over every document."""
    n = len(w)
    return sum(doc[i : i + n] == w for doc in docs for i in range(len(doc) - n + 1))


def brute_force(docs, context, max_depth, max_tokens, factor, min_prob):
    """The speculation rule written as plainly as possible: for each matched suffix length m,
    follow the most frequent continuation (the smaller token on a tie) while the product of
    branch fractions stays >= min_prob; keep the walk with the largest sum, the longer match on
    a tie."""
    vocab = sorted({t for doc in docs for t in doc})
    best = ([], [], 0.0, 0)
    for m in range(1, min(len(context), max_depth - 1) + 1):
        w = list(context[len(context) - m :])
        if not occurrences(docs, w):
            break
        limit = int(min(max_tokens, m * factor) + 1e-9)
        tokens, probs, prob = [], [], 1.0
        while len(tokens) < limit and len(w) < max_depth:
            counts = {t: occurrences(docs, [*w, t]) for t in vocab}
            total = sum(counts.values())
            if not total:
                break
            token = max(counts, key=lambda t: (counts[t], -t))
            if prob * counts[token] / total < min_prob:
                break
            prob = prob * counts[token] / total
            tokens.append(token)
            probs.append(prob)
            w.append(token)
        if sum(probs) >= best[2]:
            best = (tokens, probs, sum(probs), m)
    return best


def check(tree: SuffixTree, docs, context, max_tokens=8, factor=1.0, min_prob=0.1):
    tokens, probs, score, match = tree.speculate(context, max_tokens, factor, min_prob)
    want = brute_force(docs, list(context), tree.max_depth, max_tokens, factor, min_prob)
    assert tokens.tolist() == want[0]
    assert probs.tolist() == want[1]  # the same products in the same order: exactly equal
    assert (score, match) == (pytest.approx(want[2], rel=1e-12, abs=0), want[3])


@pytest.mark.parametrize("vocab", [2, 3, 6])
@pytest.mark.parametrize("max_depth", [2, 4, 9])
def test_speculation_matches_brute_force_while_a_document_grows(vocab, max_depth):
    rng = np.random.default_rng(vocab * 10 + max_depth)
    doc = rng.integers(0, vocab, 120).tolist()
    tree = SuffixTree(max_depth)
    pos = 0
    for size in [1, 1, 2, 5, 1, 17, 3, 40, 50]:
        tree.extend(7, doc[pos : pos + size])
        pos += size
        assert tree.num_tokens(7) == pos
        check(tree, [doc[:pos]], doc[:pos])  # drafting from its own history
        tail = tree.speculate_tail(7, 8, 1.0, 0.1)  # ... starting from its open suffixes
        want = tree.speculate(doc[:pos], 8, 1.0, 0.1)
        assert [x.tolist() for x in tail[:2]] == [x.tolist() for x in want[:2]]
        assert tail[2:] == want[2:]
        check(tree, [doc[:pos]], rng.integers(0, vocab, 12).tolist())


@pytest.mark.parametrize(
    ("factor", "min_prob", "max_tokens"),
    [(1.0, 0.1, 8), (3.0, 0.0, 20), (0.5, 0.4, 4), (2.0, 1.0, 6)],
)
def test_many_documents_and_removals_match_brute_force(factor, min_prob, max_tokens):
    rng = np.random.default_rng(int(factor * 100 + min_prob * 10))
    tree, docs = SuffixTree(8), {}
    for step in range(60):
        if docs and rng.random() < 0.3:
            victim = int(rng.choice(list(docs)))
            assert tree.remove(victim)
            del docs[victim]
        else:
            doc = step
            docs[doc] = rng.integers(0, 4, int(rng.integers(1, 40))).tolist()
            tree.extend(doc, docs[doc])
        context = rng.integers(0, 4, 10).tolist()
        check(tree, list(docs.values()), context, max_tokens, factor, min_prob)
        if docs:  # a live document's own end, among the others' counts
            doc = int(rng.choice(list(docs)))
            tail = tree.speculate_tail(doc, max_tokens, factor, min_prob)
            want = brute_force(list(docs.values()), docs[doc], 8, max_tokens, factor, min_prob)
            assert (tail[0].tolist(), tail[1].tolist(), tail[3]) == (want[0], want[1], want[3])
    for doc in list(docs):
        tree.remove(doc)
    assert tree.num_nodes == 1 and tree.num_documents == 0  # only the root is left
    assert not tree.remove(12345)


def test_a_repeated_answer_is_drafted_whole():
    answer = list(range(100, 140))
    tree = SuffixTree(32)
    tree.extend(0, answer)
    tokens, probs, score, match = tree.speculate(answer[:20], 16, 1.0, 0.1)
    # Matching all 20 leaves 11 tokens of the tree's depth of 32; 16 matched leave the 16 asked.
    assert tokens.tolist() == answer[20:36]
    assert probs.tolist() == [1.0] * 16 and match == 16


def test_a_reply_repeating_an_earlier_output_is_priced_by_its_statistics():
    """Drafts that follow an earlier output over COPY_MATCH tokens or more carry that output's
    chance (1 for an exact copy), which the policy's estimate takes as the sequence's prior in
    place of the engine-wide rate; shorter matches and the request's own text carry none."""
    proposer = SuffixProposer(32, 1.0, 0.1, 1 << 20)
    answer = list(range(100, 140))

    def seq(seq_id, tokens):
        return SimpleNamespace(
            seq_id=seq_id, tokens=tokens, num_prompt=3, finished=True, finish_reason="length"
        )

    done = seq(0, [1, 2, 3, *answer])
    assert proposer.available(done, 8) == 0 and proposer.chance(done) is None
    proposer.remove(done)  # its output goes into the shared cache
    again = seq(1, [4, 5, 6, *answer[:COPY_MATCH]])
    assert proposer.available(again, 8) == 8 and proposer.chance(again) == 1.0
    short = seq(2, [4, 5, 6, *answer[: COPY_MATCH - 1]])
    assert proposer.available(short, 8) > 0 and proposer.chance(short) is None
    own = seq(3, [7, 8, 9, 10, 7, 8, 9])  # a match in its own text
    assert proposer.available(own, 8) > 0 and proposer.chance(own) is None
    acceptance = AcceptanceEstimator()
    for other in range(10, 20):  # other sequences' drafts rejected
        acceptance.observe(other, proposed=4, accepted=0, estimate=0.5)
    assert acceptance.estimate(1) < 0.7 and acceptance.estimate(1, prior=1.0) == 1.0
    acceptance.observe(1, proposed=4, accepted=1, estimate=1.0)  # its own evidence counts
    assert acceptance.estimate(1, prior=1.0) == (1 + 2) / (1 + 1 + 2)


def test_cache_keeps_within_its_bound_and_evicts_the_least_recently_used():
    rng = np.random.default_rng(0)
    outputs = [rng.integers(0, 50_000, 300) for _ in range(8)]
    one = SuffixCache(16, 1 << 40)
    one.add(outputs[0])
    per_output = one.tree.live_bytes
    cache = SuffixCache(16, int(per_output * 3.5))
    for out in outputs[:3]:
        cache.add(out)
    cache.add(outputs[0])  # the same answer again: used, not counted twice
    assert cache.tree.num_documents == 3
    cache.add(outputs[3])  # over the bound: outputs[1] is the least recently used
    assert cache.tree.live_bytes <= cache.max_bytes and cache.evictions == 1
    assert cache.speculate(outputs[1][:10], 4, 1.0, 0.1)[0].size == 0
    for out in (outputs[0], outputs[2], outputs[3]):
        assert cache.speculate(out[:10], 4, 1.0, 0.1)[0].tolist() == out[10:14].tolist()
    for out in outputs:
        cache.add(out)
    assert cache.tree.live_bytes <= cache.max_bytes and cache.tree.num_documents == 3


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="max_depth"):
        SuffixTree(1)
    tree = SuffixTree(4)
    with pytest.raises(ValueError, match="token ids"):
        tree.extend(0, [1, -2])
    assert tree.num_tokens(0) == 0  # nothing was appended
    with pytest.raises(ValueError, match="integer"):
        tree.extend(0, [1.5])
    with pytest.raises(ValueError, match="max_tokens"):
        tree.speculate([1], -1, 1.0, 0.1)
    with pytest.raises(ValueError, match="max_tokens"):
        tree.speculate_tail(0, -1, 1.0, 0.1)
    assert tree.speculate_tail(5, 4, 1.0, 0.1)[2:] == (0.0, 0)  # no such document: no drafts
    with pytest.raises(ValueError, match="max_bytes"):
        SuffixCache(4, -1)
