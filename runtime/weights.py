"""Reading an artifact's ``params.safetensors`` into device tensors, one tensor at a time.

Plain reads, not the safetensors library: it maps the whole file, and every page a tensor copy
touches stays resident in this process until the file is closed, so loading held the weights
twice at its peak (the mapped file and the device tensors: 1.5 GiB more for
Qwen2.5-Coder-1.5B). Read into one host buffer per tensor, the file passes through the page
cache, which is not this process's memory, and the host holds at most one tensor beyond what is
already on the device. The layout read is safetensors' documented one: an 8-byte little-endian
header length, a JSON header of ``name -> {dtype, shape, data_offsets}``, then the data.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import tvm
import tvm.runtime

from .artifact import NUMPY_DTYPES, ArtifactError, ParamRecord

# safetensors' dtype names of the storage dtypes a parameter record may have.
SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "uint32": "U32"}
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit


def load_params(
    path: Path, records: Sequence[ParamRecord], device: tvm.runtime.Device
) -> list[tvm.runtime.Tensor]:
    """The parameters in the order the functions take them, each checked against its record."""
    with open(path, "rb") as f:
        header, data_start = _read_header(f, path)
        size = f.seek(0, 2)
        params = []
        for record in records:
            array = _read_tensor(f, path, header, data_start, size, record)
            params.append(tvm.runtime.tensor(array, device))
            del array  # before the next one is read
    return params


def _read_header(f: BinaryIO, path: Path) -> tuple[dict[str, Any], int]:
    """The JSON header and the file offset its data offsets count from."""
    head = f.read(8)
    (length,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
    if not 0 < length <= MAX_HEADER_BYTES:
        raise ArtifactError(f"{path} is not a safetensors file (bad header length)")
    try:
        header = json.loads(f.read(length))
    except ValueError as err:
        raise ArtifactError(f"{path} has an unreadable safetensors header: {err}") from None
    if not isinstance(header, dict):
        raise ArtifactError(f"{path} has an unreadable safetensors header")
    return header, 8 + length


def _read_tensor(
    f: BinaryIO,
    path: Path,
    header: dict[str, Any],
    data_start: int,
    size: int,
    record: ParamRecord,
) -> np.ndarray:
    entry = header.get(record.name)
    if not isinstance(entry, dict):
        raise ArtifactError(f"{path} lacks parameter {record.name!r}")
    stored = (entry.get("dtype"), list(entry.get("shape", ())))
    wanted = (SAFETENSORS_DTYPES[record.dtype], list(record.shape))
    if stored != wanted:
        raise ArtifactError(
            f"{path}: parameter {record.name!r} is {stored[0]}{stored[1]}, "
            f"the config says {record.dtype}{list(record.shape)}"
        )
    dtype = np.dtype(NUMPY_DTYPES[record.dtype])
    count = int(np.prod(record.shape, dtype=np.int64))
    offsets = entry.get("data_offsets")
    begin, end = offsets if isinstance(offsets, list) and len(offsets) == 2 else (0, -1)
    if end - begin != count * dtype.itemsize or begin < 0 or data_start + end > size:
        raise ArtifactError(f"{path}: parameter {record.name!r} has bad data offsets")
    f.seek(data_start + begin)
    return np.fromfile(f, dtype=dtype, count=count).reshape(record.shape)
