"""The paged KV cache of one loaded model.

Sequences are identified by integer ids chosen by the caller; ``Model`` runs each forward pass
inside ``forward(seq_ids, lengths)``, which yields the ``kv`` argument of the model functions.
Two kinds, as the artifact says (``runtime/artifact.py``):

* ``PagePool`` (CPU artifacts): the pages are one tensor that the functions take, and this
  class keeps the page tables. Each forward pass gets, per new token, its position and the slot
  its K/V goes to, and per sequence its pages; the model appends before it attends, so every
  row is computed the same way (``compiler/cpu_kv_cache.py``).
* ``TVMKVCache`` (CUDA artifacts): TVM's KV cache object, made by the artifact, through TVM's
  runtime builtins.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import tvm
import tvm.runtime
import tvm_ffi

from mlc_spec.errors import UserError

from .draft_tree import tree_paths
from .prefix_cache import PrefixCache


class KVCacheFull(UserError):
    """A forward pass needs more pages than are free (the engine plans to avoid it)."""


class PagedKVCache(Protocol):
    page_size: int

    def add_sequence(self, seq_id: int) -> None: ...

    def add_sequence_with_prefix(self, seq_id: int, tokens: Sequence[int]) -> int:
        """Add ``seq_id`` holding the K/V of the longest cached prefix of ``tokens`` that leaves
        its last token to compute (automatic prefix caching); returns that prefix's length."""
        ...

    def cache_prefix(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Keep the K/V that ``seq_id`` holds for ``tokens`` (its first positions) for later
        sequences starting with them."""
        ...

    def remove_sequence(self, seq_id: int) -> None: ...

    def fork_sequence(self, parent: int, child: int, fork_pos: int = -1) -> None:
        """``child`` shares ``parent``'s first ``fork_pos`` tokens (all with -1)."""
        ...

    def copy_sequence(self, parent: int, child: int) -> bool:
        """Add ``child`` holding a copy of ``parent``'s K/V in pages of its own, for timing
        passes over many sequences' contexts without prefilling each; False (nothing added)
        where the cache cannot copy pages."""
        ...

    def repeat_sequence(self, seq_id: int, length: int) -> bool:
        """Grow ``seq_id`` to ``length`` tokens whose K/V repeat its whole pages in turn, in
        pages of its own (the tokens past its last whole page become copies too), for timing
        passes over a long context without prefilling it: attention reads as many keys
        whatever they hold. False (nothing changed) where the cache cannot copy pages or the
        sequence holds no whole page."""
        ...

    def popn(self, seq_id: int, n: int) -> None:
        """Drop the last ``n`` tokens of a sequence (rejected drafts)."""
        ...

    def sequence_length(self, seq_id: int) -> int: ...

    def available_pages(self) -> int: ...

    def forward(
        self,
        seq_ids: Sequence[int],
        lengths: Sequence[int],
        trees: Sequence[tuple[int, np.ndarray] | None] | None = None,
    ) -> Any:
        """A context manager: append ``lengths[i]`` tokens to each sequence; yields the model
        functions' ``kv`` argument. ``trees[i]``, where given, is ``(base, parents)``: sequence
        i's tokens from position ``base`` on, the new ones last, form a draft tree with these
        parents (``runtime/draft_tree.py``); each new token attends to the sequence before
        ``base`` and to its own path, at the position its depth gives."""
        ...

    def keep(self, seq_id: int, start: int, kept: Sequence[int]) -> None:
        """Of the tokens from position ``start`` on (a tree's block), keep those at offsets
        ``kept`` (increasing), moved to ``start``, ``start + 1``, ...; drop the rest."""
        ...


def _aligned(values: np.ndarray) -> np.ndarray:
    """A copy of ``values`` whose data is aligned to 64 bytes, as TVM's kernels assume."""
    raw = np.empty(values.nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64
    aligned = raw[start : start + values.nbytes].view(values.dtype).reshape(values.shape)
    aligned[...] = values
    return aligned


def host_tensor(array: np.ndarray) -> tvm.runtime.Tensor:
    """A CPU tensor of a copy of ``array``: 1 us, where ``tvm.runtime.tensor`` takes 25."""
    return tvm_ffi.from_dlpack(_aligned(np.asarray(array)))


class _HostTables:
    """int32 CPU tensors of lists of ints, written into one aligned scratch array that is reused
    from forward pass to forward pass (each list 64-byte aligned): a decode step's page tables
    take ~6 us this way, a new array per list ~15 us."""

    def __init__(self):
        self._scratch = _aligned(np.zeros(1024, np.int32))

    def tensors(self, lists: Sequence[list[int]]) -> list[tvm.runtime.Tensor]:
        flat: list[int] = []
        starts = []
        for values in lists:
            starts.append(len(flat))
            flat += values
            flat += [0] * (-len(values) % 16)
        if len(flat) > len(self._scratch):
            self._scratch = _aligned(np.zeros(2 * len(flat), np.int32))
        self._scratch[: len(flat)] = flat
        return [
            tvm_ffi.from_dlpack(self._scratch[at : at + len(values)])
            for values, at in zip(lists, starts, strict=True)
        ]


@dataclass
class _Sequence:
    pages: list[int] = field(default_factory=list)
    length: int = 0


class PagePool:
    """Pages of ``page_size`` tokens in ``pages`` [layers, num_pages, 2, kv heads, page_size x
    head size] (layout: ``compiler/cpu_attention.page_layout``), shared copy-on-write between
    forked sequences (a reference count per page), and with ``prefix_cache`` kept for later
    sequences (``runtime/prefix_cache.py``) until their pages are needed."""

    def __init__(self, pages: tvm.runtime.Tensor, page_size: int, prefix_cache: bool = False):
        self.pages = pages
        self.page_size = page_size
        self._view = np.from_dlpack(pages)  # for copying a shared page before it is written
        num_pages = pages.shape[1]
        self._free = list(range(num_pages - 1, -1, -1))
        self._refs = np.zeros(num_pages, np.int32)
        self._seqs: dict[int, _Sequence] = {}
        self._tables = _HostTables()  # valid for one forward pass at a time
        self.prefix = PrefixCache(page_size) if prefix_cache else None

    def add_sequence(self, seq_id: int) -> None:
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} is already in the KV cache")
        self._seqs[seq_id] = _Sequence()

    def add_sequence_with_prefix(self, seq_id: int, tokens: Sequence[int]) -> int:
        self.add_sequence(seq_id)
        if self.prefix is None:
            return 0
        shared = self.prefix.match(tokens[: len(tokens) - 1])
        self._refs[shared] += 1
        self._seqs[seq_id] = _Sequence(shared, len(shared) * self.page_size)
        return self._seqs[seq_id].length

    def cache_prefix(self, seq_id: int, tokens: Sequence[int]) -> None:
        if self.prefix is None:
            return
        seq = self._seq(seq_id)
        whole = min(len(tokens), seq.length) // self.page_size
        added = self.prefix.store(tokens[: whole * self.page_size], seq.pages[:whole])
        self._refs[added] += 1

    def remove_sequence(self, seq_id: int) -> None:
        self._release(self._seq(seq_id).pages)
        del self._seqs[seq_id]

    def fork_sequence(self, parent: int, child: int, fork_pos: int = -1) -> None:
        source = self._seq(parent)
        length = source.length if fork_pos == -1 else fork_pos
        if not 0 <= length <= source.length:
            raise ValueError(f"fork position {fork_pos} outside sequence {parent}")
        self.add_sequence(child)
        shared = source.pages[: -(-length // self.page_size)]
        self._refs[shared] += 1
        self._seqs[child] = _Sequence(list(shared), length)

    def copy_sequence(self, parent: int, child: int) -> bool:
        source = self._seq(parent)
        self.add_sequence(child)
        copy = self._seqs[child]
        self._reserve(copy, source.length)
        self._view[:, copy.pages] = self._view[:, source.pages]
        copy.length = source.length
        return True

    def repeat_sequence(self, seq_id: int, length: int) -> bool:
        seq = self._seq(seq_id)
        whole = seq.length // self.page_size
        if whole == 0:
            return False
        if length > seq.length:
            self._reserve(seq, length)
            copies = range(whole, len(seq.pages))
            self._view[:, [seq.pages[i] for i in copies]] = self._view[
                :, [seq.pages[i % whole] for i in copies]
            ]
            seq.length = length
        return True

    def popn(self, seq_id: int, n: int) -> None:
        seq = self._seq(seq_id)
        if not 0 <= n <= seq.length:
            raise ValueError(f"cannot pop {n} of sequence {seq_id}'s {seq.length} tokens")
        seq.length -= n
        keep = -(-seq.length // self.page_size)
        self._release(seq.pages[keep:])
        del seq.pages[keep:]

    def sequence_length(self, seq_id: int) -> int:
        return self._seq(seq_id).length

    def available_pages(self) -> int:
        """Free pages, and cached ones that no sequence uses (taken back when needed)."""
        cached = 0 if self.prefix is None else self.prefix.evictable(self._refs)
        return len(self._free) + cached

    @contextmanager
    def forward(
        self,
        seq_ids: Sequence[int],
        lengths: Sequence[int],
        trees: Sequence[tuple[int, np.ndarray] | None] | None = None,
    ) -> Iterator[tuple]:
        seqs = [self._seq(s) for s in seq_ids]
        trees = trees or [None] * len(seqs)
        page = self.page_size
        positions, slots, q_indptr, page_indptr, page_values = [], [], [0], [0], []
        path_indptr, path_positions = [0], []
        for seq, n, tree in zip(seqs, lengths, trees, strict=True):
            self._reserve(seq, seq.length + n)
            start = seq.length
            for position in range(start, start + n):
                slots.append(seq.pages[position // page] * page + position % page)
            if tree is None:
                positions += range(start, start + n)
                path_indptr += [path_indptr[-1]] * n
            else:
                base, parents = tree
                if len(parents) != start + n - base:
                    raise ValueError("a tree's nodes must end with the forward pass's tokens")
                for path in tree_paths(parents)[start - base :]:
                    positions.append(base + len(path) - 1)
                    # The path's first offsets that equal their depth need no mapping.
                    moved = next((t for t, at in enumerate(path) if at != t), len(path))
                    path_positions += [base + at for at in path[moved:]]
                    path_indptr.append(len(path_positions))
            q_indptr.append(q_indptr[-1] + n)
            page_values += seq.pages
            page_indptr.append(len(page_values))
        path_positions.append(0)  # never read; keeps the tensor non-empty
        parts = (positions, slots, q_indptr, page_indptr, page_values, path_indptr, path_positions)
        yield (self.pages, *self._tables.tensors(parts))
        for seq, n in zip(seqs, lengths, strict=True):
            seq.length += n

    def keep(self, seq_id: int, start: int, kept: Sequence[int]) -> None:
        seq = self._seq(seq_id)
        page = self.page_size
        layers, num_pages, _, heads, size = self._view.shape
        # keys feature-major, values slot-major (compiler/cpu_attention.page_layout)
        keys = self._view.reshape(layers, num_pages, 2, heads, size // page, page)[:, :, 0]
        values = self._view.reshape(layers, num_pages, 2, heads, page, size // page)[:, :, 1]
        for to, offset in enumerate(kept):
            if offset != to:  # offsets increase, so a source is never overwritten before use
                src, dst = start + offset, start + to
                a, b = seq.pages[src // page], seq.pages[dst // page]
                keys[:, b, :, :, dst % page] = keys[:, a, :, :, src % page]
                values[:, b, :, dst % page] = values[:, a, :, src % page]
        self.popn(seq_id, seq.length - start - len(kept))

    def _seq(self, seq_id: int) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise ValueError(f"sequence {seq_id} is not in the KV cache") from None

    def _reserve(self, seq: _Sequence, length: int) -> None:
        """Pages for ``length`` tokens, the page being written to owned by ``seq`` alone."""
        last = seq.length // self.page_size
        if last < len(seq.pages) and self._refs[seq.pages[last]] > 1:
            shared = seq.pages[last]
            seq.pages[last] = self._take()
            self._view[:, seq.pages[last]] = self._view[:, shared]
            self._release([shared])
        while len(seq.pages) * self.page_size < length:
            seq.pages.append(self._take())

    def _take(self) -> int:
        if not self._free and self.prefix is not None:
            self._release(self.prefix.evict(1, self._refs))
        if not self._free:
            raise KVCacheFull("the KV cache has no free page left")
        page = self._free.pop()
        self._refs[page] = 1
        return page

    def _release(self, pages: Sequence[int]) -> None:
        for page in pages:
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free.append(page)


_BUILTINS = (
    "kv_state_add_sequence",
    "kv_state_remove_sequence",
    "kv_state_fork_sequence",
    "kv_state_popn",
    "kv_state_begin_forward",
    "kv_state_end_forward",
    "attention_kv_cache_get_sequence_length",
    "attention_kv_cache_get_num_available_pages",
)


NO_TREES = "draft trees need a CPU artifact: a CUDA build verifies chains only"


class TVMKVCache:
    """TVM's KV cache object ``handle``; a forward pass is bracketed by its
    ``begin_forward``/``end_forward``."""

    def __init__(self, handle: object, page_size: int):
        self.handle = handle
        self.page_size = page_size
        self._f = {name: tvm.get_global_func("vm.builtin." + name) for name in _BUILTINS}

    def add_sequence(self, seq_id: int) -> None:
        self._f["kv_state_add_sequence"](self.handle, seq_id)

    def add_sequence_with_prefix(self, seq_id: int, tokens: Sequence[int]) -> int:
        """No prefix cache on this path yet: TVM's cache computes a block's rows other than
        its decode rows (docs/exactness.md), so reused K/V could change an output."""
        self.add_sequence(seq_id)
        return 0

    def cache_prefix(self, seq_id: int, tokens: Sequence[int]) -> None:
        pass

    def remove_sequence(self, seq_id: int) -> None:
        self._f["kv_state_remove_sequence"](self.handle, seq_id)

    def fork_sequence(self, parent: int, child: int, fork_pos: int = -1) -> None:
        self._f["kv_state_fork_sequence"](self.handle, parent, child, fork_pos)

    def copy_sequence(self, parent: int, child: int) -> bool:
        return False  # TVM's cache only forks, sharing the pages

    def repeat_sequence(self, seq_id: int, length: int) -> bool:
        return False

    def popn(self, seq_id: int, n: int) -> None:
        if n:
            self._f["kv_state_popn"](self.handle, seq_id, n)

    def sequence_length(self, seq_id: int) -> int:
        return int(self._f["attention_kv_cache_get_sequence_length"](self.handle, seq_id))

    def available_pages(self) -> int:
        return int(self._f["attention_kv_cache_get_num_available_pages"](self.handle))

    def keep(self, seq_id: int, start: int, kept: Sequence[int]) -> None:
        if list(kept) != list(range(len(kept))):
            raise UserError(NO_TREES)
        self.popn(seq_id, self.sequence_length(seq_id) - start - len(kept))

    @contextmanager
    def forward(
        self,
        seq_ids: Sequence[int],
        lengths: Sequence[int],
        trees: Sequence[tuple[int, np.ndarray] | None] | None = None,
    ) -> Iterator[object]:
        if any(t is not None for t in trees or ()):
            raise UserError(NO_TREES)
        self._f["kv_state_begin_forward"](
            self.handle,
            tvm_ffi.Shape([int(s) for s in seq_ids]),
            tvm_ffi.Shape([int(n) for n in lengths]),
        )
        try:
            yield self.handle
        finally:
            self._f["kv_state_end_forward"](self.handle)
