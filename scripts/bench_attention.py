"""The CPU attention kernel alone at real models' head shapes: this tree's against a git
revision's (one whose kernel is ``paged_attention``, from c3bae87 on; a version that takes draft
trees' paths gets none, as a decode step or a chain's verify block does).

An attention change worth 10% of a layer's kernel is a few percent of a step, lost in a
whole-model run on a shared machine. Here both versions of ``compiler/cpu_attention.py``
compile the same head shapes for this CPU and take turns round by round on the same random
queries and page pool: ``rows`` new rows at the end of one sequence of ``context`` keys (1: a
decode step, more: a verify block), or the batches of ``--batches``: ``CONTEXT:ROWS[*COUNT]``
sequences joined by ``+``, e.g. ``64:1*8+2000:8`` for 8 decode rows beside a prompt chunk of 8
rows at 2,000 keys. With ``--layers 1`` the pages stay in cache from call to call, as they do
not in a model's layer; with more, each round calls every layer in turn, as a forward pass
does. Prints microseconds per call, B / A (B is this tree, A the revision), and the largest
difference between their outputs (summation order may differ; the kernels' own tests pin
accuracy).

``--kv-cache-dtype float16`` gives this tree's kernel a copy of the pool in float16 (the pages
of an int8-activation artifact), against the revision's on float32 pages.

    python scripts/bench_attention.py --against REV [--context 133] [--rows 1,4,5,8]
        [--batches 64:1*8+2000:8,...] [--layers 1] [--shapes smollm2,qwen1.5b,qwen0.5b]
        [--kv-cache-dtype float16] [--rounds 12] [--cpu native] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import os
import time
from functools import partial

import numpy as np
from bench_kernel import (
    add_run_arguments,
    alternating_medians,
    module_at,
    shape_names,
    short_commit,
)
from benchdoc import machine_context, publish, start_load

ATTENTION = "compiler/cpu_attention.py"
PAGE = 16
# (KV heads, query heads, head size) of each model.
HEADS = {"smollm2": (3, 9, 64), "qwen1.5b": (2, 12, 128), "qwen0.5b": (2, 14, 64)}
CALLS = 200  # calls per version per round: one call is a few microseconds


def batch(spec: str) -> list[tuple[int, int]]:
    """``CONTEXT:ROWS[*COUNT]+...`` as (context, rows) per sequence."""
    sequences = []
    for part in spec.split("+"):
        head, _, count = part.partition("*")
        context, _, rows = head.partition(":")
        sequences += [(int(context), int(rows))] * int(count or 1)
    return sequences


def call_arguments(sequences, layers: int, h_kv: int, h_q: int, d: int, rng) -> tuple:
    """The kernel's arguments for the ``(context, rows)`` sequences, rows at positions
    ``context`` on, their keys and values on shuffled pages of a pool of ``layers`` layers;
    per layer, without and with (empty) draft-tree paths; and the output tensor among them."""
    import tvm

    page_counts = [-(-(context + rows) // PAGE) for context, rows in sequences]
    pages = rng.standard_normal((layers, sum(page_counts) + 4, 2, h_kv, PAGE * d), np.float32)
    rows = sum(r for _, r in sequences)
    q = rng.standard_normal((rows, h_q, d), np.float32)
    tables = (
        np.cumsum([0] + [r for _, r in sequences]),  # q_indptr
        np.cumsum([0, *page_counts]),  # page_indptr
        rng.permutation(len(pages[0]))[: sum(page_counts)],  # page_values
        np.concatenate([np.arange(c, c + r) for c, r in sequences]),  # positions
    )
    arrays = [q, pages, *(t.astype(np.int32) for t in tables)]
    paths = [np.zeros(rows + 1, np.int32), np.zeros(1, np.int32)]
    out = tvm.runtime.tensor(np.zeros_like(q))
    plain = [tvm.runtime.tensor(a) for a in arrays]
    with_paths = plain + [tvm.runtime.tensor(a) for a in paths]
    return {
        False: [[*plain, layer, out] for layer in range(layers)],
        True: [[*with_paths, layer, out] for layer in range(layers)],
    }, out


def time_calls(kernel, per_layer: list) -> float:
    """Seconds per call over at least ``CALLS`` calls, every layer's in turn."""
    rounds = -(-CALLS // len(per_layer))
    start = time.perf_counter()
    for _ in range(rounds):
        for arguments in per_layer:
            kernel(*arguments)
    return (time.perf_counter() - start) / (rounds * len(per_layer))


def with_pages(arguments: dict, dtype: str) -> dict:
    """The same calls on a copy of their page pool in ``dtype``."""
    import tvm

    pages = arguments[False][0][1]
    if pages.dtype == dtype:
        return arguments
    copy = tvm.runtime.tensor(pages.numpy().astype(dtype))
    return {paths: [[c[0], copy, *c[2:]] for c in calls] for paths, calls in arguments.items()}


def build(module, target, shape: tuple[int, int, int], kv_dtype: str = "float32"):
    """The compiled kernel (pages in ``kv_dtype``), and whether it takes draft-tree paths."""
    import tvm

    pages = () if kv_dtype == "float32" else (kv_dtype,)  # revisions before float16 pages
    kernel = module.paged_attention(*shape, "float32", *pages).with_attr("global_symbol", "main")
    compiled = tvm.compile(tvm.IRModule({"main": kernel}), target=target)
    return compiled, len(kernel.params) == 10  # q, pages, 4 tables, 2 path tables, layer, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, help="git revision of the baseline (A)")
    parser.add_argument("--context", type=int, default=133, help="prefix keys; default 133")
    parser.add_argument("--rows", default="1,4,5,8", help="query rows; default 1,4,5,8")
    parser.add_argument("--batches", help="CONTEXT:ROWS[*COUNT]+... each; replaces the above")
    parser.add_argument("--layers", type=int, default=1, help="the pool's layers; default 1")
    parser.add_argument("--shapes", default=",".join(HEADS), help=f"of {', '.join(HEADS)}")
    parser.add_argument(
        "--kv-cache-dtype", default="float32", help="B's pages: float32 (default) or float16"
    )
    add_run_arguments(parser)
    args = parser.parse_args()
    shapes = shape_names(parser, args.shapes, HEADS)
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    import tvm

    from mlc_spec.compiler import cpu_attention
    from mlc_spec.compiler.targets import make_target

    load = start_load()
    target = make_target("llvm", cpu=args.cpu)
    versions = {"A": module_at(args.against, ATTENTION), "B": cpu_attention}
    rng = np.random.default_rng(0)
    batches = args.batches.split(",") if args.batches else args.rows.split(",")
    table = [
        f"| model heads (KV, query, size) | {'batch' if args.batches else 'rows'} | A µs "
        "| B µs | B / A | max difference |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in shapes:
        h_kv, h_q, d = shape = HEADS[name]
        pages = {"A": "float32", "B": args.kv_cache_dtype}
        kernels = {v: build(m, target, shape, pages[v]) for v, m in versions.items()}
        for spec in batches:
            sequences = batch(spec) if args.batches else [(args.context, int(spec))]
            shared, out = call_arguments(sequences, args.layers, h_kv, h_q, d, rng)
            arguments = {v: with_pages(shared, pages[v]) for v in versions}
            outputs = []
            for v, (kernel, paths) in kernels.items():
                kernel(*arguments[v][paths][0])
                outputs.append(out.numpy().copy())
            timers = {v: partial(time_calls, k, arguments[v][p]) for v, (k, p) in kernels.items()}
            medians = alternating_medians(timers, args.rounds)
            a, b = medians["A"] * 1e6, medians["B"] * 1e6
            line = (
                f"| {name} {shape} | {spec} | {a:.1f} | {b:.1f} | {b / a:.3f} "
                f"| {np.abs(outputs[0] - outputs[1]).max():.1e} |"
            )
            table.append(line)
            print(line, flush=True)
    against = short_commit(args.against)
    software = f"TVM {tvm.__version__}, kernels for --cpu {args.cpu}"
    section = "\n".join(
        [
            f"## CPU attention kernels alone (`scripts/bench_attention.py`) against `{against}`"
            + (f" (--cpu {args.cpu})" if args.cpu != "native" else ""),
            "",
            *machine_context(load, software, f"{args.threads} threads"),
            f"- A: `{ATTENTION}` at `{args.against}` (`{against}`); B: this tree (HEAD "
            f"`{short_commit('HEAD')}`)"
            + (f", pages in {args.kv_cache_dtype}" if args.kv_cache_dtype != "float32" else ""),
            (
                "- Batches of sequences, CONTEXT:ROWS[*COUNT]: ROWS new rows after CONTEXT keys"
                if args.batches
                else f"- One sequence with {args.context} keys before the new rows (1 row: a "
                "decode step, more: a verify block)"
            )
            + (
                ", pages in cache"
                if args.layers == 1
                else f", a pool of {args.layers} layers called in turn (pages from memory)"
            )
            + f". Medians of {args.rounds} rounds of {CALLS} calls, the versions taking turns to "
            "go first (one warm-up round dropped)",
            "",
            *table,
        ]
    )
    batches_key = "-batches" if args.batches else ""
    batches_key += f"-{args.kv_cache_dtype}" if args.kv_cache_dtype != "float32" else ""
    publish(section, args.write, f"bench_attention-{against}-{args.cpu}{batches_key}")


if __name__ == "__main__":
    main()
