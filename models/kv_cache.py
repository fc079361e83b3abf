"""How a model's functions reach their paged KV cache.

Each layer calls ``attention_with_fused_qkv`` on the object that ``bind`` makes of the
functions' ``kv`` argument. Two kinds exist: TVM's KV cache object (``TVMKVCache``, the CUDA
path: FlashInfer's or TVM's TIR kernels, bookkeeping in TVM's runtime), and on the CPU a page
pool with page tables passed in as tensors, whose kernels the compiler provides
(``compiler/cpu_kv_cache.py``).
"""

from __future__ import annotations

from typing import Any, Protocol

from tvm.relax.frontend import nn
from tvm.relax.frontend.nn.llm.kv_cache import (
    FlashInferPagedKVCache,
    PagedKVCache,
    TIRPagedKVCache,
)


class BoundKVCache(Protocol):
    """The KV cache of one call of a model function."""

    def attention_with_fused_qkv(
        self, layer_id: int, qkv: nn.Tensor, num_qo_heads: int, sm_scale: float
    ) -> nn.Tensor:
        """Append the new tokens' K/V (from ``qkv`` [b, s, h_q + 2 h_kv, d], RoPE applied
        here) and attend: [b, s, h_q, d]."""
        ...

    @property
    def result(self) -> Any:
        """What the function returns beside the logits."""
        ...


class ModelKVCache(Protocol):
    """A kind of KV cache: the spec of the functions' ``kv`` argument, and the bound object."""

    name: str  # recorded in the artifact: "tvm" or "pages"

    def spec(self) -> Any: ...

    def bind(self, kv: Any) -> BoundKVCache: ...


class _TVMBound:
    def __init__(self, kv: PagedKVCache):
        self.result = kv
        self.attention_with_fused_qkv = kv.attention_with_fused_qkv


class TVMKVCache:
    """TVM's paged KV cache object with ``attention`` kernels: ``flashinfer`` or TVM's ``tir``.
    The model exports ``create_paged_kv_cache`` for it."""

    name = "tvm"
    CLASSES = {"tir": TIRPagedKVCache, "flashinfer": FlashInferPagedKVCache}

    def __init__(self, attention: str):
        self.cls = self.CLASSES[attention]

    def spec(self) -> Any:
        return nn.spec.Object(object_type=PagedKVCache)

    def bind(self, kv: PagedKVCache) -> BoundKVCache:
        return _TVMBound(kv)
