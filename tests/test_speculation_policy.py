"""The speculation policy's decisions on hand-made cost models (no timings), the cost tables
and the acceptance estimates it reads."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from mlc_spec.runtime.speculation import (
    REFERENCE_CONTEXT,
    AcceptanceEstimator,
    Attended,
    Attention,
    Backoff,
    Candidate,
    CostTable,
    Coverage,
    DraftCosts,
    GoodputPolicy,
    RunningMean,
    StepCosts,
    StepShape,
    expected_tokens,
    refreshes_plain,
    warm_up,
)
from mlc_spec.runtime.speculation.backoff import MIN_SHARE, MOST_REST
from mlc_spec.runtime.speculation.costs import STALE_AFTER
from mlc_spec.runtime.speculation.policy import MIN_GAIN, REFRESH_BELOW
from mlc_spec.runtime.speculation.warm_up import COARSE_STRIDE, FINE_SIZES, sizes

K = 6


def costs(decode, verify, draft: DraftCosts | None = None, sizes: int = 64) -> StepCosts:
    """Tables from functions of the pass size; a free model-free proposer unless given."""
    return StepCosts(
        decode=CostTable({n: decode(n) for n in range(1, sizes + 1)}),
        verify=CostTable({n: verify(n) for n in range(1, sizes + 1)}),
        draft=draft or DraftCosts(model=False),
    )


def batch(alphas: list[float], cap: int = K, pinned: int | None = None) -> list[Candidate]:
    return [Candidate(cap=cap, pinned=pinned, acceptance=a) for a in alphas]


def choose(cands: list[Candidate], step_costs: StepCosts) -> list[int]:
    return GoodputPolicy().choose(cands, step_costs).num_draft


def test_expected_tokens():
    assert expected_tokens(0.5, 0) == 1
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(1.0, 4) == 5
    # Calibrated by position; positions past the calibration count whole.
    assert expected_tokens(0.5, 3, [0.5, 0.8]) == pytest.approx(1 + 0.25 + 0.2 + 0.125)


def test_calibration_lowers_what_drafting_is_expected_to_make():
    """A sequence estimated at 0.4 whose first drafts are accepted 1 time in 4, the second ones
    always after that: the first position is priced at what it makes (0.25 of 0.4 expected),
    the second (0.25 made of 0.16 expected) not above its estimate; without evidence the
    calibration drifts back to 1."""
    est = AcceptanceEstimator()
    assert est.calibration() == ()
    for step in range(400):
        est.fade([1])
        est.observe(1, 2, 2 if step % 4 == 0 else 0, 0.4)
    first, second = est.calibration()
    assert first == pytest.approx(0.25 / 0.4, rel=0.05) and second == 1.0
    for _ in range(1000):
        est.fade([1])
    assert est.calibration()[0] > 0.9


def test_calibrated_policy_drafts_only_where_what_drafts_make_pays():
    """Each verified token beyond the rows costs 0.45 of a decode row: at an estimate of 0.6 a
    draft pays, at a calibrated 0.6 x 0.6 it does not."""
    step = costs(
        decode=lambda n: 0.01 * n, verify=lambda n: 0.01 * min(n, 8) + 0.0045 * max(0, n - 8)
    )
    assert sum(choose(batch([0.6] * 8, cap=1), step)) > 0
    decision = GoodputPolicy().choose(batch([0.6] * 8, cap=1), step, [0.6])
    assert decision.num_draft == [0] * 8 and decision.expected_tokens == 8


def test_high_load_turns_speculation_off():
    """Once the batch fills the matmul, every extra token costs as much as a decode row: no
    acceptance rate below 1 makes a draft pay."""
    linear = costs(decode=lambda n: 0.01 * n, verify=lambda n: 0.01 * n)
    assert choose(batch([0.8] * 16), linear) == [0] * 16


def test_cheap_proposer_with_high_acceptance_drafts_the_most():
    """Verification nearly free, n-gram drafting free: every sequence takes K."""
    flat = costs(decode=lambda n: 0.030, verify=lambda n: 0.030 + 0.0001 * n)
    assert choose(batch([0.9] * 4), flat) == [K] * 4


def test_draft_model_cost_limits_k():
    """A draft pass costing a third of a target step: k stops where the next draft's chance of
    being emitted no longer pays for its pass."""
    draft = DraftCosts(
        model=True,
        first=CostTable({n: 0.010 for n in range(1, 20)}),
        next=CostTable({n: 0.010 for n in range(1, 20)}),
    )
    flat = costs(decode=lambda n: 0.030, verify=lambda n: 0.030, draft=draft)
    # alpha 0.8: tokens/s for k = 0..6 are 33.3, 45, 48.8, 49.2, 48.0, 46.0, 43.9.
    assert choose(batch([0.8]), flat) == [3]
    assert choose(batch([0.2]), flat) == [0]


def test_per_request_k_follows_acceptance():
    """A mixed batch: the code-like request drafts, the prose-like one does not."""
    step = costs(decode=lambda n: 0.030, verify=lambda n: 0.030 + 0.004 * (n - 1))
    k = choose(batch([0.95, 0.1]), step)
    assert k[0] >= 3 and k[1] == 0


def test_step_function_costs_are_searched_past_a_dip():
    """Verify of 3 tokens costs a tile more, but 4..7 tokens cost the same as 3: a policy that
    stops at the first drop in goodput would keep k = 1."""
    table = {1: 0.030, 2: 0.030, 3: 0.045, 4: 0.046, 5: 0.046, 6: 0.046, 7: 0.046}
    step = StepCosts(CostTable({1: 0.030}), CostTable(table), DraftCosts(model=False))
    assert choose(batch([0.9]), step) == [K]


def test_a_prompt_chunk_riding_in_the_pass_is_priced_with_the_drafts():
    """Passes cost a tile per 9 tokens (the int8 kernel's row tiles). At 4 rows 5 drafts ride
    free in the plain step's tile; with a 14-token prompt chunk in the pass the plain step
    fills two tiles already and a draft opens a third, which acceptance 0.3 does not repay;
    beside a 10-token chunk, 4 drafts fill the second tile for free."""

    def tiles(n: int) -> float:
        return 0.005 * (1 + -(-n // 9))

    step, candidates, policy = costs(tiles, tiles), batch([0.3] * 4), GoodputPolicy()
    assert sum(policy.choose(candidates, step).num_draft) == 5
    assert policy.choose(candidates, step, chunk=14).num_draft == [0] * 4
    assert policy.choose(candidates, step, chunk=10).num_draft == [1] * 4
    decision, _ = policy.choose_methods([{"ngram": c} for c in candidates], step, chunk=14)
    assert decision.num_draft == [0] * 4


def test_a_riding_chunk_does_not_make_drafts_look_cheaper():
    """A pass costs 4 ms plus 1 ms a token. At 2 rows and acceptance 0.3 a draft adds 0.3
    tokens for 1 ms, less than the plain step's 2 tokens in 6 ms; a 20-token chunk in the pass
    must not change that (charged to the tokens, its 20 ms made the draft look 10% better than
    plain), nor keep drafts that pay from being taken."""
    linear = costs(lambda n: 0.004 + 0.001 * n, lambda n: 0.004 + 0.001 * n)
    policy = GoodputPolicy()
    assert policy.choose(batch([0.3] * 2), linear, chunk=20).num_draft == [0, 0]
    paying = policy.choose(batch([0.9] * 2), linear).num_draft
    assert min(paying) > 0
    assert policy.choose(batch([0.9] * 2), linear, chunk=20).num_draft == paying


def test_drafts_must_promise_more_where_drafting_steps_made_less_than_predicted():
    """8 rows at acceptance 0.18 where a token costs 0.1 ms beside an 8 ms step: a draft each
    promises 8% more goodput than plain, and is taken. Once drafting steps have made 10% less
    than predicted while plain steps made what they predicted, that promise no longer clears
    the margin; as the evidence fades the policy drafts again."""
    linear = costs(lambda n: 0.008 + 0.0001 * n, lambda n: 0.008 + 0.0001 * n)
    policy = GoodputPolicy()
    cands = batch([0.18] * 8)
    assert any(policy.choose(cands, linear).num_draft)
    for _ in range(100):
        linear.realized.observe(True, 10.0, 9, 0.010, 0.010)
        linear.realized.observe(False, 8.0, 8, 0.008, 0.008)
    assert linear.realized.shrink() == pytest.approx(0.9, abs=0.01)
    assert not any(policy.choose(cands, linear).num_draft)
    for _ in range(2000):
        linear.realized.observe(False, 8.0, 8, 0.008, 0.008)
    assert any(policy.choose(cands, linear).num_draft)


def test_the_search_finds_the_best_drafts_on_any_rising_cost():
    """With a free proposer and costs by pass size, the best drafts for a total are the likeliest
    ones, so the search matches brute force over every k per sequence; it stops early only where
    no later total can win, whatever the steps' rises (tiles, flat runs)."""
    rng = np.random.default_rng(0)
    for _ in range(40):
        alphas = list(rng.uniform(0.05, 0.95, size=3))
        rises = rng.choice([0.0, 0.0, 0.001, 0.01], size=16)
        verify = dict(enumerate(0.01 + np.cumsum(rises), start=1))
        step = StepCosts(CostTable({3: verify[3]}), CostTable(verify), DraftCosts(model=False))
        grid = itertools.product(range(4), repeat=3)
        rates = {
            ks: sum(expected_tokens(a, k) for a, k in zip(alphas, ks, strict=True))
            / verify[3 + sum(ks)]
            for ks in grid
        }
        best = max(rates, key=rates.get)
        want = best if rates[best] >= (1 + MIN_GAIN) * rates[(0, 0, 0)] else (0, 0, 0)
        assert tuple(choose(batch(alphas, cap=3), step)) == want


def test_the_search_stops_once_no_later_draft_can_pay():
    """8 sequences at 30% where each token costs a decode row's time: 8.3 tokens in 90 ms after
    the first draft, with 3.1 more that all the queued drafts could add; at the third, all of
    them (11.4 tokens) could not reach the plain step's goodput in its 110 ms. The policy
    predicts 4 steps, not 65."""
    linear = costs(decode=lambda n: 0.01 * n, verify=lambda n: 0.01 * n)
    calls = []
    predict = linear.predict
    linear.predict = lambda shape: calls.append(shape.drafts) or predict(shape)
    assert choose(batch([0.3] * 8, cap=8), linear) == [0] * 8
    assert calls == [0, 1, 2, 3]


def test_a_tree_is_priced_by_its_nodes_and_chosen_where_its_depths_pay():
    """A tree of width 2 verifies 2 drafts a depth, and the draft's passes after its first
    carry 2 rows. Where verifying is nearly free, its higher acceptance per depth wins; where
    each verified token costs a quarter of a decode step, the chain does."""
    shape = StepShape.of([3], [1], widths=[2])
    assert (shape.drafts, shape.drafting) == (6, [1, 2, 2])
    flat = costs(decode=lambda n: 0.030, verify=lambda n: 0.030 + 0.0005 * n)
    steep = costs(decode=lambda n: 0.030, verify=lambda n: 0.030 + 0.008 * (n - 1))
    options = [
        {
            "draft": Candidate(cap=3, pinned=None, acceptance=0.6),
            "draft_tree": Candidate(cap=3, pinned=None, acceptance=0.75, width=2),
        }
    ]
    flat_choice, steep_choice = (GoodputPolicy().choose_methods(options, c) for c in (flat, steep))
    assert (flat_choice[0].num_draft, flat_choice[1]) == ([3], ["draft_tree"])
    assert (steep_choice[0].num_draft, steep_choice[1]) == ([2], ["draft"])


def test_pinned_and_capped_requests():
    flat = costs(decode=lambda n: 0.030, verify=lambda n: 0.030)
    linear = costs(decode=lambda n: 0.01 * n, verify=lambda n: 0.01 * n)
    cands = [
        Candidate(cap=0, pinned=0, acceptance=0.99),  # speculation off for this request
        Candidate(cap=2, pinned=2, acceptance=0.01),  # k pinned (capped) however bad
        Candidate(cap=1, pinned=None, acceptance=0.99),  # one token left to draft
        Candidate(cap=K, pinned=None, acceptance=0.99),
    ]
    assert choose(cands, flat) == [0, 2, 1, K]
    for cand in cands[2:]:
        cand.acceptance = 0.5
    assert choose(cands, linear) == [0, 2, 0, 0]


def test_no_measured_costs_means_no_drafts_for_automatic_requests():
    empty = StepCosts(CostTable(), CostTable(), DraftCosts(model=False))
    decision = GoodputPolicy().choose(batch([0.9, 0.9]), empty)
    assert decision.num_draft == [0, 0] and decision.predicted_seconds is None


def test_prediction_adds_target_draft_and_rest():
    draft = DraftCosts(
        model=True,
        first=CostTable({2: 0.004, 3: 0.005}),
        next=CostTable({1: 0.002, 2: 0.003}),
        per_sequence=RunningMean(0.0001),
    )
    step = StepCosts(
        CostTable({2: 0.020}),
        CostTable({2: 0.020, 7: 0.040}),
        draft,
        per_row=RunningMean(0.001),
    )
    # Sequence 0 drafts 3 (reads 2 tokens first), sequence 1 drafts 2 (reads 1): passes of 3
    # tokens, 2 rows, 1 row; verify 2 + 5 tokens.
    shape = StepShape.of([3, 2], [2, 1])
    assert shape.drafting == [2, 2, 1] and shape.catch_up == 3
    expected = 0.040 + (0.005 + 0.003 + 0.002 + 2 * 0.0001) + 2 * 0.001
    assert step.predict(shape) == pytest.approx(expected)
    assert step.predict(StepShape.of([0, 0], [2, 1])) == pytest.approx(0.020 + 2 * 0.001)
    # A long catch-up (a prompt the draft has not read) enters the shape as a steady one; the
    # policy adds the rest (test_catch_up_is_paid_once_and_spread_over_the_tokens_left).
    assert StepShape.of([3, 2], [150, 1]).catch_up == 3


def test_context_beyond_the_reference_is_priced_by_attention():
    """Tables hold passes at the reference context; a pass pays per token of context beyond it,
    for each row and, less, for each of its drafts, so a step measured at a long context
    enters the tables at the reference, and drafts for a sequence with a long context cost
    more."""
    step = costs(lambda n: 0.010 + 0.001 * n, lambda n: 0.010 + 0.001 * n)
    step.attention = Attention(row=2e-6, draft=1e-6)
    long = REFERENCE_CONTEXT + 1000
    shape = StepShape.of([2, 0], [1, 1], [long, REFERENCE_CONTEXT])
    assert shape.attended == Attended(rows=1000, drafts=2000)  # the long row and its 2 drafts
    assert step.predict(shape) == pytest.approx(0.010 + 0.001 * 4 + 0.002 + 0.002)
    assert step.plain([long, REFERENCE_CONTEXT]) == pytest.approx(0.012 + 0.002)
    step.observe_target(2, 2, 0.016, Attended(rows=2000))  # 12 ms at the reference
    assert step.decode.predict(2) == pytest.approx(0.012)
    # A draft costs 1 ms of matmul; at 3 us per token of context, attending 1000 tokens beyond
    # adds 3 ms to it. At 20% acceptance a draft pays at the reference context (0.2 tokens
    # more for 1 ms on 11) but not 1000 tokens past it (for 4 ms on 13).
    step.attention = Attention(row=2e-6, draft=3e-6)
    near, far = (
        [Candidate(cap=1, pinned=None, acceptance=0.2, context=c)]
        for c in (REFERENCE_CONTEXT, long)
    )
    assert choose(near, step) == [1] and choose(far, step) == [0]


def test_catch_up_is_paid_once_and_spread_over_the_tokens_left():
    """Reading a 150-token prompt costs the draft 0.3 s once. A reply with many tokens left
    spreads it thin and drafts as after a steady catch-up; one with 4 tokens left cannot earn it
    back and stays on the plain decode path. The predicted step time holds the whole cost."""
    draft = DraftCosts(
        model=True,
        first=CostTable({n: 0.002 * n for n in range(1, 200)}),
        next=CostTable({n: 0.010 for n in range(1, 20)}),
    )
    flat = costs(decode=lambda n: 0.030, verify=lambda n: 0.030, draft=draft)
    steady = [Candidate(cap=K, pinned=None, acceptance=0.8, catch_up=1)]
    assert choose(steady, flat) == [2]
    long_reply = [Candidate(cap=K, pinned=None, acceptance=0.8, catch_up=150, tokens_left=10**6)]
    decision = GoodputPolicy().choose(long_reply, flat)
    assert decision.num_draft == [2]
    assert decision.predicted_seconds == pytest.approx(0.030 + 0.300 + 0.010)
    assert decision.predicted_seconds > decision.charged_seconds
    short_reply = [Candidate(cap=3, pinned=None, acceptance=0.8, catch_up=150, tokens_left=4)]
    assert choose(short_reply, flat) == [0]
    # A pinned k drafts whatever its catch-up costs.
    pinned = [Candidate(cap=3, pinned=3, acceptance=0.8, catch_up=150, tokens_left=4)]
    assert choose(pinned, flat) == [3]


def test_a_catch_up_is_paid_only_where_drafting_lasts_in_the_batch_to_come():
    """Three sequences at acceptance 0.9 pay for their prompts' catch-ups at 3 rows, but every
    verify pass at 4 rows ran 2.7x a plain step: with a fourth sequence about to join, drafts
    would go on at 4 rows without repaying the catch-ups there, so they wait. Sequences already
    caught up draft either way; so does a batch that nothing joins."""
    draft = DraftCosts(
        model=True,
        first=CostTable({n: 0.001 * n for n in range(1, 600)}),
        next=CostTable({n: 0.005 for n in range(1, 20)}),
    )
    step = costs(decode=lambda n: 0.030, verify=lambda n: 0.030 + 0.001 * n, draft=draft)
    step.shapes[4] = {tokens: RunningMean(0.080) for tokens in range(5, 4 * (K + 1) + 1)}
    prompts = [Candidate(cap=K, pinned=None, acceptance=0.9, catch_up=150) for _ in range(3)]
    assert all(choose(prompts, step))
    assert not any(GoodputPolicy().choose(prompts, step, joining=1).num_draft)
    caught_up = [Candidate(cap=K, pinned=None, acceptance=0.9, catch_up=2) for _ in range(3)]
    assert all(GoodputPolicy().choose(caught_up, step, joining=1).num_draft)
    plain_row = Candidate(cap=0, pinned=None, acceptance=0.0)
    assert all(choose([*caught_up, plain_row], step)[:3])
    assert not any(choose([*prompts, plain_row], step))


def int8_batch_of_one() -> StepCosts:
    """Step costs as measured for the Qwen 1.5B/0.5B pair with int8 activations at batch 1
    (docs/benchmarks.md): verify of 2 tokens 1.22x a decode, a draft pass 0.4-0.5 of one, and a
    catch-up over a prompt a prefill of the draft's own."""
    return StepCosts(
        CostTable({1: 0.076}),
        CostTable({1: 0.076, 2: 0.093, 3: 0.103, 4: 0.127, 5: 0.133, 6: 0.138, 7: 0.150}),
        DraftCosts(
            model=True,
            first=CostTable({1: 0.031, 2: 0.032, 64: 0.090, 128: 0.160, 192: 0.230}),
            next=CostTable({1: 0.035}),
        ),
    )


def high_load() -> StepCosts:
    """16 rows: each verified token costs half a decode row, so drafting pays only from an
    acceptance of ~0.85 (the draft model's passes and ``MIN_GAIN`` included)."""
    return StepCosts(
        CostTable({16: 0.240}),
        CostTable({n: 0.240 * (1 + 0.5 * (n - 16) / 16) for n in range(16, 16 * (K + 1) + 1)}),
        DraftCosts(model=True, first=CostTable({32: 0.070}), next=CostTable({16: 0.090})),
    )


def simulate(step_costs: StepCosts, rows: int, alpha: float, steps: int) -> list[int]:
    """Drafts per step for ``rows`` long replies whose draft tokens are each accepted with
    probability ``alpha``, the estimates learning from every step as the engine's do."""
    est, rng, chosen = AcceptanceEstimator(), np.random.default_rng(0), []
    for _ in range(steps):
        cands = [
            Candidate(cap=K, pinned=None, acceptance=est.estimate(i), catch_up=2)
            for i in range(rows)
        ]
        num_draft = GoodputPolicy().choose(cands, step_costs, est.calibration()).num_draft
        est.fade(list(range(rows)))
        for i, k in enumerate(num_draft):
            accepted = 0
            while accepted < k and rng.random() < alpha:
                accepted += 1
            est.observe(i, k, accepted, cands[i].acceptance)
        chosen.append(sum(num_draft))
    return chosen


def test_scarce_evidence_drafts_to_measure_acceptance():
    """A new engine's first request after a 150-token prompt: the optimistic estimate drafts, so
    its acceptance gets measured. A realistic guess of 0.7 would not pay for the catch-up and
    the step, and without drafts no evidence would ever come."""
    reply = Candidate(cap=K, pinned=None, acceptance=0.0, catch_up=150, tokens_left=31)
    reply.acceptance = AcceptanceEstimator().estimate(1)
    assert choose([reply], int8_batch_of_one())[0] >= 1
    reply.acceptance = 0.7
    assert choose([reply], int8_batch_of_one()) == [0]


def test_evidence_of_high_acceptance_drafts_the_most():
    assert simulate(int8_batch_of_one(), rows=1, alpha=1.0, steps=50) == [K] * 50


def test_evidence_of_low_acceptance_keeps_exploration_rare():
    """Acceptance 0.3 at batch 1: the first step tries, the evidence then keeps speculation off;
    as the counts fade, a draft or two is tried again now and then, in under 4% of steps."""
    chosen = simulate(int8_batch_of_one(), rows=1, alpha=0.3, steps=3000)
    assert chosen[0] >= 1
    assert max(chosen[20:]) <= 2 and sum(map(bool, chosen)) < len(chosen) / 25


def test_a_gain_within_the_predictions_error_does_not_draft():
    """Verify as cheap as decode: one draft at acceptance a predicts 1 + a tokens a step. Below
    ``MIN_GAIN`` the plain step stands; above it the draft goes ahead."""
    free_verify = StepCosts(
        CostTable({1: 0.010}), CostTable({1: 0.010, 2: 0.010}), DraftCosts(model=False)
    )
    assert choose(batch([MIN_GAIN * 0.8], cap=1), free_verify) == [0]
    assert choose(batch([MIN_GAIN * 1.2], cap=1), free_verify) == [1]


def test_high_load_explores_once_then_stays_off():
    """16 sequences accepting 60%: one step of evidence outweighs the optimism for hundreds of
    steps. Where no acceptance could pay (every verified token as dear as a decode row), not
    even the optimistic estimate drafts."""
    chosen = simulate(high_load(), rows=16, alpha=0.6, steps=400)
    assert chosen[0] >= 16 and not any(chosen[1:])
    linear = costs(decode=lambda n: 0.01 * n, verify=lambda n: 0.01 * n, sizes=16 * (K + 1))
    assert not any(simulate(linear, rows=16, alpha=0.6, steps=50))


def test_cost_table_is_a_measured_step_function():
    table = CostTable({1: 0.03, 6: 0.05})
    assert table.predict(0) == 0.0
    assert table.predict(4) == 0.05  # unmeasured: the next measured size up
    assert table.predict(12) == pytest.approx(0.10)  # past the largest: in proportion
    table.observe(6, 0.10)
    assert 0.05 < table.predict(6) < 0.10  # a running mean follows new measurements
    table.observe(3, 0.04)
    assert table.predict(2) == 0.04
    assert CostTable().predict(3) is None


def test_warm_up_times_every_small_size_and_a_stride_of_the_large():
    assert sizes(2, 7) == [2, 3, 4, 5, 6, 7]  # a batch of one at K = 6: every size
    wide = sizes(2, 112)  # a batch of 16 at K = 6
    assert wide[: FINE_SIZES - 1] == list(range(2, FINE_SIZES + 1))
    assert wide[-1] == 112 and len(wide) < 45
    assert max(b - a for a, b in zip(wide, wide[1:], strict=False)) <= COARSE_STRIDE
    assert sizes(3, 2) == []


def test_acceptance_prior_and_own_history():
    est = AcceptanceEstimator()
    assert est.estimate(1) == 1.0  # no evidence: optimistic
    for _ in range(20):  # sequence 1 accepts every draft, sequence 2 none
        est.fade([1, 2])
        est.observe(1, 4, 4, est.estimate(1))
        est.observe(2, 4, 0, est.estimate(2))
    assert est.per_position()[0] == pytest.approx(0.5, abs=0.01)
    assert est.estimate(1) > 0.9 and est.estimate(2) < 0.3
    assert 0.6 < est.prior() < 0.85  # 84 accepted of 104 checked, pulled to the initial guess


def test_a_draft_models_estimate_is_steady_and_uncalibrated():
    """Drafts accepted at a steady 0.7 whatever their position, k=3 where a sequence's estimate
    is above 0.7 and k=1 below: the default estimator's calibration reads its own noise (the
    third drafts fall short of estimates that were high by chance), a draft model's
    (``steady``) takes no calibration and its estimates scatter less around the rate."""
    rng = np.random.default_rng(0)
    estimates = {}
    for steady in (False, True):
        est, seen = AcceptanceEstimator(steady=steady), []
        for _ in range(2000):
            est.fade([1])
            alpha = est.estimate(1)
            k = 3 if alpha > 0.7 else 1
            accepted = 0
            while accepted < k and rng.random() < 0.7:
                accepted += 1
            est.observe(1, k, accepted, alpha)
            seen.append(alpha)
        estimates[steady] = np.array(seen[200:])
        if steady:
            assert est.calibration() == ()
        else:
            assert est.calibration()[2] < 0.9
    assert abs(estimates[True].mean() - 0.7) < 0.03
    assert estimates[True].std() < 0.7 * estimates[False].std()


def test_acceptance_recovers_when_the_text_changes_character():
    est = AcceptanceEstimator()
    for _ in range(30):
        est.fade([1])
        est.observe(1, 4, 4, est.estimate(1))
    steps = 0
    while est.estimate(1) > 0.5:
        est.fade([1])
        est.observe(1, 4, 0, est.estimate(1))
        steps += 1
    assert steps <= 10
    # Not drafting at all: the estimate drifts back to the prior, so drafting is tried again.
    low = est.estimate(1)
    for _ in range(30):
        est.fade([1])
    assert est.estimate(1) > low + 0.2
    est.forget(1)
    assert len(est) == 0


def test_verify_passes_are_priced_by_rows_and_tokens():
    """A pass of 16 tokens over 8 sequences costs one sequence's 16 tokens plus what 8
    sequences cost beyond one sequence's 8: dearer than over 2 sequences. A shape that steps
    run keeps a running mean of its own, starting from that prediction; how far its first
    measurement was off scales the shapes not run yet."""
    step = StepCosts(
        CostTable({1: 0.030, 2: 0.032, 8: 0.060}),
        CostTable({1: 0.030, 2: 0.031, 8: 0.040, 16: 0.050}),
        DraftCosts(model=False),
    )
    assert step.target(8, 16) == pytest.approx(0.050 + 0.060 - 0.040)
    assert step.target(2, 16) == pytest.approx(0.050 + 0.032 - 0.031)
    assert step.target(8, 8) == 0.060  # a plain decode
    step.observe_target(8, 16, 0.090)
    assert step.target(8, 16) == pytest.approx(0.070 + 0.2 * (0.090 - 0.070))
    # 0.090 measured against 0.070 estimated: shapes not run yet are priced 1/5 of the way
    # to 0.090 / 0.070 dearer.
    assert step.target(2, 16) == pytest.approx(0.051 * (1 + 0.2 * (0.090 / 0.070 - 1)))
    step.observe_target(8, 16, 0.070)  # a shape run before moves only its own mean
    assert step.estimate_bias.value == pytest.approx(1 + 0.2 * (0.090 / 0.070 - 1))
    step.observe_target(8, 8, 0.050)
    assert 0.050 < step.decode.predict(8) < 0.060
    # A pinned k measures verify passes without load-time tables: nothing to predict from.
    unmeasured = StepCosts(CostTable(), CostTable(), DraftCosts(model=False))
    unmeasured.observe_target(2, 5, 0.040)
    unmeasured.observe_target(2, 2, 0.030)
    assert unmeasured.target(2, 2) == 0.030 and unmeasured.target(2, 5) == 0.040
    assert unmeasured.target(2, 4) is None


def test_plain_decode_is_never_predicted_dearer_than_a_verify_of_its_rows():
    """Load inflated the decode of 2 rows at warm-up. Once steps have run a verify pass of 2
    rows, which they keep measuring, it bounds the decode (less its extra token's cost), and
    the policy does not keep drafting just to avoid an imagined cost."""
    step = StepCosts(
        CostTable({1: 0.030, 2: 0.300}),
        CostTable({1: 0.030, 2: 0.031, 3: 0.040}),
        DraftCosts(model=False),
    )
    assert step.target(2, 2) == 0.300
    assert sum(choose(batch([0.3, 0.3]), step)) > 0
    for _ in range(30):
        step.observe_target(2, 3, 0.040)
    assert step.target(2, 2) == pytest.approx(0.031, rel=0.02)
    assert choose(batch([0.3, 0.3]), step) == [0, 0]


def test_plain_decode_is_never_predicted_below_one_sequences_pass_of_its_rows():
    """A verify of 4 sequences and 48 tokens costs less than one sequence's 48 tokens beyond
    its 4 suggest: subtracting that extra priced a plain decode of 4 rows at 4.5 ms, below the
    6.4 measured and below even one sequence's 4-token pass (6.8 ms). The bound is floored at
    that pass, and drafts at acceptance 1 pay."""
    step = StepCosts(
        CostTable({1: 0.006, 4: 0.0064}),
        CostTable({1: 0.006, 4: 0.0068, 48: 0.050}),
        DraftCosts(model=False),
    )
    step.observe_target(4, 48, 0.040)
    assert step.target(4, 4) == 0.0064
    step.decode.observe(4, 0.020)  # an inflated decode is still bounded, at the floor
    assert step.target(4, 4) == pytest.approx(0.0068)
    assert sum(choose(batch([1.0] * 4, cap=12), step)) > 0


def steps_against_a_stale_plain_price(rows: int, verify: float, refresh: bool) -> list[int]:
    """Drafts per step for ``rows`` sequences, one of which has a draft at acceptance 0.9,
    stepped as the scheduler does: a plain pass takes 10 ms, a pass verifying the draft
    ``verify`` s. The plain price was measured 10% high (11 ms) before any of these steps, and
    load-time passes of one sequence put the draft's token at 0.2 ms."""
    step = StepCosts(
        CostTable({rows: 0.011}),
        CostTable({rows: 0.009, rows + 1: 0.0092}),
        DraftCosts(model=False),
    )
    step.observe_target(rows, rows, 0.011)
    step.observe_target(rows, rows + 1, verify)
    cands = [Candidate(cap=1 if i == 0 else 0, pinned=None, acceptance=0.9) for i in range(rows)]
    chosen = []
    for _ in range(60):
        decision = GoodputPolicy().choose(cands, step)
        if refresh and any(decision.num_draft) and refreshes_plain(decision, step, rows):
            decision.num_draft = [0] * rows
        drafts = sum(decision.num_draft)
        step.observe_target(rows, rows + drafts, verify if drafts else 0.010)
        chosen.append(drafts)
    return chosen


def test_a_plain_price_only_load_time_measured_is_stale_until_a_step_measures_it():
    """Load-time passes priced the Qwen pair's plain step of 4 rows 5-7% above what steps took,
    enough to start a draft model whose catch-ups the drafts never repaid. Such a price is
    stale from the start, verify passes leave it so, and drafts that gain little step plain
    first; past ``REFRESH_BELOW`` they draft at once."""
    step = StepCosts(
        CostTable({4: 0.011}), CostTable({4: 0.009, 5: 0.0092}), DraftCosts(model=False)
    )
    assert step.plain_is_stale(4)
    step.observe_target(4, 5, 0.0105)
    assert step.plain_is_stale(4)
    cands = [Candidate(cap=1 if i == 0 else 0, pinned=None, acceptance=0.9) for i in range(4)]
    decision = GoodputPolicy().choose(cands, step)
    assert decision.num_draft == [1, 0, 0, 0] and decision.gain < REFRESH_BELOW
    assert refreshes_plain(decision, step, 4)
    step.observe_target(4, 4, 0.010)
    assert not step.plain_is_stale(4)
    assert step.target(4, 4) == pytest.approx(0.0105)  # the stale weight: halfway
    assert not refreshes_plain(decision, step, 4)


def test_a_stale_plain_price_is_measured_again_where_drafts_gain_little():
    """Verify passes never correct a plain price of 8 rows that is 10% high: their draft's
    token cost more than load time said (11.2 ms for 9 tokens against 10 for 8), so drafts
    that lose 1% pass the policy's margin step after step. After ``STALE_AFTER`` of them a
    plain step measures the price again, and the policy stops drafting. At one sequence the
    draft gains 1.8x, past ``REFRESH_BELOW``: it drafts every step, never stepping plain."""
    assert steps_against_a_stale_plain_price(8, 0.0112, refresh=False) == [1] * 60
    refreshed = steps_against_a_stale_plain_price(8, 0.0112, refresh=True)
    assert refreshed == [1] * (STALE_AFTER - 1) + [0] * (61 - STALE_AFTER)  # 1 verify before
    step = StepCosts(CostTable({1: 0.010}), CostTable({1: 0.010, 2: 0.0105}), DraftCosts(False))
    decision = GoodputPolicy().choose([Candidate(cap=1, pinned=None, acceptance=0.9)], step)
    assert decision.gain > REFRESH_BELOW
    assert steps_against_a_stale_plain_price(1, 0.0105, refresh=True) == [1] * 60


class _Clock:
    """Stands in for time.perf_counter: advanced by the fake model's passes."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Logits:
    def __init__(self, rows: int):
        self.shape = (rows, 8)


class _Cache:
    page_size = 16

    def available_pages(self) -> int:
        return 1000

    def add_sequence(self, seq_id: int) -> None: ...

    def remove_sequence(self, seq_id: int) -> None: ...

    def popn(self, seq_id: int, n: int) -> None: ...

    def sequence_length(self, seq_id: int) -> int:
        return 0

    def copy_sequence(self, parent: int, child: int) -> bool:
        return False

    def repeat_sequence(self, seq_id: int, length: int) -> bool:
        return False


class _LoadedModel:
    """Every pass takes 10 ms per row, plus 100 ms while a burst of other load lasts (its
    first ``burst`` passes)."""

    vocab_size = 100

    def __init__(self, clock: _Clock, burst: int):
        self.clock, self.burst = clock, burst
        self.sampler = self

    def prefill_chunked(self, kv, ids, tokens, chunk_size) -> None: ...

    def decode(self, kv, rows, tokens) -> _Logits:
        self.clock.now += 0.010 * len(rows) + (0.100 if self.burst > 0 else 0.0)
        self.burst -= 1
        return _Logits(len(rows))

    def sample_logits(self, logits, params, uniforms) -> None: ...


def test_warm_up_keeps_each_size_fastest_sweep(monkeypatch):
    """A burst of load during the first sweep does not stick in the cost tables."""
    clock = _Clock()
    monkeypatch.setattr(warm_up.time, "perf_counter", clock)
    passes = [[1] * r for r in (1, 2, 3)]
    model = _LoadedModel(clock, burst=1 + 2)  # the untimed first pass and 2 of the first sweep
    seconds = warm_up.time_passes(model, _Cache(), "decode", passes, chunk_size=64)
    assert seconds == pytest.approx([0.010, 0.020, 0.030])
    assert warm_up.SWEEPS >= 2


def auto_costs(free_per_sequence: float = 0.0002) -> StepCosts:
    """The int8 pair at batch 1 with suffix decoding beside the draft: its lookup is host work
    per drafting sequence, not a pass."""
    step = int8_batch_of_one()
    step.free = DraftCosts(model=False, per_sequence=RunningMean(free_per_sequence))
    return step


def options(draft: float, suffix: float, suffix_cap: int = K) -> dict[str, Candidate]:
    return {
        "draft": Candidate(cap=K, pinned=None, acceptance=draft, catch_up=1),
        "suffix": Candidate(cap=suffix_cap, pinned=None, acceptance=suffix, free=True),
    }


def test_a_free_proposer_is_priced_per_sequence_not_by_passes():
    """Suffix drafts beside a draft model add the verify's tokens and the lookup, never the
    draft model's passes."""
    step = auto_costs()
    shape = StepShape.of([3], [1], free=[True])
    assert shape.free == 1 and shape.drafting == [] and shape.drafts == 3
    assert step.predict(shape) == pytest.approx(0.127 + 0.0002)
    mixed = StepShape.of([2, 3], [1, 1], free=[False, True])
    assert mixed.drafting == [1, 1] and mixed.free == 1 and mixed.drafts == 5


def test_the_policy_picks_each_sequences_proposer_by_goodput():
    """One sequence, the Qwen pair's costs: suffix drafts cost only verify tokens, the draft's
    a pass each. Suffix decoding wins where it is as likely as the draft (and where it is
    somewhat less likely: it is free); the draft wins where suffix decoding has no draft or
    much lower acceptance. Either way the k is the one ``choose`` gives that proposer."""
    policy, step = GoodputPolicy(), auto_costs()
    decision, methods = policy.choose_methods([options(0.8, 0.8)], step)
    assert methods == ["suffix"] and decision.num_draft == choose(
        [options(0.8, 0.8)["suffix"]], step
    )
    assert policy.choose_methods([options(0.8, 0.6)], step)[1] == ["suffix"]
    assert policy.choose_methods([options(0.8, 0.8, suffix_cap=0)], step)[1] == ["draft"]
    assert policy.choose_methods([options(0.9, 0.2)], step)[1] == ["draft"]
    # Nothing drafts where neither pays: the plain decode path.
    decision, _ = policy.choose_methods([options(0.05, 0.05)], step)
    assert decision.num_draft == [0]


def test_beside_suffix_decoding_a_catch_up_is_spread_over_what_it_leaves_the_draft():
    """A new reply with no suffix match: the draft model must first read a 192-token prompt
    (0.23 s). Spread over the 128 tokens the reply has left, that pays at acceptance 0.9. Where
    suffix decoding is expected to draft 90% of the reply, the catch-up serves ~13 tokens and
    the plain decode path is faster."""
    step = auto_costs()

    def chosen(served: float) -> tuple[list[int], list[str]]:
        draft = Candidate(
            cap=K, pinned=None, acceptance=0.9, catch_up=192, tokens_left=128, served=served
        )
        suffix = Candidate(cap=0, pinned=None, acceptance=0.9, free=True)
        decision, methods = GoodputPolicy().choose_methods(
            [{"draft": draft, "suffix": suffix}], step
        )
        return decision.num_draft, methods

    assert chosen(1.0)[0][0] > 0 and chosen(1.0)[1] == ["draft"]
    assert chosen(0.1)[0] == [0]


def test_coverage_is_the_share_of_text_the_model_free_proposer_drafted():
    """Per sequence, against the engine-wide share as a prior, and following the text: a run
    of plain steps after copied text brings the share down within a few steps."""
    coverage = Coverage()
    assert coverage.share(1) == 0.0  # no evidence: a draft model's catch-up serves it all
    for _ in range(10):
        coverage.observe(1, 6, covered=True)
    assert coverage.share(1) > 0.95
    assert coverage.share(2) > 0.95  # a new sequence starts from the engine's share
    for _ in range(10):
        coverage.observe(1, 1, covered=False)
    assert coverage.share(1) < 0.7
    coverage.forget(1)
    assert coverage.share(1) == coverage.share(2)


def test_the_policy_mixes_proposers_in_a_batch():
    """Two sequences: one whose suffix tree matches, one whose does not. The best assignment
    drafts each with its own proposer in one step; a sequence whose request pinned a method
    keeps it."""
    # A flat 30 ms pass, 1 ms more per verified token; a draft pass of 3 ms.
    cheap = DraftCosts(
        model=True,
        first=CostTable({n: 0.003 for n in range(1, 20)}),
        next=CostTable({n: 0.003 for n in range(1, 20)}),
    )
    step = costs(lambda n: 0.030, lambda n: 0.029 + 0.001 * n, draft=cheap)
    step.free = DraftCosts(model=False, per_sequence=RunningMean(0.0002))
    decision, methods = GoodputPolicy().choose_methods(
        [options(0.8, 0.95), options(0.8, 0.8, suffix_cap=0)], step
    )
    assert methods == ["suffix", "draft"] and all(decision.num_draft)
    pinned = {"draft": options(0.8, 0.95)["draft"]}
    assert GoodputPolicy().choose_methods([pinned, options(0.8, 0.95)], step)[1] == [
        "draft",
        "suffix",
    ]


def test_a_batch_that_declines_its_drafts_rests_before_weighing_them_again():
    """After each step where the policy chose no draft and weighing cost more than
    ``MIN_SHARE`` of the step, the batch goes plain for twice as many steps, up to
    ``MOST_REST``; a step that drafts, or a cheap weighing, weighs every step again, and so
    does a batch with a sequence new to it."""

    def weighed_steps(backoff: Backoff, steps: int, drafted=False, seconds=0.1e-3) -> list[int]:
        weighed = []
        for step in range(steps):
            if not backoff.resting([1, 2]):
                weighed.append(step)
                backoff.weighed([1, 2], drafted, seconds, step=5e-3)
        return weighed

    declines = Backoff()
    assert weighed_steps(declines, 40) == [0, 2, 5, 10, 19, 28, 37]
    assert declines.rest == MOST_REST and declines.rested_steps == 33
    # A sequence leaving the batch keeps it resting; one joining it ends the rest.
    assert declines.resting([2]) and not declines.resting([2, 3])
    assert weighed_steps(Backoff(), 5, drafted=True) == [0, 1, 2, 3, 4]
    assert weighed_steps(Backoff(), 5, seconds=MIN_SHARE * 5e-3) == [0, 1, 2, 3, 4]
    weighed_steps(declines, 12)
    declines.weighed([1, 2], True, 0.1e-3, 5e-3)
    assert declines.rest == 0 and weighed_steps(declines, 3) == [0, 2]
    unmeasured = Backoff()
    unmeasured.weighed([1], False, 1.0, None)
    assert not unmeasured.resting([1])
