"""No request can stall the others, and the server ends as it promises: a huge body is refused
unread, a long prompt is tokenized off the event loop, SIGTERM drains within its timeout, a
client that stops reading is cut off, overload is answered on arrival, a disconnect is one
log line, and /v1 can require an API key. Each under the real ``openai`` client or raw HTTP."""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
from served import Served, ServeProcess, serving

from mlc_spec import LLM


@pytest.fixture(scope="module")
def server(tiny_llama) -> Iterator[Served]:
    llm = LLM(tiny_llama.artifact, speculative={"method": "ngram"}, async_scheduling=True)
    with serving(llm) as served:
        yield served


class Stream:
    """A greedy stream read on a thread, with the arrival time of every event."""

    def __init__(self, url: str, prompt: str, max_tokens: int, **extra):
        self.stamps: list[float] = []
        self.events: list[str] = []
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
        body |= {"temperature": 0, "ignore_eos": True, **extra}
        self._thread = threading.Thread(target=self._read, args=(url, body))
        self._thread.start()

    def _read(self, url: str, body: dict) -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    self.stamps.append(time.perf_counter())
                    self.events.append(line.removeprefix("data: "))

    def wait_for(self, events: int) -> None:
        while len(self.events) < events and self._thread.is_alive():
            time.sleep(0.005)

    def join(self) -> list[str]:
        self._thread.join()
        return self.events


@pytest.fixture(scope="module")
def smollm2_server(smollm2) -> Iterator[ServeProcess]:
    """SmolLM2 without speculation: one token per step, steps of even length."""
    with ServeProcess(smollm2, "--speculative", "none") as served:
        yield served


def _health_latencies(url: str, busy: threading.Thread) -> list[float]:
    """/health timed every 10 ms while ``busy`` runs (back to back, the probe itself would
    take the server's event loop from the stream)."""
    latencies = []
    with httpx.Client(timeout=10) as client:
        while busy.is_alive() or not latencies:
            start = time.perf_counter()
            assert client.get(f"{url}/health").status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.01)
    return latencies


def _in_background(work) -> tuple[threading.Thread, list]:
    result: list = []
    thread = threading.Thread(target=lambda: result.append(work()))
    thread.start()
    return thread, result


# A stream read by a process of its own, which stamps each event: the test's own threads
# (uploading 20 MB) would otherwise delay the stamps, not the server.
_READER = """
import json, sys, time, httpx
body = json.loads(sys.argv[2])
with httpx.stream("POST", sys.argv[1] + "/v1/completions", json=body, timeout=60) as response:
    for line in response.iter_lines():
        if line.startswith("data: "):
            print(time.time(), flush=True)
"""


def _upload(url: str, body: bytes) -> bytes:
    """POST ``body`` from a raw socket (no client library copying it); the status code."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode())
        with contextlib.suppress(OSError):  # the server answers and closes before it is sent
            sock.sendall(body)
        answer = b""
        while b"\r\n\r\n" not in answer and (chunk := sock.recv(1 << 16)):
            answer += chunk
    return answer


@pytest.mark.slow
def test_a_20mb_body_stalls_no_one(smollm2_server):
    """A 20 MB body is answered 413 before it is read whole; meanwhile /health answers within
    0.2 s and a running stream's gap between tokens stays within 3x its median. Three bodies
    during one stream, the median of their worst gaps judged: one gap on this 2-core machine
    reaches 2x the median now and then with no other request at all."""
    url = smollm2_server.url
    body = {"model": "tiny", "prompt": "Write a story about a lighthouse.", "max_tokens": 160}
    body |= {"stream": True, "temperature": 0, "ignore_eos": True}
    reader = subprocess.Popen(
        [sys.executable, "-c", _READER, url, json.dumps(body)], stdout=subprocess.PIPE, text=True
    )
    stamps = [float(reader.stdout.readline()) for _ in range(40)]  # the stream runs
    big = b'{"model": "tiny", "prompt": "' + b"word " * 4_000_000 + b'"}'
    windows, answers, latencies = [], [], []
    with httpx.Client(timeout=10) as probe:
        for _ in range(3):
            start = time.time()
            upload, answer = _in_background(lambda: _upload(url, big))
            assert probe.get(f"{url}/health").status_code == 200
            latencies.append(time.time() - start)
            upload.join()
            windows.append((start, time.time()))
            answers += answer
            time.sleep(0.15)
    stamps = np.array(stamps + [float(line) for line in reader.stdout.read().split()])
    reader.wait()

    assert all(answer.startswith(b"HTTP/1.1 413 ") for answer in answers), answers
    assert max(latencies) < 0.2, latencies
    gaps = np.diff(stamps[:-2])  # the last events: the end of the body, [DONE]
    overlaps = [[t <= end and t + g >= start for g, t in zip(gaps, stamps, strict=False)]
                for start, end in windows]  # fmt: skip
    worst = [max(gaps[hit]) for hit in map(np.array, overlaps)]
    # Reading the body on the event loop would stall it for at least its JSON parse (37 ms here,
    # 6x the median gap). The stream's own gaps reach 2.2x their median under an upload on a
    # CI runner, so the bound is 3x; where other processes take a core, its own jitter outside
    # the windows is, and a stall of the event loop still stands out against it.
    outside = gaps[~np.any(overlaps, axis=0)]
    bound = max(3 * np.median(gaps), np.percentile(outside, 99))
    assert np.median(worst) <= bound, (worst, np.median(gaps), bound)


@pytest.mark.slow
def test_a_long_prompt_is_tokenized_off_the_event_loop(smollm2_server):
    """1.9 MB of text (under the body limit, over the context) takes seconds to tokenize: it
    is done on a worker thread, so /health answers within 0.2 s all along and the running
    stream goes on; then the prompt is refused for its length."""
    url = smollm2_server.url
    stream = Stream(url, "Write a story about a lighthouse.", 400)
    stream.wait_for(20)
    text = "The quick brown fox jumps over the lazy dog. " * 42_000  # 1.9 M characters
    messages = [{"role": "user", "content": text}]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=60)

    def ask() -> openai.APIStatusError:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
        return refused.value

    start = time.perf_counter()
    big, error = _in_background(ask)
    latencies = _health_latencies(url, big)
    took = time.perf_counter() - start
    stream.join()

    assert "context length" in error[0].message
    assert took > 0.5  # it was tokenized, not refused by a cheaper check
    assert max(latencies) < 0.2, latencies
    assert np.diff(stream.stamps).max() < took / 2  # the stream did not wait for it


def _finish_reason_or_error(events: list[str]) -> str:
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    if "error" in last:
        return f"error {last['error']['code']}"
    return last["choices"][0]["finish_reason"]


def test_sigterm_lets_streams_finish_within_the_timeout_then_ends_them(smollm2_int8):
    """Streams that finish within --shutdown-timeout finish; the rest end with an error event
    and [DONE] once it has passed, their sequences are aborted, and the process exits 0.
    SmolLM2 serves: the tiny model answered all 8 long streams within the second on a Zen 5.
    The timeout is 2 s: the short streams' 40 tokens took 0.24-0.27 s after SIGTERM alone, and
    in the full suite, beside another worker's test, one of them once took more than 1 s."""
    args = ("--shutdown-timeout", "2", "--max-batch-size", "16")
    with ServeProcess(smollm2_int8, *args) as served:
        long = [Stream(served.url, f"w{i} w{i + 1}", 1000) for i in range(8)]
        short = [Stream(served.url, f"w{i} w{i + 3}", 40) for i in range(2)]
        for stream in long + short:
            stream.wait_for(1)
        served.process.send_signal(signal.SIGTERM)
        signalled = time.perf_counter()
        time.sleep(0.3)
        with pytest.raises(httpx.ConnectError):  # no new connections while draining
            httpx.get(f"{served.url}/health")
        code, log = served.finish(timeout=10)
        ended = [_finish_reason_or_error(s.join()) for s in long]
        assert [_finish_reason_or_error(s.join()) for s in short] == ["length"] * 2
    assert ended == ["error 503"] * 8
    assert 2.0 <= max(s.stamps[-1] for s in long) - signalled < 4.0
    assert code == 0, log
    assert "ending 8 running requests" in log


def test_a_second_signal_ends_the_streams_at_once(smollm2_int8):
    with ServeProcess(smollm2_int8, "--shutdown-timeout", "30") as served:
        streams = [Stream(served.url, f"w{i} w{i + 1}", 1000) for i in range(4)]
        for stream in streams:
            stream.wait_for(1)
        served.process.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        served.process.send_signal(signal.SIGINT)
        code, log = served.finish(timeout=10)
        assert [_finish_reason_or_error(s.join()) for s in streams] == ["error 503"] * 4
    assert code == 0, log


def test_a_negative_seed_is_a_seed(server):
    """OpenAI takes any int64 as a seed; -1 samples reproducibly, out of range gets a 400."""
    client = server.client()
    ask = dict(model="tiny", prompt="w20 w21", max_tokens=8, temperature=1.0)
    first, again = (client.completions.create(**ask, seed=-1) for _ in range(2))
    assert first.choices[0].text == again.choices[0].text
    with pytest.raises(
        openai.BadRequestError, match=r"seed.*allowed: seed >= -9223372036854775808"
    ):
        client.completions.create(**ask, seed=2**63)


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/v1/completions", {"prompt": "a\ud800b"}, "prompt: a lone surrogate at character 1"),
        ("/v1/completions", {"prompt": "w5", "stop": ["\udfff"]}, "stop.0: a lone surrogate"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
            "messages.0.content.0.text: a lone surrogate",
        ),
    ],
)
def test_a_lone_surrogate_gets_a_400_naming_the_field(server, path, body, message):
    """JSON can escape half a surrogate pair (the openai client refuses to send one, other
    clients do not); no tokenizer can encode it."""
    payload = json.dumps({"model": "tiny", "max_tokens": 2, **body})  # escaped: \ud800
    headers = {"Content-Type": "application/json"}
    response = httpx.post(f"{server.url}{path}", content=payload, headers=headers)
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith(message)


@pytest.fixture
def server_log(caplog) -> Iterator[pytest.LogCaptureFixture]:
    """What the server logs, uvicorn's own logger included (it does not propagate)."""
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="mlc_spec.serve")
    try:
        yield caplog
    finally:
        uvicorn_log.removeHandler(caplog.handler)


def test_a_disconnect_is_logged_once_without_a_traceback(server, server_log, monkeypatch):
    server.wait_idle()
    step = server.llm.engine.step

    def slow_step():  # 1000 tokens take >= 1 s: on a Zen 5 they took < 0.3 s, the client's wait
        time.sleep(0.01)
        return step()

    monkeypatch.setattr(server.llm.engine, "step", slow_step)
    body = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 1000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # a whole response, the client gives up
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.3)
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}) as r,
    ):
        next(line for line in r.iter_lines() if line.startswith("data: "))
    m = server.wait_idle()
    assert m["mlc_spec:kv_cache_usage_perc"] == 0
    records = server_log.records
    assert not [r for r in records if r.exc_info or r.levelno >= logging.WARNING], records
    gone = [r.getMessage() for r in records if "client disconnected" in r.getMessage()]
    assert len(gone) == 2, gone


def test_api_key_guards_v1_only_and_docs_are_off_by_default(tiny_llama, server):
    assert httpx.get(f"{server.url}/docs").status_code == 404
    assert httpx.get(f"{server.url}/openapi.json").status_code == 404
    llm = LLM(tiny_llama.artifact)
    with serving(llm, api_key="sesame", enable_docs=True) as served:
        with pytest.raises(openai.AuthenticationError, match="API key"):
            served.client(api_key="wrong").models.list()
        with pytest.raises(openai.AuthenticationError):
            served.client().completions.create(model="tiny", prompt="w5", max_tokens=2)
        assert httpx.post(f"{served.url}/v1/completions", json={}).status_code == 401
        out = served.client("sesame").completions.create(
            model="tiny", prompt="w5", max_tokens=2, extra_body={"ignore_eos": True}
        )  # sampled at temperature 1: without ignore_eos, EOS could end it after one token
        assert out.usage.completion_tokens == 2
        for path in ("/health", "/metrics", "/docs", "/openapi.json"):
            assert httpx.get(f"{served.url}{path}").status_code == 200, path


def test_the_api_key_comes_from_the_environment_too(tiny_llama):
    with ServeProcess(tiny_llama.artifact, env={"MLC_SPEC_API_KEY": "sesame"}) as served:
        assert httpx.get(f"{served.url}/v1/models").status_code == 401
        headers = {"Authorization": "Bearer sesame"}
        assert httpx.get(f"{served.url}/v1/models", headers=headers).status_code == 200


def test_a_client_that_stops_reading_is_cut_off(tiny_llama):
    """Its unread output is bounded by --max-stream-backlog: past it the request is aborted
    and its pages freed, while the client still has not read a byte. (Small socket buffers
    on both ends, so that the kernel's do not absorb the whole answer first.)"""
    llm = LLM(tiny_llama.artifact)
    with serving(llm, send_buffer=4096, max_stream_backlog=32) as served:
        body = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 1000, "ignore_eos": True}
        body |= {"stream": True, "logprobs": 20}
        payload = json.dumps(body).encode()
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", int(served.url.rsplit(":", 1)[1])))
            head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            sock.sendall(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
            ended = "mlc_spec:request_success_total{finished_reason=abort}"
            for _ in range(200):  # the request ends without the client reading anything
                if ended in served.metrics():
                    break
                time.sleep(0.05)
            m = served.wait_idle()
            assert (
                m[ended] == 1 and "mlc_spec:request_success_total{finished_reason=length}" not in m
            )
            assert m["mlc_spec:kv_cache_usage_perc"] == 0
            assert m["mlc_spec:generation_tokens_total"] < 1000
            sock.settimeout(5)
            received = b""
            while b"data: [DONE]" not in received:
                chunk = sock.recv(1 << 16)
                assert chunk, received[-300:]
                received += chunk
    last = received.split(b"data: ")[-2]
    assert b'"code":408' in last and b"read too slowly" in last


def test_overload_is_decided_on_arrival_not_at_the_next_step(tiny_llama):
    """With steps of 2 s, a request past the queue bound gets its 503 at once. (Steps of
    0.8 s against a 0.2 s bound failed once in the full suite: 0.41 s, with SmolLM2 serving
    beside it.)"""
    llm = LLM(tiny_llama.artifact, max_batch_size=1)
    step = llm.engine.step

    def slow_step():
        time.sleep(2.0)
        return step()

    llm.engine.step = slow_step
    with serving(llm, max_waiting=1) as served:
        running = Stream(served.url, "w5 w6", 2)  # runs
        running.wait_for(1)
        waiting = Stream(served.url, "w7 w8", 2)  # waits
        time.sleep(0.1)
        start = time.perf_counter()
        with pytest.raises(openai.APIStatusError) as refused:
            served.client().completions.create(model="tiny", prompt="w9", max_tokens=2)
        took = time.perf_counter() - start
        assert refused.value.status_code == 503 and took < 0.5, took
        assert _finish_reason_or_error(waiting.join()) == "length"
        running.join()


@pytest.mark.parametrize(
    ("path", "body", "message", "param"),
    [
        (
            "/v1/completions",
            '{"model": "tiny", "prompt": "w5", "temperature": NaN}',
            "temperature: Input should be a finite number (allowed: temperature >= 0 and "
            "temperature <= 2)",
            "temperature",
        ),
        (
            "/v1/completions",
            {"prompt": "w5", "temperature": 5},
            "allowed: temperature >= 0 and temperature <= 2",
            "temperature",
        ),
        (
            "/v1/completions",
            {"prompt": "w5", "stop_token_ids": [-1]},
            "stop_token_ids.0: Input should be greater than or equal to 0",
            "stop_token_ids.0",
        ),
        (
            "/v1/completions",
            {"prompt": "w5", "stop_token_ids": [99999]},
            "stop_token_ids must be in [0, ",
            None,
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ]
            },
            "messages.0.content: part 0 is of type 'image_url'; this model reads text only",
            "messages.0.content",
        ),
        (
            "/v1/completions",
            '{"model": "tiny", "prompt": "w5",',
            "the body is not valid JSON: ",
            None,
        ),
    ],
)
def test_a_wrong_value_gets_a_400_naming_the_field_and_its_range(
    server, path, body, message, param
):
    content = body if isinstance(body, str) else json.dumps({"model": "tiny", **body})
    headers = {"Content-Type": "application/json"}
    response = httpx.post(f"{server.url}{path}", content=content, headers=headers)
    assert response.status_code == 400
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == param


def test_a_chunked_body_past_the_limit_gets_a_413(tiny_llama):
    """Past --max-request-bytes: with Content-Length (the openai client) refused at once,
    chunked refused as it arrives; the server goes on."""
    with serving(LLM(tiny_llama.artifact), max_request_bytes=1000) as served:
        chunks = iter([b'{"model": "tiny", "prompt": "', b"w5 " * 400, b'"}'])
        headers = {"Content-Type": "application/json"}
        response = httpx.post(f"{served.url}/v1/completions", content=chunks, headers=headers)
        assert response.status_code == 413 and "1000 bytes" in response.json()["error"]["message"]
        with pytest.raises(openai.APIStatusError, match="1000 bytes") as refused:  # Content-Length
            served.client().completions.create(model="tiny", prompt="w5 " * 400, max_tokens=2)
        assert refused.value.status_code == 413
        small = served.client().completions.create(
            model="tiny", prompt="w5 w6", max_tokens=2, extra_body={"ignore_eos": True}
        )  # sampled at temperature 1: without ignore_eos, EOS could end it after one token
        assert small.usage.completion_tokens == 2
