"""Per-dtype facts the codec needs: the integer view, its width, the exponent field.

A view of the one dtype table (pipeline/format/tensors.py), narrowed to the dtypes
the delta codec encodes.
"""

from __future__ import annotations

import torch

from pipeline.errors import CodecError
from pipeline.format.tensors import DTYPE_TABLE, DType

DtypeInfo = DType

BY_NAME: dict[str, DtypeInfo] = {d.name: d for d in DTYPE_TABLE if d.codec}
BY_DTYPE: dict[torch.dtype, DtypeInfo] = {d.dtype: d for d in DTYPE_TABLE if d.codec}


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
