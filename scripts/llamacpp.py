"""The llama.cpp reference: build it once, and run it on the same GGUF files as mlc-spec.

The source is the ``llama-cpp-python`` sdist's vendored llama.cpp (fetched with pip, so it works
where only package registries are reachable), built with CMake for this CPU into
``~/.cache/mlc-spec/llama.cpp-<version>/``. A build whose binaries exist is reused, so only the
first call costs its ~10 minutes on 2 cores. The runners return figures parsed from llama.cpp's
own output and the child's peak RSS; each runs with flash attention ``on`` or ``off`` (``-fa``;
llama.cpp's default ``auto`` turns it on where the backend supports it):

- ``bench``: ``llama-bench`` prefill, decode and K-token batches (``-o json``);
- ``plain``: ``llama-completion``, greedy, no speculation, exactly N tokens;
- ``speculative``: ``llama-speculative-simple`` with a draft model (``draft-simple``) or one of
  its n-gram proposers (``ngram-simple``, ``ngram-mod``, ...), greedy, N tokens or a few more.

What their timings mean, read from this version's source. ``llama-completion``'s ``total time``
runs from its timers' reset after loading and warm-up to the end of generation: prompt
tokenization and evaluation, generation, sampling, printing (``load time`` apart).
``llama-speculative-simple``'s ``encoded`` covers the target's pass over the prompt (all but its
last token) and the proposer's (the draft model evaluates it too), ``decoded`` the generation
loop from the last prompt token on, drafting, verification and sampling included. Both runners
use the sum: prefill plus generation, as mlc-spec's wall time of a ``generate`` call.
``llama-speculative-simple -n N`` generates N + 1 tokens (it drafts at most what is left, then
takes one more step), so it is asked for N - 1; but its draft model ignores a budget of zero
and drafts n_max tokens anyway, so ``draft-simple`` may end up to n_max + 1 tokens past N:
``Generation.seconds_for`` then scales the generation time down to N tokens.

    python scripts/llamacpp.py [GGUF] [--fa on|off]   # build, then llama-bench's figures
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
from dataclasses import dataclass, field
from pathlib import Path

from benchdoc import lscpu_fields
from peak_rss import gib, run_measured

from mlc_spec.paths import LLAMA_CPP_PYTHON_VERSION
from mlc_spec.paths import llama_cpp_dir as cache_dir

VERSION = LLAMA_CPP_PYTHON_VERSION
SDIST = f"llama_cpp_python-{VERSION}"
TARGETS = (
    "llama-bench",
    "llama-speculative-simple",
    "llama-completion",
    "llama-perplexity",
    "llama-server",
)
NATIVE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
)
# GCC honours an explicit -mno-* over what -march=native implies, whatever their order.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
BUILD_JOBS = 2
CONTEXT = 4096  # tokens of KV cache for the generation runners: prompt + output fit
FLASH_ATTN = ("off", "on")  # the -fa settings the benchmarks compare


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
    flash_attn: str = "on",
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
    common += ["-fa", flash_attn]
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


@dataclass
class Generation:
    """One greedy generation: tokens generated, seconds of prefill and of generation (model
    loading excluded), the generated text, the prompt's token ids as llama.cpp tokenized them
    (where the runner prints them), speculation counters where any, and peak RSS."""

    tokens: int
    prompt_s: float
    generate_s: float
    text: str
    peak_rss: int
    prompt_ids: list[int] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0

    @property
    def seconds(self) -> float:
        return self.prompt_s + self.generate_s

    def seconds_for(self, n_tokens: int) -> float:
        """Prefill plus the generation of the first ``n_tokens`` tokens, taking the generation's
        tokens as equally dear where it generated more."""
        share = min(1.0, n_tokens / self.tokens)
        return self.prompt_s + self.generate_s * share


GREEDY = ("--temp", "0", "--top-k", "1", "--seed", "0", "--ignore-eos")


def plain(
    gguf: Path, prompt: str, n_tokens: int, threads: int = 2, flash_attn: str = "on"
) -> Generation:
    """``llama-completion`` on ``prompt`` without speculation: exactly ``n_tokens`` tokens,
    greedy, EOS ignored. Its ``--verbose-prompt`` listing gives the prompt's token ids."""
    cmd = [str(build() / "llama-completion"), "-m", str(gguf), "-p", prompt]
    cmd += ["-n", str(n_tokens), "-t", str(threads), "-c", str(CONTEXT), "-fa", flash_attn]
    cmd += [*GREEDY, "-no-cnv", "--no-display-prompt", "--verbose-prompt"]
    done = run_measured(cmd)
    log = done.stderr
    total_ms = float(_match(r"perf_print:\s+total time =\s+([\d.]+) ms", log))
    prompt_ms = float(_match(r"perf_print: prompt eval time =\s+([\d.]+) ms", log))
    runs = _match(r"perf_print:\s+eval time =\s+[\d.]+ ms /\s+(\d+) runs", log)
    # The first generated token comes from the prompt's logits; each later one is an eval run.
    # What is not prompt evaluation (generation, sampling, the rest) counts as generation.
    return Generation(
        tokens=int(runs) + 1,
        prompt_s=prompt_ms / 1e3,
        generate_s=(total_ms - prompt_ms) / 1e3,
        # it prints the generation, " [end of text]\n" if it ended there, then two newlines
        text=done.stdout.removesuffix("\n\n").removesuffix(" [end of text]\n"),
        peak_rss=done.peak_rss,
        prompt_ids=_prompt_ids(log),
    )


# Speculation as llama-speculative-simple's flags: the draft model's, and its n-gram proposers'
# at their defaults and with lookups about the size of mlc-spec's prompt lookup (n-grams of up
# to 3 tokens, up to 4 drafted).
def draft_simple(n_max: int) -> list[str]:
    return ["--spec-type", "draft-simple", "--spec-draft-n-max", str(n_max)]


NGRAM = {
    "ngram-simple": ["--spec-type", "ngram-simple"],
    "ngram-simple-3-4": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3"]
    + ["--spec-ngram-simple-size-m", "4"],
    "ngram-mod": ["--spec-type", "ngram-mod"],
    "ngram-mod-3-4": ["--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", "3"]
    + ["--spec-ngram-mod-n-min", "1", "--spec-ngram-mod-n-max", "4"],
}


def speculative(
    target_gguf: Path,
    prompt: str,
    n_tokens: int,
    spec: list[str],
    draft_gguf: Path | None = None,
    threads: int = 2,
    flash_attn: str = "on",
) -> Generation:
    """``llama-speculative-simple`` with the proposer ``spec`` (``draft_simple(n)`` with
    ``draft_gguf``, or one of ``NGRAM``): ``n_tokens`` tokens (``draft-simple`` may overshoot,
    see the module's docstring), greedy, EOS ignored."""
    cmd = [str(build() / "llama-speculative-simple"), "-m", str(target_gguf), *spec]
    if draft_gguf is not None:
        cmd += ["-md", str(draft_gguf), "-td", str(threads)]
    cmd += ["-p", prompt, "-n", str(n_tokens - 1), "-t", str(threads), "-c", str(CONTEXT)]
    cmd += ["-fa", flash_attn, *GREEDY]
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


def same_text(a: str, b: str) -> bool:
    """Whether two greedy generations agree as far as the shorter goes (one of
    llama-speculative-simple's may run past the token limit)."""
    shorter, longer = sorted((a, b), key=len)
    return longer.startswith(shorter)


def _match(pattern: str, text: str) -> str:
    found = re.search(pattern, text)
    if found is None:
        raise RuntimeError(f"llama.cpp's output lacks /{pattern}/:\n{text[-2000:]}")
    return found[1]


def _prompt_ids(log: str) -> list[int]:
    """The ids of ``--verbose-prompt``'s listing: a count line, then one ``ID -> 'piece'`` line
    per token (a piece holding a newline continues on unprefixed lines)."""
    count = re.search(r"number of tokens in prompt = (\d+)\n", log)
    if count is None:
        raise RuntimeError(f"no --verbose-prompt listing in llama.cpp's output:\n{log[-2000:]}")
    lines = re.finditer(r"^(?:[\d.]+ I )?\s*(\d+) -> '", log[count.end() :], re.M)
    return [int(m[1]) for m in lines][: int(count[1])]


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
    parser.add_argument("--fa", choices=FLASH_ATTN, default="on", help="flash attention")
    args = parser.parse_args()
    bin_dir = build()
    print(f"binaries in {bin_dir}")
    if args.gguf:
        figures = bench(args.gguf, threads=args.threads, batch_ks=(2, 4, 8), flash_attn=args.fa)
        print(describe_build())
        print(f"decode {figures.decode_ms_per_token:.2f} ms/token at depth 128")
        print(f"prefill {figures.prefill_tok_s:.1f} tokens/s (128 tokens)")
        for k, ms in figures.batch_ms.items():
            print(f"{k} tokens at once {ms:.2f} ms ({ms / figures.decode_ms_per_token:.2f}x)")
        print(f"peak RSS {gib(figures.peak_rss)}")


def build_target(target: str) -> Path:
    """The path of binary ``target``, built into the same tree as ``TARGETS`` if missing: tools
    that one benchmark alone needs (``llama-quantize`` for bench_fidelity's F32 reference)
    cost their minutes of building only where they are used."""
    binary = build() / target
    if not binary.exists():
        print(f"building llama.cpp's {target} (a few minutes)", file=sys.stderr)
        subprocess.run(
            ["cmake", "--build", cache_dir() / "build", f"-j{BUILD_JOBS}", "--target", target],
            check=True,
        )
    return binary


if __name__ == "__main__":
    main()
