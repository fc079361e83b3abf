"""Adaptive speculation under load: output tokens/s and time per output token against
concurrency, for no speculation, every fixed k, automatic k, and speculation configured but
switched off by every request.

``--model smollm2`` (SmolLM2-135M-Instruct as shipped) or ``--model qwen-pair`` (Qwen2.5-Coder-1.5B
with its 0.5B sibling as draft, both Q4_K_M as shipped) serves a mixed workload -- HumanEval code
prompts, raw, and ShareGPT opening turns in the chat template, alternating -- to a closed loop of
C clients: each client sends its next request as soon as its previous one finishes. Proposers:
prompt lookup (n-gram) and a draft model: for SmolLM2, SmolLM2 itself by default (every draft
accepted, each costing a target step), or its first ``--draft-layers`` layers. All engines share one
loaded target (and draft) and run in one process, config after config for each concurrency, so
the ratios compare like with like even where the machine's load drifts. Greedy decoding, so every
config must produce the no-speculation tokens; the script checks it.

    python scripts/bench_adaptive.py [--model smollm2|qwen-pair] [--concurrency 1 2 4 8 16]
        [--fixed-k 1 2 3 4 5 6] [--max-tokens 32] [--requests-per-client 2] [--draft-layers N]
        [--methods ngram draft] [--activations float|int8] [--repeats N] [--tag SLUG]
        [--write docs/benchmarks-features.md]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from benchdoc import machine_context, section_name, start_load, usable_cores, write_section

THREADS = usable_cores()
# TVM sizes its thread pool when it is first imported, so this precedes the imports that load it.
os.environ["TVM_NUM_THREADS"] = str(THREADS)

from workloads import (  # noqa: E402
    Run,
    closed_loop,
    load_models,
    mixed_prompts,
    room_for_all,
    shared_engine,
)

from mlc_spec.runtime.artifact import ACTIVATIONS  # noqa: E402
from mlc_spec.runtime.engine import Engine  # noqa: E402
from mlc_spec.runtime.params import EngineConfig, SamplingParams  # noqa: E402

# Per --model: the section of docs/benchmarks-features.md, the plot, and the title's model.
SECTIONS = {"smollm2": "bench_adaptive", "qwen-pair": "bench_adaptive-qwen-pair"}
TITLES = {
    "smollm2": "SmolLM2-135M-Instruct",
    "qwen-pair": "Qwen2.5-Coder-1.5B-Instruct, 0.5B draft, Q4_K_M as shipped",
}
MAX_K = 6


@dataclass
class Config:
    name: str
    method: str | None  # None: no speculation configured
    k: int | str = 0  # the engine's num_speculative_tokens
    request_k: int | None = None  # every request's num_speculative_tokens

    @property
    def label(self) -> str:
        return self.name


# A second engine without speculation: its ratio to the first is what the machine's noise alone
# makes of two identical configs, the yardstick for the goals that compare equal paths.
AGAIN = "no speculation, again"


def configs(methods: list[str], fixed_ks: list[int]) -> list[Config]:
    out = [Config("no speculation", None), Config(AGAIN, None)]
    for method in methods:
        out += [Config(f"{method} k={k}", method, k) for k in fixed_ks]
        out.append(Config(f"{method} auto", method, "auto"))
        out.append(Config(f"{method} configured, k=0", method, "auto", request_k=0))
    return out


def section(args: argparse.Namespace) -> str:
    """This run's section of docs/benchmarks-features.md (and its plot's name)."""
    name = section_name(SECTIONS[args.model], args.activations)
    return f"{name}-{args.tag}" if args.tag else name


def slug(text: str) -> str:
    """A tag that can name a section marker and a PNG file."""
    if not re.fullmatch(r"[A-Za-z0-9-]+", text):
        raise argparse.ArgumentTypeError(f"{text!r}: letters, digits and dashes only")
    return text


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def report(
    results: dict[tuple[str, int], Run],
    cfgs: list[Config],
    concurrencies: list[int],
    methods: list[str],
    engines: dict[str, Engine],
    lossless: list[str],
    args: argparse.Namespace,
    context: list[str],
) -> str:
    if "draft" not in args.methods:
        draft_text = ""
    elif args.model == "qwen-pair":
        draft_text = "Draft: Qwen2.5-Coder-0.5B-Instruct. "
    elif args.draft_layers is None:
        draft_text = (
            "Draft: SmolLM2 itself (every draft is accepted, each costs a target decode step). "
        )
    else:
        draft_text = f"Draft: SmolLM2's first {args.draft_layers} of 30 layers. "
    lines = [
        f"## Adaptive speculation under load: {TITLES[args.model]}, {args.activations} "
        f"activations, mixed code and prose{f' ({args.tag})' if args.tag else ''}",
        "",
        f"Closed loop: C clients, each sending its next request when the last finished, "
        f"{args.requests_per_client} requests per client; prompts alternate HumanEval (raw) and "
        f"ShareGPT opening turns (chat template); greedy, exactly {args.max_tokens} output "
        f"tokens per request (EOS ignored). N-gram: prompt lookup, n-grams of 1-3 tokens. "
        + draft_text
        + f"Engines share the loaded "
        f"models, batch up to {max(concurrencies)} sequences, max_speculative_tokens {MAX_K}. "
        "Output tok/s: output tokens of all requests over the run's wall time (prefill "
        "included). TPOT: per request, (last token time - first token time) / (tokens - 1); "
        "p50 and p99 over the run's requests (few requests: p99 is close to the slowest). "
        "Configs run one after another for each concurrency, after one untimed request each"
        + (
            f"; {args.repeats} rounds over all configs, each starting at another config, each "
            "cell the fastest round: other load on this machine only ever slows a run, in "
            "episodes of tens of seconds that hit whichever configs run then."
            if args.repeats > 1
            else "."
        )
        + f" '{AGAIN}' is a second engine without speculation: its ratio to the first (A/A) "
        "is the noise between two identical configs.",
        "",
        *context,
        "",
    ]
    header = "| config | " + " | ".join(f"C={c} tok/s, p50 / p99 TPOT ms" for c in concurrencies)
    lines += [header + " |", "|---|" + "---:|" * len(concurrencies)]
    for cfg in cfgs:
        cells = []
        for c in concurrencies:
            r = results[cfg.name, c]
            cells.append(
                f"{r.tokens_per_s:.1f}, {1e3 * percentile(r.tpot, 50):.0f} / "
                f"{1e3 * percentile(r.tpot, 99):.0f}"
            )
        lines.append(f"| {cfg.label} | " + " | ".join(cells) + " |")
    lines += ["", *acceptance_table(results, cfgs, concurrencies), ""]
    lines += goals(results, concurrencies, methods, args.fixed_k)
    lines += ["", *host_time(engines, methods)]
    lines += [
        f"- Lossless: **NO**, different tokens from {', '.join(lossless)}"
        if lossless
        else "- Lossless: every config reproduces the no-speculation tokens, token for token",
        "",
        *cost_table(engines, concurrencies, methods),
        "",
        f"![throughput and TPOT against concurrency]({section(args)}.png)",
    ]
    return "\n".join(lines)


def acceptance_table(
    results: dict[tuple[str, int], Run], cfgs: list[Config], concurrencies: list[int]
) -> list[str]:
    """Acceptance and mean chosen k of the speculating configs, per concurrency."""
    lines = [
        "Acceptance rate / mean drafts per sequence-step (k chosen, automatic: as the policy "
        "chose):",
        "",
        "| config | " + " | ".join(f"C={c}" for c in concurrencies) + " |",
        "|---|" + "---:|" * len(concurrencies),
    ]
    for cfg in cfgs:
        if cfg.method is None or cfg.request_k == 0:
            continue
        cells = []
        for c in concurrencies:
            s = results[cfg.name, c].stats
            steps = sum(s.steps_by_k)
            mean_k = sum(k * n for k, n in enumerate(s.steps_by_k)) / steps if steps else 0.0
            cells.append(f"{s.acceptance_rate:.0%} / {mean_k:.2f}")
        lines.append(f"| {cfg.label} | " + " | ".join(cells) + " |")
    return lines


def goals(
    results: dict[tuple[str, int], Run],
    concurrencies: list[int],
    methods: list[str],
    fixed_ks: list[int],
) -> list[str]:
    lines = []
    for method in methods:
        for c in concurrencies:
            tps = {name: r.tokens_per_s for (name, cc), r in results.items() if cc == c}
            none, auto = tps["no speculation"], tps[f"{method} auto"]
            noise = abs(1.0 - tps[AGAIN] / none)
            best_k = max(fixed_ks, key=lambda k: tps[f"{method} k={k}"])
            best = tps[f"{method} k={best_k}"]
            off = tps[f"{method} configured, k=0"]
            checks = [
                (f"auto {auto / best:.2f}x best fixed k={best_k}", auto / best, 0.95, 0.0),
                (f"auto {auto / none:.2f}x no speculation", auto / none, 1.0, noise),
                (f"configured k=0 {off / none:.2f}x no speculation", off / none, 0.99, noise),
            ]
            if c >= 4:
                checks.append((f"auto beats best fixed: {auto / best:.2f}x", auto / best, 1.0, 0.0))
            verdicts = "; ".join(f"{text} ({verdict(*rest)})" for text, *rest in checks)
            lines.append(f"- {method}, C={c} (A/A {tps[AGAIN] / none:.2f}x): {verdicts}")
    return lines


def verdict(ratio: float, goal: float, noise: float) -> str:
    """Met, or short of the goal by less than the A/A noise (two identical configs differ by
    that much), or not met."""
    if ratio >= goal:
        return "met"
    # A config exactly as fast as the A/A engine is within: 1 - (1 - x) need not be x in floats.
    within = ratio >= (goal - noise) * (1 - 1e-9)
    return f"within the A/A noise of {noise:.0%}" if within else "**not met**"


def host_time(engines: dict[str, Engine], methods: list[str]) -> list[str]:
    """The engine's own time per step (scheduling with the policy, committing with the
    statistics), which is all speculation switched off adds to a plain decode step."""
    names = ["no speculation"] + [f"{m} {c}" for m in methods for c in ("configured, k=0", "auto")]

    def per_step(engine: Engine) -> float:
        t = engine.timers
        return 1e3 * (t.seconds["schedule"] + t.seconds["commit"]) / max(1, t.calls["schedule"])

    figures = ", ".join(f"{name} {per_step(engines[name]):.2f}" for name in names)
    return [f"Host time per step (schedule + commit, mean over the run, ms): {figures}."]


def cost_table(
    engines: dict[str, Engine], concurrencies: list[int], methods: list[str]
) -> list[str]:
    """The step costs the automatic engines measured, as multiples of a decode step."""
    lines = []
    for method in methods:
        costs = engines[f"{method} auto"].scheduler.costs
        lines += [
            f"Step costs measured by the automatic {method} engine (warm-up and every step, "
            "running means), ms; verify of rows x (k + 1) tokens as a multiple of decode(rows)"
            + (", and the draft's passes" if method == "draft" else "")
            + ":",
            "",
            "| rows | decode ms | "
            + " | ".join(f"verify k={k}" for k in range(1, MAX_K + 1))
            + (" | draft first pass ms | draft next pass ms |" if method == "draft" else " |"),
            "|---:|---:|" + "---:|" * MAX_K + ("---:|---:|" if method == "draft" else ""),
        ]
        for rows in concurrencies:
            decode = costs.decode.predict(rows)
            cells = [
                f"{costs.target(rows, rows * (k + 1)) / decode:.2f}x" for k in range(1, MAX_K + 1)
            ]
            row = f"| {rows} | {1e3 * decode:.1f} | " + " | ".join(cells)
            if method == "draft":
                row += (
                    f" | {1e3 * costs.draft.first.predict(rows):.1f}"
                    f" | {1e3 * costs.draft.next.predict(rows):.1f}"
                )
            lines.append(row + " |")
        log = engines[f"{method} auto"].scheduler.speculation_log
        if log.measured_seconds:
            lines.append(
                f"\nPredicted vs measured decode-step time (automatic {method}, all steps): "
                f"{log.predicted_seconds:.2f}s vs {log.measured_seconds:.2f}s, mean absolute "
                f"error {1e3 * log.absolute_error_seconds / log.num_steps:.1f} ms per step.\n"
            )
    return lines


def plot(
    results: dict[tuple[str, int], Run],
    cfgs: list[Config],
    concurrencies: list[int],
    methods: list[str],
    path: Path,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(methods), 2, figsize=(12, 4.5 * len(methods)), squeeze=False)
    for row, method in zip(axes, methods, strict=True):
        shown = [c for c in cfgs if c.method in (None, method)]
        for cfg in shown:
            style = {"lw": 2.5} if cfg.method is None or "auto" in cfg.name else {"lw": 1}
            if cfg.request_k == 0:
                style = {"lw": 1.5, "ls": "--"}
            if cfg.name == AGAIN:
                style = {"lw": 1, "ls": ":", "color": "grey"}
            tps = [results[cfg.name, c].tokens_per_s for c in concurrencies]
            tpot = [1e3 * percentile(results[cfg.name, c].tpot, 50) for c in concurrencies]
            row[0].plot(concurrencies, tps, marker="o", label=cfg.label, **style)
            row[1].plot(concurrencies, tpot, marker="o", label=cfg.label, **style)
        row[0].set(title=f"{method}: output tokens/s", xlabel="concurrency", xscale="log")
        row[1].set(title=f"{method}: p50 TPOT (ms)", xlabel="concurrency", xscale="log")
        for ax in row:
            ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
            ax.minorticks_off()
            ax.grid(alpha=0.3)
        row[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SECTIONS), default="smollm2")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument(
        "--repeats", type=int, default=1, help="rounds per concurrency; cells show the fastest run"
    )
    parser.add_argument("--fixed-k", type=int, nargs="+", default=list(range(1, MAX_K + 1)))
    parser.add_argument(
        "--draft-layers", type=int, help="draft: SmolLM2's first N layers (default: all of it)"
    )
    parser.add_argument("--methods", nargs="+", default=["ngram", "draft"])
    parser.add_argument(
        "--activations",
        choices=ACTIVATIONS,
        default="float",
        help="the artifacts' quantized layers take float (default) or int8 activations",
    )
    parser.add_argument("--write", type=Path, help="replace this benchmark's section of this file")
    parser.add_argument(
        "--tag",
        type=slug,
        help="a slug (letters, digits, dashes) naming a section of its own beside the full "
        "grid's, e.g. for a few cells re-run with more rounds",
    )
    args = parser.parse_args()
    load = start_load()  # before we add our own

    models = load_models(args.model, args.draft_layers, args.activations)
    batch = max(args.concurrency)
    prompts = mixed_prompts(models[2], batch * args.requests_per_client)
    cfgs = configs(args.methods, args.fixed_k)
    config = EngineConfig(batch, room_for_all(prompts, batch, args.max_tokens, MAX_K))
    engines = {}
    for cfg in cfgs:
        print(f"loading {cfg.name}", file=sys.stderr)
        engines[cfg.name] = shared_engine(cfg.method, cfg.k, MAX_K, models, config)
    results: dict[tuple[str, int], Run] = {}
    for c in args.concurrency:
        runs: dict[str, list[Run]] = {cfg.name: [] for cfg in cfgs}
        for r in range(args.repeats):  # rounds over all configs, so drift hits each alike
            first = r * len(cfgs) // args.repeats  # each round starts elsewhere in the list
            for cfg in cfgs[first:] + cfgs[:first]:
                params = SamplingParams(
                    max_tokens=args.max_tokens,
                    temperature=0,
                    ignore_eos=True,
                    num_speculative_tokens=cfg.request_k,
                )
                engine = engines[cfg.name]
                closed_loop(engine, prompts[:1], SamplingParams(max_tokens=4, temperature=0), 1)
                run = closed_loop(engine, prompts[: c * args.requests_per_client], params, c)
                runs[cfg.name].append(run)
                print(
                    f"C={c} {cfg.name}: {run.tokens_per_s:.1f} tok/s, p50 TPOT "
                    f"{1e3 * percentile(run.tpot, 50):.0f} ms",
                    file=sys.stderr,
                )
        for cfg in cfgs:
            results[cfg.name, c] = max(runs[cfg.name], key=lambda r: r.tokens_per_s)
    lossless = sorted(
        {
            cfg.name
            for cfg in cfgs
            for c in args.concurrency
            if results[cfg.name, c].outputs != results["no speculation", c].outputs
        }
    )
    import tvm

    context = machine_context(
        load,
        f"TVM {tvm.__version__}, numpy {np.__version__}",
        f"TVM_NUM_THREADS={os.environ['TVM_NUM_THREADS']}",
    )
    text = report(results, cfgs, args.concurrency, args.methods, engines, lossless, args, context)
    print(text)
    if args.write:
        name = section(args)
        plot(results, cfgs, args.concurrency, args.methods, args.write.parent / f"{name}.png")
        write_section(args.write, name, text)


if __name__ == "__main__":
    main()
