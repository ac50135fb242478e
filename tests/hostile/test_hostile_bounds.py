"""Hostile sizes and depths: deeply nested JSON in events and manifests, objects that
are huge, sparse, endless (a FIFO) or not what their manifest declares. Each is a
one-line DeltasyncError, read boundedly; readers (`deltasync tail`, a running rollout
node) survive it. The fuzzers here reach the depths and sizes the small ones in
test_hostile_input.py never do."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.codec.anchor import anchor_tensors, encode_anchor
from pipeline.config import Settings
from pipeline.coord.connection import redis_client
from pipeline.coord.events import MAX_EVENT_BYTES, DeltaApplied, parse_event
from pipeline.coord.stream import ENTRY_FIELD, EventStream
from pipeline.errors import (
    CorruptObjectError,
    DeltasyncError,
    EventError,
    SignatureError,
    StoreError,
)
from pipeline.format.bounded import MAX_JSON_DEPTH, json_depth, load_json
from pipeline.format.manifest import MAX_MANIFEST_BYTES, manifest_key
from pipeline.format.manifest_parse import parse_manifest
from pipeline.format.signing import generate_keypair, load_public_key
from pipeline.publish.caches.state_cache import StateCache
from pipeline.publish.step import publish_step
from pipeline.store import ObjectStore, open_store
from pipeline.store.base import read_bounded
from pipeline.store.file import FileStore
from pipeline.store.trust import trusted
from pipeline.versions import chain
from tests.pipeline_helpers import cli, deltasync_env, processes, wait_for
from workers.trainers.trainer import Emitter

pytestmark = pytest.mark.kernels  # rerun with bounds checks (scripts/test.sh)

FUZZ = settings(
    max_examples=int(os.environ.get("DELTASYNC_FUZZ_EXAMPLES", "60")),
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
RUN = "bounds"
DEEP = "[" * 50_000


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16)}


def _publish(tmp: Path, steps: int = 2) -> FileStore:
    from pipeline.format.checkpoints.checkpoint_write import write_checkpoint

    store = FileStore(tmp / "store")
    cache = StateCache(tmp / "cache", RUN)
    for step in range(steps):
        state = _state(0)
        state["a.weight"][0, :step] += 1
        path = tmp / f"{step}.safetensors"
        write_checkpoint(path, state.items())
        publish_step(store, RUN, step, path, cache)
    return store


# --------------------------------------------------------------------------- JSON depth


@pytest.mark.parametrize(
    "payload",
    [DEEP, "{" + '"a":{' * 12_000, '{"type":"step-completed","run":' + DEEP, "[" * 40 + "]" * 40],
)
def test_deep_events_are_one_line_errors(payload: str) -> None:
    assert len(payload) <= MAX_EVENT_BYTES
    with pytest.raises(EventError) as caught:
        parse_event(payload)
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 300


def test_a_deep_field_value_is_refused_before_it_is_printed() -> None:
    nested: object = 0
    for _ in range(5000):
        nested = [nested]
    with pytest.raises(EventError, match="nested deeper"):
        parse_event({"type": "step-completed", "schema": 1, "run": nested})


def _nested(depth: int, leaf: object) -> object:
    doc = leaf
    for level in range(depth):
        doc = [1, "x", doc] if level % 2 else {"a": 0, "b": doc}
    return doc


@pytest.mark.parametrize("depth", [0, 1, 2, 7, MAX_JSON_DEPTH - 1, MAX_JSON_DEPTH])
def test_json_depth_counts_the_deepest_branch(depth: int) -> None:
    # Scalars beside every level; the deepest branch is the last child.
    doc = _nested(depth, 5)
    assert json_depth(doc) == depth
    assert json_depth(json.loads(json.dumps(doc))) == depth
    assert json_depth(_nested(depth, [])) == depth + 1  # an empty list is a level
    assert json_depth([{}, [[]], doc]) == max(3, depth + 1)  # shallow siblings first


def test_json_at_the_depth_limit_loads_and_one_level_more_does_not() -> None:
    text = json.dumps(_nested(MAX_JSON_DEPTH, 5))
    assert load_json(text, max_bytes=len(text), what="doc", error=EventError) is not None
    deeper = json.dumps(_nested(MAX_JSON_DEPTH + 1, 5))
    with pytest.raises(EventError, match="nested deeper than 32 levels"):
        load_json(deeper, max_bytes=len(deeper), what="doc", error=EventError)


@pytest.mark.parametrize("payload", [b"[" * 100_000, b'{"schema":1,"extra":' + b"[" * 100_000])
def test_deep_manifests_are_one_line_errors(payload: bytes) -> None:
    with pytest.raises(CorruptObjectError, match="nested deeper") as caught:
        parse_manifest(payload, source="m")
    assert "\n" not in str(caught.value)


@FUZZ
@given(
    depth=st.integers(1, 120_000),
    opener=st.sampled_from(["[", '{"a":', '{"type":"delta-available","schema":1,"run":']),
    tail=st.binary(max_size=64),
)
def test_fuzz_deep_inputs(depth: int, opener: str, tail: bytes) -> None:
    blob = (opener * depth).encode() + tail
    with contextlib.suppress(DeltasyncError):
        parse_event(blob[:MAX_EVENT_BYTES])
    with contextlib.suppress(DeltasyncError):
        parse_manifest(blob, source="fuzzed")


@FUZZ
@given(size=st.integers(MAX_EVENT_BYTES - 64, MAX_EVENT_BYTES + 64), fill=st.binary(max_size=8))
def test_fuzz_large_events(size: int, fill: bytes) -> None:
    body = (fill or b"x") * (size // max(1, len(fill) or 1))
    blob = b'{"type":"step-completed","schema":1,"run":"r","pad":"' + body[:size] + b'"}'
    with contextlib.suppress(DeltasyncError):
        parse_event(blob)


def test_an_oversized_manifest_is_refused_without_reading_it(tmp_path: Path) -> None:
    store = _publish(tmp_path, 1)
    path = store.root / manifest_key(RUN, "anchor", 0)
    with open(path, "r+b") as f:  # sparse: no disk, and never read
        f.truncate(MAX_MANIFEST_BYTES + 10)
    with pytest.raises(CorruptObjectError, match="more than"):
        chain.load_manifest(store, RUN, "anchor", 0)


# --------------------------------------------------------------------------- signature first


def test_a_verifying_reader_checks_the_signature_before_the_schema(tmp_path: Path) -> None:
    """An unsigned manifest whose schema is broken fails as unsigned: nothing unsigned
    is interpreted. A deep one is refused as unsigned too, from its first bytes;
    without a key, at the depth bound."""
    store = _publish(tmp_path, 1)
    _, public = generate_keypair(tmp_path / "keys")
    key = manifest_key(RUN, "anchor", 0)
    doc = json.loads(store.get(key))
    doc["tensors"] = "not a list"
    store.put(key, json.dumps(doc).encode())
    with pytest.raises(CorruptObjectError, match="tensors is not a list"):
        chain.load_manifest(store, RUN, "anchor", 0)
    verified = trusted(store, load_public_key(public))
    with pytest.raises(SignatureError, match="anchor 0 of run bounds is not signed"):
        chain.load_manifest(verified, RUN, "anchor", 0)
    store.put(key, b"[" * 100_000)
    with pytest.raises(SignatureError, match="is not signed"):
        chain.load_manifest(verified, RUN, "anchor", 0)
    with pytest.raises(CorruptObjectError, match="nested deeper"):
        chain.load_manifest(store, RUN, "anchor", 0)


# --------------------------------------------------------------------------- bounded objects


def _object_path(store: FileStore, kind: str = "anchor", version: int = 0) -> tuple[Path, int]:
    m = chain.load_manifest(store, RUN, kind, version)  # type: ignore[arg-type]
    entry = m.objects[0]
    return store.root / m.object_key(entry.key), entry.size


def test_a_sparse_6_gib_file_in_place_of_an_object_is_refused_unread(tmp_path: Path) -> None:
    store = _publish(tmp_path, 1)
    path, size = _object_path(store)
    path.unlink()
    with open(path, "wb") as f:
        f.truncate(6 << 30)
    m = chain.load_manifest(store, RUN, "anchor", 0)
    with pytest.raises(CorruptObjectError, match=f"more than {size} expected") as caught:
        chain.fetch_object(store, m, m.objects[0])
    assert "\n" not in str(caught.value)


def test_a_fifo_in_place_of_an_object_is_refused_without_blocking(tmp_path: Path) -> None:
    store = _publish(tmp_path, 1)
    path, _ = _object_path(store)
    path.unlink()
    os.mkfifo(path)
    m = chain.load_manifest(store, RUN, "anchor", 0)
    outcome: list[BaseException] = []

    def read() -> None:
        try:
            chain.fetch_object(store, m, m.objects[0])
        except BaseException as exc:
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(60)
    if reader.is_alive():  # unblock it before failing
        with open(path, "wb"):
            pass
        pytest.fail("reading a FIFO in place of an object blocked")
    assert len(outcome) == 1 and isinstance(outcome[0], StoreError)
    assert "not a regular file" in str(outcome[0])


def test_every_backend_reads_at_most_the_declared_size(store: ObjectStore) -> None:
    store.put("r/big", b"x" * 100_000)
    store.put("r/small", b"y" * 474)
    store.put("r/empty", b"")
    with pytest.raises(CorruptObjectError, match="474"):
        read_bounded(store, "r/big", 474)
    assert read_bounded(store, "r/small", 474) == b"y" * 474
    assert read_bounded(store, "r/empty", 0) == b""
    with pytest.raises(CorruptObjectError):
        read_bounded(store, "r/small", 473)


def test_anchor_records_are_checked_against_the_manifest_before_decoding() -> None:
    tensor = torch.arange(4096, dtype=torch.float32).to(torch.bfloat16)
    for compression in ("zstd", "none"):
        data = encode_anchor([("w", tensor)], compression)
        good = {"w": ("bfloat16", (4096,))}
        assert torch.equal(dict(anchor_tensors(data, "obj", good))["w"], tensor)
        with pytest.raises(CorruptObjectError, match="does not list"):
            list(anchor_tensors(data, "obj", {"other": ("bfloat16", (4096,))}))
        with pytest.raises(CorruptObjectError, match="declared"):
            list(anchor_tensors(data, "obj", {"w": ("bfloat16", (1 << 29,))}))


# --------------------------------------------------------------------------- real readers


def test_tail_and_a_running_node_survive_a_deep_event(tmp_path: Path, redis_url: str) -> None:
    """A 50,000-deep `[` in the stream: `deltasync tail` prints the events around it, and
    a rollout node that is following the run goes on to apply the next version."""
    env = deltasync_env(redis_url, tmp_path)
    run = "deep"
    client = redis_client(redis_url)
    stream = EventStream(client, run)
    store = open_store(Settings.from_env(env).store_url)
    emitter = Emitter(run, settings=Settings.from_env(env))
    with processes(
        env,
        tmp_path / "logs",
        diff=["worker", "diff"],
        node=["rollout", "--run", run, "--wait", "--node-id", "n1", "--poll", "0.3"],
    ):
        emitter.emit_state(0, _state(0))

        def applied(version: int) -> bool:
            return any(
                isinstance(e, DeltaApplied) and e.node == "n1" and e.version == version
                for _, e in stream.read("0-0", count=1000)
            )

        wait_for(lambda: applied(0), "the node to apply version 0")
        client.xadd(stream.key, {ENTRY_FIELD: DEEP})
        client.xadd(stream.key, {ENTRY_FIELD: "{" * 20_000})
        state = _state(0)
        state["a.weight"][3, :7] += 1
        emitter.emit_state(1, state)
        wait_for(lambda: applied(1), "the node to apply version 1 after the deep event")
        wait_for(lambda: chain.list_versions(store, run).head == 1, "the head")
    out = cli(env, "tail", "--run", run)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "delta-applied" in out.stdout and "v1" in out.stdout
    assert "Traceback" not in out.stderr


def test_a_decode_error_blames_the_object_and_a_broken_install_blames_the_install() -> None:
    """A damaged object may trip any parser: reported as that object's corruption. A
    codec that cannot be imported is not the object's fault: it says so."""
    from pipeline.errors import CorruptObjectError, TargetError
    from pipeline.format.manifest import TensorEntry
    from pipeline.targets.patching import guarded

    entry = TensorEntry("w", "bfloat16", (4,), "0" * 32, "part-00000.safetensors", 1)
    held = torch.zeros(4, dtype=torch.bfloat16)

    def tripped(name: str, tensor: torch.Tensor) -> None:
        raise ValueError("bad stream")

    def broken(name: str, tensor: torch.Tensor) -> None:
        raise ImportError("cannot import name 'x' from partially initialized module")

    with pytest.raises(CorruptObjectError, match=r"part-00000\.safetensors: bad stream"):
        guarded(tripped, entry, held)
    with pytest.raises(TargetError, match="the codec cannot be loaded") as caught:
        guarded(broken, entry, held)
    assert not isinstance(caught.value, CorruptObjectError)
