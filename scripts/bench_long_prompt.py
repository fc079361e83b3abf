"""Streams keep flowing while a long prompt is prefilled: 8 greedy streams decode, a 2,000-token
prompt arrives, and the gaps between the streams' tokens are timed until its first token. The
streams outlast the prefill by default (``--stream-tokens``), so that its last chunks, at the
longest contexts, are timed beside them too. Each
``--max-num-batched-tokens`` setting is its own ``mlc-spec serve`` (no speculation, so a gap is
one step), with ``--chunk-time-ratio`` (after a colon; 0: tokens only), and every server also
runs the 8 streams alone for the baseline: their gaps alone over the same stretch of their
output (a stream's steps slow down as its context grows). Written to
docs/benchmarks-features.md with the goal's verdict at the defaults: the streams' time per
output token (each stream's mean gap, as ``vllm bench serve`` counts it) p99 during the
prefill at most 2x its median without the long prompt, beside every gap's p50 and p99, alone and
during: on 2 cores the gaps' own p99 alone is ~2x their median (the server's event loop and the
client share the cores with the forward pass).

    python scripts/bench_long_prompt.py [--settings 64 64:0 512:0] [--stream-tokens 1200]
        [--write docs/benchmarks-features.md]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time
from pathlib import Path

import httpx
import numpy as np
from benchdoc import cpu_class, machine_context, publish, start_load, verdict

from mlc_spec.compiler.cache import compiled
from mlc_spec.runtime.params import EngineConfig
from mlc_spec.serve.launch import launched_server

DEFAULT = f"{EngineConfig.max_num_batched_tokens}:{EngineConfig.chunk_time_ratio:g}"
STREAMS = 8
STREAM_TOKENS = 1200  # ~14 s of decoding at batch 9: longer than the prefill at any setting
STREAM_PROMPT = 64
LONG_PROMPT = 2000


async def stream(client: httpx.AsyncClient, base: str, prompt: list[int], tokens: int) -> list:
    """One greedy streamed completion; the arrival time of each chunk with text, and last the
    stream's end."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": tokens, "temperature": 0}
    body |= {"ignore_eos": True, "stream": True}
    times = []
    async with client.stream("POST", f"{base}/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {") and any(
                c.get("text") for c in json.loads(line[6:]).get("choices", [])
            ):
                times.append(time.perf_counter())
    return [*times, time.perf_counter()]


async def load(
    base: str, tokens: int, with_long_prompt: bool
) -> tuple[list[np.ndarray], float | None]:
    """Per stream, the gaps between its ``tokens`` tokens as rows (token index, seconds) (all
    of them, or with the long prompt those while it waits for its first token), and the long
    prompt's time to first token."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 30000, STREAM_PROMPT).tolist() for _ in range(STREAMS)]
    async with httpx.AsyncClient(timeout=600) as client:
        tasks = [asyncio.create_task(stream(client, base, p, tokens)) for p in prompts]
        await asyncio.sleep(1.5)  # every stream decoding
        window = None
        if with_long_prompt:
            long_prompt = rng.integers(100, 30000, LONG_PROMPT).tolist()
            sent = time.perf_counter()
            first = (await stream(client, base, long_prompt, 1))[-1]  # one token: its end
            window = (sent, first)
        times = await asyncio.gather(*tasks)
    gaps = []
    for t in times:
        t = np.array(t[:-1])
        ends, seconds = t[1:], np.diff(t)
        kept = (
            np.ones(len(ends), bool)
            if window is None
            else (window[0] <= ends) & (ends <= window[1])
        )
        gaps.append(np.column_stack([np.flatnonzero(kept), seconds[kept]]))
    return gaps, None if window is None else window[1] - window[0]


def same_tokens(alone: list[np.ndarray], during: list[np.ndarray]) -> list[np.ndarray]:
    """Each stream's gaps alone over the token indices its gaps during the prefill span (a
    stream's steps slow down as its context grows)."""
    out = []
    for a, d in zip(alone, during, strict=True):
        lo, hi = d[:, 0].min(), d[:, 0].max()
        out.append(a[(a[:, 0] >= lo) & (a[:, 0] <= hi)])
    return out


def _p50_p99(ms: np.ndarray) -> str:
    return f"{np.median(ms):.1f} / {np.percentile(ms, 99):.1f}"


def setting(value: str) -> str:
    """``TOKENS[:RATIO]`` as ``TOKENS:RATIO`` (the ratio's default where left out)."""
    tokens, _, ratio = value.partition(":")
    try:
        return f"{int(tokens)}:{float(ratio or EngineConfig.chunk_time_ratio):g}"
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKENS[:RATIO], got {value!r}") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--settings",
        type=setting,
        nargs="+",
        default=[DEFAULT, "64:1", "64:0", "512:0"],
        help="--max-num-batched-tokens[:--chunk-time-ratio] per server",
    )
    parser.add_argument(
        "--stream-tokens",
        type=int,
        default=STREAM_TOKENS,
        help=f"tokens per stream (default {STREAM_TOKENS}: they outlast the prefill)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write", type=Path, help="replace this benchmark's section")
    args = parser.parse_args()
    os.environ.setdefault("TVM_NUM_THREADS", str(len(os.sched_getaffinity(0))))
    model = compiled("smollm2-135m-instruct", activations="int8")
    start = start_load()
    gaps = {b: ([], []) for b in args.settings}  # budget -> (alone, during the prefill)
    ttft = {b: [] for b in args.settings}
    with contextlib.ExitStack() as stack:
        bases = {}
        for budget in args.settings:
            tokens, ratio = budget.split(":")
            serve_args = ["--model", str(model), "--speculative", "none"]
            serve_args += ["--served-model-name", "bench", "--no-enable-prefix-caching"]
            serve_args += ["--max-num-batched-tokens", tokens, "--chunk-time-ratio", ratio]
            # A slot for the long prompt beside the streams: it is prefilled as it arrives.
            serve_args += ["--max-batch-size", str(STREAMS + 1)]
            kv_tokens = STREAMS * (STREAM_PROMPT + args.stream_tokens) + LONG_PROMPT + 1
            serve_args += ["--max-total-len", str(max(kv_tokens, EngineConfig.max_total_len))]
            bases[budget] = stack.enter_context(launched_server(serve_args))
        for _ in range(args.repeats):  # the servers in turn, round by round
            for budget, base in bases.items():
                alone, _ = asyncio.run(load(base, args.stream_tokens, with_long_prompt=False))
                during, first = asyncio.run(load(base, args.stream_tokens, with_long_prompt=True))
                gaps[budget][0].extend(alone)
                gaps[budget][1].extend(during)
                ttft[budget].append(first)
    lines = [
        f"### SmolLM2-135M-Instruct, int8 activations, `{cpu_class()}`",
        "",
        *machine_context(start, "mlc-spec serve", "2 everywhere"),
        f"- Load: {STREAMS} greedy streams of {args.stream_tokens} tokens "
        f"({STREAM_PROMPT}-token prompts), then "
        f"a {LONG_PROMPT}-token prompt 1.5 s in; no speculation, no prefix cache, batch "
        f"{STREAMS + 1}; "
        f"{args.repeats} rounds, the servers in turn",
        "",
        "| --max-num-batched-tokens : --chunk-time-ratio (0: tokens only) "
        "| TPOT alone, p50 ms | TPOT during the prefill, p50 / p99 ms | p99 / alone p50 "
        "| gaps alone, p50 / p99 ms | gaps during, p50 / p99 ms | long prompt's TTFT p50 ms |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ratios = []
    for budget in args.settings:
        alone_runs, during_runs = gaps[budget]
        alone = same_tokens(alone_runs, during_runs)
        tpot_alone = 1000 * np.array([a[:, 1].mean() for a in alone])
        tpot = 1000 * np.array([d[:, 1].mean() for d in during_runs])
        gaps_alone = 1000 * np.concatenate([a[:, 1] for a in alone])
        gaps_during = 1000 * np.concatenate([d[:, 1] for d in during_runs])
        ratio = np.percentile(tpot, 99) / np.median(tpot_alone)
        ratios.append((budget, ratio))
        lines.append(
            f"| {budget} | {np.median(tpot_alone):.1f} | {_p50_p99(tpot)} | {ratio:.2f}x "
            f"| {_p50_p99(gaps_alone)} | {_p50_p99(gaps_during)} "
            f"| {1000 * np.median(ttft[budget]):.0f} |"
        )
    listed = ", ".join(f"{b}: {r:.2f}x" for b, r in ratios)
    default = dict(ratios).get(DEFAULT)
    lines += [
        "",
        "TPOT: a stream's mean gap between tokens (`vllm bench serve`'s time per output token), "
        "here over the tokens it emitted while the long prompt waited, and alone over the same "
        "token indices; its p99 over the streams of all rounds. Gaps: every gap between two "
        "tokens of any stream.",
        "",
        f"- Streams' TPOT p99 during the prefill <= 2x their median alone, at the defaults "
        f"({DEFAULT}): "
        + ("not run" if default is None else verdict(default <= 2.0, start))
        + f" ({listed})",
    ]
    text = "\n".join(lines)
    publish(text, args.write, f"bench_long_prompt-{cpu_class()}")


if __name__ == "__main__":
    main()
