"""Quantized weight formats: the group format, its numpy reference, and GGUF blocks mapped
into it exactly."""

from .formats import (
    GroupFormat,
    QuantizedTensor,
    concat_rows,
    dequantize,
    dequantize_rows,
    describe,
    pack_codes,
    permute_rows,
    quantize_symmetric,
    take_rows,
    to_portable,
    unpack_codes,
)
from .gguf_blocks import SUPPORTED_TYPES, UnsupportedTensorType, format_of, from_gguf

__all__ = [
    "SUPPORTED_TYPES",
    "GroupFormat",
    "QuantizedTensor",
    "UnsupportedTensorType",
    "concat_rows",
    "dequantize",
    "dequantize_rows",
    "describe",
    "format_of",
    "from_gguf",
    "pack_codes",
    "permute_rows",
    "quantize_symmetric",
    "take_rows",
    "to_portable",
    "unpack_codes",
]
