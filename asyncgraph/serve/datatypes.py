"""The Open Inference Protocol's tensor datatypes and the torch dtypes they stand for.

The protocol names element types with strings (FP32, INT64, ...). Only types torch can hold are
served; BYTES (strings) is refused with a message that says so rather than guessed at.
"""

from __future__ import annotations

import torch

from asyncgraph.serve.errors import ProtocolError

TORCH_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "UINT8": torch.uint8,
    "UINT16": torch.uint16,
    "UINT32": torch.uint32,
    "UINT64": torch.uint64,
    "INT8": torch.int8,
    "INT16": torch.int16,
    "INT32": torch.int32,
    "INT64": torch.int64,
    "FP16": torch.float16,
    "FP32": torch.float32,
    "FP64": torch.float64,
    "BF16": torch.bfloat16,
}

DATATYPES: dict[torch.dtype, str] = {dtype: name for name, dtype in TORCH_DTYPES.items()}

#: Python scalar types of non-tensor inputs and outputs (symbolic ints, floats, flags).
SCALAR_DATATYPES: dict[type, str] = {bool: "BOOL", int: "INT64", float: "FP64"}

INTEGER_DATATYPES = frozenset(
    {"UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64"}
)
FLOAT_DATATYPES = frozenset({"FP16", "FP32", "FP64", "BF16"})


def torch_dtype(datatype: str, where: str) -> torch.dtype:
    """The torch dtype of a protocol datatype, or a 400 naming `where`."""
    dtype = TORCH_DTYPES.get(datatype)
    if dtype is None:
        raise ProtocolError(
            f"{where}: unsupported datatype {datatype!r}; "
            f"expected one of {', '.join(TORCH_DTYPES)}"
        )
    return dtype


def datatype_of(dtype: torch.dtype) -> str:
    """The protocol datatype of a torch dtype (complex and float8 types have none)."""
    name = DATATYPES.get(dtype)
    if name is None:
        raise TypeError(f"torch dtype {dtype} has no Open Inference Protocol datatype")
    return name


def itemsize(datatype: str) -> int:
    return TORCH_DTYPES[datatype].itemsize


def integer_range(datatype: str) -> tuple[int, int]:
    """The values an integer datatype holds, checked before a JSON list becomes a tensor."""
    info = torch.iinfo(TORCH_DTYPES[datatype])
    return int(info.min), int(info.max)
