"""Steps staged by the trainer's emitter that Redis no longer knows.

The emitter writes each step to ``<staging>/<run>/step-<step:010d>`` (renamed into
place, so a folder of that name is complete), then sends it through Redis. Redis may
lose what it was sent (a restart without persistence, FLUSHALL) before a diff worker
takes it: the staged folder is then the only trace, and the step is found again
from it (the emitter sends it again before its next step; `deltasync status` lists
it; `deltasync retry` sends it).
"""

from __future__ import annotations

import re
from pathlib import Path

import redis

from pipeline.coord import keys
from pipeline.coord.connection import redis_errors, text
from pipeline.coord.events import check_run_name
from pipeline.store.base import ObjectStore
from pipeline.versions.index import list_versions

STAGED = re.compile(r"step-(\d{10})")


def staged_path(staging_dir: Path, run: str, step: int) -> Path:
    return staging_dir / run / f"step-{step:010d}"


def lost_staged_steps(
    client: redis.Redis, store: ObjectStore, staging_dir: Path, run: str, below: int | None = None
) -> list[int]:
    """Steps staged for ``run`` (below ``below`` if given), newer than its head, neither
    pending nor set aside in Redis, oldest first. Redis is read before the store: a
    step published meanwhile (its pending entry gone, its folder not yet adopted) is
    not taken for lost."""
    try:
        staged = sorted(
            int(m.group(1))
            for entry in (staging_dir / check_run_name(run)).iterdir()
            if (m := STAGED.fullmatch(entry.name))
        )
        staged = [s for s in staged if below is None or s < below]
    except (FileNotFoundError, NotADirectoryError):
        return []
    if not staged:
        return []
    with redis_errors(client, f"reading the steps of run {run}"):
        known = {text(k) for k in client.hkeys(keys.pending_steps_key(run))}
        known |= {text(k) for k in client.hkeys(keys.dead_steps_key(run))}
    head = list_versions(store, run).head
    return [s for s in staged if str(s) not in known and (head is None or s > head)]
