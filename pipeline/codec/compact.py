"""Level 3's container layout, smaller for models of many small tensors.

Level 1 writes one JSON object per tensor record and one safetensors entry
per changed tensor (each entry costs a header line naming the tensor again, its
dtype, shape and offsets). Level 3 writes each record as a JSON array
``[name, dtype, shape, encoding, changed, [stream sizes in role order], params]``
and every tensor's streams back to back in one entry, ``streams``, in record
order; a tensor's streams are then found from the sizes of those before it.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import numpy.typing as npt

from pipeline.codec.records import TensorRecord
from pipeline.codec.tensorcodec import ENCODINGS, roles
from pipeline.errors import CorruptObjectError

U8 = npt.NDArray[np.uint8]

STREAMS_ENTRY = "streams"
COMPACT_LEVELS = frozenset({3})


def pack(records: list[TensorRecord], entries: dict[str, U8]) -> tuple[str, dict[str, U8]]:
    """The records' JSON and the container entries of a compact object."""
    rows = [
        [
            r.name,
            r.info.name,
            list(r.shape),
            r.encoding,
            r.changed,
            list(r.streams.values()),
            r.params,
        ]
        for r in records
    ]
    parts = [entries[r.name] for r in records if r.name in entries]
    body = {STREAMS_ENTRY: np.concatenate(parts)} if parts else {}
    return json.dumps(rows, separators=(",", ":")), body


def unpack(
    rows: list[Any], streams: dict[str, U8], object_name: str
) -> tuple[list[dict[str, Any]], dict[str, U8]]:
    """Records in the object form ``parse_record`` checks, and each tensor's entry as
    a view into the one ``streams`` entry."""
    stray = set(streams) - {STREAMS_ENTRY}
    if stray:
        raise CorruptObjectError(
            f"delta object {object_name}: entry {sorted(stray)[0]!r} belongs to no tensor record"
        )
    body = streams.get(STREAMS_ENTRY, np.zeros(0, np.uint8))
    records: list[dict[str, Any]] = []
    entries: dict[str, U8] = {}
    offset = 0
    for i, row in enumerate(rows):
        bad = CorruptObjectError(f"delta object {object_name}: tensor record {i} is malformed")
        if not (isinstance(row, list) and len(row) == 7):
            raise bad
        name, dtype, shape, encoding, changed, sizes, params = row
        if not (
            isinstance(name, str)
            and isinstance(params, dict)
            and encoding in ENCODINGS
            and isinstance(sizes, list)
            and all(type(s) is int and s >= 0 for s in sizes)
        ):
            raise bad
        names = roles(encoding, params)
        if names is None or len(names) != len(sizes):
            raise bad
        total = sum(sizes)
        if total:
            if offset + total > body.size:
                raise CorruptObjectError(
                    f"delta object {object_name}: tensor {name!r}: streams run past the data"
                )
            entries[name] = body[offset : offset + total]
            offset += total
        records.append(
            {
                "name": name,
                "dtype": dtype,
                "shape": shape,
                "encoding": encoding,
                "changed": changed,
                "streams": dict(zip(names, sizes, strict=True)),
                "params": params,
            }
        )
    if offset != body.size:
        raise CorruptObjectError(
            f"delta object {object_name}: records cover {offset} of {body.size} stream bytes"
        )
    return records, entries
