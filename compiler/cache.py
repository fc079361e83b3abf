"""Compiled artifacts of the PyPI models, cached beside their downloads.

An artifact's name records what makes it reusable -- this CPU's instruction set, the
quantization, the activations, the layers kept, the artifact format and a digest of the code
that compiles it (the compiler, the model definitions and TVM's version) -- so that a cache moved
to another machine, or written by other kernels, is never loaded by mistake; it is compiled
again.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from functools import cache, partial
from pathlib import Path
from typing import TypeVar

import tvm
from filelock import FileLock

from mlc_spec.runtime.artifact import FORMAT_VERSION

from .compile import compile_model
from .options import CompileOptions, default_activations, fastest_activations
from .pypi_models import MODELS, default_cache_dir, fetch
from .targets import cpu_name, make_target

_CODE_DIRS = ("compiler", "models")
A = TypeVar("A")
B = TypeVar("B")


def code_digest(root: Path) -> str:
    """8 hex digits over TVM's version and every source file of the compiler and the models
    under ``root`` (the package's root)."""
    digest = hashlib.sha256(tvm.__version__.encode())
    for path in sorted(p for d in _CODE_DIRS for p in (root / d).rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + path.read_bytes())
    return digest.hexdigest()[:8]


@cache
def _this_code() -> str:
    return code_digest(Path(__file__).resolve().parent.parent)


def artifacts_dir() -> Path:
    return default_cache_dir() / "artifacts"


def compiled(
    name: str,
    quantization: str = "as-source",
    num_layers: int | None = None,
    show_progress: bool = True,
    activations: str | None = None,
    lm_head: str | None = None,
    lm_head_vocab: int | None = None,
    kv_cache_dtype: str | None = None,
) -> Path:
    """The CPU artifact of the PyPI model ``name``, compiled on first use (``compile_model``
    only ever renames a complete artifact into place, so a cached one is whole); activations
    None: the model's default (``options.default_activations``), and likewise the KV cache's
    float type (``options.default_kv_cache_dtype``)."""
    options = _options(
        name,
        quantization,
        activations,
        lm_head=lm_head,
        lm_head_vocab=lm_head_vocab,
        num_layers=num_layers,
        kv_cache_dtype=kv_cache_dtype,
    )
    artifact = _artifact(name, options)
    if artifact.exists():
        return artifact
    artifact.parent.mkdir(parents=True, exist_ok=True)
    # Two first runs side by side: one compiles, the other waits and finds the artifact whole
    # (without the lock, its own staged copy could not be renamed onto the first one's).
    with FileLock(f"{artifact}.lock"):
        if not artifact.exists():
            compile_model(
                fetch(name), "llvm", artifact, options, show_progress=show_progress, label=name
            )
    return artifact


def _options(
    name: str, quantization: str = "as-source", activations: str | None = None, **rest
) -> CompileOptions:
    """``compiled``'s options for PyPI model ``name``, its default activations filled in."""
    if activations is None:
        activations = default_activations(MODELS[name].sha256, quantization, make_target("llvm"))
    return CompileOptions(quantization=quantization, activations=activations, **rest)


def _artifact(name: str, options: CompileOptions) -> Path:
    """Where ``compiled`` keeps PyPI model ``name`` compiled with ``options`` (activations
    given) for this CPU."""
    o = options
    layers = f"-{o.num_layers}-layers" if o.num_layers is not None else ""
    head = f"-{o.lm_head}-head" if o.lm_head is not None else ""
    head += f"-vocab{o.lm_head_vocab}" if o.lm_head_vocab is not None else ""
    kv = f"-kv-{o.kv_cache_dtype}" if o.kv_cache_dtype is not None else ""
    kind = f"{cpu_name(make_target('llvm'))}-{o.quantization}-{o.activations}{layers}{head}{kv}"
    return artifacts_dir() / f"{name}-llvm-{kind}-v{FORMAT_VERSION}-{_this_code()}"


# How a draft is compiled, by measurement (docs/benchmarks.md, the Qwen pair end to end: 1.38x
# plain decoding with these, the fastest lossless configuration): weights at 4 bits and the LM
# head, most of a small model's step, at 4 bits over the first 100,000 token ids (Qwen's rarer
# ids are higher). Lossy for the draft only: the target verifies every token.
DRAFT_OPTIONS = {"quantization": "q4", "lm_head": "q4", "lm_head_vocab": 100_000}


def compiled_with_draft(name: str, show_progress: bool = True) -> tuple[Path, Path | None]:
    """The artifacts of PyPI model ``name`` and of the model that drafts for it (None where it
    has none), compiled on first use on their fastest lossless path: both at once where both
    are missing and there are cores for two, since a compile keeps one core busy (the README's
    pair on 2 cores: 93 s one after the other, 53 s side by side)."""
    draft = MODELS[name].draft
    if draft is None:
        return compiled(name, show_progress=show_progress), None
    cached = (_artifact(name, _options(name)), _artifact(draft, _options(draft, **_draft())))
    missing = not any(artifact.exists() for artifact in cached)
    return side_by_side(
        partial(compiled, name, show_progress=show_progress),
        partial(compiled_draft, draft, show_progress),
        apart=missing and len(os.sched_getaffinity(0)) >= 2,
    )


def side_by_side(first: Callable[[], A], second: Callable[[], B], apart: bool) -> tuple[A, B]:
    """``first()`` and ``second()``: with ``apart``, ``second`` in a process of its own (spawned,
    so it shares no TVM state with this one) while ``first`` runs here; else one after the
    other."""
    if not apart:
        return first(), second()
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        running = pool.submit(second)
        return first(), running.result()


def compiled_draft(name: str, show_progress: bool = True) -> Path:
    """PyPI model ``name`` compiled to draft (``DRAFT_OPTIONS``), with int8 activations where
    the CPU has an integer dot product."""
    return compiled(name, show_progress=show_progress, **_draft())


def _draft() -> dict:
    """``compiled``'s arguments for a draft."""
    return {"activations": fastest_activations(make_target("llvm")), **DRAFT_OPTIONS}
