"""``mlc-spec serve``: the OpenAI-compatible HTTP server, FastAPI on uvicorn.

Endpoints: POST /v1/completions and /v1/chat/completions (``"stream": true`` as server-sent
events), GET /v1/models, /health, /metrics (Prometheus). Every error is OpenAI's error object:
400 for bad input, 404 for an unknown model or route, 503 with ``Retry-After`` when the
waiting queue is full. What is specific to this engine is written here; HTTP, validation and
metrics exposition are the libraries'.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException

from mlc_spec.errors import UserError
from mlc_spec.runtime.llm import LLM

from .async_engine import AsyncEngine, Overloaded, RequestStream
from .metrics import ServerMetrics
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from .responses import ResponseBuilder

T = TypeVar("T")

RETRY_AFTER_SECONDS = 1
_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 503: "overloaded_error"}


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


def build_app(llm: LLM, model_name: str, max_waiting: int) -> FastAPI:
    """The app; its engine thread runs from startup to shutdown (``app.state.engine``)."""
    metrics = ServerMetrics(model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.engine = AsyncEngine(llm.engine, metrics, max_waiting)
        yield
        app.state.engine.shutdown()

    app = FastAPI(title="mlc-spec", lifespan=lifespan)
    app.state.metrics = metrics
    context_length = llm.model.context_length
    tokenizer = llm.tokenizer

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0]
        loc = [str(p) for p in first["loc"] if p != "body"]
        where = f"{'.'.join(loc)}: " if loc else ""
        return error_response(
            400, where + first["msg"].removeprefix("Value error, "), ".".join(loc) or None
        )

    @app.exception_handler(UserError)
    async def _user_error(_: Request, err: UserError) -> JSONResponse:
        return error_response(400, str(err))

    @app.exception_handler(ModelNotFound)
    async def _no_model(_: Request, err: ModelNotFound) -> JSONResponse:
        return error_response(404, str(err), "model")

    @app.exception_handler(Overloaded)
    async def _overloaded(_: Request, err: Overloaded) -> JSONResponse:
        message = f"server overloaded: {err}; retry later"
        return error_response(503, message, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, err: HTTPException) -> JSONResponse:
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

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        prompt = tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else body.prompt
        return await _serve(raw, body, prompt, chat=False, with_logprobs=body.logprobs is not None)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        prompt = tokenizer.apply_chat_template(body.conversation())
        return await _serve(raw, body, prompt, chat=True, with_logprobs=body.logprobs)

    async def _serve(
        raw: Request,
        body: CompletionRequest | ChatCompletionRequest,
        prompt: list[int],
        chat: bool,
        with_logprobs: bool,
    ) -> Response:
        if body.model != model_name:
            raise ModelNotFound(f"model '{body.model}' does not exist; this serves '{model_name}'")
        params = body.sampling_params(llm.engine.max_sequence_len(body.n) - len(prompt))
        stream = await raw.app.state.engine.add(prompt, params)
        builder = ResponseBuilder(chat, model_name, tokenizer, len(prompt), params.n)
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


async def _collect(stream: RequestStream, builder: ResponseBuilder) -> None:
    async for delta in stream:
        builder.add(delta)


async def _events(
    stream: RequestStream, builder: ResponseBuilder, with_logprobs: bool, include_usage: bool
) -> AsyncIterator[str]:
    """Server-sent events; the client leaving cancels this, and ``close`` aborts the request."""
    try:
        async for delta in stream:
            builder.add(delta)
            chunk = builder.chunk(delta, with_logprobs)
            if chunk is not None:
                yield f"data: {chunk.model_dump_json()}\n\n"
        if include_usage:
            yield f"data: {builder.usage_chunk().model_dump_json()}\n\n"
    except Exception as err:  # noqa: BLE001 - the engine failed mid-stream: say so, then end
        error = ErrorInfo(message=f"generation failed: {err}", type="server_error", code=500)
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
    if task.cancelled():
        raise ClientGone
    return task.result()


def serve(
    llm: LLM,
    model_name: str,
    host: str,
    port: int,
    max_waiting: int,
    announce: Callable[[str], None] = print,
) -> None:
    """Serve until interrupted; ``port`` 0 picks a free one (announced with the URL)."""
    sock = socket.create_server((host, port))
    announce(f"serving {model_name} on http://{host}:{sock.getsockname()[1]}/v1")
    app = build_app(llm, model_name, max_waiting)
    config = uvicorn.Config(app, log_level="warning", access_log=False)
    uvicorn.Server(config).run(sockets=[sock])
