"""Structured output with speculation: what the grammar's masks cost, and whether speculation
keeps its speed-up when every token must follow a JSON schema.

JSON extraction prompts (a person's details in a sentence, to give back as JSON with six
fields) run greedily with and without the schema, with no speculation and with speculation
(SmolLM2: suffix decoding; the Qwen pair: the 0.5B draft), at batch 1 (one prompt at a time)
and at batch 16 (all at once). Every configuration is loaded once in this process; each round
runs them all, the order reversing every other round, and each cell is the median round's
output tokens/s, prompt prefill included (no prefix cache, so every run pays it). The grammar's
share is the engine's ``grammar`` timer (the matcher's masks on the host) against the run's
time. Goal (issue 38): constrained speculation's speed-up >= 0.9x the unconstrained one.

    python scripts/bench_structured.py [--pair smollm2|qwen] [--rounds 3] [--write PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from benchdoc import cpu_class, machine_context, publish, start_load, verdict

GOAL = 0.9
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string"},
        "job": {"type": "string"},
        "email": {"type": "string"},
        "married": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "job", "email", "married"],
    "additionalProperties": False,
}
PEOPLE = [
    ("Maria Lopez", 34, "Madrid", "nurse", True),
    ("Tom Becker", 51, "Hamburg", "carpenter", False),
    ("Aiko Tanaka", 28, "Osaka", "software engineer", False),
    ("Samuel Okafor", 45, "Lagos", "teacher", True),
    ("Elena Petrova", 39, "Sofia", "architect", True),
    ("Lucas Martin", 23, "Lyon", "student", False),
    ("Priya Nair", 31, "Chennai", "doctor", True),
    ("Jonas Berg", 60, "Bergen", "fisherman", True),
    ("Chloe Dubois", 27, "Montreal", "designer", False),
    ("Omar Haddad", 42, "Amman", "pharmacist", True),
    ("Grace Kim", 36, "Seoul", "journalist", False),
    ("Diego Silva", 48, "Porto", "chef", True),
    ("Hannah Weiss", 55, "Vienna", "lawyer", True),
    ("Ivan Novak", 33, "Zagreb", "electrician", False),
    ("Fatima Zahra", 29, "Rabat", "accountant", False),
    ("Noah Brown", 40, "Denver", "pilot", True),
]


def prompts() -> list[str]:
    out = []
    for name, age, city, job, married in PEOPLE:
        email = name.lower().replace(" ", ".") + "@example.com"
        status = "is married" if married else "is not married"
        out.append(
            f"{name} is {age} years old, lives in {city}, works as a {job}, {status}, and can "
            f"be reached at {email}. Give this person's details as a JSON object with the keys "
            "name, age, city, job, email and married.\nJSON:"
        )
    return out


def models(pair: str) -> tuple[Path, Path | None, dict]:
    """Target and draft artifacts, and the speculative config."""
    from mlc_spec.compiler.cache import compiled

    if pair == "qwen":
        from prepare_qwen_pair import prepare_pair

        draft, target = prepare_pair(show_progress=False, activations="int8")
        return target, draft, {"method": "draft", "num_speculative_tokens": "auto"}
    target = compiled("smollm2-135m-instruct", show_progress=False, activations="int8")
    return target, None, {"method": "suffix", "num_speculative_tokens": "auto"}


def run(llm, texts: list[str], batch: int, constrained: bool, max_tokens: int) -> dict:
    """Output tokens/s over the prompts, and the grammar's share of the steps' time."""
    from mlc_spec import SamplingParams

    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0,
        structured_output={"json": SCHEMA} if constrained else None,
    )
    before = llm.metrics()
    start, tokens = time.perf_counter(), 0
    for at in range(0, len(texts), batch):
        outs = llm.generate(texts[at : at + batch], params)
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    wall = time.perf_counter() - start
    after = llm.metrics()
    grammar = after["seconds"].get("grammar", 0) - before["seconds"].get("grammar", 0)
    return {"tokens_per_s": tokens / wall, "grammar_share": grammar / wall, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", choices=["smollm2", "qwen"], default="smollm2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--write", type=Path, help="docs/benchmarks-features.md")
    args = parser.parse_args()
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    import tvm

    from mlc_spec import LLM

    target, draft, spec = models(args.pair)
    # No prefix cache: every run pays the same prompt prefill, whichever ran the prompts first.
    engines = {
        "none": LLM(target, max_batch_size=16, enable_prefix_caching=False),
        "spec": LLM(
            target,
            draft_model=draft,
            speculative=spec,
            max_batch_size=16,
            enable_prefix_caching=False,
        ),
    }
    texts = prompts()
    configs = [(s, b, c) for b in (1, 16) for c in (False, True) for s in engines]
    for setting, batch, constrained in configs:  # warm-up: grammar compiled, costs measured
        run(engines[setting], texts[:2], batch, constrained, 16)
    load = start_load()
    results: dict[tuple, list[dict]] = {c: [] for c in configs}
    for round_ in range(args.rounds):
        order = configs if round_ % 2 == 0 else configs[::-1]
        for config in order:
            setting, batch, constrained = config
            result = run(engines[setting], texts, batch, constrained, args.max_tokens)
            results[config].append(result)
            print(config, f"{results[config][-1]['tokens_per_s']:.1f} tok/s", flush=True)

    def median(config, key="tokens_per_s") -> float:
        return statistics.median(r[key] for r in results[config])

    title = {
        "smollm2": "SmolLM2-135M-Instruct, suffix decoding",
        "qwen": "Qwen2.5-Coder-1.5B-Instruct, 0.5B draft",
    }[args.pair]
    lines = [
        f"### {title} (automatic k), int8 activations, `{cpu_class()}`",
        "",
        *machine_context(load, f"TVM {tvm.__version__}, xgrammar 0.2.8", f"{args.threads}"),
        f"- {len(texts)} JSON extraction prompts (a person's six details from a sentence), "
        f"greedy, at most {args.max_tokens} tokens, ending at EOS or the schema's end; "
        'constrained: `structured_output={"json": schema}` (six required fields; no '
        "maxLength: xgrammar's mask near a bounded string's end took 1.6-4.7 ms here); "
        f"medians of {args.rounds} interleaved rounds",
        "",
        "| batch | output | no speculation tok/s | speculation tok/s | speed-up "
        "| grammar's share of the time (none / spec) |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    ratios = {}
    for batch in (1, 16):
        for constrained in (False, True):
            none, spec_ = median(("none", batch, constrained)), median(("spec", batch, constrained))
            ratios[batch, constrained] = spec_ / none
            share = (
                f"{100 * median(('none', batch, True), 'grammar_share'):.1f}% / "
                f"{100 * median(('spec', batch, True), 'grammar_share'):.1f}%"
                if constrained
                else "–"
            )
            kind = "JSON schema" if constrained else "free text"
            lines.append(
                f"| {batch} | {kind} | {none:.1f} | {spec_:.1f} | {spec_ / none:.2f}x | {share} |"
            )
    lines.append("")
    for batch in (1, 16):
        kept = ratios[batch, True] / ratios[batch, False]
        lines.append(
            f"- Batch {batch}: constrained speculation's speed-up is **{kept:.2f}x** the "
            f"unconstrained one (goal >= {GOAL}x: {verdict(kept >= GOAL, load)})"
        )
    text = "\n".join(lines)
    publish(text, args.write, f"bench_structured-{args.pair}-{cpu_class()}")


if __name__ == "__main__":
    main()
