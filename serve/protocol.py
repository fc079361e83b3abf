"""The OpenAI API schema for what this server answers, as pydantic models.

Requests are validated strictly (a string is not a number) and turned into ``SamplingParams``;
fields the engine cannot honour (penalties, logit bias, echo, the deprecated ``functions``) are
refused with a 400 rather than silently ignored. Chat requests may carry ``tools``
(``runtime/tool_calls.py``). Other unknown fields are ignored, as OpenAI's own server and vLLM
do. ``top_k``, ``stop_token_ids``, ``ignore_eos``, ``num_speculative_tokens``,
``speculative_method`` and the structured-output fields ``guided_json``, ``guided_regex``,
``guided_choice`` and ``guided_grammar`` are vLLM-style extra fields; ``response_format``
(``json_object``, ``json_schema``) is OpenAI's.
"""

from __future__ import annotations

import json
import time
import uuid
from abc import abstractmethod
from typing import Annotated, Any, Literal

import annotated_types
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from mlc_spec.runtime.params import SamplingParams
from mlc_spec.runtime.tool_calls import Tool, ToolFormat

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs
INT64 = {"ge": -(2**63), "le": 2**63 - 1}  # OpenAI's range for seed


def _valid_unicode(text: str) -> str:
    """JSON may carry a lone surrogate (``"\\ud800"``), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(
            f"a lone surrogate at character {err.start} is not valid Unicode text"
        ) from None
    return text


_BOUNDS = (
    (annotated_types.Ge, "ge", ">="),
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Le, "le", "<="),
    (annotated_types.Lt, "lt", "<"),
)
Text = Annotated[str, AfterValidator(_valid_unicode)]
TokenId = Annotated[int, Field(ge=0)]


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    # OpenAI's field is named "schema"; pydantic's BaseModel reserves that attribute name.
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # the output follows the schema either way


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("type json_schema comes with json_schema, and only it")
        return self


# vLLM's structured-output fields and the ``StructuredOutput`` field each one sets.
_STRUCTURED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
# What a request that sets none of these gets from a model that recommends none.
_OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}


class _SamplingRequest(_Request):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    # None: the model's recommended setting (the artifact's), else OpenAI's default.
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1)
    n: int = Field(1, ge=1)
    seed: int | None = Field(None, **INT64)
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    num_speculative_tokens: int | None = Field(None, ge=0)
    speculative_method: Literal["draft", "draft_tree", "ngram", "suffix"] | None = None
    # Accepted only at their no-op values: anything else would be silently wrong.
    presence_penalty: float = Field(0.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[Text] | None = Field(None, min_length=1)
    guided_grammar: str | None = None

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> _SamplingRequest:
        for field in ("functions", "function_call"):
            if getattr(self, field) is not None:
                raise ValueError(f"'{field}' is deprecated and not supported: use tools")
        given = self._constraints()
        if len(given) > 1:
            raise ValueError(f"give one structured-output constraint, not {' and '.join(given)}")
        if self.presence_penalty or self.frequency_penalty:
            raise ValueError("presence_penalty and frequency_penalty are not supported")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    def _constraints(self) -> list[str]:
        """The structured-output fields this request sets."""
        given = [f for f in _STRUCTURED if getattr(self, f) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            given.append("response_format")
        return given

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @classmethod
    def allowed_range(cls, field: str) -> str | None:
        """``0 <= temperature <= 2``: a numeric field's bounds, for error messages."""
        info = cls.model_fields.get(field)
        if info is None:
            return None
        bounds = [
            f"{field} {op} {getattr(m, attr)}"
            for m in info.metadata
            for kind, attr, op in _BOUNDS
            if isinstance(m, kind)
        ]
        return " and ".join(bounds) or None

    def sampling_params(
        self, room: int, defaults: dict[str, Any], tool_format: ToolFormat | None = None
    ) -> SamplingParams:
        """``room``: tokens each sample may hold after the prompt (context or KV budget);
        ``defaults``: the model's recommended settings, for the fields the request left out;
        ``tool_format``: how the model calls tools."""
        settings = {**_OPENAI_DEFAULTS, **defaults}
        given = {f: getattr(self, f) for f in _OPENAI_DEFAULTS if getattr(self, f) is not None}
        return SamplingParams(
            max_tokens=self._max_tokens(room),
            **{**settings, **given},
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            n=self.n,
            logprobs=self._logprobs(),
            num_speculative_tokens=self.num_speculative_tokens,
            speculative_method=self.speculative_method,
            structured_output=self._structured_output(tool_format),
        )

    def _structured_output(self, tool_format: ToolFormat | None) -> dict[str, Any] | None:
        """The request's constraint in ``StructuredOutput``'s form, or None."""
        for field, kind in _STRUCTURED.items():
            if getattr(self, field) is not None:
                return {kind: getattr(self, field)}
        response_format = self.response_format
        if response_format is None or response_format.type == "text":
            return None
        if response_format.type == "json_object":
            return {"json_object": True}
        return {"json": response_format.json_schema.json_schema}

    @abstractmethod
    def _max_tokens(self, room: int) -> int: ...

    @abstractmethod
    def _logprobs(self) -> int | None: ...


class CompletionRequest(_SamplingRequest):
    prompt: Text | list[TokenId]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    tools: Any = None
    tool_choice: Any = None

    @model_validator(mode="after")
    def _refuse_completion_only(self) -> CompletionRequest:
        if self.tools is not None or self.tool_choice is not None:
            raise ValueError("tools apply to /v1/chat/completions, not to completions")
        if self.echo or self.suffix is not None:
            raise ValueError("echo and suffix are not supported")
        if self.best_of not in (None, self.n):
            raise ValueError("best_of is not supported (use n)")
        return self

    def _max_tokens(self, room: int) -> int:
        return self.max_tokens or 16  # OpenAI's default for completions

    def _logprobs(self) -> int | None:
        return self.logprobs


class TextPart(_Request):
    type: Literal["text"]
    text: Text


# OpenAI's letters, digits, '_' and '-' (up to 64), and '.' as in namespaced tool names.
FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class FunctionDefinition(_Request):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None  # false: forced calls' arguments are any JSON object


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class CalledFunction(_Request):
    name: str
    arguments: str  # JSON text, as OpenAI sends it back

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, arguments: str) -> str:
        try:
            value = json.loads(arguments)
        except json.JSONDecodeError as err:
            raise ValueError(f"is not valid JSON: {err}") from None
        if not isinstance(value, dict):
            raise ValueError("must be a JSON object")
        return arguments


class AssistantToolCall(_Request):
    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    tool_calls: list[AssistantToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # which call a tool message answers

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: Any) -> Any:
        """Say what is wrong in one line, not once per member of the union."""
        if isinstance(content, list):
            for i, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind != "text":
                    raise ValueError(f"part {i} is of type {kind!r}; this model reads text only")
        elif content is not None and not isinstance(content, str):
            raise ValueError("must be a string or a list of text parts")
        return content

    @model_validator(mode="after")
    def _fields_of_the_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls belong to assistant messages, not to {self.role}")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (but for an assistant's tool calls)")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def text(self) -> str | None:
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def template_message(self) -> dict[str, Any]:
        """As chat templates read it (transformers' convention): a call's arguments as an
        object, not as JSON text."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": c.type, "function": {"name": c.function.name,
                 "arguments": json.loads(c.function.arguments)}}
                for c in self.tool_calls
            ]  # fmt: skip
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self

    @model_validator(mode="after")
    def _tool_choice_among_tools(self) -> ChatCompletionRequest:
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) < len(names):
            raise ValueError("tools: two functions share a name")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            listed = ", ".join(names) or "none"
            raise ValueError(
                f"tool_choice names function '{choice.function.name}', which is not among "
                f"tools ({listed})"
            )
        if choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        if self.forced_tools and self._constraints():
            raise ValueError(
                f"a forced tool_choice is a constraint of its own: drop {self._constraints()[0]}"
            )
        return self

    @property
    def calls_tools(self) -> bool:
        """Tools are offered and may be called (``tool_choice`` is not ``none``)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forced_tools(self) -> bool:
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    def tool_list(self) -> list[Tool] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def conversation(self) -> list[dict[str, Any]]:
        return [m.template_message() for m in self.messages]

    def _structured_output(self, tool_format: ToolFormat | None) -> dict[str, Any] | None:
        if not self.forced_tools or tool_format is None:
            return super()._structured_output(tool_format)
        choice = self.tool_choice
        choice = choice if isinstance(choice, str) else choice.model_dump()
        tag = tool_format.structural_tag(self.tool_list(), choice, self.parallel_tool_calls)
        return {"structural_tag": tag}

    def _max_tokens(self, room: int) -> int:
        # As OpenAI and vLLM: without a limit, a chat answer may fill the context.
        return self.max_completion_tokens or self.max_tokens or max(room, 1)

    def _logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# ---- responses ------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose K/V came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class Speculation(BaseModel):
    """Per-request speculation statistics (all samples together), beside ``usage``."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: list[int]
    acceptance_rate: float
    mean_accepted_length: float


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] = []


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class DeltaToolCall(ToolCall):
    index: int  # the call's place among the sample's calls


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: Usage | None = None
    speculation: Speculation | None = None


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "mlc-spec"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


def response_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
