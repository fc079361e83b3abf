"""``mlc-spec bench serve`` end to end on the tiny model: both prompt sources, one server per
speculation setting, every request accounted for, and the JSON, table and plot written."""

from __future__ import annotations

import argparse
import asyncio
import json
import stat

import httpx
import numpy as np
import pytest
from served import serving

from mlc_spec import LLM
from mlc_spec.cli import main
from mlc_spec.errors import UserError
from mlc_spec.serve import bench
from mlc_spec.serve.bench import (
    Job,
    add_arguments,
    humaneval_jobs,
    launched_llama_server,
    llama_server_binary,
    llama_server_command,
    load_order,
    mixed_jobs,
    run_level,
    send,
    sharegpt_chat_jobs,
    sharegpt_jobs,
    summarize,
)
from mlc_spec.serve.launch import launched_server


def test_prompt_sources():
    assert len(humaneval_jobs()) == 164
    jobs = sharegpt_jobs(5)
    assert len(jobs) == 5 and all(j.endpoint == "chat/completions" for j in jobs)
    assert all(j.payload["messages"][0]["content"] for j in jobs)
    chats = sharegpt_chat_jobs(5, max_turns=3)
    assert len(chats) == 5 and all(2 <= len(j.turns) <= 3 and all(j.turns) for j in chats)


def test_edits_are_sent_twice_and_each_level_gets_jobs_of_its_own():
    edits = [j.payload["messages"][0]["content"] for j in mixed_jobs("editing", 5, start=3)]
    assert edits[3:] == edits[:2] and len(set(edits)) == 3  # firsts, then their copies
    assert "def " in edits[0] and "type hints" in edits[0]
    later = [j.payload["messages"][0]["content"] for j in mixed_jobs("editing", 4, start=8)]
    assert not set(later) & set(edits)
    code = [j.payload["prompt"] for j in mixed_jobs("humaneval", 3, start=2)]
    assert code == [j.payload["prompt"] for j in humaneval_jobs()[2:5]]


def test_bench_serve_refuses_unknown_settings(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--speculative", "ngram:many"])
    assert "ngram:many" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--repeats", "0"])
    assert "expected a whole number >= 1, got '0'" in capsys.readouterr().err


def test_each_replica_count_is_a_server_of_its_own(monkeypatch):
    """``--replicas 1 2 --threads-per-replica 1``: one plain server with one thread, and one
    command starting two one-thread replicas behind the router, per setting."""
    started = []
    monkeypatch.setattr(bench, "launched_server", lambda cmd, env: started.append((cmd, env)))
    cli = argparse.ArgumentParser()
    add_arguments(cli)
    args = cli.parse_args(["--speculative", "none", "--replicas", "1", "2"])
    args.threads_per_replica = 1
    labels = [label for label, _ in bench.servers(args)]
    assert labels == ["off, 1 replica x 1 thread", "off, 2 replicas x 1 thread"]
    (one, env), (two, no_env) = started
    assert "--replicas" not in one and env["TVM_NUM_THREADS"] == "1"
    assert two[-4:] == ["--replicas", "2", "--threads-per-replica", "1"] and no_env is None


def test_each_step_mode_is_a_server_of_its_own(monkeypatch):
    """``--async-scheduling both``: per setting, one server with async steps and one without;
    by default the server chooses (no flag passed)."""
    started = []
    monkeypatch.setattr(bench, "launched_server", lambda cmd, env: started.append(cmd))
    cli = argparse.ArgumentParser()
    add_arguments(cli)
    args = cli.parse_args(["--speculative", "none", "ngram:auto", "--async-scheduling", "both"])
    labels = [label for label, _ in bench.servers(args)]
    assert labels == [
        "off, async steps",
        "off, sync steps",
        "ngram k=auto, async steps",
        "ngram k=auto, sync steps",
    ]
    assert [c[-1] for c in started] == ["--async-scheduling", "--no-async-scheduling"] * 2
    started.clear()
    list(bench.servers(cli.parse_args(["--speculative", "none"])))
    assert not any("async-scheduling" in a for a in started[0])


def test_a_server_that_answers_no_warm_up_request_stops_the_bench(tiny_llama, tmp_path, capsys):
    """A wrong model name (or URL) fails every request alike: the bench says so with the
    server's reply instead of measuring zeros; a bare host is taken as its /v1 API."""
    assert bench.v1_url("http://127.0.0.1:8080") == "http://127.0.0.1:8080/v1"
    assert bench.v1_url("http://127.0.0.1:8080/v1/") == "http://127.0.0.1:8080/v1"
    assert bench.v1_url("http://host/proxy/v1") == "http://host/proxy/v1"
    with serving(LLM(tiny_llama.artifact)) as server:
        argv = ["bench", "serve", "--base-url", server.url, "--served-model", "nope"]
        assert main([*argv, "--concurrency", "1", "--output-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "failed every warm-up request, e.g. HTTP 404" in err and "'nope'" in err
    assert not (tmp_path / "results.json").exists()


def test_bench_serve_sweep(tiny_llama, tmp_path):
    argv = ["bench", "serve", "--model", str(tiny_llama.artifact), "--concurrency", "1", "3"]
    argv += ["--max-tokens", "4", "--min-requests", "3", "--rounds", "1", "--repeats", "2"]
    argv += ["--speculative", "none", "ngram", "suffix:auto"]
    assert main([*argv, "--output-dir", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert list(results["settings"]) == ["off", "ngram k=4", "suffix k=auto"]
    for rows in results["settings"].values():
        assert [r["concurrency"] for r in rows] == [1, 3]
        assert all(r["completed"] == r["requests"] == 6 for r in rows), rows  # 3 per repeat
        assert all(r["p50_ttft"] > 0 and r["output_throughput"] > 0 for r in rows)
        for r in rows:  # throughput is the median repeat's
            assert r["output_throughput"] == pytest.approx(
                np.median(r["output_throughput_by_repeat"])
            )
    assert results["settings"]["off"][0]["acceptance_rate"] is None
    # Each level loads every server in turn: the last server's first level comes before the
    # first server's second; the second repeat loads them in reverse (``load_order``).
    started = {label: [r["started"] for r in rows] for label, rows in results["settings"].items()}
    assert started["suffix k=auto"][0][0] < started["off"][1][0]
    assert started["suffix k=auto"][0][1] < started["ngram k=4"][0][1] < started["off"][0][1]
    # The policy's predicted and measured step times, from the server's /stats.
    assert all(r["policy"] is None for r in results["settings"]["off"])
    policy = results["settings"]["suffix k=auto"][0]["policy"]
    assert policy["steps"] > 0 and policy["predicted_ms"] > 0 and policy["measured_ms"] > 0
    assert policy["emitted_tokens"] >= 1 and policy["expected_tokens"] >= 1
    # The engine's seconds per phase over each level's runs, and the suffix server's pass costs.
    off, suffix = results["settings"]["off"][1], results["settings"]["suffix k=auto"][1]
    assert 0 < off["engine_seconds"]["decode"] < off["seconds"]
    assert "verify" not in off["engine_seconds"] and off["step_costs"] is None
    assert suffix["engine_seconds"]["verify"] > 0 and suffix["step_costs"]["decode_by_rows"]
    table = (tmp_path / "results.md").read_text()
    assert "| x off |" in table and "| off | 1 | 6/6 |" in table
    assert (tmp_path / "serve_bench.png").read_bytes()[:4] == b"\x89PNG"


def test_servers_restarted_for_each_repeat(tiny_llama, tmp_path, monkeypatch):
    """``--restart-servers``: each repeat loads a server process of its own (where its weights
    fall in memory changes with the process), and the repeats still make one row per level."""
    launched, launch = [], bench.launched_server

    def counted(cmd, env):
        launched.append(cmd)
        return launch(cmd, env)

    monkeypatch.setattr(bench, "launched_server", counted)
    argv = ["bench", "serve", "--model", str(tiny_llama.artifact), "--concurrency", "1"]
    argv += ["--max-tokens", "2", "--min-requests", "2", "--rounds", "1", "--repeats", "2"]
    argv += ["--speculative", "none", "--restart-servers", "--output-dir", str(tmp_path)]
    assert main(argv) == 0
    assert len(launched) == 2
    rows = json.loads((tmp_path / "results.json").read_text())["settings"]["off"]
    assert len(rows) == 1 and rows[0]["completed"] == rows[0]["requests"] == 4


def test_conversations_turn_by_turn_with_and_without_the_prefix_cache(tiny_llama, tmp_path):
    """``--dataset sharegpt-chat``: each turn goes out with the history and the server's
    answers, so later turns find the earlier ones' pages in the prefix cache; the same server
    without its cache (``--prefix-caching both``) finds none."""
    argv = ["bench", "serve", "--model", str(tiny_llama.artifact), "--speculative", "none"]
    argv += ["--dataset", "sharegpt-chat", "--max-turns", "3", "--concurrency", "2"]
    argv += ["--min-requests", "2", "--rounds", "1", "--max-tokens", "8"]
    argv += ["--prefix-caching", "both", "--output-dir", str(tmp_path)]
    assert main(argv) == 0
    settings = json.loads((tmp_path / "results.json").read_text())["settings"]
    (cached,), (uncached,) = settings["off"], settings["off, no prefix cache"]
    for row in (cached, uncached):
        # A request per turn: two conversations of two or three turns.
        assert row["completed"] == row["requests"] >= 4 and row["p50_ttft_later_turns"] > 0
    assert cached["prefix_cache_hit_rate"] > 0.3 and uncached["prefix_cache_hit_rate"] == 0
    assert "| off, no prefix cache | 2 |" in (tmp_path / "results.md").read_text()


def test_bench_serve_loads_a_running_server(tiny_llama, tmp_path):
    """``--base-url``: any OpenAI-compatible server, here ours started apart, under its name."""
    with serving(LLM(tiny_llama.artifact)) as served:
        argv = ["bench", "serve", "--base-url", f"{served.url}/v1", "--served-model", "tiny"]
        argv += ["--label", "elsewhere", "--concurrency", "2", "--max-tokens", "3"]
        argv += ["--min-requests", "4", "--output-dir", str(tmp_path), "--temperature", "0.7"]
        assert main(argv) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    (row,) = results["settings"]["elsewhere"]
    assert row["completed"] == row["requests"] == 4 and row["output_throughput"] > 0
    assert "sampled at temperature 0.7" in (tmp_path / "results.md").read_text()


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


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_llama_server_runs_like_ours(monkeypatch, tmp_path):
    """As many slots, as large a KV cache (unified, as our page pool) and as many threads as
    our server, under the model name requests ask for; the draft with -md."""
    monkeypatch.setenv("TVM_NUM_THREADS", "3")
    args = _args("--against-llama-server", "m.gguf", "--llama-server", "/bin/ls")
    args.llama_server_args = "--spec-draft-n-max 8"
    cmd = llama_server_command(args, "d.gguf")
    assert cmd[:3] == ["/bin/ls", "-m", "m.gguf"]
    assert "-kvu" in cmd and cmd[-2:] == ["--spec-draft-n-max", "8"]
    assert cmd[cmd.index("-np") + 1] == "8" and cmd[cmd.index("-c") + 1] == "8192"
    assert cmd[cmd.index("-t") + 1] == cmd[cmd.index("-tb") + 1] == "3"
    assert cmd[cmd.index("-a") + 1] == "bench" and cmd[cmd.index("-md") + 1] == "d.gguf"


def test_a_missing_or_failing_llama_server_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("MLC_SPEC_CACHE", str(tmp_path))
    with pytest.raises(UserError, match="scripts/llamacpp.py"):
        llama_server_binary(None)
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\necho 'error: failed to load model'\nexit 3\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    assert llama_server_binary(None) == str(fake)  # found on the PATH
    failing = launched_llama_server([str(fake), "-m", "x.gguf"], tmp_path / "log" / "ls.log")
    with pytest.raises(UserError, match="exited with 3:\n.*failed to load model"), failing:
        pass


@pytest.mark.parametrize("servers", [2, 3, 5])
def test_each_server_takes_every_place_behind_different_servers(servers):
    """Over twice as many sweeps as servers, every server loads in every place and, with three
    or more, right after at least two different servers (a rotation alone keeps one)."""
    labels = [f"s{i}" for i in range(servers)]
    orders = [load_order(labels, r) for r in range(2 * servers)]
    assert all(sorted(o) == labels for o in orders)
    for label in labels:
        assert {o.index(label) for o in orders} == set(range(servers))
        before = {o[o.index(label) - 1] for o in orders if o.index(label) > 0}
        assert len(before) >= min(2, servers - 1)
