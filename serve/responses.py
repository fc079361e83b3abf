"""One request's engine increments -> OpenAI responses (whole) or stream chunks."""

from __future__ import annotations

import dataclasses

from mlc_spec.runtime.logprobs import TokenLogprob
from mlc_spec.runtime.metrics import SpecStats
from mlc_spec.runtime.request import CompletionOutput, RequestOutput
from mlc_spec.runtime.tokenizer import Tokenizer
from mlc_spec.runtime.tool_calls import ToolCall as ParsedCall
from mlc_spec.runtime.tool_calls import ToolCallParser, ToolFormat

from .protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    PromptTokensDetails,
    Speculation,
    ToolCall,
    TopLogprob,
    Usage,
    response_id,
)


@dataclasses.dataclass
class _Sample:
    text: str = ""
    num_tokens: int = 0
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    spec_stats: SpecStats = dataclasses.field(default_factory=SpecStats)
    reported: bool = False  # a stream chunk has gone out (the first carries the role)
    parser: ToolCallParser | None = None  # a stream's tool calls, read as they come
    num_calls: int = 0  # tool calls streamed


@dataclasses.dataclass(frozen=True)
class ToolUse:
    """A chat request that may call tools: its output is parsed in the model's format."""

    format: ToolFormat
    parallel: bool  # False: the first call only (parallel_tool_calls)


class ResponseBuilder:
    def __init__(
        self,
        chat: bool,
        model: str,
        tokenizer: Tokenizer,
        prompt_tokens: int,
        n: int,
        tools: ToolUse | None = None,
    ):
        self.chat, self.model, self.tokenizer = chat, model, tokenizer
        self.id = response_id(chat)
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = 0
        self.tools = tools
        self.samples = [_Sample(parser=tools.format.parser() if tools else None) for _ in range(n)]

    # ---- whole responses ------------------------------------------------------------------
    def add(self, delta: RequestOutput) -> None:
        self.cached_tokens = delta.num_cached_tokens
        for out in delta.outputs:
            sample = self.samples[out.index]
            sample.text += out.text
            sample.num_tokens += len(out.token_ids)
            sample.logprobs += out.logprobs or []
            sample.finish_reason = out.finish_reason
            sample.spec_stats = out.spec_stats

    def response(self, with_logprobs: bool) -> CompletionResponse | ChatCompletionResponse:
        if self.chat:
            return ChatCompletionResponse(
                id=self.id,
                model=self.model,
                choices=[
                    self._chat_choice(i, sample, with_logprobs)
                    for i, sample in enumerate(self.samples)
                ],
                usage=self.usage(),
                speculation=self.speculation(),
            )
        return CompletionResponse(
            id=self.id,
            model=self.model,
            choices=[
                CompletionChoice(
                    index=i,
                    text=s.text,
                    logprobs=self._completion_logprobs(s.logprobs, 0) if with_logprobs else None,
                    finish_reason=s.finish_reason,
                )
                for i, s in enumerate(self.samples)
            ],
            usage=self.usage(),
            speculation=self.speculation(),
        )

    def _chat_choice(self, index: int, sample: _Sample, with_logprobs: bool) -> ChatChoice:
        content, calls = sample.text, []
        if self.tools is not None:
            parsed = self.tools.format.parser().parse(sample.text)
            content, calls = parsed.content, self._kept(parsed.calls, 0)
        return ChatChoice(
            index=index,
            message=AssistantMessage(
                content=(content or None) if calls else content,
                tool_calls=[ToolCall(id=c.id, function=_function(c)) for c in calls],
            ),
            logprobs=self._chat_logprobs(sample.logprobs) if with_logprobs else None,
            finish_reason=_finish_reason(sample.finish_reason, bool(calls)),
        )

    def _kept(self, calls: list[ParsedCall], earlier: int) -> list[ParsedCall]:
        """The calls a response reports, ``earlier`` ones already reported."""
        return calls if self.tools.parallel else calls[: max(0, 1 - earlier)]

    def usage(self) -> Usage:
        completion = sum(s.num_tokens for s in self.samples)
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=completion,
            total_tokens=self.prompt_tokens + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens),
        )

    def speculation(self) -> Speculation:
        total = SpecStats()
        for sample in self.samples:
            total.merge(sample.spec_stats)
        return Speculation(**total.to_dict())

    # ---- streaming ------------------------------------------------------------------------
    def chunk(
        self, delta: RequestOutput, with_logprobs: bool
    ) -> CompletionResponse | ChatCompletionChunk | None:
        """The stream chunk of one increment (after ``add``); None if it carries nothing."""
        outs = [o for o in delta.outputs if o.token_ids or o.text or o.finish_reason]
        outs = [o for o in outs if not (self.samples[o.index].reported and not o.token_ids)]
        if not outs:
            return None
        if self.chat:
            choices = [self._chat_chunk_choice(o, with_logprobs) for o in outs]
            return ChatCompletionChunk(id=self.id, model=self.model, choices=choices)
        choices = [self._completion_chunk_choice(o, with_logprobs) for o in outs]
        return CompletionResponse(id=self.id, model=self.model, choices=choices)

    def usage_chunk(self) -> CompletionResponse | ChatCompletionChunk:
        """The last chunk with ``stream_options.include_usage``: no choices, the usage."""
        kind = ChatCompletionChunk if self.chat else CompletionResponse
        return kind(
            id=self.id,
            model=self.model,
            choices=[],
            usage=self.usage(),
            speculation=self.speculation(),
        )

    def _chat_chunk_choice(self, out: CompletionOutput, with_logprobs: bool) -> ChatChunkChoice:
        sample = self.samples[out.index]
        first = not sample.reported
        sample.reported = True
        content, calls, called = out.text, [], False
        if sample.parser is not None:
            parsed = sample.parser.feed(out.text)
            if out.finish_reason is not None:
                parsed += sample.parser.finish()
            content, calls = parsed.content, self._kept(parsed.calls, sample.num_calls)
            called = sample.num_calls + len(calls) > 0
        delta_calls = [
            DeltaToolCall(index=sample.num_calls + i, id=c.id, function=_function(c))
            for i, c in enumerate(calls)
        ]
        sample.num_calls += len(calls)
        return ChatChunkChoice(
            index=out.index,
            delta=DeltaMessage(
                role="assistant" if first else None,
                content=(content or None) if delta_calls else content,
                tool_calls=delta_calls or None,
            ),
            logprobs=self._chat_logprobs(out.logprobs or []) if with_logprobs else None,
            finish_reason=_finish_reason(out.finish_reason, called),
        )

    def _completion_chunk_choice(
        self, out: CompletionOutput, with_logprobs: bool
    ) -> CompletionChoice:
        sample = self.samples[out.index]
        sample.reported = True
        start = len(sample.text) - len(out.text)  # ``add`` has appended this increment
        logprobs = self._completion_logprobs(out.logprobs or [], start) if with_logprobs else None
        return CompletionChoice(
            index=out.index, text=out.text, logprobs=logprobs, finish_reason=out.finish_reason
        )

    # ---- logprobs in OpenAI's two layouts ---------------------------------------------------
    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _completion_logprobs(self, entries: list[TokenLogprob], start: int) -> CompletionLogprobs:
        tokens = [self._token_text(e.token_id) for e in entries]
        offsets = [start + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[e.logprob for e in entries],
            top_logprobs=[{self._token_text(t): lp for t, lp in e.top} for e in entries],
            text_offset=offsets,
        )

    def _chat_logprobs(self, entries: list[TokenLogprob]) -> ChatLogprobs:
        def top(token_id: int, logprob: float) -> TopLogprob:
            text = self._token_text(token_id)
            return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

        return ChatLogprobs(
            content=[
                ChatTokenLogprob(
                    **top(e.token_id, e.logprob).model_dump(),
                    top_logprobs=[top(t, lp) for t, lp in e.top],
                )
                for e in entries
            ]
        )


def _function(call: ParsedCall) -> FunctionCall:
    return FunctionCall(name=call.name, arguments=call.arguments)


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's ``tool_calls`` where a sample that called tools stopped by itself."""
    return "tool_calls" if reason == "stop" and called else reason
