"""Signed versions end to end, with real processes: workers holding
DELTASYNC_SIGNING_KEY sign every manifest (deltas and compaction anchors); a node
holding DELTASYNC_VERIFY_KEY applies them, and refuses versions that are unsigned or
signed by another key. Without keys, logs and `deltasync status` say so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.config import Settings
from pipeline.coord.connection import redis_client
from pipeline.coord.events import DeltaApplied, ReplicaError
from pipeline.coord.stream import EventStream
from pipeline.format.checkpoints.checkpoint import CheckpointReader
from pipeline.format.hashes.hashing import content_hash
from pipeline.store import open_store
from pipeline.testing.synthetic import ModelConfig, UpdateGenerator
from pipeline.versions import chain
from tests.pipeline_helpers import cli, deltasync_env, processes, wait_for
from workers.trainers.trainer import Emitter

pytestmark = pytest.mark.slow


def _keys(env: dict[str, str], folder: Path) -> tuple[Path, Path]:
    out = cli(env, "keygen", "--out", str(folder))
    assert out.returncode == 0, out.stderr
    return folder / "signing.key", folder / "verify.pub"


def _emit(env: dict[str, str], run: str, steps: int) -> dict[int, dict[str, torch.Tensor]]:
    emitter = Emitter(run, settings=Settings.from_env(env))
    generator = UpdateGenerator(ModelConfig.preset("tiny"), lr=1e-5, seed=21)
    states: dict[int, dict[str, torch.Tensor]] = {}
    state = generator.state()
    for step in range(steps):
        if step:
            state = generator.step()
        states[step] = {n: t.clone() for n, t in state.items()}
        emitter.emit_state(step, state)
    return states


def _events(redis_url: str, run: str) -> list[object]:
    return [e for _, e in EventStream(redis_client(redis_url), run).read("0-0", count=1000)]


def _dump_hashes(path: Path) -> dict[str, str]:
    with CheckpointReader(path) as reader:
        return {n: content_hash(reader.get(n)) for n in reader.names()}


def _refused(
    env: dict[str, str], redis_url: str, run: str, node: str, log_dir: Path, bad: int = 0
) -> str:
    """Start a node, wait for its replica-error, stop it; it must never have applied
    version ``bad`` or a newer one (the newest usable version below it, it may)."""
    with processes(env, log_dir, **{node: ["rollout", "--run", run, "--node-id", node,
                                           "--poll", "0.3"]}):  # fmt: skip

        def reported() -> bool:
            return any(
                isinstance(e, ReplicaError) and e.node == node for e in _events(redis_url, run)
            )

        wait_for(reported, f"{node} to refuse")
    events = _events(redis_url, run)
    assert not any(
        isinstance(e, DeltaApplied) and e.node == node and e.version >= bad for e in events
    )
    errors = [e for e in events if isinstance(e, ReplicaError) and e.node == node]
    return errors[0].error


def test_signed_versions_end_to_end(tmp_path: Path, redis_url: str) -> None:
    base = deltasync_env(redis_url, tmp_path)
    signing, verify = _keys(base, tmp_path / "keys")
    _, other_verify = _keys(base, tmp_path / "other-keys")
    signer = {**base, "DELTASYNC_SIGNING_KEY": str(signing)}
    store = open_store(Settings.from_env(base).store_url)
    with processes(signer, tmp_path / "logs", diff=["worker", "diff"],
                   compact=["worker", "compact"]):  # fmt: skip
        states = _emit(signer, "signed", 3)
        wait_for(lambda: chain.list_versions(store, "signed").head == 2, "the head")
        done = cli(signer, "compact", "--run", "signed", "--version", "1", "--wait",
                   "--timeout", "200")  # fmt: skip
        assert done.returncode == 0, done.stderr
    index = chain.list_versions(store, "signed")
    assert 1 in index.anchors
    for version in index.versions:
        for kind in ("delta", "anchor"):
            if version in (index.deltas if kind == "delta" else index.anchors):
                m = chain.load_manifest(store, "signed", kind, version)  # type: ignore[arg-type]
                assert m.signature is not None, f"{kind} {version} is unsigned"
    logs = (tmp_path / "logs" / "diff.log").read_text()
    assert "versions are unsigned" not in logs

    # The right key: the node applies and ends bit-exact.
    verifier = {**base, "DELTASYNC_VERIFY_KEY": str(verify)}
    dump = tmp_path / "dump.safetensors"
    out = cli(verifier, "rollout", "--run", "signed", "--node-id", "trusting", "--poll", "0.3",
              "--until", "2", "--dump", str(dump))  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert _dump_hashes(dump) == {n: content_hash(t) for n, t in states[2].items()}
    assert "signatures are not checked" not in out.stderr

    # Another key: refused, nothing applied.
    wrong = {**base, "DELTASYNC_VERIFY_KEY": str(other_verify)}
    error = _refused(wrong, redis_url, "signed", "wrongkey", tmp_path / "logs-wrong")
    assert "SignatureError" in error

    # An unsigned run: refused by a node that requires signatures.
    with processes(base, tmp_path / "logs-unsigned", diff=["worker", "diff"]):
        _emit(base, "plain", 2)
        wait_for(lambda: chain.list_versions(store, "plain").head == 1, "the unsigned head")
    unsigned_log = (tmp_path / "logs-unsigned" / "diff.log").read_text()
    assert "versions are unsigned" in unsigned_log
    error = _refused(verifier, redis_url, "plain", "strict", tmp_path / "logs-strict")
    assert "SignatureError" in error and "not signed" in error

    status = cli(base, "status", "--run", "plain", "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["signed"] is False
    text = cli(base, "status", "--run", "plain")
    assert "signatures not verified" in text.stdout
    # "signed" only where the signatures were verified, not where a field is present.
    unverified = json.loads(cli(base, "status", "--run", "signed", "--json").stdout)
    assert unverified["signed"] is False
    signed_status = json.loads(cli(verifier, "status", "--run", "signed", "--json").stdout)
    assert signed_status["signed"] is True
    refused = json.loads(cli(verifier, "status", "--run", "plain", "--json").stdout)
    assert refused["signed"] is False and "not signed" in refused["chain"]["error"]


def test_a_tampered_signed_manifest_is_refused(tmp_path: Path, redis_url: str) -> None:
    """Change one tensor hash in a signed manifest (keeping its signature): refused."""
    base = deltasync_env(redis_url, tmp_path)
    signing, verify = _keys(base, tmp_path / "keys")
    signer = {**base, "DELTASYNC_SIGNING_KEY": str(signing)}
    store = open_store(Settings.from_env(base).store_url)
    with processes(signer, tmp_path / "logs", diff=["worker", "diff"]):
        _emit(signer, "tamper", 2)
        wait_for(lambda: chain.list_versions(store, "tamper").head == 1, "the head")
    key = "tamper/deltas/0000000001/manifest.json"
    doc = json.loads(store.get(key))
    doc["created"] = "2000-01-01T00:00:00Z"
    store.put(key, json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())
    verifier = {**base, "DELTASYNC_VERIFY_KEY": str(verify)}
    error = _refused(verifier, redis_url, "tamper", "careful", tmp_path / "logs-node", bad=1)
    assert "SignatureError" in error


def _forge_unsigned_delta(store_url: str, run: str, step: int, cache_dir: Path, ckpt: Path) -> None:
    """What someone with store write access but no signing key can do: publish an
    unsigned delta of their own weights on top of the signed head."""
    from pipeline.format.checkpoints.checkpoint_write import write_checkpoint
    from pipeline.publish.caches.state_cache import StateCache
    from pipeline.publish.step import publish_step

    store = open_store(store_url)
    head = chain.list_versions(store, run).head
    assert head is not None
    forged = {
        n: t.clone() for _, part in chain.reconstruct_parts(store, run, head) for n, t in part
    }
    first = sorted(forged)[0]
    forged[first].view(-1)[:8] = 0  # the attacker's weights
    write_checkpoint(ckpt, forged.items())
    result = publish_step(store, run, step, ckpt, StateCache(cache_dir, run))
    assert result.status == "published" and result.manifest is not None
    assert result.manifest.signature is None


def test_compaction_never_signs_an_unsigned_delta(tmp_path: Path, redis_url: str) -> None:
    """The bypass: an unsigned delta on a signed head, then the operator's `compact`.
    Both the CLI (which holds the signing key) and the compaction worker refuse; no
    anchor is written and the forged delta is not collected into a signed one."""
    base = deltasync_env(redis_url, tmp_path)
    signing, verify = _keys(base, tmp_path / "keys")
    signer = {**base, "DELTASYNC_SIGNING_KEY": str(signing)}
    store_url = Settings.from_env(base).store_url
    store = open_store(store_url)
    run = "bypass"
    with processes(signer, tmp_path / "logs", diff=["worker", "diff"],
                   compact=["worker", "compact"]):  # fmt: skip
        _emit(signer, run, 2)
        wait_for(lambda: chain.list_versions(store, run).head == 1, "the signed head")
        _forge_unsigned_delta(store_url, run, 2, tmp_path / "attacker-cache",
                              tmp_path / "forged.safetensors")  # fmt: skip

        # The operator's default command, with the signing key: refused before queueing.
        out = cli(signer, "compact", "--run", run, "--wait", "--timeout", "200")
        assert out.returncode != 0
        line = out.stderr.strip().splitlines()[-1]
        assert "delta 2 of run bypass is not signed" in line, out.stderr

        # Queued by a CLI without keys: the compaction worker (signing key) refuses.
        out = cli(base, "compact", "--run", run, "--wait", "--timeout", "200")
        assert out.returncode != 0
        assert "not signed" in out.stderr, out.stderr
    index = chain.list_versions(store, run)
    assert index.anchors == (0,), "an anchor was built from the unsigned delta"
    assert 2 in index.deltas  # nothing was collected either
    log = (tmp_path / "logs" / "compact.log").read_text()
    assert "SignatureError" in log

    # A node that verifies never serves version 2.
    verifier = {**base, "DELTASYNC_VERIFY_KEY": str(verify)}
    error = _refused(verifier, redis_url, run, "strict", tmp_path / "logs-node", bad=2)
    assert "SignatureError" in error and "not signed" in error
