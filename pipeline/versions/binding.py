"""A run is bound to one store: a random run-instance id kept in the store and in Redis.

The first publish of a run writes ``<run>/run.json`` (``{"instance": <32 hex>, "since":
<version>}``, in a signed envelope when the publisher signs) into the store, once, and
records ``{"store": <url>, "instance": ...}`` under ``deltasync:run:<run>:store`` in
Redis, once. Every manifest published from then on carries the instance id (covered
by its signature). A worker or node whose store holds another instance, or none, than
Redis records for the run is refused with one line: two stores on one Redis cannot
fork a run. A node with a verify key also checks the record's signature, with or
without Redis, so that a run that reuses an old run's name and key does not accept
the old run's signed versions (pipeline/rollout/node.py).

Redis may lose the binding (a restart without persistence, FLUSHALL); the store keeps
its record. Whoever sends a run work from the run's own store (the trainer's emitter,
`deltasync retry`, `deltasync compact`) restores the binding from that record first
(:func:`restore`), so a worker on another store still refuses the run.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

import structlog
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from pipeline.coord.connection import redis_errors
from pipeline.coord.events import check_run_name
from pipeline.coord.keys import binding_key
from pipeline.errors import ConfigError, CorruptObjectError, ObjectNotFoundError, SignatureError
from pipeline.format import sealed
from pipeline.format.bounded import MAX_REDIS_RECORD_BYTES, load_json
from pipeline.format.signing import SIGNS_RUN_RECORD, private_key_from, seal, verify_sealed
from pipeline.store.base import ObjectStore, put_if_absent, read_bounded
from pipeline.versions.index import list_versions

RECORD_NAME = "run.json"
MAX_RECORD_BYTES = 4096
INSTANCE_PATTERN = re.compile(r"^[0-9a-f]{32}$")

log = structlog.get_logger(__name__)

PrivateKey = Ed25519PrivateKey | bytes


class StoreBindingError(ConfigError):
    """This process's store is not the one the run is bound to (no fault of a step)."""


@dataclass(frozen=True)
class RunInstance:
    instance: str
    since: int  # manifests of older versions predate instance ids and may lack one


def record_key(run: str) -> str:
    return f"{check_run_name(run)}/{RECORD_NAME}"


def read_instance(
    store: ObjectStore, run: str, public_key: Ed25519PublicKey | bytes | None = None
) -> RunInstance | None:
    """The run's instance record in ``store``, None if it has none; CorruptObjectError if
    it is malformed. With ``public_key``: SignatureError unless the record is signed by
    that key."""
    key = record_key(run)
    try:
        data = read_bounded(store, key, MAX_RECORD_BYTES, what="run record")
    except ObjectNotFoundError:
        return None
    if public_key is not None:
        verify_sealed(data, SIGNS_RUN_RECORD, public_key, f"run record {key}")
    payload, _ = sealed.unwrap(data, f"run record {key}")
    doc = load_json(payload, max_bytes=MAX_RECORD_BYTES, what=key, error=CorruptObjectError)
    instance = doc.get("instance") if isinstance(doc, dict) else None
    since = doc.get("since") if isinstance(doc, dict) else None
    if (
        not isinstance(instance, str)
        or not INSTANCE_PATTERN.match(instance)
        or isinstance(since, bool)
        or not isinstance(since, int)
        or since < 0
    ):
        raise CorruptObjectError(f"run record {key} in {store.url} is malformed")
    return RunInstance(instance, since)


def record_bytes(instance: RunInstance, signing_key: PrivateKey | None) -> bytes:
    """``run.json`` as stored: signed when there is a key."""
    payload = sealed.canonical({"instance": instance.instance, "since": instance.since})
    return payload if signing_key is None else seal(payload, SIGNS_RUN_RECORD, signing_key)


def ensure_instance(
    store: ObjectStore, run: str, since: int, signing_key: PrivateKey | None = None
) -> RunInstance:
    """The run's instance in ``store``, created (once, atomically where the backend can)
    with ``since`` when there is none."""
    found = read_instance(store, run)
    if found is not None:
        return found
    fresh = RunInstance(secrets.token_hex(16), since)
    put_if_absent(store, record_key(run), record_bytes(fresh, signing_key))
    created = read_instance(store, run)
    assert created is not None  # just written, by this call or a concurrent one
    return created


def bind(client: Any, run: str, store: ObjectStore, instance: RunInstance) -> None:
    """Record ``store`` as the run's store in Redis unless one is recorded; ConfigError if
    Redis binds the run to another instance."""
    doc = json.dumps({"store": store.url, "instance": instance.instance}, sort_keys=True)
    with redis_errors(client, f"binding run {run} to its store"):
        client.set(binding_key(run), doc, nx=True)
    check(client, run, store, instance)


def bound(client: Any, run: str) -> tuple[str, str] | None:
    """(store URL, instance) that Redis binds ``run`` to, or None."""
    with redis_errors(client, f"reading the store of run {run}"):
        raw = client.get(binding_key(run))
    if raw is None:
        return None
    what = f"redis key {binding_key(run)}"
    doc = load_json(raw, max_bytes=MAX_REDIS_RECORD_BYTES, what=what, error=ConfigError)
    try:
        return str(doc["store"]), str(doc["instance"])
    except (TypeError, KeyError):
        raise ConfigError(f"{what} is malformed") from None


def check(client: Any, run: str, store: ObjectStore, instance: RunInstance | None) -> None:
    """ConfigError unless ``store`` (whose record is ``instance``) is the run's store."""
    binding = bound(client, run)
    if binding is None:
        return
    url, expected = binding
    if instance is None or instance.instance != expected:
        held = "no instance of it" if instance is None else f"instance {instance.instance[:8]}"
        raise StoreBindingError(
            f"run {run} is bound to store {url} (instance {expected[:8]}); this process's "
            f"store {store.url} holds {held}: check DELTASYNC_STORE"
        )


def check_store(client: Any, run: str, store: ObjectStore) -> RunInstance | None:
    """The run's instance after checking that ``store`` is the one Redis binds it to."""
    instance = read_instance(store, run)
    if instance is None and bound(client, run) is not None:
        # A publisher records the instance in its store before it binds Redis: a
        # binding seen after an empty read may have been made since, so read again.
        instance = read_instance(store, run)
    check(client, run, store, instance)
    return instance


def instance_for_publish(
    store: ObjectStore, run: str, signing_key: PrivateKey | None = None
) -> RunInstance:
    """The instance every new manifest of ``run`` carries; created with the run's first
    publish (for a run older than instance ids: the first one after them, so that its
    older manifests stay valid). With ``signing_key``, a record that is not signed by it
    (written by an earlier release, or before the key) is signed now: nodes with the
    verify key accept no version of a run whose record is not."""
    found = read_instance(store, run)
    if found is None:
        head = list_versions(store, run).head
        return ensure_instance(store, run, 0 if head is None else head + 1, signing_key)
    if signing_key is not None:
        try:
            read_instance(store, run, private_key_from(signing_key).public_key())
        except SignatureError:
            store.put(record_key(run), record_bytes(found, signing_key))
            log.info("run record signed", run=run, instance=found.instance[:8])
    return found


def bind_store(
    client: Any, run: str, store: ObjectStore, signing_key: PrivateKey | None = None
) -> RunInstance:
    """Before publishing to ``run``: StoreBindingError if Redis binds it to another
    store (checked before anything is written here), else bind it to this one."""
    check_store(client, run, store)
    instance = instance_for_publish(store, run, signing_key)
    bind(client, run, store, instance)
    return instance


def restore(client: Any, run: str, store: ObjectStore) -> bool:
    """Bind ``run`` in Redis again from the record in ``store`` when Redis holds no
    binding (it lost its data) and the store has a record: True if it did. Called only
    by processes whose store is the run's (they send it work), never by workers, which
    would bind the run to whatever store they were given."""
    if bound(client, run) is not None:
        return False
    instance = read_instance(store, run)
    if instance is None:
        return False
    bind(client, run, store, instance)
    return True
