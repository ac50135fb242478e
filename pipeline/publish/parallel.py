"""Parallel diff of one version: its parts encoded by several diff workers.

The job that holds the run's diff lease (the coordinator) publishes a *fan-out*
record for (run, step) in Redis once its state cache holds the parent version,
then encodes parts itself while other workers on the same machine do the same:
each part is claimed with a renewed lease, encoded against the shared state
cache, uploaded, and its tensor entries recorded in a Redis hash. Once every
part is recorded the coordinator writes the manifest (last), advances the
cache and clears the fan-out. A dead claimant's lease expires and its part is
claimed again; the manifest appears only when every part is recorded, and the
coordinator holds the diff lease throughout, so steps of a run stay in order.

Helpers only read the coordinator's state cache (``cache_dir`` shared on one
machine): it changes only after every part is recorded.

Part records are kept per (step, parent): a step whose coordinator died is redone
by the next coordinator, which reuses the records only when the head is still the
parent they were encoded against.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any

import redis
import structlog

from pipeline import config
from pipeline.codec import encode_delta, read_delta
from pipeline.coord.events import DeltaPart
from pipeline.coord.hints import publish_part
from pipeline.coord.keys import fanout_key, part_records_key
from pipeline.coord.replicas import run_lock
from pipeline.errors import (
    ChainError,
    DeltasyncError,
    LockError,
    MismatchError,
    ObjectNotFoundError,
)
from pipeline.format import content_hashes
from pipeline.format.checkpoint import CheckpointReader
from pipeline.format.checkpoint_names import published_form
from pipeline.format.hashing import sha256_bytes
from pipeline.format.manifest import (
    Kind,
    Manifest,
    ObjectEntry,
    TensorEntry,
    version_prefix,
)
from pipeline.publish.state_cache import StateCache
from pipeline.publish.version import (
    PrivateKey,
    delta_manifest,
    hash_pool,
    submit_hashes,
    tensor_entry,
    updated_hashes,
    write_manifest,
)
from pipeline.store.base import ObjectStore
from pipeline.testing import faults
from pipeline.versions import chain

log = structlog.get_logger(__name__)

PART_LEASE_S = config.LOCK_LEASE_S
PART_RENEW_S = config.LOCK_RENEW_S
FANOUT_TTL_S = config.FANOUT_TTL_S


def part_lock(step: int, index: int) -> str:
    """The name of the run lock that claims part ``index`` of ``step``."""
    return f"part-{step}-{index}"


@dataclass(frozen=True)
class Fanout:
    """The step being diffed part by part, against which parent, from which checkpoint."""

    run: str
    step: int
    checkpoint: str
    parent: int
    parent_kind: Kind
    level: int

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Fanout:
        doc = json.loads(text)
        return cls(
            run=str(doc["run"]),
            step=int(doc["step"]),
            checkpoint=str(doc["checkpoint"]),
            parent=int(doc["parent"]),
            parent_kind="anchor" if doc["parent_kind"] == "anchor" else "delta",
            level=int(doc["level"]),
        )


def start_fanout(client: redis.Redis, fanout: Fanout) -> None:
    client.set(fanout_key(fanout.run), fanout.to_json(), px=int(FANOUT_TTL_S * 1000))


def current_fanout(client: redis.Redis, run: str) -> Fanout | None:
    raw = client.get(fanout_key(run))
    return None if raw is None else Fanout.from_json(raw)


def end_fanout(client: redis.Redis, fanout: Fanout) -> None:
    """Stop helpers starting on ``fanout``. Its part records stay until they expire: a
    helper that read the fan-out just before sees every part recorded and does nothing."""
    client.delete(fanout_key(fanout.run))


def _record_json(obj: ObjectEntry, entries: list[TensorEntry]) -> str:
    return json.dumps(
        {"object": asdict(obj), "tensors": [asdict(e) for e in entries]}, sort_keys=True
    )


def _parse_record(text: str | bytes) -> tuple[ObjectEntry, list[TensorEntry]]:
    doc: dict[str, Any] = json.loads(text)
    obj = ObjectEntry(**doc["object"])
    tensors = [TensorEntry(**{**t, "shape": tuple(t["shape"])}) for t in doc["tensors"]]
    return obj, tensors


def recorded(client: redis.Redis, fanout: Fanout) -> dict[str, str]:
    raw = client.hgetall(part_records_key(fanout.run, fanout.step, fanout.parent))
    return {
        (k.decode() if isinstance(k, bytes) else str(k)): (
            v.decode() if isinstance(v, bytes) else str(v)
        )
        for k, v in raw.items()
    }


def encode_part(
    store: ObjectStore,
    fanout: Fanout,
    parent: Manifest,
    key: str,
    names: list[str],
    base: CheckpointReader,
    new: CheckpointReader,
) -> tuple[ObjectEntry, list[TensorEntry]]:
    """Encode one part against ``base`` (which must hold ``parent``) and upload it once."""
    parent_hashes = {t.name: t.hash for t in parent.tensors}
    pairs = [(n, base.view(n), new.view(n)) for n in names]
    # Base and new are hashed on other threads while the codec encodes, as in publish_delta.
    algorithm = content_hashes.of(parent)
    # An incremental hash: the base is still proven in full, the new hashes come from
    # the parent's and the changes.
    hashed = [(n, b, b.reshape(-1)[:0]) for n, b, _ in pairs] if algorithm.incremental else pairs
    with hash_pool() as hasher:
        hashes = submit_hashes(hasher, hashed, algorithm)
        data = encode_delta(pairs, fanout.level)
        base_hashes, new_hashes = hashes()
    for n, digest in base_hashes.items():
        if digest != parent_hashes[n]:
            raise MismatchError(
                f"base tensor {n!r} in {base.path} does not match version {parent.version}"
            )
    delta = read_delta(data, object_name=key)
    if algorithm.incremental:
        new_hashes = updated_hashes(delta, pairs, parent_hashes, algorithm)
    changed = {i.name: i.changed for i in delta.tensors}
    entries = [tensor_entry(n, t, key, changed[n], new_hashes[n]) for n, _, t in pairs]
    obj = ObjectEntry(key=key, size=len(data), sha256=sha256_bytes(data))
    del pairs
    base.close()
    new.close()
    faults.point("parallel.after_encode")
    object_key = version_prefix(fanout.run, "delta", fanout.step) + key
    # A retry after a crash that uploaded this very part does not upload it again; an
    # object left by an encoding against another parent is replaced.
    if not _holds(store, object_key, obj):
        store.put(object_key, data)
    faults.point("parallel.after_upload")
    return obj, entries


def _holds(store: ObjectStore, key: str, obj: ObjectEntry) -> bool:
    """Whether ``key`` already holds exactly ``obj``'s bytes."""
    try:
        if not store.exists(key) or store.size(key) != obj.size:
            return False
        return sha256_bytes(store.get(key)) == obj.sha256
    except ObjectNotFoundError:
        return False


def work_parts(
    client: redis.Redis,
    store: ObjectStore,
    cache: StateCache,
    fanout: Fanout,
    parent: Manifest,
    *,
    first: str | None = None,
) -> int:
    """Claim and encode every unrecorded, unclaimed part of ``fanout`` (``first`` first).

    Returns the number of parts this call recorded; 0 when the cache does not hold the
    parent (a worker on another machine, or a cache being rebuilt).
    """
    if not cache.is_valid_for(parent):
        return 0
    parts = parent.parts()
    if first is not None:
        parts.sort(key=lambda p: p[0] != first)
    index_of = {key: i for i, (key, _) in enumerate(parent.parts())}
    records = part_records_key(fanout.run, fanout.step, fanout.parent)
    done = 0
    with CheckpointReader(fanout.checkpoint) as new, cache.reader() as base:
        for key, names in parts:
            if client.hexists(records, key):
                continue
            try:
                with run_lock(
                    client,
                    fanout.run,
                    part_lock(fanout.step, index_of[key]),
                    PART_LEASE_S,
                    wait_s=0.0,
                    renew_every_s=PART_RENEW_S,
                ):
                    if client.hexists(records, key):
                        continue
                    started = time.perf_counter()
                    obj, entries = encode_part(store, fanout, parent, key, names, base, new)
                    client.hsetnx(records, key, _record_json(obj, entries))
                    client.pexpire(records, int(FANOUT_TTL_S * 1000))
                    done += 1
                    publish_part(
                        client,
                        DeltaPart.now(
                            run=fanout.run,
                            version=fanout.step,
                            parent=fanout.parent,
                            key=key,
                            size=obj.size,
                            sha256=obj.sha256,
                        ),
                    )
                    log.info(
                        "part encoded",
                        run=fanout.run,
                        version=fanout.step,
                        part=key,
                        bytes=obj.size,
                        seconds=round(time.perf_counter() - started, 4),
                    )
            except LockError:
                continue  # another worker holds this part
    return done


def _form_of(fanout: Fanout) -> str | None:
    """The tensor form the trainer recorded in the step's checkpoint (None: unknown)."""
    try:
        with CheckpointReader(fanout.checkpoint) as reader:
            return published_form(reader)
    except (DeltasyncError, OSError):
        return None


def assemble(
    client: redis.Redis,
    store: ObjectStore,
    fanout: Fanout,
    parent: Manifest,
    signing_key: PrivateKey | None,
) -> Manifest:
    """Write the manifest of ``fanout``'s delta from its recorded parts (manifest last),
    only while its parent is still the head (a coordinator whose lease lapsed while it
    waited must not publish behind a newer version)."""
    records = recorded(client, fanout)
    objects: list[ObjectEntry] = []
    entries: list[TensorEntry] = []
    for key, names in parent.parts():
        if key not in records:
            raise ChainError(f"run {fanout.run}: part {key} of delta {fanout.step} is not recorded")
        obj, tensors = _parse_record(records[key])
        if [t.name for t in tensors] != names:
            raise MismatchError(
                f"run {fanout.run}: part {key} of delta {fanout.step} holds other tensors"
            )
        objects.append(obj)
        entries.extend(tensors)
    head = chain.list_versions(store, fanout.run).head
    if head != fanout.parent:
        raise ChainError(
            f"run {fanout.run}: delta {fanout.step} was diffed against version "
            f"{fanout.parent}, but the head is now {head}"
        )
    manifest = delta_manifest(
        fanout.run, fanout.step, parent, fanout.level, objects, entries, _form_of(fanout)
    )
    manifest = write_manifest(store, manifest, signing_key, "parallel")
    log.info(
        "delta published in parallel",
        run=fanout.run,
        version=fanout.step,
        parts=len(objects),
        bytes=manifest.total_bytes,
    )
    return manifest
