"""docs/benchmarks.md laid out from the sections that the benchmark scripts write.

A run's context (date, commit, CPU class, load before and during it) and a page of marked
sections in a fixed order that the scripts rewrite and nobody edits by hand.

Each benchmark script owns sections between ``<!-- key:start STAMP -->`` / ``<!-- key:end -->``
markers (STAMP: when it was written, UTC) and rewrites only its own. Every write re-renders the
whole page: the fixed header, the headline groups first (their sections newest first), a
pointer to what was tried and left out (docs/kernels.md keeps that list), then the other
still-current measurements. Each group keeps at most a few sections (the oldest leaves, git
keeps it), and a key that belongs to no group of the page (a kernel A/B, say) goes to a
scratch file instead, so no script can grow the page without bound.

    python scripts/benchdoc.py [PAGE] [--drop KEY ...]   # re-render PAGE, dropping KEYs
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "benchmarks.md"
SCRATCH = Path("/tmp/mlc-spec-bench")  # where sections that the page does not keep go
# Share of the usable cores that other processes kept busy just before a run, above which its
# figures are flagged.
BUSY_SHARE = 0.25
PAGE_LINES = 250  # the page's budget: a write past it warns, naming the largest sections

DOC_HEADER = """# Benchmarks

Measured performance of mlc-spec against llama.cpp on the CPU, written by the scripts in
`scripts/` (`benchdoc.py` lays out the page; nothing here is edited by hand). The headline
tables come first, one per model and configuration and per CPU class (`amd-avx512`: AMD Zen 4;
`amd-avx2`: AVX2-only EPYC; `intel-avx512`: Xeon), newest first; each names the command that
reproduces it. How they are measured:

- **Alternation.** Every system (and every configuration) takes one turn per round, each in a
  child process of its own that loads the model, warms up and exits, so no TVM or llama.cpp
  thread pool is alive, spinning, while the other runs; the order reverses every other round.
  Each cell is the median over rounds with the min-max range; ratios and goals use medians.
- **Same tokens, same work.** Batch 1, greedy, 2 threads on both sides. End to end: both
  generate exactly the same number of tokens per prompt from the same prompt token ids (EOS
  ignored; llama.cpp's own tokenization is checked against ours), and tokens/s divides the
  generated tokens by the time of prefill plus generation, sampling included, model loading
  excluded, on both sides. Step costs: `llama-bench` at the same prompt length, context and
  batch sizes, with flash attention on and off (`-fa on|off`).
- **llama.cpp at its best.** Plain decoding and `llama-speculative-simple` with the draft
  model (`--spec-type draft-simple`, a sweep of `--spec-draft-n-max`) and with its n-gram
  proposers (`ngram-simple`, `ngram-mod`), each with `-fa on` and `-fa off`; the best by median
  is its headline figure. Built by `scripts/llamacpp.py` from the `llama-cpp-python` sdist.
- Goals (same run, greedy, batch 1, HumanEval): the Qwen pair's best configuration >= 2.5x
  llama.cpp's best end to end, with tokens identical to our plain decoding; SmolLM2 decode <=
  0.5x llama.cpp's ms/token; verify of 8 tokens <= 1.5x a decode step on both models. No
  verdict is given for a run during which other processes kept the cores busy: llama.cpp's
  threads wait for each other at every barrier and slow several-fold when a core is taken.

Earlier runs (float32, the kernel A/B tables, the hand-pasted `-xeon` tables, all before the
page-pool KV cache of `c3bae87`) are in git: `git show 231510b:docs/benchmarks.md`.
"""


@dataclass(frozen=True)
class Group:
    """Sections of the page whose keys match ``pattern``: at most ``keep`` of them, newest first,
    under ``heading`` (a ``##`` line), or ``empty`` where there are none yet."""

    heading: str | None
    pattern: str
    keep: int
    empty: str = ""


# How keys written by ``cpu_class`` end: one section per CPU class, and no key of the page's
# earlier layout (keyed by hand, ``-xeon``) falls into a group.
_CPU = r"-(?:intel|amd|cpu)-(?:avx512|avx2|x86)"

HEADLINE = (
    Group(
        "SmolLM2-135M-Instruct: step costs against llama.cpp",
        rf"bench_cpu-smollm2-.+{_CPU}",
        3,
        "`python scripts/bench_cpu.py --model smollm2 --activations int8 --repeats 15 "
        "--write docs/benchmarks.md`",
    ),
    Group(
        "Qwen2.5-Coder-1.5B-Instruct: step costs against llama.cpp",
        rf"bench_cpu-qwen1\.5b-.+{_CPU}",
        3,
        "`python scripts/bench_cpu.py --model qwen1.5b --activations int8 --repeats 5 "
        "--write docs/benchmarks.md`",
    ),
    Group(
        "Serving side by side with llama-server (`mlc-spec bench serve`)",
        rf"bench_serving-.+{_CPU}",
        2,
        "`python scripts/bench_serving.py --pair smollm2 --write docs/benchmarks.md` "
        "(and `--pair qwen`)",
    ),
    Group(
        "Prefix caching in the server: ShareGPT conversations turn by turn",
        rf"bench_prefix_cache{_CPU}",
        1,
        "`python scripts/bench_prefix_cache.py --write docs/benchmarks.md`",
    ),
    Group(
        "A long prompt while streams decode: prefill chunks within a token budget",
        rf"bench_long_prompt{_CPU}",
        1,
        "`python scripts/bench_long_prompt.py --write docs/benchmarks.md`",
    ),
    Group(
        "The README's first run: install, fetch, compile, answer",
        rf"bench_first_run{_CPU}",
        1,
        "`python scripts/bench_first_run.py --write docs/benchmarks.md`",
    ),
    Group(
        "Suffix decoding in the server: edits sent twice, HumanEval, ShareGPT",
        rf"bench_suffix(?:-qwen)?{_CPU}",
        2,
        "`python scripts/bench_suffix.py --write docs/benchmarks.md` (and `--pair qwen "
        "--datasets editing humaneval --concurrency 1 4`)",
    ),
    Group(
        "Structured output with speculation: JSON extraction with and without the schema",
        rf"bench_structured-.+{_CPU}",
        2,
        "`python scripts/bench_structured.py --write docs/benchmarks.md` (and `--pair qwen`)",
    ),
    Group(
        "Replicas behind sglang-router against one server",
        rf"bench_router{_CPU}",
        1,
        "`python scripts/bench_router.py --write docs/benchmarks.md`",
    ),
    Group(
        "Qwen2.5-Coder-1.5B with the 0.5B draft: speculative decoding end to end on HumanEval",
        rf"bench_speculative-qwen-.+{_CPU}",
        3,
        "`python scripts/bench_speculative.py --activations int8 --draft-quantization q4 "
        "--draft-lm-head q4 --draft-lm-head-vocab 100000 --rounds 3 --write docs/benchmarks.md`",
    ),
)
OTHER = (
    Group(
        "Other measurements",
        rf"bench_speculative-smollm2-self-.+{_CPU}",
        1,
        "Each section carries its date and commit: compare them with the headline tables' before "
        "relying on one.",
    ),
    Group(
        "`mlc-spec serve` soaked: mixed load at concurrency 64, then SIGTERM", r"soak_serve-.+", 1
    ),
    Group(None, r"bench_adaptive.*", 1),
    Group(None, r"bench_async-.+", 1),
    Group(None, r"bench_detokenize", 1),
)
OTHER_NOTE = (
    "Measured elsewhere: serving under load (`mlc-spec bench serve` writes `results.md` and its "
    "plots into `--output-dir`; the README's plot is `docs/serve_bench.png`, drawn from "
    "`docs/serve_bench.json` of 2026-11-22 on a heavily shared machine) and the n-gram index "
    "(`python scripts/bench_ngram.py` prints its table: the native index 0.7-0.8 µs a step at "
    "1k-16k tokens of context, 25-40x the numpy scan, 2026-11-21). Async scheduling "
    "(`scripts/bench_async.py --write`, 2026-11-22): 0.98-1.07x of synchronous steps on 2 cores, "
    "where the forward keeps both cores busy and the host's share of a step was 0-2%. The "
    "fidelity of int8 activations against llama.cpp's own: docs/quantization.md "
    "(`scripts/bench_fidelity.py`)."
)


def usable_cores() -> int:
    """The cores this process may use, which is also what mlc_spec defaults TVM's threads to."""
    return len(os.sched_getaffinity(0))


def _busy_seconds() -> float:
    """CPU seconds that all cores have spent busy since boot (/proc/stat, less idle and
    iowait)."""
    with open("/proc/stat") as stat:
        ticks = [int(t) for t in stat.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    """CPU seconds of this process and of the children it has waited for."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


@dataclass(frozen=True)
class StartLoad:
    """What ran beside a benchmark as it started: cores kept busy over the last second (this
    process sleeping), and the 1-minute load average. The flag goes by the first: the load
    average lags, and stays near 1 for a minute after the previous benchmark ended. The
    counters at its end let ``other_work`` tell how busy other processes kept the cores over
    the whole run: all busy CPU time less this process's and its children's."""

    busy_cores: float
    load_average: float
    wall: float = 0.0
    busy: float = 0.0
    own: float = 0.0

    def other_work(self) -> float:
        """Cores kept busy by other processes since the start, on average."""
        elapsed = time.monotonic() - self.wall
        other = (_busy_seconds() - self.busy) - (_own_seconds() - self.own)
        return max(other, 0.0) / max(elapsed, 1e-9)


def start_load(seconds: float = 1.0) -> StartLoad:
    """Sample /proc/stat over ``seconds`` while this process sleeps; call it before the run."""
    busy0, wall0 = _busy_seconds(), time.monotonic()
    time.sleep(seconds)
    busy1, wall1 = _busy_seconds(), time.monotonic()
    share = (busy1 - busy0) / max(wall1 - wall0, 1e-9)
    return StartLoad(share, os.getloadavg()[0], wall1, busy1, _own_seconds())


def lscpu_fields() -> dict[str, str]:
    """lscpu's fields by name (``Model name``, ``Flags``, ``BogoMIPS``, ...)."""
    lines = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    return {
        k.strip(): v.strip() for k, _, v in (line.partition(":") for line in lines.splitlines())
    }


def cpu_class() -> str:
    """A short label for the class of this CPU, which keys the page's tables: the figures of an
    AVX-512 Xeon, a Zen 4 and an AVX2-only EPYC differ by more than any change being judged.
    Vendor and widest vector ISA, e.g. ``amd-avx512``, ``amd-avx2``, ``intel-avx512``."""
    cpu = lscpu_fields()
    flags = set(cpu.get("Flags", "").split())
    vendor = {"GenuineIntel": "intel", "AuthenticAMD": "amd"}.get(cpu.get("Vendor ID", ""), "cpu")
    isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "x86"
    return f"{vendor}-{isa}"


def commit() -> str:
    """The checked-out commit, and whether the code that builds or runs a model differs from
    it: a figure belongs to the code that produced it."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)
        if done.returncode:
            raise OSError(done.stderr)
        return done.stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--", "compiler", "models", "runtime")
    except OSError:
        return "unknown (not a git checkout)"
    return f"`{head}`" + (" with uncommitted changes in compiler/models/runtime" if dirty else "")


def machine_context(load: StartLoad, software: str, threads: str) -> list[str]:
    """Where and how it ran: date, commit, CPU and its vector extensions, load, versions,
    threads, command, and a warning when other processes competed for the cores."""
    cpu = lscpu_fields()
    vector = [f for f in cpu["Flags"].split() if f.startswith(("avx", "sse4", "fma", "amx"))]
    date = subprocess.run(["date", "-u"], capture_output=True, text=True, check=True).stdout
    cores = usable_cores()
    during = load.other_work() if load.wall else 0.0
    lines = [
        f"- Date: {date.strip()}; commit {commit()}",
        f"- Machine: `{cpu['Model name']}` (lscpu model name, class `{cpu_class()}`), {cores} "
        f"cores, no GPU; vector flags {' '.join(vector)}; other work kept "
        f"{load.busy_cores:.2f} cores busy in the second before the run and {during:.2f} on "
        f"average during it (1-minute load average {load.load_average:.2f} at the start)",
        f"- Software: Python {platform.python_version()}, {software}",
        f"- Threads: {threads}",
        f"- Command: `{shlex.join(['python', *sys.argv])}`",
    ]
    if busy(load):
        lines.append(
            "- **Busy machine: other processes competed for the cores, which distorts the "
            "figures and the ratios; re-run on a quiet machine.**"
        )
    return lines


def busy(load: StartLoad) -> bool:
    """Whether other processes kept more than ``BUSY_SHARE`` of the cores busy before or during
    the run. llama.cpp's threads wait for each other at every barrier, so a core taken away
    from it slows it several-fold (seen: SmolLM2 decode at 60-70 ms against ~7 quiet) where
    mlc-spec slows far less: such a run's ratios say nothing."""
    during = load.other_work() if load.wall else 0.0
    return max(load.busy_cores, during) > BUSY_SHARE * usable_cores()


def verdict(ok: bool, load: StartLoad) -> str:
    """A goal's verdict, withheld where other work distorted the run."""
    if busy(load):
        return "no verdict: **busy machine**, re-run on a quiet one"
    return "met" if ok else "**not met**"


def section_name(base: str, activations: str) -> str:
    """A benchmark's section for artifacts with these activations; float activations keep the
    names sections had before int8 existed."""
    return base if activations == "float" else f"{base}-{activations}-activations"


@dataclass
class Section:
    key: str
    stamp: datetime  # when it was written (UTC)
    text: str


_SECTION = re.compile(r"<!-- (\S+):start(?: (\S+))? -->\n(.*?)\n<!-- \1:end -->", re.S)
_DATE_LINE = re.compile(r"^- Date: (\w{3} \w{3} +\d+ [\d:]+ UTC \d{4})", re.M)
_STAMP = "%Y-%m-%dT%H:%M:%SZ"


def parse_sections(text: str) -> list[Section]:
    """The page's marked sections. One written before markers carried a stamp is dated by its
    ``- Date:`` line, else as the oldest."""
    found = []
    for match in _SECTION.finditer(text):
        key, stamp, body = match[1], match[2], match[3]
        if stamp:
            when = datetime.strptime(stamp, _STAMP).replace(tzinfo=timezone.utc)
        elif date := _DATE_LINE.search(body):
            when = datetime.strptime(date[1], "%a %b %d %H:%M:%S UTC %Y")
            when = when.replace(tzinfo=timezone.utc)
        else:
            when = datetime.fromtimestamp(0, timezone.utc)
        found.append(Section(key, when, body))
    return found


def _group_of(key: str, groups: tuple[Group, ...]) -> Group | None:
    return next((g for g in groups if re.fullmatch(g.pattern, key)), None)


def render(sections: list[Section], main_page: bool) -> str:
    """The whole page: header, headline groups, the tried list, the other groups; each group's
    sections newest first and at most its ``keep``. A scratch file also keeps sections of no
    group, after the rest."""
    by_group: dict[Group | None, list[Section]] = {}
    for s in sections:
        by_group.setdefault(_group_of(s.key, HEADLINE + OTHER), []).append(s)
    parts = [DOC_HEADER.rstrip()]

    def emit(group: Group | None, fallback: str = "") -> None:
        kept = sorted(by_group.get(group, []), key=lambda s: s.stamp, reverse=True)
        kept = kept if group is None else kept[: group.keep]
        if group is not None and group.heading:
            parts.append(f"## {group.heading}")
        if fallback and (not kept or group in OTHER):
            parts.append(fallback)
        for s in kept:
            parts.append(
                f"<!-- {s.key}:start {s.stamp.strftime(_STAMP)} -->\n{s.text}\n<!-- {s.key}:end -->"
            )

    for group in HEADLINE:
        emit(group, f"No run written yet. Reproduce: {group.empty}")
    parts.append(
        "## What was tried and left out\n\nKernels, prefetching, AMX and the rest, one line each "
        "with its measured effect: docs/kernels.md, at the end."
    )
    for group in OTHER:
        emit(group, group.empty)
    parts.append(OTHER_NOTE)
    if not main_page:
        emit(None)
    return "\n\n".join(parts) + "\n"


def is_main_page(path: Path) -> bool:
    return path.resolve() == PAGE.resolve()


def is_benchmark_page(path: Path) -> bool:
    """The page, or a file laid out like it (a scratch copy, a new file): other documents
    (docs/quantization.md) keep their own text around the sections written into them."""
    return is_main_page(path) or not path.exists() or path.read_text().startswith(DOC_HEADER[:13])


def write_section(path: Path, name: str, section: str) -> None:
    """Replace section ``name`` of the page at ``path`` (or add it) and re-render the page.

    The main page keeps only keys of its groups: any other section is written to a scratch file
    under ``SCRATCH`` instead (and said so on stderr), so that nothing is lost and the page
    stays bounded. In any other document the section is replaced where it stands, or appended,
    and the rest of the file is left as it was."""
    if not is_benchmark_page(path):
        path.write_text(replace_in_place(path.read_text(), name, section))
        return
    main_page = is_main_page(path)
    if main_page and _group_of(name, HEADLINE + OTHER) is None:
        scratch = SCRATCH / f"{name}.md"
        print(
            f"benchdoc: {name} is no section of {path} (a kernel experiment's outcome goes to "
            f"the 'tried and left out' list of docs/kernels.md); written to {scratch}",
            file=sys.stderr,
        )
        path = scratch
        main_page = False
    sections = parse_sections(path.read_text()) if path.exists() else []
    sections = [s for s in sections if s.key != name]
    sections.append(Section(name, datetime.now(timezone.utc).replace(microsecond=0), section))
    rewrite(path, sections, main_page)


def replace_in_place(text: str, name: str, section: str) -> str:
    """``text`` with section ``name`` replaced, or appended where it has none."""
    block = f"<!-- {name}:start -->\n{section}\n<!-- {name}:end -->"
    found = re.search(
        rf"<!-- {re.escape(name)}:start(?: \S+)? -->\n.*?<!-- {re.escape(name)}:end -->", text, re.S
    )
    if found is None:
        return f"{text.rstrip()}\n\n{block}\n"
    return text[: found.start()] + block + text[found.end() :]


def rewrite(path: Path, sections: list[Section], main_page: bool) -> None:
    """Render ``sections`` into the page at ``path``; a section that leaves it takes its plot
    along (``KEY.png`` beside the page, as the scripts name them), and a page past its line
    budget says so on stderr."""
    text = render(sections, main_page)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    kept = {s.key for s in parse_sections(text)}
    for s in sections:
        plot = path.parent / f"{s.key}.png"
        if s.key not in kept and plot.exists():
            plot.unlink()
            print(f"benchdoc: {s.key} left {path}, and its plot {plot} with it", file=sys.stderr)
    lines = text.count("\n")
    if main_page and lines > PAGE_LINES:
        sizes = sorted((s.text.count("\n") + 1, s.key) for s in sections if s.key in kept)
        print(
            f"benchdoc: {path} has {lines} lines (budget {PAGE_LINES}); largest sections: "
            + ", ".join(f"{key} ({n})" for n, key in sizes[::-1][:3]),
            file=sys.stderr,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("page", type=Path, nargs="?", default=PAGE, help="default: the page")
    parser.add_argument("--drop", nargs="*", default=[], metavar="KEY", help="sections to drop")
    args = parser.parse_args()
    sections = parse_sections(args.page.read_text()) if args.page.exists() else []
    unknown = set(args.drop) - {s.key for s in sections}
    if unknown:
        parser.error(f"no such sections: {', '.join(sorted(unknown))}")
    main_page = is_main_page(args.page)
    rewrite(args.page, [s for s in sections if s.key not in args.drop], main_page)
    kept = parse_sections(args.page.read_text())
    print(f"{args.page}: {len(kept)} sections, {args.page.read_text().count(chr(10))} lines")


if __name__ == "__main__":
    main()
