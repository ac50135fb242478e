"""The names of the dtypes deltasync moves, as manifests and codec containers record
them (torch's, without ``torch.``), with their element widths in bytes.

Readable without torch: commands that only read manifests (``deltasync status``) check
a dtype name and size a tensor without loading it. :mod:`pipeline.format.tensors`
builds the full table (torch dtypes, safetensors codes, integer views) on these names.
"""

from __future__ import annotations

WIDTHS: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "uint16": 2,
    "int32": 4,
    "uint32": 4,
    "int64": 8,
    "uint64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e8m0fnu": 1,  # newer torch only
}
