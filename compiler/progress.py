"""Progress on stderr for the minutes a compile takes: one line per stage, and on a terminal
a counter that rewrites itself in place."""

from __future__ import annotations

import multiprocessing
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager


class Progress:
    def __init__(self, enabled: bool = True, label: str = ""):
        self.enabled = enabled
        self.label = f"{label}: " if label else ""  # which compile, where two run at once
        # A compile in a child process (a draft compiled beside its target, cache.side_by_side)
        # shares the terminal: two counters rewriting one line would garble it.
        in_child = multiprocessing.parent_process() is not None
        self.live = enabled and sys.stderr.isatty() and not in_child
        self._start = time.perf_counter()
        self._open_line = False

    def write(self, text: str) -> None:
        if self.enabled:
            self._end_line()
            sys.stderr.write(f"[{time.perf_counter() - self._start:6.1f}s] {self.label}{text}\n")

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        self.write(f"{name} ...")
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._end_line()
        self.write(f"{name} done in {time.perf_counter() - t0:.1f}s")

    def count(self, done: int, total: int) -> None:
        if self.live:
            sys.stderr.write(f"\r  {done}/{total}")
            sys.stderr.flush()
            self._open_line = True

    def _end_line(self) -> None:
        if self._open_line:
            sys.stderr.write("\n")
            self._open_line = False
