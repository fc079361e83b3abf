"""Requests refused before their body is read: too large (413) or without the API key (401).

Plain ASGI middlewares, so the refusal costs the server nothing, whatever the body; both answer
with OpenAI's error object (FastAPI's own ``max_body_size`` answers in plain text).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

ErrorResponder = Callable[[int, str], Response]


def too_large(limit: int) -> str:
    return f"the request body is over {limit} bytes, this server's limit (--max-request-bytes)"


class BodyLimit:
    """A declared ``Content-Length`` past the limit is answered at once; a chunked body is
    counted as it is read and refused (``HTTPException(413)`` to the app's handler) when it
    passes the limit."""

    def __init__(self, app: ASGIApp, limit: int, error: ErrorResponder):
        self.app, self._limit, self._error = app, limit, error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self._limit:
            response = self._error(413, too_large(self._limit))
            # Close the connection after the answer: kept alive, uvicorn would read the rest
            # of the body on the event loop to reach the next request.
            response.headers["Connection"] = "close"
            await response(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self._limit:
                raise HTTPException(413)
            return message

        await self.app(scope, counted, send)


class ApiKeyRequired:
    """``Authorization: Bearer KEY`` on ``/v1/*``, as vLLM's ``--api-key``; ``/health`` and
    ``/metrics`` stay open for probes and scrapers."""

    def __init__(self, app: ASGIApp, api_key: str, error: ErrorResponder):
        self.app, self._expected, self._error = app, f"Bearer {api_key}".encode(), error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = Headers(scope=scope).get("authorization", "").encode()
            if not secrets.compare_digest(given, self._expected):
                message = "a valid API key is required: Authorization: Bearer KEY"
                await self._error(401, message)(scope, receive, send)
                return
        await self.app(scope, receive, send)
