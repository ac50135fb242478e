"""Hostile stores against nodes that verify signatures, and hostile objects named in
part hints.

- An earlier instance of a run (same name, same signing key) planted in the store is
  refused by a node without Redis: a forged, missing or replayed ``run.json``.
- A huge unsigned manifest costs a verifying node a bounded read, not a parse.
- A FIFO or a huge sparse file named in a part hint neither hangs nor bloats a real
  `deltasync rollout` process with early start: it still exits on SIGTERM.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import redis
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from pipeline.coord.connection import redis_client
from pipeline.coord.events import DeltaApplied, DeltaPart
from pipeline.coord.hints import channel, publish_part
from pipeline.coord.stream import EventStream
from pipeline.errors import SignatureError
from pipeline.format.manifest import manifest_key, object_key, to_json
from pipeline.format.signing import generate_keypair, load_public_key, private_key_from
from pipeline.publish.version import PublishOptions, publish_anchor
from pipeline.rollout.node import NodeOptions, RolloutNode
from pipeline.store.file import FileStore
from pipeline.targets.torch import TorchTarget
from pipeline.versions import chain
from tests.pipeline_helpers import REPO, deltasync_env, processes, wait_for

RUN = "reused"
MiB = 1 << 20


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "b.bias": torch.randn(32, generator=g),
    }


Keys = tuple[Ed25519PrivateKey, Ed25519PublicKey]


def publish(
    store: FileStore, version: int, state: dict[str, torch.Tensor], key: Ed25519PrivateKey | None
) -> None:
    head = chain.list_versions(store, RUN).head
    publish_anchor(
        store,
        RUN,
        version,
        list(state.items()),
        PublishOptions(signing_key=key),
        parent=head,
        reason="test",
    )


def node_of(store: FileStore, public: Ed25519PublicKey, state_path: Path) -> RolloutNode:
    """An embedded node (no Redis, no events) over zeroed weights of the runs' shapes."""
    held = {n: torch.zeros_like(t) for n, t in weights(0).items()}
    node = RolloutNode(
        store,
        RUN,
        TorchTarget(held),
        NodeOptions(
            public_key=public,
            state_path=state_path,
            prefetch=False,
            poll_interval_s=0.01,
            max_backoff_s=0.01,
        ),
    )
    HELD[id(node)] = held
    return node


HELD: dict[int, dict[str, torch.Tensor]] = {}  # each node's weights, by node


def holds(node: RolloutNode, state: dict[str, torch.Tensor]) -> bool:
    held = HELD[id(node)]
    return all(
        torch.equal(held[n].view(torch.uint8), t.view(torch.uint8)) for n, t in state.items()
    )


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    private, public = generate_keypair(tmp_path / "keys")
    return private_key_from(private.read_bytes()), load_public_key(public)


def test_an_earlier_instance_is_refused_by_a_node_without_redis(tmp_path: Path, keys: Keys) -> None:
    """Instance A of the run published v0 and v5; the run was started anew (instance B,
    same name, same key) in another store and a node follows B's v0. A's v5 and its
    run.json copied into B's store, a forged unsigned run.json naming A, or none at
    all: the node, restarted and fresh alike, never applies A's weights."""
    private, public = keys
    old, new = FileStore(tmp_path / "old"), FileStore(tmp_path / "new")
    publish(old, 0, weights(1), private)
    publish(old, 5, weights(5), private)
    publish(new, 0, weights(2), private)
    state_path = tmp_path / "node" / "state.json"
    node = node_of(new, public, state_path)
    assert node.step_once() == 0 and node.last_error is None
    assert holds(node, weights(2))

    # Someone with write access to the store plants the old instance's v5 and record.
    shutil.copytree(
        old.root / RUN / "anchors" / "0000000005", new.root / RUN / "anchors" / "0000000005"
    )
    record = new.root / RUN / "run.json"
    record.write_bytes((old.root / RUN / "run.json").read_bytes())

    # The node restarts (its process, its Redis or none): it has followed B before.
    restarted = node_of(new, public, state_path)
    restarted.step_once()
    assert isinstance(restarted.last_error, SignatureError), restarted.last_error
    assert "follows instance" in str(restarted.last_error)
    assert restarted.applied_version != 5 and not holds(restarted, weights(5))

    # A forged record naming A (whose id every manifest of A shows).
    instance_a = chain.load_manifest(old, RUN, "anchor", 5).instance
    assert instance_a is not None
    record.write_text(json.dumps({"instance": instance_a, "since": 0}, sort_keys=True))
    fresh = node_of(new, public, tmp_path / "fresh" / "state.json")
    fresh.step_once()
    assert isinstance(fresh.last_error, SignatureError), fresh.last_error
    assert "run record" in str(fresh.last_error) and "not signed" in str(fresh.last_error)
    assert fresh.applied_version is None

    # No record at all.
    record.unlink()
    fresh = node_of(new, public, tmp_path / "fresh2" / "state.json")
    fresh.step_once()
    assert isinstance(fresh.last_error, SignatureError), fresh.last_error
    assert fresh.applied_version is None


def test_resign_moves_an_earlier_releases_signatures_to_the_envelope(
    tmp_path: Path, keys: Keys
) -> None:
    """A manifest signed inside the document (an earlier release's form) is refused in
    one line naming `deltasync resign`; after resign_run a node applies it, and a
    manifest that was never signed stays refused."""
    import base64

    from pipeline.format import sealed
    from pipeline.format.signing import key_id
    from pipeline.publish.resign import resign_run

    private, public = keys
    store = FileStore(tmp_path / "store")
    publish(store, 0, weights(3), None)
    key = store.root / manifest_key(RUN, "anchor", 0)
    manifest = chain.load_manifest(store, RUN, "anchor", 0)
    doc = json.loads(to_json(manifest))
    sig = private.sign(sealed.canonical(doc))
    doc["signature"] = {
        "alg": "ed25519",
        "key_id": key_id(public),
        "sig": base64.b64encode(sig).decode(),
    }
    key.write_bytes(sealed.canonical(doc))

    node = node_of(store, public, tmp_path / "n1" / "state.json")
    node.step_once()
    assert isinstance(node.last_error, SignatureError)
    assert "deltasync resign --run" in str(node.last_error) and "\n" not in str(node.last_error)

    result = resign_run(store, RUN, private)
    assert len(result.resigned) == 1 and not result.refused, result.describe()
    node = node_of(store, public, tmp_path / "n2" / "state.json")
    assert node.step_once() == 0 and holds(node, weights(3))

    publish(store, 1, weights(4), None)  # unsigned: left as it is
    assert resign_run(store, RUN, private).refused


HUGE_NODE = textwrap.dedent(
    """
    import json, sys, torch
    from pipeline.errors import SignatureError
    from pipeline.format.signing import load_public_key
    from pipeline.rollout.node import NodeOptions, RolloutNode
    from pipeline.store.file import FileStore
    from pipeline.targets.torch import TorchTarget

    def hwm():
        with open("/proc/self/status") as f:
            line = next(l for l in f if l.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024

    store, key = FileStore(sys.argv[1]), load_public_key(sys.argv[2])
    def node(run):
        options = NodeOptions(public_key=key, prefetch=False, poll_interval_s=0.001,
                              max_backoff_s=0.001)
        return RolloutNode(store, run, TorchTarget({"w": torch.zeros(4, 4)}), options)
    errors = []
    warm = node("small")  # every code path once, so that only the huge read can grow
    for _ in range(2):
        warm.step_once()
        errors.append(str(warm.last_error))
    before = hwm()
    huge = node("huge")
    for _ in range(3):  # and again on every retry
        huge.step_once()
        assert isinstance(huge.last_error, SignatureError), huge.last_error
        errors.append(str(huge.last_error))
    print(json.dumps({"before": before, "after": hwm(), "errors": errors}))
    """
)


def test_a_huge_unsigned_manifest_costs_a_verifying_node_bounded_memory(
    tmp_path: Path,
) -> None:
    """A 200 MB unsigned manifest in place of a run's only one: a node with a verify key
    (a real process) refuses it, three times, and its peak memory grows < 50 MB."""
    _, public_path = generate_keypair(tmp_path / "keys")
    root = tmp_path / "store"
    small = root / "small" / "anchors" / "0000000000" / "manifest.json"
    small.parent.mkdir(parents=True)
    small.write_bytes(b'{"anchor":0,"extra":{}}')
    huge = root / "huge" / "anchors" / "0000000000" / "manifest.json"
    huge.parent.mkdir(parents=True)
    with huge.open("wb") as f:
        f.write(b'{"anchor":0,"extra":{"pad":"')
        chunk = b"x" * MiB
        for _ in range(200):
            f.write(chunk)
        f.write(b'"},"kind":"anchor","run":"huge","schema":2,"version":0}')
    assert huge.stat().st_size > 200 * MiB
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", HUGE_NODE, str(root), str(public_path)],
        env=env, capture_output=True, text=True, timeout=600, cwd=REPO, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert all("not signed" in e for e in got["errors"]), got["errors"]
    grew = got["after"] - got["before"]
    assert grew < 50 * MiB, f"peak memory grew by {grew / MiB:.0f} MiB"


def vm_hwm(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def node_log(tmp_path: Path) -> list[dict[str, object]]:
    path = tmp_path / "logs" / "node.log"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.startswith("{")]


def refused(tmp_path: Path, key: str) -> bool:
    return any(
        e.get("event") == "early part refused" and e.get("key") == key for e in node_log(tmp_path)
    )


def fifo_has_reader(path: Path) -> int | None:
    """A write end of the FIFO if a process is opening it for reading (the old early
    start blocks there), else None."""
    try:
        return os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return None


def test_a_fifo_or_sparse_file_in_a_hint_neither_hangs_nor_bloats_a_node(
    redis_url: str, tmp_path: Path
) -> None:
    """A real `deltasync rollout` with early start holds v0; hints for v1 name a 1 GiB
    sparse file (hinted as 4 KiB) and a FIFO. Each is refused at once: the node's
    peak memory grows < 50 MB, and SIGTERM still stops it."""
    env = deltasync_env(redis_url, tmp_path, DELTASYNC_EARLY_START="1")
    store = FileStore(tmp_path / "store")
    publish(store, 0, weights(7), None)
    client: redis.Redis = redis_client(redis_url)
    events = EventStream(client, RUN)
    rollout = ["rollout", "--run", RUN, "--node-id", "n1", "--poll", "0.5"]
    writer: int | None = None
    try:
        with processes(env, tmp_path / "logs", node=rollout) as procs:
            node = procs["node"]
            wait_for(
                lambda: any(
                    isinstance(e, DeltaApplied) and e.version == 0
                    for _, e in events.read("0-0", count=1000)
                ),
                "v0 applied",
            )
            wait_for(lambda: client.pubsub_numsub(channel(RUN))[0][1] >= 1, "the node listening")

            folder = (tmp_path / "store" / object_key(RUN, "delta", 1, "x")).parent
            folder.mkdir(parents=True)
            sparse = folder / "part-00000.safetensors"
            with sparse.open("wb") as f:
                f.truncate(1 << 30)
            before = vm_hwm(node.pid)
            hint = DeltaPart(
                run=RUN, version=1, parent=0, key=sparse.name, size=4096, sha256="ab" * 32
            )
            publish_part(client, hint)
            wait_for(
                lambda: refused(tmp_path, sparse.name) or vm_hwm(node.pid) - before > 50 * MiB,
                "the sparse file's hint handled",
            )
            grew = vm_hwm(node.pid) - before
            assert grew < 50 * MiB, f"the node's peak memory grew by {grew / MiB:.0f} MiB"

            fifo = folder / "part-00001.safetensors"
            os.mkfifo(fifo)
            hint = DeltaPart(
                run=RUN, version=1, parent=0, key=fifo.name, size=4096, sha256="cd" * 32
            )
            publish_part(client, hint)

            def handled() -> bool:
                nonlocal writer
                writer = writer if writer is not None else fifo_has_reader(fifo)
                return writer is not None or refused(tmp_path, fifo.name)

            wait_for(handled, "the FIFO's hint handled")
            node.send_signal(signal.SIGTERM)
            try:
                code = node.wait(timeout=120)
            except subprocess.TimeoutExpired:
                pytest.fail("the node hangs on SIGTERM")
            assert code is not None
            assert refused(tmp_path, fifo.name)
    finally:
        if writer is not None:
            os.close(writer)
        client.close()
