"""The rollout node's state file: which version the target held when last proved,
and the node's floor: the newest version it ever verified.

The node resumes from a recorded version only when the target's weights match that
version's manifest; anything unreadable or from another run is ignored. The floor is
kept across restarts (here and in the metadata of the node's dumps): a node never
goes back below it, whatever the store shows after a restart.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import structlog

from pipeline.errors import DeltasyncError
from pipeline.format.checkpoints.checkpoint import CheckpointReader
from pipeline.format.manifest import Kind, Manifest

# The node's logger, so these lines keep the logger name they always had.
log = structlog.get_logger("pipeline.rollout.node")

STATE_SCHEMA = 1

# Keys of a dump's safetensors metadata (next to "format": "pt").
DUMP_RUN = "deltasync.run"
DUMP_VERSION = "deltasync.version"
DUMP_KIND = "deltasync.kind"
DUMP_FLOOR = "deltasync.floor"
DUMP_INSTANCE = "deltasync.instance"


@dataclass(frozen=True)
class Recorded:
    """What a state file or a dump says: the version held (None: nothing provable, e.g.
    mid-bootstrap), its kind, the floor and the run instance the floor belongs to."""

    version: int | None
    kind: Kind
    floor: int
    instance: str | None


def read_state(path: Path | None, run: str) -> Recorded | None:
    """What the state file records for ``run``, or None."""
    if path is None or not path.exists():
        return None
    try:
        doc = json.loads(path.read_text())
        if doc.get("schema") != STATE_SCHEMA or doc.get("run") != run:
            return None
        version, kind = doc.get("version"), doc.get("kind", "delta")
        floor, instance = doc.get("floor", version), doc.get("instance")
        if version is not None and not _is_int(version):
            return None
        if kind not in ("delta", "anchor") or not _is_int(floor):
            return None
        if instance is not None and not isinstance(instance, str):
            return None
    except (OSError, ValueError, KeyError, AttributeError) as exc:
        log.warning("ignoring unreadable node state", path=str(path), error=str(exc))
        return None
    held = None if version is None else int(version)
    return Recorded(held, kind, max(int(floor), held or 0), instance)


def write_state(
    path: Path | None,
    run: str,
    node: str,
    manifest: Manifest | None,
    floor: int | None,
    instance: str | None,
) -> None:
    """Record ``manifest``'s version as held (None: nothing provable held) and the floor
    (atomically: a crash leaves the old file). The floor written never goes below the
    one the file already records."""
    if path is None:
        return
    before = read_state(path, run)
    held = None if manifest is None else manifest.version
    floors = [v for v in (floor, held) if v is not None]
    if before is not None and (instance is None or before.instance in (None, instance)):
        floors.append(before.floor)
    doc = {
        "schema": STATE_SCHEMA,
        "run": run,
        "node": node,
        "version": held,
        "kind": "delta" if manifest is None else manifest.kind,
        "state_hash": None if manifest is None else manifest.state_hash,
        "floor": max(floors) if floors else None,
        "instance": instance,
    }
    if doc["floor"] is None:  # nothing held and nothing verified: nothing to keep
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, sort_keys=True))
    os.replace(tmp, path)


def pin_path(path: Path) -> Path:
    """Where the node records the run instance it follows, beside its state file."""
    return path.with_name(path.name + ".instance")


def read_pin(path: Path | None, run: str) -> str | None:
    """The run instance this node has followed ``run`` in, or None."""
    if path is None:
        return None
    try:
        doc = json.loads(pin_path(path).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable instance pin", path=str(pin_path(path)), error=str(exc))
        return None
    if not isinstance(doc, dict) or doc.get("run") != run:
        return None
    instance = doc.get("instance")
    return instance if isinstance(instance, str) else None


def write_pin(path: Path | None, run: str, instance: str) -> None:
    if path is None:
        return
    target = pin_path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps({"instance": instance, "run": run}, sort_keys=True))
    os.replace(tmp, target)


def dump_metadata(
    run: str, manifest: Manifest | None, floor: int | None, instance: str | None
) -> dict[str, str]:
    """The safetensors metadata of a node's dump: the version it holds and its floor,
    so a node started from the dump resumes from it and keeps the floor."""
    meta = {DUMP_RUN: run}
    if manifest is not None:
        meta[DUMP_VERSION] = str(manifest.version)
        meta[DUMP_KIND] = manifest.kind
    if floor is not None:
        meta[DUMP_FLOOR] = str(floor)
    if instance is not None:
        meta[DUMP_INSTANCE] = instance
    return meta


def read_dump(path: Path | None, run: str) -> Recorded | None:
    """What a dump of a node of ``run`` at ``path`` records, or None (not a dump of
    this run, or unreadable: a model folder, another run's weights)."""
    if path is None or not path.exists():
        return None
    try:
        with CheckpointReader(path) as reader:
            meta = dict(reader.metadata)
    except DeltasyncError as exc:
        log.info("not reading a dump's metadata", path=str(path), error=str(exc))
        return None
    if meta.get(DUMP_RUN) != run:
        return None
    version = meta.get(DUMP_VERSION)
    kind = meta.get(DUMP_KIND, "delta")
    floor = meta.get(DUMP_FLOOR, version)
    if (version is not None and not version.isdigit()) or floor is None or not floor.isdigit():
        return None
    if kind not in ("delta", "anchor"):
        return None
    held = None if version is None else int(version)
    return Recorded(held, "anchor" if kind == "anchor" else "delta", int(floor),
                    meta.get(DUMP_INSTANCE))  # fmt: skip


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
