"""uvicorn with the shutdown ``mlc-spec serve`` promises.

On SIGTERM or SIGINT uvicorn stops accepting connections and waits for open ones. Here the
engine also stops admitting, running streams get ``shutdown_timeout`` seconds to finish, and
then each one left ends with an OpenAI error event and ``[DONE]`` and its sequence is aborted.
A second signal ends them at once; uvicorn would instead cut them mid-body. The process then
exits 0 (uvicorn re-raises the signal after a graceful exit, which would kill it with it).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from types import FrameType

import uvicorn

from .async_engine import AsyncEngine

# After the streams are ended, how long their last events may take to be sent before uvicorn
# cancels what is left (a client that stopped reading).
_FLUSH_SECONDS = 5.0


class GracefulServer(uvicorn.Server):
    def __init__(
        self, config: uvicorn.Config, engine: Callable[[], AsyncEngine], shutdown_timeout: float
    ):
        config.timeout_graceful_shutdown = shutdown_timeout + _FLUSH_SECONDS
        super().__init__(config)
        self._engine, self._timeout = engine, shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None or not self.started:
            super().handle_exit(sig, frame)  # still starting: nothing runs yet
            return
        engine = self._engine()
        if self.should_exit:
            self._loop.call_soon_threadsafe(engine.end_all)
        else:
            self.should_exit = True
            self._loop.call_soon_threadsafe(engine.drain, self._timeout)
