"""Read a model source (Hugging Face directory or GGUF file) into one common in-memory form.

Everything downstream sees Hugging Face parameter names and layouts in float32 and a
Hugging Face style config, whatever the source format, so the model code has one input.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import shutil
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from .errors import CompileError
from .quantization import (
    GroupFormat,
    QuantizedTensor,
    UnsupportedTensorType,
    format_of,
    from_gguf,
    permute_rows,
)
from .sampling_defaults import FIELDS as SAMPLING_FIELDS

# model_type -> the Hugging Face class name that config["architectures"] carries.
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# Tokenizer files a Hugging Face directory may carry; copied verbatim when present.
_HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)

# GGUF tensor name -> Hugging Face name ("{}" is the layer index for per-layer tensors).
_GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_TENSOR_NAME = re.compile(r"^(?:blk\.(\d+)\.)?(\w+)\.(weight|bias)$")

# safetensors dtype -> numpy dtype of the stored bytes (BF16 is widened by hand below).
_SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16}

_MISSING = object()


@dataclass
class ModelSource:
    """A model's config, weights and tokenizer as read from its source.

    ``config`` is a Hugging Face config.json-style dict (GGUF metadata mapped to the same
    fields), read by ``models.ModelConfig.from_hf``. ``tensors`` maps Hugging Face parameter names
    to float32 arrays, read or dequantized on each access. ``source_hash`` is the sha256 over
    the weight files' bytes (for a single file, that file's own sha256).
    """

    config: dict
    tensors: Mapping[str, np.ndarray]
    source_hash: str
    path: Path
    chat_template: str | None
    # As stored in the file, for ``--quantization as-source``: GGUF tensors in the group format
    # (or float32 arrays for float types), by Hugging Face name, with each one's format (None:
    # float), and its logical shape. Empty for a Hugging Face directory, whose weights are all
    # float.
    stored: Mapping[str, QuantizedTensor | np.ndarray] = dataclasses.field(default_factory=dict)
    stored_formats: dict[str, GroupFormat | None] = dataclasses.field(default_factory=dict)
    stored_shapes: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    # A GGUF's ``tokenizer.ggml.pre``: how its text is split before the merges.
    pre_tokenizer: str | None = None
    # The publisher's sampling settings where the source has them (sampling_defaults.FIELDS).
    sampling: dict[str, Any] = dataclasses.field(default_factory=dict)

    def save_tokenizer(self, out_dir: Path) -> None:
        """Write tokenizer.json, tokenizer_config.json (with the chat template inline) and
        generation_config.json, loadable offline by ``tokenizers`` and ``AutoTokenizer``."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        if self.path.is_dir():
            if not (self.path / "tokenizer.json").is_file():
                raise CompileError(f"{self.path}: no tokenizer.json")
            for name in _HF_TOKENIZER_FILES:
                if (self.path / name).is_file():
                    shutil.copyfile(self.path / name, out_dir / name)
        else:
            _save_gguf_tokenizer(self.path, self.config["model_type"], self.pre_tokenizer, out_dir)
        # The template goes inline in tokenizer_config.json (not chat_template.jinja, which
        # transformers 5 writes), where both old and new readers look for it.
        config_path = out_dir / "tokenizer_config.json"
        tok_config = _read_json(config_path) if config_path.is_file() else {}
        if self.chat_template is not None:
            tok_config["chat_template"] = self.chat_template
        config_path.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")
        generation = {k: self.config.get(k) for k in ("bos_token_id", "eos_token_id")}
        (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


class LazyTensors(Mapping[str, Any]):
    """Name -> tensor, produced on each access and never cached, so a large model is not held
    in memory twice while it is converted."""

    def __init__(self, loaders: dict[str, Callable[[], Any]]):
        self._loaders = loaders

    def __getitem__(self, name: str) -> Any:
        return self._loaders[name]()

    def __contains__(self, name: object) -> bool:
        return name in self._loaders  # Mapping's default would load the tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._loaders)

    def __len__(self) -> int:
        return len(self._loaders)


def load_source(path: str | Path) -> ModelSource:
    """Read a Hugging Face directory or a ``.gguf`` file; CompileError names what is wrong."""
    path = Path(path)
    if not path.exists():
        raise CompileError(f"model path {path} does not exist")
    if path.is_dir():
        return _load_hf_dir(path)
    if path.suffix == ".gguf":
        return _load_gguf(path)
    raise CompileError(f"{path} is neither a Hugging Face model directory nor a .gguf file")


def sha256_files(paths: Iterable[Path]) -> str:
    """Hex sha256 over the concatenated bytes of ``paths`` (a single file: its own sha256)."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def _normalise_config(config: dict) -> dict:
    """Fill in what the source format may leave out and the compiler reads before the model
    config (``models.ModelConfig.from_hf``, the one place that interprets Hugging Face config
    fields) does: the architecture from ``model_type``, and the BOS/EOS ids."""
    cfg = dict(config)
    model_type = cfg.get("model_type")
    if "architectures" not in cfg and model_type in _ARCHITECTURES:
        cfg["architectures"] = [_ARCHITECTURES[model_type]]
    cfg.setdefault("bos_token_id", None)
    cfg.setdefault("eos_token_id", None)
    return cfg


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CompileError(f"{path} is not valid JSON: {e}") from None


def _load_hf_dir(path: Path) -> ModelSource:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise CompileError(f"{path}: config.json is missing")
    config = _read_json(config_path)
    if not isinstance(config, dict):
        raise CompileError(f"{config_path} is not a JSON object")
    # generation_config.json carries the full stop list (e.g. several eos ids for chat).
    generation_path = path / "generation_config.json"
    generation = _read_json(generation_path) if generation_path.is_file() else {}
    if not isinstance(generation, dict):
        raise CompileError(f"{generation_path} is not a JSON object")
    if generation.get("eos_token_id") is not None:
        config["eos_token_id"] = generation["eos_token_id"]

    single, index_path = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        headers = {single: _read_safetensors_header(single)}
        placement = {name: single for name in headers[single][0]}
    elif index_path.is_file():
        index = _read_json(index_path)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise CompileError(f"{index_path} has no weight_map")
        placement = {name: path / shard for name, shard in weight_map.items()}
        headers = {}
        for shard in sorted(set(placement.values())):
            if not shard.is_file():
                raise CompileError(f"{index_path} refers to {shard.name}, which is missing")
            headers[shard] = _read_safetensors_header(shard)
        for name, shard in placement.items():
            if name not in headers[shard][0]:
                raise CompileError(f"{index_path}: tensor {name!r} is not in {shard.name}")
    else:
        raise CompileError(f"{path}: no model.safetensors or model.safetensors.index.json")

    maps = {shard: np.memmap(shard, dtype=np.uint8, mode="r") for shard in headers}
    loaders = {}
    for name, shard in placement.items():
        entries, data_start = headers[shard]
        loaders[name] = _safetensors_loader(maps[shard], data_start, entries[name])

    template = None
    tok_config_path = path / "tokenizer_config.json"
    if (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    elif tok_config_path.is_file():
        template = _read_json(tok_config_path).get("chat_template")
    return ModelSource(
        config=_normalise_config(config),
        tensors=LazyTensors(loaders),
        source_hash=sha256_files(sorted(headers)),
        path=path,
        chat_template=template,
        sampling={k: generation[k] for k in SAMPLING_FIELDS if generation.get(k) is not None},
    )


def _read_safetensors_header(path: Path) -> tuple[dict[str, dict], int]:
    """Parse and check a safetensors header: (tensor entries, offset of the data section).

    Read by hand rather than with ``safetensors.safe_open`` because its numpy backend cannot
    return bfloat16, the usual dtype of released checkpoints.
    """
    try:
        with open(path, "rb") as f:
            size = path.stat().st_size
            if size < 8:
                raise ValueError("shorter than the 8-byte header length")
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size - 8:
                raise ValueError(f"header length {header_len} exceeds the file size {size}")
            header = json.loads(f.read(header_len))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        header.pop("__metadata__", None)
        data_len = size - 8 - header_len
        for name, entry in header.items():
            dtype = _SAFETENSORS_DTYPES.get(entry.get("dtype"))
            if dtype is None:
                raise ValueError(f"tensor {name!r} has unsupported dtype {entry.get('dtype')}")
            begin, end = entry["data_offsets"]
            nbytes = math.prod(entry["shape"]) * np.dtype(dtype).itemsize
            if not 0 <= begin <= end <= data_len or end - begin != nbytes:
                raise ValueError(f"tensor {name!r} lies outside the file (truncated?)")
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        raise CompileError(f"corrupt safetensors file {path}: {e}") from None
    return header, 8 + header_len


def _safetensors_loader(data: np.ndarray, data_start: int, entry: dict) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        begin, end = entry["data_offsets"]
        raw = data[data_start + begin : data_start + end]
        array = raw.view(_SAFETENSORS_DTYPES[entry["dtype"]]).reshape(entry["shape"])
        if entry["dtype"] == "BF16":  # bfloat16 is the top half of a float32
            array = (array.astype(np.uint32) << 16).view(np.float32)
        return _writable_float32(array)

    return load


def _writable_float32(array: np.ndarray) -> np.ndarray:
    """A plain float32 ndarray the caller owns: a copy whenever ``array`` views the read-only
    file mapping, so callers may modify it and the mapping is not kept alive by it."""
    return np.require(np.asarray(array), np.float32, ["W"])


class _GGUFReader(gguf.GGUFReader):
    """gguf's reader, slicing a plain ndarray view of its memory map: each slice of an
    ``np.memmap`` costs microseconds of Python, and a 151,936-token vocabulary with its merges
    is over a million of them (Qwen2.5's header: 8.3 -> 2.0 s, the same fields and tensors)."""

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None):
        if type(self.data) is np.memmap:
            self.data = self.data.view(np.ndarray)
        dtype, count = np.dtype(dtype), int(count)
        array = self.data[offset : offset + dtype.itemsize * count].view(dtype)[:count]
        order = self.byte_order if override_order is None else override_order
        return array if order == "I" else array.view(dtype.newbyteorder(order))


def _load_gguf(path: Path) -> ModelSource:
    try:
        reader = _GGUFReader(path, "r")
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        raise CompileError(f"corrupt GGUF file {path}: {e}") from None
    arch = _gguf_value(reader, path, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise CompileError(
            f"{path}: unknown GGUF architecture {arch!r} (known: {', '.join(_ARCHITECTURES)})"
        )

    def meta(key: str, default: Any = _MISSING) -> Any:
        return _gguf_value(reader, path, f"{arch}.{key}", default)

    n_head = meta("attention.head_count")
    n_kv_head = meta("attention.head_count_kv", n_head)
    config = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": meta("embedding_length"),
        "num_hidden_layers": meta("block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv_head,
        "intermediate_size": meta("feed_forward_length"),
        "vocab_size": len(_gguf_field(reader, path, "tokenizer.ggml.tokens").data),
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon"),
        "rope_theta": meta("rope.freq_base", 10000.0),
        "max_position_embeddings": meta("context_length"),
        "tie_word_embeddings": "output.weight" not in {t.name for t in reader.tensors},
        "bos_token_id": _gguf_value(reader, path, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": _gguf_value(reader, path, "tokenizer.ggml.eos_token_id", None),
    }
    head_dim = meta("attention.key_length", None)
    if head_dim is not None:
        config["head_dim"] = head_dim
    scaling_type = meta("rope.scaling.type", "none")
    if scaling_type != "none":
        config["rope_scaling"] = {
            "rope_type": scaling_type,
            "factor": meta("rope.scaling.factor"),
            "original_max_position_embeddings": meta("rope.scaling.original_context_length"),
        }

    loaders, stored, formats, shapes = {}, {}, {}, {}
    for tensor in reader.tensors:
        match = _GGUF_TENSOR_NAME.match(tensor.name)
        names = _GGUF_LAYER_NAMES if match and match[1] is not None else _GGUF_GLOBAL_NAMES
        if not match or match[2] not in names:
            raise CompileError(f"{path}: unexpected GGUF tensor {tensor.name!r}")
        layer, kind, suffix = match.groups()
        prefix = names[kind] if layer is None else f"model.layers.{layer}.{names[kind]}"
        # llama.cpp permutes llama Q/K rows for its rotary layout; Qwen2 files are not permuted.
        heads = {"attn_q": n_head, "attn_k": n_kv_head}.get(kind) if arch == "llama" else None
        if heads is not None and tensor.shape[-1] % (2 * heads):
            raise CompileError(
                f"{path}: {tensor.name} has {tensor.shape[-1]} rows, not a multiple of 2 x {heads}"
            )
        name = f"{prefix}.{suffix}"
        loaders[name] = _gguf_loader(tensor, heads)
        stored[name] = _gguf_stored_loader(path, tensor, heads)
        shapes[name] = tuple(int(d) for d in reversed(tensor.shape))
        try:
            formats[name] = format_of(tensor.tensor_type)
        except UnsupportedTensorType as err:
            raise CompileError(f"{path}: {tensor.name}: {err}") from None
    return ModelSource(
        config=_normalise_config(config),
        tensors=LazyTensors(loaders),
        source_hash=sha256_files([path]),
        path=path,
        chat_template=_gguf_value(reader, path, "tokenizer.chat_template", None),
        pre_tokenizer=_gguf_value(reader, path, "tokenizer.ggml.pre", None),
        sampling={
            name: value
            for name, key in SAMPLING_FIELDS.items()
            if (value := _gguf_value(reader, path, key, None)) is not None
        },
        stored=LazyTensors(stored),
        stored_formats=formats,
        stored_shapes=shapes,
    )


def _gguf_field(reader: gguf.GGUFReader, path: Path, key: str) -> gguf.ReaderField:
    field = reader.get_field(key)
    if field is None:
        raise CompileError(f"{path}: GGUF metadata {key!r} is missing")
    return field


def _gguf_value(reader: gguf.GGUFReader, path: Path, key: str, default: Any = _MISSING) -> Any:
    """A scalar metadata value; float32 values are rounded to their shortest decimal so that,
    e.g., an epsilon stored as float32 reads 1e-05 as in the original config, not 9.99e-06."""
    if default is not _MISSING and reader.get_field(key) is None:
        return default
    field = _gguf_field(reader, path, key)
    value = field.contents()
    if field.types == [gguf.GGUFValueType.FLOAT32]:
        value = float(str(np.float32(value)))
    return value


def _gguf_loader(tensor: gguf.ReaderTensor, heads: int | None) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        # GGUF data is already in numpy (row-major) order: (out_features, in_features).
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if heads is not None:
            array = _unpermute_rows(array, heads)
        return _writable_float32(array)

    return load


def _gguf_stored_loader(
    path: Path, tensor: gguf.ReaderTensor, heads: int | None
) -> Callable[[], QuantizedTensor | np.ndarray]:
    def load() -> QuantizedTensor | np.ndarray:
        try:
            stored = from_gguf(tensor.data, tensor.tensor_type, tuple(reversed(tensor.shape)))
        except ValueError as err:  # a truncated or malformed block buffer
            raise CompileError(f"{path}: {tensor.name}: {err}") from None
        if heads is None:
            return stored
        if isinstance(stored, QuantizedTensor):
            rows = _unpermute_rows(np.arange(stored.shape[0]), heads)
            return permute_rows(stored, rows)
        return _writable_float32(_unpermute_rows(stored, heads))

    return load


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp convert's ``permute(w, n_head)``: within each head, rows are
    stored interleaved (pairs of rotary halves); Hugging Face keeps the two halves apart."""
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _save_gguf_tokenizer(path: Path, model_type: str, pre: str | None, out_dir: Path) -> None:
    """The tokenizer ``AutoTokenizer`` would build from the file, by the class it would pick
    for ``model_type`` (a GGUF's config names none): AutoTokenizer first reads the whole file's
    config with gguf's slow reader, 10 of Qwen2.5's 12 s."""
    # transformers is slow to import and only needed here
    from transformers import TokenizersBackend
    from transformers.models.auto.tokenization_auto import (
        TOKENIZER_MAPPING_NAMES,
        tokenizer_class_from_name,
    )

    name = TOKENIZER_MAPPING_NAMES.get(model_type)
    cls = tokenizer_class_from_name(name) if name else TokenizersBackend
    try:
        tokenizer = cls.from_pretrained(path.parent, gguf_file=path.name)
    except (OSError, ValueError, KeyError) as e:
        raise CompileError(f"cannot read the tokenizer from {path}: {e}") from None
    if pre in _PRE_TOKENIZERS:
        tokenizer.backend_tokenizer.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    tokenizer.save_pretrained(out_dir)


def _smollm_pre_tokenizer():
    """SmolLM's: every digit apart, then GPT-2's byte-level split, as its own tokenizer.json
    and llama.cpp (``LLAMA_VOCAB_PRE_TYPE_SMOLLM``) split text."""
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


# GGUF pre-tokenizers (``tokenizer.ggml.pre``) that transformers rebuilds as a plain byte-level
# split, which merges digits these vocabularies were trained to see one by one.
_PRE_TOKENIZERS = {"smollm": _smollm_pre_tokenizer}
