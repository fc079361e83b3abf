"""An artifact is written into a staging directory beside its destination and renamed into
place only once complete, so no reader ever sees half of one. A compile that fails or is
terminated (SIGTERM, Ctrl-C) removes its staging directory; one killed outright (SIGKILL, out
of memory) leaves it behind, and the next compile to the same destination removes it: a
killed Qwen2.5-1.5B compile left 1.5 GB there."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A fresh directory to write ``out`` into; renamed to ``out`` when the block completes."""
    out.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{out.name}.partial-"
    for stale in out.parent.glob(f"{prefix}*"):
        pid = stale.name.removeprefix(prefix)
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    staging = out.parent / f"{prefix}{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    with _terminate_as_exit():
        try:
            yield staging
            staging.rename(out)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


@contextlib.contextmanager
def _terminate_as_exit() -> Iterator[None]:
    """SIGTERM raises SystemExit here (as Ctrl-C raises KeyboardInterrupt), so the cleanup
    runs; Python handles signals in the main thread only, elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
