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

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Int8Fidelity:
    """One file's measurement: mean KL (nats) from the F32 model's logits, ours with int8
    activations and llama.cpp (as it runs by default) on the same positions. Ours by integer
    dot instruction (``IntegerDot.instruction``): before Q4_K and Q6_K the vpmaddubsw path
    rounds activations otherwise than the vpdpbusd one (``int8_matmul.sub_scaled``), so a file
    with such tensors is measured on each; an instruction not named was not measured."""

    model: str  # the name in pypi_models.MODELS, for people
    int8_kl: Mapping[str, float]
    llamacpp_kl: float

    def int8_by_default(self, instruction: str) -> bool:
        kl = self.int8_kl.get(instruction)
        return kl is not None and kl <= self.llamacpp_kl


# Keyed by the GGUF's sha256 (pypi_models.MODELS[...].sha256), so that the same file reached by
# a path gets the same default. Figures: docs/quantization.md, "Fidelity: int8 activations
# against llama.cpp's own" (HumanEval 16 x 512 tokens, 4080 positions; llama.cpp's figure is
# what it prints, to 6 decimals). Ours round activations per 16 values; before Q4_K and Q6_K per
# weight group with vpdpbusd, per 256 with power-of-two steps per group with vpmaddubsw
# (``int8_matmul.activation_group``, ``sub_scaled``). The vpmaddubsw figures are with the KV
# cache in float16, the default with int8 activations (2026-11-29, AMD EPYC); the vpdpbusd ones
# were measured with it in float32 (Intel Xeon), which moved ours by under 4e-5 nats there.
MEASURED: dict[str, Int8Fidelity] = {
    # Q4_1 + Q8_0: llama.cpp rounds activations per 32 (Q8_1, Q8_0); both our paths compute
    # the same bits on one-level formats. Its KL: 0.001966 on the Xeon, 0.002045 on the EPYC.
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53": Int8Fidelity(
        "smollm2-135m-instruct",
        int8_kl={"vpdpbusd": 0.00108739, "vpmaddubsw": 0.00109215},
        llamacpp_kl=0.001966,
    ),
    # Mostly Q5_0 / Q8_0 (rows of 896 are no multiple of 256), which llama.cpp rounds per 32,
    # with Q4_K / Q6_K, which it rounds per 256. Its KL: 0.000313 on the Xeon that measured
    # vpdpbusd, 0.000319 on the AMD EPYC that measured vpmaddubsw.
    "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32": Int8Fidelity(
        "qwen2.5-coder-0.5b-instruct",
        int8_kl={"vpdpbusd": 0.000111425, "vpmaddubsw": 0.000136195},
        llamacpp_kl=0.000313,
    ),
    # Q4_K + Q6_K: llama.cpp rounds activations per 256 (Q8_K). Its KL: 0.000560 on the Xeon
    # that measured vpdpbusd, 0.000559 on the AMD EPYC that measured vpmaddubsw.
    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046": Int8Fidelity(
        "qwen2.5-coder-1.5b-instruct",
        int8_kl={"vpdpbusd": 0.000109965, "vpmaddubsw": 0.00017233},
        llamacpp_kl=0.000560,
    ),
}


def int8_by_default(gguf_sha256: str, instruction: str) -> bool:
    """Whether int8 activations are this file's measured default with ``instruction`` (False if
    never measured there)."""
    verdict = MEASURED.get(gguf_sha256)
    return verdict is not None and verdict.int8_by_default(instruction)
