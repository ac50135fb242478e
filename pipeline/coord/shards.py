"""Which ranks of a sharded step have staged their pieces, and where (one Redis hash).

Each rank, once its folder is staged, registers itself in ``shards_key(run, step)``:
rank -> {"host", "path", "world", "layout"}. The registration that brings the hash to
``world`` entries completes the step; that rank sends it. A rank that fails before
registering leaves the step incomplete: nothing is sent for it, and the hash expires.
The diff side reads the hash back (``rank_folders``) to route each rank's parts to
its host and find its folder there.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import redis

from pipeline import config
from pipeline.coord import keys
from pipeline.errors import ConfigError, CorruptObjectError
from pipeline.format.bounded import load_json
from pipeline.format.shards import MAX_WORLD

MAX_ENTRY_BYTES = 8192  # host, an absolute path and a digest
_DIGEST = re.compile(r"[0-9a-f]{64}")
_FIELDS = frozenset({"host", "path", "world", "layout"})


@dataclass(frozen=True)
class RankFolder:
    """Where one rank staged a step: its trainer host, its rank folder there (absolute),
    the world size it ran in and the digest of its layout (format.shards.layout_digest)."""

    host: str
    path: str
    world: int
    layout: str


def _entry_json(folder: RankFolder) -> str:
    keys.check_node_name(folder.host)
    if not isinstance(folder.path, str) or not folder.path.startswith("/"):
        raise ConfigError(f"a rank folder must be an absolute path, not {str(folder.path)[:200]!r}")
    if isinstance(folder.world, bool) or not isinstance(folder.world, int):
        raise ConfigError(f"world must be an integer, got {folder.world!r}")
    if not 1 <= folder.world <= MAX_WORLD:
        raise ConfigError(f"world {folder.world} is out of range [1, {MAX_WORLD}]")
    if not isinstance(folder.layout, str) or not _DIGEST.fullmatch(folder.layout):
        raise ConfigError(f"layout digest {str(folder.layout)[:80]!r} is not sha256 hex")
    doc = {"host": folder.host, "path": folder.path, "world": folder.world, "layout": folder.layout}
    text = json.dumps(doc, separators=(",", ":"))
    if len(text) > MAX_ENTRY_BYTES:
        raise ConfigError(f"rank folder entry is {len(text)} bytes, over {MAX_ENTRY_BYTES}")
    return text


def register_rank(client: redis.Redis, run: str, step: int, rank: int, folder: RankFolder) -> bool:
    """Record that ``rank`` staged ``step`` in ``folder``; True when this call completed
    the step (its entry was new and made the ranks registered equal ``world``), so the
    caller is the one rank that sends it. A rank registering again is never the one."""
    key = keys.shards_key(run, step)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < folder.world:
        raise ConfigError(f"rank {rank!r} is out of range [0, {folder.world})")
    entry = _entry_json(folder)
    with client.pipeline(transaction=True) as pipe:
        pipe.hset(key, str(rank), entry)
        pipe.pexpire(key, int(config.SHARDS_TTL_S * 1000))
        pipe.hlen(key)
        added, _, count = pipe.execute()
    return bool(added) and int(count) == folder.world


def _parse_entry(key: str, field: object, raw: object) -> tuple[int, RankFolder]:
    name = field.decode(errors="replace") if isinstance(field, bytes) else str(field)
    if not name.isdigit() or len(name) > 5 or (len(name) > 1 and name[0] == "0"):
        raise CorruptObjectError(f"{key}: field {name[:40]!r} is not a rank")
    rank = int(name)
    data = raw if isinstance(raw, bytes | str) else b""
    what = f"{key} rank {rank}"
    doc: Any = load_json(data, max_bytes=MAX_ENTRY_BYTES, what=what, error=CorruptObjectError)
    if not isinstance(doc, dict) or set(doc) != _FIELDS:
        raise CorruptObjectError(f"{what}: not an object of host, path, world, layout")
    host, path, world, layout = doc["host"], doc["path"], doc["world"], doc["layout"]
    if not isinstance(host, str) or not keys.NODE_PATTERN.fullmatch(host):
        raise CorruptObjectError(f"{what}: host {str(host)[:80]!r} is malformed")
    if not isinstance(path, str) or not path.startswith("/") or "\x00" in path:
        raise CorruptObjectError(f"{what}: path {str(path)[:200]!r} is not absolute")
    if isinstance(world, bool) or not isinstance(world, int) or not 1 <= world <= MAX_WORLD:
        raise CorruptObjectError(f"{what}: world {str(world)[:40]!r} is out of range")
    if rank >= world:
        raise CorruptObjectError(f"{what}: rank is not below world {world}")
    if not isinstance(layout, str) or not _DIGEST.fullmatch(layout):
        raise CorruptObjectError(f"{what}: layout digest {str(layout)[:80]!r} is malformed")
    return rank, RankFolder(host, path, world, layout)


def rank_folders(client: redis.Redis, run: str, step: int) -> dict[int, RankFolder]:
    """The ranks registered for ``step`` so far (rank -> folder), checked: a malformed
    entry, or ranks that disagree about the world size, raise CorruptObjectError."""
    key = keys.shards_key(run, step)
    if int(client.hlen(key)) > MAX_WORLD:
        raise CorruptObjectError(f"{key}: more than {MAX_WORLD} ranks")
    out = dict(_parse_entry(key, f, v) for f, v in client.hgetall(key).items())
    worlds = {f.world for f in out.values()}
    if len(worlds) > 1:
        raise CorruptObjectError(f"{key}: ranks disagree about the world size {sorted(worlds)}")
    return dict(sorted(out.items()))
