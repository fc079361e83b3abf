"""Two compiled artifacts of one model side by side: a kernel or weight-format change judged on
a noisy machine.

Both artifacts run in this process on the same prompt and take turns round by round
(``bench_cpu.measure``), so the load drift of a shared machine weighs on both alike; separate
``bench_cpu`` runs minutes apart spread more than the change being judged. Prints prefill, decode
and verify-K figures for each artifact, the ratio B / A, and the run's context (date, CPU,
load, command).

    python scripts/bench_ab.py A_ARTIFACT B_ARTIFACT [--threads N] [--repeats 10]
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
    Figures,
    measure,
)
from benchdoc import machine_context, start_load, usable_cores
from tokenizers import Tokenizer


def rows(a: Figures, b: Figures) -> list[tuple[str, float, float]]:
    """(figure, A, B), in milliseconds."""
    found = [("prefill ms", a.prefill_ms, b.prefill_ms), ("decode ms", a.decode_ms, b.decode_ms)]
    for k in MULTI_QUERY_KS:
        found.append((f"verify {k} ms", a.multi_query_ms[k], b.multi_query_ms[k]))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path, help="the baseline artifact")
    parser.add_argument("b", type=Path, help="the artifact to judge against it")
    parser.add_argument("--threads", type=int, default=usable_cores(), help="default: all")
    parser.add_argument("--repeats", type=int, default=10, help="rounds each; default 10")
    args = parser.parse_args()
    # TVM sizes its thread pool from the environment, so this must precede importing it.
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    from mlc_spec.runtime.model import Model

    load = start_load()
    models = [Model(path) for path in (args.a, args.b)]
    ids = Tokenizer.from_file(str(args.a / "tokenizer.json")).encode(TEXT * 8).ids
    prompt, continuation = ids[:PROMPT_LEN], ids[PROMPT_LEN : PROMPT_LEN + DECODE_STEPS]
    a, b = measure([Compiled(m) for m in models], prompt, continuation, args.repeats)

    import tvm  # already imported, after TVM_NUM_THREADS was set

    print(f"- A: {args.a}\n- B: {args.b}")
    print("\n".join(machine_context(load, f"TVM {tvm.__version__}", f"{args.threads} threads")))
    print(f"- Medians of {args.repeats} alternating rounds (one warm-up round dropped)\n")
    print("| figure | A | B | B / A |\n|---|---:|---:|---:|")
    for name, ms_a, ms_b in rows(a, b):
        print(f"| {name} | {ms_a:.2f} | {ms_b:.2f} | {ms_b / ms_a:.3f} |")
    for label, fig in (("A", a), ("B", b)):
        steps = ", ".join(
            f"K={k} {fig.multi_query_ms[k] / fig.decode_ms:.2f}x" for k in MULTI_QUERY_KS
        )
        print(f"- {label}, verify in own decode steps: {steps}")


if __name__ == "__main__":
    main()
