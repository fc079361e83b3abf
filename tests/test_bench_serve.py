"""``mlc-spec bench serve`` end to end on the tiny model: both prompt sources, one server per
speculation setting, every request accounted for, and the JSON, table and plot written."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from served import serving

from mlc_spec import LLM
from mlc_spec.cli import main
from mlc_spec.serve.bench import (
    Job,
    humaneval_jobs,
    launched_server,
    mixed_jobs,
    run_level,
    send,
    sharegpt_jobs,
    summarize,
)


def test_prompt_sources():
    assert len(humaneval_jobs()) == 164
    jobs = sharegpt_jobs(5)
    assert len(jobs) == 5 and all(j.endpoint == "chat/completions" for j in jobs)
    assert all(j.payload["messages"][0]["content"] for j in jobs)


def test_bench_serve_refuses_unknown_settings(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--speculative", "ngram:many"])
    assert "ngram:many" in capsys.readouterr().err


def test_bench_serve_sweep(tiny_llama, tmp_path):
    argv = ["bench", "serve", "--model", str(tiny_llama.artifact), "--concurrency", "1", "3"]
    argv += ["--max-tokens", "4", "--min-requests", "3", "--rounds", "1"]
    argv += ["--speculative", "none", "ngram", "ngram:auto"]
    assert main([*argv, "--output-dir", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert list(results["settings"]) == ["off", "ngram k=4", "ngram k=auto"]
    for rows in results["settings"].values():
        assert [r["concurrency"] for r in rows] == [1, 3]
        assert all(r["completed"] == r["requests"] == 3 for r in rows), rows
        assert all(r["p50_ttft"] > 0 and r["output_throughput"] > 0 for r in rows)
    assert results["settings"]["off"][0]["acceptance_rate"] is None
    assert "| off | 1 | 3/3 |" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "serve_bench.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_serve_loads_a_running_server(tiny_llama, tmp_path):
    """``--base-url``: any OpenAI-compatible server, here ours started apart, under its name."""
    with serving(LLM(tiny_llama.artifact)) as served:
        argv = ["bench", "serve", "--base-url", f"{served.url}/v1", "--served-model", "tiny"]
        argv += ["--label", "elsewhere", "--concurrency", "2", "--max-tokens", "3"]
        argv += ["--min-requests", "4", "--output-dir", str(tmp_path)]
        assert main(argv) == 0
    (row,) = json.loads((tmp_path / "results.json").read_text())["settings"]["elsewhere"]
    assert row["completed"] == row["requests"] == 4 and row["output_throughput"] > 0


def test_poisson_arrivals(tiny_llama):
    serve_args = ["--model", str(tiny_llama.artifact), "--served-model-name", "bench"]
    body = {"model": "bench", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    with launched_server([*serve_args, "--speculative", "none"]) as base:
        jobs = mixed_jobs("mixed", 6)
        outcomes, seconds = asyncio.run(run_level(base, jobs, body, 2, 20.0, seed=0))
    row = summarize(2, outcomes, seconds)
    assert row["completed"] == 6 and row["failed"] == 0, row["errors"]
    assert {j.endpoint for j in jobs} == {"completions", "chat/completions"}


def test_a_connection_closed_while_idle_is_retried_once():
    """A kept-alive connection the server closed (llama-server does) fails before any answer:
    sent again, not counted as a failure; a server that keeps doing it is one."""
    events = [
        'data: {"choices": [{"index": 0, "text": "hi"}]}',
        'data: {"choices": [], "usage": {"completion_tokens": 1}}',
        "data: [DONE]",
    ]
    ok = httpx.Response(200, text="\n\n".join(events) + "\n\n")

    def outcome(stale_answers: int):
        answers = iter([*[None] * stale_answers, ok])

        def handler(request: httpx.Request) -> httpx.Response:
            answer = next(answers)
            if answer is None:
                raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
            return answer

        async def one():
            async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
                return await send(client, "http://x/v1", Job("completions", {"prompt": "p"}), {})

        return asyncio.run(one())

    assert outcome(0).ok and outcome(1).ok and outcome(1).output_tokens == 1
    twice = outcome(2)
    assert not twice.ok and "RemoteProtocolError" in twice.error
