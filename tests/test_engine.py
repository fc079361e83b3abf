"""Engine behaviour: bonus tokens and draft backfill, preemption, parallel samples, seeds,
stops inside an accepted run, chunked prefill, streaming, chat, bad input, no leaked pages."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
from tiny_models import VOCAB

from mlc_spec import LLM, SamplingParams
from mlc_spec.errors import UserError
from mlc_spec.runtime.chunk_sizer import FIRST_CHUNK
from mlc_spec.runtime.engine import Engine
from mlc_spec.runtime.params import EngineConfig, SpeculativeConfig
from mlc_spec.runtime.proposers import build_proposer
from mlc_spec.runtime.scheduler import PLAIN_EVERY
from mlc_spec.runtime.speculation import CostTable

PROMPTS = [[5, 9, 14, 3, 77], list(range(40, 75)), [200, 201, 202] * 4]


def _ids(outputs) -> list[list[int]]:
    return [s.token_ids for o in outputs for s in o.outputs]


def _no_leak(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished()
    assert engine.kv.available_pages() == engine.capacity_pages
    if engine.proposer is not None and hasattr(engine.proposer, "kv"):
        assert engine.proposer.kv.available_pages() == engine.capacity_pages


def test_bonus_token_and_draft_backfill(tiny_llama):
    """Draft == target: every step emits k + 1 tokens, and the proposals after a bonus token
    stay right -- impossible unless the draft's missing KV entry was backfilled."""
    k = 3
    llm = LLM(
        tiny_llama.artifact,
        draft_model=tiny_llama.artifact,
        speculative={"method": "draft", "num_speculative_tokens": k},
    )
    params = SamplingParams(max_tokens=1 + 4 * (k + 1), temperature=0, ignore_eos=True)
    out = llm.generate([PROMPTS[0]], params)[0].outputs[0]
    assert len(out.token_ids) == params.max_tokens
    # First token from prefill, then 4 steps of k drafts, each fully accepted plus a bonus.
    assert out.spec_stats.num_drafts == 4
    assert out.spec_stats.accepted_per_position == [4] * k
    assert out.spec_stats.mean_accepted_length == k + 1
    _no_leak(llm)


def test_preemption_restores_the_same_output(target, tiny_llama_draft):
    """A cache too small for the batch forces preemption and recomputation; greedy and seeded
    sampled outputs equal those from a cache that never preempts (a restored sequence's K/V are
    recomputed bit for bit, float or int8)."""
    prompts = [list(np.random.default_rng(i).integers(3, VOCAB, 20 + 7 * i)) for i in range(5)]
    params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)] * 3 + [
        SamplingParams(max_tokens=40, temperature=1.0, seed=i, ignore_eos=True) for i in range(2)
    ]
    spec = {"method": "draft", "num_speculative_tokens": 3}
    draft = tiny_llama_draft.artifact
    big = LLM(target.artifact, draft_model=draft, speculative=spec)
    small = LLM(target.artifact, draft_model=draft, speculative=spec, max_total_len=192)
    assert _ids(small.generate(prompts, params)) == _ids(big.generate(prompts, params))
    assert small.engine.scheduler.num_preemptions > 0 and big.engine.scheduler.num_preemptions == 0
    _no_leak(small)


def test_parallel_samples_share_the_prompt(tiny_llama):
    llm = LLM(tiny_llama.artifact, speculative={"method": "ngram", "num_speculative_tokens": 2})
    out = llm.generate(PROMPTS[1], SamplingParams(n=4, max_tokens=12, seed=3, ignore_eos=True))
    samples = [s.token_ids for s in out[0].outputs]
    assert [s.index for s in out[0].outputs] == [0, 1, 2, 3]
    assert all(len(s) == 12 for s in samples) and len({tuple(s) for s in samples}) > 1
    greedy = llm.generate(PROMPTS[1], SamplingParams(n=3, max_tokens=12, temperature=0))
    assert len({tuple(s.token_ids) for s in greedy[0].outputs}) == 1
    _no_leak(llm)


def test_parallel_samples_of_a_prompt_completed_beside_streams(tiny_llama):
    """A seeded request of 3 samples whose prompt completes in the pass of two decoding
    streams (its last chunk riding there): each sample forks from the prompt's pages and draws
    its first token from that pass, and the samples, tokens and log-probabilities, are those
    of the request alone; the streams advance in that step too."""
    params = SamplingParams(n=3, max_tokens=10, seed=11, ignore_eos=True, logprobs=1)
    alone = LLM(tiny_llama.artifact).generate(PROMPTS[2], params)[0].outputs
    llm = LLM(tiny_llama.artifact, max_num_batched_tokens=64, chunk_time_ratio=None)
    engine = llm.engine
    stream = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    streams = [engine.add_request(p, stream) for p in (PROMPTS[0], PROMPTS[1])]
    while not all(s.prefilled for r in streams for s in r.sequences):
        engine.step()
    before = [s.num_output for r in streams for s in r.sequences]
    late = engine.add_request(PROMPTS[2], params)
    engine.step()
    assert all(s.num_output == 1 for s in late.sequences)  # prompt and first tokens: one step
    assert [s.num_output for r in streams for s in r.sequences] == [b + 1 for b in before]
    while engine.has_unfinished():
        engine.step()
    got = late.output(delta=False).outputs
    assert [o.token_ids for o in got] == [o.token_ids for o in alone]
    for mine, theirs in zip(got, alone, strict=True):
        assert np.array_equal(
            [t.logprob for t in mine.logprobs], [t.logprob for t in theirs.logprobs]
        )
    _no_leak(llm)


def test_pinned_k_and_seed_give_the_same_output(tiny_llama, tiny_llama_draft):
    """A request that pins its k and a seed gets the same tokens in every run, whatever shares
    its batch (here automatic-k requests) and in another engine."""
    llm = LLM(tiny_llama.artifact, draft_model=tiny_llama_draft.artifact)  # automatic k
    params = SamplingParams(
        max_tokens=20, seed=7, top_p=0.9, ignore_eos=True, num_speculative_tokens=3
    )
    first = _ids(llm.generate(PROMPTS, params))
    company = SamplingParams(max_tokens=20, seed=1, ignore_eos=True)
    again = _ids(llm.generate([PROMPTS[2], PROMPTS[0], PROMPTS[1]], [params, company, params]))
    assert [again[2], again[0]] == [first[1], first[2]]
    fresh = LLM(tiny_llama.artifact, draft_model=tiny_llama_draft.artifact)
    assert _ids(fresh.generate(PROMPTS[1], params)) == [first[1]]
    other = dataclasses.replace(params, seed=8)
    assert _ids(llm.generate(PROMPTS, other)) != first
    _no_leak(llm)


def test_stops_inside_an_accepted_run(tiny_llama):
    """With draft == target every draft is accepted; stops must still cut the run exactly."""
    llm = LLM(
        tiny_llama.artifact,
        draft_model=tiny_llama.artifact,
        speculative={"method": "draft", "num_speculative_tokens": 4},
    )
    free = llm.generate(
        [PROMPTS[0]], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    )[0].outputs[0]
    stop_at = 6  # a token in the middle of an accepted run of five
    stop_token = free.token_ids[stop_at]
    first_hit = free.token_ids.index(stop_token)
    out = llm.generate(
        [PROMPTS[0]], SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[stop_token])
    )[0].outputs[0]
    assert out.token_ids == free.token_ids[: first_hit + 1] and out.finish_reason == "stop"

    length = llm.generate(
        [PROMPTS[0]], SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)
    )[0].outputs[0]
    assert length.token_ids == free.token_ids[:7] and length.finish_reason == "length"

    word = free.text.split()[4]
    cut = llm.generate(
        [PROMPTS[0]], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[word])
    )[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.text == free.text[: free.text.index(word)]
    _no_leak(llm)


def test_chunked_prefill_matches_one_pass(tiny_llama):
    prompt = list(np.random.default_rng(9).integers(3, VOCAB, 150))
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    whole = _ids(LLM(tiny_llama.artifact).generate([prompt, PROMPTS[0]], params))
    chunked = LLM(tiny_llama.artifact, prefill_chunk_size=32)
    assert _ids(chunked.generate([prompt, PROMPTS[0]], params)) == whole


def test_a_long_prompt_is_prefilled_within_the_step_budget_while_others_decode(tiny_llama):
    """Two streams decode while a 200-token prompt arrives: with a budget of 24 tokens a step,
    its chunks take 22 (24 less a token per stream), each in one pass with the streams' tokens,
    and every step still decodes the streams, the last one sampling the prompt's first token
    too; outputs and log-probabilities equal those of whole-prompt passes. Alone, a prompt
    takes whole passes."""
    long_prompt = list(np.random.default_rng(4).integers(3, VOCAB, 200))
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=1)
    prompts = [PROMPTS[0], PROMPTS[1], long_prompt]
    expected = LLM(tiny_llama.artifact).generate(prompts, params)
    llm = LLM(
        tiny_llama.artifact,
        max_num_batched_tokens=24,
        prefill_chunk_size=64,
        chunk_time_ratio=None,  # tokens only: chunk sizes that no timing moves
    )
    engine = llm.engine
    passes, forward = [], engine.kv.forward

    def counted(seq_ids, lengths, trees=None):
        if max(lengths) > 1:  # a pass with prompt tokens, whichever function runs it
            passes.append(sum(lengths))
        return forward(seq_ids, lengths, trees)

    engine.kv.forward = counted
    streams = [engine.add_request(p, params) for p in (PROMPTS[0], PROMPTS[1])]
    while not all(s.prefilled for r in streams for s in r.sequences):
        engine.step()
    decoded = [s.num_output for r in streams for s in r.sequences]
    passes.clear()
    late = engine.add_request(long_prompt, params)
    steps = 0
    while late.sequences[0].num_output == 0:
        engine.step()
        steps += 1
    # 200 tokens: 9 chunks of 22 beside the streams' 2 tokens, then the last 2 beside them.
    assert passes == [24] * 9 + [4]
    # The streams advanced in every step, the last too, whose chunk completed the prompt.
    assert [s.num_output for r in streams for s in r.sequences] == [d + steps for d in decoded]
    while engine.has_unfinished():
        engine.step()
    for request, whole in zip((*streams, late), expected, strict=True):
        got, want = request.output(delta=False).outputs[0], whole.outputs[0]
        assert got.token_ids == want.token_ids
        logprobs = [[t.logprob for t in out.logprobs] for out in (got, want)]
        assert np.array_equal(*logprobs)  # the rows computed beside a chunk are the same bits
    passes.clear()
    llm.generate([list(np.random.default_rng(5).integers(3, VOCAB, 200))], params)
    assert passes == [64, 64, 64, 8]  # nothing decoding: whole passes
    _no_leak(llm)


def test_a_chunk_is_also_bounded_in_time(tiny_llama):
    """With a time ratio the chunk of a prompt longer than a prefill pass beside decoding rows
    takes what the chunk sizer says (``FIRST_CHUNK`` before any chunk was measured), allowed
    that multiple of the rows' plain step per waiting prompt, and every ``PLAIN_EVERY`` steps
    in a row that carried a chunk one goes without, measuring the rows' plain step at their
    contexts; outputs are those of whole-prompt passes."""
    params = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True, logprobs=1)
    rng = np.random.default_rng(6)
    long_prompts = [list(rng.integers(3, VOCAB, 200)) for _ in range(2)]
    llm = LLM(
        tiny_llama.artifact,
        max_num_batched_tokens=64,
        chunk_time_ratio=1.0,
        prefill_chunk_size=128,  # the prompts take two passes: bounded in time
    )
    engine, scheduler = llm.engine, llm.engine.scheduler
    chunks = []  # tokens of the chunk in each plain step, None without one
    ran = scheduler.plain_step_ran

    def spy(plan, seconds):
        chunks.append(None if plan.chunk is None else plan.chunk.tokens())
        ran(plan, seconds)

    scheduler.plain_step_ran = spy
    streams = [engine.add_request(p, params) for p in (PROMPTS[0], PROMPTS[1])]
    while not all(s.prefilled for r in streams for s in r.sequences):
        engine.step()
    engine.step()  # a plain step of the two streams, cold after their prompts' pass
    engine.step()  # ... and one measured by rows
    late, later = (engine.add_request(p, params) for p in long_prompts)
    chunks.clear()
    engine.step()  # admitted, the first chunk computed in the streams' pass (timed)
    assert chunks == [FIRST_CHUNK] and late.sequences[0].kv_len == FIRST_CHUNK
    scheduler.costs.decode = CostTable({2: 0.010})  # a plain step of 2 rows: 10 ms
    size = scheduler.chunk_sizer.size()
    assert scheduler._chunk_budget() == (size, 2 * 0.010)  # each waiting prompt: the ratio's
    engine.abort(later.request_id)
    assert scheduler._chunk_budget() == (size, 0.010)
    scheduler.config = dataclasses.replace(scheduler.config, chunk_time_ratio=None)
    assert scheduler._chunk_budget() == (62, None)  # 64 less the two streams' tokens
    scheduler.config = dataclasses.replace(scheduler.config, chunk_time_ratio=1.0)
    scheduler.chunk_sizer.size = lambda: 4  # chunks that take the prompt many steps
    while not late.sequences[0].num_output:
        engine.step()
    # The first chunk's 8 tokens, then 192 in 48 chunks of 4, the last of which completes the
    # prompt in the streams' step too; after every PLAIN_EVERY chunks a plain step.
    runs = " ".join(map(str, chunks)).split(" None ")
    assert sum(filter(None, chunks)) == 200 and len(runs) == 49 // PLAIN_EVERY + 1
    assert all(len(r.split()) == PLAIN_EVERY for r in runs[:-1]) and len(runs[-1].split()) == 1
    while engine.has_unfinished():
        engine.step()
    whole = LLM(tiny_llama.artifact).generate([PROMPTS[0], PROMPTS[1], long_prompts[0]], params)
    for request, want in zip((*streams, late), whole, strict=True):
        got = request.output(delta=False).outputs[0]
        assert got.token_ids == want.outputs[0].token_ids
        assert np.array_equal(
            [t.logprob for t in got.logprobs], [t.logprob for t in want.outputs[0].logprobs]
        )
    with pytest.raises(UserError, match="chunk_time_ratio must be above 0"):
        LLM(tiny_llama.artifact, chunk_time_ratio=0)


def test_a_prompt_no_longer_than_a_pass_rides_at_the_token_budget(tiny_llama):
    """The time bound spares a prompt one prefill pass takes whole: spread thinner, it would
    add as much to the streams' time in all while its row idled longer. Beside two streams a
    100-token prompt comes in 62 tokens a step, however small the chunk sizer's size and
    whatever a plain step costs; a longer one waiting too brings the bound back.
    Outputs are those of whole-prompt passes."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    rng = np.random.default_rng(8)
    short, long = (list(rng.integers(3, VOCAB, n)) for n in (100, 200))
    llm = LLM(
        tiny_llama.artifact, max_num_batched_tokens=64, chunk_time_ratio=1.0, prefill_chunk_size=128
    )
    engine, scheduler = llm.engine, llm.engine.scheduler
    chunks = []
    execute = engine._execute

    def spy(plan):
        chunks.append(None if plan.chunk is None else plan.chunk.tokens())
        return execute(plan)

    engine._execute = spy
    streams = [engine.add_request(p, params) for p in (PROMPTS[0], PROMPTS[1])]
    for _ in range(4):
        engine.step()
    scheduler.costs.decode = CostTable({2: 0.010})
    scheduler.chunk_sizer.size = lambda: 4
    late = engine.add_request(short, params)
    chunks.clear()
    engine.step()
    assert chunks == [62] and scheduler._chunk_budget() == (62, None)
    later = engine.add_request(long, params)
    engine.step()
    assert chunks == [62, 4]  # the short prompt's next 4: the long one waits too
    assert scheduler._chunk_budget() == (4, 2 * 0.010)
    while engine.has_unfinished():
        engine.step()
    whole = LLM(tiny_llama.artifact).generate([PROMPTS[0], PROMPTS[1], short, long], params)
    got = [r.output(delta=False).outputs[0].token_ids for r in (*streams, late, later)]
    assert got == [w.outputs[0].token_ids for w in whole]
    _no_leak(llm)


def test_the_chunk_sizer_learns_from_verify_steps_too(tiny_llama, tiny_llama_draft):
    """A chunk riding in a verify pass teaches the chunk sizer what it added to that pass as
    priced, so prompts do not stay at ``FIRST_CHUNK`` tokens a step while every step drafts;
    outputs are those of no speculation."""
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    llm = LLM(
        tiny_llama.artifact,
        draft_model=tiny_llama_draft.artifact,
        speculative={"method": "draft", "num_speculative_tokens": 2},
        max_num_batched_tokens=64,
        chunk_time_ratio=1.0,
        prefill_chunk_size=128,  # the late prompt takes two passes: bounded in time
    )
    engine, scheduler = llm.engine, llm.engine.scheduler
    learned = []  # (drafts in the step, chunk tokens) per lesson
    ran, sizer_ran = scheduler.chunk_ran, scheduler.chunk_sizer.ran
    step = []

    def spy(plan, num_draft, seconds):
        step[:] = [sum(num_draft)]
        ran(plan, num_draft, seconds)
        step.clear()

    def lesson(tokens, added, allowance):
        learned.append((step[0] if step else 0, tokens))
        sizer_ran(tokens, added, allowance)

    scheduler.chunk_ran, scheduler.chunk_sizer.ran = spy, lesson
    late = list(np.random.default_rng(7).integers(3, VOCAB, 200))
    streams = [engine.add_request(p, params) for p in (PROMPTS[0], PROMPTS[1])]
    for _ in range(4):
        engine.step()
    # Pinned drafts take no plain step: the prices of 2 rows, and of their 4 drafts, are given.
    scheduler.costs.decode = CostTable({2: 0.010})
    scheduler.costs.verify = CostTable({2: 0.010, 6: 0.012})
    engine.add_request(late, params)
    while engine.has_unfinished():
        engine.step()
    assert any(drafts > 0 for drafts, _ in learned)
    got = [r.output(delta=False).outputs[0].token_ids for r in streams]
    want = LLM(tiny_llama.artifact).generate([PROMPTS[0], PROMPTS[1]], params)
    assert got == [w.outputs[0].token_ids for w in want]
    _no_leak(llm)


def test_stream_increments_add_up(tiny_llama):
    llm = LLM(tiny_llama.artifact, speculative={"method": "ngram", "num_speculative_tokens": 3})
    params = SamplingParams(max_tokens=15, temperature=0, ignore_eos=True)
    final = llm.generate(PROMPTS, params)
    text, ids = {}, {}
    for delta in llm.stream(PROMPTS, params):
        out = delta.outputs[0]
        text[delta.request_id] = text.get(delta.request_id, "") + out.text
        ids[delta.request_id] = ids.get(delta.request_id, []) + out.token_ids
    assert list(ids.values()) == [o.outputs[0].token_ids for o in final]
    assert list(text.values()) == [o.outputs[0].text for o in final]


def test_text_prompts_and_chat(tiny_llama):
    llm = LLM(tiny_llama.artifact)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    by_text = llm.generate("w5 w9 w14", params)[0]
    assert by_text.prompt_token_ids == llm.tokenizer.encode("w5 w9 w14")
    chat = llm.chat([{"role": "user", "content": "w5 w9 w14"}], params)[0]
    assert chat.outputs[0].token_ids == by_text.outputs[0].token_ids  # template: content + " "


def test_bad_input_is_rejected_without_leaks(tiny_llama, tiny_qwen2, tmp_path):
    llm = LLM(tiny_llama.artifact)
    with pytest.raises(UserError, match="empty"):
        llm.generate([[]])
    with pytest.raises(UserError, match="token ids must be in"):
        llm.generate([[1, VOCAB]])
    with pytest.raises(UserError, match="context length"):
        llm.generate([[5] * 1000], SamplingParams(max_tokens=100))
    small = LLM(tiny_llama.artifact, max_total_len=128)  # 8 pages of 16 tokens
    with pytest.raises(UserError, match=r"prompt 200 \+ max_tokens 4\).*\(128 tokens\)"):
        small.generate([[5] * 200], SamplingParams(max_tokens=4))
    with pytest.raises(UserError, match="max_num_batched_tokens must be at least 1"):
        LLM(tiny_llama.artifact, max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    # A valid prompt queued before a bad one must not stay behind in the engine.
    with pytest.raises(UserError):
        llm.generate([[5, 6], []])
    _no_leak(llm)
    with pytest.raises(UserError, match="unknown speculative method"):
        LLM(tiny_llama.artifact, speculative={"method": "eagle"})
    with pytest.raises(UserError, match="needs draft_model"):
        LLM(tiny_llama.artifact, speculative={"method": "draft"})
    # A request may pin only a proposer the engine has, as a ValueError.
    with pytest.raises(ValueError, match="unknown speculative_method 'eagle'"):
        SamplingParams(speculative_method="eagle")
    with pytest.raises(ValueError, match=r"'draft' is not one this engine has \(it has suffix\)"):
        LLM(tiny_llama.artifact, speculative={"method": "auto"}).generate(
            [[5, 6]], SamplingParams(speculative_method="draft")
        )
    with pytest.raises(ValueError, match="it has none: no speculation"):
        llm.generate([[5, 6]], SamplingParams(speculative_method="suffix"))
    _no_leak(llm)


def test_draft_with_another_vocabulary_is_rejected(tiny_llama, tiny_llama_v8):
    with pytest.raises(UserError, match="vocabulary"):
        LLM(tiny_llama.artifact, draft_model=tiny_llama_v8.artifact)


def test_interrupted_stream_frees_its_pages(tiny_llama):
    llm = LLM(tiny_llama.artifact)
    stream = llm.stream(PROMPTS, SamplingParams(max_tokens=30, ignore_eos=True))
    next(stream)
    stream.close()  # the caller stops listening half way
    _no_leak(llm)


def test_speculation_on_cuda_warns_that_its_rows_differ(tiny_llama):
    """CUDA verify rows are not bit-identical to decode rows (measured on an H200): a user who
    speculates there is told that greedy output can differ; on the CPU nothing is said."""
    spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2}, False)
    llm = LLM(tiny_llama.artifact)
    config = EngineConfig(max_batch_size=4)

    def engine(model):
        return Engine(
            model, llm.tokenizer, config, build_proposer(spec, None, model, None, config), spec
        )

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine(llm.model)
    llm.model.config = {**llm.model.config, "target": "cuda"}
    with pytest.warns(UserWarning, match="on CUDA is not lossless"):
        engine(llm.model)
