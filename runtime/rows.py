"""Rows of device matrices ``[N, V]`` (logits, probabilities): picked, placed and fetched
without a round trip through the host. Compiled functions take whole tensors only, so a row
range is a view copied into a tensor of its own."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import tvm
import tvm.runtime
import tvm_ffi

_reshape = tvm.get_global_func("vm.builtin.reshape")


def matrix(tensor: tvm.runtime.Tensor) -> tvm.runtime.Tensor:
    """``tensor`` ``[..., V]`` as ``[N, V]``, sharing its memory."""
    shape = tuple(tensor.shape)
    return _reshape(tensor, tvm_ffi.Shape([int(np.prod(shape[:-1])), shape[-1]]))


def _view(tensor: tvm.runtime.Tensor, start: int, stop: int) -> tvm.runtime.Tensor:
    n, v = tensor.shape
    row_bytes = v * np.dtype(tensor.dtype).itemsize
    return tensor._create_view((stop - start, v), relative_byte_offset=start * row_bytes)


def empty(num_rows: int, like: tvm.runtime.Tensor) -> tvm.runtime.Tensor:
    """An uninitialised ``[num_rows, V]`` tensor on ``like``'s device."""
    return tvm.runtime.empty((num_rows, like.shape[1]), like.dtype, like.device)


def put(src: tvm.runtime.Tensor, dst: tvm.runtime.Tensor, start: int) -> None:
    """Copy all of ``src`` into ``dst``'s rows from ``start``."""
    src.copyto(_view(dst, start, start + src.shape[0]))


def put_row(src: tvm.runtime.Tensor, row: int, dst: tvm.runtime.Tensor, to: int) -> None:
    _view(src, row, row + 1).copyto(_view(dst, to, to + 1))


def take(tensor: tvm.runtime.Tensor, rows: Sequence[int]) -> tvm.runtime.Tensor:
    """``tensor[rows]`` as a tensor of its own (``tensor`` itself when ``rows`` is all of it)."""
    if list(rows) == list(range(tensor.shape[0])):
        return tensor
    out = empty(len(rows), tensor)
    for i, row in enumerate(rows):
        put_row(tensor, row, out, i)
    return out


@dataclasses.dataclass(frozen=True)
class Rows:
    """Rows ``start:stop`` of a device matrix, copied to the host only when read
    (``np.asarray``): the logits of the requests that ask for log-probabilities."""

    tensor: tvm.runtime.Tensor
    start: int
    stop: int

    def __getitem__(self, index: slice) -> Rows:
        start, stop, step = index.indices(self.stop - self.start)
        if step != 1:
            raise ValueError("device rows are sliced contiguously")
        return Rows(self.tensor, self.start + start, self.start + max(start, stop))

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        if self.stop == self.start:
            rows = np.empty((0, self.tensor.shape[1]), self.tensor.dtype)
        else:
            rows = _view(self.tensor, self.start, self.stop).numpy()
        return rows if dtype is None else rows.astype(dtype)
