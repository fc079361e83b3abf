"""The engine on a thread of its own, fed through a queue by the server's event loop.

The engine is not thread-safe, so one thread owns it: it takes commands (add, abort, end,
report, stop) from a queue between steps, steps while there is work, and hands each request's
increments back to the event loop that asked (``call_soon_threadsafe``). An abort is taken
before the next step, so a client that leaves frees its KV pages within one step.

Admission is decided on arrival, on the event loop: past ``max_waiting`` requests waiting (the
engine's queue after its last step, plus those handed over since) a request is refused at
once, never lost, and never after waiting for a step. A stream whose client reads slower than
the engine writes is ended once ``max_backlog`` of its tokens are unread: aborting frees its
KV pages and batch slot for clients that keep up, where pausing it would hold them for as long
as the client stalls; and no buffer grows without bound.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
import time

from mlc_spec.runtime.engine import Engine
from mlc_spec.runtime.params import SamplingParams
from mlc_spec.runtime.request import RequestOutput

from .metrics import ServerMetrics

log = logging.getLogger(__name__)


class Overloaded(Exception):
    """The waiting queue is full, or the server is shutting down; the client should retry."""


class StreamEnded(Exception):
    """The server ended a request before it finished; ``status`` is the HTTP status for why."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


@dataclasses.dataclass
class _Stream:
    """What the engine thread keeps per request: where to send its increments, and timings."""

    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    arrival: float
    num_prompt: int
    first_token: float | None = None
    num_tokens: list[int] = dataclasses.field(default_factory=list)  # per sample
    drafts_seen: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # per sample
    finished: set[int] = dataclasses.field(default_factory=set)  # samples done
    sent: int = 0  # tokens handed to the event loop (written by the engine thread)
    read: int = 0  # tokens the handler has taken (written by the event loop)


class AsyncEngine:
    def __init__(self, engine: Engine, metrics: ServerMetrics, max_waiting: int, max_backlog: int):
        self.engine, self.metrics = engine, metrics
        self.max_waiting, self.max_backlog = max_waiting, max_backlog
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._engine_waiting = 0  # the engine's waiting queue after its last command or step
        self._handed_over = 0  # adds queued for the engine thread and not yet taken
        self._draining = False
        self._thread = threading.Thread(target=self._run, name="mlc-spec-engine", daemon=True)
        self._thread.start()

    def check_admission(self) -> None:
        """Raise Overloaded unless a request arriving now would be queued."""
        if self._draining:
            raise Overloaded("the server is shutting down")
        if self._engine_waiting + self._handed_over >= self.max_waiting:
            raise Overloaded(f"{self.max_waiting} requests are already waiting")

    async def add(self, prompt_ids: list[int], params: SamplingParams) -> RequestStream:
        """Queue a request. Raises UserError (bad input) or Overloaded (queue full)."""
        loop = asyncio.get_running_loop()
        if params.structured_output is not None:
            # Compiled here, off the engine thread (xgrammar caches it for the engine's own
            # compile): a first import or a large schema would otherwise stall every stream.
            await loop.run_in_executor(None, self.engine.grammars.compile, params.structured_output)
        request_id = f"req-{next(self._ids)}"
        added = loop.create_future()
        stream = _Stream(loop, asyncio.Queue(), time.monotonic(), len(prompt_ids))
        with self._lock:
            self.check_admission()
            self._handed_over += 1
            self._commands.put(("add", request_id, prompt_ids, params, stream, added))
        try:
            await added
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return RequestStream(self, request_id, stream)

    def abort(self, request_id: str) -> None:
        """Drop a request before the next step, freeing its pages (no-op once finished)."""
        self._commands.put(("abort", request_id))

    def drain(self, timeout: float) -> None:
        """Refuse new requests from now on, and end those still running after ``timeout``
        seconds. Called on the event loop."""
        self._draining = True
        log.info("shutting down: no new requests; running ones get %g s to finish", timeout)
        asyncio.get_running_loop().call_later(timeout, self.end_all)

    def end_all(self) -> None:
        """End every running request with an error (503) before the next step."""
        self._commands.put(("end_all",))

    async def engine_metrics(self) -> dict:
        """``Engine.metrics``, read between steps: the engine thread updates them as it steps."""
        loop = asyncio.get_running_loop()
        report = loop.create_future()
        self._commands.put(("report", loop, report))
        return await report

    def shutdown(self) -> None:
        self._commands.put(("stop",))
        self._thread.join()

    # ---- on the engine thread ------------------------------------------------------------
    def _run(self) -> None:
        while self._take_commands(block=not self.engine.has_unfinished()):
            if self.engine.has_unfinished():
                self._step()
            occupancy = self.engine.occupancy()
            with self._lock:
                self._engine_waiting = occupancy.num_waiting
            proposer = self.engine.proposer.metrics() if self.engine.proposer else {}
            self.metrics.observe_engine(occupancy, self.engine.stats, proposer)

    def _take_commands(self, block: bool) -> bool:
        """Carry out queued commands (waiting for one if ``block``); False on stop."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return True
        while True:
            if command[0] == "stop":
                return False
            if command[0] == "add":
                self._add(*command[1:])
            elif command[0] == "abort":
                self._abort(command[1])
            elif command[0] == "report":
                loop, report = command[1:]
                loop.call_soon_threadsafe(_settle, report, None, self.engine.metrics())
            else:
                self._end_all()
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, request_id, prompt_ids, params, stream: _Stream, added) -> None:
        try:
            self.engine.add_request(prompt_ids, params, request_id=request_id)
        except Exception as err:  # noqa: BLE001 - handed to the caller's event loop
            stream.loop.call_soon_threadsafe(_settle, added, err)
            return
        finally:
            waiting = self.engine.occupancy().num_waiting
            with self._lock:
                self._handed_over -= 1
                self._engine_waiting = waiting
        stream.num_tokens = [0] * params.n
        stream.drafts_seen = [(0, 0)] * params.n
        self._streams[request_id] = stream
        stream.loop.call_soon_threadsafe(_settle, added, None)

    def _abort(self, request_id: str, error: Exception | None = None) -> None:
        """Drop a request, and hand ``error`` to its handler if it still listens."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return  # finished in the meantime, or never admitted
        self.engine.abort(request_id)
        for _ in range(len(stream.num_tokens) - len(stream.finished)):
            self.metrics.finished("abort")
        if error is not None:
            stream.loop.call_soon_threadsafe(stream.out.put_nowait, error)

    def _end_all(self) -> None:
        if self._streams:
            log.info("shutting down: ending %d running requests", len(self._streams))
        for request_id in list(self._streams):
            self._abort(request_id, StreamEnded("the server is shutting down", 503))

    def _step(self) -> None:
        try:
            deltas = self.engine.step()
        except Exception as err:  # noqa: BLE001 - fail the requests in flight, keep serving
            for request_id in list(self._streams):
                self._abort(request_id, err)
            return
        now = time.monotonic()
        for delta in deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None:
                continue
            self._observe(stream, delta, now)
            stream.sent += sum(len(out.token_ids) for out in delta.outputs)
            stream.loop.call_soon_threadsafe(stream.out.put_nowait, delta)
            if delta.finished:
                del self._streams[delta.request_id]
            elif stream.sent - stream.read > self.max_backlog:
                message = (
                    f"the client read too slowly: {stream.sent - stream.read} tokens were "
                    f"waiting to be sent (the bound is {self.max_backlog})"
                )
                log.info("request %s ended: %s", delta.request_id, message)
                self._abort(delta.request_id, StreamEnded(message, 408))

    def _observe(self, stream: _Stream, delta: RequestOutput, now: float) -> None:
        m = self.metrics
        if stream.first_token is None:
            stream.first_token = now
            m.time_to_first_token.observe(now - stream.arrival)
            m.prompt_tokens.inc(stream.num_prompt)
        else:  # a decode step: record the draft length each live sample was given
            for out in delta.outputs:
                if out.token_ids:
                    before = stream.drafts_seen[out.index]
                    stats = out.spec_stats
                    drafted = stats.num_drafts > before[0]
                    m.draft_length.observe(stats.num_draft_tokens - before[1] if drafted else 0)
                    stream.drafts_seen[out.index] = (stats.num_drafts, stats.num_draft_tokens)
        for out in delta.outputs:
            stream.num_tokens[out.index] += len(out.token_ids)
            m.generation_tokens.inc(len(out.token_ids))
            if out.finish_reason and out.index not in stream.finished:
                stream.finished.add(out.index)
                m.finished(out.finish_reason)
        if delta.finished:
            m.e2e_request_latency.observe(now - stream.arrival)
            longest = max(stream.num_tokens)
            if longest > 1:
                m.time_per_output_token.observe((now - stream.first_token) / (longest - 1))


class RequestStream:
    """One request's increments, in order. ``close`` aborts the request unless it finished
    (its client left); it is idempotent, so every path out of a handler may call it."""

    def __init__(self, engine: AsyncEngine, request_id: str, stream: _Stream):
        self._engine, self._request_id, self._stream = engine, request_id, stream
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self._stream.out.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._stream.read += sum(len(out.token_ids) for out in item.outputs)
        self._done = item.finished
        return item

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._engine.abort(self._request_id)
            log.info(
                "request %s aborted after %d tokens: its client disconnected",
                self._request_id,
                self._stream.read,
            )


def _settle(future: asyncio.Future, error: BaseException | None, value: object = None) -> None:
    """Resolve a future on its own loop, unless its waiter has already gone."""
    if future.done():
        return
    if error is None:
        future.set_result(value)
    else:
        future.set_exception(error)
