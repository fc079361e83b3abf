"""Teacher-forced agreement of ``--activations int8`` with float activations, on real text.

For SmolLM2-135M and Qwen2.5-Coder-1.5B as shipped, both artifacts (``mlc_spec.compiler.cache``)
read the same HumanEval solutions and ShareGPT turns; at every position the script compares the
next-token argmax and the KL divergence of the int8 distribution from the float one
(``mlc_spec.agreement``). The issue's bar: argmax equal at >= 99% of >= 2000 positions.

    python scripts/bench_int8_agreement.py [--positions 2000] [--models smollm2 qwen1.5b]
        [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchdoc import machine_context, start_load, write_section

# --models choice: (name in mlc_spec.compiler.pypi_models, label)
MODELS = {
    "smollm2": ("smollm2-135m-instruct", "SmolLM2-135M-Instruct"),
    "qwen1.5b": ("qwen2.5-coder-1.5b-instruct", "Qwen2.5-Coder-1.5B-Instruct"),
}
GOAL = 0.99


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--positions", type=int, default=2000, help="at least this many")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--write", type=Path, help="replace this script's section of this file")
    args = parser.parse_args()
    load = start_load()

    import tvm

    from mlc_spec.agreement import real_texts, teacher_forced_agreement
    from mlc_spec.compiler.cache import compiled
    from mlc_spec.runtime.model import Model
    from mlc_spec.runtime.tokenizer import Tokenizer

    rows = []
    for key in args.models:
        name, label = MODELS[key]
        reference, candidate = compiled(name), compiled(name, activations="int8")
        texts = real_texts(Tokenizer(reference), args.positions)
        result = teacher_forced_agreement(Model(reference), Model(candidate), texts)
        verdict = "met" if result.argmax_equal >= GOAL else "**not met**"
        rows.append(
            f"| {label} | {len(texts)} | {result.positions} | {result.argmax_equal:.2%} "
            f"| {result.mean_kl:.5f} | {verdict} |"
        )
        print(rows[-1], flush=True)
    context = machine_context(load, f"TVM {tvm.__version__}", "not timed")
    section = "\n".join(
        [
            "## Int8 activations: teacher-forced agreement with float activations",
            "",
            "Both artifacts of each model as shipped (`--quantization as-source`, `--activations "
            "float` and `int8`) read the same texts, HumanEval prompts with their canonical "
            "solutions alternating with ShareGPT opening turns (at most 512 tokens each); at "
            "every position: is the next-token argmax the same, and the KL divergence "
            "KL(float || int8) of the next-token distributions. Goal: argmax equal at >= 99% "
            "of >= 2000 positions.",
            "",
            *context,
            "",
            "| model | texts | positions | argmax equal | mean KL (nats) | goal |",
            "|---|---:|---:|---:|---:|---|",
            *rows,
        ]
    )
    print(section)
    if args.write:
        write_section(args.write, "bench_int8_agreement", section)


if __name__ == "__main__":
    main()
