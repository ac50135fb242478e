"""A node never goes back below what it verified, across restarts; a store frozen
behind Redis's announcements is visible; a bad manifest at the head stops no node.

Real processes: `deltasync worker diff`, `deltasync rollout` nodes that require
signatures, `deltasync status`, a real redis-server and a file store in which someone
with write access but no signing key hides or plants manifests.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pipeline.config import Settings
from pipeline.coord.connection import redis_client
from pipeline.coord.events import DeltaApplied
from pipeline.coord.problems import list_failing
from pipeline.coord.replicas import list_replicas
from pipeline.coord.stream import EventStream
from pipeline.format.checkpoints.checkpoint import CheckpointReader
from pipeline.format.checkpoints.checkpoint_write import write_checkpoint
from pipeline.format.hashes.hashing import content_hash
from pipeline.format.signing import generate_keypair
from pipeline.publish.caches.state_cache import StateCache
from pipeline.publish.step import publish_step
from pipeline.publish.version import PublishOptions
from pipeline.rollout.node import state_path_for
from pipeline.store.file import FileStore
from pipeline.versions import chain
from tests.pipeline_helpers import cli, deltasync_env, processes, wait_for
from workers.trainers.trainer import Emitter

pytestmark = pytest.mark.slow

RUN = "floor"
FLOOR_ERROR = "store head v2 is below this node's floor v4"


def _state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(32, 16, generator=g).to(torch.bfloat16)
    w.view(torch.int16)[0, : step * 3] += 1
    return {"w": w, "b": torch.full((8,), float(step), dtype=torch.float32)}


def _publish(store: FileStore, tmp: Path, steps: range, key: Path) -> None:
    """Signed versions, published in this process (a trainer's diff job)."""
    cache = StateCache(tmp / "cache", RUN)
    for step in steps:
        path = tmp / f"ckpt-{step}.safetensors"
        write_checkpoint(path, _state(step).items())
        publish_step(store, RUN, step, path, cache, PublishOptions(signing_key=key.read_bytes()))


def _hide(store: FileStore, *versions: int) -> None:
    """What a store writer without the signing key can do: take manifests away."""
    for v in versions:
        manifest = store.root / RUN / "deltas" / f"{v:010d}" / "manifest.json"
        manifest.rename(manifest.with_name("manifest.json.hidden"))


def _unhide(store: FileStore, *versions: int) -> None:
    for v in versions:
        hidden = store.root / RUN / "deltas" / f"{v:010d}" / "manifest.json.hidden"
        hidden.rename(hidden.with_name("manifest.json"))


def _node(node: str, *args: str) -> list[str]:
    return ["rollout", "--run", RUN, "--node-id", node, "--poll", "0.2", *args]


def _failing_error(redis_url: str, node: str) -> str | None:
    found = [f.error for f in list_failing(redis_client(redis_url), RUN) if f.node == node]
    return found[0] if found else None


def _applied_since(redis_url: str, position: str, node: str) -> bool:
    events = EventStream(redis_client(redis_url), RUN).read(position, count=1000)
    return any(isinstance(e, DeltaApplied) and e.node == node for _, e in events)


def _replica_version(redis_url: str, node: str) -> int | None:
    found = [r.version for r in list_replicas(redis_client(redis_url), RUN) if r.node == node]
    return found[0] if found else None


def _state_file(env: dict[str, str], node: str) -> dict[str, object]:
    path = state_path_for(Settings.from_env(env).data_dir, RUN, node)
    doc: dict[str, object] = json.loads(path.read_text())
    return doc


def _status(env: dict[str, str]) -> tuple[str, dict[str, object]]:
    text = cli(env, "status", "--run", RUN)
    assert text.returncode == 0, text.stderr[-2000:]
    as_json = cli(env, "status", "--run", RUN, "--json")
    assert as_json.returncode == 0, as_json.stderr[-2000:]
    doc: dict[str, object] = json.loads(as_json.stdout)
    return text.stdout, doc


def test_a_restarted_node_refuses_a_store_head_below_its_floor(
    tmp_path: Path, redis_url: str
) -> None:
    """Its state file keeps the floor; status shows the failing node and the freeze."""
    base = deltasync_env(redis_url, tmp_path)
    signing, verify = generate_keypair(tmp_path / "keys")
    signer = {**base, "DELTASYNC_SIGNING_KEY": str(signing)}
    verifier = {**base, "DELTASYNC_VERIFY_KEY": str(verify)}
    store = FileStore(tmp_path / "store")
    with processes(signer, tmp_path / "logs", diff=["worker", "diff"]):
        emitter = Emitter(RUN, settings=Settings.from_env(signer))
        for step in range(5):
            emitter.emit_state(step, _state(step), dtype=None)
        wait_for(lambda: chain.list_versions(store, RUN).head == 4, "version 4")

    out = cli(verifier, *_node("n1", "--until", "4"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert _state_file(verifier, "n1")["version"] == 4

    _hide(store, 3, 4)
    assert chain.list_versions(store, RUN).head == 2
    freeze = "store behind announcements: v4 announced, head v2"
    position = EventStream(redis_client(redis_url), RUN).last_id()
    nodes = {"n1": _node("n1"), "fresh": _node("fresh")}
    with processes(verifier, tmp_path / "logs-restart", **nodes):
        wait_for(
            lambda: (
                _failing_error(redis_url, "n1") is not None
                or _applied_since(redis_url, position, "n1")
            ),
            "the restarted node to refuse or to load",
        )
        assert not _applied_since(redis_url, position, "n1")
        error = _failing_error(redis_url, "n1")
        assert error is not None and FLOOR_ERROR in error, error
        # A node that never saw v4 serves the head it finds, and says the store is behind.
        wait_for(lambda: _failing_error(redis_url, "fresh") is not None, "the fresh node")
        assert freeze in str(_failing_error(redis_url, "fresh"))
        assert _replica_version(redis_url, "fresh") == 2
        text, doc = _status(base)
        assert doc["store_behind"] == freeze and doc["announced_head"] == 4
        failing = {f["node"]: f["error"] for f in doc["failing"]}  # type: ignore[attr-defined]
        assert sorted(failing) == ["fresh", "n1"] and FLOOR_ERROR in failing["n1"]
        assert "n1" in text and freeze in text
    log = (tmp_path / "logs-restart" / "n1.log").read_text()
    assert FLOOR_ERROR in log and "bootstrapping" not in log
    state = _state_file(verifier, "n1")
    assert state["floor"] == 4 and state["version"] == 4, state


def test_a_node_started_from_its_dump_keeps_the_floor_and_its_weights(
    tmp_path: Path, redis_url: str
) -> None:
    """No state file at all (another home): the dump's metadata carries the floor.
    Once the store shows v4 again, the node resumes from its own weights."""
    base = deltasync_env(redis_url, tmp_path)
    signing, verify = generate_keypair(tmp_path / "keys")
    store = FileStore(tmp_path / "store")
    _publish(store, tmp_path / "trainer", range(5), signing)
    first = {**base, "DELTASYNC_VERIFY_KEY": str(verify)}
    dump = tmp_path / "v4.safetensors"
    out = cli(first, *_node("n2", "--until", "4", "--dump", str(dump)))
    assert out.returncode == 0, out.stderr[-3000:]
    with CheckpointReader(dump) as reader:
        held = {n: content_hash(reader.get(n)) for n in reader.names()}
    assert held == {n: content_hash(t) for n, t in _state(4).items()}

    _hide(store, 3, 4)
    elsewhere = {**first, "DELTASYNC_HOME": str(tmp_path / "other-home")}
    position = EventStream(redis_client(redis_url), RUN).last_id()
    node = _node("n2", "--model", str(dump))
    with processes(elsewhere, tmp_path / "logs", n2=node):
        wait_for(
            lambda: (
                _failing_error(redis_url, "n2") is not None
                or _applied_since(redis_url, position, "n2")
                or _replica_version(redis_url, "n2") is not None
            ),
            "the node to refuse or to serve",
        )
        error = _failing_error(redis_url, "n2")
        assert error is not None and FLOOR_ERROR in error, error
        assert _replica_version(redis_url, "n2") is None
        assert not state_path_for(Settings.from_env(elsewhere).data_dir, RUN, "n2").exists()

        # The versions come back: its own weights prove v4, nothing is downloaded.
        _unhide(store, 3, 4)
        wait_for(lambda: _replica_version(redis_url, "n2") == 4, "the node to resume v4")
        wait_for(lambda: _failing_error(redis_url, "n2") is None, "the failure to clear")
    log = (tmp_path / "logs" / "n2.log").read_text()
    assert "resumed" in log and "bootstrapping" not in log
    assert not _applied_since(redis_url, position, "n2")
    assert _state_file(elsewhere, "n2")["version"] == 4


def test_a_bad_manifest_at_the_head_does_not_stop_a_new_node(
    tmp_path: Path, redis_url: str
) -> None:
    """An unsigned delta manifest and a corrupt anchor manifest planted as v4: a new
    node bootstraps from v3, logs the unusable ones, and follows a good v4."""
    base = deltasync_env(redis_url, tmp_path)
    signing, verify = generate_keypair(tmp_path / "keys")
    store = FileStore(tmp_path / "store")
    _publish(store, tmp_path / "trainer", range(4), signing)
    stored = json.loads((store.root / RUN / "deltas" / f"{3:010d}" / "manifest.json").read_text())
    planted = {**stored["signed"], "version": 4, "parent": 3}  # out of its signed envelope
    delta4 = store.root / RUN / "deltas" / f"{4:010d}"
    anchor4 = store.root / RUN / "anchors" / f"{4:010d}"
    delta4.mkdir(parents=True)
    anchor4.mkdir(parents=True)
    (delta4 / "manifest.json").write_text(json.dumps(planted))
    (anchor4 / "manifest.json").write_text("{not json")
    assert chain.list_versions(store, RUN).head == 4

    verifier = {**base, "DELTASYNC_VERIFY_KEY": str(verify)}
    with processes(verifier, tmp_path / "logs", n3=_node("n3")):
        wait_for(lambda: _replica_version(redis_url, "n3") == 3, "a bootstrap from v3")
        wait_for(lambda: _failing_error(redis_url, "n3") is not None, "the bad head reported")
        error = _failing_error(redis_url, "n3")
        assert error is not None and "SignatureError" in error and "delta 4" in error, error

        # The planted version goes; the trainer publishes its real v4: followed.
        shutil.rmtree(delta4)
        shutil.rmtree(anchor4)
        _publish(store, tmp_path / "trainer", range(4, 5), signing)
        wait_for(lambda: _replica_version(redis_url, "n3") == 4, "the node to follow v4")
        wait_for(lambda: _failing_error(redis_url, "n3") is None, "the failure to clear")
    log = (tmp_path / "logs" / "n3.log").read_text()
    assert "unusable manifest skipped" in log
    assert "unusable anchor skipped" in log
