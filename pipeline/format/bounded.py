"""Bounded parsing of untrusted bytes: JSON with a size and a nesting limit, and the
errors of a hostile input (deep nesting, huge sizes) turned into one-line
DeltasyncErrors instead of RecursionError or MemoryError.

Everything deltasync reads from Redis or the store goes through here before its
schema is checked: events, manifests, anchor headers.
"""

from __future__ import annotations

import json
from typing import Any

from pipeline.errors import DeltasyncError

# Deeper than any document deltasync writes (a manifest nests 4 levels, an event 1),
# far below the interpreter's recursion limit.
MAX_JSON_DEPTH = 32
# A record deltasync keeps in Redis (a dead step, a refused job, a damage report) is a
# few hundred bytes; a larger one is not its own.
MAX_REDIS_RECORD_BYTES = 64 * 1024
_CONTAINERS = (dict, list)


def load_json(
    data: bytes | str,
    *,
    max_bytes: int,
    what: str,
    error: type[DeltasyncError],
    max_depth: int = MAX_JSON_DEPTH,
) -> Any:
    """``data`` decoded as JSON, or ``error`` (one line naming ``what``) when it is larger
    than ``max_bytes``, not JSON, or nested deeper than ``max_depth``."""
    if len(data) > max_bytes:
        raise error(f"{what}: {len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        doc = json.loads(data)
    except RecursionError:
        raise error(f"{what}: nested deeper than {max_depth} levels") from None
    except MemoryError:
        raise error(f"{what}: too large to decode") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise error(f"{what}: not JSON ({str(exc)[:120]})") from None
    if json_depth(doc, max_depth) > max_depth:
        raise error(f"{what}: nested deeper than {max_depth} levels")
    return doc


def json_depth(doc: object, limit: int = MAX_JSON_DEPTH) -> int:
    """How deep ``doc`` nests (a scalar is 0), counted level by level without recursion;
    stops once past ``limit``. Each level's containers are picked out by one
    comprehension: a delta object's header holds thousands of small containers, read
    on every apply."""
    level: list[object] = [doc] if isinstance(doc, _CONTAINERS) else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return depth
        below: list[object] = []
        for value in level:
            children: Any = value.values() if isinstance(value, dict) else value
            below += [c for c in children if isinstance(c, _CONTAINERS)]
        level = below
    return depth
