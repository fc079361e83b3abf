"""Reading params.safetensors a tensor at a time: every storage dtype round-trips bit for bit,
and a file that does not match the config fails with an error naming what is wrong."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import tvm
from safetensors.numpy import save_file

from mlc_spec.runtime.artifact import ArtifactError, ParamRecord
from mlc_spec.runtime.huge_pages import ALIGNMENT, HUGE_PAGE, HugePageArena
from mlc_spec.runtime.weights import load_params


def _tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "embed": rng.standard_normal((7, 5)).astype(np.float32),
        "norm": rng.standard_normal(5).astype(np.float16),
        "head": rng.standard_normal((3, 4)).astype(ml_dtypes.bfloat16),
        "w.codes": rng.integers(0, 2**32, (6, 2), dtype=np.uint32),
    }


def _records(tensors: dict[str, np.ndarray]) -> list[ParamRecord]:
    return [
        ParamRecord(name, a.shape, str(a.dtype), name.split(".")[0], str(a.dtype))
        for name, a in tensors.items()
    ]


def test_every_dtype_round_trips_in_config_order(tmp_path):
    tensors = _tensors()
    save_file(tensors, str(tmp_path / "params.safetensors"))
    records = _records(tensors)[::-1]  # the config's order, not the file's
    params = load_params(tmp_path / "params.safetensors", records, tvm.cpu())
    for record, param in zip(records, params, strict=True):
        expected = tensors[record.name]
        assert param.dtype == str(expected.dtype) and tuple(param.shape) == expected.shape
        assert param.numpy().tobytes() == expected.tobytes()


@pytest.mark.parametrize(
    "name, shape, dtype, error",
    [
        ("gone", (2,), "float32", "lacks parameter 'gone'"),
        (
            "embed",
            (5, 7),
            "float32",
            r"'embed' is float32\[7, 5\], the config says float32\[5",
        ),
        ("norm", (5,), "float32", r"'norm' is float16\[5\], the config says float32\[5\]"),
    ],
    ids=["missing", "shape", "dtype"],
)
def test_a_file_unlike_the_config_is_rejected(tmp_path, name, shape, dtype, error):
    tensors = _tensors()
    save_file(tensors, str(tmp_path / "params.safetensors"))
    records = [r for r in _records(tensors) if r.name != name]
    records.append(ParamRecord(name, shape, dtype, name, dtype))
    with pytest.raises(ArtifactError, match=error):
        load_params(tmp_path / "params.safetensors", records, tvm.cpu())


def test_truncated_and_foreign_files_are_rejected(tmp_path):
    tensors = _tensors()
    path = tmp_path / "params.safetensors"
    save_file(tensors, str(path))
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(ArtifactError, match="not a readable safetensors file"):
        load_params(path, _records(tensors), tvm.cpu())
    path.write_bytes(b"\x00" * 16)
    with pytest.raises(ArtifactError, match="not a readable safetensors file"):
        load_params(path, _records(tensors), tvm.cpu())


def test_cpu_weights_share_one_huge_page_mapping(tmp_path):
    """Without a dtype DLPack cannot carry, the CPU tensors are laid out front to back in one
    mapping from a huge page's start, each 64-byte aligned as TVM's kernels assume, bit for bit
    the stored ones; where DLPack cannot (bfloat16) each is a tensor of its own, as above."""
    tensors = {k: v for k, v in _tensors().items() if k != "head"}
    save_file(tensors, str(tmp_path / "params.safetensors"))
    records = _records(tensors)
    params = load_params(tmp_path / "params.safetensors", records, tvm.cpu())
    starts = [np.from_dlpack(p).ctypes.data for p in params]
    assert starts[0] % HUGE_PAGE == 0 and all(s % ALIGNMENT == 0 for s in starts)
    sizes = [-(-tensors[r.name].nbytes // ALIGNMENT) * ALIGNMENT for r in records]
    assert np.diff(starts).tolist() == sizes[:-1]  # one piece after another
    for record, param in zip(records, params, strict=True):
        assert param.numpy().tobytes() == tensors[record.name].tobytes()


def test_an_arena_hands_out_only_what_it_was_sized_for():
    arena = HugePageArena([((3, 5), np.float32)])
    pool = arena.empty((3, 5), np.float32)
    assert np.from_dlpack(pool).sum() == 0 and pool.dtype == "float32"
    with pytest.raises(ValueError, match="no room left"):
        arena.empty((1,), np.int8)
