"""End-to-end speed of lossless speculative decoding on HumanEval, against llama.cpp and
transformers.

Qwen2.5-Coder-1.5B-Instruct generates greedily at batch 1 without speculation, with prompt
lookup, and with Qwen2.5-Coder-0.5B-Instruct drafting k = 1..8 tokens, compiled from the GGUFs
with ``--quantization`` (default: as shipped). On the same GGUFs and prompts, llama.cpp
(``scripts/llamacpp.py``) runs plainly (``llama-completion``) and with the draft proposing up to
n_max tokens (``llama-speculative-simple``), and transformers (float32) runs plainly, with the
draft as ``assistant_model`` and with ``prompt_lookup_num_tokens``. Everything runs in one run
with the same thread count, so the ratios hold even where the absolute figures drift. Greedy
speculation must not change a single token: each output is compared with its own system's
no-speculation output. ``--pair smollm2-self`` has SmolLM2-135M draft for itself instead: every
draft is accepted, which shows what the machinery costs, in minutes rather than an hour.

Beside each of our draft lengths stands its acceptance bound, the speed-up that the measured
acceptance allows at the measured step costs (``step_costs``); ``--plot`` draws tokens/s
against k for both systems. The engine's peak RSS is measured in a child process.

    python scripts/bench_speculative.py [--pair qwen|smollm2-self] [--quantization as-source]
        [--activations float|int8] [--draft-quantization q4] [--draft-lm-head q4]
        [--draft-lm-head-vocab N] [--num-prompts 5] [--max-tokens 64]
        [--only nospec,ngram,draft1,...,llama,llama-spec1,...,hf,...]
        [--write PATH] [--plot PNG]
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import transformers
from benchdoc import machine_context, section_name, start_load, usable_cores, write_section

THREADS = usable_cores()
# TVM sizes its thread pool when it is first imported, so this precedes the imports that load it.
os.environ["TVM_NUM_THREADS"] = str(THREADS)

import llamacpp  # noqa: E402
from bench_cpu import Compiled, timed_ms  # noqa: E402
from peak_rss import engine_peak_rss, gib  # noqa: E402
from prepare_qwen_pair import DRAFT, QUANTIZATIONS, TARGET  # noqa: E402
from workloads import humaneval_prompts  # noqa: E402

from mlc_spec import LLM, SamplingParams  # noqa: E402
from mlc_spec.compiler.cache import compiled  # noqa: E402
from mlc_spec.compiler.pypi_models import fetch  # noqa: E402
from mlc_spec.compiler.quantization.plan import LM_HEAD_QUANTIZATIONS  # noqa: E402
from mlc_spec.runtime.artifact import ACTIVATIONS, WEIGHTS_FILE, read_config  # noqa: E402
from mlc_spec.runtime.metrics import SpecStats  # noqa: E402
from mlc_spec.runtime.model import Model  # noqa: E402
from mlc_spec.runtime.request import CompletionOutput  # noqa: E402
from mlc_spec.runtime.tokenizer import Tokenizer  # noqa: E402

T = TypeVar("T")
WARMUP_TOKENS = 8
DRAFT_LENGTHS = range(1, 9)
STEP_COST_ROUNDS = 9  # medians of the step costs behind the acceptance bound
# Calls averaged per sample, under the median over rounds: one call per sample was noisy.
STEP_COST_CALLS = 4
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
            f"mlc-spec, draft k={k}",
            {"method": "draft", "num_speculative_tokens": k},
        )
        for k in DRAFT_LENGTHS
    },
}
# name: (table label, --spec-draft-n-max or None for no speculation)
LLAMA: dict[str, tuple[str, int | None]] = {
    "llama": ("llama.cpp, no speculation", None),
    **{f"llama-spec{n}": (f"llama.cpp, draft n_max={n}", n) for n in DRAFT_LENGTHS},
}
# name: (table label, extra `generate` arguments); the assistant is loaded only when asked for.
HF: dict[str, tuple[str, dict[str, Any]]] = {
    "hf": ("transformers greedy", {}),
    "hf-assisted": ("transformers assisted", {"assistant_model": None}),
    "hf-lookup": ("transformers prompt lookup, 4", {"prompt_lookup_num_tokens": 4}),
}
CONFIGS = [*OURS, *LLAMA, *HF]


@dataclass(frozen=True)
class Pair:
    """A target and its draft (names in ``mlc_spec.compiler.pypi_models``), how the report
    names them, and the docs/benchmarks.md section that its results go to."""

    target: str
    draft: str
    title: str
    description: str
    engine: str
    section: str


PAIRS = {
    "qwen": Pair(
        TARGET,
        DRAFT,
        "Qwen2.5-Coder-1.5B-Instruct",
        "Target Qwen2.5-Coder-1.5B-Instruct, draft Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUFs)",
        "LLM(model=1.5B, draft_model=0.5B)",
        "bench_speculative",
    ),
    "smollm2-self": Pair(
        "smollm2-135m-instruct",
        "smollm2-135m-instruct",
        "SmolLM2-135M-Instruct drafting for itself",
        "SmolLM2-135M-Instruct (Q4_1 + Q8_0 GGUF) drafting for itself, so that every draft is "
        "accepted",
        "LLM(model=SmolLM2, draft_model=SmolLM2)",
        "bench_speculative-smollm2-self",
    ),
}
# The engine's timers (``LLM.metrics()["seconds"]``) that split our configs' time: the target's
# prefill, the draft's passes (its own prefill of each prompt included), verification and plain
# decode steps; what the rest of a step took is the generate calls' wall time less these.
PHASES = ("prefill", "draft", "verify", "decode")
# each config's no-speculation baseline: the same system without a proposer
BASELINE = {**dict.fromkeys(OURS, "nospec"), **dict.fromkeys(LLAMA, "llama")}


@dataclass
class Run:
    """One configuration over all prompts: outputs (token ids, or llama.cpp's text), generated
    tokens, summed wall time and what is known of the speculation."""

    name: str
    label: str
    outputs: list[list[int]] | list[str]
    tokens: int
    seconds: float
    mean_accepted_length: float | None = None  # tokens per verification step
    acceptance: float | None = None  # accepted / drafted tokens
    phases: dict[str, float] | None = None  # ours: engine seconds per phase (PHASES)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def log(run: Run) -> Run:
    """Progress on stderr: the full benchmark takes a while."""
    print(f"{run.label}: {run.tokens_per_s:.2f} tokens/s, {run.seconds:.0f}s", file=sys.stderr)
    return run


def timed(
    generate: Callable[[list[int], int], T],
    prompts: list[list[int]],
    max_tokens: int,
    after_warm_up: Callable[[], None] = lambda: None,
) -> tuple[list[T], float]:
    """``generate(ids, max_tokens)`` prompt by prompt (one request at a time: batch 1) and the
    summed wall time, after an untimed warm-up that pays first-call costs (threads, buffers)."""
    generate(prompts[0], WARMUP_TOKENS)
    after_warm_up()
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

    warm = {}
    completions, seconds = timed(
        generate, prompts, max_tokens, lambda: warm.update(llm.metrics()["seconds"])
    )
    outputs = [c.token_ids for c in completions]
    run = Run(name, label, outputs, sum(map(len, outputs)), seconds)
    timers = llm.metrics()["seconds"]
    run.phases = {p: timers.get(p, 0.0) - warm.get(p, 0.0) for p in PHASES}
    if speculative is not None:
        stats = SpecStats()
        for completion in completions:
            stats.merge(completion.spec_stats)
        run.mean_accepted_length, run.acceptance = stats.mean_accepted_length, stats.acceptance_rate
    return run


def run_llama(name: str, pair: Pair, prompts: list[str], max_tokens: int) -> Run:
    """One llama.cpp config, a fresh process per prompt; its timings exclude model loading."""
    label, draft_n_max = LLAMA[name]
    target, draft = fetch(pair.target), fetch(pair.draft)
    if draft_n_max is None:
        gens = [llamacpp.plain(target, p, max_tokens, THREADS) for p in prompts]
    else:
        gens = [
            llamacpp.speculative(target, draft, p, max_tokens, draft_n_max, THREADS)
            for p in prompts
        ]
    run = Run(
        name,
        label,
        [g.text for g in gens],
        sum(g.tokens for g in gens),
        sum(g.seconds for g in gens),
    )
    if draft_n_max is not None:
        run.acceptance = sum(g.accepted for g in gens) / max(1, sum(g.drafted for g in gens))
    return run


@dataclass
class StepCosts:
    """Median milliseconds of one target decode step, one draft decode step, and the target's
    verification of k drafts (k + 1 tokens in one forward) for each k."""

    decode_ms: float
    draft_ms: float
    verify_ms: dict[int, float]

    def bound(self, k: int, mean_accepted_length: float) -> float:
        """Speed-up over plain decoding if a step cost only its k draft steps and one
        verification: tokens per step over the step's cost in target decode steps."""
        cost = k * self.draft_ms / self.decode_ms + self.verify_ms[k] / self.decode_ms
        return mean_accepted_length / cost


def step_costs(target: Path, draft: Path, prompt: list[int]) -> StepCosts:
    """Time the pieces of a draft speculation step at the context of a real prompt, models
    taking turns each round; one warm-up round is dropped."""
    ours, small = Compiled(Model(target)), Compiled(Model(draft))
    ours.prefill(prompt)
    small.prefill(prompt)
    tokens = prompt[: max(DRAFT_LENGTHS) + 1]

    def mean_ms(call: Callable[[list[int]], None], model: Compiled, n: int) -> float:
        """``call`` of the first n tokens, ``STEP_COST_CALLS`` times, rolled back each time."""
        samples = []
        for _ in range(STEP_COST_CALLS):
            samples.append(timed_ms(call, tokens[:n]))
            model.rollback(n)
        return statistics.fmean(samples)

    rounds: list[tuple[float, float, dict[int, float]]] = []
    for _ in range(STEP_COST_ROUNDS + 1):
        decode = mean_ms(lambda t: ours.decode(t[0]), ours, 1)
        draft_ms = mean_ms(lambda t: small.decode(t[0]), small, 1)
        verify = {k: mean_ms(ours.multi_query, ours, k + 1) for k in DRAFT_LENGTHS}
        rounds.append((decode, draft_ms, verify))
    rounds = rounds[1:]
    return StepCosts(
        statistics.median(r[0] for r in rounds),
        statistics.median(r[1] for r in rounds),
        {k: statistics.median(r[2][k] for r in rounds) for k in DRAFT_LENGTHS},
    )


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
    names: list[str], pair: Pair, prompts: list[list[int]], max_tokens: int, eos_ids: list[int]
) -> Iterator[Run]:
    """transformers' configs in turn, sharing one loaded target (and assistant)."""
    model = load_hf(pair.target)
    assistant = load_hf(pair.draft) if "hf-assisted" in names else None
    for name in names:
        label, extra = HF[name]
        extra = {k: assistant if k == "assistant_model" else v for k, v in extra.items()}
        generate = functools.partial(hf_generate, model, extra, eos_ids)
        outputs, seconds = timed(generate, prompts, max_tokens)
        yield Run(name, label, outputs, sum(map(len, outputs)), seconds)


@dataclass
class Memory:
    """Peak RSS of ``LLM(target, draft_model=draft)`` against its artifacts' weight bytes."""

    engine: str
    peak_rss: int
    weight_bytes: int

    def line(self) -> str:
        ratio = self.peak_rss / self.weight_bytes
        verdict = "met" if ratio <= 1.5 else "**not met**"
        return (
            f"- Peak RSS of `{self.engine}` loading and generating (a child "
            f"process): {gib(self.peak_rss)}, {ratio:.2f}x the two artifacts' weight bytes "
            f"({gib(self.weight_bytes)}); goal at most 1.5x: {verdict}"
        )


def measure_memory(engine: str, target: Path, draft: Path) -> Memory:
    return Memory(
        engine,
        engine_peak_rss(target, draft),
        sum((a / WEIGHTS_FILE).stat().st_size for a in (target, draft)),
    )


def report(
    runs: list[Run],
    costs: StepCosts | None,
    memory: Memory,
    pair: Pair,
    settings: dict[str, Any],
    context: list[str],
    plot: str | None,
) -> str:
    """The markdown section: how it was measured, the table, losslessness and the speed-ups."""
    by_name = {r.name: r for r in runs}
    flags = draft_flags(settings)
    lines = [
        "| config | tokens/s | speed-up vs own no-spec | mean accepted length | acceptance "
        "| acceptance bound (measured / bound) | same output as own no-spec |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        base = by_name.get(BASELINE.get(r.name, ""))
        speedup = f"{r.tokens_per_s / base.tokens_per_s:.2f}x" if base else "–"
        same = f"{same_outputs(r, base)}/{len(r.outputs)}" if base else "–"
        length = f"{r.mean_accepted_length:.2f}" if r.mean_accepted_length else "–"
        acceptance = f"{r.acceptance:.0%}" if r.acceptance is not None else "–"
        bound = "–"
        if costs and r.name.startswith("draft") and r.mean_accepted_length:
            limit = costs.bound(int(r.name[5:]), r.mean_accepted_length)
            bound = f"{limit:.2f}x"
            if base:
                bound += f" ({r.tokens_per_s / base.tokens_per_s / limit:.0%})"
        lines.append(
            f"| {r.label} | {r.tokens_per_s:.2f} | {speedup} | {length} | {acceptance} "
            f"| {bound} | {same} |"
        )
    return "\n".join(
        [
            f"## Speculative decoding end to end: {pair.title} on HumanEval"
            + (
                f", draft quantization {settings['draft_quantization']}"
                if settings["draft_quantization"]
                else ""
            )
            + (f", draft LM head {settings['draft_lm_head']}" if settings["draft_lm_head"] else "")
            + (
                f", draft scoring the first {settings['draft_lm_head_vocab']} ids"
                if settings["draft_lm_head_vocab"]
                else ""
            ),
            "",
            f"The first {settings['num_prompts']} HumanEval prompts (the raw `prompt` field), "
            f"greedy, batch 1, up to {settings['max_tokens']} new tokens each (EOS stops early). "
            f"{pair.description}; mlc-spec compiled with `--quantization "
            f"{settings['quantization']} --activations {settings['activations']}`"
            + (f" (the draft also with `{' '.join(flags)}`)" if flags else "")
            + "; "
            "llama.cpp runs the GGUFs as shipped and tokenizes the same prompt text itself; "
            "transformers dequantizes them to float32 and gets our prompt token ids. Tokens/s is "
            "generated tokens over the time of the generate calls, prefill included (ours: wall "
            "time after one untimed warm-up; llama.cpp: its printed prompt plus generation "
            "times, one process per prompt, model loading excluded). N-gram: prompt lookup with "
            "n-grams of 1-3 tokens. llama.cpp: `llama-completion` greedy, and "
            "`llama-speculative-simple --spec-type draft-simple --spec-draft-n-max N` (default "
            "minimum draft probability 0: it always drafts N), which overshoots the token limit "
            "by up to N tokens; its losslessness is checked on the text, as far as the shorter "
            "output goes. "
            "transformers assisted generation uses its defaults (up to 20 draft tokens per step, "
            "stopping early below an adaptive draft confidence) and does not report acceptance.",
            "",
            *(step_cost_note(costs) if costs else []),
            *context,
            "",
            *lines,
            "",
            *summary(runs),
            memory.line(),
            *phase_table(runs),
            *(["", f"![tokens/s against k]({plot})"] if plot else []),
        ]
    )


def draft_flags(settings: dict[str, Any]) -> list[str]:
    """The draft's own compile flags, as ``mlc-spec compile`` spells them."""
    flags = []
    if settings["draft_quantization"]:
        flags.append(f"--quantization {settings['draft_quantization']}")
    if settings["draft_lm_head"]:
        flags.append(f"--lm-head-quantization {settings['draft_lm_head']}")
    if settings["draft_lm_head_vocab"]:
        flags.append(f"--lm-head-vocab {settings['draft_lm_head_vocab']}")
    return flags


def phase_table(runs: list[Run]) -> list[str]:
    """Where our configs' time went, in seconds over all prompts (``PHASES``)."""
    ours = [r for r in runs if r.phases is not None]
    if not ours:
        return []
    lines = [
        "",
        "Where our time went, seconds over the prompts (engine timers; the draft's include its "
        "prefill of each prompt; other: sampling, scheduling and the Python between):",
        "",
        f"| config | total | {' | '.join(PHASES)} | other |",
        "|---|---:|" + "---:|" * (len(PHASES) + 1),
    ]
    for r in ours:
        cells = [f"{r.phases[p]:.2f}" for p in PHASES]
        other = r.seconds - sum(r.phases.values())
        lines.append(f"| {r.label} | {r.seconds:.2f} | {' | '.join(cells)} | {other:.2f} |")
    return lines


def step_cost_note(costs: StepCosts) -> list[str]:
    verify = ", ".join(f"k={k} {ms / costs.decode_ms:.2f}" for k, ms in costs.verify_ms.items())
    return [
        "Acceptance bound of draft length k: mean accepted length / (k x c_draft + "
        "c_verify(k)), the speed-up over plain decoding if a step cost nothing but k draft "
        "decode steps and one verification of k + 1 tokens. Step costs measured in this run "
        f"with the same artifacts at the context of the first prompt (each the mean of "
        f"{STEP_COST_CALLS} calls; medians of "
        f"{STEP_COST_ROUNDS} rounds): target decode step {costs.decode_ms:.1f} ms, c_draft = "
        f"draft decode step / target step = {costs.draft_ms / costs.decode_ms:.2f}, c_verify "
        f"= verify of k + 1 tokens / target step: {verify}. The measured speed-up also pays "
        "prefill, sampling and scheduling, which the bound leaves out.",
        "",
    ]


def same_outputs(run: Run, base: Run) -> int:
    """Prompts on which ``run`` reproduces ``base``: token for token, or, for llama.cpp's text,
    as far as the shorter of the two goes."""
    return sum(
        llamacpp.same_text(a, b) if isinstance(a, str) else a == b
        for a, b in zip(run.outputs, base.outputs, strict=True)
    )


def summary(runs: list[Run]) -> list[str]:
    """Losslessness, the best configuration of each system, and how they compare."""
    by_name = {r.name: r for r in runs}
    lines = []
    for base_name in ("nospec", "llama"):
        base = by_name.get(base_name)
        speculative = [r for r in runs if BASELINE.get(r.name) == base_name and r is not base]
        if base is None or not speculative:
            continue
        broken = [r.label for r in speculative if same_outputs(r, base) != len(r.outputs)]
        lines.append(
            f"- Lossless, {base.label}: **NO**, different output from {', '.join(broken)}"
            if broken
            else f"- Lossless: all {len(speculative)} speculative configs reproduce "
            f"{base.label} token for token"
        )
    if "hf" in by_name and "nospec" in by_name:
        lines.append(
            f"- transformers greedy gives our tokens on "
            f"{same_outputs(by_name['hf'], by_name['nospec'])}/{len(by_name['hf'].outputs)} prompts"
        )
    ours = [r for r in runs if r.name in OURS]
    llama = [r for r in runs if r.name in LLAMA]
    drafts = [r for r in ours if r.name.startswith("draft")]
    if drafts and "nospec" in by_name:
        best = max(drafts, key=lambda r: r.tokens_per_s)
        ratio = best.tokens_per_s / by_name["nospec"].tokens_per_s
        verdict = "met" if ratio >= 1.3 else "**not met**"
        lines.append(
            f"- Best draft length: {best.label}, {best.tokens_per_s:.2f} tokens/s, "
            f"{ratio:.3f}x our no-speculation (goal at least 1.3x: {verdict})"
        )
    if ours and llama:
        best, ref = (max(rs, key=lambda r: r.tokens_per_s) for rs in (ours, llama))
        ratio = best.tokens_per_s / ref.tokens_per_s
        verdict = "met" if ratio >= 1.2 else "**not met**"
        lines.append(
            f"- Best llama.cpp config: {ref.label}, {ref.tokens_per_s:.2f} tokens/s; our best, "
            f"{best.label}, is {ratio:.3f}x it (goal at least 1.2x: {verdict})"
        )
    if ours and "hf-assisted" in by_name:
        best = max(ours, key=lambda r: r.tokens_per_s)
        ratio = best.tokens_per_s / by_name["hf-assisted"].tokens_per_s
        lines.append(f"- {best.label} vs transformers assisted generation: {ratio:.2f}x")
    return lines


def plot_tokens_per_s(runs: list[Run], costs: StepCosts | None, path: Path, title: str) -> None:
    """Tokens/s against the draft length k for both systems, with our acceptance bound (our
    no-speculation tokens/s times the bound) and no speculation as flat lines."""
    import matplotlib

    matplotlib.use("Agg")  # no display
    import matplotlib.pyplot as plt

    by_name = {r.name: r for r in runs}
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for prefix, label, color in (("draft", "mlc-spec", "C0"), ("llama-spec", "llama.cpp", "C1")):
        points = [(k, by_name[f"{prefix}{k}"]) for k in DRAFT_LENGTHS if f"{prefix}{k}" in by_name]
        if points:
            ks, rs = zip(*points, strict=True)
            ax.plot(ks, [r.tokens_per_s for r in rs], "o-", color=color, label=f"{label}, draft")
        base = by_name.get(BASELINE[prefix + "1"])
        if base:
            ax.axhline(
                base.tokens_per_s, color=color, ls="--", lw=1, label=f"{label}, no speculation"
            )
        if prefix == "draft" and costs and base and points:
            bounds = [base.tokens_per_s * costs.bound(k, r.mean_accepted_length) for k, r in points]
            ax.plot(ks, bounds, ":", color=color, label="mlc-spec, acceptance bound")
    ax.set(xlabel="draft length k (llama.cpp: --spec-draft-n-max)", ylabel="tokens/s", title=title)
    ax.set_xticks(list(DRAFT_LENGTHS))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_only(value: str) -> list[str]:
    """Config names in the table's order, whatever order they were given in."""
    names = set(value.split(","))
    unknown = names - set(CONFIGS)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown configs {sorted(unknown)}; known: {CONFIGS}")
    return [n for n in CONFIGS if n in names]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--pair",
        choices=PAIRS,
        default="qwen",
        help="qwen (default): the 1.5B with the 0.5B drafting; smollm2-self: SmolLM2-135M "
        "drafting for itself, a quick check of the whole benchmark",
    )
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default="as-source",
        help="how our pair is compiled (default: as-source, the GGUFs' own types)",
    )
    parser.add_argument(
        "--activations",
        choices=ACTIVATIONS,
        default="float",
        help="how our quantized linear layers take activations: float (default) or int8",
    )
    parser.add_argument(
        "--draft-quantization",
        choices=QUANTIZATIONS,
        help="compile the draft so instead (default: as --quantization); q4 narrows the 0.5B "
        "draft's 5- to 8-bit tensors to 4 bits",
    )
    parser.add_argument(
        "--draft-lm-head",
        choices=LM_HEAD_QUANTIZATIONS,
        help="compile the draft with its LM head group-quantized anew (--lm-head-quantization)",
    )
    parser.add_argument(
        "--draft-lm-head-vocab",
        type=int,
        metavar="N",
        help="compile the draft with an LM head scoring only the first N ids (--lm-head-vocab)",
    )
    parser.add_argument("--num-prompts", type=int, default=5, help="the first N HumanEval prompts")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt")
    parser.add_argument(
        "--only",
        type=parse_only,
        default=CONFIGS,
        help=f"comma-separated subset of: {','.join(CONFIGS)}",
    )
    parser.add_argument("--write", type=Path, help="replace the pair's section of this file")
    parser.add_argument("--plot", type=Path, help="write tokens/s against k to this PNG")
    args = parser.parse_args()
    load = start_load()  # before we add our own
    torch.set_num_threads(THREADS)

    pair = PAIRS[args.pair]
    target = compiled(pair.target, args.quantization, activations=args.activations)
    draft = compiled(
        pair.draft,
        args.draft_quantization or args.quantization,
        activations=args.activations,
        lm_head=args.draft_lm_head,
        lm_head_vocab=args.draft_lm_head_vocab,
    )
    texts = humaneval_prompts(args.num_prompts)
    tokenizer = Tokenizer(target)
    prompts = [tokenizer.encode(p) for p in texts]
    memory = measure_memory(pair.engine, target, draft)
    print(memory.line(), file=sys.stderr)
    runs = []
    for name in (n for n in args.only if n in OURS):
        runs.append(log(run_ours(name, target, draft, prompts, args.max_tokens)))
        gc.collect()  # free this config's weights before loading the next
    costs = None
    if any(n.startswith("draft") for n in args.only):
        costs = step_costs(target, draft, prompts[0])
        gc.collect()
    runs += [log(run_llama(n, pair, texts, args.max_tokens)) for n in args.only if n in LLAMA]
    hf_names = [n for n in args.only if n in HF]
    if hf_names:
        eos_ids = read_config(target)["eos_token_ids"]
        runs += map(log, run_hf(hf_names, pair, prompts, args.max_tokens, eos_ids))

    import tvm

    context = machine_context(
        load,
        f"TVM {tvm.__version__}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, {llamacpp.describe_build()}",
        f"TVM_NUM_THREADS={os.environ['TVM_NUM_THREADS']}, "
        f"torch.set_num_threads({torch.get_num_threads()}), llama.cpp -t {THREADS} -td {THREADS}",
    )
    settings = vars(args)
    plot = None
    if args.plot:
        flags = draft_flags(settings)
        title = (
            f"{pair.title}, --quantization {args.quantization} "
            f"--activations {args.activations}\n"
            + (f"draft: {' '.join(flags)}\n" if flags else "")
            + f"HumanEval x{args.num_prompts}, greedy, batch 1, {THREADS} threads"
        )
        plot_tokens_per_s(runs, costs, args.plot, title)
        plot = os.path.relpath(args.plot, args.write.parent) if args.write else str(args.plot)
    section = report(runs, costs, memory, pair, settings, context, plot)
    print(section)
    if args.write:
        name = section_name(pair.section, args.activations)
        if args.draft_quantization:
            name += f"-draft-{args.draft_quantization}"
        if args.draft_lm_head:
            name += f"-draft-{args.draft_lm_head}-head"
        if args.draft_lm_head_vocab:
            name += f"-vocab{args.draft_lm_head_vocab}"
        write_section(args.write, name, section)


if __name__ == "__main__":
    main()
