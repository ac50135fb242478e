"""Per-dtype facts the codec needs: the integer view, its width, the exponent field."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeline.errors import CodecError


@dataclass(frozen=True)
class DtypeInfo:
    name: str  # stable name recorded in the container
    dtype: torch.dtype
    view: torch.dtype  # signed (or uint8) integer dtype of the same width
    width: int  # bytes per element
    # Exponent field (shift, mask) of floating dtypes; None for integers and bool.
    exponent: tuple[int, int] | None

    @property
    def unsigned(self) -> type[np.unsignedinteger]:
        return _UNSIGNED[self.width]


_UNSIGNED: dict[int, type[np.unsignedinteger]] = {
    1: np.uint8,
    2: np.uint16,
    4: np.uint32,
    8: np.uint64,
}

_TABLE: list[DtypeInfo] = [
    DtypeInfo("bfloat16", torch.bfloat16, torch.int16, 2, (7, 0xFF)),
    DtypeInfo("float16", torch.float16, torch.int16, 2, (10, 0x1F)),
    DtypeInfo("float32", torch.float32, torch.int32, 4, (23, 0xFF)),
    DtypeInfo("float64", torch.float64, torch.int64, 8, (52, 0x7FF)),
    DtypeInfo("float8_e4m3fn", torch.float8_e4m3fn, torch.uint8, 1, (3, 0xF)),
    DtypeInfo("float8_e5m2", torch.float8_e5m2, torch.uint8, 1, (2, 0x1F)),
    DtypeInfo("int8", torch.int8, torch.int8, 1, None),
    DtypeInfo("uint8", torch.uint8, torch.uint8, 1, None),
    DtypeInfo("bool", torch.bool, torch.uint8, 1, None),
    DtypeInfo("int16", torch.int16, torch.int16, 2, None),
    DtypeInfo("int32", torch.int32, torch.int32, 4, None),
    DtypeInfo("int64", torch.int64, torch.int64, 8, None),
    DtypeInfo("uint16", torch.uint16, torch.int16, 2, None),
    DtypeInfo("uint32", torch.uint32, torch.int32, 4, None),
    DtypeInfo("uint64", torch.uint64, torch.int64, 8, None),
]

BY_NAME: dict[str, DtypeInfo] = {d.name: d for d in _TABLE}
BY_DTYPE: dict[torch.dtype, DtypeInfo] = {d.dtype: d for d in _TABLE}


def info_for(dtype: torch.dtype, tensor_name: str) -> DtypeInfo:
    try:
        return BY_DTYPE[dtype]
    except KeyError:
        raise CodecError(f"tensor {tensor_name!r}: unsupported dtype {dtype}") from None


def int_view_flat(tensor: torch.Tensor, info: DtypeInfo) -> torch.Tensor:
    """The tensor's elements as a flat integer tensor of the same width (no copy if
    contiguous)."""
    t = tensor.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.view(info.view).view(-1)
