"""The int8 matmul kernel alone on real models' shapes: this tree's against a git revision's.

A kernel change that saves 10% of a layer is lost in a whole-model run on a shared machine, whose
rounds differ by as much. Here both versions of ``compiler/int8_matmul.py`` compile the same
weight shapes for this CPU and take turns call by call on random weights in the stored layout,
each version cycling over enough copies that every call reads its weights from DRAM, as a decode
step does. Prints milliseconds per call, the weight bytes read per second, B / A (B is this
tree, A the revision), and whether both gave the same outputs bit for bit on the same inputs
(a kernel change that only reorders exact integer work must).

    python scripts/bench_kernel.py (--against REV | --widths 1,2,4) [--rows 1,2,3,4,8]
        [--rounds 12] [--shapes gate_up,down,qkv] [--cpu native] [--write docs/benchmarks.md]

``--widths`` times this tree's kernel with each sweep width forced on every row count instead,
the figures behind ``IntegerDot.widths``.
"""

from __future__ import annotations

import argparse
import importlib.util
import linecache
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from types import ModuleType, SimpleNamespace

import numpy as np
from benchdoc import machine_context, publish, start_load, usable_cores
from gguf import GGMLQuantizationType as T

ROOT = Path(__file__).resolve().parent.parent
KERNEL = "compiler/int8_matmul.py"
# Weight copies per version span at least this much, so no call finds its weights in cache.
RESIDENT_BYTES = 256 << 20
# (GGUF type, rows, columns); first Qwen2.5-Coder-1.5B-Instruct Q4_K_M's linear layers.
SHAPES = {
    "gate_up": (T.Q4_K, 17920, 1536),
    "down": (T.Q6_K, 1536, 8960),
    "qkv": (T.Q4_K, 2048, 1536),
    "o": (T.Q4_K, 1536, 1536),
    # SmolLM2-135M-Instruct's (Q4_1): 9 and 15 panels of 64 rows for o/down and q/k/v.
    "smol_gate_up": (T.Q4_1, 3072, 576),
    "smol_down": (T.Q4_1, 576, 1536),
    "smol_o": (T.Q4_1, 576, 576),
    "smol_qkv": (T.Q4_1, 960, 576),
    # 8-bit LM heads: SmolLM2's (tied) table and Qwen2.5-Coder-0.5B's, the draft's.
    "smol_head": (T.Q8_0, 49152, 576),
    "draft_head": (T.Q8_0, 151936, 896),
    # Qwen2.5-Coder-0.5B-Instruct Q4_K_M's (the draft's): 5-bit Q5_0 where 896 columns leave no
    # room for 256-wide K-type blocks, Q6_K or Q4_K for down.
    "draft_gate_up": (T.Q5_0, 9728, 896),
    "draft_qkv": (T.Q5_0, 1152, 896),
    "draft_down": (T.Q6_K, 896, 4864),
}


def module_at(rev: str, path: str = KERNEL) -> ModuleType:
    """The compiler module ``path`` as of git revision ``rev``, imported beside this tree's."""
    shown = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:{path}"], capture_output=True, text=True
    )
    if shown.returncode:
        raise SystemExit(f"--against {rev}: {shown.stderr.strip()}")
    source = shown.stdout
    stem = Path(path).stem
    name = f"mlc_spec.compiler.{stem}_at_{re.sub(r'[^0-9A-Za-z]', '_', rev)}"
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))
    module.__package__ = "mlc_spec.compiler"
    sys.modules[name] = module
    filename = f"{rev}:{path}"
    # TVMScript parses its functions' source text, which it looks up by file name.
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), module.__dict__)
    return module


@dataclass
class Kernel:
    """One version's compiled kernel for one shape, and the weight copies it cycles over."""

    func: object
    call: object
    weights: list[dict]
    weight_bytes: int

    def argument_lists(self, activations: dict) -> list[list]:
        """The kernel's arguments in order, once per weight copy."""
        count = len(self.func.params)
        return [[{**activations, **copy}[i] for i in range(count)] for copy in self.weights]


def random_arguments(func, m: int, rng: np.random.Generator) -> tuple[dict, dict]:
    """(activation arguments, weight arguments) by position in ``func``'s parameters, M = m:
    int8 activations, any bits for codes, small positive scales, a zeroed output, shifts
    (``int8_matmul.sub_scaled_quantize_func``) within their range."""
    import tvm

    activations, weights = {}, {}
    last = len(func.params) - 1
    for i, param in enumerate(func.params):
        dynamic = any(not isinstance(d, tvm.tirx.IntImm) for d in param.shape)
        shape = [int(d) if isinstance(d, tvm.tirx.IntImm) else m for d in param.shape]
        dtype = str(param.dtype)
        if i == last:
            value = np.zeros(shape, dtype)
        elif param.name == "xshift":
            value = rng.integers(0, 4, shape).astype(dtype)
        elif dtype == "int8":
            value = rng.integers(-127, 128, shape).astype(dtype)
        elif dtype == "uint32":
            value = rng.integers(0, 2**32, shape, dtype=np.uint32)
        elif dtype.startswith(("int", "uint")):
            value = rng.integers(1, 60, shape).astype(dtype)
        else:
            value = rng.uniform(0, 0.01, shape).astype(dtype)
        (activations if dynamic else weights)[i] = tvm.runtime.tensor(value)
    return activations, weights


def build(module: ModuleType, target, kind: str, rng: np.random.Generator) -> Kernel:
    """Compile ``module``'s kernel for shape ``kind`` and lay out its weight copies."""
    import tvm

    from mlc_spec.compiler.quantization import format_of
    from mlc_spec.models.quantized import panel_width

    ggml_type, n, k = SHAPES[kind]
    dot = module.integer_dot(target)
    func = module.matmul_func(dot, format_of(ggml_type), n, k, panel_width(n))
    func = func.with_attr("global_symbol", "main")
    call = tvm.compile(tvm.IRModule({"main": func}), target=target)["main"]
    _, first = random_arguments(func, 1, rng)
    weight_bytes = sum(t.numpy().nbytes for t in first.values())
    copies = max(2, math.ceil(RESIDENT_BYTES / weight_bytes))
    weights = [first] + [random_arguments(func, 1, rng)[1] for _ in range(copies - 1)]
    return Kernel(func, call, weights, weight_bytes)


def same_outputs(kernels: dict[str, Kernel], activations: dict) -> bool:
    """Whether every version, called once on the same activations and the first version's first
    weight copy (each version draws its own copies), into a zeroed output, writes the same bits."""
    import tvm

    arguments = next(iter(kernels.values())).argument_lists(activations)[0]
    outputs = []
    for kernel in kernels.values():
        arguments[-1] = tvm.runtime.tensor(np.zeros_like(arguments[-1].numpy()))
        kernel.call(*arguments)
        outputs.append(arguments[-1].numpy())
    return all(np.array_equal(outputs[0], o) for o in outputs[1:])


def time_round(call, argument_lists: list[list]) -> float:
    """Seconds per call over one pass through the weight copies."""
    start = time.perf_counter()
    for arguments in argument_lists:
        call(*arguments)
    return (time.perf_counter() - start) / len(argument_lists)


def widths_at(module: ModuleType, width: int) -> SimpleNamespace:
    """``module``'s kernel with every row count's sweep width forced to ``width`` vectors."""

    def integer_dot(target):
        return replace(module.integer_dot(target), widths=(width,) * 8, byte_widths=None)

    return SimpleNamespace(integer_dot=integer_dot, matmul_func=module.matmul_func)


def medians(kernels: dict[str, Kernel], m: int, rounds: int, rng) -> tuple[dict, bool | None]:
    """Seconds per call of each version at M = m, and whether all wrote the same bits (None
    where the versions take different activations: each gets random ones of its own)."""
    signatures = {tuple(str(p.dtype) for p in k.func.params) for k in kernels.values()}
    if len(signatures) == 1:
        shared = random_arguments(next(iter(kernels.values())).func, m, rng)[0]
        activations = dict.fromkeys(kernels, shared)
        same = same_outputs(kernels, shared)
    else:
        activations = {v: random_arguments(k.func, m, rng)[0] for v, k in kernels.items()}
        same = None
    timers = {
        v: partial(time_round, k.call, k.argument_lists(activations[v])) for v, k in kernels.items()
    }
    return alternating_medians(timers, rounds), same


def _same_cell(same: bool | None) -> str:
    return "other activations" if same is None else "yes" if same else "**no**"


def alternating_medians(timers: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """Each version's median of its timer's seconds over ``rounds`` rounds, after a warm-up
    round that is dropped; in each round every version runs once."""
    times = {v: [] for v in timers}
    for round_ in range(rounds + 1):
        # Each goes first every other round: in an A/A run going second was worth 1-5%.
        for v in sorted(timers, reverse=bool(round_ % 2)):
            times[v].append(timers[v]())
    return {v: float(np.median(t[1:])) for v, t in times.items()}


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every kernel benchmark takes: rounds, threads, CPU and where to record."""
    parser.add_argument("--rounds", type=int, default=12, help="alternating rounds; default 12")
    parser.add_argument("--threads", type=int, default=usable_cores(), help="default: all")
    parser.add_argument(
        "--cpu", default="native", help="LLVM CPU: x86-64-v3 (AVX2) etc.; default native"
    )
    parser.add_argument("--write", type=Path, help="record the table in this markdown file")


def shape_names(parser: argparse.ArgumentParser, value: str, known) -> list[str]:
    """The comma-separated ``--shapes``; a parser error names any not in ``known``."""
    names = value.split(",")
    unknown = set(names) - set(known)
    if unknown:
        parser.error(f"unknown --shapes {', '.join(sorted(unknown))} (known: {', '.join(known)})")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    baseline = parser.add_mutually_exclusive_group(required=True)
    baseline.add_argument("--against", help="git revision of the baseline (A)")
    baseline.add_argument(
        "--widths", help="instead: this tree's kernel at each sweep width, e.g. 1,2,4"
    )
    parser.add_argument("--rows", default="1,2,3,4,8", help="activation rows M; default 1,2,3,4,8")
    parser.add_argument("--shapes", default="gate_up,down", help=f"of {', '.join(SHAPES)}")
    add_run_arguments(parser)
    args = parser.parse_args()
    shapes = shape_names(parser, args.shapes, SHAPES)
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    import tvm

    from mlc_spec.compiler import int8_matmul
    from mlc_spec.compiler.errors import CompileError
    from mlc_spec.compiler.targets import make_target

    load = start_load()
    try:
        target = make_target("llvm", cpu=args.cpu)
        dot = int8_matmul.integer_dot(target)
    except CompileError as error:
        raise SystemExit(f"--cpu {args.cpu}: {error}") from None
    instruction = dot.vnni or dot.maddubs
    if args.widths:
        versions = {f"w{w}": widths_at(int8_matmul, int(w)) for w in args.widths.split(",")}
        header = [f"{v} ms" for v in versions] + ["fastest"]
    else:
        versions = {"A": module_at(args.against), "B": int8_matmul}
        header = ["A ms", "B ms", "A GB/s", "B GB/s", "B / A"]
    rows = [int(r) for r in args.rows.split(",")]
    rng = np.random.default_rng(0)
    table = [
        f"| shape | M | {' | '.join(header)} | same bits |",
        "|---|---:|" + "---:|" * len(header) + "---|",
    ]
    for kind in shapes:
        kernels = {v: build(module, target, kind, rng) for v, module in versions.items()}
        for m in rows:
            seconds, same = medians(kernels, m, args.rounds, rng)
            cells = [f"{t * 1e3:.3f}" for t in seconds.values()]
            if args.widths:
                cells.append(min(seconds, key=seconds.get))
            else:
                a, b = seconds["A"], seconds["B"]
                gbs = [kernels[v].weight_bytes / t / 1e9 for v, t in seconds.items()]
                cells += [f"{gbs[0]:.1f}", f"{gbs[1]:.1f}", f"{b / a:.3f}"]
            ggml_type, n, k = SHAPES[kind]
            line = (
                f"| {kind} {ggml_type.name} {n}x{k} | {m} | {' | '.join(cells)} "
                f"| {_same_cell(same)} |"
            )
            table.append(line)
            print(line, flush=True)
    software = f"TVM {tvm.__version__}, kernels for --cpu {args.cpu} ({instruction})"
    context = machine_context(load, software, f"{args.threads} threads")
    if args.widths:
        title = f"sweep widths {args.widths}"
        versions_line = (
            f"- This tree's kernel (HEAD `{short_commit('HEAD')}`) with every row count's sweep "
            f"width forced to each of {args.widths} vectors (`{KERNEL}`'s `IntegerDot.widths`)"
        )
        key = f"bench_kernel-widths-{args.cpu}"
    else:
        # Named by commit: a relative revision (HEAD~1) would name another baseline tomorrow.
        against = short_commit(args.against)
        title = f"against `{against}`"
        versions_line = (
            f"- A: `{KERNEL}` at `{args.against}` (`{against}`); "
            f"B: this tree (HEAD `{short_commit('HEAD')}`)"
        )
        key = f"bench_kernel-{against}-{args.cpu}"
    section = "\n".join(
        [
            f"## Int8 matmul kernel alone (`scripts/bench_kernel.py`) {title}",
            "",
            *context,
            versions_line,
            f"- Medians of {args.rounds} rounds, the versions taking turns to go first (one "
            f"warm-up round dropped); each call reads its weights from DRAM (copies spanning "
            f"{RESIDENT_BYTES >> 20} MiB)",
            "",
            *table,
        ]
    )
    publish(section, args.write, key)


def short_commit(rev: str) -> str:
    shown = ["git", "-C", str(ROOT), "rev-parse", "--short", rev]
    return subprocess.run(shown, capture_output=True, text=True).stdout.strip()


if __name__ == "__main__":
    main()
