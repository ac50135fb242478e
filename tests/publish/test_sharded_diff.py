"""Sharded runs on the diff side: 4 trainer ranks over 2 emulated hosts, each host with
its own staging and cache folders; every part encoded on its rank's host, manifest
last, each version bit-exact from the store.

The ranks' staging folders and registrations are written here in the shared format
(``pieces.json`` beside a checkpoint of 1-D pieces; ``deltasync:run:<run>:shards:<step>``),
as the distributed emitter writes them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
import redis
import torch

from pipeline.codec import apply_patch, read_delta
from pipeline.codec.anchor import anchor_tensors
from pipeline.coord import keys
from pipeline.coord.connection import redis_client
from pipeline.coord.events import DeltaAvailable
from pipeline.coord.shards import RankFolder, register_rank
from pipeline.coord.stream import EventStream
from pipeline.errors import ConfigError, DeltasyncError, MismatchError
from pipeline.format.checkpoints.checkpoint import CheckpointReader
from pipeline.format.checkpoints.checkpoint_write import write_checkpoint
from pipeline.format.checkpoints.shards import RankLayout, RankPiece, layout_digest, write_layout
from pipeline.format.hashes import mixsum
from pipeline.format.manifest import (
    PIECES_SCHEMA,
    Kind,
    Manifest,
    dtype_name,
    version_prefix,
)
from pipeline.format.regions import Region
from pipeline.format.tensors import DTYPES
from pipeline.publish import offline
from pipeline.publish.caches.rank_cache import RankCache
from pipeline.publish.compaction import compact
from pipeline.publish.diff import DeltaTask
from pipeline.publish.ranks.fanout import fanout_from_json, fanout_to_json, start_fanout
from pipeline.publish.ranks.sharded import (
    HostSide,
    MissingPartsError,
    help_host,
    plan_rank_parts,
    publish_sharded,
    rank_of,
    read_pieces,
    work_host,
)
from pipeline.publish.version import PublishOptions
from pipeline.rollout.node import RolloutNode
from pipeline.store import ObjectStore, open_store
from pipeline.targets.setup import TargetSetup
from pipeline.targets.torch import TorchTarget
from pipeline.versions import chain
from tests.pipeline_helpers import REPO, assert_same_state, deltasync_env, wait_for
from tests.workers.test_faults_workers import _job_done, retry_abandoned, wait_killed
from workers import queues

RUN = "shard"
WORLD = 4
HOST_OF = {0: "ha", 1: "ha", 2: "hb", 3: "hb"}
LAUNCH = "start-1"  # the trainer start every rank registers with
PART_BYTES = 6000
# name -> (dtype, shape); rows split unevenly over the ranks (rank 3 holds none of the norm).
MODEL = {
    "model.embed_tokens.weight": (torch.bfloat16, (96, 64)),
    "model.layers.0.self_attn.q_proj.weight": (torch.bfloat16, (64, 64)),
    "model.layers.0.mlp.up_proj.weight": (torch.bfloat16, (112, 64)),
    "model.norm.weight": (torch.float32, (64,)),
    "lm_head.weight": (torch.bfloat16, (96, 64)),
}
CUTS = (0.0, 0.3, 0.45, 0.8, 1.0)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _ranges(name: str) -> list[tuple[int, int]]:
    """Each rank's flat range of ``name``: rows cut unevenly (the norm: elements, the
    last rank empty)."""
    _, shape = MODEL[name]
    if len(shape) == 1:
        cuts = [0, 20, 41, shape[0], shape[0]]
        return [(cuts[r], cuts[r + 1]) for r in range(WORLD)]
    rows, cols = shape
    cuts = [round(c * rows) for c in CUTS]
    return [(cuts[r] * cols, cuts[r + 1] * cols) for r in range(WORLD)]


def _grid(shape: tuple[int, ...]) -> list[Region]:
    """Each rank's box of a 2-D tensor as FSDP x TP on a 2 x 2 mesh leaves it: rows cut
    in two (dp), columns unevenly in two (tp, Shard(1))."""
    rows, cols = shape
    r, c = rows // 2, 24
    return [
        Region(shape, (r0, c0), (rn, cn))
        for r0, rn in ((0, r), (r, rows - r))
        for c0, cn in ((0, c), (c, cols - c))
    ]


def first_state(seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).to(d) for n, (d, s) in MODEL.items()}


def next_state(state: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    """~2% of every tensor's elements changed (each tensor touched)."""
    g = torch.Generator().manual_seed(1000 + step)
    out = {}
    for name, t in state.items():
        flat = t.reshape(-1).clone()
        count = max(1, flat.numel() // 50)
        at = torch.randperm(flat.numel(), generator=g)[:count]
        bump = (torch.randn(count, generator=g) * 0.05 + 0.01).to(torch.float32)
        flat[at] = (flat[at].float() + bump).to(t.dtype)
        out[name] = flat.reshape(t.shape)
    return out


def stage(
    client: redis.Redis,
    staging: dict[str, Path],
    step: int,
    state: dict[str, torch.Tensor],
    *,
    ranges: dict[str, list[tuple[int, int]]] | None = None,
    boxes: bool = False,
) -> Path:
    """Every rank's folder of ``step`` in its host's staging, and its registration (the
    emitter's own sidecar and registration code); the step folder of the last rank
    (the one that completes the step)."""
    folder = Path()
    for rank in range(WORLD):
        host = HOST_OF[rank]
        folder = staging[host] / RUN / f"step-{step:010d}" / f"rank-{rank:05d}"
        tmp = folder.parent / f".rank-{rank:05d}.tmp"
        tmp.mkdir(parents=True)
        pieces: list[RankPiece] = []
        tensors = []
        for name, t in state.items():
            if boxes and t.dim() == 2:
                region = _grid(tuple(t.shape))[rank]
                pieces.append(RankPiece.at(name, dtype_name(t.dtype), tuple(t.shape), region))
                tensors.append((name, region.take(t).clone()))
                continue
            start, stop = (ranges or {}).get(name, _ranges(name))[rank]
            if stop > start:  # a rank holding none of a tensor stages no piece of it
                pieces.append(RankPiece(name, dtype_name(t.dtype), tuple(t.shape), start, stop))
                tensors.append((name, t.reshape(-1)[start:stop].clone()))
        write_checkpoint(tmp / "model.safetensors", tensors)
        layout = RankLayout(RUN, step, rank, WORLD, host, tuple(pieces))
        write_layout(tmp, layout)
        os.rename(tmp, folder)
        entry = RankFolder(host, str(folder), WORLD, layout_digest(layout), LAUNCH)
        register_rank(client, RUN, step, rank, entry)
    return folder.parent


def reassemble(store: ObjectStore, version: int) -> dict[str, torch.Tensor]:
    """Every tensor of ``version`` from the store, decoded here: each anchor piece copied
    into its region, then each delta piece patched into it."""
    plan = chain.resolve(store, RUN, version)
    full: dict[str, torch.Tensor] = {}
    for e in plan.anchor.tensors:
        flat = torch.empty(e.numel, dtype=DTYPES[e.dtype])
        for p in e.pieces:
            data = chain.fetch_object(store, plan.anchor, plan.anchor.object_entry(p.object))
            e.region(p).put(flat, dict(anchor_tensors(data, p.object))[e.name])
        full[e.name] = flat
    for d in plan.deltas:
        for e in d.tensors:
            for p in e.pieces:
                if p.changed:
                    obj = read_delta(chain.fetch_object(store, d, d.object_entry(p.object)))
                    piece = e.region(p).take(full[e.name]).clone()
                    apply_patch(piece, obj.decode(e.name, piece))
                    e.region(p).put(full[e.name], piece)
    return {e.name: full[e.name].reshape(e.shape) for e in plan.target.tensors}


def check_version(
    store: ObjectStore, version: int, state: dict[str, torch.Tensor], boxes: bool = False
) -> Manifest:
    kind: Kind = "anchor" if version in chain.list_versions(store, RUN).anchors else "delta"
    manifest = chain.load_manifest(store, RUN, kind, version)
    assert manifest.schema == PIECES_SCHEMA and manifest.is_pieced
    assert all(len(e.pieces) == (3 if "norm" in e.name else WORLD) for e in manifest.tensors)
    for e in manifest.tensors:  # 2-D tensors in boxes when staged so, else flat ranges
        assert all(p.is_box == (boxes and len(e.shape) == 2) for p in e.pieces), e.name
    assert {rank_of(o.key) for o in manifest.objects} == set(range(WORLD))
    rebuilt = reassemble(store, version)
    assert_same_state(dict(chain.reconstruct_tensors(store, RUN, version)), state, "chain")
    assert_same_state(rebuilt, state, f"version {version}")
    for e in manifest.tensors:  # and the manifest's hashes are those of the full state
        assert mixsum.full(state[e.name]) == e.hash
    return manifest


# --------------------------------------------------------------------------- in process


class Hosts:
    """Two emulated hosts in this process; calling them in runs their work at once."""

    def __init__(self, client: redis.Redis, store: ObjectStore, tmp: Path) -> None:
        self.client, self.store = client, store
        self.staging = {h: tmp / h / "staging" for h in ("ha", "hb")}
        self.sides = {
            h: HostSide(client, store, h, self.staging[h], tmp / h / "cache", PART_BYTES)
            for h in ("ha", "hb")
        }
        self.called: list[tuple[str, str | None]] = []

        self.here: str | None = None  # the coordinator's own host: not called in

    def call_in(self, task: DeltaTask, parts: list[tuple[str, str | None]]) -> None:
        self.called.extend(parts)
        for host in sorted({h for _, h in parts if h is not None and h != self.here}):
            work_host(self.sides[host], task)

    def publish(
        self,
        step: int,
        checkpoint: Path,
        level: int = 1,
        content_hash: str | None = None,
        here: str | None = None,
        anchor_compression: str = "none",
        part_bytes: int = PART_BYTES,
    ) -> Manifest:
        self.here = here
        result = publish_sharded(
            self.client,
            self.store,
            RUN,
            step,
            str(checkpoint),
            PublishOptions(
                level=level,
                content_hash=content_hash,
                anchor_compression=anchor_compression,
                part_bytes=part_bytes,
            ),
            call_in=self.call_in,
            work_here=None if here is None else functools.partial(work_host, self.sides[here]),
            wait_s=30,
            launch=LAUNCH,
        )
        assert result.manifest is not None
        return result.manifest


def test_partition_of_a_rank_follows_its_sidecar_split_by_part_bytes(tmp_path: Path) -> None:
    folder = tmp_path / "rank"
    folder.mkdir()
    pieces = (
        RankPiece("a", "bfloat16", (10, 100), 0, 1000),
        RankPiece("c", "float32", (4000,), 1000, 3000),
        RankPiece("d", "bfloat16", (500,), 0, 500),
    )
    write_layout(folder, RankLayout(RUN, 1, 3, WORLD, "ha", pieces))
    parts = plan_rank_parts(3, read_pieces(folder), 3000)
    assert [(k, [p.name for p in ps]) for k, ps in parts] == [
        ("part-r00003-00000.safetensors", ["a"]),  # 2000 bytes; c's 8000 would exceed
        ("part-r00003-00001.safetensors", ["c"]),
        ("part-r00003-00002.safetensors", ["d"]),
    ]


def test_box_pieces_in_process(redis_url: str, tmp_path: Path) -> None:
    """Ranks holding boxes (FSDP x TP on a 2 x 2 mesh): anchor, deltas of levels 1 and
    3, a rebuilt rank cache and a compaction, each version bit for bit; a torch
    replica follows them, and a delta whose boxes are swapped is refused unwritten."""
    client = redis_client(redis_url)
    store = open_store(f"file://{tmp_path / 'store'}")
    hosts = Hosts(client, store, tmp_path)
    states = [first_state()]
    for step in range(1, 5):
        states.append(next_state(states[-1], step))
    hosts.publish(0, stage(client, hosts.staging, 0, states[0], boxes=True))
    check_version(store, 0, states[0], boxes=True)
    target = TorchTarget.for_node(
        TargetSetup(store=store, run=RUN, stop=threading.Event(), device="cpu")
    )
    assert target is not None
    node = RolloutNode(store, RUN, target)
    assert node.step_once() == 0
    for step in (1, 2):
        checkpoint = stage(client, hosts.staging, step, states[step], boxes=True)
        level = 2 * step - 1  # codec levels 1 and 3
        manifest = hosts.publish(step, checkpoint, level=level, here="ha" if step == 2 else None)
        assert all(e.changed > 0 for e in manifest.tensors), "every tensor touched"
        check_version(store, step, states[step], boxes=True)
        assert node.step_once() == step
        assert_same_state({n: target.tensor(n) for n in target.specs()}, states[step], "replica")
    shutil.rmtree(RankCache(tmp_path / "hb" / "cache", RUN, 2).root)  # rebuilt from the store
    hosts.publish(3, stage(client, hosts.staging, 3, states[3], boxes=True))
    check_version(store, 3, states[3], boxes=True)

    # A replica refuses a version whose two boxes of a tensor are swapped (each piece's
    # hash is at its own flat positions): nothing written, the held weights unchanged.
    manifest = chain.load_manifest(store, RUN, "delta", 3)
    name = "lm_head.weight"
    entry = manifest.tensor(name)
    first, third = entry.pieces[0], entry.pieces[2]  # boxes of one size, rows apart
    assert first.size == third.size
    swapped = (
        dataclasses.replace(first, offset=third.offset),
        entry.pieces[1],
        dataclasses.replace(third, offset=first.offset),
        *entry.pieces[3:],
    )
    held = {n: target.tensor(n).clone() for n in target.specs()}
    bad = dataclasses.replace(
        manifest,
        tensors=tuple(
            dataclasses.replace(e, pieces=swapped) if e.name == name else e
            for e in manifest.tensors
        ),
    )
    objects = {o.key: chain.fetch_object(store, manifest, o) for o in manifest.objects}
    with pytest.raises(DeltasyncError, match="hash") as info:
        target.apply_delta(bad, objects, "touched")
    assert "\n" not in str(info.value)
    assert_same_state({n: target.tensor(n) for n in target.specs()}, held, "after refusal")
    assert node.step_once() == 3
    assert_same_state({n: target.tensor(n) for n in target.specs()}, states[3], "replica")

    # Offline apply of the box-pieced delta folder to a checkpoint of its base.
    base = tmp_path / "base.safetensors"
    write_checkpoint(base, [(n, states[2][n]) for n in MODEL])
    out = tmp_path / "applied.safetensors"
    offline.apply_delta(base, tmp_path / "store" / version_prefix(RUN, "delta", 3), out)
    with CheckpointReader(out) as applied:
        assert_same_state({n: applied.get(n) for n in MODEL}, states[3], "offline apply")

    # Compaction rebuilds the chain part by part into an anchor that keeps the boxes.
    assert compact(store, RUN, 3).kind == "anchor"
    check_version(store, 3, states[3], boxes=True)
    fresh = TorchTarget.for_node(
        TargetSetup(store=store, run=RUN, stop=threading.Event(), device="cpu")
    )
    assert fresh is not None and RolloutNode(store, RUN, fresh).step_once() == 3
    assert_same_state({n: fresh.tensor(n) for n in fresh.specs()}, states[3], "fresh replica")


@pytest.fixture(params=["file", "s3"])
def file_or_s3(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "file":
        return open_store(f"file://{tmp_path / 'store'}")
    return open_store(str(request.getfixturevalue("s3_url")))


def test_sharded_versions_in_process(
    redis_url: str, tmp_path: Path, file_or_s3: ObjectStore
) -> None:
    client = redis_client(redis_url)
    store = file_or_s3
    hosts = Hosts(client, store, tmp_path)
    states = [first_state()]
    for step in range(1, 4):
        states.append(next_state(states[-1], step))

    anchor = hosts.publish(0, stage(client, hosts.staging, 0, states[0]))
    assert anchor.kind == "anchor" and anchor.content_hash == "mixsum-128"
    ranks = anchor.extra["ranks"]
    assert isinstance(ranks, dict) and sorted(ranks) == ["0", "1", "2", "3"]
    per_rank = {r: [o.key for o in anchor.objects if rank_of(o.key) == r] for r in range(WORLD)}
    assert all(len(k) >= 2 for k in per_rank.values()), per_rank
    check_version(store, 0, states[0])

    for step in (1, 2):
        checkpoint = stage(client, hosts.staging, step, states[step])
        # Codec levels 1 and 3; at step 2 the coordinator serves hb and does hb's parts.
        level = 2 * step - 1
        manifest = hosts.publish(step, checkpoint, level=level, here="hb" if step == 2 else None)
        assert manifest.codec.level == level
        assert manifest.parent == step - 1
        assert sorted(o.key for o in manifest.objects) == sorted(o.key for o in anchor.objects)
        assert (
            0
            < sum(e.changed for e in manifest.tensors)
            < 0.05 * sum(e.numel for e in manifest.tensors)
        )
        assert all(e.changed > 0 for e in manifest.tensors), "every tensor touched"
        check_version(store, step, states[step])
        # The published step of each rank is now its host's cache (adopted: a rename).
        assert not (hosts.staging["ha"] / RUN / f"step-{step - 1:010d}").exists()
        assert RankCache(tmp_path / "ha" / "cache", RUN, 0).version == step - 1

    # A host that lost a rank's cache rebuilds it from the store (proven piece by piece).
    cache = RankCache(tmp_path / "hb" / "cache", RUN, 3)
    shutil.rmtree(cache.root)  # its state and its record of what hb uploaded
    hosts.publish(3, stage(client, hosts.staging, 3, states[3]))
    check_version(store, 3, states[3])
    assert cache.version == 2 and cache.is_proven_for(
        chain.load_manifest(store, RUN, "delta", 2),
        [o.key for o in anchor.objects if rank_of(o.key) == 3],
    )

    # A step whose ranks hold other pieces than the first anchor fixed is refused.
    moved = {n: _ranges(n) for n in MODEL}
    (a0, a1), (b0, b1) = moved["lm_head.weight"][:2]
    moved["lm_head.weight"][:2] = [(a0, a1 + 64), (b0 + 64, b1)]
    step4 = stage(client, hosts.staging, 4, next_state(states[3], 4), ranges=moved)
    with pytest.raises(MismatchError, match="layout of rank 0 of step 4 differs") as info:
        hosts.publish(4, step4)
    assert "\n" not in str(info.value)
    assert chain.list_versions(store, RUN).head == 3

    # A host's workers open only folders in their own staging.
    foreign = RankFolder("ha", str(hosts.staging["hb"] / RUN / "x"), WORLD, "0" * 64, LAUNCH)
    with pytest.raises(ConfigError, match="not in host ha's staging folder"):
        hosts.sides["ha"].own_folder(RUN, 2, foreign)
    register_rank(client, RUN, 5, 2, foreign)
    task = DeltaTask(RUN, 5, "-", 3, "delta", 1, sharded=True, launch=LAUNCH)
    assert help_host(hosts.sides["ha"], task) == 0


def test_a_sharded_anchor_in_zstd_byte_planes(redis_url: str, tmp_path: Path) -> None:
    client = redis_client(redis_url)
    store = open_store(f"file://{tmp_path / 'store'}")
    hosts = Hosts(client, store, tmp_path)
    states = [first_state(3)]
    states.append(next_state(states[0], 1))
    anchor = hosts.publish(0, stage(client, hosts.staging, 0, states[0]), anchor_compression="zstd")
    assert anchor.codec.name == "safetensors-planes-zstd"
    check_version(store, 0, states[0])
    hosts.publish(1, stage(client, hosts.staging, 1, states[1]))
    check_version(store, 1, states[1])


def test_every_host_plans_the_first_anchor_by_the_coordinators_part_bytes(
    redis_url: str, tmp_path: Path
) -> None:
    """Hosts configured with other part sizes (hb's would hold each rank in one part)
    split their ranks' pieces by the size the coordinator's fan-out carries."""
    client = redis_client(redis_url)
    store = open_store(f"file://{tmp_path / 'store'}")
    hosts = Hosts(client, store, tmp_path)
    hosts.sides = {
        "ha": replace(hosts.sides["ha"], part_bytes=PART_BYTES // 3),
        "hb": replace(hosts.sides["hb"], part_bytes=10**9),
    }
    states = [first_state(5)]
    states.append(next_state(states[0], 1))
    anchor = hosts.publish(0, stage(client, hosts.staging, 0, states[0]))
    expected = [
        key
        for rank in range(WORLD)
        for key, _ in plan_rank_parts(
            rank,
            read_pieces(hosts.staging[HOST_OF[rank]] / RUN / f"step-{0:010d}" / f"rank-{rank:05d}"),
            PART_BYTES,
        )
    ]
    assert sorted(o.key for o in anchor.objects) == sorted(expected)
    assert all(sum(rank_of(k) == r for k in expected) >= 2 for r in range(WORLD))
    check_version(store, 0, states[0])
    hosts.publish(1, stage(client, hosts.staging, 1, states[1]))
    check_version(store, 1, states[1])


def test_a_retried_first_anchor_keeps_the_part_bytes_of_the_dead_coordinator(
    redis_url: str, tmp_path: Path
) -> None:
    """A coordinator of the first anchor died with its fan-out out (size PART_BYTES);
    the next one, configured otherwise, finishes it with the same partition."""
    client = redis_client(redis_url)
    store = open_store(f"file://{tmp_path / 'store'}")
    hosts = Hosts(client, store, tmp_path)
    checkpoint = stage(client, hosts.staging, 0, first_state(9))
    dead = DeltaTask(RUN, 0, str(checkpoint), 0, "anchor", 1, True, "anchor", "none", LAUNCH)
    start_fanout(client, replace(dead, part_bytes=PART_BYTES))
    work_host(hosts.sides["ha"], replace(dead, part_bytes=PART_BYTES))  # ha's parts stored
    anchor = hosts.publish(0, checkpoint, part_bytes=10**9)
    per_rank = [sum(rank_of(o.key) == r for o in anchor.objects) for r in range(WORLD)]
    assert all(n >= 2 for n in per_rank), per_rank
    check_version(store, 0, first_state(9))


def test_the_fanout_record_round_trips() -> None:
    anchor = DeltaTask(RUN, 0, "-", 0, "anchor", 1, True, "anchor", "none", LAUNCH, 4096)
    assert fanout_from_json(fanout_to_json(anchor)) == anchor
    delta = DeltaTask(RUN, 3, "/c", 2, "delta", 1, True, launch=LAUNCH)
    assert fanout_from_json(fanout_to_json(delta)) == delta
    # An unsharded fan-out left by an older release still reads (nobody helps with it).
    old = {"run": RUN, "step": 3, "checkpoint": "/c", "parent": 2, "parent_kind": "delta"}
    assert fanout_from_json(json.dumps({**old, "level": 1})) == DeltaTask(
        RUN, 3, "/c", 2, "delta", 1
    )


def test_a_sharded_run_needs_mixsum(redis_url: str, tmp_path: Path) -> None:
    client = redis_client(redis_url)
    store = open_store(f"file://{tmp_path / 'store'}")
    hosts = Hosts(client, store, tmp_path)
    checkpoint = stage(client, hosts.staging, 0, first_state())
    with pytest.raises(ConfigError, match="a sharded run hashes its pieces with mixsum-128"):
        hosts.publish(0, checkpoint, content_hash="xxh3-128")
    assert hosts.called == [] and chain.list_versions(store, RUN).head is None


def test_a_host_that_never_records_fails_the_step_in_process(
    redis_url: str, tmp_path: Path
) -> None:
    client = redis_client(redis_url)
    store = open_store(f"file://{tmp_path / 'store'}")
    hosts = Hosts(client, store, tmp_path)
    states = [first_state(), next_state(first_state(), 1)]
    hosts.publish(0, stage(client, hosts.staging, 0, states[0]))

    def only_ha(task: DeltaTask, parts: list[tuple[str, str | None]]) -> None:
        hosts.call_in(task, [(k, h) for k, h in parts if h == "ha"])

    with pytest.raises(MissingPartsError, match=r"host\(s\) hb did not record") as info:
        publish_sharded(
            client,
            store,
            RUN,
            1,
            str(stage(client, hosts.staging, 1, states[1])),
            PublishOptions(part_bytes=PART_BYTES),
            call_in=only_ha,
            wait_s=1.5,
        )
    assert "\n" not in str(info.value)
    assert chain.list_versions(store, RUN).head == 0
    hb_caches = tmp_path / "hb" / "cache" / RUN
    assert any(hb_caches.glob("rank-*/uploaded/0000000000/*")), "hb uploaded anchor parts"
    assert not any(hb_caches.glob("rank-*/uploaded/0000000001/*")), "hb did nothing of 1"
    states.append(next_state(states[1], 2))
    assert hosts.publish(2, stage(client, hosts.staging, 2, states[2])).parent == 0
    check_version(store, 2, states[2])
    assert (hosts.staging["ha"] / RUN / f"step-{1:010d}").is_dir()
    states.append(next_state(states[2], 3))
    assert hosts.publish(3, stage(client, hosts.staging, 3, states[3])).parent == 2
    check_version(store, 3, states[3])
    late = publish_sharded(
        client,
        store,
        RUN,
        1,
        "-",
        PublishOptions(part_bytes=PART_BYTES),
        call_in=hosts.call_in,
        wait_s=30,
    )  # a retry of the failed step, now behind the head
    assert late.status == "skipped" and late.reason == "stale: head is 3"
    # The failed step's folders go once their host's caches move past it.
    assert sorted(p.name for p in (hosts.staging["ha"] / RUN).iterdir()) == [f"step-{3:010d}"]
    assert sorted(p.name for p in (hosts.staging["hb"] / RUN).iterdir()) == [f"step-{3:010d}"]


# --------------------------------------------------------------------------- real workers


class Workers:
    """A coordinator (no host) and each host's diff workers, each its own process with
    its own DELTASYNC_HOME (staging and cache folders)."""

    def __init__(self, redis_url: str, tmp: Path, wait_s: float) -> None:
        self.tmp, self.redis_url = tmp, redis_url
        self.logs = tmp / "logs"
        self.logs.mkdir()
        self.common = {
            "DELTASYNC_STORE": f"file://{tmp / 'store'}",
            "DELTASYNC_PART_BYTES": str(PART_BYTES),
            "DELTASYNC_SHARDED_PART_WAIT_S": str(wait_s),
            "DELTASYNC_COMPACT_MAX_CHAIN": "100",
        }
        # deltasync_env's DELTASYNC_HOME: <home>/home, whose staging/ is the host's.
        self.staging = {h: tmp / h / "home" / "staging" for h in ("ha", "hb")}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, host: str | None, **extra: str) -> subprocess.Popen[bytes]:
        home = self.tmp / (host or "coordinator")
        env = deltasync_env(self.redis_url, home, **self.common, **extra)
        args = ["worker", "diff", "--name", name]
        if host is not None:
            args += ["--host", host, "--host-only"]
        proc = subprocess.Popen(
            [sys.executable, "-m", "workers", *args],
            env=env,
            stdout=(self.logs / f"{name}.log").open("ab"),
            stderr=subprocess.STDOUT,
            cwd=REPO,
            start_new_session=True,
        )
        self.procs[name] = proc
        return proc

    def stop(self, name: str) -> None:
        proc = self.procs.pop(name)
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def close(self) -> None:
        for name in list(self.procs):
            self.stop(name)

    def encoded(self, name: str) -> list[tuple[int, str]]:
        out = []
        for line in (self.logs / f"{name}.log").read_text().splitlines():
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if isinstance(doc, dict) and doc.get("event") == "part encoded":
                out.append((int(doc["version"]), str(doc["part"])))
        return out


@contextmanager
def workers(redis_url: str, tmp: Path, wait_s: float = 120) -> Iterator[Workers]:
    w = Workers(redis_url, tmp, wait_s)
    try:
        yield w
    finally:
        w.close()


def emit(client: redis.Redis, step: int, checkpoint: Path) -> None:
    """What the rank completing a step sends: the diff job and the pending step."""
    kwargs = {
        "run": RUN,
        "step": step,
        "checkpoint": str(checkpoint),
        "owned": True,
        "sharded": True,
        "launch": LAUNCH,
    }
    with client.pipeline(transaction=True) as pipe:
        queues.enqueue_diff(client, queues.DiffArgs(**kwargs), pipeline=pipe)
        pipe.set(keys.emitted_key(RUN, step), 1)
        pipe.hset(keys.pending_steps_key(RUN), str(step), json.dumps(kwargs))
        pipe.execute()


def head(store: ObjectStore) -> int | None:
    return chain.list_versions(store, RUN).head


def announced(client: redis.Redis) -> list[int]:
    events = EventStream(client, RUN).read(after_id="0-0", count=1000)
    return sorted(e.version for _, e in events if isinstance(e, DeltaAvailable))


@pytest.mark.slow
def test_host_workers_publish_a_sharded_run_and_survive_a_kill(
    redis_url: str, tmp_path: Path
) -> None:
    """Real rq workers: a coordinator of no host, host ha's and hb's workers each with
    its own staging and cache. A worker of ha SIGKILLed mid-part: another worker of ha
    takes the part, the version is published and announced once, the chain stays
    linear."""
    client = redis_client(redis_url)
    store = open_store(f"file://{tmp_path / 'store'}")
    states = [first_state()]
    for step in range(1, 4):
        states.append(next_state(states[-1], step))
    with workers(redis_url, tmp_path) as w:
        w.start("coordinator", None)
        w.start("ha-1", "ha")
        w.start("hb-1", "hb")
        for step in (0, 1):
            emit(client, step, stage(client, w.staging, step, states[step]))
            wait_for(functools.partial(lambda s: head(store) == s, step), f"version {step}", 180)

        w.stop("ha-1")
        doomed = w.start("ha-doomed", "ha", DELTASYNC_FAULT="publish.after_encode")
        emit(client, 2, stage(client, w.staging, 2, states[2]))
        wait_for(lambda: doomed.poll() is not None, "the ha worker killed mid-part", 180)
        assert doomed.returncode == -signal.SIGKILL
        w.procs.pop("ha-doomed")
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(doomed.pid, signal.SIGKILL)  # what a supervisor does: rq's scheduler too
        time.sleep(1.0)
        assert head(store) == 1, "no manifest while ha's part is not recorded"
        w.start("ha-2", "ha")
        wait_for(lambda: head(store) == 2, "version 2 after the kill", 180)
        emit(client, 3, stage(client, w.staging, 3, states[3]))
        wait_for(lambda: head(store) == 3, "version 3", 180)
        wait_for(lambda: announced(client) == [0, 1, 2, 3], "the announcements", 60)

    index = chain.list_versions(store, RUN)
    assert index.anchors == (0,) and index.deltas == (1, 2, 3)
    for version, state in enumerate(states):
        manifest = check_version(store, version, state)
        assert manifest.parent == (None if version == 0 else version - 1), "a linear chain"
    assert announced(client) == [0, 1, 2, 3], "each version announced once"

    parts = [o.key for o in chain.load_manifest(store, RUN, "delta", 2).objects]
    by_worker = {n: w.encoded(n) for n in ("ha-1", "ha-doomed", "ha-2", "hb-1", "coordinator")}
    assert by_worker["coordinator"] == [], "the coordinator of no host encodes nothing"
    assert by_worker["ha-doomed"] == [], "killed before recording its part"
    for name, done in by_worker.items():
        for _, key in done:
            assert HOST_OF[rank_of(key)] == name[:2], f"{name} encoded {key} of another host"
    for version in range(4):
        every = sorted(k for done in by_worker.values() for v, k in done if v == version)
        assert every == sorted(parts), f"each part of version {version} encoded once"
    assert {k for v, k in by_worker["ha-2"] if v == 2} == {
        k for k in parts if HOST_OF[rank_of(k)] == "ha"
    }, "ha's other worker took the killed part (and the rest of ha's)"


@pytest.mark.slow
def test_a_host_that_never_records_fails_its_step_and_the_next_publishes(
    redis_url: str, tmp_path: Path
) -> None:
    client = redis_client(redis_url)
    store = open_store(f"file://{tmp_path / 'store'}")
    states = [first_state(), next_state(first_state(), 1)]
    states.append(next_state(states[1], 2))
    with workers(redis_url, tmp_path, wait_s=4) as w:
        w.start("coordinator", None)
        w.start("ha-1", "ha")
        w.start("hb-1", "hb")
        emit(client, 0, stage(client, w.staging, 0, states[0]))
        wait_for(lambda: head(store) == 0, "the anchor", 180)
        w.stop("hb-1")
        emit(client, 1, stage(client, w.staging, 1, states[1]))

        def dead() -> str | None:
            raw = client.hget(keys.dead_steps_key(RUN), "1")
            return None if raw is None else str(json.loads(raw)["reason"])

        wait_for(lambda: dead() is not None, "step 1 set aside", 120)
        reason = dead()
        assert reason is not None and "host(s) hb did not record" in reason, reason
        assert "\n" not in reason and head(store) == 0
        w.start("hb-2", "hb")
        emit(client, 2, stage(client, w.staging, 2, states[2]))
        wait_for(lambda: head(store) == 2, "the next step", 240)
    # rq retries a step set aside: with hb back, a retry may still publish step 1 first.
    deltas = chain.list_versions(store, RUN).deltas
    assert deltas in ((2,), (1, 2)), deltas
    assert check_version(store, 2, states[2]).parent == (1 if deltas == (1, 2) else 0)
    for version in deltas:
        check_version(store, version, states[version])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "killed"),
    [
        ("sharded.waiting", 1),
        ("publish.before_manifest", 1),
        ("publish.after_manifest", 1),
        ("sharded.waiting", 0),
        ("anchor.after_manifest", 0),
    ],
)
def test_coordinator_killed_mid_step_publishes_it_once(
    redis_url: str, tmp_path: Path, fault: str, killed: int
) -> None:
    """Real rq workers: the coordinator of step ``killed`` (the first anchor, or a
    delta) SIGKILLed while its hosts' parts are out, before its manifest, or after it
    (not announced). The next step's job publishes (or announces) it first, from the
    parts the hosts recorded; rq's late retry of the dead job then changes nothing.
    Each version: one manifest, announced once, a linear chain, bit-exact."""
    client = redis_client(redis_url)
    store = open_store(f"file://{tmp_path / 'store'}")
    states = [first_state(7)]
    for step in (1, 2):
        states.append(next_state(states[-1], step))
    with workers(redis_url, tmp_path) as w:
        w.start("ha-1", "ha")
        w.start("hb-1", "hb")
        if killed:
            w.start("coordinator", None)
            emit(client, 0, stage(client, w.staging, 0, states[0]))
            wait_for(lambda: head(store) == 0, "the anchor", 180)
            w.stop("coordinator")
        doomed = w.start("doomed", None, DELTASYNC_FAULT=fault)
        try:
            _recover_from_a_dead_coordinator(client, store, w, doomed, fault, killed, states)
        finally:  # only the leader died: its rq scheduler lived on to schedule the retry
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(doomed.pid, signal.SIGKILL)

    index = chain.list_versions(store, RUN)
    assert index.anchors == (0,) and index.deltas == (1, 2), "one manifest per version"
    for version, state in enumerate(states):
        manifest = check_version(store, version, state)
        assert manifest.parent == (None if version == 0 else version - 1), "a linear chain"
    assert announced(client) == [0, 1, 2], "each version announced once"
    kind: Kind = "delta" if killed else "anchor"
    parts = sorted(o.key for o in chain.load_manifest(store, RUN, kind, killed).objects)
    by_worker = {n: w.encoded(n) for n in ("ha-1", "hb-1", "doomed", "coordinator-2", "late")}
    assert not any(by_worker[n] for n in ("doomed", "coordinator-2", "late"))
    every = sorted(k for done in by_worker.values() for v, k in done if v == killed)
    assert every == parts, f"each part of step {killed} encoded once, its records reused"


def _recover_from_a_dead_coordinator(
    client: redis.Redis,
    store: ObjectStore,
    w: Workers,
    doomed: subprocess.Popen[bytes],
    fault: str,
    killed: int,
    states: list[dict[str, torch.Tensor]],
) -> None:
    emit(client, killed, stage(client, w.staging, killed, states[killed]))
    wait_killed(doomed, fault, 180)
    w.procs.pop("doomed")
    before = killed - 1 if killed else None
    assert head(store) == (killed if fault.endswith("after_manifest") else before)
    assert announced(client) == list(range(killed)), "the dead coordinator announced nothing"

    w.start("coordinator-2", None)
    following = killed + 1
    emit(client, following, stage(client, w.staging, following, states[following]))
    wait_for(lambda: head(store) == following, f"step {following}, step {killed} first", 240)
    wait_for(lambda: announced(client) == list(range(following + 1)), "the announcements", 60)

    # rq's retry of the dead coordinator's job (its heartbeat lapsed: the clock is
    # moved on) finds the step published and does nothing more.
    w.stop("coordinator-2")
    assert retry_abandoned(client, queues.DIFF_QUEUE) == 1
    w.start("late", None)
    job_id = queues.diff_job_id(RUN, killed)
    wait_for(lambda: _job_done(client, job_id), f"the late retry of {job_id}", 120)
    if following < 2:  # and the run goes on
        emit(client, 2, stage(client, w.staging, 2, states[2]))
        wait_for(lambda: head(store) == 2, "step 2", 180)
