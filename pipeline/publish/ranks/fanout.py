"""A sharded step's fan-out in Redis: the record of the step being diffed part by part,
the parts routed to trainer hosts, and the part records its hosts' workers write.

The coordinator (the diff job holding the run's diff lease) publishes the fan-out
record for (run, step) and calls the hosts' diff workers in
(:mod:`pipeline.publish.ranks.sharded`). Each part is claimed with a renewed lease (a run
lock), encoded, uploaded, and its record written to a Redis hash; once every part is
recorded the coordinator writes the manifest (last) and ends the fan-out. A dead
claimant's lease expires and its part is claimed again.

Part records are kept per (step, parent): a step whose coordinator died is redone
by the next coordinator, which reuses the records only when the head is still the
parent they were encoded against.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

import redis

from pipeline import config
from pipeline.coord.connection import text
from pipeline.coord.keys import fanout_key, part_hosts_key, part_records_key
from pipeline.coord.replicas import run_lock
from pipeline.errors import LockError
from pipeline.format.manifest import ObjectEntry, Piece, TensorEntry
from pipeline.format.pieces import StoredPiece
from pipeline.publish.diff import DeltaTask, PartRecord

PART_LEASE_S = config.LOCK_LEASE_S
PART_RENEW_S = config.LOCK_RENEW_S
FANOUT_TTL_S = config.FANOUT_TTL_S


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
    return json.dumps(asdict(task), sort_keys=True)


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

    def close(self) -> None:
        if self.owner:
            end_fanout(self.client, self.fanout)


# Calls the hosts' diff workers in on a fan-out: each part key with its host.
CallIn = Callable[[DeltaTask, list[tuple[str, str]]], None]
