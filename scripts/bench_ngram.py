"""Per-decode-step cost of prompt-lookup drafting: native NgramIndex vs the numpy scan.

A step is what a speculative decoder does per accepted token: propose up to k drafts, then append
one token. The native index should be flat in the context length; the numpy scan grows with it.

    python scripts/bench_ngram.py [--contexts 1024 4096 8192 16384] [--steps 2000]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from mlc_spec.runtime.ngram_index import NgramIndex, propose_numpy


def text_like_tokens(length: int, seed: int = 0) -> np.ndarray:
    """Zipf 'words' from a 32k vocab with frequent copies of earlier spans, like code or chat."""
    rng = np.random.default_rng(seed)
    out: list[int] = []
    while len(out) < length:
        if len(out) > 64 and rng.random() < 0.3:
            span = int(rng.integers(8, 33))
            start = int(rng.integers(0, len(out) - span))
            out.extend(out[start : start + span])
        else:
            out.extend(int(t) for t in np.minimum(rng.zipf(1.2, size=8), 32_000))
    return np.array(out[:length], dtype=np.int32)


def native_us_per_step(tokens: np.ndarray, context: int, steps: int, args) -> tuple[float, float]:
    """Returns (µs per step, mean draft length)."""
    index = NgramIndex(args.min_n, args.max_n)
    index.extend(tokens[:context])
    drafted = 0
    start = time.perf_counter()
    for pos in range(context, context + steps):
        drafted += index.propose(args.k).size
        index.extend(tokens[pos : pos + 1])
    return (time.perf_counter() - start) / steps * 1e6, drafted / steps


def numpy_us_per_step(tokens: np.ndarray, context: int, steps: int, args) -> float:
    # The history is a view of a preallocated buffer, so appending costs nothing here.
    start = time.perf_counter()
    for pos in range(context, context + steps):
        propose_numpy(tokens[:pos], args.k, args.min_n, args.max_n)
    return (time.perf_counter() - start) / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192, 16384])
    parser.add_argument("--steps", type=int, default=2000, help="decode steps timed per run")
    parser.add_argument("--repeats", type=int, default=5, help="best of this many runs")
    parser.add_argument("--min-n", type=int, default=2)
    parser.add_argument("--max-n", type=int, default=4)
    parser.add_argument("-k", type=int, default=8, help="max draft tokens per proposal")
    args = parser.parse_args()

    tokens = text_like_tokens(max(args.contexts) + args.steps)
    print(
        f"min_n={args.min_n} max_n={args.max_n} k={args.k}, {args.steps} steps, best of "
        f"{args.repeats}\n"
    )
    print("| context | native µs/step | numpy µs/step | speed-up | mean draft len |")
    print("|---:|---:|---:|---:|---:|")
    for context in args.contexts:
        runs = [native_us_per_step(tokens, context, args.steps, args) for _ in range(args.repeats)]
        native, draft_len = min(runs)
        scan = min(
            numpy_us_per_step(tokens, context, args.steps, args) for _ in range(args.repeats)
        )
        print(f"| {context} | {native:.2f} | {scan:.1f} | {scan / native:.0f}x | {draft_len:.1f} |")


if __name__ == "__main__":
    main()
