"""docs/benchmarks.md, benchmarks-serving.md and benchmarks-features.md laid out from the
sections that the benchmark scripts write.

A run's context (date, commit, CPU class, load before and during it) and pages of marked
sections in a fixed order that the scripts rewrite and nobody edits by hand: the headline page
(mlc-spec against llama.cpp), the serving page (against llama-server) and the features page
(prefix cache, prompt chunks, suffix decoding, structured output, replicas, the first run, the
soak...), so that each page stays short enough to read.

Each benchmark script owns sections between ``<!-- key:start STAMP -->`` / ``<!-- key:end -->``
markers (STAMP: when it was written, UTC) and rewrites only its own. A script writes to any
page (``--write docs/benchmarks.md``) and its section goes to the page whose groups claim its
key. Every write re-renders that whole page: its fixed header, its groups in order (their
sections newest first), then its closing note. Each group keeps at most a few sections (the
oldest leaves, git keeps it), and a key that belongs to no group of any page (a kernel A/B,
say) goes to a scratch file instead, so no script can grow a page without bound.

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
SCRATCH = Path("/tmp/mlc-spec-bench")  # where sections that no page keeps go
# Share of the usable cores that other processes kept busy just before a run, above which its
# figures are flagged.
BUSY_SHARE = 0.25
PAGE_LINES = 250  # each page's budget: a write past it warns, naming the largest sections

_HOW_MEASURED = """\
- **How.** Systems and configurations take turns round by round, each in a child process of its
  own, the order reversed every other round; cells are medians (min-max) over rounds. Batch 1,
  greedy, 2 threads on both sides, the same prompt ids and token counts (EOS ignored); tokens/s
  counts prefill plus generation. llama.cpp at its best: plain, draft-simple (n_max swept) and
  its n-gram proposers, each `-fa on` and `off`; step costs from `llama-bench` at our sizes.
- **Goals** (HumanEval, batch 1): the Qwen pair's best >= 2.5x llama.cpp's best with tokens
  identical to our plain decoding; SmolLM2 decode <= 0.5x llama.cpp's; verify of 8 <= 1.5x a
  decode step. A run on a busy machine gets no verdict (llama.cpp slows several-fold).
"""


@dataclass(frozen=True)
class Group:
    """Sections of a page whose keys match ``pattern``: at most ``keep`` of them, newest first,
    under ``heading`` (a ``##`` line), or ``empty`` where there are none yet."""

    heading: str | None
    pattern: str
    keep: int
    empty: str = ""


@dataclass(frozen=True)
class Page:
    """A page of sections: its header, its groups in order, and a closing note."""

    path: Path
    header: str
    groups: tuple[Group, ...]
    note: str = ""


# How keys written by ``cpu_class`` end: one section per CPU class, and no key of the page's
# earlier layout (keyed by hand, ``-xeon``) falls into a group.
_CPU = r"-(?:intel|amd|cpu)-(?:avx512|avx2|x86)(?:-zen5)?"

HEADLINE = Page(
    REPO / "docs" / "benchmarks.md",
    f"""# Benchmarks

mlc-spec against llama.cpp and llama-server on the CPU, written by `scripts/` (laid out by
`benchdoc.py`; nothing is edited by hand): per model, configuration and CPU class (`amd-avx512`:
Zen 4; `amd-avx512-zen5`; `amd-avx2`: AVX2-only EPYC; `intel-avx512`: Xeon), newest first, each
with its command.
Serving against llama-server: [benchmarks-serving.md](benchmarks-serving.md); serving features:
[benchmarks-features.md](benchmarks-features.md); the CUDA path on a lent GPU:
[benchmarks-gpu.md](benchmarks-gpu.md).

{_HOW_MEASURED}
Earlier runs are in git (`git log -p docs/benchmarks.md`).""",
    (
        Group(
            "Qwen2.5-Coder-1.5B with the 0.5B draft: speculative decoding end to end on HumanEval",
            rf"bench_speculative-qwen-.+{_CPU}",
            2,
            "`python scripts/bench_speculative.py --activations int8 --draft-quantization q4 "
            "--draft-lm-head q4 --draft-lm-head-vocab 100000 --rounds 3 --write "
            "docs/benchmarks.md`",
        ),
        Group(
            "SmolLM2-135M-Instruct: step costs against llama.cpp",
            rf"bench_cpu-smollm2-.+{_CPU}",
            2,
            "`python scripts/bench_cpu.py --model smollm2 --repeats 15 --write docs/benchmarks.md`",
        ),
        Group(
            "Qwen2.5-Coder-1.5B-Instruct: step costs against llama.cpp",
            rf"bench_cpu-qwen1\.5b-.+{_CPU}",
            1,
            "`python scripts/bench_cpu.py --model qwen1.5b --activations int8 --repeats 5 "
            "--write docs/benchmarks.md`",
        ),
    ),
    "Kernels, prefetching, AMX and the rest that was tried and left out, one line each with its "
    "measured effect: docs/kernels.md, at the end.",
)
SERVING = Page(
    REPO / "docs" / "benchmarks-serving.md",
    """# Serving side by side with llama-server

`mlc-spec serve` against llama-server on the same GGUF files and threads, loaded in turn by
`mlc-spec bench serve` at each concurrency, written by `scripts/bench_serving.py` (laid out by
`benchdoc.py`; nothing here is edited by hand): one section per model and CPU class, newest
first. Beside them, automatic speculation against none in one process on shared weights
(`scripts/bench_auto.py`), where no server process's memory placement weighs in.
Single-stream decoding against llama.cpp is in [benchmarks.md](benchmarks.md).

- **Goals:** automatic speculation >= 1.0x no speculation in every cell; mlc-spec (its best
  setting) >= 3x llama-server's throughput (its best) at concurrency >= 4; at concurrency 1,
  mlc-spec's best TPOT p50 <= 0.5x llama-server's best.""",
    (
        Group(
            "SmolLM2-135M-Instruct",
            rf"bench_serving-smollm2{_CPU}",
            2,
            "`python scripts/bench_serving.py --pair smollm2 --write docs/benchmarks-serving.md`",
        ),
        Group(
            "Qwen2.5-Coder-1.5B-Instruct with and without the 0.5B draft",
            rf"bench_serving-qwen{_CPU}",
            2,
            "`python scripts/bench_serving.py --pair qwen --rounds 1 --min-requests 4 --repeats 2 "
            "--write docs/benchmarks-serving.md`",
        ),
        Group(
            "Automatic speculation against none in one process, on one copy of the weights",
            rf"bench_auto-(?:smollm2|qwen-pair)(?:-varied)?{_CPU}",
            3,
            "`python scripts/bench_auto.py --write docs/benchmarks-serving.md` (and "
            "`--pair qwen-pair`)",
        ),
        Group(
            "Async scheduling against synchronous steps",
            rf"bench_serving-steps-.+{_CPU}",
            2,
            "`python scripts/bench_serving.py --pair smollm2 --steps --write "
            "docs/benchmarks-serving.md`",
        ),
    ),
)
FEATURES = Page(
    REPO / "docs" / "benchmarks-features.md",
    """# Benchmarks of the serving features

What each serving feature buys, measured with `mlc-spec serve` and written by the scripts in
`scripts/` (`benchdoc.py` lays out the page; nothing here is edited by hand); mlc-spec against
llama.cpp is in [benchmarks.md](benchmarks.md). Each section carries its date, commit, machine
and command: compare only figures from one section.""",
    (
        Group(
            "Suffix decoding in the server: edits sent twice, HumanEval, ShareGPT",
            rf"bench_suffix(?:-qwen)?{_CPU}",
            2,
            "`python scripts/bench_suffix.py --write docs/benchmarks-features.md` (and "
            "`--pair qwen --datasets editing humaneval --concurrency 1 4`)",
        ),
        Group(
            "Structured output with speculation: JSON extraction with and without the schema",
            rf"bench_structured-.+{_CPU}",
            2,
            "`python scripts/bench_structured.py --write docs/benchmarks-features.md` "
            "(and `--pair qwen`)",
        ),
        Group(
            "Prefix caching in the server: ShareGPT conversations turn by turn",
            rf"bench_prefix_cache{_CPU}",
            1,
            "`python scripts/bench_prefix_cache.py --write docs/benchmarks-features.md`",
        ),
        Group(
            "A long prompt while streams decode: prefill chunks within a token budget",
            rf"bench_long_prompt{_CPU}",
            1,
            "`python scripts/bench_long_prompt.py --write docs/benchmarks-features.md`",
        ),
        Group(
            "The README's first run: install, fetch, compile, answer",
            rf"bench_first_run{_CPU}",
            1,
            "`python scripts/bench_first_run.py --write docs/benchmarks-features.md`",
        ),
        Group(
            "Replicas behind sglang-router against one server",
            rf"bench_router{_CPU}",
            1,
            "`python scripts/bench_router.py --write docs/benchmarks-features.md`",
        ),
        Group(
            "`mlc-spec serve` soaked: mixed load at concurrency 64, then SIGTERM",
            r"soak_serve-.+",
            1,
        ),
        Group(
            "Other measurements",
            rf"bench_speculative-smollm2-self-.+{_CPU}",
            1,
        ),
        Group(None, r"bench_adaptive.*", 1),
        Group(None, r"bench_async-.+", 1),
    ),
    "Measured elsewhere: serving under load (`mlc-spec bench serve` writes `results.md` and its "
    "plots into `--output-dir`; the README's plot is `docs/serve_bench.png`, drawn from "
    "`docs/serve_bench.json` of 2026-11-22 on a heavily shared machine) and the n-gram index "
    "(`python scripts/bench_ngram.py` prints its table: the native index 0.7-0.8 µs a step at "
    "1k-16k tokens of context, 25-40x the numpy scan, 2026-11-21). Async scheduling "
    "(`scripts/bench_async.py --write`, 2026-11-22): 0.98-1.07x of synchronous steps on 2 cores, "
    "where the forward keeps both cores busy and the host's share of a step was 0-2%; in the "
    "server: [benchmarks-serving.md](benchmarks-serving.md). Detokenizing "
    "(`python scripts/bench_detokenize.py` prints its table, 2026-11-26): the output processor "
    "decodes only the new tokens, 1.5-6.6 µs of host time per output token at 100 and 2,000 "
    "tokens, where decoding the whole output again after each step cost 31-278 µs at 2,000. The "
    "fidelity of int8 activations against llama.cpp's own: docs/quantization.md "
    "(`scripts/bench_fidelity.py`).",
)
GPU = Page(
    REPO / "docs" / "benchmarks-gpu.md",
    """# Benchmarks of the CUDA path

The CUDA artifacts on a lent GPU (an H100 or H200, when a task is lent one): parity with
transformers, whether verify rows equal decode rows, greedy speculation against plain decoding,
and speed against the HBM roofline and transformers eager. Built here and run there as
docs/gpu.md says; written by `scripts/gpu_report.py` (nothing here is edited by hand).""",
    (
        Group(
            None,
            r"gpu_check",
            1,
            "`scripts/gpu_build.sh` here, `scripts/gpu_check.py` there, `scripts/gpu_report.py` "
            "here (docs/gpu.md)",
        ),
    ),
)
PAGES = (HEADLINE, SERVING, FEATURES, GPU)


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
    Vendor and widest vector ISA, e.g. ``amd-avx512``, ``amd-avx2``, ``intel-avx512``; Zen 5
    (AMD family 26, one cycle per 512-bit operation where Zen 4 takes two) is
    ``amd-avx512-zen5``, as all of them present themselves as plain "AMD EPYC" here."""
    cpu = lscpu_fields()
    flags = set(cpu.get("Flags", "").split())
    vendor = {"GenuineIntel": "intel", "AuthenticAMD": "amd"}.get(cpu.get("Vendor ID", ""), "cpu")
    isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "x86"
    zen5 = vendor == "amd" and isa == "avx512" and cpu.get("CPU family") == "26"
    return f"{vendor}-{isa}" + ("-zen5" if zen5 else "")


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
        f"- Machine: `{cpu['Model name']}` (lscpu model name, CPU family {cpu.get('CPU family')}, "
        f"class `{cpu_class()}`), {cores} "
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


def page_of(key: str) -> Page | None:
    """The page whose groups claim ``key``, if any."""
    return next((p for p in PAGES if _group_of(key, p) is not None), None)


def _group_of(key: str, page: Page) -> Group | None:
    return next((g for g in page.groups if re.fullmatch(g.pattern, key)), None)


def render(sections: list[Section], page: Page | None) -> str:
    """A whole page: header, its groups (each group's sections newest first, at most its
    ``keep``), its note. A scratch file (``page`` None) is every section, newest first."""
    if page is None:
        kept = sorted(sections, key=lambda s: s.stamp, reverse=True)
        return "\n\n".join(map(_marked, kept)) + "\n"
    parts = [page.header.rstrip()]
    for group in page.groups:
        kept = [s for s in sections if _group_of(s.key, page) is group]
        kept = sorted(kept, key=lambda s: s.stamp, reverse=True)[: group.keep]
        if group.heading:
            parts.append(f"## {group.heading}")
        if not kept and group.empty:
            parts.append(f"No run written yet. Reproduce: {group.empty}")
        parts += map(_marked, kept)
    if page.note:
        parts.append(page.note)
    return "\n\n".join(parts) + "\n"


def _marked(s: Section) -> str:
    return f"<!-- {s.key}:start {s.stamp.strftime(_STAMP)} -->\n{s.text}\n<!-- {s.key}:end -->"


def page_at(path: Path) -> Page | None:
    return next((p for p in PAGES if path.resolve() == p.path.resolve()), None)


def is_benchmark_page(path: Path) -> bool:
    """One of the pages, or a file laid out like one (a scratch copy, a new file): other
    documents (docs/quantization.md) keep their own text around the sections written into
    them."""
    return (
        page_at(path) is not None
        or not path.exists()
        or path.read_text().startswith("# Benchmarks")
    )


def write_section(path: Path, name: str, section: str) -> None:
    """Replace section ``name`` (or add it) and re-render its page.

    Written to any page, a section goes to the page whose groups claim its key; one that no
    page claims is written to a scratch file under ``SCRATCH`` instead (and said so on stderr),
    so that nothing is lost and the pages stay bounded. In any other document the section is
    replaced where it stands, or appended, and the rest of the file is left as it was."""
    if not is_benchmark_page(path):
        path.write_text(replace_in_place(path.read_text(), name, section))
        return
    page = page_at(path)
    if page is not None:
        page = page_of(name)
        if page is None:
            path = SCRATCH / f"{name}.md"
            print(
                f"benchdoc: {name} is no section of the benchmark pages (a kernel experiment's "
                f"outcome goes to the 'tried and left out' list of docs/kernels.md); written to "
                f"{path}",
                file=sys.stderr,
            )
        elif page.path.resolve() != path.resolve():
            print(f"benchdoc: {name} belongs to {page.path}; written there", file=sys.stderr)
            path = page.path
    sections = parse_sections(path.read_text()) if path.exists() else []
    sections = [s for s in sections if s.key != name]
    sections.append(Section(name, datetime.now(timezone.utc).replace(microsecond=0), section))
    rewrite(path, sections, page)


def publish(text: str, page: Path | str | None, key: str) -> None:
    """Print a run's section, and write it as ``key`` where a page was asked for (``--write``)."""
    print(text)
    if page:
        write_section(Path(page), key, text)


def replace_in_place(text: str, name: str, section: str) -> str:
    """``text`` with section ``name`` replaced, or appended where it has none."""
    block = f"<!-- {name}:start -->\n{section}\n<!-- {name}:end -->"
    found = re.search(
        rf"<!-- {re.escape(name)}:start(?: \S+)? -->\n.*?<!-- {re.escape(name)}:end -->", text, re.S
    )
    if found is None:
        return f"{text.rstrip()}\n\n{block}\n"
    return text[: found.start()] + block + text[found.end() :]


def rewrite(path: Path, sections: list[Section], page: Page | None) -> None:
    """Render ``sections`` into the page at ``path``; a section that leaves it takes its plot
    along (``KEY.png`` beside the page, as the scripts name them), and a page past its line
    budget says so on stderr."""
    text = render(sections, page)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    kept = {s.key for s in parse_sections(text)}
    for s in sections:
        plot = path.parent / f"{s.key}.png"
        if s.key not in kept and plot.exists():
            plot.unlink()
            print(f"benchdoc: {s.key} left {path}, and its plot {plot} with it", file=sys.stderr)
    lines = text.count("\n")
    if page is not None and lines > PAGE_LINES:
        sizes = sorted((s.text.count("\n") + 1, s.key) for s in sections if s.key in kept)
        print(
            f"benchdoc: {path} has {lines} lines (budget {PAGE_LINES}); largest sections: "
            + ", ".join(f"{key} ({n})" for n, key in sizes[::-1][:3]),
            file=sys.stderr,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "page", type=Path, nargs="?", default=HEADLINE.path, help="default: the headline page"
    )
    parser.add_argument("--drop", nargs="*", default=[], metavar="KEY", help="sections to drop")
    args = parser.parse_args()
    sections = parse_sections(args.page.read_text()) if args.page.exists() else []
    unknown = set(args.drop) - {s.key for s in sections}
    if unknown:
        parser.error(f"no such sections: {', '.join(sorted(unknown))}")
    rewrite(args.page, [s for s in sections if s.key not in args.drop], page_at(args.page))
    kept = parse_sections(args.page.read_text())
    print(f"{args.page}: {len(kept)} sections, {args.page.read_text().count(chr(10))} lines")


if __name__ == "__main__":
    main()
