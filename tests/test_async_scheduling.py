"""Async scheduling changes when host work happens, never what comes out: with it on and off
the same workload gives the same tokens, text, finish reasons and per-position acceptance, and
leaves no KV page behind."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from tiny_models import VOCAB

from mlc_spec import LLM, SamplingParams
from mlc_spec.runtime.request import Status

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _prompts(seed: int = 0) -> list[list[int]]:
    """Mixed lengths (3 to 51 tokens); repeats give prompt lookup something to find."""
    rng = np.random.default_rng(seed)
    return [
        list(rng.integers(3, VOCAB, n)) * r for n, r in ((5, 1), (9, 3), (17, 2), (51, 1), (3, 4))
    ]


def _pair(method: str, k: int, tiny_llama, tiny_llama_draft, **engine) -> tuple[LLM, LLM]:
    """The same engine twice, with async scheduling off and on."""
    spec = None if method == "none" else {"method": method, "num_speculative_tokens": k}
    if method == "tree":  # a draft tree of width 3
        spec = {"method": "draft", "num_speculative_tokens": k, "draft_tree_width": 3}
    draft = tiny_llama_draft.artifact if method in ("draft", "tree") else None
    return tuple(
        LLM(tiny_llama.artifact, draft_model=draft, speculative=spec, async_scheduling=on, **engine)
        for on in (False, True)
    )


def _run(llm: LLM, prompts, params=GREEDY) -> list[tuple]:
    """What a client sees of each request, and the acceptance behind it; checks no page is
    left in either cache."""
    engine = llm.engine
    draft_kv = getattr(engine.proposer, "kv", None)
    draft_pages = draft_kv.available_pages() if draft_kv is not None else None
    outs = llm.generate(prompts, params)
    assert not engine.has_unfinished()
    assert engine.kv.available_pages() == engine.capacity_pages
    if draft_kv is not None:
        assert draft_kv.available_pages() == draft_pages
    return [
        (
            o.outputs[0].token_ids,
            o.outputs[0].text,
            o.outputs[0].finish_reason,
            o.outputs[0].spec_stats.accepted_per_position,
            o.outputs[0].spec_stats.num_draft_tokens,
            o.outputs[0].spec_stats.steps_by_k,
        )
        for o in outs
    ]


@pytest.mark.parametrize(
    ("method", "k"),
    [("none", 0), ("suffix", 3), ("tree", 2), ("tree", 4)]
    + [(m, k) for m in ("ngram", "draft") for k in range(1, 6)],
)
def test_greedy_output_and_acceptance_are_identical(tiny_llama, tiny_llama_draft, method, k):
    sync, on = _pair(method, k, tiny_llama, tiny_llama_draft)
    _check_identical(sync, on, method)


@pytest.mark.parametrize(("method", "k"), [("ngram", 2), ("draft", 4)])
def test_int8_greedy_output_and_acceptance_are_identical(
    tiny_llama_q4_int8, tiny_llama_draft, method, k
):
    sync, on = _pair(method, k, tiny_llama_q4_int8, tiny_llama_draft)
    _check_identical(sync, on, method)


def _check_identical(sync: LLM, on: LLM, method: str) -> None:
    expected = _run(sync, _prompts())
    assert _run(on, _prompts()) == expected
    if method != "none":
        assert sum(r[4] for r in expected) > 0  # drafts were made and verified


def test_chunked_prefill_and_preemption(target, tiny_llama_draft):
    """Prompts cut into 32-token passes, and a cache so small that requests are preempted
    and recomputed; the number of preemptions may differ, the outputs may not, and they are
    plain greedy decoding's."""
    prompts = _prompts(1) + [list(np.random.default_rng(2).integers(3, VOCAB, 70))]
    sync, on = _pair(
        "draft",
        3,
        target,
        tiny_llama_draft,
        max_batch_size=4,
        max_total_len=224,
        prefill_chunk_size=32,
    )
    expected = _run(sync, prompts)
    assert [r[:3] for r in _run(on, prompts)] == [r[:3] for r in expected]
    assert sync.engine.scheduler.num_preemptions > 0 and on.engine.scheduler.num_preemptions > 0
    plain = LLM(target.artifact).generate(prompts, GREEDY)
    assert [r[0] for r in expected] == [o.outputs[0].token_ids for o in plain]


@pytest.mark.parametrize("method", ["none", "ngram"])
def test_stop_strings_end_sequences_mid_run(tiny_llama, tiny_llama_draft, method):
    """A stop string is found only when the text is processed, after the next step was
    launched with its sequence: that step's tokens are discarded and never reported."""
    sync, on = _pair(method, 4, tiny_llama, tiny_llama_draft)
    free = sync.generate(_prompts(), GREEDY)
    stops = [o.outputs[0].text.split()[6] for o in free]
    params = [
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[s]) for s in stops
    ]
    expected = _run(sync, _prompts(), params)
    streamed: dict[str, list] = {}
    for delta in on.stream(_prompts(), params):
        streamed.setdefault(delta.request_id, []).append(delta.outputs[0])
    got = _run(on, _prompts(), params)
    assert got == expected
    for (_, text, reason, *_), stop, whole in zip(got, stops, free, strict=True):
        assert reason == "stop" and stop not in text
        assert text == whole.outputs[0].text[: whole.outputs[0].text.index(stop)]
    for outs, (ids, text, *_) in zip(streamed.values(), got, strict=True):
        assert "".join(o.text for o in outs) == text
        assert sum((o.token_ids for o in outs), []) == ids
    assert on.engine.kv.available_pages() == on.engine.capacity_pages


def _admitted_ahead(llm: LLM, prompts, params) -> bool:
    """Run the requests step by step; whether the last one was ever admitted while a step was
    in flight (running, but not yet in the cache)."""
    engine = llm.engine
    last = [engine.add_request(p, q) for p, q in zip(prompts, params, strict=True)][-1]
    ahead = False
    while engine.has_unfinished():
        engine.step()
        ahead |= last.status == Status.RUNNING and not last.sequences[0].in_cache
    return ahead


def test_admission_happens_while_the_step_runs(tiny_llama, tiny_llama_draft):
    """Two slots: a stop string ends the first request while the next step (with its tokens)
    is in flight, which frees a slot for the third. It is admitted before that step is
    collected and enters the cache at the next launch; the outputs are the synchronous
    engine's."""
    prompts = _prompts()[:3]
    sync, on = _pair("ngram", 3, tiny_llama, tiny_llama_draft, max_batch_size=2)
    stop = sync.generate(prompts[:1], GREEDY)[0].outputs[0].text.split()[3]
    stopped = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
    params = [stopped, GREEDY, GREEDY]
    expected = _run(sync, prompts, params)
    assert not _admitted_ahead(sync, prompts, params)
    assert _admitted_ahead(on, prompts, params)
    assert _run(on, prompts, params) == expected
    assert expected[0][2] == "stop" and on.engine.kv.available_pages() == on.engine.capacity_pages


@pytest.mark.parametrize("method", ["draft", "tree"])
def test_seeded_sampling_is_identical(tiny_llama, tiny_llama_draft, method):
    params = [
        SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=seed, ignore_eos=True)
        for seed in range(5)
    ]
    sync, on = _pair(method, 3, tiny_llama, tiny_llama_draft)
    expected = _run(sync, _prompts(), params)
    assert _run(on, _prompts(), params) == expected
    assert len({tuple(r[0]) for r in expected}) > 1


def test_aborted_stream_frees_its_pages_at_once(tiny_llama, tiny_llama_draft):
    _, on = _pair("draft", 3, tiny_llama, tiny_llama_draft)
    engine = on.engine
    draft_pages = engine.proposer.kv.available_pages()
    stream = on.stream(_prompts()[:2], GREEDY)
    for _ in range(3):
        next(stream)
    assert engine.kv.available_pages() < engine.capacity_pages
    stream.close()  # the client went away, mid-step
    assert engine.kv.available_pages() == engine.capacity_pages
    assert engine.proposer.kv.available_pages() == draft_pages
    assert not engine.has_unfinished()


def test_host_work_overlaps_the_forward(tiny_llama, tiny_llama_draft):
    """``step`` returns the last step's tokens while the next forward is still running (the
    forward here waits for the test's signal, so only an overlapped loop can return)."""
    _, on = _pair("none", 0, tiny_llama, tiny_llama_draft)
    engine, release = on.engine, threading.Event()
    decode = engine.target.decode

    def held_decode(*args):
        assert release.wait(timeout=60), "the step loop waited for the forward"
        return decode(*args)

    engine.add_request(_prompts()[0], GREEDY, request_id="r")
    engine.target.decode = held_decode
    try:
        reported = []
        while not reported:  # prefill, then the first decode step is launched and held
            reported = engine.step()
        assert reported[0].outputs[0].token_ids  # the first token, reported while held
        assert engine.has_unfinished()
    finally:
        release.set()
        engine.target.decode = decode
    while engine.has_unfinished():
        engine.step()
    assert engine.kv.available_pages() == engine.capacity_pages


def test_logprobs_are_identical(tiny_llama, tiny_llama_draft):
    """Logprobs are read from a step's logits while the next step runs: they must be that
    step's own."""
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
    scored = []
    for llm in _pair("ngram", 3, tiny_llama, tiny_llama_draft):
        outs = llm.generate(_prompts(), params)
        scored.append(
            [[(t.token_id, t.logprob, t.top) for t in o.outputs[0].logprobs] for o in outs]
        )
    assert scored[0] == scored[1]
    assert all(len(s) == 16 for s in scored[1])


def test_draft_tree_logprobs_are_plain_decodings(tiny_llama, tiny_llama_draft):
    """A tree's accepted path reports the logprobs of its own rows (copied out of the verify
    pass): the same as plain decoding's, with async scheduling off and on."""
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
    plain = LLM(tiny_llama.artifact)
    scored = []
    for llm in (plain, *_pair("tree", 3, tiny_llama, tiny_llama_draft)):
        outs = llm.generate(_prompts(), params)
        scored.append(
            [[(t.token_id, t.logprob, t.top) for t in o.outputs[0].logprobs] for o in outs]
        )
    assert scored[0] == scored[1] == scored[2]
