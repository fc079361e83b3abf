"""Sampling losslessness: with speculation, the distribution of generated tokens equals the
target's own (checked against the exact distribution computed from the transformers model),
and a deliberately broken acceptance rule is caught by the same check."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import SMALL_VOCAB, TinyModel
from policies import RandomK
from sampling_oracle import probs_for
from stats import chi2_rejects
from tiny_models import perturbed_copy

from mlc_spec import LLM, SamplingParams
from mlc_spec.compiler.compile import compile_model
from mlc_spec.compiler.options import CompileOptions
from mlc_spec.runtime import draft_tree
from mlc_spec.runtime import engine as engine_module
from mlc_spec.runtime.sampler import DraftProbs, Sampler

V = SMALL_VOCAB
PROMPT = [3, 4, 5, 3, 4, 5, 3, 4]  # repeats, so prompt lookup proposes too
SAMPLES = 3000
PARAMS = {
    "temperature 1": dict(temperature=1.0),
    "top-k/top-p": dict(temperature=0.8, top_k=5, top_p=0.9),
}


@pytest.fixture(scope="module")
def pair(tiny_llama_v8, tmp_path_factory) -> tuple[TinyModel, TinyModel]:
    # Different enough that many drafts are rejected (the residual path matters).
    draft = TinyModel(
        tmp_path_factory.mktemp("v8_draft"), "llama", hf=perturbed_copy(tiny_llama_v8.hf, 0.15)
    )
    return tiny_llama_v8, draft


@torch.no_grad()
def exact_joint(hf: torch.nn.Module, params: SamplingParams) -> np.ndarray:
    """P(t1, t2, t3 | PROMPT) under target-only sampling with ``params``, shape [V, V, V]."""

    def next_probs(prefixes: list[list[int]]) -> np.ndarray:
        logits = hf(torch.tensor(prefixes)).logits[:, -1].numpy()
        return probs_for(logits, [params] * len(prefixes))

    p1 = next_probs([PROMPT])[0]
    p2 = next_probs([PROMPT + [a] for a in range(V)])
    p3 = next_probs([PROMPT + [a, b] for a, b in itertools.product(range(V), repeat=2)])
    return p1[:, None, None] * p2[:, :, None] * p3.reshape(V, V, V)


def sample_counts(llm: LLM, params: dict, num_speculative_tokens: list | None = None) -> np.ndarray:
    """Counts of the 3-token continuations of ``SAMPLES`` seeded samples; request i sets
    ``num_speculative_tokens[i]`` when given."""
    per_request = 60
    num_requests = SAMPLES // per_request
    ks = num_speculative_tokens or [None] * num_requests
    requests = [
        SamplingParams(
            max_tokens=3,
            ignore_eos=True,
            n=per_request,
            seed=seed,
            num_speculative_tokens=ks[seed],
            **params,
        )
        for seed in range(num_requests)
    ]
    counts = np.zeros((V, V, V), dtype=np.int64)
    for out in llm.generate([PROMPT] * len(requests), requests):
        for sample in out.outputs:
            counts[tuple(sample.token_ids)] += 1
    return counts


def _llm(pair, method: str) -> LLM:
    target, draft = pair
    spec = {"method": method, "num_speculative_tokens": 2}
    return LLM(
        target.artifact,
        draft_model=draft.artifact if method == "draft" else None,
        speculative=spec,
        max_batch_size=64,
    )


# Suffix drafts also come from earlier samples' outputs (the shared cache): still point masses.
@pytest.mark.parametrize("method", ["draft", "ngram", "suffix"])
@pytest.mark.parametrize("name", list(PARAMS))
def test_speculative_sampling_matches_target_distribution(pair, method, name):
    llm = _llm(pair, method)
    counts = sample_counts(llm, PARAMS[name])
    joint = exact_joint(pair[0].hf, SamplingParams(**PARAMS[name]))
    assert not chi2_rejects(counts.ravel(), joint.ravel())
    stats = llm.metrics()
    assert 0.05 < stats["acceptance_rate"] < 0.95, stats  # both accept and reject happened


def test_sampling_is_exact_with_both_proposers_in_one_step(pair, monkeypatch):
    """Method auto with each sequence's proposer and k drawn at random per step: a verify pass
    holds the draft model's sampled drafts and suffix decoding's point masses side by side,
    each sequence accepted by its own rule, and the joint law is the target's. A merge that
    hands the point masses a distribution of the draft model's (its first row) is caught."""
    target, draft = pair
    joint = exact_joint(target.hf, SamplingParams(**PARAMS["temperature 1"]))

    def counts() -> tuple[np.ndarray, dict]:
        llm = LLM(
            target.artifact,
            draft_model=draft.artifact,
            speculative={"method": "auto"},
            max_batch_size=64,
        )
        llm.engine.scheduler.policy = RandomK(seed=5)
        found = sample_counts(llm, PARAMS["temperature 1"])
        return found, llm.metrics()["speculation"]["drafting_sequence_steps_by_method"]

    found, by_method = counts()
    assert by_method["draft"] > 0 and by_method["suffix"] > 0, by_method
    assert not chi2_rejects(found.ravel(), joint.ravel())

    def misattributed(self, target_probs, drafts, draft_probs, *uniforms):
        rows = [
            np.zeros(len(d), np.int64) if r is None else r
            for d, r in zip(drafts, draft_probs.rows, strict=True)
        ]
        return self.verify_probs(
            target_probs, drafts, DraftProbs(draft_probs.data, rows), *uniforms
        )

    monkeypatch.setattr(Sampler, "_verify_mixed", misattributed)
    assert chi2_rejects(counts()[0].ravel(), joint.ravel())


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_sampling_is_exact_under_random_k(pair, method):
    """k drawn at random per step and sequence (automatic requests), or fixed per request (off,
    1 or 2): the joint law is still the target's."""
    target, draft = pair
    llm = LLM(
        target.artifact,
        draft_model=draft.artifact if method == "draft" else None,
        speculative={"method": method, "num_speculative_tokens": "auto"},
        max_batch_size=64,
    )
    llm.engine.scheduler.policy = RandomK(seed=2)
    rng = np.random.default_rng(4)
    ks = [[None, 0, 1, 2][i] for i in rng.integers(0, 4, SAMPLES // 60)]
    counts = sample_counts(llm, PARAMS["temperature 1"], ks)
    joint = exact_joint(pair[0].hf, SamplingParams(**PARAMS["temperature 1"]))
    assert not chi2_rejects(counts.ravel(), joint.ravel())
    chosen = llm.metrics()["speculation"]["sequence_steps_by_k"]
    assert chosen[0] > 0 and chosen[1] > 0  # both paths, mixed within steps
    assert 0.05 < llm.metrics()["acceptance_rate"] < 0.95


def test_a_draft_scoring_only_some_ids_keeps_the_target_distribution(pair, tmp_path_factory):
    """``--lm-head-vocab 5`` of 8: the draft never proposes ids 5-7, so wherever the target
    samples one of them, the residual alone must supply it."""
    target, draft = pair
    root = tmp_path_factory.mktemp("v8_draft_5_ids")
    trimmed = compile_model(
        draft.checkpoint,
        "llvm",
        root / "artifact",
        CompileOptions(lm_head_vocab=5),
        show_progress=False,
    )
    llm = _llm((target, SimpleNamespace(artifact=trimmed)), "draft")
    counts = sample_counts(llm, PARAMS["temperature 1"])
    joint = exact_joint(target.hf, SamplingParams(**PARAMS["temperature 1"]))
    assert not chi2_rejects(counts.ravel(), joint.ravel())
    assert 0.05 < llm.metrics()["acceptance_rate"] < 0.95


def _tree_llm(pair) -> LLM:
    target, draft = pair
    spec = {"method": "draft", "num_speculative_tokens": 2, "max_speculative_tokens": 2}
    spec["draft_tree_width"] = 3
    return LLM(target.artifact, draft_model=draft.artifact, speculative=spec, max_batch_size=64)


@pytest.mark.parametrize("name", list(PARAMS))
def test_draft_tree_sampling_matches_target_distribution(pair, name):
    """Three children per node, chosen by the draft, accepted by sequential point-mass
    rejection down the tree: the joint law of three tokens is the target's."""
    llm = _tree_llm(pair)
    counts = sample_counts(llm, PARAMS[name])
    joint = exact_joint(pair[0].hf, SamplingParams(**PARAMS[name]))
    assert not chi2_rejects(counts.ravel(), joint.ravel())
    stats = llm.metrics()
    assert 0.05 < stats["acceptance_rate"] < 0.95, stats


def test_broken_tree_rule_is_detected(pair, monkeypatch):
    """A broken multi-draft rule: a rejected child keeps its mass for the next children and for
    the final draw (no residual), so the draft's choices are over-represented."""

    def no_residual(tokens, parents, probs, uniform):
        kids = draft_tree.children(parents)
        node, path = 0, []
        while True:
            p = np.asarray(probs(node), dtype=np.float64)
            chosen = next((c for c in kids[node] if uniform() < p[tokens[c]]), None)
            if chosen is None:
                cdf = np.cumsum(p)
                token = min(int(np.searchsorted(cdf, uniform() * cdf[-1], side="right")), V - 1)
                return draft_tree.Walk(path, [tokens[n] for n in path] + [token])
            path.append(chosen)
            node = chosen

    monkeypatch.setattr(engine_module, "sampled_walk", no_residual)
    counts = sample_counts(_tree_llm(pair), PARAMS["temperature 1"])
    joint = exact_joint(pair[0].hf, SamplingParams(**PARAMS["temperature 1"]))
    assert chi2_rejects(counts.ravel(), joint.ravel())


def test_target_only_sampling_matches_exact_distribution(pair):
    counts = sample_counts(LLM(pair[0].artifact, max_batch_size=64), PARAMS["temperature 1"])
    joint = exact_joint(pair[0].hf, SamplingParams(**PARAMS["temperature 1"]))
    assert not chi2_rejects(counts.ravel(), joint.ravel())


def test_broken_acceptance_rule_is_detected(pair, monkeypatch):
    """A broken rule: the compiled verification fed zero acceptance uniforms keeps every draft
    the target gives any probability, so the tokens follow the draft instead."""
    verify_probs = Sampler.verify_probs

    def accept_all(self, target_probs, drafts, draft_probs, accept_u, sample_u):
        return verify_probs(self, target_probs, drafts, draft_probs, 0 * accept_u, sample_u)

    monkeypatch.setattr(Sampler, "verify_probs", accept_all)
    counts = sample_counts(_llm(pair, "draft"), PARAMS["temperature 1"])
    joint = exact_joint(pair[0].hf, SamplingParams(**PARAMS["temperature 1"]))
    assert chi2_rejects(counts.ravel(), joint.ravel())
