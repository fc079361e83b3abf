"""OpenAI request bodies -> prompt and SamplingParams; engine outputs -> OpenAI responses."""

from __future__ import annotations

import time
import uuid
from typing import Any

from mlc_spec.errors import UserError
from mlc_spec.runtime.params import SamplingParams
from mlc_spec.runtime.request import RequestOutput
from mlc_spec.runtime.tokenizer import Tokenizer

# OpenAI field -> SamplingParams field; mlc-spec/vLLM extensions are accepted as well.
_PARAM_FIELDS = {
    "max_tokens": "max_tokens",
    "max_completion_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "seed": "seed",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "n": "n",
}


def sampling_params(body: dict[str, Any]) -> SamplingParams:
    kwargs = {ours: body[theirs] for theirs, ours in _PARAM_FIELDS.items() if theirs in body}
    kwargs.setdefault("max_tokens", 16)
    try:
        return SamplingParams(**kwargs)
    except TypeError as err:
        raise UserError(f"bad sampling parameters: {err}") from None


def completion_prompt(body: dict[str, Any], tokenizer: Tokenizer) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return prompt
    raise UserError("'prompt' must be one string or one list of token ids")


def chat_prompt(body: dict[str, Any], tokenizer: Tokenizer) -> list[int]:
    messages = body.get("messages")
    if (
        not isinstance(messages, list)
        or not messages
        or not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages)
    ):
        raise UserError("'messages' must be a non-empty list of {role, content} objects")
    return tokenizer.apply_chat_template(messages)


class ResponseBuilder:
    """Accumulates increments into one response, or renders them as stream chunks."""

    def __init__(self, model: str, chat: bool, prompt_tokens: int):
        self.model, self.chat, self.prompt_tokens = model, chat, prompt_tokens
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.text: dict[int, str] = {}
        self.tokens: dict[int, int] = {}
        self.finish: dict[int, str | None] = {}

    def add(self, delta: RequestOutput) -> None:
        for out in delta.outputs:
            self.text[out.index] = self.text.get(out.index, "") + out.text
            self.tokens[out.index] = self.tokens.get(out.index, 0) + len(out.token_ids)
            self.finish[out.index] = out.finish_reason

    def chunk(self, delta: RequestOutput) -> dict[str, Any]:
        choices = []
        for out in delta.outputs:
            choice: dict[str, Any] = {"index": out.index, "finish_reason": out.finish_reason}
            if self.chat:
                choice["delta"] = {"role": "assistant", "content": out.text}
            else:
                choice["text"] = out.text
            choices.append(choice)
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(kind, choices)

    def final(self) -> dict[str, Any]:
        choices = []
        for index in sorted(self.text):
            choice: dict[str, Any] = {"index": index, "finish_reason": self.finish[index]}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": self.text[index]}
            else:
                choice["text"] = self.text[index]
            choices.append(choice)
        completion = sum(self.tokens.values())
        response = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        response["usage"] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }
        return response

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
