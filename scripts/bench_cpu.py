"""CPU step costs at batch 1: mlc-spec against llama.cpp (and, if asked, transformers).

All systems run the same GGUF file at the same prompt length, context and thread count in one
run, so the ratios hold on a noisy machine where the absolute figures drift. Each system takes
one turn per round in a child process of its own, which loads the model, warms up, measures once
and exits: no TVM or llama.cpp thread pool is alive, spinning after its last call, while another
system runs (this process never imports TVM). The order reverses every other round, a first
warm-up round is dropped, and each cell is the median over rounds with its min-max range.
llama.cpp is ``llama-bench`` (one repetition after its own warm-up) with flash attention off and
on, two systems. Each K-token verify figure stands beside its compute floor: K rows cost K x
(weight parameters) multiply-adds at this CPU's peak rate.

    python scripts/bench_cpu.py [--model smollm2|qwen1.5b] [--quantization as-source|q4|q8|none]
        [--activations float|int8 (default: the model's on this CPU)] [--threads N] [--repeats 10]
        [--systems mlc,llama-fa-off,llama-fa-on,transformers] [--artifact DIR] [--write PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import gguf as gguf_py
import numpy as np
import peak_rate
from benchdoc import (
    StartLoad,
    cpu_class,
    lscpu_fields,
    machine_context,
    publish,
    start_load,
    usable_cores,
    verdict,
)
from llamacpp import FLASH_ATTN, bench, describe_build
from peak_rss import engine_peak_rss, gib, run_measured
from tokenizers import Tokenizer
from transformers_cache import cache_argument

if TYPE_CHECKING:
    from mlc_spec.runtime.model import Model

T = TypeVar("T")
R = TypeVar("R")

# --model choice: (name in mlc_spec.compiler.pypi_models, label)
MODELS = {
    "smollm2": ("smollm2-135m-instruct", "SmolLM2-135M-Instruct"),
    "qwen1.5b": ("qwen2.5-coder-1.5b-instruct", "Qwen2.5-Coder-1.5B-Instruct"),
}
PROMPT_LEN = 128
DECODE_STEPS = 32  # decode runs over contexts 128..160
MULTI_QUERY_KS = (2, 4, 8)
# Calls per verify size and round, averaged as the decode steps are: one call a round let a
# single slow call set the round's ratio (Qwen2.5-1.5B on a Zen 5: verify 8 at 1.07-1.80x a
# decode step over 10 rounds, median 1.52x, while the medians' ratio was 1.22x).
MULTI_QUERY_CALLS = 8
# The goals, per model: our decode ms/token over llama.cpp's best, and the verify cost
# of 8 tokens in our own decode steps.
DECODE_GOALS = {"smollm2": 0.5}
VERIFY_GOALS = {8: 1.5}
LLAMA_SYSTEMS = {f"llama-fa-{fa}": fa for fa in FLASH_ATTN}
SYSTEMS = ("mlc", *LLAMA_SYSTEMS, "transformers")
TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a small tin "
    "of oil and a cloth for the lens. Ships passing the rocky headland relied on the beam to find "
    "the narrow channel into the harbour, and in forty years the light had never once failed. "
)
RESULT = "bench-result: "  # how a child process hands its result to the parent


class Backend(Protocol):
    """One batch-1 sequence with a KV cache: what a speculative decoder does per step."""

    def prefill(self, tokens: list[int]) -> None: ...
    def decode(self, token: int) -> None: ...
    def multi_query(self, tokens: list[int]) -> None: ...
    def rollback(self, n: int) -> None: ...


class Compiled:
    """The mlc-spec artifact on its paged KV cache."""

    def __init__(self, model: Model):
        self.model = model
        self.kv = model.create_kv_cache(
            max_batch_size=1, max_total_len=2048, prefill_chunk_size=512
        )
        self.kv.add_sequence(0)

    def prefill(self, tokens: list[int]) -> None:
        self.model.prefill(self.kv, [0], [tokens])

    def decode(self, token: int) -> None:
        self.model.decode(self.kv, [0], [token])

    def multi_query(self, tokens: list[int]) -> None:
        self.model.evaluate_multi_query(self.kv, [0], [tokens])

    def rollback(self, n: int) -> None:
        self.kv.popn(0, n)


class Eager:
    """transformers in eager PyTorch with its DynamicCache."""

    def __init__(self, hf: Any):
        import torch
        import transformers

        self.torch = torch
        self.hf = hf
        self.cache = transformers.DynamicCache(config=hf.config)
        self.cache_argument = cache_argument(hf, self.cache)

    def _forward(self, tokens: list[int], **kwargs: Any) -> None:
        ids = self.torch.tensor([tokens])
        self.hf(ids, use_cache=True, **self.cache_argument, **kwargs)

    def prefill(self, tokens: list[int]) -> None:
        # Only the last token's logits, like generate() and like our prefill.
        self._forward(tokens, logits_to_keep=1)

    def decode(self, token: int) -> None:
        self._forward([token])

    def multi_query(self, tokens: list[int]) -> None:
        self._forward(tokens)  # verification needs every token's logits

    def rollback(self, n: int) -> None:
        self.cache.crop(-n)


@dataclass
class Figures:
    """Milliseconds per call: one round's sample, or the median over rounds."""

    prefill_ms: float
    decode_ms: float
    multi_query_ms: dict[int, float]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Figures:
        ks = {int(k): v for k, v in data["multi_query_ms"].items()}
        return cls(data["prefill_ms"], data["decode_ms"], ks)


@dataclass(frozen=True)
class Spread:
    """A figure over rounds: its median and range."""

    low: float
    mid: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        return cls(min(values), statistics.median(values), max(values))

    def cell(self, fmt: str = "{:.2f}", suffix: str = "") -> str:
        f = fmt.format
        return f"{f(self.mid)}{suffix} ({f(self.low)}–{f(self.high)})"


def timed_ms(call: Callable[..., object], *args: object) -> float:
    start = time.perf_counter()
    call(*args)
    return (time.perf_counter() - start) * 1e3


def one_round(backend: Backend, prompt: list[int], continuation: list[int]) -> Figures:
    """One sample of each figure: prefill into an empty cache, then decode and multi-query at a
    context of ``len(prompt)`` (means over ``DECODE_STEPS`` steps and ``MULTI_QUERY_CALLS``
    calls); rollbacks are untimed and leave the cache empty again."""
    prefill_ms = timed_ms(backend.prefill, prompt)
    decode_ms = statistics.fmean(timed_ms(backend.decode, token) for token in continuation)
    backend.rollback(len(continuation))
    multi_query_ms = {k: _multi_query_ms(backend, continuation[:k]) for k in MULTI_QUERY_KS}
    backend.rollback(len(prompt))
    return Figures(prefill_ms, decode_ms, multi_query_ms)


def _multi_query_ms(backend: Backend, tokens: list[int]) -> float:
    """Mean ms of ``MULTI_QUERY_CALLS`` multi-query calls of ``tokens``, each rolled back."""
    calls = []
    for _ in range(MULTI_QUERY_CALLS):
        calls.append(timed_ms(backend.multi_query, tokens))
        backend.rollback(len(tokens))
    return statistics.fmean(calls)


def alternate(
    systems: Sequence[T], rounds: int, turn: Callable[[T], R], warm_up: int = 0
) -> dict[T, list[R]]:
    """``turn(system)`` for every system once per round, the order reversed every other round
    (going second was worth 1-5% in an A/A run of identical kernels, ``bench_kernel.py``), so
    that load drifting over minutes weighs on all alike. The first ``warm_up`` rounds are
    dropped; progress goes to stderr."""
    samples: dict[T, list[R]] = {s: [] for s in systems}
    for round_ in range(warm_up + rounds):
        order = list(systems)[::-1] if round_ % 2 else list(systems)
        for system in order:
            start = time.perf_counter()
            result = turn(system)
            if round_ >= warm_up:
                samples[system].append(result)
            label = "warm-up" if round_ < warm_up else f"{round_ - warm_up + 1}/{rounds}"
            print(f"round {label}: {system} {time.perf_counter() - start:.1f}s", file=sys.stderr)
    return samples


def measure(
    backends: list[Backend], prompt: list[int], continuation: list[int], repeats: int
) -> list[list[Figures]]:
    """Every backend's figures over ``repeats`` alternating rounds in this process (after one
    warm-up round that pays first-call costs): for artifacts of one system side by side, as
    ``bench_ab.py`` compares them; systems against each other run in children
    (``alternate``)."""
    rounds = alternate(
        range(len(backends)),
        repeats,
        lambda i: one_round(backends[i], prompt, continuation),
        warm_up=1,
    )
    return [rounds[i] for i in range(len(backends))]


def spreads(rounds: list[Figures]) -> dict[str, Spread]:
    """Each figure's spread over rounds, the verify costs also in the round's decode steps."""
    found = {
        "prefill_ms": Spread.of([r.prefill_ms for r in rounds]),
        "decode_ms": Spread.of([r.decode_ms for r in rounds]),
    }
    for k in MULTI_QUERY_KS:
        found[f"verify{k}_ms"] = Spread.of([r.multi_query_ms[k] for r in rounds])
        found[f"verify{k}_steps"] = Spread.of([r.multi_query_ms[k] / r.decode_ms for r in rounds])
    return found


@dataclass
class ComputeFloor:
    """The least time K rows of a matmul-bound forward can take: K x ``parameters`` FMAs at
    ``fma_per_s``, with the assumption behind that rate in words."""

    parameters: int
    fma_per_s: float
    assumption: str

    def ms(self, rows: int) -> float:
        return rows * self.parameters / self.fma_per_s * 1e3


def _multiplied(path: Path) -> list:
    """The GGUF's tensors that every token multiplies: all 2-D ones, less the embedding table
    when an untied ``output.weight`` is the LM head (then the table is only looked up)."""
    tensors = gguf_py.GGUFReader(path).tensors
    untied = any(t.name == "output.weight" for t in tensors)
    return [
        t for t in tensors if len(t.shape) == 2 and not (untied and t.name == "token_embd.weight")
    ]


def matmul_parameters(path: Path) -> int:
    return sum(int(t.n_elements) for t in _multiplied(path))


def decode_bytes(gguf: Path, artifact: Path) -> tuple[int, int]:
    """Weight bytes a decode step reads: (mlc-spec's artifact, llama.cpp's file as shipped), the
    looked-up embedding table left out where an untied LM head exists. Decode of a quantized
    model is bound by reading them, so bytes / decode time is the bandwidth each one reaches."""
    from mlc_spec.runtime.artifact import NUMPY_DTYPES, read_config

    params = read_config(artifact)["params"]
    untied = any(p.weight == "lm_head.weight" for p in params)
    ours = sum(
        int(np.prod(p.shape)) * np.dtype(NUMPY_DTYPES[p.dtype]).itemsize
        for p in params
        if not (untied and p.weight == "model.embed_tokens.weight")
    )
    return ours, sum(int(t.n_bytes) for t in _multiplied(gguf))


def compute_floor(parameters: int, threads: int, activations: str) -> ComputeFloor:
    """Peak multiply-add rate of ``threads`` cores: measured with the instruction the kernels use
    where a probe runs it (``peak_rate``), else from lscpu: 2 FMA units of 16 lanes with AVX-512
    (but 8 on AMD family 25: Zen 4 splits 512-bit FMAs into two 256-bit halves), of 8 lanes
    with AVX2; the clock lscpu's max MHz, else the TSC rate (BogoMIPS / 2). With int8
    activations each 32-bit lane of an integer dot product (vpdpbusd, vpmaddubsw) does 4."""
    cpu = lscpu_fields()
    flags = set(cpu["Flags"].split())
    zen = cpu.get("Vendor ID") == "AuthenticAMD" and cpu.get("CPU family") == "25"
    if "avx512f" in flags and not zen:
        lanes, isa = 16, "AVX-512"
    elif "avx512f" in flags:
        lanes, isa = 8, "AVX-512 on AMD Zen 4, as two 256-bit halves"
    elif "avx2" in flags and "fma" in flags:
        lanes, isa = 8, "AVX2"
    else:
        raise SystemExit("no AVX2/FMA in lscpu's flags: this benchmark's compute floor needs them")
    per_row = f"{parameters / 1e6:.0f} M weight parameters per row"
    if activations == "int8":
        from mlc_spec.compiler.int8_matmul import integer_dot
        from mlc_spec.compiler.targets import make_target

        dot = integer_dot(make_target("llvm"))
        probe = peak_rate.int8_instruction(dot.instruction, dot.lanes)
    else:
        probe = peak_rate.FMA_512 if "avx512f" in flags else peak_rate.FMA_256
    rate = probe and peak_rate.measured_rate(probe, threads)
    if rate:
        return ComputeFloor(
            parameters,
            rate,
            f"{threads} cores each running 12 independent {probe.name} chains (measured, "
            f"`scripts/peak_rate.py`): {rate / 1e9:.0f} G multiply-adds/s; {per_row}",
        )
    if cpu.get("CPU max MHz"):
        mhz, source = float(cpu["CPU max MHz"]), "lscpu CPU max MHz"
    else:
        mhz, source = float(cpu["BogoMIPS"]) / 2, "TSC rate, lscpu BogoMIPS / 2"
    per_lane, kind = (4, "int8 multiply-adds") if activations == "int8" else (1, "float32 FMA")
    per_cycle = 2 * lanes * per_lane
    return ComputeFloor(
        parameters,
        threads * per_cycle * mhz * 1e6,
        f"{threads} cores x {per_cycle} {kind}/cycle ({isa}, 2 vector units) x "
        f"{mhz / 1e3:.2f} GHz ({source}) = {threads * per_cycle * mhz / 1e3:.0f} G/s; {per_row}",
    )


# --- child processes: each system's turn, and the preparation that needs TVM -----------------


def child_result(value: Any) -> None:
    """Hand ``value`` (JSON) to the parent: the last line it reads of this child's output."""
    print(RESULT + json.dumps(value), flush=True)


def run_child(script: Path, args: list[str], threads: int) -> tuple[Any, int]:
    """Run ``script --child ...`` with ``threads`` for TVM and torch; its result and peak RSS
    (which counts this process's RSS at the fork, small here: no model is loaded in it)."""
    env = {**os.environ, "TVM_NUM_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
    done = run_measured([sys.executable, str(script), *args], env=env)
    line = done.stdout.rpartition(RESULT)[2].splitlines()[0]
    return json.loads(line), done.peak_rss


def _child_prepare(args: argparse.Namespace) -> None:
    """Fetch the GGUF and compile (or take) the artifact: the parent stays free of TVM."""
    import tvm

    from mlc_spec.compiler.cache import compiled
    from mlc_spec.compiler.options import default_activations
    from mlc_spec.compiler.pypi_models import MODELS as PYPI_MODELS
    from mlc_spec.compiler.pypi_models import fetch
    from mlc_spec.compiler.targets import make_target
    from mlc_spec.runtime.artifact import read_config

    name = MODELS[args.model][0]
    gguf = fetch(name)
    artifact = args.artifact or compiled(
        name, args.quantization, show_progress=False, activations=args.activations
    )
    default = default_activations(PYPI_MODELS[name].sha256, args.quantization, make_target("llvm"))
    child_result(
        {
            "gguf": str(gguf),
            "artifact": str(artifact),
            "activations": read_config(artifact)["activations"],
            "default_activations": default,
            "weight_bytes": decode_bytes(gguf, artifact),
            "software": f"TVM {tvm.__version__}",
        }
    )


def _child_turn(args: argparse.Namespace) -> None:
    """One system's turn: load, one untimed warm-up round, one measured round."""
    ids = json.loads(args.ids)
    prompt, continuation = ids[:PROMPT_LEN], ids[PROMPT_LEN:]
    if args.child == "mlc":
        from mlc_spec.runtime.model import Model

        backend: Backend = Compiled(Model(args.artifact))
        software = ""
    else:
        import torch
        import transformers

        torch.set_num_threads(args.threads)
        torch.set_grad_enabled(False)
        gguf = Path(args.gguf)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        ).eval()
        backend = Eager(hf)
        software = (
            f"torch {torch.__version__}, transformers {transformers.__version__} "
            f"({hf.config._attn_implementation} attention)"
        )
    one_round(backend, prompt, continuation)
    figures = one_round(backend, prompt, continuation)
    child_result({**asdict(figures), "software": software})


# --- the report -------------------------------------------------------------------------------


@dataclass
class Side:
    """One system's column: its figures over rounds and its peak RSS (None: not measured)."""

    name: str
    rounds: list[Figures]
    peak_rss: int | None

    @property
    def spread(self) -> dict[str, Spread]:
        return spreads(self.rounds)


def report(
    title: str,
    model: str,
    sides: list[Side],
    floor: ComputeFloor,
    weight_bytes: tuple[int, int],
    context: list[str],
    rounds: int,
    load: StartLoad,
) -> str:
    """The page's section: context, one table (median and range of every figure per system,
    our time over llama.cpp's best), the goals and how each system was run."""
    ours, llamas = sides[0], [s for s in sides if s.name.startswith("llama.cpp")]

    def best_llama(figure: str) -> float:
        return min(s.spread[figure].mid for s in llamas)

    def row(label: str, figure: str, extra: Callable[[Side], str] = lambda s: "") -> str:
        cells = " | ".join(s.spread[figure].cell() + extra(s) for s in sides)
        ratio = f"{ours.spread[figure].mid / best_llama(figure):.2f}x" if llamas else "–"
        return f"| {label} | {cells} | {ratio} |"

    def in_steps(k: int) -> Callable[[Side], str]:
        return lambda s: f", {s.spread[f'verify{k}_steps'].mid:.2f}x"

    columns = " | ".join(s.name for s in sides)
    lines = [
        f"| batch 1, ms: median (min–max) of {rounds} round(s) | {columns} "
        "| mlc-spec / llama.cpp's best |",
        f"|---|{'---:|' * len(sides)}---:|",
        row(f"decode, context {PROMPT_LEN}..{PROMPT_LEN + DECODE_STEPS}", "decode_ms"),
        row(f"prefill {PROMPT_LEN} tokens", "prefill_ms"),
        *(
            row(f"verify {k} tokens, ms and x own decode step", f"verify{k}_ms", in_steps(k))
            for k in MULTI_QUERY_KS
        ),
    ]

    def streamed(side: Side) -> str:
        size = weight_bytes[0] if side is ours else weight_bytes[1] if side in llamas else 0
        ms = side.spread["decode_ms"].mid
        return f"{size / 1e9:.2f} GB, {size / ms / 1e6:.1f} GB/s" if size else "–"

    lines.append(
        f"| weights read per decode step | {' | '.join(map(streamed, sides))} "
        f"| {weight_bytes[0] / weight_bytes[1]:.2f}x llama.cpp's bytes |"
    )
    rss = " | ".join(gib(s.peak_rss) if s.peak_rss else "–" for s in sides)
    lines.append(f"| peak RSS | {rss} | |")
    return "\n".join(
        [
            f"### {title}",
            "",
            *context,
            "",
            *lines,
            "",
            *goals(model, ours, best_llama("decode_ms") if llamas else None, floor, load),
            f"- Compute floor of a K-token verify: {floor.assumption}; K rows at least "
            + ", ".join(f"{floor.ms(k):.2f} ms at K={k}" for k in MULTI_QUERY_KS)
            + " (attention ignored).",
            f"- How: mlc-spec's `Model.prefill` / `decode` / `evaluate_multi_query` (logits of "
            f"all K rows) on its paged KV cache, a {PROMPT_LEN}-token English prompt, "
            f"{DECODE_STEPS} decode steps, {MULTI_QUERY_CALLS} calls of each verify size (means); "
            f"llama.cpp `llama-bench -r 1 -fa off|on -p "
            f"{PROMPT_LEN} -n 0` and `-d {PROMPT_LEN} -n {DECODE_STEPS} -p "
            f"{','.join(map(str, MULTI_QUERY_KS))}` (random token ids; its batches compute only "
            "their last token's logits); peak RSS of a child loading and generating.",
        ]
    )


def goals(
    model: str, ours: Side, llama_decode_ms: float | None, floor: ComputeFloor, load: StartLoad
) -> list[str]:
    """The issue's goals, judged on medians, with the range over rounds. Beside the verify
    goal, what it asks of each token past the first: the time it may add against what it adds,
    and against its multiply-adds alone at the compute floor, which no kernel beats."""
    lines = []
    if llama_decode_ms is not None:
        decode = ours.spread["decode_ms"]
        ratio = decode.mid / llama_decode_ms
        goal = DECODE_GOALS.get(model)
        lines.append(
            f"- Decode {ratio:.2f}x llama.cpp's best ms/token"
            + (f" (goal <= {goal}x): {verdict(ratio <= goal, load)}" if goal else "")
        )
    for k, goal in VERIFY_GOALS.items():
        cost = ours.spread[f"verify{k}_steps"]
        decode_ms = ours.spread["decode_ms"].mid
        adds = (ours.spread[f"verify{k}_ms"].mid - decode_ms) / (k - 1)
        allowed = (goal - 1) * decode_ms / (k - 1)
        lines += [
            f"- Verify {k} tokens {cost.cell(suffix='x')} a decode step (goal <= {goal}x): "
            f"{verdict(cost.mid <= goal, load)}",
            f"- Per token past the first, a verify of {k} adds {adds:.2f} ms (its time less a "
            f"decode step's, over {k - 1}); the goal allows {allowed:.2f} ms ({goal - 1:g} of a "
            f"decode step, over {k - 1}), of which one row's multiply-adds at the compute floor "
            f"below take {floor.ms(1):.2f} ms ({floor.ms(1) / allowed:.0%}), leaving "
            f"{allowed - floor.ms(1):.2f} ms for its attention, activation rounding, norms and "
            "the rest",
        ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="smollm2", help="default: smollm2")
    parser.add_argument(
        "--quantization",
        default="as-source",
        help="how mlc-spec compiles the weights: as-source (default, the GGUF's own types), q4, "
        "q8 or none (float32)",
    )
    parser.add_argument(
        "--activations",
        choices=("float", "int8"),
        help="how mlc-spec's quantized linear layers take activations: float or int8 (quantized "
        "per row and group, integer dot products); default: the model's default on this CPU",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=int(os.environ.get("TVM_NUM_THREADS") or usable_cores()),
        help="threads of every system (default: $TVM_NUM_THREADS, else the usable cores)",
    )
    parser.add_argument(
        "--repeats", type=int, default=10, help="rounds after the warm-up round (default 10)"
    )
    parser.add_argument(
        "--systems",
        default="mlc,llama-fa-off,llama-fa-on",
        help=f"comma-separated, in turn order, of {','.join(SYSTEMS)} (default: all but "
        "transformers, which dequantizes to float32 and is slow on the 1.5B)",
    )
    parser.add_argument(
        "--artifact", type=Path, help="a compiled artifact of --model (default: the cached one)"
    )
    parser.add_argument("--write", type=Path, help="replace this run's section of this page")
    parser.add_argument(
        "--child", choices=("prepare", "mlc", "transformers"), help=argparse.SUPPRESS
    )
    parser.add_argument("--ids", help=argparse.SUPPRESS)
    parser.add_argument("--gguf", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "prepare":
        return _child_prepare(args)
    if args.child:
        return _child_turn(args)
    systems = args.systems.split(",")
    if unknown := set(systems) - set(SYSTEMS):
        parser.error(f"unknown systems {sorted(unknown)}; known: {', '.join(SYSTEMS)}")
    if systems[0] != "mlc":
        parser.error("--systems must start with mlc: the table compares it with the others")
    load = start_load()  # before we add our own

    script = Path(__file__).resolve()
    common = ["--model", args.model, "--quantization", args.quantization]
    common += ["--threads", str(args.threads)]
    if args.artifact:
        common += ["--artifact", str(args.artifact)]
    given = ["--activations", args.activations] if args.activations else []
    prepared, _ = run_child(script, [*common, *given, "--child", "prepare"], args.threads)
    gguf, artifact = Path(prepared["gguf"]), Path(prepared["artifact"])
    activations = prepared["activations"]
    common += ["--activations", activations]
    common += [] if args.artifact else ["--artifact", str(artifact)]
    tokens = Tokenizer.from_file(str(artifact / "tokenizer.json")).encode(TEXT * 8).ids
    ids = tokens[: PROMPT_LEN + DECODE_STEPS]
    software = {"mlc": prepared["software"]}
    peak_rss: dict[str, int] = {"mlc": engine_peak_rss(artifact, prompt_len=PROMPT_LEN)}

    def turn(system: str) -> Figures:
        assert "tvm" not in sys.modules, "TVM must live in the children only"
        if system in LLAMA_SYSTEMS:
            figures = bench(
                gguf,
                args.threads,
                PROMPT_LEN,
                DECODE_STEPS,
                1,
                MULTI_QUERY_KS,
                flash_attn=LLAMA_SYSTEMS[system],
            )
            peak_rss[system] = max(peak_rss.get(system, 0), figures.peak_rss)
            return Figures(
                PROMPT_LEN * 1e3 / figures.prefill_tok_s,
                figures.decode_ms_per_token,
                figures.batch_ms,
            )
        child = ["--child", system, "--ids", json.dumps(ids), "--gguf", str(gguf)]
        result, rss = run_child(script, [*common, *child], args.threads)
        if system == "transformers":
            peak_rss[system] = max(peak_rss.get(system, 0), rss)
        software[system] = result.pop("software")
        return Figures.from_json(result)

    rounds = alternate(systems, args.repeats, turn, warm_up=1)

    names = {
        "mlc": f"mlc-spec ({args.quantization}, {activations} activations)",
        **{s: f"llama.cpp -fa {fa}" for s, fa in LLAMA_SYSTEMS.items()},
        "transformers": "transformers (float32)",
    }
    sides = [Side(names[s], rounds[s], peak_rss.get(s)) for s in systems]
    extra = [software[s] for s in systems if software.get(s)]
    context = machine_context(
        load,
        ", ".join([*extra, describe_build()]),
        f"{args.threads} everywhere (TVM_NUM_THREADS, llama-bench -t, torch); "
        f"{args.repeats} round(s) after a warm-up round",
    )
    label = MODELS[args.model][1]
    default = " (the default)" if activations == prepared["default_activations"] else ""
    title = f"{label}, `{args.quantization}` weights, {activations} activations{default}, "
    title += f"`{cpu_class()}`"
    floor = compute_floor(matmul_parameters(gguf), args.threads, activations)
    weight_bytes = tuple(prepared["weight_bytes"])
    section = report(title, args.model, sides, floor, weight_bytes, context, args.repeats, load)
    key = f"bench_cpu-{args.model}-{args.quantization}-{activations}-{cpu_class()}"
    publish(section, args.write, key)


if __name__ == "__main__":
    main()
