"""Automatic prefix caching in the server: ShareGPT conversations replayed turn by turn (each
turn sent with the history and the answers the server gave), ``mlc-spec serve`` with its prefix
cache against the same server without it, loaded in turn at each concurrency. Written to
docs/benchmarks-features.md with the goal's verdict: time to first token of turns >= 2, p50 at
least 3x lower with the cache.

    python scripts/bench_prefix_cache.py [--write docs/benchmarks-features.md]
"""

from __future__ import annotations

import argparse
import os

from benchdoc import SCRATCH, cpu_class, machine_context, publish, start_load, verdict

from mlc_spec.compiler.cache import compiled
from mlc_spec.serve import bench

CONCURRENCY = (1, 4, 16)
ON, OFF = "off", "off, no prefix cache"  # bench serve's labels: no speculation, cache on / off


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.0f}"


def section(results: dict, load, args: argparse.Namespace) -> str:
    """One row per concurrency: TTFT of later turns with and without the cache, the ratio of
    their medians, the hit rate, and throughput."""
    on, off = results["settings"][ON], results["settings"][OFF]
    lines = [
        f"### SmolLM2-135M-Instruct, int8 activations, `{cpu_class()}`",
        "",
        *machine_context(load, "mlc-spec serve", "2 everywhere"),
        f"- Load: {args.conversations} conversations per level and server of 2 to "
        f"{args.max_turns} user turns (ShareGPT, each at most 1500 characters), a request per "
        f"turn with the whole history; greedy, {args.max_tokens} tokens per answer, streamed; "
        f"batch {args.max_batch_size}, {args.max_total_len} tokens of KV cache (room for every "
        f"conversation at C=16, so no request waits for a batch slot); {args.repeats} repeats "
        "interleaved",
        "",
        "| C | requests | TTFT turns >= 2 p50 / p99 ms, cache | without | p50 ratio "
        "| prompt tokens found in the cache | output tok/s, cache / without |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ratios = []
    for c, a, b in zip(CONCURRENCY, on, off, strict=True):
        ratio = b["p50_ttft_later_turns"] / a["p50_ttft_later_turns"]
        ratios.append((c, ratio))
        lines.append(
            f"| {c} | {a['completed']}/{a['requests']} "
            f"| {_ms(a['p50_ttft_later_turns'])} / {_ms(a['p99_ttft_later_turns'])} "
            f"| {_ms(b['p50_ttft_later_turns'])} / {_ms(b['p99_ttft_later_turns'])} "
            f"| {ratio:.2f}x | {a['prefix_cache_hit_rate']:.0%} "
            f"| {a['output_throughput']:.0f} / {b['output_throughput']:.0f} |"
        )
    listed = ", ".join(f"C={c} {r:.2f}x" for c, r in ratios)
    lines += [
        "",
        "- Time to first token of turns >= 2, p50 at least 3x lower with the cache: "
        f"{verdict(all(r >= 3.0 for _, r in ratios), load)} ({listed})",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=16, help="per level and server")
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--max-total-len", type=int, default=32768)
    parser.add_argument("--write", help="replace this benchmark's section of this page")
    args = parser.parse_args()
    os.environ.setdefault("TVM_NUM_THREADS", str(len(os.sched_getaffinity(0))))
    load = start_load()
    cli = argparse.ArgumentParser()
    bench.add_arguments(cli)
    argv = ["--model", str(compiled("smollm2-135m-instruct", activations="int8"))]
    argv += ["--speculative", "none", "--prefix-caching", "both", "--dataset", "sharegpt-chat"]
    argv += ["--max-turns", str(args.max_turns), "--max-tokens", str(args.max_tokens)]
    argv += ["--concurrency", *map(str, CONCURRENCY), "--repeats", str(args.repeats)]
    argv += ["--min-requests", str(args.conversations), "--rounds", "1"]
    argv += ["--max-batch-size", str(args.max_batch_size)]
    argv += ["--max-total-len", str(args.max_total_len)]
    argv += ["--output-dir", str(SCRATCH / "prefix-cache")]
    results = bench.bench(cli.parse_args(argv))
    text = section(results, load, args)
    publish(text, args.write, f"bench_prefix_cache-{cpu_class()}")


if __name__ == "__main__":
    main()
