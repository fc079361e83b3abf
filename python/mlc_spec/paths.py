"""Where mlc-spec keeps what it downloads and builds. One rule for the compiler's models and
artifacts, the benchmark scripts' llama.cpp build and ``bench serve``'s llama-server, none of
which may import the others (the server side never imports the compiler)."""

from __future__ import annotations

import os
from pathlib import Path

# The llama-cpp-python sdist whose vendored llama.cpp scripts/llamacpp.py builds: the reference
# a CPU user would pick, pinned so that every figure names one llama.cpp.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"


def cache_dir() -> Path:
    """``$MLC_SPEC_CACHE``, else ``~/.cache/mlc-spec``."""
    env = os.environ.get("MLC_SPEC_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "mlc-spec"


def llama_cpp_dir() -> Path:
    """scripts/llamacpp.py's build of llama.cpp; its binaries are under ``build/bin``."""
    return cache_dir() / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}"
