"""The trainer side of sharded runs: rank sidecars, the Redis registration, and real
torch.distributed ranks (gloo, FSDP2) emitting only what each holds, reassembled here
bit for bit into the gathered full state."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from pipeline import config
from pipeline.coord import keys
from pipeline.coord.connection import redis_client
from pipeline.coord.shards import RankFolder, rank_folders, register_rank
from pipeline.errors import ConfigError, CorruptObjectError
from pipeline.format.checkpoints.checkpoint import CheckpointReader
from pipeline.format.checkpoints.checkpoint_names import FORM_METADATA_KEY
from pipeline.format.checkpoints.shards import (
    LAYOUT_NAME,
    RankLayout,
    RankPiece,
    layout_digest,
    read_layout,
    write_layout,
)
from pipeline.format.tensors import BY_NAME
from tests import sharded_ranks
from tests.pipeline_helpers import REPO, deltasync_env
from workers import queues

WORLD = 4


def _layout(step: int = 3, host: str = "h0") -> RankLayout:
    pieces = (RankPiece("a.weight", "bfloat16", (5, 2), 4, 10), RankPiece("b", "int64", (), 0, 1))
    return RankLayout("run-1", step, 1, 4, host, pieces)


# -------------------------------------------------------------------------- sidecar


def test_layout_round_trips_and_its_digest_ignores_step_and_host(tmp_path: Path) -> None:
    layout = _layout()
    write_layout(tmp_path, layout)
    assert read_layout(tmp_path) == layout
    assert layout_digest(layout) == layout_digest(_layout(step=9, host="h7"))
    other = RankLayout("run-1", 3, 1, 4, "h0", (RankPiece("a.weight", "bfloat16", (5, 2), 4, 9),))
    assert layout_digest(other) != layout_digest(layout)
    assert [p.name for p in read_layout(tmp_path).pieces] == ["a.weight", "b"]


@pytest.mark.parametrize(
    ("text", "fault"),
    [
        ("{", "not JSON"),
        ("[" * 40 + "]" * 40, "nested deeper"),
        ('{"run": "r"}', "missing or unknown field"),
        ("X", "not JSON"),
    ],
)
def test_bad_sidecars_fail_in_one_line(tmp_path: Path, text: str, fault: str) -> None:
    (tmp_path / LAYOUT_NAME).write_text(text)
    with pytest.raises(CorruptObjectError, match=fault) as info:
        read_layout(tmp_path)
    assert "\n" not in str(info.value)


def _doc(**changes: Any) -> dict[str, Any]:
    piece = {"name": "w", "dtype": "bfloat16", "shape": [4, 3], "start": 0, "stop": 6}
    piece.update(changes.pop("piece", {}))
    doc = {"run": "r", "step": 1, "rank": 0, "world": 2, "host": "h0", "tensors": [piece]}
    doc.update(changes)
    return doc


@pytest.mark.parametrize(
    ("doc", "fault"),
    [
        (_doc(rank=2), "rank 2 is out of range"),
        (_doc(step=True), "step is not an integer"),
        (_doc(host="a b"), "host"),
        (_doc(run="../x"), "run"),
        (_doc(piece={"stop": 13}), "stop 13 is out of range"),
        (_doc(piece={"start": 6}), "empty or reversed"),
        (_doc(piece={"dtype": "complex64"}), "unknown dtype"),
        (_doc(piece={"shape": [-1]}), "shape"),
        (_doc(piece={"extra": 1}), "unknown field"),
        (_doc(tensors=[_doc()["tensors"][0]] * 2), "listed twice"),
    ],
)
def test_malformed_sidecar_fields_are_refused(tmp_path: Path, doc: object, fault: str) -> None:
    (tmp_path / LAYOUT_NAME).write_text(json.dumps(doc))
    with pytest.raises(CorruptObjectError, match=fault):
        read_layout(tmp_path)


def test_missing_or_huge_sidecar(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(CorruptObjectError, match="cannot be read"):
        read_layout(tmp_path)
    write_layout(tmp_path, _layout())
    from pipeline.format.checkpoints import shards

    monkeypatch.setattr(shards, "MAX_LAYOUT_BYTES", 50)
    with pytest.raises(CorruptObjectError, match="exceeds the limit"):
        read_layout(tmp_path)


def test_write_layout_refuses_what_read_would_refuse(tmp_path: Path) -> None:
    bad = RankLayout("r", 0, 4, 4, "h0", ())
    with pytest.raises(ConfigError, match="rank 4"):
        write_layout(tmp_path, bad)
    assert not (tmp_path / LAYOUT_NAME).exists()


# -------------------------------------------------------------------------- Redis


def test_the_last_new_registration_completes_the_step(redis_url: str) -> None:
    r = redis_client(redis_url)
    digest = "ab" * 32
    folders = {i: RankFolder(f"h{i // 2}", f"/s/rank-{i:05d}", 3, digest) for i in range(3)}
    assert not register_rank(r, "run", 5, 0, folders[0])
    assert not register_rank(r, "run", 5, 2, folders[2])
    assert not register_rank(r, "run", 5, 2, folders[2])  # again: not a new rank
    assert register_rank(r, "run", 5, 1, folders[1])
    assert not register_rank(r, "run", 5, 1, folders[1])  # completes once only
    assert rank_folders(r, "run", 5) == folders
    ttl = r.pttl(keys.shards_key("run", 5))
    assert 0 < ttl <= config.SHARDS_TTL_S * 1000
    assert rank_folders(r, "run", 6) == {}
    with pytest.raises(ConfigError, match="rank 3"):
        register_rank(r, "run", 5, 3, folders[0])
    with pytest.raises(ConfigError, match="absolute"):
        register_rank(r, "run", 5, 0, RankFolder("h0", "rel/path", 3, digest))


def test_a_step_emitted_again_after_a_restart_completes_with_that_start_only(
    redis_url: str,
) -> None:
    r = redis_client(redis_url)
    digest = "cd" * 32

    def folder(i: int, launch: str) -> RankFolder:
        return RankFolder(f"h{i // 2}", f"/s/{launch}/rank-{i:05d}", 3, digest, launch)

    # The first start staged ranks 0 and 1 of step 7, then died.
    assert not register_rank(r, "run", 7, 0, folder(0, "first"))
    assert not register_rank(r, "run", 7, 1, folder(1, "first"))
    # The next start emits step 7 again: rank 2 alone must not complete it with the
    # first start's folders of ranks 0 and 1.
    assert not register_rank(r, "run", 7, 2, folder(2, "second"))
    assert not register_rank(r, "run", 7, 0, folder(0, "second"))
    assert register_rank(r, "run", 7, 1, folder(1, "second"))
    assert rank_folders(r, "run", 7, "second") == {i: folder(i, "second") for i in range(3)}
    assert rank_folders(r, "run", 7, "first") == {}


@pytest.mark.parametrize(
    ("field", "value", "fault"),
    [
        ("x", "{}", "is not a rank"),
        ("007", "{}", "is not a rank"),
        ("1", "{", "not JSON"),
        ("1", '{"host": "h"}', "not an object of host"),
        (
            "1",
            '{"host": "h", "path": "rel", "world": 2, "layout": "' + "a" * 64 + '", "launch": ""}',
            "path",
        ),
        (
            "2",
            '{"host": "h", "path": "/p", "world": 2, "layout": "' + "a" * 64 + '", "launch": ""}',
            "below",
        ),
        (
            "1",
            '{"host": "h", "path": "/p", "world": 2, "layout": "zz", "launch": ""}',
            "layout digest",
        ),
        (
            "1",
            '{"host": "h h", "path": "/p", "world": 2, "layout": "' + "a" * 64 + '", "launch": ""}',
            "host",
        ),
        (
            "1",
            '{"host": "h", "path": "/p", "world": 2, "layout": "' + "a" * 64 + '", "launch": 3}',
            "launch",
        ),
        ("1", "x" * 10000, "exceeds the limit"),
    ],
)
def test_malformed_registrations_fail_in_one_line(
    redis_url: str, field: str, value: str, fault: str
) -> None:
    r = redis_client(redis_url)
    r.hset(keys.shards_key("run", 1), field, value)
    with pytest.raises(CorruptObjectError, match=fault) as info:
        rank_folders(r, "run", 1)
    assert "\n" not in str(info.value)


def test_ranks_that_disagree_about_the_world_are_refused(redis_url: str) -> None:
    r = redis_client(redis_url)
    register_rank(r, "run", 1, 0, RankFolder("h0", "/a", 2, "a" * 64))
    register_rank(r, "run", 1, 1, RankFolder("h0", "/b", 3, "a" * 64))
    with pytest.raises(CorruptObjectError, match="disagree"):
        rank_folders(r, "run", 1)


# -------------------------------------------------------------------------- names


def test_checkpoint_renaming_is_what_checkpoint_state_writes() -> None:
    from pipeline.format.checkpoints.checkpoint_names import checkpoint_renaming, checkpoint_state

    torch.manual_seed(0)
    llama = sharded_ranks._tiny_transformers(moe=False)
    state = llama.state_dict()
    renaming = checkpoint_renaming(llama, list(state))
    written, form = checkpoint_state(llama)
    assert form == "checkpoint" and renaming is not None
    assert list(renaming) == list(written) and "lm_head.weight" in state
    for new, old in renaming.items():
        assert torch.equal(state[old], written[new])
    moe = sharded_ranks._tiny_transformers(moe=True)
    assert checkpoint_renaming(moe, list(moe.state_dict())) is None  # experts get split


# -------------------------------------------------------------------------- real ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn_ranks(rank_main: Callable[..., None], redis_url: str, tmp_path: Path) -> None:
    """``WORLD`` ranks of ``rank_main`` in a gloo group, each choosing its own host."""
    env = deltasync_env(redis_url, tmp_path)
    env.pop("DELTASYNC_DIFF_HOST", None)
    mp.spawn(rank_main, args=(WORLD, _free_port(), env, str(tmp_path)), nprocs=WORLD, join=True)


def _reassemble(r: Any, run: str, step: int, world: int) -> dict[str, torch.Tensor]:
    """The full tensors of ``step`` from every rank's folder, as integer views; every
    element must be covered exactly once."""
    folders = rank_folders(r, run, step)
    assert sorted(folders) == list(range(world))
    flats: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for rank, entry in folders.items():
        assert entry.host == sharded_ranks.host_of(rank)
        assert f"/{entry.host}/staging/" in entry.path  # each host its own staging
        layout = read_layout(entry.path)
        assert (layout.rank, layout.world, layout.host, layout.step) == (
            rank,
            world,
            entry.host,
            step,
        )
        assert layout_digest(layout) == entry.layout
        if not layout.pieces:
            continue
        reader = CheckpointReader(entry.path)
        assert reader.names() == [p.name for p in layout.pieces]  # the sidecar's order
        for p in layout.pieces:
            tensor = reader.get(p.name)
            dtype = BY_NAME[p.dtype]
            assert tensor.dtype == dtype.dtype and tuple(tensor.shape) == (p.numel,)
            numel = math.prod(p.shape)
            if p.name not in flats:
                flats[p.name] = torch.zeros(numel, dtype=dtype.view)
                covered[p.name] = torch.zeros(numel, dtype=torch.int32)
                shapes[p.name] = p.shape
            assert shapes[p.name] == p.shape
            # Placed element by element: a box's elements are not one flat range.
            at = p.region.positions(torch.arange(p.numel))
            flats[p.name][at] = tensor.view(dtype.view)
            covered[p.name][at] += 1
        reader.close()
    for name, count in covered.items():
        assert torch.equal(count, torch.ones_like(count)), f"{name} not covered exactly once"
    return {name: flat.reshape(shapes[name]) for name, flat in flats.items()}


def _as_int(t: torch.Tensor) -> torch.Tensor:
    dtype = torch.bfloat16 if t.is_floating_point() else t.dtype
    t = t.detach().to(dtype)
    return t.view({torch.bfloat16: torch.int16, torch.int64: torch.int64}[dtype])


def _events(r: Any, run: str) -> list[dict[str, Any]]:
    out = []
    for _, fields in r.xrange(keys.stream_key(run)):
        raw = next(iter(fields.values()))
        out.append(json.loads(raw))
    return out


def _completed_steps(r: Any, run: str) -> list[int]:
    return [e["version"] for e in _events(r, run) if e.get("type") == "step-completed"]


def _jobs(r: Any) -> dict[str, dict[str, Any]]:
    queue = queues.queue(r, queues.DIFF_QUEUE)
    return {job.id: job.kwargs for job in queue.get_jobs()}


@pytest.mark.slow
def test_fsdp2_ranks_emit_their_shards_and_the_steps_reassemble_bit_for_bit(
    redis_url: str, tmp_path: Path
) -> None:
    _spawn_ranks(sharded_ranks.fsdp_rank, redis_url, tmp_path)
    r = redis_client(redis_url)
    results = {
        rank: json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in range(WORLD)
    }

    for step in (1, 2, 4, 5):
        expected = torch.load(tmp_path / f"expected-{step}.pt")
        got = _reassemble(r, "fsdp", step, WORLD)
        assert list(got) == list(expected)  # the module's own names, in its order
        for name, full in expected.items():
            assert torch.equal(got[name], _as_int(full)), (step, name)
        # One rank completed it; the others only registered.
        assert sum(results[k][str(step)]["completed"] for k in range(WORLD)) == 1

    # Rank 2 raised before registering at step 3: nothing was sent for it.
    assert "is not inside [3, 2]" in results[2]["3"]["error"]
    assert sorted(rank_folders(r, "fsdp", 3)) == [0, 1, 3]
    assert not r.exists(keys.emitted_key("fsdp", 3))
    assert _completed_steps(r, "fsdp") == [1, 2, 4, 5]
    pending = r.hgetall(keys.pending_steps_key("fsdp"))
    assert sorted(int(k) for k in pending) == [1, 2, 4, 5]
    jobs = _jobs(r)
    fsdp_jobs = {k: v for k, v in jobs.items() if v["run"] == "fsdp"}
    assert sorted(fsdp_jobs) == sorted(queues.diff_job_id("fsdp", s) for s in (1, 2, 4, 5))
    for kwargs in fsdp_jobs.values():
        assert kwargs["sharded"] is True and kwargs["owned"] is True
        step_dir = Path(kwargs["checkpoint"])
        assert step_dir.name == f"step-{kwargs['step']:010d}"
        assert any(p.name.startswith("rank-") for p in step_dir.iterdir())
    # Step 3 never completed: its staged folders went once step 4 had.
    for host in ("h0", "h1"):
        staged = sorted(p.name for p in (tmp_path / host / "staging" / "fsdp").iterdir())
        assert staged == [f"step-{s:010d}" for s in (1, 2, 4, 5)], host

    # Mappings: Replicate staged once, tensor-parallel and 2-D mesh boxes, row slices,
    # a tensor one rank holds whole; all placed element for element.
    assert "'sum'" in results[0]["refused-partial"] and "Partial" in results[0]["refused-partial"]
    got = _reassemble(r, "maps", 0, WORLD)
    assert torch.equal(got["rep"], _as_int(torch.arange(10.0).reshape(2, 5)))
    assert torch.equal(got["col"], _as_int(torch.arange(32.0).reshape(4, 8)))
    assert torch.equal(got["tp"], _as_int(torch.arange(32.0).reshape(4, 8)))
    assert torch.equal(got["grid"], _as_int(torch.arange(48.0).reshape(8, 6)))
    assert torch.equal(got["cube"], _as_int(torch.arange(105.0).reshape(3, 5, 7)))
    assert torch.equal(got["rows"], _as_int(torch.arange(24.0).reshape(8, 3)))
    assert torch.equal(got["ints"], torch.arange(5, dtype=torch.int64))
    for stage in (0, 1):
        want = torch.arange(12.0).reshape(4, 3) + 100 * stage
        assert torch.equal(got[f"stage{stage}"], _as_int(want))
    boxes = {
        p.name: p.size
        for entry in rank_folders(r, "maps", 0).values()
        for p in read_layout(entry.path).pieces
        if entry.path.endswith("rank-00003")
    }
    assert boxes["col"] == (4, 2) and boxes["grid"] == (4, 3) and boxes["cube"] == (3, 2, 3)
    assert _completed_steps(r, "maps") == [0]
    assert queues.diff_job_id("maps", 0) in jobs


def test_fsdp2_over_tensor_parallel_ranks_emit_boxes_that_reassemble_bit_for_bit(
    redis_url: str, tmp_path: Path
) -> None:
    """A (dp=2, tp=2) mesh: column- and row-parallel weights under FSDP2, real AdamW
    steps; every rank stages only its chunk, the row-parallel ones as boxes."""
    _spawn_ranks(sharded_ranks.tp_fsdp_rank, redis_url, tmp_path)
    r = redis_client(redis_url)
    placements = json.loads((tmp_path / "tp-placements-0.json").read_text())
    assert "Shard(dim=1)" in placements["blocks.0.down.weight"]  # row-parallel, kept by FSDP
    assert "Shard(dim=0)" in placements["blocks.0.up.weight"]
    for step in (1, 2, 3):
        expected = torch.load(tmp_path / f"tp-expected-{step}.pt")
        got = _reassemble(r, "tp", step, WORLD)
        assert list(got) == list(expected)
        for name, full in expected.items():
            assert torch.equal(got[name], _as_int(full)), (step, name)
        done = [
            json.loads((tmp_path / f"tp-rank-{k}-{step}.json").read_text())["completed"]
            for k in range(WORLD)
        ]
        assert sum(done) == 1
    layout = read_layout(rank_folders(r, "tp", 3)[1].path)
    down = next(p for p in layout.pieces if p.name == "blocks.0.down.weight")
    assert down.size and not down.region.is_contiguous  # a box: columns of some rows
    assert _completed_steps(r, "tp") == [1, 2, 3]


@pytest.mark.slow
def test_transformers_models_under_fsdp2_get_their_checkpoint_names(
    redis_url: str, tmp_path: Path
) -> None:
    env = deltasync_env(redis_url, tmp_path)
    world = 2
    mp.spawn(
        sharded_ranks.transformers_rank,
        args=(world, _free_port(), env, str(tmp_path)),
        nprocs=world,
        join=True,
    )
    r = redis_client(redis_url)
    for run, form in (("llama", "checkpoint"), ("moe", "given")):
        expected = torch.load(tmp_path / f"{run}.pt")
        got = _reassemble(r, run, 0, world)
        assert sorted(got) == sorted(expected)
        for name, full in expected.items():
            assert torch.equal(got[name], _as_int(full)), (run, name)
        for entry in rank_folders(r, run, 0).values():
            assert CheckpointReader(entry.path).metadata[FORM_METADATA_KEY] == form
        assert _completed_steps(r, run) == [0]
        # The tied head is dropped from the checkpoint; the MoE keeps its fused experts.
        assert ("lm_head.weight" in got) == (run == "moe")
        assert any(".experts.gate_up_proj" in name for name in got) == (run == "moe")


def _plain_ranks(env: dict[str, str], tmp: Path, steps: str, fault: dict[int, str]) -> list[int]:
    procs = []
    port = str(_free_port())
    for rank in range(WORLD):
        host = sharded_ranks.host_of(rank)
        rank_env = {**env, "DELTASYNC_STAGING": str(tmp / host / "staging")}
        if rank in fault:
            rank_env["DELTASYNC_FAULT"] = fault[rank]
        cmd = [sys.executable, "-m", "tests.sharded_ranks", "plain", str(rank), str(WORLD)]
        procs.append(subprocess.Popen([*cmd, steps, str(tmp), port], env=rank_env, cwd=REPO))
    return [p.wait(timeout=300) for p in procs]


@pytest.mark.slow
def test_a_rank_killed_before_registering_leaves_the_step_unsent(
    redis_url: str, tmp_path: Path
) -> None:
    env = deltasync_env(redis_url, tmp_path)
    codes = _plain_ranks(env, tmp_path, "1", {3: "emit.before_register"})
    assert codes[:3] == [0, 0, 0] and codes[3] == -9
    r = redis_client(redis_url)
    assert sorted(rank_folders(r, "plain", 1)) == [0, 1, 2]
    assert _completed_steps(r, "plain") == []
    assert _jobs(r) == {}
    assert not r.hgetall(keys.pending_steps_key("plain"))
    killed = tmp_path / "h1" / "staging" / "plain" / f"step-{1:010d}" / "rank-00003"
    assert read_layout(killed).rank == 3  # staged, then killed before registering

    # A restarted trainer: the next steps complete.
    assert _plain_ranks(env, tmp_path, "2,3", {}) == [0, 0, 0, 0]
    for step in (2, 3):
        got = _reassemble(r, "plain", step, WORLD)
        assert torch.equal(got["w"], _as_int(sharded_ranks.plain_full(step)))
        assert torch.equal(got["b"], _as_int(torch.ones(3)))
    assert _completed_steps(r, "plain") == [2, 3]
    assert sorted(_jobs(r)) == sorted(queues.diff_job_id("plain", s) for s in (2, 3))
    # The killed step's folders (rank 3 staged before it died) are gone.
    for host in ("h0", "h1"):
        staged = sorted(p.name for p in (tmp_path / host / "staging" / "plain").iterdir())
        assert staged == [f"step-{s:010d}" for s in (2, 3)], host
