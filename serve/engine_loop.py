"""The engine on a thread of its own, shared by every HTTP request.

HTTP handlers submit requests and read their increments from a queue; one loop thread owns
the engine (which is not thread-safe) and steps it while there is work, so concurrent clients
are batched together (continuous batching).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

from mlc_spec.runtime.engine import Engine
from mlc_spec.runtime.params import SamplingParams
from mlc_spec.runtime.request import RequestOutput

_DONE = object()


class EngineLoop:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, queue.Queue] = {}
        self._wake = threading.Event()
        self._stop = False
        self._ids = iter(range(1 << 62))
        self._thread = threading.Thread(target=self._run, name="mlc-spec-engine", daemon=True)
        self._thread.start()

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[RequestOutput]:
        """Queue a request; yields its increments. Raises the engine's UserError for bad input.
        Closing the iterator early (client gone) aborts the request and frees its pages."""
        request_id = f"req-{next(self._ids)}"
        out: queue.Queue = queue.Queue()
        self._call(lambda: self._add(request_id, prompt_ids, params, out))
        try:
            while (item := out.get()) is not _DONE:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            self._call(lambda: self._abort(request_id))

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join()

    # ---- on the engine thread ----------------------------------------------------------
    def _add(self, request_id: str, ids: list[int], params: SamplingParams, out) -> None:
        self.engine.add_request(ids, params, request_id=request_id)
        self._streams[request_id] = out

    def _abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self.engine.abort(request_id)

    def _call(self, fn) -> None:
        """Run ``fn`` on the engine thread and wait; its exception is re-raised here."""
        done: queue.Queue = queue.Queue()
        self._commands.put((fn, done))
        self._wake.set()
        error = done.get()
        if error is not None:
            raise error

    def _run(self) -> None:
        while not self._stop:
            while not self._commands.empty():
                fn, done = self._commands.get()
                try:
                    fn()
                    done.put(None)
                except Exception as err:  # noqa: BLE001 - handed to the caller's thread
                    done.put(err)
            if not self.engine.has_unfinished():
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                deltas = self.engine.step()
            except Exception as err:  # noqa: BLE001 - fail the requests in flight, keep serving
                for request_id, stream in list(self._streams.items()):
                    stream.put(err)
                    self._abort(request_id)
                continue
            for delta in deltas:
                stream = self._streams.get(delta.request_id)
                if stream is not None:
                    stream.put(delta)
                    if delta.finished:
                        stream.put(_DONE)
                        del self._streams[delta.request_id]
