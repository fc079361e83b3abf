"""The scheduler is the planner: each engine step runs the one plan ``Scheduler.schedule``
returns, and the plan says everything the step does (admissions and their prefix-cache hits,
the prompt chunk within the token budget, the rows and their drafts, preemptions)."""

from __future__ import annotations

import numpy as np
from tiny_models import VOCAB

from mlc_spec import LLM, SamplingParams
from mlc_spec.runtime.scheduler import SchedulerOutput

PARAMS = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _recording(llm: LLM) -> list[SchedulerOutput]:
    plans, schedule = [], llm.engine.scheduler.schedule

    def recorded() -> SchedulerOutput:
        plans.append(schedule())
        return plans[-1]

    llm.engine.scheduler.schedule = recorded
    return plans


def _step(llm: LLM, plans: list[SchedulerOutput]) -> SchedulerOutput:
    llm.engine.step()
    return plans[-1]


def test_a_step_runs_its_plan(tiny_llama):
    """A prompt alone gets a whole pass and no decode rows; a prompt that shares whole pages
    with it starts from them, and its rest rides in the stream's plain step, which samples
    its first token too; a prompt arriving while two streams decode rides in their plain
    step's pass, within the token budget less a token per stream. Outputs are those of each
    prompt alone."""
    llm = LLM(
        tiny_llama.artifact, max_num_batched_tokens=24, prefill_chunk_size=64, chunk_time_ratio=None
    )
    engine, plans = llm.engine, _recording(llm)
    rng = np.random.default_rng(0)
    first = [int(t) for t in rng.integers(3, VOCAB, 40)]
    a = engine.add_request(first, PARAMS)
    plan = _step(llm, plans)
    assert plan.admitted == [a] and plan.cached_tokens == 0 and plan.preempted == []
    assert [len(t) for _, t in plan.prefill.fresh] == [40] and plan.prefill.completes == [True]
    assert plan.step is None  # the first token is reported before any decode step

    plan = _step(llm, plans)
    assert plan.admitted == [] and plan.prefill is None
    assert plan.step.seqs == a.sequences and plan.step.num_draft == [0]

    b = engine.add_request(first[:32] + [int(t) for t in rng.integers(3, VOCAB, 8)], PARAMS)
    plan = _step(llm, plans)
    assert plan.admitted == [b] and plan.cached_tokens == 32  # two whole pages of a's prompt
    assert plan.prefill is None and plan.step.seqs == a.sequences
    assert [len(t) for _, t in plan.step.chunk.fresh] == [8] and plan.step.chunk.completes == [True]
    assert b.num_cached_tokens == 32
    assert [len(r.sequences[0].tokens) - r.sequences[0].num_prompt for r in (a, b)] == [3, 1]

    c = engine.add_request([int(t) for t in rng.integers(3, VOCAB, 60)], PARAMS)
    prompts = [r.prompt_token_ids for r in (a, b, c)]
    plan = _step(llm, plans)
    assert plan.admitted == [c] and plan.prefill is None
    assert plan.step.seqs == a.sequences + b.sequences
    assert [len(t) for _, t in plan.step.chunk.fresh] == [22]  # 24 less the two streams' tokens
    assert [w is plan.step for w in plan.works] == [True]  # one pass
    while engine.has_unfinished():
        engine.step()
    assert engine.kv.available_pages() == engine.capacity_pages
    alone = [LLM(tiny_llama.artifact).generate([p], PARAMS)[0] for p in prompts]
    for request, want in zip((a, b, c), alone, strict=True):
        assert request.sequences[0].tokens[len(want.prompt_token_ids) :] == (
            want.outputs[0].token_ids
        )


def test_preempted_requests_come_back_through_the_plan(tiny_llama):
    """A cache too small for every stream's next step: the plan names the newest request as
    preempted and drops it from that step's rows, and a later plan admits it again."""
    llm = LLM(tiny_llama.artifact, max_total_len=160)
    plans = _recording(llm)
    prompts = [[int(t) for t in np.random.default_rng(i).integers(3, VOCAB, 30)] for i in range(4)]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    preempting = [i for i, p in enumerate(plans) if p.preempted]
    assert preempting, "the cache was meant to run short"
    for i in preempting:
        plan = plans[i]
        assert plan.step.seqs and plan.preempted == plan.preempted[:1]  # the newest only
        request = plan.preempted[0]
        assert not set(request.sequences) & set(plan.step.seqs)
        assert any(request in later.admitted for later in plans[i + 1 :])
    assert llm.engine.scheduler.num_preemptions >= len(preempting)
    assert all(len(o.outputs[0].token_ids) == 40 for o in outputs)


def test_the_step_after_a_prefill_pass_of_its_own_feeds_no_cost_table(tiny_llama):
    """A prefill pass evicts from the cache the weights that decode steps keep there, so the
    step after it costs more than its shape (``StepPlan.cold``): its time stays out of the
    cost tables, and the next step's goes in."""
    llm = LLM(tiny_llama.artifact, chunk_time_ratio=None)
    engine, plans = llm.engine, _recording(llm)
    costs = engine.scheduler.costs
    rng = np.random.default_rng(1)
    engine.add_request([int(t) for t in rng.integers(3, VOCAB, 40)], PARAMS)
    plan = _step(llm, plans)
    assert plan.prefill is not None and plan.step is None
    before = costs.decode.to_dict()
    plan = _step(llm, plans)
    assert plan.step.cold and costs.decode.to_dict() == before
    plan = _step(llm, plans)
    assert not plan.step.cold and costs.decode.to_dict() != before
    while engine.has_unfinished():
        engine.step()
