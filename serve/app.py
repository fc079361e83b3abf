"""``mlc-spec serve``: OpenAI-compatible HTTP endpoints on the runtime engine.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with ``"stream": true`` as
server-sent events), GET /v1/models, GET /health, GET /metrics (Prometheus text, counters
named after vLLM's ``spec_decode`` metrics).
"""

from __future__ import annotations

import itertools
import json
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from mlc_spec.errors import UserError
from mlc_spec.runtime.llm import LLM

from .engine_loop import EngineLoop
from .protocol import ResponseBuilder, chat_prompt, completion_prompt, sampling_params


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, llm: LLM, model_name: str, host: str = "127.0.0.1", port: int = 8000):
        self.llm = llm
        self.model_name = model_name
        self.loop = EngineLoop(llm.engine)
        super().__init__((host, port), Handler)

    def server_close(self) -> None:
        super().server_close()
        self.loop.shutdown()


class Handler(BaseHTTPRequestHandler):
    server: Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass  # one line per request on stderr is noise under load

    def do_GET(self) -> None:  # noqa: N802 - stdlib naming
        if self.path == "/health":
            self._json(HTTPStatus.OK, {"status": "ok"})
        elif self.path == "/v1/models":
            model = {"id": self.server.model_name, "object": "model", "owned_by": "mlc-spec"}
            self._json(HTTPStatus.OK, {"object": "list", "data": [model]})
        elif self.path == "/metrics":
            self._send(HTTPStatus.OK, "text/plain; version=0.0.4", self._metrics().encode())
        else:
            self._error(HTTPStatus.NOT_FOUND, f"no route {self.path}")

    def do_POST(self) -> None:  # noqa: N802 - stdlib naming
        chat = self.path == "/v1/chat/completions"
        if not chat and self.path != "/v1/completions":
            self._error(HTTPStatus.NOT_FOUND, f"no route {self.path}")
            return
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            if not isinstance(body, dict):
                raise UserError("the request body must be a JSON object")
            tokenizer = self.server.llm.tokenizer
            prompt = chat_prompt(body, tokenizer) if chat else completion_prompt(body, tokenizer)
            params = sampling_params(body)
            response = ResponseBuilder(self.server.model_name, chat, len(prompt))
            stream = self.server.loop.generate(prompt, params)
            first = next(stream)  # bad input surfaces here, before any header is sent
        except (UserError, ValueError) as err:
            self._error(HTTPStatus.BAD_REQUEST, str(err))
            return
        if body.get("stream"):
            self._stream(response, first, stream)
            return
        try:
            for delta in itertools.chain([first], stream):
                response.add(delta)
        except Exception as err:  # noqa: BLE001 - the engine failed this request
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"generation failed: {err}")
            return
        self._json(HTTPStatus.OK, response.final())

    def _stream(self, response: ResponseBuilder, first, stream) -> None:
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        try:
            for delta in itertools.chain([first], stream):
                self.wfile.write(f"data: {json.dumps(response.chunk(delta))}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
        except (BrokenPipeError, ConnectionResetError):
            stream.close()  # the client left: abort the request, free its pages
        self.close_connection = True

    def _metrics(self) -> str:
        stats = self.server.llm.engine.stats
        lines = []
        for name, value in (
            ("spec_decode_num_drafts_total", stats.num_drafts),
            ("spec_decode_num_draft_tokens_total", stats.num_draft_tokens),
            ("spec_decode_num_accepted_tokens_total", stats.num_accepted_tokens),
        ):
            lines += [f"# TYPE mlc_spec:{name} counter", f"mlc_spec:{name} {value}"]
        lines.append("# TYPE mlc_spec:spec_decode_num_accepted_tokens_per_pos_total counter")
        lines += [
            f'mlc_spec:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}} {count}'
            for i, count in enumerate(stats.accepted_per_position)
        ]
        return "\n".join(lines) + "\n"

    def _json(self, status: HTTPStatus, payload: dict[str, Any]) -> None:
        self._send(status, "application/json", json.dumps(payload).encode())

    def _error(self, status: HTTPStatus, message: str) -> None:
        kind = {
            HTTPStatus.BAD_REQUEST: "invalid_request_error",
            HTTPStatus.NOT_FOUND: "not_found",
        }.get(status, "server_error")
        self._json(status, {"error": {"message": message, "type": kind, "code": status.value}})

    def _send(self, status: HTTPStatus, content_type: str, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
