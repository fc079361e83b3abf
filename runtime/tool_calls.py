"""Tool calls in the formats chat templates teach models: Hermes (Qwen2.5) and Llama 3's JSON.

A format is the text a model writes to call a function. The same strings serve both directions,
so what the grammar forces is what the parser reads:
- ``tool_choice`` ``required`` or a named function becomes an xgrammar structural tag (the call's
  opening text with the name, its arguments under the function's JSON schema, its closing text),
  enforced like any structured output, with speculation;
- ``auto`` is parsed: text outside calls is the message's content, each call becomes an OpenAI
  ``tool_call``. Output that looks like a call but does not parse stays text, as written.

Parsers read text as it streams: content is released as soon as it cannot be the start of a
call (at most a tag's length is held back, and the whitespace around calls is dropped), and a
call is released when it closes.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import uuid
from typing import Any

from mlc_spec.errors import UserError

# A tool in OpenAI's (and transformers' chat templates') form:
# {"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}.
Tool = dict[str, Any]
# "none", "auto", "required", or {"type": "function", "function": {"name": ...}}.
ToolChoice = str | dict[str, Any]
# Whitespace between JSON tokens of forced arguments: one, as models write it. Unbounded, a
# small model can pad an object with newlines until max_tokens.
MAX_WHITESPACE = 1


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str = dataclasses.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclasses.dataclass
class Parsed:
    """What a piece of output is: text for ``content``, and completed calls."""

    content: str = ""
    calls: list[ToolCall] = dataclasses.field(default_factory=list)

    def __iadd__(self, other: Parsed) -> Parsed:
        self.content += other.content
        self.calls += other.calls
        return self


class ToolCallParser(abc.ABC):
    """One sample's output, fed as it is generated."""

    @abc.abstractmethod
    def feed(self, text: str) -> Parsed: ...

    @abc.abstractmethod
    def finish(self) -> Parsed:
        """The end of the output: whatever was held back."""

    def parse(self, text: str) -> Parsed:
        parsed = self.feed(text)
        parsed += self.finish()
        return parsed


@dataclasses.dataclass(frozen=True)
class ToolFormat:
    """A call is ``prefix + '{"name": "NAME", "<arguments_key>": ' + ARGS + suffix``. With a
    ``separator``, an answer that calls tools is calls alone, joined by it (Llama 3); without,
    calls may come anywhere in the text (Hermes)."""

    name: str
    prefix: str
    arguments_key: str
    suffix: str
    separator: str | None = None
    # Other (opening, closing) pairs around a call that the parser reads too (not the grammar).
    also_read: tuple[tuple[str, str], ...] = ()

    def begin(self, function: str) -> str:
        return f'{self.prefix}{{"name": "{function}", "{self.arguments_key}": '

    @property
    def end(self) -> str:
        return "}" + self.suffix

    def parser(self) -> ToolCallParser:
        return _JsonParser(self) if self.separator else _TaggedParser(self)

    def structural_tag(
        self, tools: list[Tool], choice: ToolChoice, parallel: bool
    ) -> dict[str, Any] | None:
        """The grammar of ``choice`` as an xgrammar structural tag: one call of the named
        function, or at least one call of any (just one unless ``parallel``); None for
        ``auto`` and ``none``, which are not constrained."""
        if choice in ("auto", "none"):
            return None
        if choice == "required":
            calls = {"tags": [self._tag(t["function"]) for t in tools], "at_least_one": True}
            calls["stop_after_first"] = not parallel
            if self.separator:
                calls |= {"type": "tags_with_separator", "separator": self.separator}
            else:  # what every tag begins with starts one
                calls |= {"type": "triggered_tags", "triggers": [self.prefix + '{"name": ']}
            return _structural_tag(calls)
        name = choice["function"]["name"]
        (function,) = (t["function"] for t in tools if t["function"]["name"] == name)
        return _structural_tag(self._tag(function))

    def _tag(self, function: dict[str, Any]) -> dict[str, Any]:
        # As OpenAI: only ``strict: false`` leaves the arguments free (any JSON object).
        schema = function.get("parameters") or {"type": "object"}
        if function.get("strict") is False:
            schema = {"type": "object"}
        content = {"type": "json_schema", "json_schema": schema}
        content["max_whitespace_cnt"] = MAX_WHITESPACE
        return {"type": "tag", "begin": self.begin(function["name"]), "content": content,
                "end": self.end}  # fmt: skip


def _structural_tag(fmt: dict[str, Any]) -> dict[str, Any]:
    return {"type": "structural_tag", "format": fmt}


# Qwen2.5-Coder, taught the Hermes format by its template, writes its calls in a fenced JSON
# block more often than not (measured: every one of 8 greedy calls of the 1.5B); Ollama reads
# those as calls, vLLM's hermes parser does not.
HERMES = ToolFormat(
    "hermes", "<tool_call>\n", "arguments", "\n</tool_call>", also_read=(("```json", "```"),)
)
LLAMA3_JSON = ToolFormat("llama3_json", "", "parameters", "", separator="; ")
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON)}


def detect(template: str | None) -> ToolFormat | None:
    """The format a chat template teaches, from the instructions it renders; None if it
    renders no tools."""
    if template is None:
        return None
    if "<tool_call>" in template:
        return HERMES
    if '"parameters": dictionary of argument name' in template or "<|python_tag|>" in template:
        return LLAMA3_JSON
    return None


def tool_format(name: str) -> ToolFormat:
    if name not in FORMATS:
        raise UserError(f"unknown tool-call format {name!r} (known: {', '.join(FORMATS)})")
    return FORMATS[name]


def _call(obj: Any, keys: tuple[str, ...]) -> ToolCall | None:
    """The call a decoded JSON object spells, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = next((obj[k] for k in keys if k in obj), None)
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _held(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could begin ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class _TaggedParser(ToolCallParser):
    """Calls between an opening and a closing tag (Hermes' ``<tool_call>`` ... ``</tool_call>``),
    anywhere in the text. A tag followed by anything but a JSON object is text."""

    def __init__(self, fmt: ToolFormat):
        self._tags = dict([(fmt.prefix.strip(), fmt.suffix.strip()), *fmt.also_read])
        self._keys = (fmt.arguments_key,)
        self._pending = ""  # text not yet released
        self._open: str | None = None  # the opening tag of the call being read
        self._space = ""  # trailing whitespace of content: dropped if a call follows
        self._after_call = False  # leading whitespace of content after a call is dropped
        self._called = False
        self._written = False  # some content was released

    def feed(self, text: str) -> Parsed:
        self._pending += text
        out = Parsed()
        while True:
            if self._open is None:
                found = [(at, tag) for tag in self._tags if (at := self._pending.find(tag)) >= 0]
                if not found:
                    held = max(_held(self._pending, tag) for tag in self._tags)
                    release = len(self._pending) - held
                    out.content += self._content(self._pending[:release])
                    self._pending = self._pending[release:]
                    return out
                at, self._open = min(found)
                out.content += self._content(self._pending[:at])
                self._pending = self._pending[at + len(self._open) :]
                continue
            body = self._pending.lstrip()
            if body and body[0] != "{":  # not a call after all
                out.content += self._content(self._open)
                self._open = None
                continue
            at = self._pending.find(self._tags[self._open])
            if at < 0:
                return out
            body = self._pending[:at]
            self._pending = self._pending[at + len(self._tags[self._open]) :]
            out += self._read_call(body, closed=True)

    def finish(self) -> Parsed:
        out = Parsed()
        if self._open is not None:  # cut off (max_tokens), or the model stopped without closing
            out += self._read_call(self._pending, closed=False)
        else:
            out.content += self._content(self._pending)
        if not self._called:
            out.content += self._space
        self._pending = self._space = ""
        return out

    def _read_call(self, body: str, closed: bool) -> Parsed:
        open_, self._open = self._open, None
        try:
            call = _call(json.loads(body), self._keys)
        except json.JSONDecodeError:
            call = None
        if call is None:  # not a call: the text as the model wrote it
            return Parsed(self._content(open_ + body + (self._tags[open_] if closed else "")))
        self._called = self._after_call = True
        self._space = "\n" if self._written else ""  # between content before and after calls
        return Parsed(calls=[call])

    def _content(self, text: str) -> str:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return ""
            self._after_call = False
        text = self._space + text
        body = text.rstrip()
        self._space = text[len(body) :]
        self._written = self._written or bool(body)
        return body


class _JsonParser(ToolCallParser):
    """Llama 3: the whole answer is one or more JSON calls (separated by ';'), or it is text. An
    answer that begins with '{' is held until it ends."""

    def __init__(self, fmt: ToolFormat):
        self._keys = (fmt.arguments_key, "arguments")
        self._text = ""
        self._json: bool | None = None  # undecided until the first non-space character

    def feed(self, text: str) -> Parsed:
        self._text += text
        if self._json is None and self._text.strip():
            self._json = self._text.lstrip().startswith("{")
            if not self._json:
                return Parsed(self._text)
            return Parsed()
        return Parsed(text) if self._json is False else Parsed()

    def finish(self) -> Parsed:
        if not self._json:
            return Parsed() if self._json is False else Parsed(self._text)
        calls = _json_calls(self._text, self._keys)
        return Parsed(calls=calls) if calls else Parsed(self._text)


def _json_calls(text: str, keys: tuple[str, ...]) -> list[ToolCall] | None:
    decoder, calls, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and (text[at].isspace() or (calls and text[at] == ";")):
            at += 1
        if at == len(text):
            return calls
        try:
            obj, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return None
        call = _call(obj, keys)
        if call is None:
            return None
        calls.append(call)
