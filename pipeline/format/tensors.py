"""What a tensor is, independent of where it lives: its dtype and shape, and the one
table of every dtype deltasync moves.

Each row holds everything a layer needs about a dtype: the name manifests and codec
containers record (torch's, without ``torch.``), the safetensors header code, the
integer view of the same width the codec works on, and the exponent field of
floating dtypes. The manifest, safetensors and codec lookups are all derived from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeline.format.dtype_names import WIDTHS

# The unsigned integer of each element width: the bits of any dtype of that width.
UNSIGNED: dict[int, type[np.unsignedinteger]] = {
    1: np.uint8,
    2: np.uint16,
    4: np.uint32,
    8: np.uint64,
}


@dataclass(frozen=True)
class TensorSpec:
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class DType:
    name: str  # stable name recorded in manifests and codec containers
    dtype: torch.dtype
    safetensors: str  # the dtype code of a safetensors header
    view: torch.dtype  # signed (or uint8) integer dtype of the same width
    width: int  # bytes per element
    # Exponent field (shift, mask) of floating dtypes; None for integers and bool.
    exponent: tuple[int, int] | None
    codec: bool = True  # the delta codec encodes it (else it travels in anchors only)

    @property
    def unsigned(self) -> type[np.unsignedinteger]:
        return UNSIGNED[self.width]


_ROWS: list[DType] = [
    DType("bool", torch.bool, "BOOL", torch.uint8, 1, None),
    DType("uint8", torch.uint8, "U8", torch.uint8, 1, None),
    DType("int8", torch.int8, "I8", torch.int8, 1, None),
    DType("int16", torch.int16, "I16", torch.int16, 2, None),
    DType("uint16", torch.uint16, "U16", torch.int16, 2, None),
    DType("int32", torch.int32, "I32", torch.int32, 4, None),
    DType("uint32", torch.uint32, "U32", torch.int32, 4, None),
    DType("int64", torch.int64, "I64", torch.int64, 8, None),
    DType("uint64", torch.uint64, "U64", torch.int64, 8, None),
    DType("float16", torch.float16, "F16", torch.int16, 2, (10, 0x1F)),
    DType("bfloat16", torch.bfloat16, "BF16", torch.int16, 2, (7, 0xFF)),
    DType("float32", torch.float32, "F32", torch.int32, 4, (23, 0xFF)),
    DType("float64", torch.float64, "F64", torch.int64, 8, (52, 0x7FF)),
    DType("float8_e4m3fn", torch.float8_e4m3fn, "F8_E4M3", torch.uint8, 1, (3, 0xF)),
    DType("float8_e5m2", torch.float8_e5m2, "F8_E5M2", torch.uint8, 1, (2, 0x1F)),
]
if hasattr(torch, "float8_e8m0fnu"):  # newer torch only; all exponent, no codec support
    _ROWS.append(
        DType("float8_e8m0fnu", torch.float8_e8m0fnu, "F8_E8M0", torch.uint8, 1, (0, 0xFF), False)
    )

DTYPE_TABLE: tuple[DType, ...] = tuple(_ROWS)
assert all(WIDTHS.get(d.name) == d.width for d in DTYPE_TABLE), "dtype_names.WIDTHS"
BY_NAME: dict[str, DType] = {d.name: d for d in DTYPE_TABLE}
BY_TORCH: dict[torch.dtype, DType] = {d.dtype: d for d in DTYPE_TABLE}
BY_SAFETENSORS: dict[str, DType] = {d.safetensors: d for d in DTYPE_TABLE}
# Every dtype deltasync moves, by its name (a manifest's ``dtype``).
DTYPES: dict[str, torch.dtype] = {d.name: d.dtype for d in DTYPE_TABLE}
