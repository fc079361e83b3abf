"""Automatic speculation against none, in one process on one copy of the weights: a closed loop
of C clients per dataset and concurrency, every engine in turn each round, the order reversed
every other round.

``bench_serving.py`` starts a server process per setting, and two loads of one artifact can run
3-4% apart for as long as they live (where their weights and KV pages fall in memory: two SmolLM2
int8 engines in one process, each with its own weights, kept that gap through 5 rounds), which
is as much as the policy's choices gain or lose under load. Here every engine runs the one
loaded target (and draft), so the ratios are the policy's, and a second engine without
speculation ("none, again") shows what noise is left.

- ``smollm2``: SmolLM2-135M-Instruct, int8 activations; automatic n-gram and suffix decoding.
- ``qwen-pair``: Qwen2.5-Coder-1.5B-Instruct with its 0.5B sibling as draft, int8 activations;
  automatic n-gram and draft model.

    python scripts/bench_auto.py [--pair smollm2|qwen-pair] [--datasets humaneval sharegpt]
        [--concurrency 4 8] [--rounds 5] [--requests 32] [--max-tokens 64] [--varied]
        [--write PAGE]

Every answer is ``--max-tokens`` long (EOS ignored), as in ``bench_serving.py``. Replies of one
length keep the streams of no speculation in step: they end together, and their successors are
prefilled together with nothing decoding, while speculation's streams drift apart and each
successor is chunked in beside running ones. ``--varied`` draws each request's length from
0.5-1.5x ``--max-tokens`` (the same for every engine), as replies of real traffic differ.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import numpy as np
from benchdoc import cpu_class, machine_context, publish, start_load, usable_cores

THREADS = usable_cores()
# TVM sizes its thread pool when it is first imported, so this precedes the imports that load it.
os.environ["TVM_NUM_THREADS"] = str(THREADS)

from workloads import (  # noqa: E402
    Run,
    closed_loop,
    dataset_prompts,
    load_models,
    shared_engine,
)

from mlc_spec.runtime.engine import Engine  # noqa: E402
from mlc_spec.runtime.params import EngineConfig, SamplingParams  # noqa: E402

METHODS = {"smollm2": ("ngram", "suffix"), "qwen-pair": ("ngram", "draft")}
TITLES = {
    "smollm2": "SmolLM2-135M-Instruct",
    "qwen-pair": "Qwen2.5-Coder-1.5B-Instruct, 0.5B draft",
}
NONE, AGAIN = "none", "none, again"


def measure(
    engines: dict[str, Engine], work: list[list[int]], args: argparse.Namespace, c: int
) -> dict[str, list[Run]]:
    """``args.rounds`` rounds of ``args.requests`` new prompts each (one untimed round
    first), every engine in turn on the same prompts; a speculating engine must give the
    tokens of no speculation."""
    lengths = np.full(len(work), args.max_tokens)
    if args.varied:
        rng = np.random.default_rng(0)
        lengths = rng.integers(args.max_tokens // 2, args.max_tokens * 3 // 2 + 1, len(work))
    params = [SamplingParams(max_tokens=int(n), temperature=0, ignore_eos=True) for n in lengths]
    runs: dict[str, list[Run]] = {name: [] for name in engines}
    for r in range(args.rounds + 1):
        start, stop = r * args.requests, (r + 1) * args.requests
        order = list(engines) if r % 2 == 0 else list(engines)[::-1]
        done = {
            name: closed_loop(engines[name], work[start:stop], params[start:stop], c)
            for name in order
        }
        for name, run in done.items():
            if run.outputs != done[NONE].outputs:
                raise SystemExit(f"{name} at C={c} gave other tokens than no speculation")
            if r:  # the first round warms each engine's caches and cost tables
                runs[name].append(run)
    return runs


def cell(runs: list[Run], base: list[Run]) -> str:
    """The engine's throughput over none's, the median over rounds [their range] (the same
    tokens: the ratio of none's time to the engine's)."""
    ratios = [b.seconds / a.seconds for a, b in zip(runs, base, strict=True)]
    return f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", choices=sorted(METHODS), default="smollm2")
    parser.add_argument("--datasets", nargs="+", default=["humaneval", "sharegpt"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=32, help="new prompts per round")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--varied", action="store_true", help="answers of 0.5-1.5x --max-tokens, not all equal"
    )
    parser.add_argument("--write", type=Path, help="record the section in this markdown file")
    args = parser.parse_args()
    load = start_load()
    models = load_models(args.pair, activations="int8")
    config = EngineConfig()  # the server's: 8 sequences, 8192 tokens of KV cache
    names = [NONE, AGAIN, *(f"{m} auto" for m in METHODS[args.pair])]
    methods = [None, None, *METHODS[args.pair]]
    rows = []
    count = (args.rounds + 1) * args.requests
    for dataset in args.datasets:
        work = dataset_prompts(models[2], dataset, count)
        for c in args.concurrency:
            # Fresh engines per cell: a suffix cache or cost tables from another cell would
            # carry over into this one.
            engines = {
                n: shared_engine(m, "auto", None, models, config)
                for n, m in zip(names, methods, strict=True)
            }
            runs = measure(engines, work, args, c)
            base = runs[NONE]
            tok_s = statistics.median(r.tokens_per_s for r in base)
            cells = [cell(runs[n], base) for n in names[1:]]
            rows.append(f"| {dataset} | {c} | {tok_s:.0f} | " + " | ".join(cells) + " |")
            print(rows[-1], flush=True)
    import tvm  # already imported, after TVM_NUM_THREADS was set

    lengths_text = (
        f"{args.max_tokens // 2}-{args.max_tokens * 3 // 2} tokens (drawn once)"
        if args.varied
        else f"{args.max_tokens} tokens"
    )

    text = "\n".join(
        [
            f"### {TITLES[args.pair]}, int8 activations, answers of "
            f"{'varied' if args.varied else 'one'} length, `{cpu_class()}`",
            "",
            *machine_context(load, f"TVM {tvm.__version__}", f"{THREADS} threads"),
            f"- Load: {args.requests} new prompts per round and engine, {args.rounds} rounds "
            f"after an untimed one, the engines in turn (order reversed every other round); "
            f"greedy, {lengths_text} per answer (EOS ignored); batch 8, 8192 tokens "
            "of KV cache; every speculating engine gave the tokens of no speculation",
            "",
            "| dataset | C | none tok/s | " + " | ".join(names[1:]) + " |",
            "|---|---:|---:|" + "---:|" * (len(names) - 1),
            *rows,
            "",
            "Cells: throughput over no speculation's, the median of the rounds' ratios [their "
            f"range]; '{AGAIN}' is a second engine without speculation (the noise).",
        ]
    )
    varied = "-varied" if args.varied else ""
    publish(text, args.write, f"bench_auto-{args.pair}{varied}-{cpu_class()}")


if __name__ == "__main__":
    main()
