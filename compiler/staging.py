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
    with _interrupts_recorded():
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


# The exceptions that signals raised inside ``staged``, newest last. TVM hands an exception
# raised in one of its callbacks back as a RuntimeError of its own, so code that catches TVM's
# errors asks here whether they were an interrupt (``interrupted``).
_raised: list[BaseException] = []


def interrupted() -> BaseException | None:
    """The KeyboardInterrupt or SystemExit that Ctrl-C or SIGTERM raised inside ``staged``,
    if one did: to be raised again in place of the error TVM made of it."""
    return _raised[-1] if _raised else None


@contextlib.contextmanager
def _interrupts_recorded() -> Iterator[None]:
    """SIGTERM raises SystemExit here (as Ctrl-C raises KeyboardInterrupt), so the cleanup
    runs; both are recorded for ``interrupted``. Python handles signals in the main thread
    only; elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, _frame: object) -> None:
        _raised.append(SystemExit(128 + signum))
        raise _raised[-1]

    def interrupt(_signum: int, _frame: object) -> None:
        _raised.append(KeyboardInterrupt())
        raise _raised[-1]

    _raised.clear()
    previous = signal.signal(signal.SIGTERM, terminate), signal.signal(signal.SIGINT, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGINT, previous[1])
        _raised.clear()
