"""Which ranks of a sharded step have staged their pieces, and where (one Redis hash).

Each rank, once its folder is staged, registers itself in ``shards_key(run, step)``:
rank -> {"host", "path", "world", "layout", "launch"}. The registration that brings the
entries of its launch to ``world`` completes the step; that rank sends it. A rank that
fails before registering leaves the step incomplete: nothing is sent for it, and the
hash expires. The launch (one token shared by the ranks of one start of the trainer)
keeps a step emitted again after a restart from completing with the folders an earlier
attempt registered.
The diff side reads the hash back (``rank_folders``) to route each rank's parts to
its host and find its folder there.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from typing import Any

import redis

from pipeline import config
from pipeline.coord import keys, scripts
from pipeline.errors import ConfigError, CorruptObjectError
from pipeline.format.bounded import load_json
from pipeline.format.checkpoints.shards import MAX_WORLD

MAX_ENTRY_BYTES = 8192  # host, an absolute path and a digest
_DIGEST = re.compile(r"[0-9a-f]{64}")
_FIELDS = frozenset({"host", "path", "world", "layout", "launch"})
_LAUNCH = re.compile(r"[A-Za-z0-9._-]{0,64}")


@dataclass(frozen=True)
class RankFolder:
    """Where one rank staged a step: its trainer host, its rank folder there (absolute),
    the world size it ran in and the digest of its layout (format.shards.layout_digest)."""

    host: str
    path: str
    world: int
    layout: str
    launch: str = ""  # the trainer start it belongs to ("": not told apart)


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
    if not isinstance(folder.launch, str) or not _LAUNCH.fullmatch(folder.launch):
        raise ConfigError(f"launch {str(folder.launch)[:80]!r} is not [A-Za-z0-9._-]{{0,64}}")
    text = json.dumps(asdict(folder), separators=(",", ":"))
    if len(text) > MAX_ENTRY_BYTES:
        raise ConfigError(f"rank folder entry is {len(text)} bytes, over {MAX_ENTRY_BYTES}")
    return text


def register_rank(client: redis.Redis, run: str, step: int, rank: int, folder: RankFolder) -> bool:
    """Record that ``rank`` staged ``step`` in ``folder``; True when this call completed
    the step (its entry was new to its launch and made the ranks registered in that
    launch equal ``world``), so the caller is the one rank that sends it. A rank
    registering again in the same launch is never the one."""
    key = keys.shards_key(run, step)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < folder.world:
        raise ConfigError(f"rank {rank!r} is out of range [0, {folder.world})")
    entry = _entry_json(folder)
    ttl_ms = int(config.SHARDS_TTL_S * 1000)
    done = scripts.REGISTER_RANK(
        client, [key], str(rank), entry, folder.launch, folder.world, ttl_ms
    )
    return int(done) == 1


def _parse_entry(key: str, field: object, raw: object) -> tuple[int, RankFolder]:
    name = field.decode(errors="replace") if isinstance(field, bytes) else str(field)
    if not name.isdigit() or len(name) > 5 or (len(name) > 1 and name[0] == "0"):
        raise CorruptObjectError(f"{key}: field {name[:40]!r} is not a rank")
    rank = int(name)
    data = raw if isinstance(raw, bytes | str) else b""
    what = f"{key} rank {rank}"
    doc: Any = load_json(data, max_bytes=MAX_ENTRY_BYTES, what=what, error=CorruptObjectError)
    if not isinstance(doc, dict) or set(doc) != _FIELDS:
        raise CorruptObjectError(f"{what}: not an object of host, path, world, layout, launch")
    host, path, world, layout = doc["host"], doc["path"], doc["world"], doc["layout"]
    launch = doc["launch"]
    if not isinstance(launch, str) or not _LAUNCH.fullmatch(launch):
        raise CorruptObjectError(f"{what}: launch {str(launch)[:80]!r} is malformed")
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
    return rank, RankFolder(host, path, world, layout, launch)


def rank_folders(
    client: redis.Redis, run: str, step: int, launch: str | None = None
) -> dict[int, RankFolder]:
    """The ranks registered for ``step`` so far (rank -> folder), those of ``launch``
    only when given, checked: a malformed entry, or ranks that disagree about the world
    size, raise CorruptObjectError."""
    key = keys.shards_key(run, step)
    if int(client.hlen(key)) > MAX_WORLD:
        raise CorruptObjectError(f"{key}: more than {MAX_WORLD} ranks")
    out = dict(_parse_entry(key, f, v) for f, v in client.hgetall(key).items())
    if launch is not None:
        out = {r: f for r, f in out.items() if f.launch == launch}
    worlds = {f.world for f in out.values()}
    if len(worlds) > 1:
        raise CorruptObjectError(f"{key}: ranks disagree about the world size {sorted(worlds)}")
    return dict(sorted(out.items()))
