"""Codec entry points. STUB: signatures are final, bodies are being written."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

CODEC_NAME = "deltasync-bitdelta"
CODEC_VERSION = 1
LEVELS = (1, 2)
DEFAULT_LEVEL = 1


@dataclass(frozen=True)
class EncodedTensorInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    encoding: str  # "same" | "sparse" | "bitmap" | "dense" (+ level-specific variants)
    changed: int
    nbytes: int  # payload bytes for this tensor in the object


@dataclass(frozen=True)
class TensorPatch:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    positions: torch.Tensor  # int64, flat indices into the tensor, sorted ascending
    values: torch.Tensor  # new contents, integer view of dtype (int16 for bf16), len == positions


class DeltaObject:
    level: int
    tensors: list[EncodedTensorInfo]

    def info(self, name: str) -> EncodedTensorInfo:
        raise NotImplementedError

    def decode(self, name: str, base: torch.Tensor) -> TensorPatch:
        raise NotImplementedError


def encode_delta(
    pairs: Iterable[tuple[str, torch.Tensor, torch.Tensor]], level: int = DEFAULT_LEVEL
) -> bytes:
    raise NotImplementedError


def read_delta(data: bytes, *, object_name: str = "<delta>") -> DeltaObject:
    raise NotImplementedError


def apply_patch(tensor: torch.Tensor, patch: TensorPatch) -> None:
    raise NotImplementedError
