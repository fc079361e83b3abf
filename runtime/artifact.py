"""The artifact format: the files ``mlc-spec compile`` writes and the runtime reads.

An artifact directory holds everything needed to run the model with TVM's runtime alone:
``model.so`` (compiled functions), ``params.safetensors`` (converted weights, in the order the
functions take them), the tokenizer files and ``mlc-spec-config.json`` describing the rest.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlc_spec.errors import UserError

CONFIG_FILE = "mlc-spec-config.json"
LIBRARY_FILE = "model.so"
WEIGHTS_FILE = "params.safetensors"
FORMAT_VERSION = 1
FUNCTIONS = ("prefill", "decode", "evaluate_multi_query", "create_paged_kv_cache")


class ArtifactError(UserError):
    """A directory that is not a usable mlc-spec artifact."""


def read_config(artifact_dir: str | Path) -> dict[str, Any]:
    """Read and sanity-check an artifact's config, with errors that name what is wrong."""
    root = Path(artifact_dir)
    path = root / CONFIG_FILE
    if not path.is_file():
        raise ArtifactError(f"{root} is not an mlc-spec artifact (no {CONFIG_FILE})")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ArtifactError(f"{path} is unreadable: {err}") from None
    if config.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(
            f"{path} has format version {config.get('format_version')}, "
            f"this mlc-spec reads {FORMAT_VERSION}"
        )
    for name in (LIBRARY_FILE, WEIGHTS_FILE):
        if not (root / name).is_file():
            raise ArtifactError(f"artifact {root} is incomplete: {name} is missing")
    return config
