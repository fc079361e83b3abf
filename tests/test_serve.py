"""The OpenAI-compatible server under a real client: the same tokens as the Python API, the
OpenAI options clients send, 64 concurrent streams, bad input, disconnects and overload,
without a lost request or a leaked KV page."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from served import GREEDY, Served, serving

from mlc_spec import LLM, SamplingParams


@pytest.fixture(scope="module")
def server(tiny_llama) -> Iterator[Served]:
    """As ``mlc-spec serve`` runs by default: with async scheduling (the Python API's default
    is off, so every comparison with ``_expected`` compares the two)."""
    llm = LLM(
        tiny_llama.artifact,
        speculative={"method": "ngram", "num_speculative_tokens": 3},
        async_scheduling=True,
    )
    with serving(llm) as served:
        yield served


def _expected(tiny_llama, prompt, max_tokens: int) -> str:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return LLM(tiny_llama.artifact).generate(prompt, params)[0].outputs[0].text


def test_completion_matches_python_api(server, tiny_llama):
    out = server.client().completions.create(
        model="tiny", prompt="w5 w9 w14 w5 w9", max_tokens=12, **GREEDY
    )
    assert out.choices[0].text == _expected(tiny_llama, "w5 w9 w14 w5 w9", 12)
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (5, 12)
    assert out.model_extra["speculation"]["num_drafts"] >= 0


def test_chat_stream_adds_up_to_the_whole_answer(server):
    async def ask() -> tuple[str, list]:
        client = server.async_client()
        messages = [{"role": "user", "content": "w7 w8 w9"}]
        whole = await client.chat.completions.create(
            model="tiny", messages=messages, max_completion_tokens=10, **GREEDY
        )
        stream = await client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_completion_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
        return whole.choices[0].message.content, [chunk async for chunk in stream]

    whole, chunks = asyncio.run(ask())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content for c in chunks[:-1]) == whole
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert "speculation" in chunks[-1].model_extra


def test_first_token_is_reported_before_any_decode_step(tiny_llama):
    """The step that samples a request's first token ends there, not after a speculative step."""
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    engine = LLM(tiny_llama.artifact, speculative=spec).engine
    engine.add_request([5, 6, 5, 6, 5, 6], SamplingParams(max_tokens=8, temperature=0))
    (first,) = engine.step()
    assert len(first.outputs[0].token_ids) == 1
    while engine.has_unfinished():
        engine.step()


def test_greedy_logprobs_do_not_depend_on_speculation(server):
    """Logprobs come from the target's rows: drafting (num_speculative_tokens=3) or not (0)
    gives the same figures, and the greedy token is the most likely one."""
    client = server.client()

    def ask(k: int):
        return client.completions.create(
            model="tiny",
            prompt="w5 w6 w5 w6 w5 w6 w5 w6",
            max_tokens=16,
            logprobs=3,
            temperature=0,
            extra_body={"ignore_eos": True, "num_speculative_tokens": k},
        )

    spec, plain = ask(3), ask(0)
    assert spec.model_extra["speculation"]["num_accepted_tokens"] > 0
    assert plain.model_extra["speculation"]["num_draft_tokens"] == 0
    assert spec.choices[0].text == plain.choices[0].text
    a, b = spec.choices[0].logprobs, plain.choices[0].logprobs
    assert a.tokens == b.tokens and len(a.tokens) == 16
    assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-4)
    for top_a, top_b, lp in zip(a.top_logprobs, b.top_logprobs, a.token_logprobs, strict=True):
        assert list(top_a) == list(top_b) and len(top_a) == 3
        assert max(top_a.values()) == pytest.approx(lp)

    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "w5 w6 w5 w6"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        **GREEDY,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.logprob <= 0 for t in content)


def test_n_seed_and_stop(server):
    client = server.client()
    kwargs = dict(model="tiny", prompt="w20 w21", max_tokens=6, temperature=1.0, seed=7, n=2)
    first, again = client.completions.create(**kwargs), client.completions.create(**kwargs)
    texts = [c.text for c in first.choices]
    assert len(texts) == 2 and texts == [c.text for c in again.choices]
    assert first.usage.completion_tokens == 12

    whole = client.completions.create(model="tiny", prompt="w30", max_tokens=8, **GREEDY)
    words = whole.choices[0].text.split()
    cut = client.completions.create(
        model="tiny", prompt="w30", max_tokens=8, stop=[words[3]], **GREEDY
    )
    assert cut.choices[0].finish_reason == "stop"
    assert whole.choices[0].text.startswith(cut.choices[0].text)
    assert words[3] not in cut.choices[0].text.split()


def test_models_health_and_metrics(server):
    assert server.client().models.list().data[0].id == "tiny"
    assert httpx.get(f"{server.url}/health").status_code == 200
    server.client().completions.create(
        model="tiny", prompt="w5 w6 w5 w6 w5 w6", max_tokens=8, **GREEDY
    )
    # The prefix cache: a 40-token prompt sent again finds its two whole pages of 16.
    prompt = " ".join(f"w{10 + i}" for i in range(40))
    usages = [
        server.client().completions.create(model="tiny", prompt=prompt, max_tokens=2).usage
        for _ in range(2)
    ]
    assert [u.prompt_tokens_details.cached_tokens for u in usages] == [0, 32]
    m = server.wait_idle()
    for name in (
        "mlc_spec:kv_cache_usage_perc",
        "mlc_spec:time_to_first_token_seconds_count",
        "mlc_spec:time_per_output_token_seconds_count",
        "mlc_spec:e2e_request_latency_seconds_count",
        "mlc_spec:prompt_tokens_total",
        "mlc_spec:generation_tokens_total",
        "mlc_spec:request_success_total{finished_reason=length}",
        "mlc_spec:spec_decode_num_drafts_total",
        "mlc_spec:spec_decode_num_draft_tokens_total",
        "mlc_spec:spec_decode_num_accepted_tokens_total",
        "mlc_spec:spec_decode_num_accepted_tokens_per_pos_total{position=0}",
        "mlc_spec:spec_decode_draft_length_count",
        "mlc_spec:prefix_cache_queries_total",
        "mlc_spec:prefix_cache_hits_total",
    ):
        assert name in m, name
        assert m[name] > 0 or name == "mlc_spec:kv_cache_usage_perc", name


def test_stats_show_the_engine_and_its_speculation(server):
    """/stats: the engine's phases and counters, read on the engine thread between steps, and
    the speculation policy's decisions with the step times it predicted."""
    prompt = "w5 w6 w5 w6 w5 w6"
    server.client().completions.create(model="tiny", prompt=prompt, max_tokens=8, **GREEDY)
    server.wait_idle()
    stats = httpx.get(f"{server.url}/stats").json()
    assert stats["calls"]["prefill"] > 0 and stats["seconds"]["prefill"] > 0
    assert stats["speculation"]["num_steps"] > 0 and "costs" in stats["speculation"]
    assert stats["speculation"]["num_predicted"] <= stats["speculation"]["num_steps"]


def test_suffix_decoding_reports_its_cache(tiny_llama):
    """An answer goes into the shared suffix tree when it ends: /stats and /metrics show it."""
    llm = LLM(tiny_llama.artifact, speculative={"method": "suffix"}, async_scheduling=True)
    with serving(llm) as served:
        for _ in range(2):
            served.client().completions.create(model="tiny", prompt="w5", max_tokens=9, **GREEDY)
        m = served.wait_idle()
        stats = httpx.get(f"{served.url}/stats").json()
    assert stats["suffix_cache"]["documents"] == 1  # the same answer twice is held once
    assert m["mlc_spec:suffix_cache_bytes"] == stats["suffix_cache"]["bytes"] > 0


def test_stats_without_speculation(tiny_llama):
    with serving(LLM(tiny_llama.artifact)) as served:
        served.client().completions.create(model="tiny", prompt="w5", max_tokens=3, **GREEDY)
        stats = httpx.get(f"{served.url}/stats").json()
    assert stats["speculation"] is None and stats["calls"]["decode"] > 0


def test_64_concurrent_streams(server, tiny_llama):
    """Every stream completes whole, then no page is held, and greedy output is unchanged."""
    client = server.client()
    probe = dict(model="tiny", prompt="w40 w41 w42", max_tokens=10, **GREEDY)
    before = client.completions.create(**probe).choices[0].text

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str, int, int]:
        stream = await client.completions.create(
            model="tiny",
            prompt=f"w{10 + i} w{11 + i} w{10 + i}",
            max_tokens=8 + i % 8,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
        chunks = [c async for c in stream]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        return text, finish, chunks[-1].usage.completion_tokens, 8 + i % 8

    async def load() -> list:
        client = server.async_client()
        return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(load())
    assert all(finish == "length" and used == asked for _, finish, used, asked in results)
    assert all(text for text, *_ in results)
    m = server.wait_idle()
    assert m["mlc_spec:kv_cache_usage_perc"] == 0
    assert client.completions.create(**probe).choices[0].text == before


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        ("/v1/completions", b"{not json", 400, "JSON"),
        ("/v1/completions", {"prompt": "w5", "max_tokens": "many"}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "w5", "temperature": "hot"}, 400, "temperature"),
        ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
        ("/v1/completions", {"prompt": "w5", "max_tokens": -3}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "w5", "max_tokens": 10**9}, 400, "context length"),
        ("/v1/completions", {"prompt": [5, 99999]}, 400, "token ids"),
        ("/v1/completions", {"prompt": [5] * 1100}, 400, "context length"),
        ("/v1/completions", {"prompt": "w5", "n": 100}, 400, "sequence slots"),
        ("/v1/completions", {"prompt": "w5", "top_p": 2}, 400, "top_p"),
        ("/v1/completions", {"prompt": "w5", "logprobs": 50}, 400, "logprobs"),
        ("/v1/completions", {"prompt": "w5", "echo": True}, 400, "echo"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "w5"}], "tools": [{"type": "function"}]},
            400,
            "tools.0.function: Field required",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "w5"}],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objectx"}},
                },
            },
            400,
            "invalid JSON schema",
        ),
        ("/v1/completions", {"prompt": "w5", "guided_regex": "(open"}, 400, "invalid regex"),
        (
            "/v1/completions",
            {"prompt": "w5", "guided_regex": "a+", "guided_choice": ["b"]},
            400,
            "give one structured-output constraint",
        ),
        (
            "/v1/completions",
            {"prompt": "w5", "response_format": {"type": "json_schema"}},
            400,
            "json_schema",
        ),
        (
            "/v1/completions",
            {"prompt": "w5", "speculative_method": "draft"},
            400,
            "speculative_method 'draft' is not one this engine has (it has ngram)",
        ),
        ("/v1/completions", {"prompt": "w5", "model": "gpt-4"}, 404, "does not exist"),
        ("/v1/embeddings", {}, 404, "Not Found"),
    ],
)
def test_bad_input_gets_an_openai_error_and_the_server_goes_on(server, path, body, status, message):
    if isinstance(body, dict):
        body = json.dumps({"model": "tiny", **body}).encode()
    headers = {"Content-Type": "application/json"}
    response = httpx.post(f"{server.url}{path}", content=body, headers=headers, timeout=30)
    assert response.status_code == status
    error = response.json()["error"]
    assert message in error["message"] and error["code"] == status and error["type"]
    out = server.client().completions.create(model="tiny", prompt="w5", max_tokens=2, **GREEDY)
    assert out.usage.completion_tokens == 2


def test_client_disconnect_frees_pages(server):
    server.wait_idle()
    aborted = server.metrics().get("mlc_spec:request_success_total{finished_reason=abort}", 0)
    body = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 1000, "stream": True}
    body["ignore_eos"] = True
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", f"{server.url}/v1/completions", json=body) as response,
    ):
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert server.metrics()["mlc_spec:kv_cache_usage_perc"] > 0  # it holds pages now
    m = server.wait_idle()  # leaving the block closed the connection mid-stream
    assert m["mlc_spec:kv_cache_usage_perc"] == 0
    assert m["mlc_spec:request_success_total{finished_reason=abort}"] == aborted + 1


def test_client_gone_before_a_whole_response_frees_pages(server):
    server.wait_idle()
    aborted = server.metrics().get("mlc_spec:request_success_total{finished_reason=abort}", 0)
    body = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 1000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.3)
    m = server.wait_idle()
    assert m["mlc_spec:kv_cache_usage_perc"] == 0
    assert m["mlc_spec:request_success_total{finished_reason=abort}"] == aborted + 1


def test_overload_is_answered_503_with_retry_after(tiny_llama):
    """4x the queue bound at once: each request completes or gets 503 + Retry-After."""
    llm = LLM(tiny_llama.artifact, max_batch_size=2)
    bound = 4

    async def one(client: openai.AsyncOpenAI) -> str:
        try:
            out = await client.completions.create(
                model="tiny", prompt="w9 w8", max_tokens=200, **GREEDY
            )
        except openai.APIStatusError as err:
            assert err.status_code == 503 and err.response.headers["retry-after"] == "1"
            return "refused"
        assert out.usage.completion_tokens == 200
        return "done"

    async def flood(served: Served) -> list[str]:
        client = served.async_client()
        return await asyncio.gather(*(one(client) for _ in range(4 * bound + 2)))

    with serving(llm, max_waiting=bound) as served:
        outcomes = asyncio.run(flood(served))
        m = served.wait_idle()
    assert outcomes.count("refused") > 0 and outcomes.count("done") >= bound
    assert m["mlc_spec:kv_cache_usage_perc"] == 0


def test_chat_without_max_tokens_fills_at_most_the_kv_budget(tiny_llama):
    """OpenAI's default for chat is no limit: the answer may fill what one sequence can hold,
    here the KV budget (smaller than the context), and is not refused."""
    llm = LLM(tiny_llama.artifact, max_total_len=160)
    room = llm.engine.max_sequence_len()
    with serving(llm) as served:
        out = served.client().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "w5 w6"}], **GREEDY
        )
    assert 0 < out.usage.completion_tokens <= room - out.usage.prompt_tokens
    assert room < llm.model.context_length
