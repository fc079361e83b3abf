"""The OpenAI-compatible server: same tokens as the Python API, streaming, concurrent
clients batched together, clear 4xx errors, no leaked KV pages."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from mlc_spec import LLM, SamplingParams
from mlc_spec.serve.app import Server


@pytest.fixture(scope="module")
def server(tiny_llama):
    llm = LLM(tiny_llama.artifact, speculative={"method": "ngram", "num_speculative_tokens": 3})
    srv = Server(llm, "tiny", port=0)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _url(srv: Server, path: str) -> str:
    return f"http://127.0.0.1:{srv.server_port}{path}"


def _post(srv: Server, path: str, body) -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(_url(srv, path), data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def _expected(tiny_llama, prompt, max_tokens: int) -> str:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return LLM(tiny_llama.artifact).generate(prompt, params)[0].outputs[0].text


def test_completion_matches_python_api(server, tiny_llama):
    body = {"prompt": "w5 w9 w14 w5 w9", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    status, raw = _post(server, "/v1/completions", body)
    response = json.loads(raw)
    assert status == 200 and response["object"] == "text_completion"
    assert response["choices"][0]["text"] == _expected(tiny_llama, "w5 w9 w14 w5 w9", 12)
    assert response["usage"]["completion_tokens"] == 12
    assert response["choices"][0]["finish_reason"] == "length"


def test_chat_stream_adds_up_to_the_full_answer(server):
    body = {
        "messages": [{"role": "user", "content": "w7 w8 w9"}],
        "max_tokens": 10,
        "temperature": 0,
        "ignore_eos": True,
    }
    _, raw = _post(server, "/v1/chat/completions", body)
    full = json.loads(raw)["choices"][0]["message"]["content"]
    _, raw = _post(server, "/v1/chat/completions", {**body, "stream": True})
    events = [line[6:] for line in raw.decode().split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == full
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_concurrent_clients(server, tiny_llama):
    prompts = [f"w{i} w{i + 1} w{i + 2}" for i in range(10, 16)]

    def ask(prompt: str) -> str:
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        return json.loads(_post(server, "/v1/completions", body)[1])["choices"][0]["text"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(ask, prompts))
    assert answers == [_expected(tiny_llama, p, 8) for p in prompts]


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        ("/v1/completions", {"max_tokens": 4}, 400, "'prompt' must be"),
        ("/v1/completions", {"prompt": "w5", "max_tokens": 5000}, 400, "context length"),
        ("/v1/completions", {"prompt": "w5", "top_p": 2}, 400, "top_p"),
        ("/v1/completions", b"{not json", 400, ""),
        ("/v1/chat/completions", {"messages": "hi"}, 400, "'messages' must be"),
        ("/v1/embeddings", {}, 404, "no route"),
    ],
)
def test_bad_requests(server, path, body, status, message):
    code, raw = _post(server, path, body)
    assert code == status
    assert message in json.loads(raw)["error"]["message"]


def test_models_metrics_and_no_leak(server):
    with urllib.request.urlopen(_url(server, "/v1/models")) as resp:
        assert json.loads(resp.read())["data"][0]["id"] == "tiny"
    _post(server, "/v1/completions", {"prompt": "w5 w6 w5 w6 w5 w6", "max_tokens": 8})
    with urllib.request.urlopen(_url(server, "/metrics")) as resp:
        metrics = resp.read().decode()
    drafts = next(
        line
        for line in metrics.splitlines()
        if line.startswith("mlc_spec:spec_decode_num_draft_tokens_total")
    )
    assert int(drafts.split()[-1]) > 0
    engine = server.llm.engine
    assert not engine.has_unfinished()
    assert engine.kv.available_pages() == engine.capacity_pages
