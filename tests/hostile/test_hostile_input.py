"""Hostile and malformed input: garbage events, wrong schemas, traversal and control
characters in run and tensor names, absurd safetensors headers, manifests naming
objects outside their run, poisoned rq jobs. Each is rejected with a reason, writes
nothing outside the store, and never stops a worker from taking the next good job.
The event parser, the manifest parser and the delta decoder are fuzzed: only
DeltasyncError subclasses may escape them."""

from __future__ import annotations

import contextlib
import json
import os
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from pipeline.codec import encode_delta, read_delta
from pipeline.config import Settings
from pipeline.coord.connection import redis_client
from pipeline.coord.events import parse_event
from pipeline.coord.stream import EventStream
from pipeline.errors import ConfigError, CorruptObjectError, DeltasyncError, EventError
from pipeline.format.checkpoints.checkpoint import CheckpointReader, tensors_from_bytes
from pipeline.format.manifest import manifest_key
from pipeline.format.manifest_parse import parse_manifest
from pipeline.publish.caches.state_cache import StateCache
from pipeline.publish.step import publish_step
from pipeline.rollout.node import NodeOptions, RolloutNode
from pipeline.store import open_store
from pipeline.store.file import FileStore
from pipeline.targets.torch import TorchTarget
from tests.pipeline_helpers import cli, deltasync_env, processes, wait_for
from workers import queues
from workers.trainers.trainer import Emitter

pytestmark = pytest.mark.kernels  # rerun with bounds checks (scripts/test.sh)

FUZZ = settings(
    # benchmarks/reliability.py raises this for its longer runs.
    max_examples=int(os.environ.get("DELTASYNC_FUZZ_EXAMPLES", "300")),
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
RUN = "hostile"


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file()}


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "b.bias": torch.randn(32, generator=g),
    }


def _write(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    from pipeline.format.checkpoints.checkpoint_write import write_checkpoint

    path.parent.mkdir(parents=True, exist_ok=True)
    write_checkpoint(path, tensors.items())
    return path


# --------------------------------------------------------------------------- events


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\x00\xff garbage", "not JSON"),
        (b"[1, 2]", "not an object"),
        (json.dumps({"type": "delta-available", "schema": 99}), "unsupported schema"),
        (json.dumps({"type": "delta-available", "schema": True}), "unsupported schema"),
        (json.dumps({"type": "rm -rf", "schema": 1}), "unknown event type"),
        ("x" * 70_000, "exceeds"),
        (
            json.dumps(
                {
                    "type": "step-completed",
                    "schema": 1,
                    "run": "../../etc",
                    "version": 1,
                    "checkpoint": "/x",
                    "owned": False,
                    "time": "2024-01-01T00:00:00Z",
                }
            ),
            "invalid run name",
        ),
        (
            json.dumps(
                {
                    "type": "step-completed",
                    "schema": 1,
                    "run": "r",
                    "version": 1,
                    "checkpoint": "/x\n",
                    "owned": False,
                    "time": "2024-01-01T00:00:00Z",
                }
            ),
            "control character",
        ),
        (
            json.dumps(
                {
                    "type": "step-completed",
                    "schema": 1,
                    "run": "r",
                    "version": 1e400,
                    "checkpoint": "/x",
                    "owned": False,
                    "time": "2024-01-01T00:00:00Z",
                }
            ),
            "version",
        ),
    ],
)
def test_malformed_events_are_rejected_with_a_reason(payload: str | bytes, reason: str) -> None:
    with pytest.raises(EventError, match=reason) as caught:
        parse_event(payload)
    assert "\n" not in str(caught.value)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner),
    max_leaves=12,
)
EVENT_KEYS = [
    "type",
    "schema",
    "run",
    "version",
    "time",
    "checkpoint",
    "owned",
    "kind",
    "parent",
    "anchor",
    "bytes",
    "changed",
    "total",
    "manifest",
    "node",
    "error",
]


@FUZZ
@given(
    st.one_of(
        st.binary(max_size=300),
        st.text(max_size=300),
        st.dictionaries(st.sampled_from(EVENT_KEYS), json_values, max_size=10),
    )
)
def test_fuzz_event_parser(data: bytes | str | dict[str, object]) -> None:
    with contextlib.suppress(DeltasyncError):
        parse_event(data)


# --------------------------------------------------------------------------- manifests


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> tuple[FileStore, bytes, bytes]:
    tmp = tmp_path_factory.mktemp("hostile")
    store = FileStore(tmp / "store")
    cache = StateCache(tmp / "cache", RUN)
    for step in (0, 1):
        state = _state(0)
        if step:
            state["a.weight"][0, :5] += 1
        publish_step(store, RUN, step, _write(tmp / f"{step}.safetensors", state), cache)
    manifest = store.get(manifest_key(RUN, "delta", 1))
    delta = store.get(f"{RUN}/deltas/{1:010d}/part-00000.safetensors")
    return store, manifest, delta


@pytest.mark.parametrize(
    "bad_key",
    ["../../other/deltas/0000000001/part-00000.safetensors", "/etc/passwd", "a/../../b",
     "manifest.json", "part\x00.safetensors", "C:\\x"],
)  # fmt: skip
def test_manifest_naming_objects_outside_its_folder_is_refused(
    published: tuple[FileStore, bytes, bytes], bad_key: str
) -> None:
    _, manifest, _ = published
    doc = json.loads(manifest)
    good = doc["objects"][0]["key"]
    doc["objects"][0]["key"] = bad_key
    for t in doc["tensors"]:
        if t["object"] == good:
            t["object"] = bad_key
    with pytest.raises(CorruptObjectError, match="manifest"):
        parse_manifest(json.dumps(doc), expected_run=RUN, expected_version=1)


def test_node_refuses_a_manifest_pointing_outside_the_run(
    published: tuple[FileStore, bytes, bytes], tmp_path: Path, redis_url: str
) -> None:
    store, manifest, _ = published
    own = FileStore(tmp_path / "store")
    for key in store.list(f"{RUN}/"):
        own.put(key, store.get(key))
    own.put("other/secret", b"not yours")
    doc = json.loads(manifest)
    doc["version"], doc["parent"] = 2, 1
    doc["objects"][0]["key"] = "../../../other/secret"
    for t in doc["tensors"]:
        t["object"] = "../../../other/secret"
    own.put(manifest_key(RUN, "delta", 2), json.dumps(doc).encode())
    target = TorchTarget({n: torch.empty_like(t) for n, t in _state(0).items()})
    events = EventStream(redis_client(redis_url), RUN)
    node = RolloutNode(own, RUN, target, NodeOptions(node_id="n", prefetch=False), events=events)
    before = _files(tmp_path)
    assert node.step_once() != 2  # never applied
    assert isinstance(node.last_error, CorruptObjectError)
    assert "not a plain name" in str(node.last_error)
    assert _files(tmp_path) == before
    errors = [e for _, e in events.read(after_id="0-0") if e.type == "replica-error"]
    assert errors


def _flip_bytes(data: bytes, draws: list[tuple[int, int]]) -> bytes:
    out = bytearray(data)
    for pos, value in draws:
        out[pos % len(out)] = value
    return bytes(out)


@FUZZ
@given(st.data())
def test_fuzz_manifest_parser(
    published: tuple[FileStore, bytes, bytes], data: st.DataObject
) -> None:
    _, manifest, _ = published
    mode = data.draw(st.sampled_from(["bytes", "truncate", "json"]))
    if mode == "bytes":
        edits = data.draw(st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)),
                                   min_size=1, max_size=6))  # fmt: skip
        blob: bytes | str = _flip_bytes(manifest, edits)
    elif mode == "truncate":
        blob = manifest[: data.draw(st.integers(0, len(manifest)))]
    else:
        doc = json.loads(manifest)
        key = data.draw(st.sampled_from(sorted(doc)))
        doc[key] = data.draw(json_values)
        blob = json.dumps(doc)
    with contextlib.suppress(DeltasyncError):
        parse_manifest(blob, expected_run=RUN, expected_version=1, expected_kind="delta")


# --------------------------------------------------------------------------- deltas


@pytest.fixture(scope="module")
def delta_case() -> tuple[bytes, dict[str, torch.Tensor]]:
    base = _state(3)
    new = {n: t.clone() for n, t in base.items()}
    new["a.weight"].view(torch.int16)[::7] += 1
    new["b.bias"][3] = float("nan")
    data = encode_delta([(n, base[n], new[n]) for n in base], 1)
    return data, base


@FUZZ
@given(st.data())
def test_fuzz_delta_decoder(
    delta_case: tuple[bytes, dict[str, torch.Tensor]], data: st.DataObject
) -> None:
    blob, base = delta_case
    mode = data.draw(st.sampled_from(["bytes", "truncate", "header"]))
    if mode == "bytes":
        edits = data.draw(st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)),
                                   min_size=1, max_size=4))  # fmt: skip
        mutated = _flip_bytes(blob, edits)
    elif mode == "truncate":
        mutated = blob[: data.draw(st.integers(0, len(blob)))]
    else:
        (n,) = struct.unpack("<Q", blob[:8])
        header = bytearray(blob[8 : 8 + n])
        edits = data.draw(
            st.lists(st.tuples(st.integers(0, n - 1), st.integers(32, 126)), max_size=4)
        )
        for pos, value in edits:
            header[pos] = value
        mutated = blob[:8] + bytes(header) + blob[8 + n :]
    try:
        delta = read_delta(mutated, object_name="fuzzed")
        for name, tensor in base.items():
            delta.decode(name, tensor.clone())
    except DeltasyncError:
        pass


def _safetensors(header: object, body: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + body


def _f32(offsets: list[int], shape: list[int] | None = None) -> dict[str, object]:
    return {"dtype": "F32", "shape": shape or [4], "data_offsets": offsets}


@pytest.mark.parametrize(
    "blob",
    [
        b"",
        b"\x00" * 7,
        struct.pack("<Q", 2**63) + b"{}",
        struct.pack("<Q", 10**9) + b"{}",
        struct.pack("<Q", 2) + b"[]",
        _safetensors({"t": _f32([0, 1600])}, b"\x00" * 16),  # data past the end
        _safetensors({"t": _f32([2, 2**64 - 1])}, b"\x00" * 16),  # absurd offsets
        _safetensors({"t": _f32([0, 16], [10**12])}, b"\x00" * 16),  # absurd shape
        _safetensors({"a": _f32([0, 16]), "b": _f32([8, 24])}, b"\x00" * 24),  # overlap
        _safetensors({"t": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}}, b"\x00" * 16),
        _safetensors({"t": _f32([0, 16]), "__metadata__": {"k": 1}}, b"\x00" * 16),
    ],
)
def test_absurd_safetensors_headers_are_corrupt_objects(blob: bytes, tmp_path: Path) -> None:
    with pytest.raises(CorruptObjectError):
        list(tensors_from_bytes(blob, "evil.safetensors"))
    path = tmp_path / "evil.safetensors"
    path.write_bytes(blob)
    with pytest.raises(CorruptObjectError), CheckpointReader(path) as reader:
        for name in reader.names():
            reader.get(name)


@pytest.mark.parametrize("run", ["../evil", "a/b", "", "a\nb", "a\x1b[31m", "." * 3, "x" * 200])
def test_hostile_run_names_are_refused(run: str, tmp_path: Path, redis_url: str) -> None:
    settings_ = Settings.from_env(deltasync_env(redis_url, tmp_path))
    with pytest.raises(ConfigError):
        Emitter(run, settings=settings_)
    assert not (tmp_path / "home").exists() or not any("evil" in str(p) for p in _files(tmp_path))


# --------------------------------------------------------------------------- workers


def _poison_and_good_jobs(env: dict[str, str], tmp: Path, redis_url: str) -> list[str]:
    """Enqueue jobs a worker must refuse, then one good one; returns the bad job ids."""
    r = redis_client(redis_url)
    evil = tmp / "evil.safetensors"
    evil.write_bytes(struct.pack("<Q", 2**40) + b"{}")
    traversal = _write(
        tmp / "names.safetensors", {"../../../../escape\n": torch.zeros(4), "ok": torch.ones(4)}
    )
    bad: list[str] = []
    for kwargs in (
        {"run": "../../escape", "step": 1, "checkpoint": str(evil), "owned": True},
        {"run": "okrun", "step": 1, "checkpoint": str(evil), "owned": True},
        {"run": "okrun", "step": 2, "checkpoint": "/nonexistent/x", "owned": True},
        {"run": "okrun", "step": 3, "checkpoint": str(traversal), "owned": True},
    ):
        bad.append(queues.enqueue_diff(r, queues.DiffArgs(**kwargs)))
    # A job whose stored payload is not even JSON (a pickle, say).
    garbage = queues.enqueue_diff(r, queues.DiffArgs("okrun", 4, str(evil), owned=False))
    r.hset(f"rq:job:{garbage}", "data", b"\x80\x04\x95pickle")
    bad.append(garbage)
    good = _write(tmp / "good.safetensors", _state(1))
    Emitter("okrun", settings=Settings.from_env(env)).emit_checkpoint(10, good)
    return bad


@pytest.mark.slow
def test_worker_survives_poisoned_jobs_and_takes_the_next_good_one(
    tmp_path: Path, redis_url: str
) -> None:
    env = deltasync_env(redis_url, tmp_path)
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    before_outside = _files(outside)
    bad = _poison_and_good_jobs(env, tmp_path, redis_url)
    store = open_store(Settings.from_env(env).store_url)
    r = redis_client(redis_url)
    with processes(env, tmp_path / "logs", diff=["worker", "diff"]) as procs:
        wait_for(lambda: store.exists(manifest_key("okrun", "anchor", 10)), "the good job")
        assert procs["diff"].poll() is None, "the worker died"
    for job_id in bad:
        job = Job.fetch(job_id, connection=r, serializer=JSONSerializer)
        status = job.get_status(refresh=True)
        assert status in (JobStatus.FAILED, JobStatus.SCHEDULED, JobStatus.FINISHED), status
        if status == JobStatus.FINISHED:
            # The traversal names are only tensor names; any other bad job may finish
            # only as a retry that found its step behind the good one's head, skipped.
            result = job.return_value()
            assert job_id.endswith("-3") or (
                isinstance(result, dict)
                and result.get("status") == "skipped"
                and str(result.get("reason", "")).startswith("stale")
            ), (job_id, result)
    # Nothing written outside the store, staging, cache or the test's own files.
    assert _files(outside) == before_outside
    store_root = tmp_path / "store"
    assert not list(store_root.glob("escape*")) and not (tmp_path / "escape").exists()
    for path in _files(tmp_path):
        assert "escape" not in path.name, path
    os.rmdir(outside)


def test_cli_rejects_hostile_names_in_one_line(tmp_path: Path, redis_url: str) -> None:
    env = deltasync_env(redis_url, tmp_path)
    ckpt = _write(tmp_path / "c.safetensors", _state(0))
    for run in ("../x", "a\x07b"):
        out = cli(env, "emit", "--run", run, "--step", "1", "--checkpoint", str(ckpt))
        assert out.returncode != 0
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
