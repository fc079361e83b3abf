"""Reading an artifact's ``params.safetensors`` into device tensors, one tensor at a time.

Every tensor is read through a mapping of the file of its own. The pages a copy touches stay
resident in this process for as long as the file is mapped, so reading all tensors through one
mapping held the weights twice at the peak (the mapped file and the device tensors: 1.5 GiB
more for Qwen2.5-Coder-1.5B). Mapped and unmapped per tensor, the host holds at most one tensor
beyond what is already on the device. On the CPU the tensors are laid out in one mapping on huge
pages (``runtime/huge_pages.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import safetensors
import tvm
import tvm.runtime

from .artifact import NUMPY_DTYPES, ArtifactError, ParamRecord
from .huge_pages import HugePageArena


def load_params(
    path: Path, records: Sequence[ParamRecord], device: tvm.runtime.Device
) -> list[tvm.runtime.Tensor]:
    """The parameters in the order the functions take them, each checked against its record."""
    dtypes = [np.dtype(NUMPY_DTYPES[r.dtype]) for r in records]
    on_cpu = device.dlpack_device_type() == tvm.cpu().dlpack_device_type()
    carried = all(d.kind in "iuf" for d in dtypes)  # by DLPack (bfloat16 is CUDA's only)
    arena = None
    if on_cpu and carried:
        arena = HugePageArena([(tuple(r.shape), d) for r, d in zip(records, dtypes, strict=True)])
    try:
        with safetensors.safe_open(str(path), framework="numpy") as f:
            stored = set(f.keys())
        params = []
        for record in records:
            if record.name not in stored:
                raise ArtifactError(f"{path} lacks parameter {record.name!r}")
            with safetensors.safe_open(str(path), framework="numpy") as f:
                array = f.get_tensor(record.name)
            if array.shape != record.shape or array.dtype != NUMPY_DTYPES[record.dtype]:
                raise ArtifactError(
                    f"{path}: parameter {record.name!r} is {array.dtype}{list(array.shape)}, "
                    f"the config says {record.dtype}{list(record.shape)}"
                )
            params.append(
                tvm.runtime.tensor(array, device) if arena is None else arena.tensor(array)
            )
            del array  # before the next one is read
    except safetensors.SafetensorError as err:
        raise ArtifactError(f"{path} is not a readable safetensors file: {err}") from None
    return params
