"""``mlc-spec serve``: the OpenAI-compatible HTTP server, FastAPI on uvicorn.

Endpoints: POST /v1/completions and /v1/chat/completions (``"stream": true`` as server-sent
events), GET /v1/models, /health, /metrics (Prometheus), /stats (the engine's phases and the
speculation policy's decisions against measured step times). Every error is OpenAI's error object:
400 for bad input, 401 without the API key, 404 for an unknown model or route, 413 for a body
past ``max_request_bytes``, 503 with ``Retry-After`` when the waiting queue is full or the
server is shutting down. No request can stall the others: bodies are bounded before they are
read whole, prompts are tokenized off the event loop, and a client that stops reading is cut
off once its unread output passes a bound. What is specific to this engine is written here;
HTTP, validation and metrics exposition are the libraries'.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import json
import logging
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException

from mlc_spec.errors import UserError
from mlc_spec.runtime.llm import LLM

from .async_engine import AsyncEngine, Overloaded, RequestStream, StreamEnded
from .guards import ApiKeyRequired, BodyLimit, too_large
from .metrics import ServerMetrics
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from .responses import ResponseBuilder, ToolUse
from .shutdown import GracefulServer

T = TypeVar("T")

RETRY_AFTER_SECONDS = 1
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "invalid_request_error",
    503: "overloaded_error",
}
# Validation errors of a value out of its field's bounds, which name only the bound it broke.
_OUT_OF_RANGE = (
    "greater_than",
    "greater_than_equal",
    "less_than",
    "less_than_equal",
    "finite_number",
)
# Unicode normalization (NFC) can fold up to three characters into one before tokenizing.
_NORMALIZATION_FOLD = 3


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """What ``mlc-spec serve`` bounds; defaults are the CLI's."""

    max_waiting: int = 256
    max_request_bytes: int = 4 << 20
    max_stream_backlog: int = 1024  # tokens produced for a stream and not yet sent
    shutdown_timeout: float = 30.0
    api_key: str | None = None
    enable_docs: bool = False

    def __post_init__(self) -> None:
        for name in ("max_waiting", "max_request_bytes", "max_stream_backlog"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.shutdown_timeout >= 0:
            raise UserError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")


class ModelNotFound(Exception):
    pass


def error_response(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    error = ErrorInfo(
        message=message,
        type=_ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
        param=param,
        code=status,
    )
    return JSONResponse(ErrorResponse(error=error).model_dump(), status, headers)


def build_app(llm: LLM, model_name: str, config: ServerConfig = ServerConfig()) -> FastAPI:
    """The app; its engine thread runs from startup to shutdown (``app.state.engine``)."""
    metrics = ServerMetrics(model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.engine = AsyncEngine(
            llm.engine, metrics, config.max_waiting, config.max_stream_backlog
        )
        yield
        app.state.engine.shutdown()

    docs = {} if config.enable_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="mlc-spec", lifespan=lifespan, **docs)
    # The last added runs first: the key is checked before the size.
    app.add_middleware(BodyLimit, limit=config.max_request_bytes, error=error_response)
    if config.api_key:
        app.add_middleware(ApiKeyRequired, api_key=config.api_key, error=error_response)
    app.state.metrics = metrics
    context_length = llm.model.context_length
    tokenizer = llm.tokenizer
    longest_text = context_length * tokenizer.longest_token_chars * _NORMALIZATION_FOLD
    request_models = {
        "/v1/completions": CompletionRequest,
        "/v1/chat/completions": ChatCompletionRequest,
    }

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        # The most specific error: of a union's members, the one that matched the input's shape.
        first = max(err.errors(), key=lambda e: len(e["loc"]))
        if first["type"] == "json_invalid":
            where = f" at character {first['loc'][-1]}" if len(first["loc"]) > 1 else ""
            return error_response(
                400, f"the body is not valid JSON: {first['ctx']['error']}{where}"
            )
        # Union members (``str``, ``function-after[...]``) name no field a client sent.
        loc = [str(p) for p in first["loc"][1:] if not _is_union_tag(p)]
        message = first["msg"].removeprefix("Value error, ")
        model = request_models.get(request.url.path)
        allowed = model.allowed_range(loc[0]) if model and len(loc) == 1 else None
        if allowed and first["type"] in _OUT_OF_RANGE:
            message += f" (allowed: {allowed})"
        field = ".".join(loc)
        return error_response(400, f"{field}: {message}" if field else message, field or None)

    @app.exception_handler(UserError)
    async def _user_error(_: Request, err: UserError) -> JSONResponse:
        return error_response(400, str(err))

    @app.exception_handler(ModelNotFound)
    async def _no_model(_: Request, err: ModelNotFound) -> JSONResponse:
        return error_response(404, str(err), "model")

    @app.exception_handler(Overloaded)
    async def _overloaded(_: Request, err: Overloaded) -> JSONResponse:
        message = f"server unavailable: {err}; retry later"
        return error_response(503, message, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})

    @app.exception_handler(StreamEnded)
    async def _ended(_: Request, err: StreamEnded) -> JSONResponse:
        return error_response(err.status, str(err))

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, err: HTTPException) -> JSONResponse:
        if err.status_code == 413:  # a chunked body, past the limit as it was read
            return error_response(413, too_large(config.max_request_bytes))
        return error_response(err.status_code, str(err.detail))

    @app.exception_handler(Exception)
    async def _server_error(_: Request, err: Exception) -> JSONResponse:
        return error_response(500, f"internal error: {type(err).__name__}: {err}")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, max_model_len=context_length)])

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        """The engine's own figures: speculation counters, seconds and calls per phase, and the
        speculation policy's recent decisions, predicted against measured step times."""
        return await app.state.engine.engine_metrics()

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        _check_model(body.model)
        if isinstance(body.prompt, str):
            _check_fits(len(body.prompt), "prompt")
            prompt = await _tokenize(raw, tokenizer.encode, body.prompt)
        else:
            prompt = body.prompt
        return await _serve(raw, body, prompt, chat=False, with_logprobs=body.logprobs is not None)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        _check_model(body.model)
        conversation, tools = body.conversation(), body.tool_list()
        text = sum(len(m["content"] or "") for m in conversation) + len(json.dumps(tools))
        _check_fits(text, "messages")
        prompt = await _tokenize(
            raw, lambda c: tokenizer.apply_chat_template(c, tools), conversation
        )
        # Past the template: a model given tools has a tool-call format (render_chat checks).
        tool_use = (
            ToolUse(tokenizer.tool_format, body.parallel_tool_calls) if body.calls_tools else None
        )
        return await _serve(
            raw, body, prompt, chat=True, with_logprobs=body.logprobs, tools=tool_use
        )

    def _check_model(name: str) -> None:
        """Before the prompt is tokenized: a request for another model costs nothing."""
        if name != model_name:
            raise ModelNotFound(f"model '{name}' does not exist; this serves '{model_name}'")

    def _check_fits(num_chars: int, field: str) -> None:
        if num_chars > longest_text:
            raise UserError(
                f"{field}: {num_chars} characters cannot fit in the model's context length "
                f"{context_length}"
            )

    async def _tokenize(raw: Request, encode: Callable[[T], list[int]], text: T) -> list[int]:
        """On a worker thread (the tokenizer releases the GIL), so that a long prompt never
        holds up /health or the tokens of running streams; refused first when the queue is
        full, so that an overloaded server does not tokenize what it will refuse."""
        raw.app.state.engine.check_admission()
        return await asyncio.to_thread(encode, text)

    async def _serve(
        raw: Request,
        body: CompletionRequest | ChatCompletionRequest,
        prompt: list[int],
        chat: bool,
        with_logprobs: bool,
        tools: ToolUse | None = None,
    ) -> Response:
        params = body.sampling_params(
            llm.engine.max_sequence_len(body.n) - len(prompt),
            llm.sampling_defaults,
            tokenizer.tool_format,
        )
        stream = await raw.app.state.engine.add(prompt, params)
        builder = ResponseBuilder(chat, model_name, tokenizer, len(prompt), params.n, tools)
        if body.stream:
            events = _events(stream, builder, with_logprobs, body.include_usage)
            return StreamingResponse(
                events, media_type="text/event-stream", background=BackgroundTask(stream.close)
            )
        try:
            await _unless_disconnected(raw, _collect(stream, builder))
        except ClientGone:
            return Response(status_code=499)  # nobody reads it: the request was aborted
        finally:
            stream.close()
        return JSONResponse(builder.response(with_logprobs).model_dump())

    return app


def _is_union_tag(loc: int | str) -> bool:
    return isinstance(loc, str) and ("[" in loc or loc in ("str", "int", "float", "bool"))


async def _collect(stream: RequestStream, builder: ResponseBuilder) -> None:
    async for delta in stream:
        builder.add(delta)


async def _events(
    stream: RequestStream, builder: ResponseBuilder, with_logprobs: bool, include_usage: bool
) -> AsyncIterator[str]:
    """Server-sent events. The client leaving cancels this, and ``close`` aborts the request;
    a stream the server ends (shutdown, a failed step, a client too slow) ends with an error
    event, then ``[DONE]``, as every stream does."""
    try:
        async for delta in stream:
            builder.add(delta)
            chunk = builder.chunk(delta, with_logprobs)
            if chunk is not None:
                yield f"data: {chunk.model_dump_json()}\n\n"
        if include_usage:
            yield f"data: {builder.usage_chunk().model_dump_json()}\n\n"
    except Exception as err:  # noqa: BLE001 - the stream ended mid-way: say so, then end
        status = err.status if isinstance(err, StreamEnded) else 500
        message = str(err) if isinstance(err, StreamEnded) else f"generation failed: {err}"
        error = ErrorInfo(
            message=message, type=_ERROR_TYPES.get(status, "server_error"), code=status
        )
        yield f"data: {ErrorResponse(error=error).model_dump_json()}\n\n"
    finally:
        stream.close()
    yield "data: [DONE]\n\n"


class ClientGone(Exception):
    pass


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client disconnects first (then cancel it, raise ClientGone)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            # A cancelled task is not done until it has run once more: wait for that.
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone
    return task.result()


def overlaps_host_work(pool_threads: int) -> bool:
    """Whether steps should run asynchronously (``async_scheduling``) by default: only where
    TVM's thread pools (``pool_threads`` in all, across replicas) leave a core for the host.
    With every core in a pool, the engine's and the server's Python preempt a pool thread
    mid-pass and the whole pass waits for it at the next barrier, which eats what the overlap
    saves: on 2 cores synchronous steps served as much or slightly more
    (docs/benchmarks-serving.md, async scheduling)."""
    return pool_threads < len(os.sched_getaffinity(0))


def limit_malloc_arenas(arenas: int = 2) -> None:
    """Call before the engine's threads start. glibc gives threads malloc arenas of their own;
    the VM's buffers, allocated on the step thread and freed after each prefill pass
    (``release_pooled_buffers``), then fragment them and the server's RSS creeps up (measured:
    +6% in 80 s of mixed prompts with async scheduling, flat with 2 arenas). Elsewhere than
    glibc, nothing is done."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(-8, arenas)  # M_ARENA_MAX


def serve(
    llm: LLM,
    model_name: str,
    host: str,
    port: int,
    config: ServerConfig,
    announce: Callable[[str], None] = print,
) -> None:
    """Serve until SIGTERM or SIGINT; ``port`` 0 picks a free one (announced with the URL)."""
    log = logging.getLogger("mlc_spec.serve")  # disconnects and shutdown, one line each
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    sock = socket.create_server((host, port))
    # Inherited by every accepted connection. asyncio sets it only on sockets made with
    # proto=IPPROTO_TCP, which create_server's are not; without it Nagle's algorithm holds a
    # response's second write until the client's delayed ACK: 40 ms on every keep-alive request.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    announce(f"serving {model_name} on http://{host}:{sock.getsockname()[1]}/v1")
    app = build_app(llm, model_name, config)
    uv_config = uvicorn.Config(app, log_level="warning", access_log=False)
    GracefulServer(uv_config, lambda: app.state.engine, config.shutdown_timeout).run(sockets=[sock])
