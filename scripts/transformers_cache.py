"""A transformers model's KV cache, passed under the name the installed version takes it by."""

from __future__ import annotations

import inspect
from typing import Any


def cache_argument(model: Any, cache: Any) -> dict[str, Any]:
    """``{name: cache}`` for ``model``'s forward: transformers 5.24 renamed its
    ``past_key_values`` to ``cache``, and drops the old name in 5.40."""
    taken = inspect.signature(model.forward).parameters
    return {"cache" if "cache" in taken else "past_key_values": cache}
