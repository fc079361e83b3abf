"""``mlc-spec compile``: model source -> artifact directory, all or nothing."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import safetensors.numpy
import tvm

from mlc_spec.models import MODEL_CLASSES, ConfigError, LlamaForCausalLM, ModelConfig
from mlc_spec.models.kv_cache import TVMKVCache
from mlc_spec.models.quantized import PANEL_SUFFIXES, quantizable_weights, quantize_layers
from mlc_spec.runtime.artifact import (
    CONFIG_FILE,
    FORMAT_VERSION,
    LIBRARY_FILE,
    SAMPLER_LIBRARY_FILE,
    WEIGHTS_FILE,
    ParamRecord,
    functions,
    sampler_functions,
)

from . import flashinfer
from .convert import convert_parameters
from .cpu_kv_cache import CPUKVCache
from .errors import CompileError
from .head_vocab import head_vocab
from .int8_matmul import Int8Matmul
from .options import CompileOptions
from .pipeline import relax_pipeline
from .progress import Progress
from .quantization.plan import Quantize, layer_layouts, plan_quantization, requantize_lm_head
from .sampler import attach_sampler
from .sampling_defaults import sampling_defaults
from .sources import ModelSource, load_source
from .staging import interrupted, staged
from .targets import vector_features
from .truncate import first_layers

_DEFAULTS = CompileOptions()  # frozen, so one instance serves every call as the default


def compile_model(
    model: str | Path,
    target: str,
    output: str | Path,
    options: CompileOptions = _DEFAULTS,
    show_progress: bool = True,
    label: str = "",
) -> Path:
    """Compile ``model`` (Hugging Face directory or GGUF file) for ``target`` into the artifact
    ``output`` as ``options`` ask (``CompileOptions``, all checked before the model is read);
    ``label`` starts each progress line.

    Everything is written into a sibling temporary directory that is renamed at the end, so
    a failure or an interrupt never leaves a half-written artifact behind.
    """
    out = Path(output)
    if out.exists():
        raise CompileError(f"output path {out} already exists")
    options = options.validate(target)
    tvm_target = options.tvm_target(target)
    progress = Progress(show_progress, label)

    with progress.stage(f"reading {model}"):
        source = load_source(model)
        if options.num_layers is not None:
            source = first_layers(source, options.num_layers)
        try:
            cfg = ModelConfig.from_hf(source.config, options.dtype)
        except ConfigError as err:
            raise CompileError(f"{model}: {err}") from None
        if options.lm_head_vocab is not None:
            source, cfg = head_vocab(source, cfg, options.lm_head_vocab)
        sampling = sampling_defaults(source.sampling, source.source_hash)
    if options.attention == "flashinfer":
        flashinfer.check_supported(cfg, options.cuda_arch)
    options = options.with_source_defaults(source, tvm_target)
    int8 = options.activations == "int8"
    if target == "llvm":
        kv_cache = CPUKVCache(cfg, options.kv_cache_dtype)
    else:
        kv_cache = TVMKVCache(options.attention)
    module = MODEL_CLASSES[cfg.family](cfg, tvm_target, kv_cache)
    module.to(cfg.dtype)
    weights = quantizable_weights(module)
    plan = plan_quantization(
        weights,
        source.stored_formats,
        source.stored_shapes,
        options.quantization,
        float_panels=target == "llvm",
        int8_formats=int8,
    )
    if options.lm_head is not None:
        plan = requantize_lm_head(plan, weights, options.lm_head, int8_formats=int8)
    if int8 and not any(how.fmt for how in plan.values()):
        raise CompileError(
            f"--activations int8 applies to quantized weights; --quantization "
            f"{options.quantization} leaves this model with none"
        )
    module = quantize_layers(module, layer_layouts(plan), Int8Matmul(tvm_target) if int8 else None)

    with staged(out) as staging:
        _write_artifact(
            staging,
            Path(model),
            source,
            module,
            cfg,
            target,
            tvm_target,
            options,
            plan,
            sampling,
            progress,
        )
    progress.write(f"wrote {out}")
    return out


def _write_artifact(
    staging: Path,
    model_path: Path,
    source: ModelSource,
    module: LlamaForCausalLM,
    cfg: ModelConfig,
    target: str,
    tvm_target: tvm.target.Target,
    options: CompileOptions,
    plan: dict[str, Quantize],
    sampling: dict,
    progress: Progress,
) -> None:
    """Everything of the artifact into ``staging``; ``options`` have every default filled in;
    ``sampling``: the settings requests that set none use."""
    with ExitStack() as kernels:
        if options.attention == "flashinfer":
            kernels.enter_context(progress.stage("building FlashInfer kernels (cached on disk)"))
            kernels.enter_context(flashinfer.jit_build(options.cuda_arch))
        ir_module, named_params = module.export_tvm(spec=module.get_default_spec())
    sampler_module = attach_sampler(tvm.IRModule(), cfg.vocab_size, cpu=target == "llvm")
    link_options = None
    if module.extern_mods:
        ir_module = ir_module.with_attr("external_mods", module.extern_mods)
        link_options = flashinfer.link_options()
    expected = [(name, tuple(int(d) for d in p.shape)) for name, p in named_params]

    # The weights convert and the tokenizer is written on a thread of their own (numpy, mostly
    # outside the GIL) while TVM compiles, which keeps one core busy: Qwen2.5-Coder-1.5B's
    # compile 52 -> 41 s on 2 cores.
    stop = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        converting = pool.submit(
            _weights_and_tokenizer, staging, expected, source, cfg, plan, progress, stop
        )
        try:
            with progress.stage(f"compiling for {target}"):
                noalias = options.activations != "int8"
                _build(
                    staging,
                    ir_module,
                    sampler_module,
                    link_options,
                    target,
                    tvm_target,
                    cfg.dtype,
                    noalias,
                )
        except BaseException:
            stop.set()  # a failed or interrupted compile does not wait for the weights
            raise
        records = converting.result()

    with progress.stage("writing config"):
        config = {
            "format_version": FORMAT_VERSION,
            "model": cfg.to_dict(),
            "target": target,
            "target_spec": str(tvm_target),
            "cpu_features": vector_features(tvm_target),
            "attention": options.attention,
            "kv_cache": module.kv_cache.name,
            "kv_cache_dtype": options.kv_cache_dtype,
            "tvm_version": tvm.__version__,
            "functions": list(functions(module.kv_cache.name)),
            "sampler_functions": list(sampler_functions(module.kv_cache.name)),
            "quantization": options.quantization,
            "activations": options.activations,
            "params": [r.to_json() for r in records],
            "bos_token_id": source.config.get("bos_token_id"),
            "eos_token_ids": _as_list(source.config.get("eos_token_id")),
            "sampling_defaults": sampling,
            "source": {"path": str(model_path.resolve()), "sha256": source.source_hash},
        }
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def _weights_and_tokenizer(
    staging: Path,
    expected: list[tuple[str, tuple[int, ...]]],
    source: ModelSource,
    cfg: ModelConfig,
    plan: dict[str, Quantize],
    progress: Progress,
    stop: threading.Event,
) -> list[ParamRecord] | None:
    """The weights in the artifact's layout and the tokenizer's files, written to ``staging``;
    the weights' records (None where ``stop`` was set first)."""
    with progress.stage("converting weights"):
        params = {}
        for name, array in convert_parameters(
            expected, source, cfg.dtype, cfg.tie_word_embeddings, plan, progress.count
        ):
            if stop.is_set():
                return None
            params[name] = array
        safetensors.numpy.save_file(params, str(staging / WEIGHTS_FILE))
    if stop.is_set():
        return None
    with progress.stage("writing tokenizer"):
        source.save_tokenizer(staging)
    return [_record(name, array, plan) for name, array in params.items()]


def _build(
    staging: Path,
    ir_module: tvm.IRModule,
    sampler_module: tvm.IRModule,
    link_options: list[str] | None,
    target: str,
    tvm_target: tvm.target.Target,
    dtype: str,
    noalias: bool,
) -> None:
    """The model's and the sampler's libraries, into ``staging``."""
    try:
        executable = tvm.compile(
            ir_module,
            target=tvm_target,
            relax_pipeline=relax_pipeline(tvm_target, dtype, noalias=noalias),
        )
        executable.export_library(str(staging / LIBRARY_FILE), options=link_options)
        # Its own library, always noalias (runtime/artifact.py says why).
        sampler = tvm.compile(
            sampler_module,
            target=tvm_target,
            relax_pipeline=relax_pipeline(tvm_target, dtype, unroll=False),
        )
        sampler.export_library(str(staging / SAMPLER_LIBRARY_FILE))
    except Exception as err:  # noqa: BLE001 - TVM raises many types
        if (signalled := interrupted()) is not None:
            raise signalled from None  # Ctrl-C or SIGTERM, which TVM made a RuntimeError
        last = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise CompileError(f"TVM failed to compile for {target}: {last}") from None


def _record(name: str, array: np.ndarray, plan: dict[str, Quantize]) -> ParamRecord:
    weight, _, suffix = name.rpartition(".")
    dtype = str(array.dtype)
    if suffix in PANEL_SUFFIXES and weight in plan:
        fmt = plan[weight].fmt
        return ParamRecord(name, array.shape, dtype, weight, fmt.name if fmt else dtype, "panels")
    return ParamRecord(name, array.shape, dtype, name, dtype)


def _as_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]
