"""Running compiled artifacts (imports TVM's runtime only, never its compiler)."""

from __future__ import annotations

import sys


def _import_tvm_without_torch() -> None:
    """Import TVM before any runtime module does, keeping torch out of this process.

    ``tvm_ffi`` imports torch whenever it is installed (for conversions of torch tensors and
    dtypes, and a workaround for a symbol conflict on Windows), about 0.3 GiB of resident memory
    that running an artifact never uses; TVM offers no switch for it. While TVM is imported,
    ``sys.modules["torch"] = None`` makes that optional import fail as if torch were not
    installed; afterwards torch imports as usual for a caller who wants it (only TVM's own torch
    conversions stay off). A process that imported torch or TVM first is left as it is.
    """
    if "torch" in sys.modules or "tvm_ffi" in sys.modules:
        return
    sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        import tvm.runtime  # noqa: F401
    finally:
        if "torch" in sys.modules and sys.modules["torch"] is None:
            del sys.modules["torch"]


_import_tvm_without_torch()
