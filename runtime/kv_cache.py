"""The paged KV cache of one loaded model, through TVM's runtime builtins."""

from __future__ import annotations

from collections.abc import Sequence

import tvm
import tvm_ffi

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


class PagedKVCache:
    """Sequences are identified by integer ids chosen by the caller; a forward pass over a
    set of sequences is bracketed by ``begin_forward``/``end_forward`` (see ``Model``)."""

    def __init__(self, handle: object, page_size: int, max_total_len: int):
        self.handle = handle
        self.page_size = page_size
        self.total_pages = -(-max_total_len // page_size)
        self._f = {name: tvm.get_global_func("vm.builtin." + name) for name in _BUILTINS}

    def add_sequence(self, seq_id: int) -> None:
        self._f["kv_state_add_sequence"](self.handle, seq_id)

    def remove_sequence(self, seq_id: int) -> None:
        self._f["kv_state_remove_sequence"](self.handle, seq_id)

    def fork_sequence(self, parent: int, child: int, fork_pos: int = -1) -> None:
        """``child`` shares ``parent``'s first ``fork_pos`` tokens (all with -1) copy-on-write."""
        self._f["kv_state_fork_sequence"](self.handle, parent, child, fork_pos)

    def popn(self, seq_id: int, n: int) -> None:
        """Drop the last ``n`` tokens of a sequence (rejected drafts)."""
        if n:
            self._f["kv_state_popn"](self.handle, seq_id, n)

    def sequence_length(self, seq_id: int) -> int:
        return int(self._f["attention_kv_cache_get_sequence_length"](self.handle, seq_id))

    def available_pages(self) -> int:
        return int(self._f["attention_kv_cache_get_num_available_pages"](self.handle))

    def begin_forward(self, seq_ids: Sequence[int], lengths: Sequence[int]) -> None:
        self._f["kv_state_begin_forward"](
            self.handle,
            tvm_ffi.Shape([int(s) for s in seq_ids]),
            tvm_ffi.Shape([int(n) for n in lengths]),
        )

    def end_forward(self) -> None:
        self._f["kv_state_end_forward"](self.handle)
