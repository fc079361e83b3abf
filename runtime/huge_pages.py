"""CPU tensors on transparent huge pages: the weights and the KV cache's page pool.

A decode step streams every weight once. On 4 KiB pages that is one TLB entry per 4 KiB, far
more than any TLB holds (SmolLM2 int8: ~30,000 pages a step), so the step also pays for page
walks. Linux backs an anonymous private mapping with 2 MiB pages where it is advised to
(``MADV_HUGEPAGE``; the common default of ``transparent_hugepage/enabled`` is ``madvise``, which
gives none otherwise), and TVM's allocator does not advise. What it saves is in
docs/kernels.md: nothing at one row, a few percent at four.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence

import numpy as np
import tvm.runtime
import tvm_ffi

HUGE_PAGE = 2 << 20
# TVM's kernels assume 64-byte aligned data (its allocator's alignment).
ALIGNMENT = 64


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


class HugePageArena:
    """One anonymous mapping advised for huge pages, handed out front to back as CPU tensors
    of the shapes and dtypes it was sized for. Where huge pages cannot be advised (not Linux)
    it is an ordinary mapping. Its memory is freed with the last tensor taken from it."""

    def __init__(self, shapes: Sequence[tuple[tuple[int, ...], np.dtype]]):
        sizes = [_padded(int(np.prod(shape)) * np.dtype(dtype).itemsize) for shape, dtype in shapes]
        # Private: a shared anonymous mapping is shmem, which ``shmem_enabled`` governs instead.
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        self._map = mmap.mmap(-1, max(1, sum(sizes)) + HUGE_PAGE, flags=flags)
        if hasattr(mmap, "MADV_HUGEPAGE"):  # before any page is touched
            self._map.madvise(mmap.MADV_HUGEPAGE)
        self._bytes = np.frombuffer(self._map, np.uint8)
        self._next = -self._bytes.ctypes.data % HUGE_PAGE  # from a huge page's start
        self._end = self._next + sum(sizes)

    def _take(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        if self._next + nbytes > self._end:
            raise ValueError(f"the arena has no room left for {dtype}{list(shape)}")
        piece = self._bytes[self._next : self._next + nbytes].view(dtype).reshape(shape)
        self._next += _padded(nbytes)
        return piece

    def tensor(self, array: np.ndarray) -> tvm.runtime.Tensor:
        """A CPU tensor holding a copy of ``array``."""
        piece = self._take(array.shape, array.dtype)
        piece[...] = array
        return tvm_ffi.from_dlpack(piece)

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> tvm.runtime.Tensor:
        """A CPU tensor, zero-filled (as anonymous memory comes)."""
        return tvm_ffi.from_dlpack(self._take(shape, dtype))
