"""Replicas behind sglang-router against one server, on this machine: ``mlc-spec serve`` with
one thread, and ``mlc-spec serve --replicas 2`` with one thread per replica, loaded in turn at
each concurrency. At concurrency 1 both compute each request on one thread, so the difference
in latency is the router's hop; above it the second replica uses the second core. Written to
docs/benchmarks-features.md.

    python scripts/bench_router.py [--write docs/benchmarks-features.md]
"""

from __future__ import annotations

import argparse

from benchdoc import SCRATCH, cpu_class, machine_context, publish, start_load

from mlc_spec.compiler.cache import compiled
from mlc_spec.serve import bench

CONCURRENCY = (1, 2, 4, 8)
ONE, TWO = "off, 1 replica x 1 thread", "off, 2 replicas x 1 thread"  # bench serve's labels


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.1f}"


def section(results: dict, load, args: argparse.Namespace) -> str:
    """One row per concurrency: latency and throughput of each, and their ratios."""
    one, two = results["settings"][ONE], results["settings"][TWO]
    lines = [
        f"### SmolLM2-135M-Instruct, int8 activations, `{cpu_class()}`",
        "",
        *machine_context(load, "mlc-spec serve, sglang-router", "1 per server or replica"),
        f"- Load: HumanEval prompts, at least {args.requests} requests per level and server, "
        f"greedy, {args.max_tokens} tokens each, EOS ignored, streamed, no speculation; "
        f"{args.repeats} repeats interleaved (median run's throughput, latencies pooled)",
        "",
        "| C | requests ok, 1 / 2 replicas | TTFT p50 ms, 1 / 2 | latency p50 ms, 1 / 2 "
        "| latency p50 difference | output tok/s, 1 / 2 | 2 over 1 |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c, a, b in zip(CONCURRENCY, one, two, strict=True):
        lines.append(
            f"| {c} | {a['completed']}/{a['requests']} / {b['completed']}/{b['requests']} "
            f"| {_ms(a['p50_ttft'])} / {_ms(b['p50_ttft'])} "
            f"| {_ms(a['p50_e2e'])} / {_ms(b['p50_e2e'])} "
            f"| {_ms(b['p50_e2e'] - a['p50_e2e'])} "
            f"| {a['output_throughput']:.0f} / {b['output_throughput']:.0f} "
            f"| {b['output_throughput'] / a['output_throughput']:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16, help="per level and server")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write", help="replace this benchmark's section of this page")
    args = parser.parse_args()
    load = start_load()
    cli = argparse.ArgumentParser()
    bench.add_arguments(cli)
    argv = ["--model", str(compiled("smollm2-135m-instruct", activations="int8"))]
    argv += ["--speculative", "none", "--replicas", "1", "2", "--threads-per-replica", "1"]
    argv += ["--concurrency", *map(str, CONCURRENCY), "--repeats", str(args.repeats)]
    argv += ["--min-requests", str(args.requests), "--rounds", "2"]
    argv += ["--max-tokens", str(args.max_tokens), "--output-dir", str(SCRATCH / "router")]
    results = bench.bench(cli.parse_args(argv))
    text = section(results, load, args)
    publish(text, args.write, f"bench_router-{cpu_class()}")


if __name__ == "__main__":
    main()
