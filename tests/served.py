"""A server on a loopback port for the server tests, run by uvicorn on a thread of this process."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from mlc_spec import LLM
from mlc_spec.serve.app import ServerConfig, build_app
from mlc_spec.serve.launch import start_server

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


class Served:
    """A server on a free loopback port, run by uvicorn on a thread of this process."""

    def __init__(self, llm: LLM, config: ServerConfig, send_buffer: int | None = None):
        self.llm = llm
        sock = socket.create_server(("127.0.0.1", 0))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as serve() does
        if send_buffer:  # inherited by the connections it accepts
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(
            build_app(llm, "tiny", config), log_level="warning", access_log=False
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]})
        self._thread.start()
        while not self._server.started:
            time.sleep(0.01)

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join()

    def client(self, api_key: str = "-") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0)

    def async_client(self, api_key: str = "-") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0)

    def metrics(self) -> dict[str, float]:
        return metrics(self.url)

    def wait_idle(self) -> dict[str, float]:
        """Metrics once no request runs or waits (the engine thread updates them each loop)."""
        for _ in range(200):
            m = self.metrics()
            if m["mlc_spec:num_requests_running"] == m["mlc_spec:num_requests_waiting"] == 0:
                return m
            time.sleep(0.05)
        raise AssertionError(f"requests still in flight: {m}")


@contextlib.contextmanager
def serving(llm: LLM, send_buffer: int | None = None, **config) -> Iterator[Served]:
    served = Served(llm, ServerConfig(**{"max_waiting": 64, **config}), send_buffer)
    try:
        yield served
    finally:
        served.close()


def metrics(url: str) -> dict[str, float]:
    """A server's /metrics samples by name and labels (the model_name label left out)."""
    text = httpx.get(f"{url}/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in s.labels.items() if k != "model_name")
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


class ServeProcess:
    """``mlc-spec serve`` as users run it: its own process, its signal handling, its exit code."""

    def __init__(self, artifact, *args: str, env: dict[str, str | None] | None = None):
        """``env``: over this process's environment (a variable set to None: left out)."""
        serve_args = ["--model", str(artifact), "--served-model-name", "tiny", *args]
        env = {"TVM_NUM_THREADS": "2", **os.environ, **(env or {})}
        env = {k: v for k, v in env.items() if v is not None}
        # Its log goes to a file: a pipe nobody reads until the end would fill and block it.
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed in __exit__)
        self.process, base, self.announced = start_server(serve_args, env, stderr=self.log)
        self.url = base.removesuffix("/v1")

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.communicate()
        self.log.close()

    def logged(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def finish(self, timeout: float) -> tuple[int, str]:
        """The exit code and what the server logged, once it exits (killed past ``timeout``)."""
        try:
            self.process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.communicate()
            raise AssertionError(
                f"the server still ran {timeout} s later:\n{self.logged()}"
            ) from None
        return self.process.returncode, self.logged()
