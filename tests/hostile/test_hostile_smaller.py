"""Smaller hardening cases: an error about a non-safetensors file does not show its
bytes; a dtype the delta codec cannot carry is refused before version 0; with the
run's anchors gone the compaction policy warns instead of failing a published job; a
symlink inside a file store is refused, never written through."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from pipeline.errors import CodecError, CorruptObjectError, SignatureError, StoreError
from pipeline.format.checkpoints.checkpoint_write import write_checkpoint
from pipeline.format.signing import generate_keypair, load_public_key
from pipeline.publish.caches.state_cache import StateCache
from pipeline.publish.compaction import collect_garbage, compact
from pipeline.publish.step import publish_step
from pipeline.publish.version import PublishOptions
from pipeline.store.file import FileStore
from pipeline.store.trust import trusted
from pipeline.versions import chain
from pipeline.versions.policy import tally

pytestmark = pytest.mark.kernels  # rerun with bounds checks (scripts/test.sh)

RUN = "small"


def _state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    w = torch.randn(32, 16, generator=g).to(torch.bfloat16)
    w.view(torch.int16)[1, : step * 2] += 1
    return {"w": w}


def _publish(store: FileStore, tmp: Path, steps: range) -> None:
    cache = StateCache(tmp / "cache", RUN)
    for step in steps:
        path = tmp / f"ckpt-{step}.safetensors"
        write_checkpoint(path, _state(step).items())
        publish_step(store, RUN, step, path, cache)


def test_a_non_safetensors_file_is_refused_without_showing_its_bytes(tmp_path: Path) -> None:
    secret = b"hunter2!" + b"more secret text"
    path = tmp_path / "shadow"
    path.write_bytes(secret)
    store = FileStore(tmp_path / "store")
    with pytest.raises(CorruptObjectError) as caught:
        publish_step(store, RUN, 0, path, StateCache(tmp_path / "cache", RUN))
    message = str(caught.value)
    (as_number,) = struct.unpack("<Q", secret[:8])
    assert str(as_number) not in message and "hunter2" not in message
    assert "not a safetensors file" in message
    assert chain.list_versions(store, RUN).head is None


@pytest.mark.skipif(not hasattr(torch, "float8_e8m0fnu"), reason="torch without float8_e8m0fnu")
def test_a_dtype_the_delta_codec_cannot_carry_is_refused_before_version_0(
    tmp_path: Path,
) -> None:
    path = tmp_path / "e8m0.safetensors"
    write_checkpoint(
        path, [("scale", torch.zeros(8, dtype=torch.uint8).view(torch.float8_e8m0fnu))]
    )
    store = FileStore(tmp_path / "store")
    with pytest.raises(CodecError, match="unsupported dtype"):
        publish_step(store, RUN, 0, path, StateCache(tmp_path / "cache", RUN))
    assert list(store.list(f"{RUN}/anchors")) == []


def test_without_anchors_the_policy_warns_and_never_fails(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    _publish(store, tmp_path, range(2))
    for key in list(store.list(f"{RUN}/anchors")):
        store.delete(key)
    _publish(store, tmp_path, range(2, 3))  # the next step still publishes (cache holds 1)
    assert chain.list_versions(store, RUN).head == 2
    with capture_logs() as logs:
        assert tally(store, RUN, 2) is None
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert warnings and "no new node can bootstrap" in warnings[0]["event"]


def test_a_symlinked_version_folder_is_never_written_through(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    _publish(store, tmp_path, range(1))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    folder = store.root / RUN / "deltas" / "0000000001"
    folder.parent.mkdir(parents=True, exist_ok=True)
    folder.symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(StoreError, match="symlink"):
        store.put(f"{RUN}/deltas/0000000001/part-00000.safetensors", b"x")
    path = tmp_path / "ckpt-1.safetensors"
    write_checkpoint(path, _state(1).items())
    with pytest.raises(StoreError, match="symlink"):
        publish_step(store, RUN, 1, path, StateCache(tmp_path / "cache", RUN))
    assert list(elsewhere.iterdir()) == []
    with pytest.raises(StoreError, match="symlink"):
        store.get(f"{RUN}/deltas/0000000001/manifest.json")


def _signed_run(tmp: Path) -> tuple[FileStore, Path, Path]:
    private, public = generate_keypair(tmp / "keys")
    store = FileStore(tmp / "store")
    cache = StateCache(tmp / "cache", RUN)
    for step in range(3):
        path = tmp / f"ckpt-{step}.safetensors"
        write_checkpoint(path, _state(step).items())
        publish_step(
            store, RUN, step, path, cache, PublishOptions(signing_key=private.read_bytes())
        )
    return store, private, public


def test_a_signing_worker_never_builds_on_an_unsigned_head(tmp_path: Path) -> None:
    store, private, _ = _signed_run(tmp_path)
    forged = tmp_path / "forged.safetensors"
    write_checkpoint(forged, _state(7).items())
    publish_step(store, RUN, 3, forged, StateCache(tmp_path / "attacker", RUN))
    path = tmp_path / "ckpt-4.safetensors"
    write_checkpoint(path, _state(4).items())
    cache = StateCache(tmp_path / "cache", RUN)
    with pytest.raises(SignatureError, match="delta 3 of run small is not signed"):
        publish_step(store, RUN, 4, path, cache, PublishOptions(signing_key=private.read_bytes()))
    assert chain.list_versions(store, RUN).head == 3


def test_garbage_collection_verifies_what_it_keeps(tmp_path: Path) -> None:
    """An unsigned anchor at the head would let GC delete the signed chains below it."""
    store, private, public = _signed_run(tmp_path)
    compact(store, RUN, 1, PublishOptions(signing_key=private.read_bytes()))
    compact(store, RUN, 2)  # someone without the key: an unsigned anchor
    before = sorted(store.list(RUN))
    with pytest.raises(SignatureError, match="anchor 2 of run small is not signed"):
        collect_garbage(trusted(store, load_public_key(public)), RUN, 1, None)
    assert sorted(store.list(RUN)) == before


def test_checkpoint_roots_limit_what_a_job_may_name(tmp_path: Path) -> None:
    from pipeline.config import Settings
    from pipeline.errors import ConfigError
    from workers.jobs.diff import check_checkpoint_root

    home = {"DELTASYNC_HOME": str(tmp_path / "home")}
    trainer = tmp_path / "trainer"
    trainer.mkdir()
    (trainer / "evil").symlink_to("/etc")
    open_settings = Settings.from_env(home)
    check_checkpoint_root(open_settings, RUN, Path("/etc/passwd"))  # unset: any path
    limited = Settings.from_env(home, checkpoint_roots=str(trainer))
    check_checkpoint_root(limited, RUN, trainer / "step-3")
    check_checkpoint_root(limited, RUN, limited.staging_dir / RUN / "step-0000000003")
    for outside in (Path("/etc/passwd"), trainer / "evil" / "passwd", limited.staging_dir):
        with pytest.raises(ConfigError, match="outside the run's staging folder"):
            check_checkpoint_root(limited, RUN, outside)


def test_a_retried_poison_step_is_recorded_and_announced_once(redis_url: str) -> None:
    from pipeline.coord.connection import redis_client
    from pipeline.coord.stream import EventStream
    from pipeline.publish import dead_letters

    r = redis_client(redis_url)
    run = "retried"
    pending = f"deltasync:run:{run}:pending-steps"
    for _ in range(4):  # the job and rq's three retries
        r.hset(pending, "2", "{}")
        reason = dead_letters.record(r, run, 2, "/x\n", ValueError("bad\nstep"), pending)
    assert reason == "ValueError: bad"
    assert [d.step for d in dead_letters.list_dead(r, run)] == [2]
    events = [e for _, e in EventStream(r, run).read("0-0") if e is not None]
    assert [e.type for e in events] == ["step-failed"]
    assert not r.hexists(pending, "2")


def test_oversized_records_planted_in_redis_are_not_parsed(redis_url: str) -> None:
    """Records read back from Redis go through the bounded loader: a planted record past
    its size limit is passed over, not decoded whole, and the well-formed ones still show."""
    from pipeline.coord import problems
    from pipeline.coord.connection import redis_client
    from pipeline.format.bounded import MAX_REDIS_RECORD_BYTES
    from pipeline.publish import dead_letters

    r = redis_client(redis_url)
    run = "planted"
    pending = f"deltasync:run:{run}:pending-steps"
    r.hset(pending, "1", "{}")
    dead_letters.record(r, run, 1, "/x", ValueError("bad"), pending)
    padded = {"reason": "r", "checkpoint": "/y", "time": "t", "pad": "x" * MAX_REDIS_RECORD_BYTES}
    r.hset(f"deltasync:run:{run}:dead-steps", "2", json.dumps(padded))
    assert [d.step for d in dead_letters.list_dead(r, run)] == [1]
    problems.report_cache_damage(r, run, "host-a", 3, "w", "flipped")
    big = {"version": 3, "tensor": "w", "note": "n", "time": "t", "count": 1}
    r.hset(f"deltasync:run:{run}:cache-damage", "host-b", json.dumps({**big, "pad": padded["pad"]}))
    assert [d.host for d in problems.list_cache_damage(r, run)] == ["host-a"]


def test_a_fifo_named_as_a_checkpoint_is_refused_without_blocking(tmp_path: Path) -> None:
    import os
    import threading

    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    store = FileStore(tmp_path / "store")
    outcome: list[BaseException] = []

    def publish() -> None:
        try:
            publish_step(store, RUN, 0, fifo, StateCache(tmp_path / "cache", RUN))
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=publish, daemon=True)
    worker.start()
    worker.join(60)
    if worker.is_alive():
        with open(fifo, "wb"):  # unblock it before failing
            pass
        pytest.fail("a FIFO named as a checkpoint blocked the publish")
    assert len(outcome) == 1 and isinstance(outcome[0], CorruptObjectError)
    assert "not a regular file" in str(outcome[0])
