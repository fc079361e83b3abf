"""A compiled model loaded from its artifact: VM functions, weights, KV-cache factory.

Imports only TVM's runtime, so it runs where the compiler is not installed (a GPU machine
with the runtime-only TVM).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import tvm
import tvm.runtime
import tvm_ffi
from tvm.runtime.vm import VirtualMachine

from . import rows
from .artifact import (
    LIBRARY_FILE,
    SAMPLER_LIBRARY_FILE,
    WEIGHTS_FILE,
    ArtifactError,
    missing_cpu_features,
    read_config,
)
from .cuda_kernels import cuda_device
from .huge_pages import HugePageArena
from .kv_cache import PagedKVCache, PagePool, TVMKVCache, host_tensor
from .sampler import Sampler
from .weights import load_params

# TVM 0.27's paged-KV kernels (append, copy, attention) are generated for 16-token pages.
PAGE_SIZE = 16


def _device(config: dict) -> tvm.runtime.Device:
    target = config["target"]
    if target == "llvm":
        missing = missing_cpu_features(config.get("cpu_features", []))
        if missing:
            raise ArtifactError(
                f"this artifact was compiled for a CPU with {', '.join(missing)}, which this CPU "
                "lacks; compile it here, or with --cpu x86-64-v3 for a portable build"
            )
        return tvm.cpu()
    if target == "cuda":
        return cuda_device(config["target_spec"])
    raise ArtifactError(f"artifact target {target!r} is not supported by this runtime")


def release_pooled_buffers() -> None:
    """Free the buffers TVM's VMs keep for reuse (every VM in the process; buffers in use stay).

    The pooled allocator keeps each freed buffer for the next request of its rounded size and
    never lets go. Decode and verify passes have a bounded set of shapes, but prefill passes of
    arbitrary prompt lengths add a size each: a server's RSS grew 24% in 8 minutes of mixed
    prompts (scripts/soak_serve.py). Called after each prefill pass, the pool holds at most one
    prefill's buffers besides the bounded decode set, which the next step allocates again."""
    _CLEAR_POOLS()


_CLEAR_POOLS = tvm.get_global_func("vm.builtin.memory_manager.clear")


class Model:
    """One artifact, ready to run: ``prefill``/``decode``/``evaluate_multi_query`` take token
    ids per sequence and return float32 logits ``[rows, V]`` on the device, where ``sampler``
    turns them into tokens."""

    def __init__(self, artifact_dir: str | Path):
        self.path = Path(artifact_dir)
        self.config = read_config(self.path)
        self.model_config = self.config["model"]
        self.vocab_size = int(self.model_config["vocab_size"])
        self.context_length = int(self.model_config["context_length"])
        self.device = _device(self.config)
        self.vm = VirtualMachine(
            tvm.runtime.load_module(str(self.path / LIBRARY_FILE)), self.device
        )
        self.sampler_vm = VirtualMachine(
            tvm.runtime.load_module(str(self.path / SAMPLER_LIBRARY_FILE)), self.device
        )
        # Converted to a TVM array once: a Python list would be converted on every call.
        self.params = tvm_ffi.convert(
            load_params(self.path / WEIGHTS_FILE, self.config["params"], self.device)
        )
        self._fn = {name: self.vm[name] for name in self.config["functions"]}
        self.sampler = Sampler(
            {name: self.sampler_vm[name] for name in self.config["sampler_functions"]}, self.device
        )

    @property
    def verifies_trees(self) -> bool:
        """Whether its verify pass takes a draft tree: CPU artifacts' attention kernels are
        ours and do; TVM's KV cache on CUDA verifies chains only here."""
        return self.config["kv_cache"] == "pages"

    def create_kv_cache(
        self,
        max_batch_size: int,
        max_total_len: int,
        prefill_chunk_size: int,
        page_size: int = PAGE_SIZE,
        prefix_cache: bool = False,
    ) -> PagedKVCache:
        """Room for ``max_total_len`` tokens of all sequences together; TVM's KV cache object
        also takes at most ``max_batch_size`` sequences and ``prefill_chunk_size`` tokens a
        forward pass. ``prefix_cache``: keep ended sequences' pages for reuse (CPU artifacts;
        ``runtime/prefix_cache.py``)."""
        if page_size != PAGE_SIZE:
            raise ArtifactError(
                f"page size {page_size} is not supported: the paged-KV kernels are built for "
                f"{PAGE_SIZE}-token pages"
            )
        if self.config["kv_cache"] == "pages":
            m = self.model_config
            shape = (
                m["num_hidden_layers"],
                -(-max_total_len // page_size),
                2,
                m["num_key_value_heads"],
                page_size * m["head_dim"],
            )
            dtype = np.dtype(self.config["kv_cache_dtype"])
            pages = HugePageArena([(shape, dtype)]).empty(shape, dtype)
            return PagePool(pages, page_size, prefix_cache)
        shape = tvm_ffi.Shape
        handle = self._fn["create_paged_kv_cache"](
            shape([max_batch_size]),
            shape([max_total_len]),
            shape([prefill_chunk_size]),
            shape([page_size]),
            shape([0]),
        )
        return TVMKVCache(handle, page_size)

    def _ids(self, flat: np.ndarray, shape: tuple[int, ...]) -> tvm.runtime.Tensor:
        ids = np.asarray(flat, dtype=np.int32).reshape(shape)
        if self.config["target"] == "llvm":
            return host_tensor(ids)
        return tvm.runtime.tensor(ids, self.device)

    def _run(
        self, name: str, kv: PagedKVCache, seq_ids, lengths, *inputs, trees=None
    ) -> tvm.runtime.Tensor:
        with kv.forward(seq_ids, lengths, trees) as kv_arg:
            out = self._fn[name](*inputs, kv_arg, self.params)
        return rows.matrix(out[0])

    def prefill(
        self, kv: PagedKVCache, seq_ids: Sequence[int], tokens: Sequence[Sequence[int]]
    ) -> tvm.runtime.Tensor:
        """Append each sequence's new tokens; logits of each sequence's last token [b, V]."""
        lengths = [len(t) for t in tokens]
        flat = np.concatenate([np.asarray(t, dtype=np.int32) for t in tokens])
        last = np.cumsum(lengths) - 1
        return self._run(
            "prefill",
            kv,
            seq_ids,
            lengths,
            self._ids(flat, (1, len(flat))),
            self._ids(last, (len(last),)),
        )

    def prefill_chunked(
        self,
        kv: PagedKVCache,
        seq_ids: Sequence[int],
        tokens: Sequence[Sequence[int]],
        chunk_size: int,
    ) -> tvm.runtime.Tensor:
        """``prefill`` in forward passes of at most ``chunk_size`` tokens; logits [b, V]."""
        passes = list(chunk_rounds(tokens, chunk_size))
        logits = None
        for members, chunks in passes:
            out = self.prefill(
                kv,
                [seq_ids[i] for i in members],
                [tokens[i][c] for i, c in zip(members, chunks, strict=True)],
            )
            if len(passes) == 1 and len(members) == len(seq_ids):
                return out
            logits = rows.empty(len(seq_ids), out) if logits is None else logits
            for j, (i, c) in enumerate(zip(members, chunks, strict=True)):
                if c.stop == len(tokens[i]):  # this sequence's last chunk
                    rows.put_row(out, j, logits, i)
        return logits

    def decode(
        self, kv: PagedKVCache, seq_ids: Sequence[int], tokens: Sequence[int]
    ) -> tvm.runtime.Tensor:
        """One token per sequence; logits [b, V]."""
        b = len(seq_ids)
        return self._run("decode", kv, seq_ids, [1] * b, self._ids(tokens, (b, 1)))

    def evaluate_multi_query(
        self,
        kv: PagedKVCache,
        seq_ids: Sequence[int],
        tokens: Sequence[Sequence[int]],
        trees: Sequence[tuple[int, np.ndarray] | None] | None = None,
        scored: Sequence[int] | None = None,
    ) -> tvm.runtime.Tensor:
        """Append several tokens per sequence; logits of every new token, concatenated in
        sequence order [sum(len), V]. ``trees[i]``: sequence i's new tokens are the last nodes
        of a draft tree rooted at position ``base`` with ``parents`` (``(base, parents)``,
        ``runtime/draft_tree.py``), not a run of consecutive tokens. ``scored``: only the
        tokens at these positions (of the concatenation) get logits, in this order; the others
        (a prompt chunk riding in a step's pass) only append their keys and values, through
        ``prefill``'s logit positions, so that their rows pay no LM head (a row is the same in
        either function)."""
        lengths = [len(t) for t in tokens]
        flat = np.concatenate([np.asarray(t, dtype=np.int32) for t in tokens])
        ids = self._ids(flat, (1, len(flat)))
        if scored is None:
            return self._run("evaluate_multi_query", kv, seq_ids, lengths, ids, trees=trees)
        positions = self._ids(np.asarray(scored), (len(scored),))
        return self._run("prefill", kv, seq_ids, lengths, ids, positions, trees=trees)


def chunk_rounds(
    tokens: Sequence[Sequence[int]], budget: int
) -> Iterator[tuple[list[int], list[slice]]]:
    """Split ragged token lists into forward passes of at most ``budget`` tokens, first come
    first served: yields the list indices in the pass and the slice each one contributes."""
    pos = [0] * len(tokens)
    while any(p < len(t) for p, t in zip(pos, tokens, strict=True)):
        rows, chunks, left = [], [], budget
        for i, t in enumerate(tokens):
            take = min(len(t) - pos[i], left)
            if take > 0:
                rows.append(i)
                chunks.append(slice(pos[i], pos[i] + take))
                pos[i] += take
                left -= take
        yield rows, chunks
