"""The parallel diff: one version's parts encoded by several diff workers.

The same diff path as a single worker's (:mod:`pipeline.publish.diff`) with its part
records in Redis instead of memory. The job that holds the run's diff lease (the
coordinator) runs ``publish_step`` with a :class:`FanoutSpread`: once its state cache
holds the parent version it publishes a *fan-out* record for (run, step) and has the
helpers called in (:meth:`FanoutSpread.__call__`), then encodes parts itself while
other workers sharing its state cache do the same (:func:`work_parts`). Each part is
claimed with a renewed lease, encoded, uploaded, and its record written to a Redis
hash. Once every part is recorded the coordinator writes the manifest (last), ends
the fan-out, announces and advances the cache. A dead claimant's lease expires and
its part is claimed again; the manifest appears only when every part is recorded,
and the coordinator holds the diff lease throughout, so steps of a run stay in order.

Helpers only read the coordinator's state cache (``cache_dir`` shared on one
machine): it changes only after every part is recorded.

Part records are kept per (step, parent): a step whose coordinator died is redone
by the next coordinator, which reuses the records only when the head is still the
parent they were encoded against.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

import redis
import structlog

from pipeline import config
from pipeline.coord.connection import text
from pipeline.coord.events import DeltaPart
from pipeline.coord.keys import fanout_key, part_hosts_key, part_records_key
from pipeline.coord.replicas import run_lock
from pipeline.errors import DeltasyncError, LockError
from pipeline.format.checkpoint import CheckpointReader
from pipeline.format.manifest import Manifest, ObjectEntry, Piece, TensorEntry
from pipeline.format.pieces import StoredPiece
from pipeline.publish.diff import DeltaTask, PartRecord, assemble_delta, encode_parts
from pipeline.publish.state_cache import StateCache
from pipeline.publish.uploads import PublishTimings
from pipeline.publish.version import PrivateKey
from pipeline.store.base import ObjectStore
from pipeline.versions import chain

log = structlog.get_logger(__name__)

PART_LEASE_S = config.LOCK_LEASE_S
PART_RENEW_S = config.LOCK_RENEW_S
FANOUT_TTL_S = config.FANOUT_TTL_S
IDLE_S = 0.1  # between looks at the records while other workers hold parts


def part_lock(step: int, index: int) -> str:
    """The name of the run lock that claims part ``index`` of ``step``."""
    return f"part-{step}-{index}"


def route_parts(client: redis.Redis, run: str, step: int, hosts: Mapping[str, str]) -> None:
    """Route parts of ``step`` to the diff workers of trainer hosts (part key: host):
    only a worker serving that host encodes it, the others leave it alone. Parts not
    routed go to any worker."""
    if not hosts:
        return
    with client.pipeline(transaction=True) as pipe:
        for key, host in hosts.items():
            pipe.hset(part_hosts_key(run, step), key, host)
        pipe.pexpire(part_hosts_key(run, step), int(FANOUT_TTL_S * 1000))
        pipe.execute()


def part_hosts(client: redis.Redis, run: str, step: int) -> dict[str, str]:
    raw = client.hgetall(part_hosts_key(run, step))
    return {text(k): text(v) for k, v in raw.items()}


def fanout_to_json(task: DeltaTask) -> str:
    doc = asdict(task)
    if not task.sharded:  # an unsharded fan-out's record as it always was
        for field in ("sharded", "publishes", "anchor_compression", "launch", "part_bytes"):
            del doc[field]
    return json.dumps(doc, sort_keys=True)


def fanout_from_json(text: str | bytes) -> DeltaTask:
    doc = json.loads(text)
    return DeltaTask(
        run=str(doc["run"]),
        step=int(doc["step"]),
        checkpoint=str(doc["checkpoint"]),
        parent=int(doc["parent"]),
        parent_kind="anchor" if doc["parent_kind"] == "anchor" else "delta",
        level=int(doc["level"]),
        sharded=doc.get("sharded") is True,
        publishes="anchor" if doc.get("publishes") == "anchor" else "delta",
        anchor_compression=str(doc.get("anchor_compression", "none")),
        launch=None if doc.get("launch") is None else str(doc["launch"]),
        part_bytes=None if doc.get("part_bytes") is None else int(doc["part_bytes"]),
    )


def start_fanout(client: redis.Redis, fanout: DeltaTask) -> None:
    client.set(fanout_key(fanout.run), fanout_to_json(fanout), px=int(FANOUT_TTL_S * 1000))


def current_fanout(client: redis.Redis, run: str) -> DeltaTask | None:
    raw = client.get(fanout_key(run))
    return None if raw is None else fanout_from_json(raw)


def end_fanout(client: redis.Redis, fanout: DeltaTask) -> None:
    """Stop helpers starting on ``fanout``. Its part records stay until they expire: a
    helper that read the fan-out just before sees every part recorded and does nothing."""
    client.delete(fanout_key(fanout.run))


def _record_json(record: PartRecord) -> str:
    doc: dict[str, Any] = {
        "object": asdict(record.object),
        "tensors": [asdict(e) for e in record.tensors],
    }
    if record.pieces:
        doc["pieces"] = [asdict(p) for p in record.pieces]
    return json.dumps(doc, sort_keys=True)


def _parse_record(text: str | bytes) -> PartRecord:
    doc: dict[str, Any] = json.loads(text)
    obj = ObjectEntry(**doc["object"])
    tensors = tuple(
        TensorEntry(
            **{
                **t,
                "shape": tuple(t["shape"]),
                "pieces": tuple(Piece(**_dims(p, "offset", "size")) for p in t.get("pieces", ())),
            }
        )
        for t in doc["tensors"]
    )
    pieces = tuple(
        StoredPiece(**_dims(p, "shape", "offset", "size")) for p in doc.get("pieces", ())
    )
    return PartRecord(obj, tensors, pieces)


def _dims(doc: dict[str, Any], *keys: str) -> dict[str, Any]:
    """``doc`` with its lists of dimensions at ``keys`` as tuples (JSON has no tuple)."""
    return {**doc, **{k: tuple(doc[k]) for k in keys if k in doc}}


class RedisLedger:
    """The part records of ``fanout`` in a Redis hash, parts claimed with run locks. A
    worker serving trainer host ``host`` claims the parts routed to it and those not
    routed; a worker of no host only those not routed."""

    def __init__(
        self,
        client: redis.Redis,
        fanout: DeltaTask,
        *,
        owner: bool = False,
        host: str | None = None,
    ) -> None:
        self.client, self.fanout, self.owner, self.host = client, fanout, owner, host
        self.key = part_records_key(fanout.run, fanout.step, fanout.parent)
        self._hosts: dict[str, str] | None = None

    def host_of(self, key: str) -> str | None:
        if self._hosts is None:
            self._hosts = part_hosts(self.client, self.fanout.run, self.fanout.step)
        return self._hosts.get(key)

    def is_recorded(self, key: str) -> bool:
        return bool(self.client.hexists(self.key, key))

    def claim(self, index: int, key: str) -> contextlib.ExitStack | None:
        if self.host_of(key) not in (None, self.host):
            return None  # another host's part: its base is in that host's cache
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(
                run_lock(
                    self.client,
                    self.fanout.run,
                    part_lock(self.fanout.step, index),
                    PART_LEASE_S,
                    wait_s=0.0,
                    renew_every_s=PART_RENEW_S,
                )
            )
        except LockError:
            return None
        return stack

    def record(self, key: str, record: PartRecord) -> None:
        with self.client.pipeline(transaction=True) as pipe:
            pipe.hsetnx(self.key, key, _record_json(record))
            pipe.pexpire(self.key, int(FANOUT_TTL_S * 1000))
            pipe.execute()

    def recorded_keys(self) -> set[str]:
        """The parts recorded so far, without their records (cheap to poll)."""
        return {text(k) for k in self.client.hkeys(self.key)}

    def records(self) -> dict[str, PartRecord]:
        raw = self.client.hgetall(self.key)
        return {text(k): _parse_record(v) for k, v in raw.items()}

    def wait(self) -> None:
        time.sleep(IDLE_S)

    def clear(self) -> None:
        self.client.delete(self.key)

    def close(self) -> None:
        if self.owner:
            end_fanout(self.client, self.fanout)


# Calls the diff workers in on a fan-out: each part key with the host it is routed to.
CallIn = Callable[[DeltaTask, list[tuple[str, str | None]]], None]


class FanoutSpread:
    """Spreads a coordinator's delta over the diff workers: publishes the fan-out and
    calls ``call_in`` with it and its parts, each with its host (the worker queues a
    job per part, on the host's queue when routed). ``host``: the coordinator's."""

    def __init__(self, client: redis.Redis, call_in: CallIn, host: str | None = None) -> None:
        self.client, self.call_in, self.host = client, call_in, host

    def __call__(self, task: DeltaTask, parent: Manifest) -> RedisLedger:
        start_fanout(self.client, task)
        ledger = RedisLedger(self.client, task, owner=True, host=self.host)
        self.call_in(task, [(key, ledger.host_of(key)) for key, _ in parent.parts()])
        return ledger


def work_parts(
    client: redis.Redis,
    store: ObjectStore,
    cache: StateCache,
    fanout: DeltaTask,
    parent: Manifest,
    *,
    first: str | None = None,
    on_part: Callable[[DeltaPart], None] | None = None,
    host: str | None = None,
) -> int:
    """A helper's share of ``fanout``: every unrecorded, unclaimed part (``first``
    first), encoded against the shared state cache. Returns the number of parts this
    call recorded; 0 when the cache does not hold the parent (a worker on another
    machine, or a cache being rebuilt)."""
    if not cache.is_valid_for(parent):
        return 0
    proven = cache.is_proven_for(parent)
    with CheckpointReader(fanout.checkpoint) as new, cache.reader() as base:
        return encode_parts(
            store,
            fanout,
            parent,
            base,
            new,
            RedisLedger(client, fanout, host=host),
            timings=PublishTimings(),
            base_proven=proven,
            on_part=on_part,
            first=first,
        )


def help_fanout(
    client: redis.Redis,
    store: ObjectStore,
    cache: StateCache,
    fanout: DeltaTask,
    *,
    first: str | None = None,
    on_part: Callable[[DeltaPart], None] | None = None,
    host: str | None = None,
) -> int:
    """:func:`work_parts` at best effort: whatever a helper fails to do, the
    coordinator does itself."""
    try:
        parent = chain.load_manifest(store, fanout.run, fanout.parent_kind, fanout.parent)
        return work_parts(
            client, store, cache, fanout, parent, first=first, on_part=on_part, host=host
        )
    except (DeltasyncError, OSError) as e:
        # The fan-out ended under us (checkpoint removed or adopted, cache advanced) or
        # the cache is damaged: the coordinator sees the same and acts on it.
        log.info("cannot help with the fan-out", version=fanout.step, error=str(e))
        return 0


def assemble(
    client: redis.Redis,
    store: ObjectStore,
    fanout: DeltaTask,
    parent: Manifest,
    signing_key: PrivateKey | None,
    tensor_form: str | None = None,
) -> Manifest:
    """Write the manifest of ``fanout``'s delta from its recorded parts (manifest last)."""
    records = RedisLedger(client, fanout).records()
    return assemble_delta(
        store, fanout, parent, records, signing_key=signing_key, tensor_form=tensor_form
    )
