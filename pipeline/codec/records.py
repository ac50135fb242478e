"""Per-tensor records in a delta object's metadata, and their validation.

Everything a record claims is checked against hard limits and against the
streams it names before any decoding allocates memory from its numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, TypeGuard

import numpy as np
import numpy.typing as npt

from pipeline.codec import contents, rice
from pipeline.codec.dtypes import BY_NAME, DtypeInfo
from pipeline.errors import CorruptObjectError

U8 = npt.NDArray[np.uint8]

MAX_NUMEL = 1 << 44
ROLES: dict[str, tuple[str, ...]] = {
    "same": (),
    "sparse": ("unary", "fixed", "values"),
    "classed": ("unary", "fixed", "values"),
    "bitmap": ("mask", "values"),
    "dense": ("values",),
}


@dataclass(frozen=True)
class TensorRecord:
    name: str
    info: DtypeInfo
    shape: tuple[int, ...]
    encoding: str
    changed: int
    streams: dict[str, str]  # role -> stream key in the container
    params: dict[str, Any]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": self.info.name,
            "shape": list(self.shape),
            "encoding": self.encoding,
            "changed": self.changed,
            "streams": self.streams,
            "params": self.params,
        }


def _is_int(x: object) -> TypeGuard[int]:
    return type(x) is int


def parse_record(
    raw: object, streams: dict[str, U8], object_name: str, position: int
) -> TensorRecord:
    """Validate one record against the container's streams."""
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        raise CorruptObjectError(
            f"delta object {object_name}: tensor record {position} is malformed"
        )
    name: str = raw["name"]

    def bad(reason: str) -> CorruptObjectError:
        return CorruptObjectError(f"delta object {object_name}: tensor {name!r}: {reason}")

    info = BY_NAME.get(raw.get("dtype"))  # type: ignore[arg-type]
    if info is None:
        raise bad(f"unknown dtype {raw.get('dtype')!r}")
    shape = raw.get("shape")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise bad("shape is not a list of non-negative integers")
    numel = math.prod(shape)
    if numel > MAX_NUMEL:
        raise bad(f"{numel} elements is absurd")
    encoding = raw.get("encoding")
    if encoding not in ROLES:
        raise bad(f"unknown encoding {encoding!r}")
    changed = raw.get("changed")
    if not _is_int(changed) or not 0 <= changed <= numel:
        raise bad(f"changed count {changed!r} is not within 0..{numel}")
    role_keys = raw.get("streams")
    if not isinstance(role_keys, dict) or set(role_keys) != set(ROLES[encoding]):
        raise bad(f"streams {role_keys!r} do not match encoding {encoding!r}")
    for key in role_keys.values():
        if not isinstance(key, str) or key not in streams:
            raise bad(f"names a missing stream {key!r}")
    params = raw.get("params")
    if not isinstance(params, dict):
        raise bad("params are not a JSON object")
    record = TensorRecord(
        name, info, tuple(shape), encoding, changed, dict(role_keys), dict(params)
    )
    reason = _check_sizes(record, {r: streams[k] for r, k in role_keys.items()})
    if reason:
        raise bad(reason)
    return record


def _check_sizes(rec: TensorRecord, streams: dict[str, U8]) -> str | None:
    numel, k, width = rec.numel, rec.changed, rec.info.width
    enc = rec.encoding
    if enc == "same":
        return None if k == 0 else "encoding 'same' with changed elements"
    if k == 0:
        return f"encoding {enc!r} with no changed elements"
    expected_values = numel * width if enc == "dense" else k * width
    if contents.frame_content_size(streams["values"]) != expected_values:
        return f"contents stream does not declare {expected_values} bytes"
    if enc == "bitmap" and contents.frame_content_size(streams["mask"]) != (numel + 7) // 8:
        return "change mask stream does not declare the tensor's size"
    if enc == "sparse":
        param = rec.params.get("rice")
        if not _is_int(param) or not 0 <= param <= rice.MAX_PARAM:
            return f"Rice parameter {param!r} out of range"
        if streams["fixed"].size != rice.fixed_nbytes(k, param):
            return "fixed-width position stream has the wrong size"
        max_bits = k + ((numel - k) >> param)
        if not (k + 7) // 8 <= streams["unary"].size <= (max_bits + 7) // 8:
            return "unary position stream has an impossible size"
    if enc == "classed":
        return _check_classes(rec, streams)
    return None


def _check_classes(rec: TensorRecord, streams: dict[str, U8]) -> str | None:
    table = rec.params.get("classes")
    if rec.info.exponent is None:
        return "class-coded positions for a dtype without exponent"
    top = rec.info.exponent[1]
    if not isinstance(table, list) or not table:
        return "class table missing"
    seen: set[int] = set()
    total = 0
    for entry in table:
        if not (isinstance(entry, list) and len(entry) == 4 and all(_is_int(x) for x in entry)):
            return "class table entry malformed"
        cls, k_c, param, inverted = entry
        if not (0 <= cls <= top and cls not in seen and k_c >= 1):
            return f"class table entry {entry} invalid"
        if not (0 <= param <= rice.MAX_PARAM and inverted in (0, 1)):
            return f"class table entry {entry} invalid"
        seen.add(cls)
        total += k_c
    if total != rec.changed:
        return f"class counts sum to {total}, record says {rec.changed}"
    numel = rec.numel
    if streams["unary"].size > (2 * numel + 7) // 8:
        return "unary position stream has an impossible size"
    if streams["fixed"].size > rice.fixed_nbytes(numel, rice.MAX_PARAM):
        return "fixed-width position stream has an impossible size"
    return None
