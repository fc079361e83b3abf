"""Tool calls (``runtime/tool_calls.py``): the Hermes (Qwen2.5) and Llama 3 formats parsed
whole and as they stream, forced calls (``required``, a named function) enforced by a grammar
that accepts exactly what the parser reads, greedy forced calls identical with speculation on
and off, the templates fed tools and tool results, and the server's ``tools`` through the real
``openai`` client, with the bad input it refuses."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
import xgrammar
from served import serving

from mlc_spec import LLM, SamplingParams
from mlc_spec.errors import UserError
from mlc_spec.runtime.metrics import SpecStats
from mlc_spec.runtime.params import StructuredOutput
from mlc_spec.runtime.request import CompletionOutput, RequestOutput
from mlc_spec.runtime.structured_output import Grammars
from mlc_spec.runtime.tokenizer import Tokenizer
from mlc_spec.runtime.tool_calls import HERMES, LLAMA3_JSON, Parsed, ToolFormat, detect
from mlc_spec.serve.responses import ResponseBuilder, ToolUse

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

# ChatML templates that render tools (SmolLM2's own renders none), in the two formats.
HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
You may call functions. Their signatures:
<tools>{% for t in tools %}
{{ t | tojson }}{% endfor %}
</tools>
Call one as <tool_call>
{"name": <name>, "arguments": <arguments>}
</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{%- for c in m.tool_calls %}
<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}<|im_start|>assistant
"""
LLAMA3_TEMPLATE = """\
{%- for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>

{% if tools and loop.last %}Given the following functions, respond with a JSON for a function \
call. Respond in the format {"name": function name, "parameters": dictionary of argument name \
and its value}.
{% for t in tools %}{{ t | tojson }}
{% endfor %}{% endif %}{{ m.content }}<|eot_id|>
{%- endfor %}<|start_header_id|>assistant<|end_header_id|>

"""


def _call(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


# (output, its content, its calls); None: the output is all content, as written.
HERMES_OUTPUTS = [
    (_call("add", {"a": 1, "b": 2}), "", [("add", {"a": 1, "b": 2})]),
    (
        "Let me look.\n" + _call("get_weather", {"city": "Oslo", "unit": "C"}) + "\n"
        + _call("add", {"a": 3, "b": 4}) + "\nDone.\n",
        "Let me look.\nDone.",
        [("get_weather", {"city": "Oslo", "unit": "C"}), ("add", {"a": 3, "b": 4})],
    ),
    ("No tools needed: 2 < 3 and <tool is text.\n\n", None, []),
    ("x <tool_call>\n{not json}\n</tool_call> y", None, []),
    ('<tool_call>\n{"name": "add"}\n</tool_call>', None, []),
    # Cut off before its closing tag: a whole JSON call still counts, a partial one is text.
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1}}', "", [("add", {"a": 1})]),
    ('<tool_call>\n{"name": "add", "argu', None, []),
    # Qwen2.5-Coder's way: a fenced JSON block. Other fenced blocks are text.
    ('```json\n{\n  "name": "add",\n  "arguments": {\n    "a": 17\n  }\n}\n```', "",
     [("add", {"a": 17})]),
    ('Here:\n```json\n{"a": [1, 2]}\n```\n', None, []),
    ("```json\n[1, 2]\n```", None, []),
    ("```python\nprint(1)\n```", None, []),
]  # fmt: skip
LLAMA3_OUTPUTS = [
    ('{"name": "add", "parameters": {"a": 1, "b": 2}}', "", [("add", {"a": 1, "b": 2})]),
    (
        ' {"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_weather", '
        '"arguments": {"city": "Rome", "unit": "F"}}',
        "",
        [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Rome", "unit": "F"})],
    ),
    ("The answer is 3.", None, []),
    ('{"a": 1, "b": 2}', None, []),
    ('{"name": "add", "parameters": {"a": 1', None, []),
]


def _spelled(parsed) -> tuple[str, list[tuple[str, dict]]]:
    return parsed.content, [(c.name, json.loads(c.arguments)) for c in parsed.calls]


@pytest.mark.parametrize(
    ("fmt", "output", "content", "calls"),
    [(HERMES, *case) for case in HERMES_OUTPUTS] + [(LLAMA3_JSON, *c) for c in LLAMA3_OUTPUTS],
)
def test_outputs_parse_into_content_and_calls(fmt: ToolFormat, output, content, calls):
    assert _spelled(fmt.parser().parse(output)) == (output if content is None else content, calls)


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON])
@pytest.mark.parametrize("piece", [1, 2, 3, 7])
def test_a_stream_parses_as_the_whole_output(fmt: ToolFormat, piece: int):
    """Fed in pieces of any size, a parser releases what it releases whole: content is only
    held while it could begin a call."""
    outputs = HERMES_OUTPUTS if fmt is HERMES else LLAMA3_OUTPUTS
    for output, content, calls in outputs:
        parser, streamed = fmt.parser(), Parsed()
        for at in range(0, len(output), piece):
            streamed += parser.feed(output[at : at + piece])
        streamed += parser.finish()
        assert _spelled(streamed) == (output if content is None else content, calls)


def test_hermes_content_streams_before_the_call_is_read():
    parser = HERMES.parser()
    assert parser.feed("Checking the weather").content == "Checking the weather"
    assert parser.feed(" now <tool_").content == " now"  # "<tool_" may open a call
    assert parser.feed('call>\n{"name": "add", ').content == ""
    parsed = parser.feed('"arguments": {"a": 1, "b": 2}}\n</tool_call>')
    assert [c.name for c in parsed.calls] == ["add"]
    # A fence that opens no JSON object is text at once, not when it closes.
    parser = HERMES.parser()
    assert parser.feed("```").content == ""
    assert parser.feed("json\n[1, 2").content == "```json\n[1, 2"


def test_formats_are_recognised_from_their_templates(smollm2_tokenizer_dir):
    assert detect(HERMES_TEMPLATE) is HERMES
    assert detect(LLAMA3_TEMPLATE) is LLAMA3_JSON
    assert Tokenizer(smollm2_tokenizer_dir).tool_format is None  # SmolLM2's renders no tools


SMOLLM2_EOS = 2


@pytest.fixture(scope="module")
def grammars(smollm2_tokenizer_dir) -> Grammars:
    return Grammars(smollm2_tokenizer_dir, 49152, [SMOLLM2_EOS])


def _accepts(grammars: Grammars, tag: dict, text: str) -> bool:
    """The grammar takes ``text`` whole and may end there (its stop token accepted)."""
    compiled = grammars.compile(StructuredOutput(structural_tag=tag))
    matcher = xgrammar.GrammarMatcher(compiled)
    return matcher.accept_string(text) and matcher.accept_token(SMOLLM2_EOS)


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON])
def test_forced_calls_accept_what_the_parser_reads(grammars, fmt: ToolFormat):
    """``required``: one or more calls of the tools with arguments under their schemas;
    a named function: that one call; ``parallel_tool_calls`` false: one call. What the grammar
    accepts, the parser reads back as those calls."""
    weather = fmt.begin("get_weather") + '{"city": "Oslo", "unit": "C"}' + fmt.end
    add = fmt.begin("add") + '{"a": 1, "b": 2}' + fmt.end
    both = weather + ("\n" if fmt is HERMES else "; ") + add
    required = fmt.structural_tag(TOOLS, "required", parallel=True)
    for text in (weather, add, both):
        assert _accepts(grammars, required, text), text
        assert [c.name for c in fmt.parser().parse(text).calls]
    assert _spelled(fmt.parser().parse(both))[1] == [
        ("get_weather", {"city": "Oslo", "unit": "C"}),
        ("add", {"a": 1, "b": 2}),
    ]
    bad_unit = fmt.begin("get_weather") + '{"city": "Oslo", "unit": "K"}' + fmt.end
    unknown = fmt.begin("mul") + '{"a": 1, "b": 2}' + fmt.end
    for text in (bad_unit, unknown, "It is sunny.", ""):
        assert not _accepts(grammars, required, text), text
    single = fmt.structural_tag(TOOLS, "required", parallel=False)
    assert _accepts(grammars, single, add) and not _accepts(grammars, single, both)
    named = fmt.structural_tag(TOOLS, {"type": "function", "function": {"name": "add"}}, True)
    assert _accepts(grammars, named, add) and not _accepts(grammars, named, weather)
    assert fmt.structural_tag(TOOLS, "auto", True) is None


def test_templates_render_tools_and_tool_results(smollm2_tokenizer_dir, tmp_path):
    (tmp_path / "hermes.jinja").write_text(HERMES_TEMPLATE)
    tok = Tokenizer(smollm2_tokenizer_dir, chat_template=tmp_path / "hermes.jinja")
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}}]},
        {"role": "tool", "content": "-3 C, snow", "tool_call_id": "call_1"},
    ]  # fmt: skip
    text = tok.render_chat(messages, TOOLS)
    assert json.dumps(WEATHER) in text
    assert '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}' in text
    assert "<tool_response>\n-3 C, snow\n</tool_response>" in text
    with pytest.raises(UserError, match="no tool-call format"):
        Tokenizer(smollm2_tokenizer_dir).render_chat(messages[:1], TOOLS)
    with pytest.raises(UserError, match="unknown tool-call format 'xml'"):
        Tokenizer(smollm2_tokenizer_dir, tool_call_parser="xml")
    llama = Tokenizer(smollm2_tokenizer_dir, tool_call_parser="llama3_json")
    assert llama.tool_format is LLAMA3_JSON


def _delta(text: str, finish: str | None = None) -> RequestOutput:
    out = CompletionOutput(0, text, [1], finish, SpecStats())
    return RequestOutput("r", None, [5, 6, 7], [out], finished=finish is not None)


@pytest.mark.parametrize("parallel", [True, False])
def test_responses_carry_tool_calls_whole_and_streamed(smollm2_tokenizer_dir, parallel):
    """``auto``: an output that calls tools comes back as OpenAI ``tool_calls`` with
    ``finish_reason`` ``tool_calls``, the same whole and as stream deltas; with
    ``parallel_tool_calls`` false, the first call only."""
    output = HERMES_OUTPUTS[1][0]
    pieces = [output[i : i + 5] for i in range(0, len(output), 5)]
    tok = Tokenizer(smollm2_tokenizer_dir)
    whole = ResponseBuilder(True, "m", tok, 3, 1, ToolUse(HERMES, parallel))
    streamed = ResponseBuilder(True, "m", tok, 3, 1, ToolUse(HERMES, parallel))
    content, calls, reasons = "", [], []
    for i, piece in enumerate(pieces):
        delta = _delta(piece, "stop" if i == len(pieces) - 1 else None)
        whole.add(delta)
        streamed.add(delta)
        choice = streamed.chunk(delta, with_logprobs=False).choices[0]
        content += choice.delta.content or ""
        calls += choice.delta.tool_calls or []
        reasons.append(choice.finish_reason)
    message = whole.response(with_logprobs=False).choices[0].message
    names = ["get_weather", "add"] if parallel else ["get_weather"]
    assert [c.function.name for c in message.tool_calls] == names
    assert [c.function.name for c in calls] == names
    assert [c.index for c in calls] == list(range(len(names)))
    assert [c.function.arguments for c in calls] == [
        c.function.arguments for c in message.tool_calls
    ]
    assert message.content == content == "Let me look.\nDone."
    assert whole.response(with_logprobs=False).choices[0].finish_reason == "tool_calls"
    assert reasons[-1] == "tool_calls" and not any(reasons[:-1])


@pytest.fixture(scope="module")
def hermes_llm(smollm2_int8, tmp_path_factory) -> LLM:
    path = tmp_path_factory.mktemp("templates") / "hermes.jinja"
    path.write_text(HERMES_TEMPLATE)
    return LLM(smollm2_int8, speculative={"method": "suffix"}, chat_template=path)


QUESTIONS = ["What is the weather in Paris, in Celsius?", "What is 17 plus 25?", "Hello!"]


def _forced(llm: LLM, fmt: ToolFormat, choice, k: int | None) -> list[list[int]]:
    tag = fmt.structural_tag(TOOLS, choice, parallel=True)
    params = SamplingParams(
        max_tokens=64, temperature=0, structured_output={"structural_tag": tag},
        num_speculative_tokens=k,
    )  # fmt: skip
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    outs = llm.chat(conversations, params, tools=TOOLS)
    for out in outs:
        parsed = fmt.parser().parse(out.outputs[0].text)
        assert parsed.calls, out.outputs[0].text
        for call in parsed.calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.slow
def test_forced_calls_are_identical_with_speculation(hermes_llm, smollm2_int8):
    """Greedy forced calls, token for token, with suffix drafts of k = 1, 3 and auto as
    without speculation, in both formats (the second round drafts from the first's output)."""
    llama = LLM(smollm2_int8, speculative={"method": "ngram"}, tool_call_parser="llama3_json")
    for llm, fmt in ((hermes_llm, HERMES), (llama, LLAMA3_JSON)):
        for choice in ("required", {"type": "function", "function": {"name": "add"}}):
            plain = _forced(llm, fmt, choice, 0)
            for k in (1, 3, None):
                assert _forced(llm, fmt, choice, k) == plain, (fmt.name, choice, k)
    assert hermes_llm.metrics()["num_accepted_tokens"] > 0


@pytest.fixture(scope="module")
def served(hermes_llm):
    with serving(hermes_llm) as served:
        yield served


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_the_openai_client_gets_tool_calls(served, stream):
    """``tool_choice`` required and named, whole and streamed: calls whose arguments follow
    the function's schema, ``finish_reason`` ``tool_calls``; then the call's result goes back
    as a ``tool`` message."""
    client = served.client()
    messages = [{"role": "user", "content": "What is the weather in Paris, in Celsius?"}]
    for choice, name in (
        ("required", None),
        ({"type": "function", "function": {"name": "add"}}, "add"),
    ):
        args = {"model": "tiny", "messages": messages, "tools": TOOLS, "tool_choice": choice}
        args |= {"temperature": 0, "max_tokens": 64}
        if stream:
            calls, content, reason = {}, "", None
            for chunk in client.chat.completions.create(**args, stream=True):
                delta = chunk.choices[0].delta
                content += delta.content or ""
                for call in delta.tool_calls or []:
                    entry = calls.setdefault(call.index, {"name": "", "arguments": "", "id": ""})
                    entry["id"] += call.id or ""
                    entry["name"] += call.function.name or ""
                    entry["arguments"] += call.function.arguments or ""
                reason = chunk.choices[0].finish_reason or reason
            calls = [calls[i] for i in sorted(calls)]
        else:
            choice_ = client.chat.completions.create(**args).choices[0]
            reason, content = choice_.finish_reason, choice_.message.content or ""
            calls = [c.function.model_dump() | {"id": c.id} for c in choice_.message.tool_calls]
        assert reason == "tool_calls" and content == "" and calls
        for call in calls:
            assert call["id"].startswith("call_")
            assert name in (None, call["name"])
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    reply = messages + [
        {"role": "assistant", "tool_calls": [{"id": calls[0]["id"], "type": "function",
         "function": {"name": calls[0]["name"], "arguments": calls[0]["arguments"]}}]},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "7"},
    ]  # fmt: skip
    answer = client.chat.completions.create(
        model="tiny", messages=reply, tools=TOOLS, tool_choice="none", max_tokens=8,
        temperature=0,
    )  # fmt: skip
    assert answer.choices[0].message.tool_calls in (None, [])
    assert answer.choices[0].message.content


BAD_TOOLS = [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "mul"}}},
     "tool_choice names function 'mul', which is not among tools (get_weather, add)"),
    ({"tool_choice": "required"}, "tool_choice 'required' needs tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools: two functions share a name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "a forced tool_choice is a constraint of its own: drop response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "invalid structural tag"),
    ({"functions": [{"name": "f"}]}, "'functions' is deprecated and not supported: use tools"),
    ({"messages": [{"role": "tool", "content": "3"}]}, "needs the tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
      "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages.0.tool_calls.0.function.arguments: is not valid JSON"),
    ({"messages": [{"role": "user", "tool_calls": []}]}, "tool_calls belong to assistant"),
]  # fmt: skip


@pytest.mark.slow
def test_bad_tool_requests_get_a_400_that_says_which(served, smollm2_int8):
    for extra, message in BAD_TOOLS:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]} | extra
        response = httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=30)
        assert response.status_code == 400, (extra, response.text)
        assert message in response.json()["error"]["message"], response.text
    body = {"model": "tiny", "prompt": "hi", "tools": TOOLS}
    response = httpx.post(f"{served.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400
    assert "tools apply to /v1/chat/completions" in response.json()["error"]["message"]
    with serving(LLM(smollm2_int8)) as plain:  # SmolLM2's own template renders no tools
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
        response = httpx.post(f"{plain.url}/v1/chat/completions", json=body, timeout=30)
        assert response.status_code == 400
        assert "chat template has no tool-call format" in response.json()["error"]["message"]
    assert served.wait_idle()["mlc_spec:num_requests_running"] == 0
