"""``mlc-spec serve --replicas N``: N servers behind sglang-router, one command.

Why sglang-router (PyPI ``sglang-router``): a router process that speaks the OpenAI API to any
worker, whose ``cache_aware`` policy keeps a radix tree of the prompts it sent each worker and
sends a request to the worker holding its longest prefix (the prefix cache pays off across
replicas only if chats stick to one), falling back to the least loaded worker when the load is
uneven; it checks workers' ``/health`` and stops routing to a dead one. Ray Serve would put our
server inside its actors and bring a cluster runtime for what one router process does here.

Each replica is ``mlc-spec serve`` with the same arguments on a loopback port, with
``cores / N`` threads (``--threads-per-replica``): replicas share the machine's cores.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable

from mlc_spec.errors import UserError

from .launch import die_with_parent, free_port, healthy, start_server, stop


def router_command(workers: list[str], host: str, port: int, policy: str) -> list[str]:
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", host]
    cmd += ["--port", str(port), "--policy", policy, "--worker-urls", *workers]
    # A dead replica is dropped after two failed checks 5 s apart (the defaults, 3 checks a
    # minute apart, route to it for minutes); until then a request that cannot reach it is
    # retried on another.
    cmd += ["--health-check-interval-secs", "5", "--health-failure-threshold", "2"]
    return [*cmd, "--log-level", "warn"]  # not a line per request


def replica_threads(threads: int | None, replicas: int) -> int:
    """TVM threads per replica: as asked, or the cores shared out."""
    return threads or max(1, (os.cpu_count() or 1) // replicas)


def serve_replicas(
    serve_argv: list[str],
    replicas: int,
    host: str,
    port: int,
    policy: str,
    threads: int | None,
    announce: Callable[[str], None],
) -> None:
    """Start the replicas (``mlc-spec serve`` with ``serve_argv``), then the router on
    ``host:port``; run until the router ends or a signal comes, then stop them all. A replica
    that dies is left dead: the router sends its later requests to the others."""
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        raise UserError("--replicas needs sglang-router: pip install sglang-router") from None
    threads = replica_threads(threads, replicas)
    env = {**os.environ, "TVM_NUM_THREADS": str(threads)}
    procs: list[subprocess.Popen] = []
    try:
        workers = []
        for _ in range(replicas):
            proc, base, _ = start_server([*serve_argv, "--host", "127.0.0.1"], env)
            procs.append(proc)
            workers.append(base.removesuffix("/v1"))
            _drain(proc)
        port = port or free_port(host)
        router = subprocess.Popen(  # its log to stderr: stdout is this command's announcement
            router_command(workers, host, port, policy),
            stdout=sys.stderr,
            preexec_fn=die_with_parent,
        )
        procs.insert(0, router)  # stopped first: no request goes to a replica that is stopping
        if not healthy(f"http://{host}:{port}/v1", router, seconds=60):
            raise UserError(f"sglang-router did not answer /health on {host}:{port} within 60 s")
        announce(
            f"serving {len(workers)} replicas ({threads} threads each, {', '.join(workers)}) "
            f"behind sglang-router ({policy}) on http://{host}:{port}/v1"
        )
        _wait_for_signal_or(router)
    finally:
        for proc in procs:
            stop(proc, signal.SIGTERM)


def _drain(proc: subprocess.Popen) -> None:
    """Read what a replica prints after its first line, so a full pipe never blocks it."""
    threading.Thread(target=proc.stdout.read, daemon=True).start()


def _wait_for_signal_or(router: subprocess.Popen) -> None:
    """Block until SIGTERM or SIGINT arrives or the router exits."""
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    threading.Thread(target=lambda: (router.wait(), done.set()), daemon=True).start()
    done.wait()
