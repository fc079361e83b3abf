"""The llama.cpp reference: build it once, and run it on the same GGUF files as mlc-spec.

The source is the ``llama-cpp-python`` sdist's vendored llama.cpp (fetched with pip, so it works
where only package registries are reachable), built with CMake for this CPU into
``~/.cache/mlc-spec/llama.cpp-<version>/``. A build whose binaries exist is reused, so only the
first call costs its ~5 minutes on 2 cores. The runners return figures parsed from llama.cpp's
own output and the child's peak RSS:

- ``bench``: ``llama-bench`` prefill, decode and K-token batches (``-o json``);
- ``speculative``: ``llama-speculative-simple``, a draft model proposing for the target, greedy;
- ``plain``: ``llama-completion`` on the same prompt, greedy, no speculation.

    python scripts/llamacpp.py [GGUF]   # build, then print llama-bench's figures for GGUF
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from benchdoc import lscpu_fields
from peak_rss import gib, run_measured

from mlc_spec.compiler.pypi_models import default_cache_dir

VERSION = "0.3.36"
SDIST = f"llama_cpp_python-{VERSION}"
TARGETS = ("llama-bench", "llama-speculative-simple", "llama-completion", "llama-perplexity")
NATIVE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
)
# GCC honours an explicit -mno-* over what -march=native implies, whatever their order.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
BUILD_JOBS = 2
CONTEXT = 4096  # tokens of KV cache for the generation runners: prompt + output fit


def cache_dir() -> Path:
    return default_cache_dir() / f"llama.cpp-{VERSION}"


def cmake_flags() -> tuple[str, ...]:
    """Native, except AMX where the CPU has it: this version's AMX matmul segfaulted on the
    first prefill on a 2-core Xeon VM (2026-11-23; llama.cpp issue 20824 reports the same)."""
    if "amx_int8" not in lscpu_fields()["Flags"].split():
        return NATIVE_FLAGS
    return (*NATIVE_FLAGS, f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}")


def build() -> Path:
    """The directory of the built binaries, building whatever is missing or was configured
    with other flags."""
    root = cache_dir()
    bin_dir = root / "build" / "bin"
    flags, stamp = cmake_flags(), root / "build" / "mlc-spec-cmake-flags"
    built = all((bin_dir / target).exists() for target in TARGETS)
    if built and stamp.exists() and stamp.read_text() == "\n".join(flags):
        return bin_dir
    if not (root / SDIST).exists():
        _unpack_sdist(root)
    source = root / SDIST / "vendor" / "llama.cpp"
    print(f"building llama.cpp from {SDIST} (several minutes)", file=sys.stderr)
    subprocess.run(["cmake", "-S", source, "-B", root / "build", *flags], check=True)
    subprocess.run(
        ["cmake", "--build", root / "build", f"-j{BUILD_JOBS}", "--target", *TARGETS], check=True
    )
    stamp.write_text("\n".join(flags))
    return bin_dir


def _unpack_sdist(root: Path) -> None:
    """Download the sdist, note its sha256 and unpack it; renamed into place only when whole."""
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
            + ["--dest", tmp, f"llama-cpp-python=={VERSION}"],
            check=True,
        )
        archive = Path(tmp) / f"{SDIST}.tar.gz"
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        digest = hashlib.sha256(archive.read_bytes()).hexdigest()
        (Path(tmp) / SDIST / "sdist.sha256").write_text(f"{digest}  {archive.name}\n")
        Path(tmp, SDIST).rename(root / SDIST)


def describe_build() -> str:
    """What was built, for the benchmark's context lines: the sdist and llama.cpp's build info."""
    sha = (cache_dir() / SDIST / "sdist.sha256").read_text().split()[0]
    info = subprocess.run(
        [build() / "llama-completion", "--version"], capture_output=True, text=True, check=True
    )
    version = " ".join((info.stdout + info.stderr).split())
    return (
        f"llama.cpp vendored in llama-cpp-python {VERSION} (sdist sha256 {sha[:12]}…; "
        f"`--version`: {version}; cmake {' '.join(cmake_flags())})"
    )


@dataclass
class BenchFigures:
    """llama-bench's medians: prefill from empty; decode and K-token batches (the shape of a
    verification step) at a context of the prompt's length."""

    decode_ms_per_token: float
    prefill_tok_s: float
    batch_ms: dict[int, float]
    peak_rss: int


def bench(
    gguf: Path,
    threads: int = 2,
    n_prompt: int = 128,
    n_gen: int = 64,
    reps: int = 5,
    batch_ks: tuple[int, ...] = (),
) -> BenchFigures:
    """``llama-bench`` on ``gguf``: prefill of ``n_prompt`` tokens into an empty cache, and, at a
    context of ``n_prompt`` tokens, ``n_gen`` decode steps and one batch of each K in
    ``batch_ks``; medians of ``reps`` runs after llama-bench's own warm-up run (its means
    would follow every stall of a shared machine).

    llama-bench's batches compute the logits of their last token only, where verification needs
    all K: its K-token figure leaves out K - 1 rows of the LM head.
    """
    tool = str(build() / "llama-bench")
    common = ["-m", str(gguf), "-t", str(threads), "-r", str(reps), "-o", "json"]
    prefill = run_measured([tool, *common, "-p", str(n_prompt), "-n", "0"])
    at_depth = ["-d", str(n_prompt), "-n", str(n_gen)]
    at_depth += ["-p", ",".join(map(str, batch_ks))] if batch_ks else ["-p", "0"]
    deep = run_measured([tool, *common, *at_depth])
    rows = json.loads(prefill.stdout) + json.loads(deep.stdout)

    def median_ms(n_prompt: int, n_gen: int, depth: int) -> float:
        shape = (n_prompt, n_gen, depth)
        row = next(r for r in rows if (r["n_prompt"], r["n_gen"], r["n_depth"]) == shape)
        return statistics.median(row["samples_ns"]) / 1e6

    return BenchFigures(
        decode_ms_per_token=median_ms(0, n_gen, n_prompt) / n_gen,
        prefill_tok_s=n_prompt * 1e3 / median_ms(n_prompt, 0, 0),
        batch_ms={k: median_ms(k, 0, n_prompt) for k in batch_ks},
        peak_rss=max(prefill.peak_rss, deep.peak_rss),
    )


def median_figures(rounds: list[BenchFigures], peak_rss: int) -> BenchFigures:
    """The median of each timed figure over rounds of ``bench``, with ``peak_rss`` (taken by
    the caller from a run whose parent process was small: see ``peak_rss.run_measured``)."""
    return BenchFigures(
        decode_ms_per_token=statistics.median(r.decode_ms_per_token for r in rounds),
        prefill_tok_s=statistics.median(r.prefill_tok_s for r in rounds),
        batch_ms={k: statistics.median(r.batch_ms[k] for r in rounds) for k in rounds[0].batch_ms},
        peak_rss=peak_rss,
    )


@dataclass
class Generation:
    """One greedy generation: tokens generated, seconds for prompt and generation (model loading
    excluded), the generated text, speculation counters where any, and peak RSS."""

    tokens: int
    prompt_s: float
    generate_s: float
    text: str
    peak_rss: int
    drafted: int = 0
    accepted: int = 0

    @property
    def seconds(self) -> float:
        """Prompt processing plus generation: what mlc-spec's tokens/s divides by too."""
        return self.prompt_s + self.generate_s


GREEDY = ("--temp", "0", "--top-k", "1", "--seed", "0")


def same_text(a: str, b: str) -> bool:
    """Whether two greedy generations agree as far as the shorter goes: where one reaches
    ``-n`` first, llama-speculative-simple overshoots it by up to n_max tokens."""
    shorter, longer = sorted((a, b), key=len)
    return longer.startswith(shorter)


def speculative(
    target_gguf: Path,
    draft_gguf: Path,
    prompt: str,
    n_predict: int,
    draft_n_max: int,
    threads: int = 2,
) -> Generation:
    """``llama-speculative-simple``: the draft proposes ``draft_n_max`` tokens a step
    (``--spec-type draft-simple``, default minimum draft probability 0), the target verifies
    them in one batch; greedy. It stops once it has more than ``n_predict`` tokens."""
    cmd = [str(build() / "llama-speculative-simple"), "-m", str(target_gguf)]
    cmd += ["-md", str(draft_gguf), "--spec-type", "draft-simple"]
    cmd += ["--spec-draft-n-max", str(draft_n_max), "-p", prompt, "-n", str(n_predict)]
    cmd += ["-t", str(threads), "-td", str(threads), "-c", str(CONTEXT), *GREEDY]
    done = run_measured(cmd)
    log = done.stderr
    encoded = _match(r"encoded\s+\d+ tokens in\s+([\d.]+) seconds", log)
    decoded = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
    if decoded is None:
        raise RuntimeError(f"no timings in llama-speculative-simple's output:\n{log[-2000:]}")
    return Generation(
        tokens=int(decoded[1]),
        prompt_s=float(encoded),
        generate_s=float(decoded[2]),
        text=_generated_text(done.stdout, prompt),
        peak_rss=done.peak_rss,
        drafted=int(_match(r"n_drafted\s*=\s*(\d+)", log)),
        accepted=int(_match(r"n_accept\s*=\s*(\d+)", log)),
    )


def plain(gguf: Path, prompt: str, n_predict: int, threads: int = 2) -> Generation:
    """``llama-completion`` on the same prompt without speculation, greedy."""
    cmd = [str(build() / "llama-completion"), "-m", str(gguf), "-p", prompt]
    cmd += ["-n", str(n_predict), "-t", str(threads), "-c", str(CONTEXT), *GREEDY]
    cmd += ["-no-cnv", "--no-display-prompt"]
    done = run_measured(cmd)
    log = done.stderr
    prompt_ms = _match(r"prompt eval time =\s+([\d.]+) ms", log)
    eval_ms = _match(r"perf_print:\s+eval time =\s+([\d.]+) ms", log)
    runs = _match(r"perf_print:\s+eval time =\s+[\d.]+ ms /\s+(\d+) runs", log)
    # The first generated token comes from the prompt's logits; each later one is an eval run.
    return Generation(
        tokens=int(runs) + 1,
        prompt_s=float(prompt_ms) / 1e3,
        generate_s=float(eval_ms) / 1e3,
        # it prints the generation, " [end of text]\n" if it ended there, then two newlines
        text=done.stdout.removesuffix("\n\n").removesuffix(" [end of text]\n"),
        peak_rss=done.peak_rss,
    )


def _match(pattern: str, text: str) -> str:
    found = re.search(pattern, text)
    if found is None:
        raise RuntimeError(f"llama.cpp's output lacks /{pattern}/:\n{text[-2000:]}")
    return found[1]


def _generated_text(stdout: str, prompt: str) -> str:
    """llama-speculative-simple prints two newlines and the prompt before the generation, and
    four newlines after it."""
    text = stdout.removeprefix("\n\n").removesuffix("\n\n\n\n")
    if not text.startswith(prompt):
        raise RuntimeError(f"llama-speculative-simple did not echo the prompt:\n{stdout[:500]}")
    return text[len(prompt) :]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", type=Path, nargs="?", help="a GGUF to run llama-bench on")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    bin_dir = build()
    print(f"binaries in {bin_dir}")
    if args.gguf:
        figures = bench(args.gguf, threads=args.threads, batch_ks=(2, 4, 8))
        print(describe_build())
        print(f"decode {figures.decode_ms_per_token:.2f} ms/token at depth 128")
        print(f"prefill {figures.prefill_tok_s:.1f} tokens/s (128 tokens)")
        for k, ms in figures.batch_ms.items():
            print(f"{k} tokens at once {ms:.2f} ms ({ms / figures.decode_ms_per_token:.2f}x)")
        print(f"peak RSS {gib(figures.peak_rss)}")


if __name__ == "__main__":
    main()
