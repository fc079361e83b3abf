"""What ``mlc-spec compile`` builds besides the model, target and output path: one frozen
object, checked in one place before the model is read, so that a bad or inapplicable flag is
refused before anything is written and no option is silently ignored."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from mlc_spec.runtime.artifact import ACTIVATIONS, KV_CACHE_DTYPES

from .activations_default import int8_by_default
from .errors import CompileError
from .int8_matmul import integer_dot
from .quantization.plan import LM_HEAD_QUANTIZATIONS, QUANTIZATIONS
from .targets import (
    ALLOWED_DTYPES,
    ATTENTION,
    DEFAULT_CPU,
    DEFAULT_CUDA_ARCH,
    DEFAULT_DTYPE,
    TARGETS,
    make_target,
)

if TYPE_CHECKING:
    from tvm.target import Target

    from .sources import ModelSource

# Options that one target alone reads (field: flag, target): given for another, they would
# change nothing, so they are refused rather than ignored.
_ONE_TARGET = {
    "cpu": ("--cpu", "llvm"),
    "cuda_arch": ("--cuda-arch", "cuda"),
    "lm_head_vocab": ("--lm-head-vocab", "llvm"),
    "kv_cache_dtype": ("--kv-cache-dtype", "llvm"),
}


@dataclass(frozen=True)
class CompileOptions:
    """The options of ``compile_model``; None is "not given": ``validate`` fills in the target's
    defaults, ``with_source_defaults`` those that depend on the model.

    ``dtype`` is the model's float type; ``cuda_arch`` the GPU (cuda) and ``cpu`` the CPU
    (llvm: ``native`` or an LLVM name such as ``x86-64-v3``) built for; ``attention`` the KV
    cache's kernels (``targets.ATTENTION``); ``quantization`` one of ``QUANTIZATIONS`` (default:
    ``as-source`` for a GGUF file, whose quantized tensors are kept as shipped, ``none`` for a
    Hugging Face directory); ``activations`` ``int8`` quantizes the activations of quantized
    layers for integer dot products (``int8_matmul``; llvm only), ``float`` keeps them;
    ``lm_head`` (``q4`` / ``q8``) group-quantizes the LM head anew and ``lm_head_vocab`` has it
    score only the first token ids (llvm only), both for a draft; ``num_layers`` keeps only
    the first layers (a self-draft for layer-skip speculation); ``kv_cache_dtype`` the float
    type of the KV pages (llvm only; default ``default_kv_cache_dtype``)."""

    dtype: str | None = None
    cuda_arch: str | None = None
    cpu: str | None = None
    attention: str | None = None
    quantization: str | None = None
    activations: str | None = None
    lm_head: str | None = None
    lm_head_vocab: int | None = None
    num_layers: int | None = None
    kv_cache_dtype: str | None = None

    def validate(self, target: str) -> CompileOptions:
        """These options with ``target``'s defaults filled in, or a one-line CompileError naming
        the first flag that is unknown or does not apply to ``target``. Ranges that depend on
        the model (``num_layers``, ``lm_head_vocab``) are checked once it is read."""
        if target not in TARGETS:
            raise CompileError(f"unknown target {target!r}; choose one of {', '.join(TARGETS)}")
        for field, (flag, only) in _ONE_TARGET.items():
            if getattr(self, field) is not None and target != only:
                raise CompileError(_not_for(flag, only, target))
        if self.activations == "int8" and target != "llvm":
            raise CompileError(_not_for("--activations int8", "llvm", target))
        _check_known("quantization", self.quantization, QUANTIZATIONS)
        _check_known("LM head quantization", self.lm_head, LM_HEAD_QUANTIZATIONS)
        _check_known("activations", self.activations, ACTIVATIONS)
        _check_known("KV cache dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        options = replace(
            self,
            dtype=self.dtype or DEFAULT_DTYPE[target],
            attention=self.attention or ATTENTION[target][0],
            cuda_arch=self.cuda_arch or (DEFAULT_CUDA_ARCH if target == "cuda" else None),
            cpu=self.cpu or (DEFAULT_CPU if target == "llvm" else None),
        )
        _check_supported("dtype", options.dtype, ALLOWED_DTYPES[target], target)
        _check_supported("attention", options.attention, ATTENTION[target], target)
        tvm_target = options.tvm_target(target)  # refuses an unknown CPU
        if options.activations == "int8":
            integer_dot(tvm_target)  # refuses a CPU without AVX2
        return options

    def tvm_target(self, target: str) -> Target:
        """TVM's target for ``target`` as options that ``validate`` returned build it."""
        if target == "cuda":
            return make_target(target, cuda_arch=self.cuda_arch)
        return make_target(target, cpu=self.cpu)

    def with_source_defaults(self, source: ModelSource, tvm_target: Target) -> CompileOptions:
        """Validated options with the defaults that depend on the model filled in."""
        options = replace(self, quantization=self.quantization or default_quantization(source))
        activations = options.activations or default_activations(
            source.source_hash, options.quantization, tvm_target
        )
        kv_cache_dtype = options.kv_cache_dtype
        if tvm_target.kind.name == "llvm" and kv_cache_dtype is None:
            kv_cache_dtype = default_kv_cache_dtype(activations, options.dtype)
        return replace(options, activations=activations, kv_cache_dtype=kv_cache_dtype)


def default_quantization(source: ModelSource) -> str:
    """A file's quantized tensors as shipped (GGUF); float weights for a Hugging Face directory."""
    return "as-source" if source.stored_formats else "none"


def default_activations(source_hash: str, quantization: str, tvm_target: Target) -> str:
    """The activations when ``--activations`` is not given: int8 for a file (by its sha256)
    where they were measured at least as faithful to the float model as llama.cpp
    (``activations_default``), its quantized weights kept as shipped, on a CPU with an integer
    dot product (VNNI or AVX2) whose arithmetic was measured so; float everywhere else."""
    if tvm_target.kind.name != "llvm" or quantization != "as-source":
        return "float"
    instruction = _integer_dot_instruction(tvm_target)
    return "int8" if instruction and int8_by_default(source_hash, instruction) else "float"


def default_kv_cache_dtype(activations: str, dtype: str) -> str:
    """The CPU's KV pages when ``--kv-cache-dtype`` is not given: float16 with int8 activations,
    as llama.cpp keeps its KV cache by default (the fidelity verdicts in docs/quantization.md
    hold with it), since a decode step's attention streams its pages from memory and reads
    half the bytes (docs/kernels.md); the model's own ``dtype`` with float activations, the
    path that keeps parity with transformers."""
    return "float16" if activations == "int8" else dtype


def fastest_activations(tvm_target: Target) -> str:
    """int8 where ``tvm_target``'s CPU has an integer dot product (VNNI or AVX2), else float."""
    return "int8" if _integer_dot_instruction(tvm_target) else "float"


def _integer_dot_instruction(tvm_target: Target) -> str | None:
    """The instruction of ``tvm_target``'s integer dot product, None where its CPU has none."""
    try:
        return integer_dot(tvm_target).instruction
    except CompileError:
        return None


def _not_for(flag: str, only: str, target: str) -> str:
    return f"{flag} is built for --target {only} only, not {target}"


def _check_known(what: str, value: str | None, choices: tuple[str, ...]) -> None:
    if value is not None and value not in choices:
        raise CompileError(f"unknown {what} {value!r}; choose one of {', '.join(choices)}")


def _check_supported(what: str, value: str, choices: tuple[str, ...], target: str) -> None:
    if value not in choices:
        raise CompileError(
            f"{what} {value!r} is not supported on {target}; choose {' or '.join(choices)}"
        )
