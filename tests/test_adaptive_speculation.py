"""Adaptive speculation in the engine: greedy output is the same for any k chosen per step,
speculation switched off costs no draft or verify pass, per-request k and its validation, the
policy's decisions and step times in the metrics, and no leaked pages."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest
from policies import Declines, Marginal, RandomK, Watching
from tiny_models import VOCAB

from mlc_spec import LLM, SamplingParams
from mlc_spec.cli import main
from mlc_spec.errors import UserError
from mlc_spec.runtime.model import Model
from mlc_spec.runtime.params import EngineConfig, SpeculativeConfig
from mlc_spec.runtime.proposers.build import build_proposer
from mlc_spec.runtime.speculation import Attention, warm_up
from mlc_spec.runtime.speculation.costs import REFERENCE_CONTEXT, STALE_AFTER
from mlc_spec.runtime.speculation.policy import REFRESH_BELOW
from mlc_spec.runtime.speculation.warm_up import CATCH_UP_STRIDE, LONG_CONTEXT
from mlc_spec.runtime.speculation.warm_up import _prefill as prefill
from mlc_spec.runtime.speculation.warm_up import _sweeps as sweeps

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
AUTO = "auto"


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    # Repeats inside the prompts give prompt lookup something to find.
    return [list(rng.integers(3, VOCAB, n)) * r for n, r in ((5, 1), (9, 3), (17, 2), (3, 4))]


def _ids(outputs) -> list[list[int]]:
    return [s.token_ids for o in outputs for s in o.outputs]


def _llm(model, method: str, draft=None, **kwargs) -> LLM:
    spec = {"method": method, "num_speculative_tokens": kwargs.pop("k", AUTO)}
    spec.update(kwargs.pop("spec", {}))
    return LLM(
        model.artifact,
        draft_model=draft.artifact if method == "draft" else None,
        speculative=spec,
        **kwargs,
    )


def _no_leak(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished()
    assert engine.kv.available_pages() == engine.capacity_pages
    if hasattr(engine.proposer, "kv"):
        assert engine.proposer.kv.available_pages() == engine.capacity_pages
    # No per-sequence state left behind.
    assert all(len(e) == 0 for e in engine.scheduler.acceptance.values())


@pytest.fixture(scope="module")
def reference(tiny_llama) -> list[list[int]]:
    return _ids(LLM(tiny_llama.artifact).generate(_prompts(), GREEDY))


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_greedy_is_identical_under_random_k(target, tiny_llama_draft, method):
    reference = _ids(LLM(target.artifact).generate(_prompts(), GREEDY))
    llm = _llm(target, method, tiny_llama_draft)
    llm.engine.scheduler.policy = RandomK(seed=0)
    assert _ids(llm.generate(_prompts(), GREEDY)) == reference
    chosen = llm.metrics()["speculation"]["sequence_steps_by_k"]
    # Many k ran: all of 0..6 with the draft model; prompt lookup is planned with what it found.
    assert len(chosen) >= {"draft": 7, "ngram": 4}[method]
    assert chosen[0] > 0 and (min(chosen[1:]) > 0 if method == "draft" else sum(chosen[1:]) > 0)
    assert llm.metrics()["num_draft_tokens"] > 0
    _no_leak(llm)


def test_random_k_with_preemption(target, tiny_llama_draft):
    """The draft catches up after a sequence skipped speculation or was preempted. Chunks are
    bounded by tokens alone, so that the steps, and the preemptions, do not follow timings."""
    prompts = [list(np.random.default_rng(i).integers(3, VOCAB, 20 + 7 * i)) for i in range(5)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    expected = _ids(LLM(target.artifact).generate(prompts, params))
    llm = _llm(target, "draft", tiny_llama_draft, max_total_len=192, chunk_time_ratio=None)
    llm.engine.scheduler.policy = RandomK(seed=1)
    assert _ids(llm.generate(prompts, params)) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    _no_leak(llm)


def test_speculation_off_runs_the_plain_decode_path(tiny_llama, tiny_llama_draft, reference):
    llm = _llm(tiny_llama, "draft", tiny_llama_draft)
    calls = {"propose": [], "verify": 0, "policy": 0}
    propose = llm.engine.proposer.propose
    verify = llm.engine.target.evaluate_multi_query
    choose = llm.engine.scheduler.policy.choose

    def counting_choose(*args, **kwargs):
        calls["policy"] += 1
        return choose(*args, **kwargs)

    def counting_propose(seqs, num_tokens):
        calls["propose"] += [s.request.request_id for s in seqs]
        return propose(seqs, num_tokens)

    def counting_verify(*args):
        calls["verify"] += 1
        return verify(*args)

    llm.engine.proposer.propose = counting_propose
    llm.engine.target.evaluate_multi_query = counting_verify
    llm.engine.scheduler.policy.choose = counting_choose
    off = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, num_speculative_tokens=0)
    outputs = llm.generate(_prompts(), off)
    assert _ids(outputs) == reference
    assert calls == {"propose": [], "verify": 0, "policy": 0}  # not even a choice to make
    assert "draft" not in llm.metrics()["seconds"] and "verify" not in llm.metrics()["seconds"]
    assert all(o.outputs[0].spec_stats.steps_by_k == [23] for o in outputs)

    # Mixed: only the request that speculates is drafted for.
    on = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, num_speculative_tokens=3)
    mixed = llm.generate(_prompts()[:2], [off, on])
    assert _ids(mixed) == reference[:2]
    assert set(calls["propose"]) == {mixed[1].request_id} and calls["verify"] > 0
    assert mixed[0].outputs[0].spec_stats.num_drafts == 0
    assert mixed[1].outputs[0].spec_stats.steps_by_k[3] > 0
    _no_leak(llm)


def test_pinned_k_is_capped_by_the_engine_maximum(tiny_llama, tiny_llama_draft):
    llm = _llm(tiny_llama, "draft", tiny_llama_draft, k=1, spec={"max_speculative_tokens": 2})
    greedy = dict(max_tokens=13, temperature=0, ignore_eos=True)
    out = llm.generate(
        _prompts()[:2],
        [SamplingParams(**greedy), SamplingParams(**greedy, num_speculative_tokens=50)],
    )
    engine_default, pinned = (o.outputs[0].spec_stats for o in out)
    assert len(engine_default.steps_by_k) == 2 and engine_default.steps_by_k[1] > 0  # k = 1
    assert len(pinned.steps_by_k) == 3 and pinned.steps_by_k[2] > 0  # 50 capped to 2
    _no_leak(llm)


def test_automatic_k_reports_its_decisions(tiny_llama, reference, monkeypatch):
    """Self-drafting accepts everything; whatever the policy picks, greedy output is the
    target's and every step's choice, estimate and predicted/measured time is reported."""
    timed, prefilled = [], []

    def recording(model, kv, function, passes, ids):
        timed.append((function, kv.sequence_length(ids[0])))
        return sweeps(model, kv, function, passes, ids)

    def prefilling(model, kv, ids, context, chunk_size):
        nonlocal prefilled
        prefilled += [context for i in ids if kv.sequence_length(i) < context]
        prefill(model, kv, ids, context, chunk_size)

    monkeypatch.setattr(warm_up, "_sweeps", recording)
    monkeypatch.setattr(warm_up, "_prefill", prefilling)
    llm = LLM(tiny_llama.artifact, draft_model=tiny_llama.artifact)  # automatic by default
    outputs = llm.generate(_prompts(), GREEDY)
    assert _ids(outputs) == reference
    spec = llm.metrics()["speculation"]
    assert (
        spec["costs"]["verify_one_sequence_by_tokens"] and spec["costs"]["draft_next_pass_by_rows"]
    )
    # A prompt's catch-up by the draft was timed at load, not extrapolated from small passes;
    # so was attending over a long context (512 tokens against 32, a row's and a draft's),
    # which on this tiny model may cost nothing measurable beyond the noise (a rate of 0).
    assert CATCH_UP_STRIDE in spec["costs"]["draft_first_pass_by_tokens"]
    for function in ("decode", "evaluate_multi_query"):
        assert {(function, REFERENCE_CONTEXT), (function, LONG_CONTEXT)} <= set(timed)
    assert LONG_CONTEXT not in prefilled  # the reference context's pages repeated instead
    assert min(spec["costs"]["attention_per_context_token"].values()) >= 0
    assert spec["measured_seconds"] > 0 and spec["predicted_seconds"] > 0
    # The last step the policy weighed (a resting batch's plain steps are not priced).
    step = next(s for s in reversed(spec["recent"]) if s["predicted_seconds"] is not None)
    assert len(step["sequences"]) == len(step["num_draft"]) == len(step["acceptance"])
    assert step["measured_seconds"] > 0
    sequence_steps = sum(sum(o.outputs[0].spec_stats.steps_by_k) for o in outputs)
    assert sum(spec["sequence_steps_by_k"]) == sequence_steps
    assert 0 < spec["num_predicted"] <= spec["num_steps"]
    if llm.metrics()["num_drafts"]:
        assert llm.metrics()["acceptance_rate"] == 1.0
        assert spec["costs"]["verify_by_rows_x_tokens"]  # the shapes steps ran, each its own
    _no_leak(llm)


def test_bad_speculation_settings_are_rejected(tiny_llama):
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 0"):
        SamplingParams(num_speculative_tokens=-1)
    with pytest.raises(UserError, match="'auto' or an int"):
        LLM(tiny_llama.artifact, speculative={"method": "ngram", "num_speculative_tokens": "x"})
    with pytest.raises(UserError, match="exceeds max_speculative_tokens"):
        _llm(tiny_llama, "ngram", k=5, spec={"max_speculative_tokens": 3})
    with pytest.raises(UserError, match="at least 1"):
        _llm(tiny_llama, "ngram", spec={"max_speculative_tokens": 0})
    with pytest.raises(UserError, match="prefill_chunk_size"):
        spec = {"max_speculative_tokens": 6}
        _llm(tiny_llama, "ngram", max_batch_size=16, prefill_chunk_size=64, spec=spec)
    with pytest.raises(UserError, match="draft, ngram, suffix or auto"):
        _llm(tiny_llama, "tree")
    for bad, match in (
        ({"suffix_decoding_max_tree_depth": 1}, "max_tree_depth"),
        ({"suffix_decoding_min_token_prob": 1.5}, "min_token_prob"),
        ({"suffix_decoding_max_spec_factor": 0}, "max_spec_factor"),
        ({"suffix_decoding_cache_mb": -1}, "cache_mb"),
    ):
        with pytest.raises(UserError, match=match):
            _llm(tiny_llama, "suffix", spec=bad)
    for method, k, width, match in (
        ("draft", 3, 0, "draft_tree_width must be an int >= 1"),
        ("draft", 3, 9, "exceeds the artifacts' 8 candidates"),
        ("auto", 3, 2, "need a draft model"),
        ("ngram", 3, 2, "need a draft model"),
    ):
        with pytest.raises(UserError, match=match):
            _llm(tiny_llama, method, k=k, draft=tiny_llama, spec={"draft_tree_width": width})
    with pytest.raises(UserError, match="need draft_model"):
        _llm(tiny_llama, "auto", spec={"draft_tree_width": 2})
    cuda_like = Model(tiny_llama.artifact)  # a CUDA artifact's KV cache, which takes no tree
    cuda_like.config = {**cuda_like.config, "kv_cache": "tvm"}
    for method in ("draft", "auto"):
        spec = SpeculativeConfig(method=method, draft_tree_width=2)
        with pytest.raises(UserError, match="draft trees need a CPU artifact"):
            build_proposer(spec, tiny_llama.artifact, cuda_like, None, EngineConfig())
    with pytest.raises(UserError, match=r"max_batch_size 8 x \(24 drafts \+ 1\)"):
        spec = {"draft_tree_width": 4, "max_speculative_tokens": 6}
        _llm(tiny_llama, "draft", k=3, draft=tiny_llama, spec=spec, prefill_chunk_size=128)


def test_the_default_cap_on_k_is_the_methods_within_what_a_verify_pass_holds(tiny_llama):
    """Suffix decoding (and method auto) may draft 12 where the others draft 6; a cap left to
    the default is lowered to what a full batch's verify pass holds in a prefill chunk (64 / 16
    = 4 tokens a sequence: 3 drafts beside its own), where one given is refused (above)."""
    caps = {
        method: _llm(tiny_llama, method, draft=tiny_llama).engine.scheduler.max_k
        for method in ("draft", "ngram", "suffix")
    }
    assert caps == {"draft": 6, "ngram": 6, "suffix": 12}
    auto = LLM(tiny_llama.artifact, draft_model=tiny_llama.artifact, speculative={"method": "auto"})
    assert auto.engine.max_k == 12
    for method in ("ngram", "suffix"):
        small = _llm(tiny_llama, method, max_batch_size=16, prefill_chunk_size=64)
        assert small.engine.max_k == small.engine.scheduler.max_k == 3
        pinned = SamplingParams(max_tokens=16, temperature=0, num_speculative_tokens=10)
        out = small.generate([[5, 6, 7, 8] * 8], pinned)
        assert 1 <= len(out[0].outputs[0].spec_stats.accepted_per_position) <= 3
        _no_leak(small)
    fixed = _llm(tiny_llama, "ngram", k=8)
    assert fixed.engine.max_k == 8


def test_attention_is_not_timed_where_the_cache_cannot_hold_a_long_context(tiny_llama):
    """8 rows of 64 tokens: too short to tell attention from noise; passes are then priced at
    the contexts steps run at, as without a warm-up."""
    llm = _llm(tiny_llama, "ngram", max_total_len=512, prefill_chunk_size=256)
    assert llm.engine.scheduler.costs.attention == Attention()


def test_generate_command_takes_a_per_request_k(tiny_llama, capsys):
    args = ["generate", "--model", str(tiny_llama.artifact), "--max-tokens", "6", "w5 w9 w14"]
    assert main([*args, "--speculative-tokens", "0"]) == 0
    off = capsys.readouterr()
    assert main([*args, "-k", "2", "--speculative-tokens", "3"]) == 0
    pinned = capsys.readouterr()
    assert off.out == pinned.out and off.out.strip()
    with pytest.raises(SystemExit):
        main([*args, "-k", "lots"])
    assert "expected 'auto' or a number" in capsys.readouterr().err


def test_a_prompt_chunk_rides_in_the_verify_pass_while_streams_draft(tiny_llama):
    """A 150-token prompt arrives while two streams decode, with a step budget that chunks it:
    the policy is told the chunk's tokens and may draft for the automatic-k stream (a random k
    here), the stream that set k = 3 keeps drafting, every chunk rides in the streams' pass
    (verifying or plain) rather than a pass of its own, the last one too, which samples the
    prompt's first token, and every token is the one plain decoding gives."""
    llm = LLM(
        tiny_llama.artifact,
        speculative={"method": "ngram", "num_speculative_tokens": "auto"},
        max_num_batched_tokens=20,
    )
    engine = llm.engine
    policy = engine.scheduler.policy = RandomK(seed=5)
    plans = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]
    repeat = [200, 201, 202, 203] * 6  # prompt lookup finds drafts all along
    late_prompt = list(np.random.default_rng(2).integers(3, VOCAB, 150))
    params = SamplingParams(max_tokens=120, temperature=0)
    auto = engine.add_request(repeat, params)
    pinned = engine.add_request(repeat, dataclasses.replace(params, num_speculative_tokens=3))
    while not all(r.sequences[0].prefilled for r in (auto, pinned)):
        engine.step()
    before = [r.sequences[0].stats.num_drafts for r in (auto, pinned)]
    late = engine.add_request(late_prompt, GREEDY)
    plans.clear()
    while late.sequences[0].num_output == 0:
        engine.step()
    after = [r.sequences[0].stats.num_drafts for r in (auto, pinned)]
    assert after[0] > before[0] and after[1] > before[1]
    riding = [p for p in plans if p.step is not None and p.step.chunk is not None]
    assert any(any(p.step.num_draft) for p in riding)
    # Told of every chunk that rode (one told of may wait instead, for a plain step to measure).
    assert not Counter(p.step.chunk.tokens() for p in riding) - Counter(policy.chunks)
    assert all(p.prefill is None for p in plans)  # the prompt's last chunk rode too
    assert riding[-1].step.chunk.completes == [True]
    while engine.has_unfinished():
        engine.step()
    plain = LLM(tiny_llama.artifact)
    expected = _ids(plain.generate([repeat], params) + plain.generate([late_prompt], GREEDY))
    outputs = [s.tokens[s.num_prompt :] for s in (r.sequences[0] for r in (auto, pinned, late))]
    assert outputs == [expected[0], *expected]
    _no_leak(llm)


@pytest.mark.parametrize("gain", [1.1, 1.5])
def test_drafts_that_gain_little_give_way_to_a_plain_step_once_its_price_is_stale(
    tiny_llama, tiny_llama_draft, gain
):
    """A policy drafting every step: drafts predicted to gain 10% step plain after
    ``STALE_AFTER`` verify passes without a plain one, measuring the plain price they were
    weighed against, with the same tokens; drafts predicted to gain 50% never do. The reply
    opens with two plain steps: only load time had priced one row's plain step, and the first
    step after the prompt's prefill is cold, measuring nothing."""
    llm = _llm(tiny_llama, "draft", tiny_llama_draft)
    llm.engine.scheduler.policy = Marginal(gain)
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    outputs = llm.generate(_prompts()[:1], params)
    assert _ids(outputs) == _ids(LLM(tiny_llama.artifact).generate(_prompts()[:1], params))
    steps_by_k = outputs[0].outputs[0].spec_stats.steps_by_k
    refreshes = llm.metrics()["speculation"]["plain_refreshes"]
    if gain < REFRESH_BELOW:
        assert refreshes == 2 + sum(steps_by_k[1:]) // STALE_AFTER > 2
    else:
        assert refreshes == 0
    assert steps_by_k[0] >= refreshes  # the last token's step has no room for a draft
    _no_leak(llm)


def test_the_policy_is_told_how_many_sequences_will_soon_join_the_batch(
    tiny_llama, tiny_llama_draft
):
    """A batch of 4 that loses a reply expects its size back (a closed loop refills it), so
    the policy hears of 1 sequence joining the 3 left; once the batch has stayed at 3 for a
    while, of none."""
    llm = _llm(tiny_llama, "draft", tiny_llama_draft)
    watching = llm.engine.scheduler.policy = Watching()
    lengths = [60, 60, 60, 12]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    llm.generate(_prompts(), params)
    joining = {}
    for rows, expected in watching.seen:
        joining.setdefault(rows, []).append(expected)
    assert set(joining[4]) == {0}
    assert joining[3][0] == 1 and joining[3][-1] == 0
    _no_leak(llm)


def test_a_batch_that_declines_its_drafts_is_weighed_less_often(tiny_llama, reference):
    """Where the policy declines every draft step after step, the batch steps plain without
    weighing them (``Backoff``), with the same tokens; a request that pinned its k drafts all
    the same beside one that rests."""
    llm = _llm(tiny_llama, "ngram")
    llm.engine.scheduler.policy = Declines()
    outputs = llm.generate(_prompts(), GREEDY)
    assert _ids(outputs) == reference
    steps = max(sum(o.outputs[0].spec_stats.steps_by_k) for o in outputs)
    rested = llm.metrics()["speculation"]["rested_steps"]
    assert steps / 2 < rested < steps
    assert all(o.outputs[0].spec_stats.num_drafts == 0 for o in outputs)

    pinned = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, num_speculative_tokens=2)
    mixed = llm.generate(_prompts()[:2], [GREEDY, pinned])
    assert _ids(mixed) == reference[:2]
    automatic, drafting = (o.outputs[0].spec_stats for o in mixed)
    assert automatic.num_drafts == 0 and drafting.num_drafts > 0
    assert llm.metrics()["speculation"]["rested_steps"] - rested > sum(drafting.steps_by_k) / 2
    _no_leak(llm)
