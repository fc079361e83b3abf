"""Speculative acceptance: exact greedy equivalence and statistical losslessness when sampling,
for the numpy oracle and the compiled verification alike (``sampling`` fixture)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from sampling_oracle import probs_from_logits, rejection_sample, sample_from_probs
from stats import chi2_rejects

Sampler = Callable[..., tuple[np.ndarray, np.ndarray]]


def split(num_accepted: np.ndarray, tokens: np.ndarray) -> list[list[int]]:
    return [t.tolist() for t in np.split(tokens, np.cumsum(num_accepted + 1)[:-1])]


# --- exact behaviour --------------------------------------------------------------------------


def test_hand_computed_ragged_batch(sampling) -> None:
    num_draft = np.array([2, 0, 1])
    draft_tokens = np.array([0, 1, 2])
    draft_probs = np.array([[0.5, 0.25, 0.25], [0.2, 0.6, 0.2], [0.1, 0.1, 0.8]])
    target_probs = np.array(
        [
            [0.25, 0.5, 0.25],  # req 0 pos 0: ratio 0.25/0.5 = 0.5, u = 0.4 accepts
            [0.3, 0.3, 0.4],  # req 0 pos 1: ratio 0.5, u = 0.5 rejects (strict <)
            [1.0, 0.0, 0.0],  # req 0 bonus row, unused
            [0.5, 0.5, 0.0],  # req 1: no drafts, samples here
            [0.2, 0.2, 0.6],  # req 2 pos 0: ratio 0.75, u = 0.7 accepts
            [0.0, 1.0, 0.0],  # req 2 bonus row
        ]
    )
    # Req 0's residual max(0, [.3, .3, .4] - [.2, .6, .2]) = [.1, 0, .2] -> [1/3, 0, 2/3]; u = 0.5
    # picks token 2. Req 1: u = 0.6 over [.5, .5, 0] picks 1. Req 2's bonus is 1.
    num_accepted, tokens = sampling.rejection_sample(
        draft_tokens,
        num_draft,
        draft_probs,
        target_probs,
        np.array([0.4, 0.5, 0.7]),
        np.array([0.5, 0.6, 0.0]),
    )
    assert num_accepted.dtype == np.int64 and tokens.dtype == np.int64
    np.testing.assert_array_equal(num_accepted, [1, 0, 1])
    assert split(num_accepted, tokens) == [[0, 2], [1], [2, 1]]


def test_deterministic_draft_residual_removes_the_draft_token(sampling) -> None:
    # Point-mass proposal: accept iff u < p_t(x); on rejection x itself can never be emitted.
    target_probs = np.array([[0.6, 0.3, 0.1], [0.0, 0.0, 1.0]])
    for u in np.linspace(0.0, 0.99, 12):
        num_accepted, tokens = sampling.rejection_sample(
            np.array([0]), np.array([1]), None, target_probs, np.array([0.55]), np.array([u])
        )
        assert num_accepted[0] == 1 and tokens.tolist() == [0, 2]
        num_accepted, tokens = sampling.rejection_sample(
            np.array([0]), np.array([1]), None, target_probs, np.array([0.6]), np.array([u])
        )
        assert num_accepted[0] == 0 and tokens.tolist() == [1 if u < 0.75 else 2]


def test_empty_residual_falls_back_to_target_row(sampling) -> None:
    # p_t(x) = p_d(x) = 0 rejects although p_t == p_d, leaving no residual mass.
    probs = np.array([[0.5, 0.5, 0.0]])
    num_accepted, tokens = sampling.rejection_sample(
        np.array([2]), np.array([1]), probs, np.vstack([probs, probs]), [0.0], np.array([0.7])
    )
    assert num_accepted[0] == 0 and tokens.tolist() == [1]


def test_oracle_shape_mismatches_raise() -> None:
    target = np.full((3, 4), 0.25)
    with pytest.raises(ValueError):  # target needs sum(k) + B = 4 rows
        rejection_sample(np.array([1, 2]), np.array([2, 0]), None, target, np.zeros(2), np.zeros(2))
    with pytest.raises(ValueError):  # draft_probs must be [sum(k), V]
        rejection_sample(
            np.array([1]), np.array([1, 0]), np.ones((1, 3)), target, np.zeros(1), np.zeros(2)
        )


# --- greedy: exactly "longest matching prefix, then the target argmax" -------------------------


@pytest.mark.parametrize("draft_kind", ["deterministic", "sampled"])
@pytest.mark.parametrize("uniform_kind", ["random", "zero", "almost-one"])
def test_greedy_target_gives_longest_matching_prefix(
    sampling, draft_kind: str, uniform_kind: str
) -> None:
    rng = np.random.default_rng(3)
    v = 11
    # (k_i, first mismatching position or None): bonus, none accepted, k = 0, partial prefixes.
    spec = [(3, None), (0, None), (4, 0), (2, 1), (1, None), (3, 2), (0, None), (5, 4), (1, 0)]
    num_draft = np.array([k for k, _ in spec])
    t, b = int(num_draft.sum()), len(spec)
    target_probs = probs_from_logits(rng.normal(size=(t + b, v)), 0.0, 0, 1.0)
    argmax = target_probs.argmax(axis=1)

    draft_tokens, expected = [], []
    row = 0
    for k, mismatch in spec:
        drafts = argmax[row : row + k].copy()
        if mismatch is not None:
            drafts[mismatch] = (drafts[mismatch] + 1 + rng.integers(v - 1)) % v
        n_acc = k if mismatch is None else mismatch
        draft_tokens += drafts.tolist()
        expected.append(argmax[row : row + n_acc + 1].tolist())
        row += k + 1
    draft_tokens = np.array(draft_tokens)

    draft_probs = None
    if draft_kind == "sampled":  # a full-support stochastic draft must not change the result
        draft_probs = rng.dirichlet(np.ones(v), size=t)
    accept_u, sample_u = {
        "random": (rng.random(t), rng.random(b)),
        "zero": (np.zeros(t), np.zeros(b)),
        "almost-one": (np.full(t, np.nextafter(1.0, 0.0)), np.full(b, np.nextafter(1.0, 0.0))),
    }[uniform_kind]

    num_accepted, tokens = sampling.rejection_sample(
        draft_tokens, num_draft, draft_probs, target_probs, accept_u, sample_u
    )
    assert num_accepted.tolist() == [len(e) - 1 for e in expected]
    assert split(num_accepted, tokens) == expected


# --- sampling: the emitted tokens follow the target distribution ------------------------------

V, K, PREV0, N_TRIALS = 6, 3, 0, 20_000


def resample_from_target(sampling) -> Sampler:
    """Broken: correct acceptance test, but a rejected draft is replaced by a fresh target sample
    instead of a residual sample, which over-weights tokens the draft already proposes."""

    def sampler(draft_tokens, num_draft, draft_probs, target_probs, accept_u, sample_u):
        num_accepted, tokens = sampling.rejection_sample(
            draft_tokens, num_draft, draft_probs, target_probs, accept_u, sample_u
        )
        rows = np.cumsum(num_draft) - num_draft + np.arange(num_draft.size) + num_accepted
        last = np.cumsum(num_accepted + 1) - 1
        rejected = num_accepted < num_draft
        fresh = sampling.sample_from_probs(target_probs[rows[rejected]], sample_u[rejected])
        tokens[last[rejected]] = fresh
        return num_accepted, tokens

    return sampler


def always_accept(sampling) -> Sampler:
    """Broken: accepts every draft, so tokens follow the draft's distribution."""

    def sampler(draft_tokens, num_draft, draft_probs, target_probs, accept_u, sample_u):
        last_rows = np.cumsum(num_draft + 1) - 1
        bonus = sampling.sample_from_probs(target_probs[last_rows], sample_u)
        return num_draft.copy(), np.insert(draft_tokens, np.cumsum(num_draft), bonus)

    return sampler


class TinyModel:
    """Bigram 'models': next-token distribution depends on the previous token only."""

    def __init__(self, seed: int, temperature: float, top_k: int, top_p: float, greedy_draft: bool):
        rng = np.random.default_rng(seed)
        target_logits = rng.normal(size=(V, V))
        draft_logits = target_logits + rng.normal(size=(V, V))  # correlated, but not equal
        self.p_t = probs_from_logits(target_logits, temperature, top_k, top_p)
        self.p_d = probs_from_logits(draft_logits, temperature, top_k, top_p)
        # A deterministic proposer (think n-gram table or greedy draft): draft_probs=None.
        self.next_greedy = self.p_d.argmax(axis=1) if greedy_draft else None

    def step(
        self, sampler: Sampler, prev: np.ndarray, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One speculative step for len(prev) requests with ragged k in 0..K; also returns where
        each request's tokens start."""
        n = prev.size
        num_draft = rng.integers(0, K + 1, size=n)
        chain = np.empty((n, K + 1), dtype=np.int64)
        chain[:, 0] = prev
        for j in range(K):  # draft positions, vectorised over requests
            if self.next_greedy is None:
                chain[:, j + 1] = sample_from_probs(self.p_d[chain[:, j]], rng.random(n))
            else:
                chain[:, j + 1] = self.next_greedy[chain[:, j]]
        is_draft = np.arange(K) < num_draft[:, None]
        draft_tokens = chain[:, 1:][is_draft]
        draft_probs = None if self.next_greedy is not None else self.p_d[chain[:, :-1][is_draft]]
        target_probs = self.p_t[chain[np.arange(K + 1) <= num_draft[:, None]]]
        num_accepted, tokens = sampler(
            draft_tokens,
            num_draft,
            draft_probs,
            target_probs,
            rng.random(draft_tokens.size),
            rng.random(n),
        )
        return num_accepted, tokens, np.cumsum(num_accepted + 1) - (num_accepted + 1)

    def first_two_tokens(self, sampler: Sampler, n: int, seed: int) -> np.ndarray:
        """[n, 2] first two generated tokens after PREV0, as an engine would produce them:
        requests that emitted a single token run a second speculative step from it."""
        rng = np.random.default_rng(seed)
        num_accepted, tokens, start = self.step(sampler, np.full(n, PREV0), rng)
        out = np.empty((n, 2), dtype=np.int64)
        out[:, 0] = tokens[start]
        more = num_accepted >= 1
        out[more, 1] = tokens[start[more] + 1]
        _, tokens2, start2 = self.step(sampler, out[~more, 0], rng)
        out[~more, 1] = tokens2[start2]
        return out

    def mismatch(self, sampler: Sampler, seed: int) -> tuple[bool, bool]:
        """Whether the first token, and the first-two-token pair, fail the chi-square test."""
        pairs = self.first_two_tokens(sampler, N_TRIALS, seed)
        first = np.bincount(pairs[:, 0], minlength=V)
        joint = np.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V)
        exact_joint = (self.p_t[PREV0][:, None] * self.p_t).ravel()
        return chi2_rejects(first, self.p_t[PREV0]), chi2_rejects(joint, exact_joint)


PROCESSING = {
    "plain": (1.0, 0, 1.0),
    "temp-topk-topp": (0.8, 4, 0.85),
}


@pytest.mark.parametrize("greedy_draft", [False, True], ids=["sampled-draft", "deterministic"])
@pytest.mark.parametrize("processing", list(PROCESSING))
def test_sampling_is_lossless(sampling, processing: str, greedy_draft: bool) -> None:
    model = TinyModel(4, *PROCESSING[processing], greedy_draft=greedy_draft)
    assert model.mismatch(sampling.rejection_sample, seed=5) == (False, False)


@pytest.mark.parametrize("broken", [resample_from_target, always_accept])
@pytest.mark.parametrize("greedy_draft", [False, True], ids=["sampled-draft", "deterministic"])
@pytest.mark.parametrize("processing", list(PROCESSING))
def test_check_detects_broken_acceptance(
    sampling, processing: str, greedy_draft: bool, broken: Callable[..., Sampler]
) -> None:
    model = TinyModel(4, *PROCESSING[processing], greedy_draft=greedy_draft)
    assert model.mismatch(broken(sampling), seed=5) == (True, True)
