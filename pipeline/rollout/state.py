"""The rollout node's state file: which version the target held when last proved.

The node resumes from it only when the target's weights match that version's
manifest; anything unreadable or from another run is ignored.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import structlog

from pipeline.format.manifest import Kind, Manifest

# The node's logger, so these lines keep the logger name they always had.
log = structlog.get_logger("pipeline.rollout.node")

STATE_SCHEMA = 1


def read_state(path: Path | None, run: str) -> tuple[int, Kind] | None:
    """The (version, kind) recorded for ``run``, or None."""
    if path is None or not path.exists():
        return None
    try:
        doc = json.loads(path.read_text())
        if doc.get("schema") != STATE_SCHEMA or doc.get("run") != run:
            return None
        version, kind = doc["version"], doc["kind"]
        if not isinstance(version, int) or kind not in ("delta", "anchor"):
            return None
    except (OSError, ValueError, KeyError, AttributeError) as exc:
        log.warning("ignoring unreadable node state", path=str(path), error=str(exc))
        return None
    return version, kind


def write_state(path: Path | None, run: str, node: str, manifest: Manifest) -> None:
    """Record ``manifest``'s version as held (atomically: a crash leaves the old file)."""
    if path is None:
        return
    doc = {
        "schema": STATE_SCHEMA,
        "run": run,
        "node": node,
        "version": manifest.version,
        "kind": manifest.kind,
        "state_hash": manifest.state_hash,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, sort_keys=True))
    os.replace(tmp, path)


def remove_state(path: Path | None) -> None:
    if path is not None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def pin_path(path: Path) -> Path:
    """Where the node records the run instance it follows, beside its state file (which
    is removed whenever the node must bootstrap; the instance stays)."""
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
