"""The runtime and the server import TVM's runtime only: an artifact carries everything they
need, so they run where the compiler is not installed (the GPU machine's runtime-only TVM)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = (
    "tvm.relax",
    "tvm.tirx",
    "tvm.s_tir",
    "tvm.te",
    "tvm.script",
    "mlc_spec.compiler",
    "mlc_spec.models",
)


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names += [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.ImportFrom) and node.level >= 2:
            names.append(f"..{node.module}")  # a relative import leaving the package
    return names


@pytest.mark.parametrize("package", ["runtime", "serve"])
def test_no_compiler_imports(package):
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in _imports(path):
            assert not name.startswith(FORBIDDEN), f"{path.relative_to(ROOT)} imports {name}"
            if name.startswith(".."):  # only from a runtime subpackage up into the runtime
                assert path.parent.parent == ROOT / "runtime", (path, name)
