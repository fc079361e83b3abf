"""Peak resident memory (RSS) of a child process: a command, or an mlc-spec engine that loads and
generates.

Measured in a child so that nothing the benchmark process itself holds (a second model, torch,
a model it just compiled) counts. Run directly, it is that child: it loads
``LLM(TARGET, draft_model=DRAFT)``, generates greedily from a prompt and prints its own peak
(``VmHWM``: its address space since ``exec``), which the parent reads. For other commands the
parent reads the kernel's ``ru_maxrss`` of the child, which includes its own RSS at the fork.

    python scripts/peak_rss.py TARGET_ARTIFACT [--draft DRAFT_ARTIFACT] [--prompt-len 128]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

TAIL_LINES = 20  # of a failed child's stderr, in the error
_PEAK_LINE = "peak RSS KiB: "  # how the engine child reports its peak


class ChildFailed(RuntimeError):
    """A measured command exited with an error; the message carries the end of its stderr."""


@dataclass
class Finished:
    """A child that exited cleanly: its output and its peak RSS in bytes."""

    stdout: str
    stderr: str
    peak_rss: int


def run_measured(cmd: list[str], env: dict[str, str] | None = None) -> Finished:
    """Run ``cmd`` to completion and return its output with its peak RSS (``wait4``). That
    counts this process's RSS at the fork too (the kernel keeps the high-water mark of the image
    that ``exec`` replaced), so call it while this process is small."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    if proc.returncode != 0:
        tail = "\n".join(stderr.splitlines()[-TAIL_LINES:])
        raise ChildFailed(f"{Path(cmd[0]).name} exited with {proc.returncode}:\n{tail}")
    return Finished(stdout, stderr, usage.ru_maxrss * 1024)  # Linux reports KiB


def engine_peak_rss(
    target: Path, draft: Path | None = None, prompt_len: int = 128, max_tokens: int = 16
) -> int:
    """Peak RSS in bytes of loading ``LLM(target, draft_model=draft)`` and generating with it."""
    cmd = [sys.executable, __file__, str(target), "--prompt-len", str(prompt_len)]
    cmd += ["--max-tokens", str(max_tokens)]
    if draft is not None:
        cmd += ["--draft", str(draft)]
    out = run_measured(cmd).stdout
    return int(out.rpartition(_PEAK_LINE)[2].split()[0]) * 1024


def _own_peak_kib() -> int:
    """This process's peak RSS since ``exec``, in KiB (``VmHWM`` of /proc/self/status)."""
    status = Path("/proc/self/status").read_text()
    return int(status.partition("VmHWM:")[2].split()[0])


def gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", type=Path, help="the target artifact")
    parser.add_argument("--draft", type=Path, help="a draft artifact (draft speculation)")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens to generate")
    args = parser.parse_args()
    from mlc_spec import LLM, SamplingParams

    llm = LLM(args.target, draft_model=args.draft, max_batch_size=1, max_total_len=2048)
    prompt = list(range(1000, 1000 + args.prompt_len))  # ordinary vocabulary ids
    llm.generate([prompt], SamplingParams(max_tokens=args.max_tokens, temperature=0))
    print(f"{_PEAK_LINE}{_own_peak_kib()}")


if __name__ == "__main__":
    main()
