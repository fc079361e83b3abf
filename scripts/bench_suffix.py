"""Suffix decoding in the server: ``mlc-spec bench serve`` on an editing workload (HumanEval
solutions given back to add type hints and a docstring, each request sent twice, as agents
send context again), HumanEval and ShareGPT, with no speculation, automatic prompt lookup and
automatic suffix decoding (and, for the Qwen pair, the automatic 0.5B draft and method auto,
which chooses between it and suffix decoding per request and step), every server loaded in
turn at each concurrency. Written to docs/benchmarks-features.md with the goals' verdicts:
suffix >= 1.5x no speculation and >= 1.2x prompt lookup on the editing workload, with the most
the measured pass costs allow there (``ceilings``); automatic speculation >= 1.0x no
speculation in every cell.

    python scripts/bench_suffix.py [--pair smollm2|qwen] [--write docs/benchmarks-features.md]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
from benchdoc import SCRATCH, cpu_class, machine_context, publish, start_load, verdict

from mlc_spec.compiler.cache import compiled
from mlc_spec.runtime.params import DEFAULT_MAX_SPECULATIVE_TOKENS, SUFFIX_MAX_SPECULATIVE_TOKENS
from mlc_spec.serve import bench

DATASETS = ("editing", "humaneval", "sharegpt")
CONCURRENCY = (1, 4, 16)
NONE, NGRAM, SUFFIX, AUTO = "off", "ngram k=auto", "suffix k=auto", "auto k=auto"
TITLES = {
    "smollm2": "SmolLM2-135M-Instruct, int8 activations",
    "qwen": "Qwen2.5-Coder-1.5B-Instruct, 0.5B draft, int8 activations",
}


def _ratio(settings: dict, a: str, b: str, level: int) -> tuple[float, str]:
    """The median of the repeats' throughput ratios a / b at a level, and their range: the two
    ran minutes apart at most, under the same host."""
    paired = np.divide(
        settings[a][level]["output_throughput_by_repeat"],
        settings[b][level]["output_throughput_by_repeat"],
    )
    spread = f" [{paired.min():.2f}-{paired.max():.2f}]" if len(paired) > 1 else ""
    return float(np.median(paired)), spread


def step_ceiling(costs: dict | None, rows: int) -> tuple[float, int, int] | None:
    """The most a step of ``rows`` sequences (or the most rows below it that steps ran) gains
    from drafts, every one accepted, at the server's measured pass costs (``/stats``, at their
    reference context): max over the shapes run of (tokens / rows) x decode(rows) /
    verify(rows, tokens); with the rows and tokens of that shape. The draft's own cost is left
    out, so no proposer beats it."""
    if not costs:
        return None
    decode = {int(r): s for r, s in costs["decode_by_rows"].items()}
    shapes: dict[int, dict[int, float]] = {}
    for key, seconds in costs["verify_by_rows_x_tokens"].items():
        r, t = map(int, key.split("x"))
        shapes.setdefault(r, {})[t] = seconds
    ran = [r for r in shapes if r <= rows and r in decode]
    if not ran:
        return None
    r = max(ran)
    t, seconds = max(shapes[r].items(), key=lambda ts: ts[0] / ts[1])
    return t / r * decode[r] / seconds, r, t


def ceilings(settings: dict, concurrency: list[int]) -> list[str]:
    """Per level: the suffix server's step ceiling, the share of the plain server's time in its
    decode steps (their passes and sampling), and the bound both give on suffix over no
    speculation (Amdahl: the rest of the time, prompts and serving, is not sped up; decode
    steps that carried a prompt chunk count as decode, so the bound is generous)."""
    cells = []
    for i, c in enumerate(concurrency):
        ceiling = step_ceiling(settings[SUFFIX][i].get("step_costs"), c)
        plain = settings[NONE][i]
        spent = plain.get("engine_seconds") or {}
        if ceiling is None or "decode" not in spent:
            continue
        gain, r, t = ceiling
        share = (spent["decode"] + spent.get("sample", 0.0)) / plain["seconds"]
        bound = 1 / (1 - share + share / gain)
        lookup, _ = _ratio(settings, NGRAM, NONE, i)
        cells.append(
            f"C={c} {gain:.2f}x a step ({r} rows, {t} tokens), decode {share:.0%} of the time, "
            f"so at most {bound:.2f}x no speculation and {bound / lookup:.2f}x prompt lookup "
            f"(at {lookup:.2f}x)"
        )
    return cells


def section(results: dict[str, dict], load, args: argparse.Namespace) -> str:
    settings0 = next(iter(results.values()))["settings"]
    lines = [
        f"### {TITLES[args.pair]}, `{cpu_class()}`",
        "",
        *machine_context(load, "mlc-spec serve", "2 everywhere"),
        f"- Load: max({args.min_requests}, {args.rounds} x concurrency) requests per level and "
        f"server, each level's jobs unseen before it, {args.repeats} repeats interleaved (tok/s: "
        f"the median repeat's); greedy, {args.max_tokens} tokens per answer (EOS ignored), "
        f"streamed; batch {args.max_batch_size}, {args.max_total_len} tokens of KV cache, prefix "
        f"cache on; at most {SUFFIX_MAX_SPECULATIVE_TOKENS} drafts per step with suffix "
        f"decoding and method auto, {DEFAULT_MAX_SPECULATIVE_TOKENS} with the others (the "
        "engine's defaults)",
        "",
        "| dataset | server | " + " | ".join(f"C={c}" for c in args.concurrency) + " |",
        "|---|---|" + "---:|" * len(args.concurrency),
    ]
    for dataset, res in results.items():
        for label, rows in res["settings"].items():
            cells = [
                f"{r['output_throughput']:.0f} · {100 * (r.get('acceptance_rate') or 0):.0f}%"
                if label != NONE
                else f"{r['output_throughput']:.0f}"
                for r in rows
            ]
            lines.append(f"| {dataset} | {label} | " + " | ".join(cells) + " |")
    lines += ["", "Cells: output tok/s · draft acceptance."]
    over_none, over_ngram, autos = [], [], []
    for dataset, res in results.items():
        s = res["settings"]
        for i, c in enumerate(args.concurrency):
            for auto in (label for label in s if label != NONE):
                autos.append((f"{dataset} C={c} {auto}", *_ratio(s, auto, NONE, i)))
            if dataset == "editing":
                over_none.append((f"C={c}", *_ratio(s, SUFFIX, NONE, i)))
                over_ngram.append((f"C={c}", *_ratio(s, SUFFIX, NGRAM, i)))

    def listed(rows: list[tuple[str, float, str]]) -> str:
        return ", ".join(f"{name} {r:.2f}x{spread}" for name, r, spread in rows)

    lines += [
        "",
        "Ratios: the median of the repeats' ratios [their range].",
        "",
        "- Editing: suffix >= 1.5x no speculation: "
        f"{verdict(all(r >= 1.5 for _, r, _ in over_none), load)} ({listed(over_none)})",
        "- Editing: suffix >= 1.2x prompt lookup: "
        f"{verdict(all(r >= 1.2 for _, r, _ in over_ngram), load)} ({listed(over_ngram)})",
        "- Automatic speculation >= 1.0x no speculation in every cell: "
        f"{verdict(all(r >= 1.0 for _, r, _ in autos), load)} ({listed(autos)})",
    ]
    if "editing" in results:
        lines.append(
            "- What drafts could buy on the editing workload, from the suffix server's pass costs "
            "(every draft accepted, the draft free) and the plain server's time in decode "
            "steps: " + "; ".join(ceilings(results["editing"]["settings"], args.concurrency))
        )
    if AUTO in settings0:  # method auto against the best of the servers with one proposer
        best = []
        for dataset, res in results.items():
            s = res["settings"]
            for i, c in enumerate(args.concurrency):
                rival = max((x for x in s if x != AUTO), key=lambda x: s[x][i]["output_throughput"])
                best.append((f"{dataset} C={c} vs {rival}", *_ratio(s, AUTO, rival, i)))
        lines.append(
            "- Method auto >= 0.95x the best fixed configuration in every cell: "
            f"{verdict(all(r >= 0.95 for _, r, _ in best), load)} ({listed(best)})"
        )
    assert list(settings0)[:3] == [NONE, NGRAM, SUFFIX], list(settings0)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="requests per client per level")
    parser.add_argument("--min-requests", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2, help="sweeps, interleaved")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--max-total-len", type=int, default=16384)
    parser.add_argument("--datasets", nargs="+", choices=DATASETS, default=list(DATASETS))
    parser.add_argument("--concurrency", nargs="+", type=int, default=list(CONCURRENCY))
    parser.add_argument("--pair", choices=list(TITLES), default="smollm2")
    parser.add_argument("--write", type=Path, help="replace this benchmark's section of this page")
    args = parser.parse_args()
    os.environ.setdefault("TVM_NUM_THREADS", str(len(os.sched_getaffinity(0))))
    servers, draft = ["none", "ngram:auto", "suffix:auto"], []
    if args.pair == "qwen":
        model = compiled("qwen2.5-coder-1.5b-instruct", activations="int8")
        servers += ["draft:auto", "auto:auto"]
        draft = ["--draft-model", str(compiled("qwen2.5-coder-0.5b-instruct", activations="int8"))]
    else:
        model = compiled("smollm2-135m-instruct", activations="int8")
    load = start_load()
    results = {}
    for dataset in args.datasets:
        cli = argparse.ArgumentParser()
        bench.add_arguments(cli)
        argv = ["--model", str(model), *draft, "--speculative", *servers]
        argv += ["--dataset", dataset, "--concurrency", *map(str, args.concurrency)]
        argv += ["--rounds", str(args.rounds), "--min-requests", str(args.min_requests)]
        argv += ["--repeats", str(args.repeats), "--max-tokens", str(args.max_tokens)]
        argv += ["--max-batch-size", str(args.max_batch_size)]
        argv += ["--max-total-len", str(args.max_total_len)]
        argv += ["--output-dir", str(SCRATCH / f"suffix-{args.pair}-{dataset}")]
        results[dataset] = bench.bench(cli.parse_args(argv))
    text = section(results, load, args)
    pair = "" if args.pair == "smollm2" else f"-{args.pair}"
    publish(text, args.write, f"bench_suffix{pair}-{cpu_class()}")


if __name__ == "__main__":
    main()
