"""A CPU artifact's KV cache inside its model functions: the page pool and the forward pass's
page tables are function inputs, and each layer runs this package's kernels: RoPE
(``cpu_rope``), the append of the new K/V into their slots (``cpu_kv_append``) and attention
over the pages (``cpu_attention``). The runtime keeps the page tables (``runtime/kv_cache.py``).

Appending before attending is what lets one attention kernel serve decode, verification and
prefill alike, so that a token's rows are bit for bit the same however they were computed.
"""

from __future__ import annotations

from typing import Any

from tvm import tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from mlc_spec.models import ModelConfig

from .cpu_attention import PAGE, paged_attention
from .cpu_kv_append import append_kv
from .cpu_rope import rope_split

# The ``kv`` argument of a CPU artifact's functions, in this order (``runtime/kv_cache.py``
# builds it): the pages, then per new row its position and slot, per sequence its rows and
# pages (index pointers), the pages' ids, and per row the positions of its draft-tree path
# (index pointers; ``cpu_attention``).
KV_INPUTS = (
    "pages",
    "positions",
    "slots",
    "q_indptr",
    "page_indptr",
    "page_values",
    "path_indptr",
    "path_positions",
)


class CPUKVCache:
    """The ``models.kv_cache.ModelKVCache`` of CPU artifacts, its pages in ``kv_dtype``
    (default the model's float type): keys and values are rounded to it once, as they are
    appended, and attention reads them back into float32."""

    name = "pages"

    def __init__(self, cfg: ModelConfig, kv_dtype: str | None = None):
        self.cfg = cfg
        self.kv_dtype = kv_dtype or cfg.dtype
        h_q, h_kv, d, dtype = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.dtype,
        )
        self.shape = (h_q, h_kv, d)
        self.rope = rope_split(cfg.rope_theta, cfg.rope_scaling, h_q, h_kv, d, dtype)
        self.append = append_kv(h_kv, d, dtype, self.kv_dtype)
        self.attention = paged_attention(h_kv, h_q, d, dtype, self.kv_dtype)

    def spec(self) -> Any:
        _, h_kv, d = self.shape
        pages = (self.cfg.num_hidden_layers, "num_pages", 2, h_kv, PAGE * d)
        rows = nn.spec.Tensor(["rows"], "int32")
        indptr = nn.spec.Tensor(["batch_plus_1"], "int32")
        tensors = {
            "pages": nn.spec.Tensor(pages, self.kv_dtype),
            "positions": rows,
            "slots": rows,
            "q_indptr": indptr,
            "page_indptr": indptr,
            "page_values": nn.spec.Tensor(["nnz_pages"], "int32"),
            "path_indptr": nn.spec.Tensor(["rows_plus_1"], "int32"),
            "path_positions": nn.spec.Tensor(["nnz_path"], "int32"),
        }
        return [tensors[name] for name in KV_INPUTS]

    def bind(self, kv: Any) -> _Forward:
        return _Forward(self, dict(zip(KV_INPUTS, kv, strict=True)))


class _Forward:
    """One call's KV cache: each layer appends into the pages (in place) and attends."""

    def __init__(self, cache: CPUKVCache, tensors: dict[str, nn.Tensor]):
        self.cache = cache
        self.tensors = tensors
        self.result = tensors["pages"]  # the pages as the last layer left them

    def attention_with_fused_qkv(
        self, layer_id: int, qkv: nn.Tensor, num_qo_heads: int, sm_scale: float
    ) -> nn.Tensor:
        h_q, h_kv, d = self.cache.shape
        assert num_qo_heads == h_q and sm_scale == d**-0.5, "the kernels are built for the model"
        b, s = qkv.shape[0], qkv.shape[1]
        t = self.tensors
        fused = op.reshape(qkv, (b * s, h_q + 2 * h_kv, d))
        dtype = self.cache.cfg.dtype
        q, k, v = op.tensor_ir_op(
            self.cache.rope,
            "rope_split_cpu",
            [fused, t["positions"]],
            [
                nn.Tensor.placeholder((b * s, h_q, d), dtype),
                nn.Tensor.placeholder((b * s, h_kv, d), dtype),
                nn.Tensor.placeholder((b * s, h_kv, d), dtype),
            ],
        )
        layer = tirx.IntImm("int64", layer_id)
        self.result = op.tensor_ir_inplace_op(
            self.cache.append,
            "kv_append_cpu",
            [self.result, k, v, t["slots"], layer],
            0,
            nn.Tensor.placeholder(self.result.shape, self.cache.kv_dtype),
        )
        out = op.tensor_ir_op(
            self.cache.attention,
            "paged_attention_cpu",
            [
                q,
                self.result,
                *(t[name] for name in ("q_indptr", "page_indptr", "page_values", "positions")),
                t["path_indptr"],
                t["path_positions"],
                layer,
            ],
            nn.Tensor.placeholder((b * s, h_q, d), dtype),
        )
        return op.reshape(out, (b, s, h_q, d))
