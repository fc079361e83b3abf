"""Where a batch-1 step of a compiled model spends its time, by kind of work.

TVM 0.27's VM has no profiler, so every call instruction of ``prefill``, ``decode`` and
(``--verify K``) ``evaluate_multi_query`` of K tokens is timed through
``VirtualMachine.set_instrument`` and booked to a category by its symbol: matmuls (with int8
activations: their activation quantization apart), the LM head, attention (the KV cache's
kernels: RoPE, append, attention), norms, other elementwise kernels, VM builtins
(allocation, shape checks). The host side of a call (token tensors,
the KV cache's page tables, the VM call itself, sampling: greedy, or at ``--temperature``
every row's probabilities and a draw from each) is timed without the
instrument, and the difference between the un-instrumented call and the sum of its kernels is
the VM's own dispatch. Each kernel's time includes its thread-pool launch; run with
``--threads 1`` beside the default to see which kernels gain nothing from a second thread.

    python scripts/profile_step.py [--model smollm2|qwen1.5b | --artifact DIR] [--context 128]
        [--activations float|int8] [--verify 4 8] [--steps 32] [--repeats 5] [--threads N]
        [--temperature T]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MODELS = {"smollm2": "smollm2-135m-instruct", "qwen1.5b": "qwen2.5-coder-1.5b-instruct"}
# Symbol substring -> category, first match wins.
CATEGORIES = (
    ("attention", "attention"),
    ("rope_split", "attention"),
    ("kv_append", "attention"),
    ("argmax", "sampling"),
    ("quantize_x", "int8 activations: quantize"),
    ("lm_head", "LM head"),
    ("matmul", "matmul"),
    ("rms_norm", "norm"),
    ("take", "embedding"),
    ("vm.builtin", "VM builtins"),
    ("shape_func", "VM builtins"),
)
VM_BUILTINS = "VM builtins"


def category(symbol: str) -> str:
    return next((cat for key, cat in CATEGORIES if key in symbol), "elementwise")


class CallTimer:
    """A VM instrument that books each call instruction's wall time to its symbol."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._start = 0.0

    def __call__(self, _func, symbol: str, before_run: bool, _ret, *_args) -> int:
        now = time.perf_counter()
        if before_run:
            self._start = now
        else:
            self.seconds[symbol] += now - self._start
            self.calls[symbol] += 1
        return 0  # VMInstrumentReturnKind.NO_OP


def median_ms(call: Callable[[], object], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


class Step:
    """One batch-1 sequence on a paged KV cache, with the host parts of a step split out."""

    def __init__(self, model, prompt: np.ndarray, temperature: float = 0.0):
        from mlc_spec.runtime import rows
        from mlc_spec.runtime.params import SamplingParams

        self.model, self.prompt, self.rows = model, prompt, rows
        self.params = SamplingParams(temperature=temperature)
        self.kv = model.create_kv_cache(
            max_batch_size=1, max_total_len=4096, prefill_chunk_size=1024
        )
        self.kv.add_sequence(0)
        self.host: dict[str, list[float]] = defaultdict(list)

    def reset(self) -> None:
        self.kv.remove_sequence(0)
        self.kv.add_sequence(0)

    def _timed(self, part: str, call: Callable[[], object]):
        start = time.perf_counter()
        out = call()
        self.host[part].append((time.perf_counter() - start) * 1e3)
        return out

    def run(self, name: str, inputs: list, length: int):
        """What ``Model._run`` does plus sampling, each part timed on its own."""
        m, forward = self.model, self.kv.forward([0], [length])
        kv = self._timed("KV cache: page tables", forward.__enter__)
        out = self._timed("VM call", lambda: m._fn[name](*inputs, kv, m.params))
        self._timed("KV cache: lengths", lambda: forward.__exit__(None, None, None))
        logits = self._timed("logits view", lambda: self.rows.matrix(out[0]))
        if self.params.greedy:
            return self._timed("sampling (argmax)", lambda: m.sampler.argmax(logits))
        rows = [self.params] * int(logits.shape[0])
        probs = self._timed("sampling: probabilities", lambda: m.sampler.probs(logits, rows))
        return self._timed("sampling: draw", lambda: m.sampler.sample(probs, [0.5] * len(rows)))

    def prefill(self) -> None:
        n = len(self.prompt)
        ids = self._timed("token tensors", lambda: self.model._ids(self.prompt, (1, n)))
        last = self._timed("token tensors", lambda: self.model._ids([n - 1], (1,)))
        self.run("prefill", [ids, last], n)

    def decode(self, token: int) -> None:
        ids = self._timed("token tensors", lambda: self.model._ids([token], (1, 1)))
        self.run("decode", [ids], 1)

    def verify(self, tokens: list[int]) -> None:
        """``evaluate_multi_query`` of ``tokens`` and greedy tokens of all their rows (what a
        speculative step does with k drafts and the bonus row); ``undo`` drops them again."""
        k = len(tokens)
        ids = self._timed("token tensors", lambda: self.model._ids(tokens, (1, k)))
        self.run("evaluate_multi_query", [ids], k)


@dataclass
class Job:
    """Calls of one compiled function, each timed on its own: ``setup`` (untimed) makes the
    cache ready, ``undo`` (untimed) follows each call (e.g. drops the verified tokens)."""

    name: str
    setup: Callable[[], None]
    calls: list[Callable[[], None]]
    undo: Callable[[], None] = lambda: None


def jobs(step: Step, steps: int, verify: list[int]) -> list[Job]:
    """Prefill of the prompt; ``steps`` decodes from it; ``steps`` verifies of each K at the
    prompt's context."""
    tokens = [int(t) for t in np.arange(100, 100 + steps) % step.model.vocab_size]

    def prefilled() -> None:
        step.reset()
        step.prefill()

    found = [
        Job("prefill", step.reset, [step.prefill], step.reset),
        Job("decode", prefilled, [lambda t=t: step.decode(t) for t in tokens]),
    ]
    for k in verify:
        drafts = (tokens * (k // len(tokens) + 1))[:k]
        found.append(
            Job(
                f"verify {k} tokens (evaluate_multi_query)",
                prefilled,
                [lambda d=drafts: step.verify(d)] * steps,
                lambda k=k: step.kv.popn(0, k),
            )
        )
    return found


def profile(step: Step, todo: list[Job], repeats: int) -> dict[str, dict]:
    """Per job: un-instrumented call times (median) and host parts (mean per call) over
    ``repeats`` rounds after a warm-up round, then ``repeats`` instrumented rounds (kernel
    times, mean per call)."""
    out = {}
    for job in todo:
        walls, host = [], defaultdict(float)
        for round_ in range(repeats + 1):  # round 0 warms up and is dropped
            job.setup()
            for call in job.calls:
                step.host.clear()
                start = time.perf_counter()
                call()
                wall = (time.perf_counter() - start) * 1e3
                job.undo()
                if round_:
                    walls.append(wall)
                    for part, samples in step.host.items():
                        host[part] += sum(samples)
        timer = CallTimer()
        for _ in range(repeats):
            job.setup()
            for call in job.calls:
                step.model.vm.set_instrument(timer)
                call()
                step.model.vm.set_instrument(None)
                job.undo()
        n = len(walls)
        kernels = {s: (timer.seconds[s] * 1e3 / n, timer.calls[s] / n) for s in timer.seconds}
        host = {part: ms / n for part, ms in host.items()}
        out[job.name] = {"wall": statistics.median(walls), "host": host, "kernels": kernels}
    return out


def report(name: str, result: dict) -> str:
    lines = []
    for fn, r in result.items():
        wall, host, kernels = r["wall"], r["host"], r["kernels"]
        lines.append(f"\n### {name}: {fn}, {wall:.2f} ms per call (median, no instrument)\n")
        by_cat: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for symbol, (ms, calls) in kernels.items():
            by_cat[category(symbol)][0] += ms
            by_cat[category(symbol)][1] += calls
        builtins = by_cat.pop(VM_BUILTINS)
        by_cat.pop("sampling", None)  # a call of its own, timed on the host side below
        lines.append("| part | ms/call | % of call | calls/call |")
        lines.append("|---|---:|---:|---:|")
        for cat, (ms, calls) in sorted(by_cat.items(), key=lambda kv: -kv[1][0]):
            lines.append(f"| {cat} | {ms:.3f} | {100 * ms / wall:.1f} | {calls:.0f} |")
        vm = host.pop("VM call", 0.0) - sum(ms for ms, _ in by_cat.values())
        lines.append(
            f"| VM: builtins and dispatch (the VM call less its kernels) | {vm:.3f} | "
            f"{100 * vm / wall:.1f} | {builtins[1]:.0f} |"
        )
        for part, ms in host.items():
            lines.append(f"| host: {part} | {ms:.3f} | {100 * ms / wall:.1f} | |")
        rest = wall - sum(host.values()) - sum(ms for ms, _ in by_cat.values()) - vm
        lines.append(f"| host: Python between the parts | {rest:.3f} | {100 * rest / wall:.1f} | |")
        lines.append("\nTop calls:\n")
        lines.append("| symbol | category | ms/call | calls/call | µs/call |")
        lines.append("|---|---|---:|---:|---:|")
        for symbol, (ms, calls) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:15]:
            lines.append(
                f"| `{symbol}` | {category(symbol)} | {ms:.3f} | {calls:.0f} | "
                f"{1e3 * ms / calls:.1f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="smollm2")
    parser.add_argument("--artifact", type=Path, help="default: the cached as-source artifact")
    parser.add_argument("--context", type=int, default=128, help="prompt length (default 128)")
    parser.add_argument("--steps", type=int, default=32, help="decodes (verifies) per round")
    parser.add_argument(
        "--verify", type=int, nargs="*", default=[], help="also verify K tokens, for each K given"
    )
    parser.add_argument("--activations", choices=("float", "int8"), default="float")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=int(os.environ.get("TVM_NUM_THREADS", 2)))
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="sample at it (default 0: greedy)"
    )
    args = parser.parse_args()
    load = os.getloadavg()
    os.environ["TVM_NUM_THREADS"] = str(args.threads)  # read when TVM starts its pool
    from mlc_spec.runtime.model import Model

    if args.artifact is None:
        from mlc_spec.compiler.cache import compiled

        args.artifact = compiled(MODELS[args.model], activations=args.activations)
    model = Model(args.artifact)
    prompt = np.random.default_rng(0).integers(100, model.vocab_size - 100, args.context)
    step = Step(model, prompt, args.temperature)
    result = profile(step, jobs(step, args.steps, args.verify), args.repeats)
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    cpu = next(ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if "Model name" in ln)
    print(f"- artifact: {args.artifact}")
    print(f"- {cpu}; TVM_NUM_THREADS={args.threads}; load average before: {load}")
    print(
        f"- prompt {args.context} tokens; {args.steps} decodes from it, and {args.steps} "
        f"verifies of each K at its context; {args.repeats} rounds after a warm-up"
    )
    print(report(args.artifact.name, result))


if __name__ == "__main__":
    main()
