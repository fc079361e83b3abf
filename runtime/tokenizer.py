"""Text <-> token ids and chat formatting, from the tokenizer files inside an artifact.

Built on the ``tokenizers`` library and jinja2, not on transformers, whose import pulls in
torch (``transformers.utils.generic``): together about 0.4 GiB of resident memory the runtime
never uses. ``tokenizer.json`` is what transformers' fast tokenizers run too (it ignores
``add_bos_token``/``add_eos_token`` beside one); on top of it this reproduces what
transformers adds for generation: the named special tokens, and chat templates rendered as
``apply_chat_template`` renders them, sandboxed, with its options and helpers (the tests pin
equality with transformers on the shipped tokenizers).
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

from mlc_spec.errors import UserError

from . import tool_calls

# The named special tokens transformers passes to chat templates (``special_tokens_map``).
SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class Tokenizer:
    """``chat_template``: a Jinja file that replaces the model's template (vLLM's
    ``--chat-template``); ``tool_call_parser``: the format of tool calls (``tool_calls.FORMATS``)
    where the template's is not recognised."""

    def __init__(
        self,
        artifact_dir: str | Path,
        chat_template: str | Path | None = None,
        tool_call_parser: str | None = None,
    ):
        root = Path(artifact_dir)
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(root / "tokenizer.json"))
            config = _read_json(root / "tokenizer_config.json")
            legacy = _read_json(root / "special_tokens_map.json")
            self._chat_template = _chat_template(root, config)
        except Exception as err:  # tokenizers raises plain Exception for malformed files
            raise UserError(f"cannot load the tokenizer of {artifact_dir}: {err}") from None
        if chat_template is not None:
            try:
                self._chat_template = Path(chat_template).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as err:
                raise UserError(f"cannot read the chat template {chat_template}: {err}") from None
        self._special_tokens = _named_special_tokens(config, legacy)
        self.tool_format = (
            tool_calls.tool_format(tool_call_parser)
            if tool_call_parser is not None
            else tool_calls.detect(self._chat_template)
        )

    @property
    def vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    @functools.cached_property
    def longest_token_chars(self) -> int:
        """No token covers more characters of text than this (a token's string spells its
        bytes, or its characters, or more, as ``<0x0A>`` does), so text longer than
        ``n * longest_token_chars`` cannot be n tokens or fewer: a server refuses it before
        spending seconds encoding it."""
        return max(map(len, self.vocab))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch lets go of the GIL while it works and encode does not always (measured:
        # a 1.9 MB prompt held it for 1.5 s), so a server tokenizing on a worker thread would
        # stall its event loop.
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)

    def render_chat(
        self, messages: list[dict[str, Any]], tools: list[tool_calls.Tool] | None = None
    ) -> str:
        """The chat template's text for ``messages`` (and the ``tools`` they may call), ending
        with the assistant's turn."""
        if self._chat_template is None:
            raise UserError("this model's tokenizer has no chat template; use generate()")
        if tools and self.tool_format is None:
            raise UserError(
                "tools: this model's chat template has no tool-call format (known: Qwen2.5's "
                "Hermes <tool_call> and Llama 3's JSON); serve it with --chat-template and "
                "--tool-call-parser"
            )
        template = _compile_template(self._chat_template)
        # As transformers: keys whose value is None are dropped (many templates print "None").
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            return template.render(
                **self._special_tokens,
                messages=messages,
                tools=tools or None,
                documents=None,
                add_generation_prompt=True,
            )
        except jinja2.TemplateError as err:
            raise UserError(f"the chat template rejects these messages: {err}") from None

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[tool_calls.Tool] | None = None
    ) -> list[int]:
        # The template already wrote any special tokens (BOS, role markers) as text.
        return self.encode(self.render_chat(messages, tools), add_special_tokens=False)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _named_special_tokens(config: dict[str, Any], legacy: dict[str, Any]) -> dict[str, str]:
    """The named special tokens, from tokenizer_config.json or, where it lacks one, the older
    special_tokens_map.json; each is text or an AddedToken record."""
    tokens = {}
    for name in SPECIAL_TOKENS:
        value = config[name] if name in config else legacy.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if value is not None:
            tokens[name] = value
    return tokens


def _chat_template(root: Path, config: dict[str, Any]) -> str | None:
    """The default chat template, where transformers looks for it: ``chat_template.jinja``
    first, then the config's entry (one template, or a list of named ones)."""
    path = root / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        return named.get("default")
    return template


@functools.lru_cache(maxsize=8)
def _compile_template(template: str) -> jinja2.Template:
    """The template in the environment transformers renders chat templates in
    (``chat_template_utils``): sandboxed, blocks trimmed, loop controls, and its ``tojson``,
    ``raise_exception`` and ``strftime_now``. Compiled at first use, so that a template that
    does not parse fails chat requests only."""

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        # Unlike jinja's own filter, no HTML escaping.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as err:
        raise UserError(f"the model's chat template does not parse: {err}") from None
