"""The engine on a thread of its own, fed through a queue by the server's event loop.

The engine is not thread-safe, so one thread owns it: it takes commands (add, abort, stop)
from a queue between steps, steps while there is work, and hands each request's increments
back to the event loop that asked (``call_soon_threadsafe``). An abort is taken before the
next step, so a client that leaves frees its KV pages within one step. Admission is decided
here too, where the waiting queue is: past ``max_waiting`` a request is refused, never lost.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import queue
import threading
import time

from mlc_spec.runtime.engine import Engine
from mlc_spec.runtime.params import SamplingParams
from mlc_spec.runtime.request import RequestOutput

from .metrics import ServerMetrics


class Overloaded(Exception):
    """The waiting queue is full; the client should retry later."""


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


class AsyncEngine:
    def __init__(self, engine: Engine, metrics: ServerMetrics, max_waiting: int):
        self.engine, self.metrics, self.max_waiting = engine, metrics, max_waiting
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="mlc-spec-engine", daemon=True)
        self._thread.start()

    async def add(self, prompt_ids: list[int], params: SamplingParams) -> RequestStream:
        """Queue a request. Raises UserError (bad input) or Overloaded (queue full)."""
        loop = asyncio.get_running_loop()
        request_id = f"req-{next(self._ids)}"
        added = loop.create_future()
        stream = _Stream(loop, asyncio.Queue(), time.monotonic(), len(prompt_ids))
        self._commands.put(("add", request_id, prompt_ids, params, stream, added))
        try:
            await added
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return RequestStream(self, request_id, stream.out)

    def abort(self, request_id: str) -> None:
        """Drop a request before the next step, freeing its pages (no-op once finished)."""
        self._commands.put(("abort", request_id))

    def shutdown(self) -> None:
        self._commands.put(("stop",))
        self._thread.join()

    # ---- on the engine thread ------------------------------------------------------------
    def _run(self) -> None:
        while self._take_commands(block=not self.engine.has_unfinished()):
            if self.engine.has_unfinished():
                self._step()
            self.metrics.observe_engine(self.engine.occupancy(), self.engine.stats)

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
            else:
                self._abort(command[1])
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, request_id, prompt_ids, params, stream: _Stream, added) -> None:
        try:
            if self.engine.occupancy().num_waiting >= self.max_waiting:
                raise Overloaded(f"{self.max_waiting} requests are already waiting")
            self.engine.add_request(prompt_ids, params, request_id=request_id)
        except Exception as err:  # noqa: BLE001 - handed to the caller's event loop
            stream.loop.call_soon_threadsafe(_settle, added, err)
            return
        stream.num_tokens = [0] * params.n
        stream.drafts_seen = [(0, 0)] * params.n
        self._streams[request_id] = stream
        stream.loop.call_soon_threadsafe(_settle, added, None)

    def _abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return  # finished in the meantime, or never admitted
        self.engine.abort(request_id)
        for _ in range(len(stream.num_tokens) - len(stream.finished)):
            self.metrics.finished("abort")

    def _step(self) -> None:
        try:
            deltas = self.engine.step()
        except Exception as err:  # noqa: BLE001 - fail the requests in flight, keep serving
            for request_id, stream in list(self._streams.items()):
                stream.loop.call_soon_threadsafe(stream.out.put_nowait, err)
                self._streams.pop(request_id)
                self.engine.abort(request_id)
            return
        now = time.monotonic()
        for delta in deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None:
                continue
            self._observe(stream, delta, now)
            stream.loop.call_soon_threadsafe(stream.out.put_nowait, delta)
            if delta.finished:
                del self._streams[delta.request_id]

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
    """One request's increments, in order. ``close`` aborts the request unless it finished;
    it is idempotent, so every path out of a handler may call it."""

    def __init__(self, engine: AsyncEngine, request_id: str, out: asyncio.Queue):
        self._engine, self._request_id, self._out = engine, request_id, out
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self._out.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.finished
        return item

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._engine.abort(self._request_id)


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    """Resolve a future on its own loop, unless its waiter has already gone."""
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
