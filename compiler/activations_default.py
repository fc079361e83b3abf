"""Which GGUF files get int8 activations by default: the measured verdicts, in one place.

Int8 activations (``--activations int8``) change the arithmetic, so they become the default for a
file's quantized weights (on CPUs with VNNI or AVX2) only where they were measured at least as
faithful to the float model as llama.cpp's own CPU path, which also rounds activations to 8 bits
for its quantized dot products: our int8 artifact's mean KL divergence from the F32-dequantized
model's logits no higher than llama.cpp's on the same file, text and positions (point estimates).
``scripts/bench_fidelity.py`` measures it; docs/quantization.md ("Int8 activations against
llama.cpp's fidelity") has the table these figures come from. Files never measured keep float.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Int8Fidelity:
    """One file's measurement: mean KL (nats) from the F32 model's logits, ours with int8
    activations and llama.cpp (as it runs by default) on the same positions."""

    model: str  # the name in pypi_models.MODELS, for people
    int8_kl: float
    llamacpp_kl: float

    @property
    def int8_by_default(self) -> bool:
        return self.int8_kl <= self.llamacpp_kl


# Keyed by the GGUF's sha256 (pypi_models.MODELS[...].sha256), so that the same file reached by
# a path gets the same default.
MEASURED: dict[str, Int8Fidelity] = {}


def int8_by_default(gguf_sha256: str) -> bool:
    """Whether int8 activations are this file's measured default (False if never measured)."""
    verdict = MEASURED.get(gguf_sha256)
    return verdict is not None and verdict.int8_by_default
