"""Async scheduling against the synchronous step loop: output tokens/s, and the host's time on
the critical path per step -- what the forward waits for.

Each setting runs its target (and draft) once, loaded, under two engines that differ only in
``async_scheduling``; for every concurrency the two alternate on the same closed-loop workload
(C clients, each sending its next request when the last finished; HumanEval and ShareGPT
prompts alternating; greedy, exactly ``--max-tokens`` output tokens per request). Host time on
the critical path per step is (wall time - time the step's passes ran) / steps: all host work
when synchronous, only what is not overlapped when asynchronous. The script checks that both
produce the same tokens and the same drafted/accepted counts.

    python scripts/bench_async.py [--setting smollm2:ngram:auto qwen-pair:draft:3]
        [--concurrency 1 4 16] [--max-tokens 64] [--requests-per-client 1] [--repeats 1]
        [--write docs/benchmarks-features.md]
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from benchdoc import machine_context, start_load, usable_cores, write_section

os.environ["TVM_NUM_THREADS"] = str(usable_cores())

from workloads import (  # noqa: E402
    Run,
    closed_loop,
    load_models,
    median_round,
    mixed_prompts,
    room_for_all,
    shared_engine,
)

from mlc_spec.runtime.engine import Engine  # noqa: E402
from mlc_spec.runtime.params import EngineConfig, SamplingParams  # noqa: E402

MAX_K = 6
# Host phases of a step, as the engine's timers name them; sampling runs inside the step's
# passes (on the worker thread when asynchronous) and is reported beside them.
HOST_PHASES = ("schedule", "commit", "process", "sample")


@dataclass
class Setting:
    model: str  # smollm2 | qwen-pair
    method: str  # none | ngram | draft
    k: int | str

    @classmethod
    def parse(cls, text: str) -> Setting:
        model, method, k = text.split(":")
        return cls(model, method, k if k == "auto" else int(k))

    @property
    def label(self) -> str:
        spec = "no speculation" if self.method == "none" else f"{self.method} k={self.k}"
        return f"{self.model}, {spec}"


@dataclass
class Measured:
    run: Run
    steps: int
    execute_s: float  # the steps' passes (forward, sampling, proposer), wherever they ran
    host_s: dict[str, float]  # per host phase

    @property
    def critical_host_ms(self) -> float:
        """Host time the forward waited for, per step."""
        return 1e3 * max(self.run.seconds - self.execute_s, 0.0) / self.steps

    @property
    def step_ms(self) -> float:
        return 1e3 * self.run.seconds / self.steps


def measure(
    eng: Engine, prompts: list[list[int]], params: SamplingParams, concurrency: int
) -> Measured:
    closed_loop(eng, prompts[:1], SamplingParams(max_tokens=4, temperature=0), 1)  # warm
    seconds, calls = dict(eng.timers.seconds), dict(eng.timers.calls)
    run = closed_loop(eng, prompts, params, concurrency)
    after = eng.timers
    return Measured(
        run,
        after.calls["execute"] - calls.get("execute", 0),
        after.seconds["execute"] - seconds.get("execute", 0.0),
        {p: after.seconds[p] - seconds.get(p, 0.0) for p in HOST_PHASES},
    )


def run_setting(setting: Setting, args: argparse.Namespace) -> list[str]:
    """The setting's table rows, one per concurrency."""
    models = load_models(setting.model)
    batch = max(args.concurrency)
    prompts = mixed_prompts(models[2], batch * args.requests_per_client)
    total_len = room_for_all(prompts, batch, args.max_tokens, MAX_K)
    method = None if setting.method == "none" else setting.method
    engines = {
        on: shared_engine(
            method, setting.k, MAX_K, models, EngineConfig(batch, total_len, async_scheduling=on)
        )
        for on in (False, True)
    }
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    rows = []
    for c in args.concurrency:
        rounds: dict[bool, list[Measured]] = {False: [], True: []}
        for _ in range(args.repeats):  # sync and async alternate, so drift hits both alike
            for on in (False, True):
                m = measure(engines[on], prompts[: c * args.requests_per_client], params, c)
                rounds[on].append(m)
                print(
                    f"{setting.label} C={c} async={on}: {m.run.tokens_per_s:.1f} tok/s, host on "
                    f"critical path {m.critical_host_ms:.1f} of {m.step_ms:.1f} ms/step",
                    file=sys.stderr,
                )
        sync, asy = (median_round(rounds[on], lambda m: m.run.tokens_per_s) for on in (False, True))
        same = sync.run.outputs == asy.run.outputs
        same_acceptance = (
            sync.run.stats.accepted_per_position == asy.run.stats.accepted_per_position
            and sync.run.stats.num_draft_tokens == asy.run.stats.num_draft_tokens
        )
        acceptance = (
            "n/a (auto: k follows measured step times)"
            if setting.k == "auto"
            else ("yes" if same_acceptance else "**NO**")
        )
        rows.append(
            f"| {setting.label} | {c} | {sync.run.tokens_per_s:.1f} | {asy.run.tokens_per_s:.1f} "
            f"| {asy.run.tokens_per_s / sync.run.tokens_per_s:.2f}x "
            f"| {sync.critical_host_ms:.1f} / {sync.step_ms:.1f} "
            f"({sync.critical_host_ms / sync.step_ms:.0%}) "
            f"| {asy.critical_host_ms:.1f} / {asy.step_ms:.1f} "
            f"({asy.critical_host_ms / asy.step_ms:.0%}) "
            f"| {' / '.join(f'{1e3 * sync.host_s[p] / sync.steps:.1f}' for p in HOST_PHASES)} "
            f"| {'yes' if same else '**NO**'} "
            f"| {acceptance} "
            f"({asy.run.stats.num_accepted_tokens}/{asy.run.stats.num_draft_tokens}) |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--setting",
        type=Setting.parse,
        nargs="+",
        default=[Setting("smollm2", "ngram", 3), Setting("qwen-pair", "draft", 3)],
        help="model:method:k, model smollm2|qwen-pair, method none|ngram|draft, k N|auto",
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests-per-client", type=int, default=1)
    parser.add_argument(
        "--repeats", type=int, default=1, help="rounds per concurrency; cells show the median run"
    )
    parser.add_argument(
        "--write", type=Path, help="replace this run's section (one per set of models) of this file"
    )
    args = parser.parse_args()
    load_avg = start_load()
    rows = []
    for setting in args.setting:
        rows += run_setting(setting, args)
    import tvm

    context = machine_context(
        load_avg,
        f"TVM {tvm.__version__}, numpy {np.__version__}",
        f"TVM_NUM_THREADS={os.environ['TVM_NUM_THREADS']}",
    )
    section = "\n".join(
        [
            f"## Async scheduling: host time off the critical path, "
            f"{', '.join(sorted({s.model for s in args.setting}))}",
            "",
            f"Closed loop of C clients, {args.requests_per_client} request(s) each, HumanEval "
            f"and ShareGPT prompts alternating, greedy, exactly {args.max_tokens} output tokens "
            "per request. The same loaded model(s) under two engines that differ only in "
            "`async_scheduling`, alternating at each concurrency"
            + (
                f" for {args.repeats} rounds, each cell the round with the median tokens/s"
                if args.repeats > 1
                else ""
            )
            + ". Host on the critical path: "
            "(wall time - time the step's passes ran) / steps, against the whole step; sync "
            "host phases: schedule / commit / process (text, stop strings, increments) / sample "
            "(inside the step's passes), ms per step. Same tokens: greedy outputs identical; "
            "same acceptance: drafted and accepted counts per position identical (async "
            "accepted/drafted in brackets).",
            "",
            *context,
            "",
            "| setting | C | sync tok/s | async tok/s | async/sync | sync host ms / step ms "
            "| async host ms / step ms | sync schedule / commit / process / sample ms "
            "| same tokens | same acceptance |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
            *rows,
        ]
    )
    print(section)
    if args.write:
        models = sorted({s.model for s in args.setting})
        write_section(args.write, "bench_async-" + "-".join(models), section)


if __name__ == "__main__":
    main()
