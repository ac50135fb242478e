"""A sharded trainer end to end, every part real: 4 FSDP2 ranks (gloo, real AdamW steps)
as 2 emulated trainer hosts, each host with its own staging and cache folders and its
own diff worker on its own queue, a real Redis and a real S3 server shared by all, a
torch replica following the run, a manual compaction by a compaction worker.

At every published version the replica holds the gathered trainer state bit for bit.
A rank that fails before registering leaves its step unpublished and the next step
publishes; a host's diff worker SIGKILLed mid-part loses and duplicates nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from pipeline.coord.connection import redis_client
from pipeline.coord.stream import ENTRY_FIELD, stream_key
from pipeline.format.hashes import content_hashes
from pipeline.format.manifest import PIECES_SCHEMA, Manifest
from pipeline.rollout.node import RolloutNode
from pipeline.store import ObjectStore, open_store
from pipeline.targets.patching import int_view
from pipeline.targets.setup import TargetSetup
from pipeline.targets.torch import TorchTarget
from pipeline.versions import chain
from tests import sharded_ranks
from tests.pipeline_helpers import REPO, cli, deltasync_env, wait_for

pytestmark = pytest.mark.slow

RUN = "e2e"
WORLD = 4
STEPS = 5
HOSTS = ("h0", "h1")
ALGORITHM = content_hashes.get(content_hashes.MIXSUM)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Cluster:
    """Each host's settings and diff workers (their own processes), and the logs."""

    def __init__(self, redis_url: str, store_url: str, tmp: Path) -> None:
        self.tmp = tmp
        self.logs = tmp / "logs"
        self.logs.mkdir()
        self.envs = {
            h: deltasync_env(redis_url, tmp / h, DELTASYNC_STORE=store_url, DELTASYNC_DIFF_HOST=h)
            for h in HOSTS
        }
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, *args: str, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "workers", "worker", *args, "--name", name],
            env=dict(env),
            stdout=(self.logs / f"{name}.log").open("ab"),
            stderr=subprocess.STDOUT,
            cwd=REPO,
            start_new_session=True,
        )
        self.procs[name] = proc
        return proc

    def diff_worker(self, name: str, host: str, **extra: str) -> subprocess.Popen[bytes]:
        # h0's worker also takes the shared diff queue: it coordinates each step.
        only = ["--host-only"] if host != "h0" else []
        return self.start(name, "diff", "--host", host, *only, env={**self.envs[host], **extra})

    def stop(self, name: str, kill: bool = False) -> None:
        proc = self.procs.pop(name)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        # What a supervisor does: the worker's whole group (rq's scheduler too).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)

    def close(self) -> None:
        for name in list(self.procs):
            self.stop(name)

    def log_tail(self) -> str:
        return "\n".join(
            f"== {p.name}\n" + "\n".join(p.read_text().splitlines()[-15:])
            for p in sorted(self.logs.iterdir())
        )


def _head(store: ObjectStore) -> int | None:
    return chain.list_versions(store, RUN).head


def _same_bits(held: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> None:
    assert sorted(held) == sorted(want)
    for name, tensor in want.items():
        got = held[name].cpu().contiguous()
        assert got.dtype == tensor.dtype and tuple(got.shape) == tuple(tensor.shape), name
        assert torch.equal(int_view(got).view(-1), int_view(tensor.contiguous()).view(-1)), name


def _replica(store: ObjectStore) -> tuple[TorchTarget, RolloutNode]:
    setup = TargetSetup(store=store, run=RUN, stop=threading.Event(), device="cpu")
    target = TorchTarget.for_node(setup)
    assert target is not None
    return target, RolloutNode(store, RUN, target)


def _held(target: TorchTarget) -> dict[str, torch.Tensor]:
    return {name: target.tensor(name) for name in target.specs()}


def _announced(redis_url: str) -> list[int]:
    r = redis_client(redis_url)
    out = []
    for _, fields in r.xrange(stream_key(RUN)):
        doc = json.loads(fields[ENTRY_FIELD.encode()])
        if doc.get("type") == "delta-available":
            out.append(int(doc["version"]))
    return out


@pytest.fixture
def cluster(redis_url: str, s3_url: str, tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(redis_url, s3_url, tmp_path)
    try:
        yield c
    finally:
        c.close()


@contextmanager
def _ranks(
    rank_main: Callable[..., None], cluster: Cluster, tmp_path: Path, steps: int
) -> Iterator[None]:
    """``WORLD`` trainer ranks of ``rank_main`` running while the block runs, joined at
    its end; on a failure the workers' log tail is printed and the ranks killed."""
    ranks = mp.start_processes(
        rank_main,
        args=(WORLD, _free_port(), cluster.envs, str(tmp_path), steps),
        nprocs=WORLD,
        join=False,
        start_method="spawn",
    )
    try:
        yield
        while not ranks.join(timeout=1):
            pass
    except BaseException:
        print(cluster.log_tail())
        raise
    finally:
        for proc in ranks.processes:
            if proc.is_alive():
                proc.kill()


def _published(store: ObjectStore, step: int, expected: Mapping[str, torch.Tensor]) -> Manifest:
    """Version ``step`` once published: pieced, every rank's part in an object of its
    own (written by its host), its hashes those of the gathered state."""
    wait_for(lambda: _head(store) == step, f"version {step}", 300)
    manifest = chain.load_manifest(store, RUN, "anchor" if step == 1 else "delta", step)
    assert manifest.schema == PIECES_SCHEMA and manifest.is_pieced
    assert {o.key[:11] for o in manifest.objects} == {f"part-r{r:05d}" for r in range(WORLD)}
    for entry in manifest.tensors:
        assert entry.hash == ALGORITHM.full(expected[entry.name]), entry.name
    return manifest


def test_fsdp2_ranks_on_two_hosts_reach_a_replica_bit_for_bit(
    cluster: Cluster, redis_url: str, s3_url: str, tmp_path: Path
) -> None:
    store = open_store(s3_url)
    cluster.diff_worker("h0-diff", "h0")
    cluster.diff_worker("h1-diff", "h1")
    with _ranks(sharded_ranks.e2e_rank, cluster, tmp_path, STEPS):
        target, node = _replica(store)  # waits for the ranks' first anchor
        for step in range(1, STEPS + 1):
            wait_for(lambda s=step: (tmp_path / f"expected-{s}.pt").exists(), f"step {step}", 300)
            expected = torch.load(tmp_path / f"expected-{step}.pt")
            if step == 2:
                # Rank 3 raised before it registered: the step is never sent.
                error = json.loads((tmp_path / "error-3-2.json").read_text())["error"]
                assert "bad" in error and "\n" not in error
            else:
                manifest = _published(store, step, expected)
                assert node.step_once() == step  # and the replica holds it, bit for bit
                _same_bits(_held(target), expected)
            if step == 3:  # the next step's part on h1 is taken by a worker killed mid-part
                cluster.stop("h1-diff")
                doomed = cluster.diff_worker(
                    "h1-doomed", "h1", DELTASYNC_FAULT="publish.after_encode"
                )
            (tmp_path / f"go-{step}").touch()
            if step == 3:
                wait_for(lambda p=doomed: p.poll() is not None, "h1's worker killed mid-part", 300)
                assert doomed.returncode == -signal.SIGKILL
                cluster.stop("h1-doomed")
                time.sleep(1.0)
                assert _head(store) == 3, "no manifest while h1's part is not recorded"
                cluster.diff_worker("h1-diff-2", "h1")

    index = chain.list_versions(store, RUN)
    assert index.anchors == (1,) and index.deltas == (3, 4, 5)  # step 2 never published
    assert sorted(_announced(redis_url)) == [1, 3, 4, 5]  # each announced once

    # A manual compaction, by a compaction worker: the new anchor keeps the pieces, and
    # a new replica bootstraps from it to the trainer's last state.
    cluster.start("compactor", "compact", env=cluster.envs["h0"])
    done = cli(cluster.envs["h0"], "compact", "--run", RUN, "--wait", "--timeout", "300")
    assert done.returncode == 0, done.stdout + done.stderr
    anchor = chain.load_manifest(store, RUN, "anchor", STEPS)
    assert anchor.is_pieced and anchor.state_hash == manifest.state_hash
    fresh, fresh_node = _replica(store)
    assert fresh_node.step_once() == STEPS
    _same_bits(_held(fresh), torch.load(tmp_path / f"expected-{STEPS}.pt"))


TP_STEPS = 4


def test_fsdp2_over_tensor_parallel_ranks_reach_a_replica_bit_for_bit(
    cluster: Cluster, s3_url: str, tmp_path: Path
) -> None:
    """A (dp=2, tp=2) mesh: column- and row-parallel weights sharded again by FSDP2
    (boxes of dim 0 and of dim 1), weights left out of TP on the dp slice only."""
    store = open_store(s3_url)
    cluster.diff_worker("h0-diff", "h0")
    cluster.diff_worker("h1-diff", "h1")
    with _ranks(sharded_ranks.tp_rank, cluster, tmp_path, TP_STEPS):
        target, node = _replica(store)
        for step in range(1, TP_STEPS + 1):
            wait_for(lambda s=step: (tmp_path / f"expected-{s}.pt").exists(), f"step {step}", 300)
            expected = torch.load(tmp_path / f"expected-{step}.pt")
            manifest = _published(store, step, expected)
            pieces = {e.name: e.pieces for e in manifest.tensors}
            assert all(p.is_box for p in pieces["blocks.0.o.weight"])  # Shard(1) x Shard(0)
            # Off TP: held alike by both tp ranks of a dp slice, staged once.
            assert len(pieces["embed.weight"]) == 2
            assert node.step_once() == step, node.last_error
            _same_bits(_held(target), expected)
            (tmp_path / f"go-{step}").touch()
    assert chain.list_versions(store, RUN).deltas == tuple(range(2, TP_STEPS + 1))
