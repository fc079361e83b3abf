"""Two compiled artifacts of one model side by side: a kernel or weight-format change judged on
a noisy machine.

Both artifacts run in this process on the same prompt and take turns round by round, the order
reversed every other round (``bench_cpu.measure``), so the load drift of a shared machine
weighs on both alike; separate ``bench_cpu`` runs minutes apart spread more than the change
being judged. Both are one system (TVM, one thread pool), so they share a process, unlike
``bench_cpu``'s systems. Prints prefill, decode and verify-K figures for each artifact (median
and range over rounds), the ratio B / A of the medians, and the run's context. Its result
belongs in the commit message and, once judged, in the "Tried and left out" list at the end of
docs/kernels.md, not in a table of its own in docs/benchmarks.md.

    python scripts/bench_ab.py A_ARTIFACT B_ARTIFACT [--threads N] [--repeats 10]
        [--a-small-pages]

``--a-small-pages`` copies A's weights into tensors of TVM's allocator, on 4 KiB pages, as the
runtime held them before ``runtime/huge_pages.py``: with one artifact as A and B, it judges the
huge pages alone.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from bench_cpu import (
    DECODE_STEPS,
    MULTI_QUERY_KS,
    PROMPT_LEN,
    TEXT,
    Compiled,
    Spread,
    measure,
    spreads,
)
from benchdoc import machine_context, start_load, usable_cores
from tokenizers import Tokenizer

FIGURES = ("prefill_ms", "decode_ms", *(f"verify{k}_ms" for k in MULTI_QUERY_KS))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path, help="the baseline artifact")
    parser.add_argument("b", type=Path, help="the artifact to judge against it")
    parser.add_argument("--threads", type=int, default=usable_cores(), help="default: all")
    parser.add_argument("--repeats", type=int, default=10, help="rounds each; default 10")
    parser.add_argument(
        "--a-small-pages", action="store_true", help="A's weights on 4 KiB pages (TVM's allocator)"
    )
    args = parser.parse_args()
    # TVM sizes its thread pool from the environment, so this must precede importing it.
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    from mlc_spec.runtime.model import Model

    load = start_load()
    models = [Model(path) for path in (args.a, args.b)]
    if args.a_small_pages:
        import tvm
        import tvm_ffi

        params = models[0].params
        models[0].params = tvm_ffi.convert(
            [tvm.runtime.tensor(p.numpy(), p.device) for p in params]
        )
    ids = Tokenizer.from_file(str(args.a / "tokenizer.json")).encode(TEXT * 8).ids
    prompt, continuation = ids[:PROMPT_LEN], ids[PROMPT_LEN : PROMPT_LEN + DECODE_STEPS]
    a, b = (
        spreads(r)
        for r in measure([Compiled(m) for m in models], prompt, continuation, args.repeats)
    )

    import tvm  # already imported, after TVM_NUM_THREADS was set

    pages = " (weights on 4 KiB pages)" if args.a_small_pages else ""
    print(f"- A: {args.a}{pages}\n- B: {args.b}")
    print("\n".join(machine_context(load, f"TVM {tvm.__version__}", f"{args.threads} threads")))
    print(f"- {args.repeats} alternating rounds (one warm-up round dropped)\n")
    print("| figure, ms: median (min–max) | A | B | B / A |\n|---|---:|---:|---:|")
    for figure in FIGURES:
        ratio = b[figure].mid / a[figure].mid
        print(
            f"| {figure.removesuffix('_ms')} | {a[figure].cell()} | {b[figure].cell()} "
            f"| {ratio:.3f} |"
        )
    for label, spread in (("A", a), ("B", b)):
        steps: list[tuple[int, Spread]] = [(k, spread[f"verify{k}_steps"]) for k in MULTI_QUERY_KS]
        cells = ", ".join(f"K={k} {s.cell(suffix='x')}" for k, s in steps)
        print(f"- {label}, verify in own decode steps: {cells}")


if __name__ == "__main__":
    main()
