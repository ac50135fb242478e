"""Which runs exist: those with versions (or a record) in the store, and those with
events in Redis. A command given a run that is in neither (a misspelled name) says
so at once and lists the runs it saw, instead of waiting or printing nothing."""

from __future__ import annotations

import redis

from pipeline.coord.events import RUN_NAME_PATTERN
from pipeline.coord.stream import list_runs
from pipeline.errors import ConfigError
from pipeline.store.base import ObjectStore
from pipeline.versions.index import list_versions

SHOWN = 20  # runs named in an error, at most


class UnknownRunError(ConfigError):
    """A run has no version in the store and no event in Redis."""


def runs_in_store(store: ObjectStore) -> list[str]:
    """The runs the store holds anything of (first folder of every key), sorted."""
    return sorted(
        {
            key.split("/", 1)[0]
            for key in store.list("")
            if "/" in key and RUN_NAME_PATTERN.fullmatch(key.split("/", 1)[0])
        }
    )


def known(store: ObjectStore, client: redis.Redis, run: str) -> bool:
    """Whether ``run`` has a published version or an event (a step emitted, say)."""
    return list_versions(store, run).head is not None or run in list_runs(client)


def require_run(store: ObjectStore, client: redis.Redis, run: str, *, hint: str = "") -> None:
    """UnknownRunError naming the runs seen unless ``run`` has a version or an event."""
    if known(store, client, run):
        return
    stored = runs_in_store(store)
    with_events = list_runs(client)
    seen = sorted(set(stored) | set(with_events))
    if seen:
        listed = ", ".join(seen[:SHOWN]) + (
            f" and {len(seen) - SHOWN} more" if len(seen) > SHOWN else ""
        )
        found = f"runs seen: {listed}"
    else:
        found = "no run at all"
    where = f"{store.url} has no version of it and redis has no event of it"
    raise UnknownRunError(f"run {run!r} is unknown ({where}); {found}{hint}")
