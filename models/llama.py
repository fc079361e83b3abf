"""The Llama-family decoder (Llama 2/3, Mistral, TinyLlama, SmolLM/SmolLM2; Qwen2 adds QKV bias)
written with ``tvm.relax.frontend.nn``; attention and RoPE run inside the paged KV cache
(``models/kv_cache.py``: TVM's object on CUDA, the page pool's own kernels on the CPU).

Parameter names follow Hugging Face's, except that q/k/v and gate/up projections are fused
into one matmul each (``HF_FUSED``) so a decode step reads each layer's input once.
"""

from __future__ import annotations

from tvm import relax as rx
from tvm import runtime, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache, RopeMode
from tvm.script import tirx as T
from tvm.target import Target

from .config import ModelConfig
from .kv_cache import BoundKVCache, ModelKVCache, TVMKVCache
from .quantized import QuantizedEmbedding

# Our fused parameter suffix -> the Hugging Face parameters concatenated (along the output rows).
HF_FUSED = {
    "self_attn.qkv_proj.weight": (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
    ),
    "self_attn.qkv_proj.bias": (
        "self_attn.q_proj.bias",
        "self_attn.k_proj.bias",
        "self_attn.v_proj.bias",
    ),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


def hf_sources(name: str) -> tuple[str, ...]:
    """The Hugging Face parameters that make up our parameter ``name`` (one mapping for all
    weight formats: GGUF tensors are renamed to Hugging Face names before they get here)."""
    for ours, theirs in HF_FUSED.items():
        if name.endswith(ours):
            prefix = name[: -len(ours)]
            return tuple(prefix + t for t in theirs)
    return (name,)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        self.num_q, self.num_kv, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        qkv_rows = (self.num_q + 2 * self.num_kv) * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, qkv_rows, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.num_q * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: nn.Tensor, kv: BoundKVCache, layer_id: int) -> nn.Tensor:
        b, s, _ = x.shape
        qkv = op.reshape(self.qkv_proj(x), (b, s, self.num_q + 2 * self.num_kv, self.head_dim))
        out = kv.attention_with_fused_qkv(layer_id, qkv, self.num_q, sm_scale=self.head_dim**-0.5)
        return self.o_proj(op.reshape(out, (b, s, self.num_q * self.head_dim)))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        gate, up = op.split(self.gate_up_proj(x), 2, axis=-1)
        return self.down_proj(op.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        eps = cfg.rms_norm_eps
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, -1, eps, bias=False)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, -1, eps, bias=False)

    def forward(self, x: nn.Tensor, kv: BoundKVCache, layer_id: int) -> nn.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), kv, layer_id)
        return x + self.mlp(self.post_attention_layernorm(x))


def clipped_take(x: nn.Tensor, indices: nn.Tensor, axis: int, name: str = "take") -> nn.Tensor:
    """``op.take`` with indices clipped into bounds. TVM's default mode ("fast") would read out
    of bounds on a bad index, and says so in a warning at every compile; the runtime checks
    token ids before a pass, so clipping changes no result and costs a min/max a row."""
    return op.wrap_nested(rx.op.take(x._expr, indices._expr, axis, mode="clip"), name)


class Embedding(nn.Embedding):
    """``nn.Embedding`` gathering with ``clipped_take``."""

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        if x.ndim == 1:
            return clipped_take(self.weight, x, 0)
        rows = clipped_take(self.weight, op.reshape(x, shape=[-1]), 0)
        return op.reshape(rows, shape=[*x.shape, self.weight.shape[1]])


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = nn.RMSNorm(cfg.hidden_size, -1, cfg.rms_norm_eps, bias=False)

    def forward(self, input_ids: nn.Tensor, kv: BoundKVCache) -> nn.Tensor:
        x = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, kv, i)
        return self.norm(x)


def _unscored_at_minus_inf(scored: int, vocab: int) -> tirx.PrimFunc:
    """Logits [rows, scored] -> [rows, vocab] with the ids from ``scored`` on at -inf: a kernel
    of its own (scheduled here, never fused), since no CPU schedule rule takes it fused into the
    LM head's matmul."""

    @T.prim_func(private=True, s_tir=True)
    def unscored_logits(var_x: T.handle, var_out: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "op_pattern": 8, "tirx.noalias": True})
        rows = T.int64()
        x = T.match_buffer(var_x, (rows, scored), "float32")
        out = T.match_buffer(var_out, (rows, vocab), "float32")
        for r in T.parallel(rows):
            with T.sblock("row"):
                for v in range(scored):
                    out[r, v] = x[r, v]
                for v in range(vocab - scored):
                    out[r, scored + v] = T.float32(float("-inf"))

    return unscored_logits


class LlamaForCausalLM(nn.Module):
    """Exports ``prefill``, ``decode`` and ``evaluate_multi_query`` (and, for TVM's KV cache
    object, ``create_paged_kv_cache``).

    All three forward functions run on the sequences and lengths of the KV cache's forward
    pass: TVM's ``begin_forward`` beforehand, or the page tables passed in with the pages
    (``kv_cache``, a ``models.kv_cache.ModelKVCache``); the token ids of all sequences are
    concatenated (ragged). After export, ``extern_mods`` holds the prebuilt kernel libraries
    that the compiled module must link (FlashInfer's).
    """

    def __init__(self, cfg: ModelConfig, target: Target, kv_cache: ModelKVCache):
        self.cfg = cfg
        self.target = target
        self.kv_cache = kv_cache
        self.extern_mods: list[runtime.Module] = []
        self.model = Backbone(cfg)
        if not cfg.tie_word_embeddings:
            rows = cfg.lm_head_vocab or cfg.vocab_size
            self.lm_head = nn.Linear(cfg.hidden_size, rows, bias=False)

    def _logits(self, h: nn.Tensor) -> nn.Tensor:
        embed = self.model.embed_tokens
        if self.cfg.tie_word_embeddings and isinstance(embed, QuantizedEmbedding):
            logits = embed.project(h)
        elif self.cfg.tie_word_embeddings:
            logits = op.matmul(h, op.permute_dims(embed.weight))
        else:
            logits = self.lm_head(h)
        logits = logits if logits.dtype == "float32" else logits.astype("float32")
        if self.cfg.lm_head_vocab:  # the ids the head does not score: never chosen
            scored, vocab = self.cfg.lm_head_vocab, self.cfg.vocab_size
            full = op.tensor_ir_op(
                _unscored_at_minus_inf(scored, vocab),
                "unscored_logits",
                [op.reshape(logits, (-1, scored))],
                nn.Tensor.placeholder((logits.shape[0] * logits.shape[1], vocab), "float32"),
            )
            logits = op.reshape(full, (*logits.shape[:-1], vocab))
        return logits

    def prefill(self, input_ids: nn.Tensor, logit_positions: nn.Tensor, kv):
        """New tokens of one or more sequences [1, total]; logits at ``logit_positions``
        (each sequence's last token) [1, batch, vocab]. Also continues a sequence (chunks)."""
        bound = self.kv_cache.bind(kv)
        h = clipped_take(self.model(input_ids, bound), logit_positions, axis=1)
        return self._logits(h), bound.result

    def decode(self, input_ids: nn.Tensor, kv):
        """One new token for each of a batch of sequences [batch, 1] -> [batch, 1, vocab]."""
        bound = self.kv_cache.bind(kv)
        return self._logits(self.model(input_ids, bound)), bound.result

    def evaluate_multi_query(self, input_ids: nn.Tensor, kv):
        """Several new tokens per sequence [1, total] -> logits of every token [1, total, vocab]:
        verifies drafts and recomputes the KV of preempted sequences."""
        bound = self.kv_cache.bind(kv)
        return self._logits(self.model(input_ids, bound)), bound.result

    def create_paged_kv_cache(
        self,
        max_batch_size: tirx.Var,
        max_total_seq_len: tirx.Var,
        prefill_chunk_size: tirx.Var,
        page_size: tirx.Var,
        support_sliding_window: tirx.Var,
    ) -> PagedKVCache:
        c = self.cfg
        assert isinstance(self.kv_cache, TVMKVCache), "only TVM's KV cache object is created"
        cache = self.kv_cache.cls(
            attn_kind="mha",
            max_batch_size=max_batch_size,
            max_total_seq_len=max_total_seq_len,
            prefill_chunk_size=prefill_chunk_size,
            page_size=page_size,
            support_sliding_window=support_sliding_window,
            layer_partition=rx.ShapeExpr([0, c.num_hidden_layers]),
            num_hidden_layers=c.num_hidden_layers,
            num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads,
            qk_head_dim=c.head_dim,
            v_head_dim=c.head_dim,
            mla_original_qk_head_dim=0,
            mla_original_v_head_dim=0,
            rope_mode=RopeMode.NORMAL,
            rope_scale=1,
            rope_theta=c.rope_theta,
            rope_scaling=c.rope_scaling or {},
            rope_ext_factors=rx.prim_value(0),
            rotary_dim=c.head_dim,
            enable_disaggregation=False,
            dtype=c.dtype,
            target=self.target,
        )
        self.extern_mods = getattr(cache, "extern_mods", [])
        return cache

    def get_default_spec(self) -> dict:
        kv = self.kv_cache.spec()
        packed = {"param_mode": "packed", "effect_mode": "none"}
        ids = nn.spec.Tensor([1, "total_len"], "int32")
        spec = {
            "prefill": {
                "input_ids": ids,
                "logit_positions": nn.spec.Tensor(["batch_size"], "int32"),
                "kv": kv,
                "$": packed,
            },
            "decode": {
                "input_ids": nn.spec.Tensor(["batch_size", 1], "int32"),
                "kv": kv,
                "$": packed,
            },
            "evaluate_multi_query": {"input_ids": ids, "kv": kv, "$": packed},
        }
        if isinstance(self.kv_cache, TVMKVCache):
            spec["create_paged_kv_cache"] = {
                "max_batch_size": int,
                "max_total_seq_len": int,
                "prefill_chunk_size": int,
                "page_size": int,
                "support_sliding_window": int,
                "$": {"param_mode": "none", "effect_mode": "none"},
            }
        return spec


__all__ = ["LlamaForCausalLM", "hf_sources"]
