"""``mlc-spec serve --replicas 2``: two servers behind sglang-router on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
from pathlib import Path

import httpx
import openai
import pytest
from served import GREEDY, ServeProcess, metrics

from mlc_spec import LLM, SamplingParams
from mlc_spec.cli import main


class Replicas:
    """``mlc-spec serve --replicas 2`` as a user starts it, with its replicas' URLs and PIDs."""

    def __init__(self, artifact, *args: str):
        # As a user's shell has it: not the test workers' TVM_BIND_THREADS (conftest.py)
        self.served = ServeProcess(
            artifact,
            "--replicas",
            "2",
            "--threads-per-replica",
            "1",
            *args,
            env={"TVM_BIND_THREADS": None},
        )
        self.url = self.served.url
        self.workers = re.findall(r"http://127\.0\.0\.1:\d+", self.served.announced)[:2]

    def replica_pids(self) -> list[int]:
        """The replicas' processes: the children of the command running ``mlc_spec.cli``."""
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError):
                ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
                cmdline = (stat.parent / "cmdline").read_bytes()
                if ppid == self.served.process.pid and b"mlc_spec.cli" in cmdline:
                    pids.append(int(stat.parent.name))
        return pids

    def __enter__(self) -> Replicas:
        return self

    def __exit__(self, *exc) -> None:
        """SIGTERM: the router and the replicas stop, the command exits 0, none is left."""
        pids = self.replica_pids()
        self.served.process.send_signal(signal.SIGTERM)
        code, log = self.served.finish(timeout=90)
        assert code == 0, log
        assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()]


def _expected(tiny_llama, prompt: str, max_tokens: int) -> str:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return LLM(tiny_llama.artifact).generate(prompt, params)[0].outputs[0].text


async def _stream(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> str:
    stream = await client.completions.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, stream=True, **GREEDY
    )
    return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])


def test_64_streams_through_the_router_and_a_shared_prefix_sticks(tiny_llama):
    with Replicas(tiny_llama.artifact) as replicas:
        _serve_64_streams_and_a_shared_prefix(replicas, tiny_llama)


def _serve_64_streams_and_a_shared_prefix(replicas: Replicas, tiny_llama) -> None:
    assert len(replicas.workers) == 2 and len(replicas.replica_pids()) == 2
    client = openai.AsyncOpenAI(base_url=f"{replicas.url}/v1", api_key="-", timeout=120)
    prompts = [" ".join(f"w{(7 * i + j) % 90 + 5}" for j in range(6)) for i in range(64)]

    async def run() -> list[str]:
        return await asyncio.gather(*(_stream(client, p, 8) for p in prompts))

    answers = asyncio.run(run())
    expected = {p: _expected(tiny_llama, p, 8) for p in set(prompts)}
    assert answers == [expected[p] for p in prompts]
    # Four requests sharing a 64-token prefix: the cache-aware router sends them to one
    # replica, whose prefix cache then finds the prefix's pages.
    prefix = " ".join(f"w{10 + j % 80}" for j in range(64))
    sync = openai.OpenAI(base_url=f"{replicas.url}/v1", api_key="-")
    for tail in ("w5", "w6", "w7", "w8"):
        sync.completions.create(model="tiny", prompt=f"{prefix} {tail}", max_tokens=2)
    hits = [metrics(w)["mlc_spec:prefix_cache_hits_total"] for w in replicas.workers]
    assert max(hits) >= 3 * 64 and min(hits) < 64, hits
    # One thread each, and still free to run on any core: TVM pins a pool of one to core 0
    # (both replicas on one core of a 2-core machine) unless told not to.
    for pid in replicas.replica_pids():
        for task in Path(f"/proc/{pid}/task").iterdir():
            assert os.sched_getaffinity(int(task.name)) == os.sched_getaffinity(0), task


def test_a_killed_replica_fails_its_streams_cleanly_and_the_other_serves(tiny_llama):
    """Round robin spreads 8 streams over both replicas; one is killed while they run. Its
    streams end with an error, none hangs, the others finish whole, and the requests after all
    go to the replica left."""
    with Replicas(tiny_llama.artifact, "--router-policy", "round_robin") as replicas:
        _kill_one(replicas, tiny_llama)


def _kill_one(replicas: Replicas, tiny_llama) -> None:
    client = openai.AsyncOpenAI(base_url=f"{replicas.url}/v1", api_key="-", timeout=60)
    prompts = [f"w{5 + i} w{9 + i} w{14 + i}" for i in range(8)]

    async def run() -> tuple[list, list[str]]:
        started = asyncio.Semaphore(0)

        async def one(prompt: str) -> str:
            stream = await client.completions.create(
                model="tiny", prompt=prompt, max_tokens=1000, stream=True, **GREEDY
            )
            text = ""
            async for chunk in stream:
                if not text:
                    started.release()
                text += chunk.choices[0].text if chunk.choices else ""
            return text

        tasks = [asyncio.create_task(one(p)) for p in prompts]
        for _ in prompts:  # every stream has its first token: all are running
            await started.acquire()
        os.kill(replicas.replica_pids()[0], signal.SIGKILL)
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        return outcomes, await asyncio.gather(*(_stream(client, p, 8) for p in prompts))

    outcomes, after = asyncio.run(asyncio.wait_for(run(), timeout=120))
    failed = [o for o in outcomes if isinstance(o, Exception)]
    assert 0 < len(failed) < len(outcomes), outcomes
    assert all(isinstance(o, openai.APIError | httpx.HTTPError) for o in failed), failed
    for prompt, outcome in zip(prompts, outcomes, strict=True):
        if not isinstance(outcome, Exception):
            assert outcome == _expected(tiny_llama, prompt, 1000)
    assert after == [_expected(tiny_llama, p, 8) for p in prompts]


def test_replicas_must_be_at_least_one(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--replicas", "0"])
    assert "expected a whole number >= 1, got '0'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("cores", "argv", "flag"),
    [
        (2, ["--replicas", "2"], "--no-async-scheduling"),  # 2 x 1 thread: no core left over
        (2, ["--replicas", "2", "--threads-per-replica", "2"], "--no-async-scheduling"),
        (4, ["--replicas", "3", "--threads-per-replica", "1"], "--async-scheduling"),
        (2, ["--replicas", "2", "--async-scheduling"], "--async-scheduling"),  # as asked
    ],
)
def test_replicas_overlap_host_work_only_where_their_threads_leave_a_core(
    monkeypatch, cores, argv, flag
):
    from mlc_spec.serve import app, replicas

    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(cores)))
    started = []
    monkeypatch.setattr(replicas, "serve_replicas", lambda own, *rest: started.append(own))
    assert main(["serve", *argv]) == 0
    (own,) = started
    assert [a for a in own if "async-scheduling" in a] == [flag]
    assert app.overlaps_host_work(cores - 1) and not app.overlaps_host_work(cores)
