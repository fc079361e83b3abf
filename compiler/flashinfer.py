"""FlashInfer attention kernels for ``--target cuda``, built on the compiling machine.

TVM's ``FlashInferPagedKVCache`` has ``tvm.relax.backend.cuda.flashinfer`` generate FlashInfer's
batch prefill/decode kernels for the model's head dim and dtype from the sources in
flashinfer-python and compile them with nvcc + ninja (no GPU needed); the objects are linked
into ``model.so``. :func:`jit_build` makes that work with flashinfer-python 0.7.2.post1 and
keeps the objects in a cache, so compiling the same shapes again rebuilds nothing. Within it,
FlashInfer's build specs are replaced by :class:`_CachedBuild`, which

- builds only the objects: FlashInfer's ninja file also links a ``.so`` of its own against
  ``libcuda`` (the GPU driver), which a build machine need not have, and TVM does not use it;
- returns the objects under the names ninja gives them, ``<source dir>_<stem>.cuda.o``
  (``JitSpec.get_object_paths`` in 0.7.2 leaves out the prefix);
- compiles TVM's renamed binding source from a copy written only when its content changes:
  TVM renames the exported functions by rewriting the binding source that FlashInfer
  regenerates on every call, so ninja saw it as new and recompiled it on every compile;
- gives the prefill plan function the arguments TVM passes (:func:`_with_tvm_plan_signature`);
- completes the prefill kernel sources (in such copies too) with the CTA_TILE_Q variants that
  ``batch_prefill.cu`` dispatches to but the generated sources leave out: CTA_TILE_Q=32 for
  head dims below 512, which FlashInfer's planner never picks there, but whose 12 undefined
  symbols would be left in ``model.so``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from mlc_spec.models import ModelConfig
from mlc_spec.runtime.cuda_kernels import CUDA_ARCH

from .errors import CompileError
from .pypi_models import default_cache_dir

VERSION = "0.7.2.post1"
HEAD_DIMS = (64, 128, 256)
DTYPES = ("float16", "bfloat16")
MIN_SM = 80  # FlashInfer's FA2 kernels use Ampere tensor-core instructions

# TVM's generators call these through ``flashinfer.jit`` at call time.
_GENERATORS = ("gen_customize_batch_prefill_module", "gen_customize_batch_decode_module")
# The CTA_TILE_Q cases of DISPATCH_CTA_TILE_Q (include/flashinfer/utils.cuh).
_DISPATCHED_CTA_TILES = (16, 32, 64, 128)
_INSTANCE = re.compile(r"template cudaError_t [^;]*?/\*CTA_TILE_Q=\*/(\d+)[^;]*;")
_PLAN = r"(Array<int64_t> BatchPrefillWithKVCachePlan\([^)]*?), int64_t uniform_q_len"
_PLAN_DEFINITION = re.compile(_PLAN + r" = 0\) \{")
_PLAN_DECLARATION = re.compile(_PLAN + r"\);")
_FIX = "use --attention tir"


def check_supported(cfg: ModelConfig, cuda_arch: str) -> None:
    """Reject, before anything is built, what FlashInfer's kernels cannot run."""
    if cfg.dtype not in DTYPES:
        raise CompileError(
            f"FlashInfer attention needs {' or '.join(DTYPES)}, not {cfg.dtype}; {_FIX}"
        )
    if cfg.head_dim not in HEAD_DIMS:
        raise CompileError(
            f"FlashInfer attention supports head dims {', '.join(map(str, HEAD_DIMS))}; "
            f"this model has {cfg.head_dim}; {_FIX}"
        )
    major, minor, _ = _parse_sm(cuda_arch)
    if major * 10 + minor < MIN_SM:
        raise CompileError(
            f"FlashInfer attention needs sm_{MIN_SM} or newer, not {cuda_arch}; {_FIX}"
        )


@contextlib.contextmanager
def jit_build(cuda_arch: str) -> Iterator[None]:
    """Within this context, FlashInfer kernels that TVM generates are built for ``cuda_arch``
    into the cache (``$FLASHINFER_WORKSPACE_BASE``, by default under mlc-spec's cache)."""
    jit = _import_jit(cuda_arch)
    originals = {name: getattr(jit, name) for name in _GENERATORS}
    for name, generate in originals.items():
        setattr(jit, name, _cached(generate))
    try:
        yield
    finally:
        for name, generate in originals.items():
            setattr(jit, name, generate)


def link_options() -> list[str]:
    """``export_library`` options for a library holding FlashInfer's objects: they call the CUDA
    runtime, the ``libcudart`` that TVM's CUDA runtime loads too. TVM puts options before the
    objects, where a linker defaulting to ``--as-needed`` would drop the library."""
    return [f"-L{_cuda_home() / 'lib64'}", "-Wl,--no-as-needed", "-lcudart"]


def _import_jit(cuda_arch: str) -> Any:
    """Import ``flashinfer.jit`` set up for this build. FlashInfer reads its cache directory and
    target architectures from the environment once, at import, and its CUDA toolkit from
    ``CUDA_HOME``."""
    if shutil.which("ninja") is None:
        raise CompileError(
            f"FlashInfer kernels are built with ninja, which is not on PATH "
            f"(pip install ninja); or {_FIX}"
        )
    os.environ["CUDA_HOME"] = str(_cuda_home())
    os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", str(default_cache_dir() / "flashinfer"))
    major, minor, suffix = _parse_sm(cuda_arch)
    os.environ["FLASHINFER_CUDA_ARCH_LIST"] = f"{major}.{minor}{suffix}"
    try:
        import flashinfer
        import flashinfer.jit
        from flashinfer.jit import env as jit_env
    except ImportError as err:
        raise CompileError(
            f"FlashInfer attention needs flashinfer-python=={VERSION} "
            f"(pip install 'mlc-spec[cuda]'): {err}; or {_FIX}"
        ) from None
    if flashinfer.__version__ != VERSION:
        raise CompileError(
            f"FlashInfer attention is built with flashinfer-python=={VERSION}, "
            f"found {flashinfer.__version__}; or {_FIX}"
        )
    if jit_env._get_workspace_dir_name() != jit_env.FLASHINFER_WORKSPACE_DIR:
        raise CompileError(
            "flashinfer was imported in this process before mlc-spec set its CUDA "
            "architecture (FLASHINFER_CUDA_ARCH_LIST); compile in a new process"
        )
    return flashinfer.jit


def _cuda_home() -> Path:
    """``$CUDA_HOME``, else /usr/local/cuda, else the toolkit of the ``nvcc`` on PATH (checked
    last: it may be a wrapper script outside the toolkit)."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home is None:
        nvcc = shutil.which("nvcc")
        on_path = Path(nvcc).resolve().parents[1] if nvcc else None
        home = "/usr/local/cuda" if Path("/usr/local/cuda/bin/nvcc").is_file() else on_path
    if home is None or not (Path(home) / "bin" / "nvcc").is_file():
        raise CompileError(
            f"FlashInfer kernels are built with nvcc; found no CUDA toolkit (set CUDA_HOME); "
            f"or {_FIX}"
        )
    return Path(home)


def _parse_sm(cuda_arch: str) -> tuple[int, int, str]:
    """``sm_90a`` -> (9, 0, "a")."""
    match = CUDA_ARCH.fullmatch(cuda_arch)
    if match is None:
        raise CompileError(f"cannot read CUDA architecture {cuda_arch!r}; expected e.g. sm_90")
    return int(match[1]), int(match[2]), match[3]


def _cached(generate: Callable[..., Any]) -> Callable[..., _CachedBuild]:
    @functools.wraps(generate)
    def wrapper(*args: Any, **kwargs: Any) -> _CachedBuild:
        return _CachedBuild(generate(*args, **kwargs))

    return wrapper


class _CachedBuild:
    """Stands in for FlashInfer's ``JitSpecNvcc`` in TVM's generators, which read ``sources``
    (renaming the exports in the files they list), then call ``build`` and
    ``get_object_paths``."""

    def __init__(self, spec: Any):
        self._spec = spec
        self.sources: list[Path] = spec.sources

    def build(self, verbose: bool = False) -> None:
        from filelock import FileLock

        self.sources[:] = [_source_to_compile(s) for s in self.sources]
        objects = self.get_object_paths()
        build_dir = self._spec.build_dir
        with FileLock(self._spec.lock_path):
            self._spec.write_ninja()
            result = subprocess.run(
                ["ninja", "-C", str(build_dir), "-f", str(self._spec.ninja_path)]
                + [str(o) for o in objects],
                capture_output=True,
                text=True,
            )
        if result.returncode != 0:
            log = build_dir / "build.log"
            log.write_text(result.stdout + result.stderr)
            raise CompileError(f"building FlashInfer kernels failed; see {log}")

    def get_object_paths(self) -> list[Path]:
        return [
            self._spec.build_dir
            / f"{s.parent.name}_{s.stem}{'.cuda.o' if s.suffix == '.cu' else '.o'}"
            for s in self.sources
        ]


def _with_tvm_plan_signature(text: str) -> str:
    """``text`` with the prefill plan function taking the 19 arguments that TVM 0.27's KV cache
    passes: FlashInfer 0.6.16 added a 20th, ``uniform_q_len`` (0 unless the caller knows every
    sequence brings as many new tokens), and the call failed on the GPU with "Expected 20 but
    got 19 arguments". The definition keeps it as a constant 0, the binding's declaration drops
    it."""
    text = _PLAN_DEFINITION.sub(
        r"\1) {\n  const int64_t uniform_q_len = 0;  // TVM 0.27 passes none", text
    )
    return _PLAN_DECLARATION.sub(r"\1);", text)


def _source_to_compile(source: Path) -> Path:
    """``source``, or the copy of it to compile instead: TVM's renamed binding source, and
    kernel sources completed with the CTA_TILE_Q variants they leave out. A copy is written only
    when its content changes, so that ninja does not rebuild it; its name does not end in
    ``_binding.cu``, or TVM would rename its exports again."""
    text = source.read_text()
    completed = _with_tvm_plan_signature(_with_all_cta_tiles(text))
    if completed == text and not source.name.endswith("_binding.cu"):
        return source
    copy = source.with_name(f"{source.stem}_tvm{source.suffix}")
    if not copy.is_file() or copy.read_text() != completed:
        copy.write_text(completed)
    return copy


def _with_all_cta_tiles(text: str) -> str:
    """``text`` with an instance of its kernels for each CTA_TILE_Q that the dispatch references
    and ``text`` leaves out, modelled on its instances for the smallest tile."""
    instances = list(_INSTANCE.finditer(text))
    present = {int(m[1]) for m in instances}
    missing = [tile for tile in _DISPATCHED_CTA_TILES if tile not in present]
    if not instances or not missing:
        return text
    base = min(present)
    added = [
        m[0].replace(f"/*CTA_TILE_Q=*/{base}", f"/*CTA_TILE_Q=*/{tile}")
        for tile in missing
        for m in instances
        if int(m[1]) == base
    ]
    end = instances[-1].end()
    return text[:end] + "\n\n" + "\n\n".join(added) + text[end:]
