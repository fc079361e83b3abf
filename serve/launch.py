"""Starting ``mlc-spec serve`` as a child process and waiting for it: bench serve's servers, the
replicas behind the router, and the tests' servers all start the same way."""

from __future__ import annotations

import contextlib
import ctypes
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_server(
    serve_args: list[str], env: dict[str, str] | None = None, stderr: int | None = None
) -> tuple[subprocess.Popen, str, str]:
    """``mlc-spec serve`` on a free loopback port: ``(process, its /v1 URL, the line it
    announced itself with)`` once it answers /health; a process that does not get there is
    stopped and the error says why (with what it logged, where ``stderr`` is
    ``subprocess.PIPE``)."""
    cmd = [sys.executable, "-m", "mlc_spec.cli", "serve", *serve_args, "--port", "0"]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=env,
        preexec_fn=die_with_parent,
    )
    line = proc.stdout.readline()
    base = line.rsplit(" on ", 1)[1].split()[0] if " on http://" in line else None
    if base is None or not healthy(base, proc, seconds=60):
        proc.kill()
        _, log = proc.communicate()
        raise RuntimeError(
            f"the server did not start ({shlex.join(cmd)}): {line!r}{log or ''}"
            if base is None
            else f"the server at {base} did not answer /health within 60 s: {log or ''}"
        )
    return proc, base, line.strip()


@contextlib.contextmanager
def launched_server(serve_args: list[str], env: dict[str, str] | None = None) -> Iterator[str]:
    """``start_server`` for the length of a ``with``: yields the /v1 URL, stops it after."""
    proc, base, _ = start_server(serve_args, env)
    try:
        yield base
    finally:
        stop(proc)


def die_with_parent() -> None:
    """In a child, before it runs: SIGTERM to it when its parent dies (Linux's
    ``PR_SET_PDEATHSIG``), so a parent that is killed leaves no server behind."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


def healthy(base: str, proc: subprocess.Popen, seconds: float) -> bool:
    """Whether the server at ``base`` (its /v1 URL) answers /health with 200 within
    ``seconds``; False as soon as its process exits."""
    for _ in range(int(seconds * 10)):
        if proc.poll() is not None:
            return False
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base.removesuffix("/v1") + "/health").status_code == 200:
                return True
        time.sleep(0.1)
    return False


def stop(proc: subprocess.Popen, sig: int = signal.SIGINT, timeout: float = 30) -> None:
    """Ask the process to end (it finishes what it serves), kill it after ``timeout``."""
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
