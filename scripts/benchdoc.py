"""Recording benchmark results in docs/benchmarks.md: the run's context and marked sections.

Each benchmark script owns one section between ``<!-- name:start -->`` / ``<!-- name:end -->``
markers and rewrites only that, so the figures of every script live in one file.
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# Share of the usable cores that other processes kept busy just before a run, above which its
# figures are flagged.
BUSY_SHARE = 0.25
DOC_HEADER = """# Benchmarks

Measured performance of mlc-spec. Each section names the script and command that produced it.
Sections sit between `<!-- name:start -->` / `<!-- name:end -->` markers so that a script can
rewrite its own and leave the others alone (`scripts/bench_cpu.py --write docs/benchmarks.md`).
"""


def usable_cores() -> int:
    """The cores this process may use, which is also what mlc_spec defaults TVM's threads to."""
    return len(os.sched_getaffinity(0))


@dataclass(frozen=True)
class StartLoad:
    """What ran beside a benchmark as it started: cores kept busy over the last second (this
    process sleeping), and the 1-minute load average. The flag goes by the first: the load
    average lags, and stays near 1 for a minute after the previous benchmark ended."""

    busy_cores: float
    load_average: float


def start_load(seconds: float = 1.0) -> StartLoad:
    """Sample /proc/stat over ``seconds`` while this process sleeps; call it before the run."""

    def busy_and_total() -> tuple[int, int]:
        with open("/proc/stat") as stat:
            ticks = [int(t) for t in stat.readline().split()[1:]]
        idle = ticks[3] + ticks[4]  # idle, iowait
        return sum(ticks) - idle, sum(ticks)

    busy0, total0 = busy_and_total()
    time.sleep(seconds)
    busy1, total1 = busy_and_total()
    share = (busy1 - busy0) / max(total1 - total0, 1)
    return StartLoad(share * os.cpu_count(), os.getloadavg()[0])


def lscpu_fields() -> dict[str, str]:
    """lscpu's fields by name (``Model name``, ``Flags``, ``BogoMIPS``, ...)."""
    lines = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    return {
        k.strip(): v.strip() for k, _, v in (line.partition(":") for line in lines.splitlines())
    }


def machine_context(load: StartLoad, software: str, threads: str) -> list[str]:
    """Where and how it ran: date, CPU and its vector extensions, load, versions, threads,
    command, and a warning when other processes competed for the cores."""
    cpu = lscpu_fields()
    vector = [f for f in cpu["Flags"].split() if f.startswith(("avx", "sse4", "fma", "amx"))]
    date = subprocess.run(["date", "-u"], capture_output=True, text=True, check=True).stdout
    cores = usable_cores()
    lines = [
        f"- Date: {date.strip()}",
        f"- Machine: `{cpu['Model name']}` (lscpu model name), {cores} cores, no GPU; vector "
        f"flags {' '.join(vector)}; when the run started, "
        f"{load.busy_cores:.2f} cores busy with other work over a second (1-minute load average "
        f"{load.load_average:.2f})",
        f"- Software: Python {platform.python_version()}, {software}",
        f"- Threads: {threads}",
        f"- Command: `{shlex.join(['python', *sys.argv])}`",
    ]
    if load.busy_cores > BUSY_SHARE * cores:
        lines.append(
            "- **Busy machine: other processes competed for the cores, which distorts the "
            "figures and the ratios; re-run on a quiet machine.**"
        )
    return lines


def section_name(base: str, activations: str) -> str:
    """A benchmark's section for artifacts with these activations; float activations keep the
    names sections had before int8 existed."""
    return base if activations == "float" else f"{base}-{activations}-activations"


def write_section(path: Path, name: str, section: str) -> None:
    """Replace section ``name`` of ``path``, or append it; the rest of the file is kept."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    text = path.read_text() if path.exists() else DOC_HEADER
    block = f"{start}\n{section}\n{end}"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = f"{text.rstrip()}\n\n{block}\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
