"""Greedy losslessness: with any proposer and any k, speculative output equals target-only
greedy output token for token, over a batch of mixed prompt lengths, for float and int8
activations alike (``target``)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from tiny_models import VOCAB

from mlc_spec import LLM, SamplingParams
from mlc_spec.runtime.proposers.suffix import COPY_MATCH

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    # Repeats inside the prompts give prompt lookup something to find.
    return [
        list(rng.integers(3, VOCAB, n)) * r for n, r in ((5, 1), (9, 3), (17, 2), (40, 1), (3, 4))
    ]


def _token_ids(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.fixture
def reference(target) -> list[list[int]]:
    return _token_ids(LLM(target.artifact), _prompts())


@pytest.mark.parametrize("k", [1, 3, 5])
def test_draft_model_is_lossless(target, tiny_llama_draft, reference, k):
    llm = LLM(
        target.artifact,
        draft_model=tiny_llama_draft.artifact,
        speculative={"method": "draft", "num_speculative_tokens": k},
    )
    assert _token_ids(llm, _prompts()) == reference
    stats = llm.metrics()
    # The noisy draft (of the float model) is right sometimes but not always: both paths of the
    # rule ran.
    assert 0 < stats["acceptance_rate"] < 1.0, stats
    assert llm.engine.kv.available_pages() == llm.engine.capacity_pages


@pytest.mark.parametrize(("k", "width"), [(1, 2), (3, 3), (5, 2)])
def test_draft_tree_is_lossless(target, tiny_llama_draft, reference, k, width):
    """Trees verified in one pass, each node over its own path, then the accepted path moved
    into place in both caches: still the plain output, and accepting more of what was drafted
    per step than the chain of the same depth does."""
    spec = {"method": "draft", "num_speculative_tokens": k}
    chain = LLM(target.artifact, draft_model=tiny_llama_draft.artifact, speculative=spec)
    assert _token_ids(chain, _prompts()) == reference
    llm = LLM(
        target.artifact,
        draft_model=tiny_llama_draft.artifact,
        speculative={**spec, "draft_tree_width": width},
    )
    assert _token_ids(llm, _prompts()) == reference
    tree, plain = llm.metrics(), chain.metrics()
    assert tree["num_draft_tokens"] > plain["num_draft_tokens"]  # several nodes per depth
    assert tree["num_accepted_tokens"] > plain["num_accepted_tokens"]
    assert llm.engine.kv.available_pages() == llm.engine.capacity_pages


def test_auto_is_lossless_with_both_proposers_in_one_step(target, tiny_llama_draft, reference):
    """Method auto: each sequence drafts with the draft model or suffix decoding, as its
    request pins (method, k or both) or the policy chooses per step; both kinds of drafts in
    one verify pass still give the plain output, and both proposers drafted."""
    llm = LLM(
        target.artifact, draft_model=tiny_llama_draft.artifact, speculative={"method": "auto"}
    )
    pins = [("draft", 2), ("suffix", 2), (None, None), ("draft", None), (None, 3)]
    params = [
        dataclasses.replace(GREEDY, speculative_method=m, num_speculative_tokens=k) for m, k in pins
    ]
    assert _token_ids(llm, _prompts(), params) == reference
    by_method = llm.metrics()["speculation"]["drafting_sequence_steps_by_method"]
    assert by_method.get("draft", 0) > 0 and by_method.get("suffix", 0) > 0, by_method
    assert llm.engine.kv.available_pages() == llm.engine.capacity_pages


def test_beside_suffix_decoding_a_draft_model_is_priced_for_the_text_left_to_it(
    target, tiny_llama_draft, reference
):
    """Method auto, the same requests twice: the second time suffix decoding drafts the answers
    from their first copies, and the share of text it drafted rises. A new request's draft-model
    candidate then expects to draft only the rest (its catch-up spread over that); one whose
    request pins the draft model drafts all of it."""
    llm = LLM(
        target.artifact, draft_model=tiny_llama_draft.artifact, speculative={"method": "auto"}
    )
    scheduler = llm.engine.scheduler
    assert _token_ids(llm, _prompts()) == reference
    first = scheduler.coverage.engine_share()
    assert _token_ids(llm, _prompts()) == reference
    share = scheduler.coverage.engine_share()
    assert share > first + 0.2, (first, share)
    pinned = dataclasses.replace(GREEDY, speculative_method="draft")
    seqs = [
        llm.engine.add_request(_prompts()[0], params).sequences[0] for params in (GREEDY, pinned)
    ]
    candidates = [scheduler._candidate(seq, "draft", 3, automatic=True) for seq in seqs]
    assert candidates[0].served == pytest.approx(1 - share)
    assert candidates[1].served == 1.0
    assert scheduler._candidate(seqs[0], "suffix", 3, automatic=True).served == 1.0
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert llm.engine.kv.available_pages() == llm.engine.capacity_pages


def test_the_policy_chooses_chains_and_trees_per_sequence(target, tiny_llama_draft, reference):
    """A tree width with automatic k: each sequence drafts a chain or a tree of the draft
    model, as its request pins or the policy chooses per step, beside suffix decoding (method
    auto); chains and trees in one verify pass still give the plain output, every kind
    drafted, and a tree's acceptance is learned by depth, not by node."""
    llm = LLM(
        target.artifact,
        draft_model=tiny_llama_draft.artifact,
        speculative={"method": "auto", "max_speculative_tokens": 3, "draft_tree_width": 2},
    )
    pins = [("draft_tree", 3), ("draft", 2), ("suffix", None), ("draft_tree", None), (None, 2)]
    params = [
        dataclasses.replace(GREEDY, speculative_method=m, num_speculative_tokens=k) for m, k in pins
    ]
    assert _token_ids(llm, _prompts(), params) == reference
    by_method = llm.metrics()["speculation"]["drafting_sequence_steps_by_method"]
    assert all(by_method.get(m, 0) > 0 for m in ("draft", "draft_tree", "suffix")), by_method
    assert len(llm.engine.scheduler.acceptance["draft_tree"].per_position()) == 3
    assert llm.engine.kv.available_pages() == llm.engine.capacity_pages


@pytest.mark.parametrize("k", [2, 4])
def test_ngram_is_lossless(target, reference, k):
    llm = LLM(target.artifact, speculative={"method": "ngram", "num_speculative_tokens": k})
    assert _token_ids(llm, _prompts()) == reference
    assert llm.metrics()["num_draft_tokens"] > 0


@pytest.mark.parametrize("k", [2, 5, "auto"])
def test_suffix_is_lossless_and_drafts_from_earlier_outputs(target, reference, k):
    """The second round drafts each answer from its earlier copy, with k auto too: the copy's
    statistics price those drafts, not the engine-wide rate that the first round's rejected
    drafts from the prompts brought down."""
    llm = LLM(target.artifact, speculative={"method": "suffix", "num_speculative_tokens": k})
    assert _token_ids(llm, _prompts()) == reference
    first = llm.metrics()
    assert first["suffix_cache"]["documents"] == len(reference)
    # The same requests again: each answer is drafted from its earlier copy, and still equal.
    assert _token_ids(llm, _prompts()) == reference
    again = llm.metrics()
    accepted = again["num_accepted_tokens"] - first["num_accepted_tokens"]
    assert accepted > first["num_accepted_tokens"]
    assert again["suffix_cache"]["documents"] == len(reference)  # equal answers: not twice
    assert llm.engine.kv.available_pages() == llm.engine.capacity_pages


def test_a_repeated_answer_is_priced_by_its_earlier_copy(target, reference):
    """Once other drafts were rejected the engine-wide rate is low; a request repeating an
    earlier answer is priced by that answer's statistics (a chance of 1), not by the rate."""
    llm = LLM(target.artifact, speculative={"method": "suffix", "num_speculative_tokens": "auto"})
    prompt = _prompts()[3]
    assert _token_ids(llm, [prompt]) == [reference[3]]
    scheduler = llm.engine.scheduler
    acceptance = scheduler.acceptance["suffix"]
    for other in range(1000, 1060):
        acceptance.observe(other, proposed=4, accepted=0, estimate=0.5)
    # Pinned to no drafts while it gets there, so that it has no acceptance of its own yet.
    plain = dataclasses.replace(GREEDY, num_speculative_tokens=0)
    request = llm.engine.add_request(prompt, plain)
    seq = request.sequences[0]
    while seq.num_output < COPY_MATCH:
        llm.engine.step()
    candidate = scheduler._candidate(seq, "suffix", 6, automatic=True)
    assert candidate.cap == 6 and scheduler.proposers["suffix"].chance(seq) == 1.0
    assert candidate.acceptance == 1.0 and acceptance.estimate(seq.seq_id) < 0.3
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert request.output(delta=False).outputs[0].token_ids == reference[3]


def test_draft_equal_to_target_accepts_everything(target, reference):
    llm = LLM(
        target.artifact,
        draft_model=target.artifact,
        speculative={"method": "draft", "num_speculative_tokens": 4},
    )
    assert _token_ids(llm, _prompts()) == reference
    stats = llm.metrics()
    assert stats["acceptance_rate"] == 1.0
    assert stats["num_drafts"] > 0
