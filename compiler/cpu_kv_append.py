"""The KV cache's append on the CPU: each new token's keys and values into its page slot.

Every layer of every forward pass appends before it attends (``cpu_attention``), in the page
layout that kernel reads: keys feature-major, a feature's 16 slots side by side, and values
slot-major, a slot's features side by side (``cpu_attention.page_layout``).
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .cpu_attention import PAGE


def append_kv(h_kv: int, d: int, dtype: str, kv_dtype: str | None = None) -> tirx.PrimFunc:
    """k, v [tokens, h_kv, d] in ``dtype`` into ``layer``'s page slots ``slots`` (page * PAGE +
    offset) of ``pages`` [layers, num_pages, 2, h_kv, PAGE * d] in ``kv_dtype`` (default
    ``dtype``; a narrower one rounds each value to nearest even), in place."""
    kv_dtype = kv_dtype or dtype

    @T.prim_func(s_tir=True)
    def kv_append_cpu(
        var_pages: T.handle,
        var_k: T.handle,
        var_v: T.handle,
        var_slots: T.handle,
        layer: T.int64,
    ):
        T.func_attr({"tirx.is_scheduled": True, "op_pattern": 8})
        ntoken = T.int32()
        layers, num_pages = T.int64(), T.int64()
        pages = T.match_buffer(var_pages, (layers, num_pages, 2, h_kv, PAGE * d), kv_dtype)
        k = T.match_buffer(var_k, (ntoken, h_kv, d), dtype)
        v = T.match_buffer(var_v, (ntoken, h_kv, d), dtype)
        slots = T.match_buffer(var_slots, (ntoken,), "int32")
        for t in range(ntoken):
            with T.sblock("append"):
                T.reads()  # opaque: the slots depend on the map
                T.writes()
                page: T.let[T.int32] = slots[t] // PAGE
                slot: T.let[T.int32] = slots[t] % PAGE
                for h in range(h_kv):
                    for f in range(d):
                        pages[layer, page, 0, h, f * PAGE + slot] = T.Cast(kv_dtype, k[t, h, f])
                    for f in T.vectorized(d):
                        pages[layer, page, 1, h, slot * d + f] = T.Cast(kv_dtype, v[t, h, f])

    return kv_append_cpu
