"""Soak ``mlc-spec serve`` as users run it: minutes of mixed load at concurrency 64, then SIGTERM.

The server is the CLI's default (SmolLM2, n-gram speculation), in its own process. Load comes in
waves through the ``openai`` client: streaming and whole responses, chat and completions, greedy
and seeded sampling; 10% of the clients leave at a random point and 5% send bad input. After each
wave the server must be idle: no request running or waiting, no KV page held. Judged:

- nothing lost (every request completes, or gets the error its input deserves), nothing garbled
  (every greedy answer equals the one the same request got alone before the soak: speculation and
  batching are lossless), no 5xx;
- the server's RSS flat within 5% from minute 2 to the end;
- greedy output identical before and after;
- SIGTERM during a last wave of long streams: each ends whole or with an error event, and the
  process exits 0 within the shutdown timeout.

    python scripts/soak_serve.py [--minutes 10] [--write docs/benchmarks-features.md]

Writes its section into the page, the RSS curve into docs/soak_rss.png; exits 1 on a failure.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import openai
from benchdoc import cpu_class, machine_context, start_load, write_section
from prometheus_client.parser import text_string_to_metric_families
from workloads import humaneval_prompts, sharegpt_turns

from mlc_spec.serve.launch import start_server

CONCURRENCY = 64
WAVE_SECONDS = 45
FLAT_RSS = 0.05  # RSS may move this much from minute 2 to the end
SHUTDOWN_TIMEOUT = 30
# Bodies a server must refuse, and how: (path, raw JSON body, status).
BAD_INPUT = (
    ("/v1/completions", '{"model": "M", "prompt": "hi", "max_tokens": -3}', 400),
    ("/v1/completions", '{"model": "M", "prompt": "hi", "temperature": NaN}', 400),
    ("/v1/completions", '{"model": "M", "prompt": "a\\ud800b"}', 400),
    ("/v1/completions", '{"model": "M", "prompt": "hi", "seed": 18446744073709551616}', 400),
    ("/v1/chat/completions", '{"model": "M", "messages": []}', 400),
    ("/v1/completions", '{"model": "gpt-4", "prompt": "hi"}', 404),
    ("/v1/completions", '{"model": "M", "prompt": "hi",', 400),
)


@dataclasses.dataclass(frozen=True)
class Ask:
    """One request of the pool: chat or completion, its text and its token budget."""

    chat: bool
    text: str
    max_tokens: int

    def args(self, model: str) -> dict:
        body = {"model": model, "max_tokens": self.max_tokens}
        if self.chat:
            return body | {"messages": [{"role": "user", "content": self.text}]}
        return body | {"prompt": self.text}


class Server:
    """``mlc-spec serve`` with its defaults, on a free port."""

    def __init__(self):
        serve_args = ["--served-model-name", "M", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT)]
        self.process, self.url, _ = start_server(serve_args, stderr=subprocess.PIPE)  # .../v1
        self.root = self.url.removesuffix("/v1")

    def rss_mib(self) -> float:
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return (
            next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS"))
            / 1024
        )

    def load(self) -> dict[str, float]:
        """The server's gauges by name, without the ``mlc_spec:`` prefix."""
        text = httpx.get(f"{self.root}/metrics").text
        return {
            family.name.removeprefix("mlc_spec:"): family.samples[0].value
            for family in text_string_to_metric_families(text)
            if family.type == "gauge"
        }


@dataclasses.dataclass
class Tally:
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    problems: list[str] = dataclasses.field(default_factory=list)
    latency: list[float] = dataclasses.field(default_factory=list)  # whole requests, seconds
    first_token: list[float] = dataclasses.field(default_factory=list)  # streams, seconds

    def count(self, outcome: str) -> None:
        self.counts[outcome] = self.counts.get(outcome, 0) + 1

    def problem(self, outcome: str, detail: str) -> None:
        self.count(outcome)
        if len(self.problems) < 20:
            self.problems.append(f"{outcome}: {detail}")


async def _answer(
    client: openai.AsyncOpenAI, ask: Ask, stream: bool, leave_after: int | None, **sampling
) -> tuple[str, str | None, float | None]:
    """Text, finish reason and time to first token (streams); ``leave_after`` chunks, then
    close the stream (a client that leaves)."""
    create = client.chat.completions.create if ask.chat else client.completions.create
    if not stream:
        out = await create(**ask.args("M"), **sampling)
        choice = out.choices[0]
        return (choice.message.content if ask.chat else choice.text), choice.finish_reason, None
    start, first, parts, finish = time.perf_counter(), None, [], None
    chunks = await create(**ask.args("M"), stream=True, **sampling)
    async for chunk in chunks:
        first = first or time.perf_counter() - start
        if chunk.choices:
            choice = chunk.choices[0]
            parts.append((choice.delta.content if ask.chat else choice.text) or "")
            finish = choice.finish_reason or finish
        if leave_after is not None and len(parts) >= leave_after:
            await chunks.close()
            break
    return "".join(parts), finish, first


async def _one(client, http, asks, expected, rng: random.Random, tally: Tally) -> None:
    """One request of the mix, judged."""
    roll = rng.random()
    if roll < 0.05:
        path, body, status = rng.choice(BAD_INPUT)
        response = await http.post(path, content=body, headers={"Content-Type": "application/json"})
        if response.status_code == status and "error" in response.json():
            tally.count("bad input refused")
        else:
            tally.problem("lost", f"{body} -> {response.status_code} {response.text[:200]}")
        return
    ask = rng.choice(asks)
    stream = rng.random() < 0.5
    greedy = rng.random() < 0.8
    sampling = (
        {"temperature": 0} if greedy else {"temperature": 0.8, "seed": rng.randrange(1 << 31)}
    )
    start = time.perf_counter()
    try:
        if roll < 0.15:  # leaves: a stream after some chunks, a whole response after a while
            if stream:
                await _answer(client, ask, True, rng.randrange(1, 12), **sampling)
            else:
                await asyncio.wait_for(
                    _answer(client, ask, False, None, **sampling), rng.uniform(0.05, 2.0)
                )
            return tally.count("left early")
        text, finish, first = await _answer(client, ask, stream, None, **sampling)
    except TimeoutError:
        return tally.count("left early")
    except openai.APIStatusError as err:
        kind = "5xx" if err.status_code >= 500 else "lost"
        return tally.problem(kind, f"{err.status_code} {err.message[:200]}")
    except (openai.APIError, httpx.HTTPError) as err:
        return tally.problem("lost", f"{type(err).__name__}: {err}"[:300])
    tally.latency.append(time.perf_counter() - start)
    if first is not None:
        tally.first_token.append(first)
    if finish not in ("length", "stop"):
        return tally.problem("garbled", f"finish_reason {finish!r}")
    if greedy and text != expected[ask]:
        return tally.problem(
            "garbled", f"{ask.text[:40]!r}: {text[:80]!r} != {expected[ask][:80]!r}"
        )
    tally.count(f"{'greedy' if greedy else 'sampled'} {'stream' if stream else 'whole'}")


async def _wave(server: Server, asks, expected, seconds: float, seed: int, tally: Tally) -> None:
    client = openai.AsyncOpenAI(base_url=server.url, api_key="-", max_retries=0, timeout=300)
    async with httpx.AsyncClient(base_url=server.root, timeout=60) as http:
        end = time.monotonic() + seconds

        async def worker(i: int) -> None:
            rng = random.Random(seed * 1000 + i)
            while time.monotonic() < end:
                await _one(client, http, asks, expected, rng, tally)

        await asyncio.gather(*(worker(i) for i in range(CONCURRENCY)))
    await client.close()


def _greedy(server: Server, asks: list[Ask]) -> dict[Ask, str]:
    """Each request alone, one after another: the reference answers."""

    async def one_by_one() -> dict[Ask, str]:
        client = openai.AsyncOpenAI(base_url=server.url, api_key="-", max_retries=0, timeout=120)
        answers = {ask: (await _answer(client, ask, False, None, temperature=0))[0] for ask in asks}
        await client.close()
        return answers

    return asyncio.run(one_by_one())


async def _shutdown_wave(server: Server, asks: list[Ask], tally: Tally) -> tuple[int, float]:
    """Long streams at full concurrency, SIGTERM two seconds in; (exit code, seconds to exit)."""
    client = openai.AsyncOpenAI(base_url=server.url, api_key="-", max_retries=0, timeout=300)

    async def stream(i: int) -> None:
        ask = dataclasses.replace(asks[i % len(asks)], max_tokens=256)
        try:
            _, finish, _ = await _answer(client, ask, True, None, temperature=0)
        except openai.APIError as err:
            if "shutting down" in str(err):
                tally.count("ended by shutdown")
            else:
                tally.problem("lost", str(err)[:300])
            return
        if finish:
            tally.count("finished before shutdown")
        else:
            tally.problem("garbled", "a stream ended without a finish reason or an error")

    tasks = [asyncio.create_task(stream(i)) for i in range(CONCURRENCY)]
    await asyncio.sleep(2)
    server.process.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    await asyncio.gather(*tasks)
    code = await asyncio.to_thread(server.process.wait, SHUTDOWN_TIMEOUT + 15)
    return code, time.monotonic() - signalled


@dataclasses.dataclass
class Result:
    tally: Tally
    rss: list[tuple[float, float]]  # (seconds since start, MiB)
    waves_idle: list[bool]
    same_after: bool
    exit_code: int
    exit_seconds: float

    def rss_drift(self) -> float:
        """Largest move of RSS from its value at minute 2, as a share of it."""
        later = [mib for t, mib in self.rss if t >= 120]
        return max(abs(m - later[0]) for m in later) / later[0] if later else float("nan")

    def failures(self) -> list[str]:
        c = self.tally.counts
        out = [f"{c[k]} {k}" for k in ("lost", "garbled", "5xx") if c.get(k)]
        if not all(self.waves_idle):
            out.append(f"not idle after {self.waves_idle.count(False)} waves")
        if not self.rss_drift() <= FLAT_RSS:
            out.append(f"RSS moved {self.rss_drift():.1%} after minute 2")
        if not self.same_after:
            out.append("greedy output changed")
        if self.exit_code != 0 or self.exit_seconds > SHUTDOWN_TIMEOUT + 5:
            out.append(f"exit {self.exit_code} after {self.exit_seconds:.1f} s")
        return out + self.tally.problems


def soak(minutes: float) -> Result:
    asks = [Ask(True, text, 48) for text in sharegpt_turns(8)]
    asks += [Ask(False, text, 64) for text in humaneval_prompts(4)]
    server = Server()
    try:
        expected = _greedy(server, asks)
        tally, rss, idle, start = Tally(), [], [], time.monotonic()

        async def sample_rss() -> None:
            while True:
                rss.append((time.monotonic() - start, server.rss_mib()))
                await asyncio.sleep(5)

        async def run() -> None:
            sampler = asyncio.create_task(sample_rss())
            wave = 0
            while time.monotonic() - start < minutes * 60:
                left = minutes * 60 - (time.monotonic() - start)
                await _wave(server, asks, expected, min(WAVE_SECONDS, left), wave, tally)
                idle.append(await _idle(server))
                wave += 1
            sampler.cancel()

        asyncio.run(run())
        same_after = _greedy(server, asks) == expected
        code, seconds = asyncio.run(_shutdown_wave(server, asks, tally))
        return Result(tally, rss, idle, same_after, code, seconds)
    finally:
        if server.process.poll() is None:
            server.process.kill()


async def _idle(server: Server) -> bool:
    """Whether the server lets go of every request and page within 30 s of a wave."""
    for _ in range(300):
        load = await asyncio.to_thread(server.load)
        if (
            load["num_requests_running"]
            == load["num_requests_waiting"]
            == 0
            == load["kv_cache_usage_perc"]
        ):
            return True
        await asyncio.sleep(0.1)
    return False


def _plot(result: Result, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t, mib = zip(*result.rss, strict=True)
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.plot(np.array(t) / 60, mib)
    ax.axvline(2, color="grey", linestyle=":")
    ax.set_xlabel("minutes")
    ax.set_ylabel("server RSS (MiB)")
    ax.set_title(f"mlc-spec serve, SmolLM2, concurrency {CONCURRENCY}: RSS under the soak")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _section(result: Result, load, minutes: float) -> str:
    c = result.tally.counts
    total = sum(c.values())
    lat, ttft = np.array(result.tally.latency), np.array(result.tally.first_token)
    rows = "\n".join(f"| {k} | {v} |" for k, v in sorted(c.items()))
    failures = result.failures()
    lines = [
        *machine_context(
            load,
            f"openai {openai.__version__}, httpx {httpx.__version__}",
            "TVM_NUM_THREADS=" + os.environ.get("TVM_NUM_THREADS", "unset"),
        ),
        "",
        f"{minutes:g} minutes at concurrency {CONCURRENCY}, `mlc-spec serve` with its defaults, "
        f"{len(result.waves_idle)} waves of {WAVE_SECONDS} s, then SIGTERM during {CONCURRENCY} "
        f"streams of 256 tokens. {total} requests:",
        "",
        "| outcome | requests |",
        "|---|---:|",
        rows,
        "",
        f"- Latency of whole requests (e2e, both kinds): p50 {np.median(lat):.2f} s, p99 "
        f"{np.percentile(lat, 99):.2f} s; time to first token of streams: p50 "
        f"{np.median(ttft):.2f} s, p99 {np.percentile(ttft, 99):.2f} s",
        f"- Idle after every wave (no request running or waiting, no KV page held): "
        f"{result.waves_idle.count(True)}/{len(result.waves_idle)}",
        f"- Server RSS: {result.rss[0][1]:.0f} MiB at the start, largest move after minute 2 "
        f"{result.rss_drift():.1%} (bound {FLAT_RSS:.0%}); curve: `docs/soak_rss.png`",
        f"- Greedy answers after the soak equal those before it: {result.same_after}",
        f"- SIGTERM: exit code {result.exit_code} after {result.exit_seconds:.1f} s "
        f"(--shutdown-timeout {SHUTDOWN_TIMEOUT})",
        f"- Verdict: {'**passed**' if not failures else '**failed**: ' + '; '.join(failures)}",
        "",
        "![server RSS during the soak](soak_rss.png)",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--write", type=Path, help="the benchmarks page to write the report into")
    args = parser.parse_args()
    load = start_load()
    result = soak(args.minutes)
    print(json.dumps({"counts": result.tally.counts, "failures": result.failures()}, indent=1))
    if args.write:
        _plot(result, args.write.parent / "soak_rss.png")
        write_section(args.write, f"soak_serve-{cpu_class()}", _section(result, load, args.minutes))
    sys.exit(1 if result.failures() else 0)


if __name__ == "__main__":
    main()
