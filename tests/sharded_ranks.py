"""Trainer ranks of a sharded run, for tests/publish/test_sharded_emit.py: real processes.

- ``fsdp_rank``: one rank of a gloo process group (``torch.multiprocessing.spawn``)
  training a small model wrapped with FSDP2 ``fully_shard``, emitting after each
  AdamW step; it saves the gathered full state (test only) for the parent to check.
- ``python -m tests.sharded_ranks plain RANK WORLD STEP OUT``: one rank emitting a
  step of plain row slices (``ShardPiece``), no process group; ``DELTASYNC_FAULT``
  may kill it on the way.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

SEED = 7
VOCAB = 11  # odd sizes: dim 0 does not divide by 4, the last ranks hold fewer rows
WIDTH = 6
HIDDEN = 9
BATCH = (3, 5)


def host_of(rank: int) -> str:
    return f"h{rank // 2}"  # two ranks per emulated host


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.RMSNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(self.norm(x))
        return out


def sharded_model() -> tuple[TinyLM, torch.optim.Optimizer]:
    """The model wrapped with FSDP2 ``fully_shard`` (blocks, then the whole) and its
    AdamW, the same on every rank (the process group initialised)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(SEED)
    model = TinyLM()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """One real AdamW step on a batch drawn from ``step``."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, BATCH, generator=g)
    model(tokens).float().pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def plain_full(step: int) -> torch.Tensor:
    """The full tensor the plain ranks hold row slices of, at ``step``."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(10, 3, generator=g)


def _atomic(path: Path, write: Callable[[Path], object]) -> None:
    """``write`` to a temporary name, then rename: the test polls for ``path`` and
    reads it as soon as it exists, so it must never see a partial file."""
    partial = path.with_name(path.name + ".partial")
    write(partial)
    os.replace(partial, path)


def _write(out: Path, name: str, doc: dict[str, Any]) -> None:
    _atomic(out / name, lambda path: path.write_text(json.dumps(doc)))


def _save(out: Path, name: str, tensors: dict[str, torch.Tensor]) -> None:
    _atomic(out / name, lambda path: torch.save(tensors, path))


def _host_env(rank: int, port: int, env: dict[str, str], out: str) -> None:
    """A spawned rank's environment: its emulated host's name and staging folder."""
    os.environ.update(env)
    host = host_of(rank)
    os.environ["DELTASYNC_DIFF_HOST"] = host
    os.environ["DELTASYNC_STAGING"] = str(Path(out) / host / "staging")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)


def fsdp_rank(rank: int, world: int, port: int, env: dict[str, str], out: str) -> None:
    _host_env(rank, port, env, out)

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from pipeline.errors import DeltasyncError
    from workers.trainers.sharded_trainer import ShardedEmitter, ShardPiece

    dist.init_process_group("gloo", rank=rank, world_size=world)
    folder = Path(out)
    try:
        model, optimizer = sharded_model()
        emitter = ShardedEmitter("fsdp")
        results: dict[str, Any] = {}
        for step in range(1, 6):
            train_step(model, optimizer, step)
            weights: Any = model
            if step == 3 and rank == 2:
                # This rank fails before it registers: rows past the tensor's end.
                bad = ShardPiece(torch.zeros(2, 2), (3, 2), 2)
                weights = {**model.state_dict(), "bad": bad}
            try:
                done = emitter.emit_shards(step, weights)
                results[str(step)] = {"completed": done.completed, "folder": done.folder}
            except DeltasyncError as exc:
                results[str(step)] = {"error": str(exc)}
            # The full state, gathered here for the test's check only.
            full = {k: v.full_tensor() for k, v in model.state_dict().items()}
            if rank == 0:
                _save(folder, f"expected-{step}.pt", full)

        # Mapping inputs: a replicated DTensor, tensor-parallel slices of dim 1, boxes of
        # a 2-D mesh (FSDP x TP), uneven boxes of a 3-D tensor, a refused Partial, row
        # slices and boxes given as plain tensors, a whole tensor held by one rank only.
        mesh = next(iter(model.state_dict().values())).device_mesh
        grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        maps = ShardedEmitter("maps")
        try:
            maps.emit_shards(0, {"sum": DTensor.from_local(torch.ones(2, 2), mesh, [Partial()])})
        except DeltasyncError as exc:
            results["refused-partial"] = str(exc)
        rows = torch.arange(24.0).reshape(8, 3)
        cols = torch.arange(32.0).reshape(4, 8)
        mapping: dict[str, Any] = {
            "rep": distribute_tensor(torch.arange(10.0).reshape(2, 5), mesh, [Replicate()]),
            "col": distribute_tensor(cols, mesh, [Shard(1)]),
            "grid": distribute_tensor(torch.arange(48.0).reshape(8, 6), grid, [Shard(0), Shard(1)]),
            "cube": distribute_tensor(
                torch.arange(105.0).reshape(3, 5, 7), grid, [Shard(1), Shard(2)]
            ),
            "rows": ShardPiece(rows[rank * 2 : rank * 2 + 2], (8, 3), rank * 2),
            "tp": ShardPiece(cols[:, rank * 2 : rank * 2 + 2], (4, 8), offset=(0, rank * 2)),
        }
        if rank == 1:
            mapping["ints"] = torch.arange(5, dtype=torch.int64)
        # Pipeline stages: each stage's tensors on its own dp sub-mesh of a (pp, dp)
        # mesh; "pp" is no parallel dimension (no tensor is placed on it), so both
        # stages stage theirs.
        stages = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        stage = stages.get_coordinate()[0]
        mapping[f"stage{stage}"] = distribute_tensor(
            torch.arange(12.0).reshape(4, 3) + 100 * stage, stages["dp"], [Shard(0)]
        )
        done = maps.emit_shards(0, mapping)
        results["maps"] = {"completed": done.completed, "folder": done.folder}
        _write(folder, f"rank-{rank}.json", results)
        dist.barrier()  # no rank tears gloo down while a peer's collective still runs
    finally:
        dist.destroy_process_group()


def tp_fsdp_rank(rank: int, world: int, port: int, env: dict[str, str], out: str) -> None:
    """One rank of ``tp_sharded_model`` (FSDP2 over tensor parallelism) for
    tests/publish/test_sharded_emit.py: real AdamW steps, emitted after each."""
    _host_env(rank, port, env, out)
    import torch.distributed as dist

    from workers.trainers.sharded_trainer import ShardedEmitter

    dist.init_process_group("gloo", rank=rank, world_size=world)
    folder = Path(out)
    try:
        model, optimizer = tp_sharded_model()
        emitter = ShardedEmitter("tp")
        for step in range(1, 4):
            train_step(model, optimizer, step)
            done = emitter.emit_shards(step, model)
            full = {k: v.full_tensor() for k, v in model.state_dict().items()}
            if rank == 0:
                _save(folder, f"tp-expected-{step}.pt", full)
            _write(folder, f"tp-rank-{rank}-{step}.json", {"completed": done.completed})
        placements = {k: str(tuple(v.placements)) for k, v in model.state_dict().items()}
        _write(folder, f"tp-placements-{rank}.json", placements)
        dist.barrier()  # no rank tears gloo down while a peer's collective still runs
    finally:
        dist.destroy_process_group()


def _tiny_transformers(moe: bool) -> nn.Module:
    import transformers

    common = {
        "vocab_size": 37,
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
    }
    if moe:
        config = transformers.Qwen3MoeConfig(
            **common, num_experts=3, num_experts_per_tok=2, moe_intermediate_size=8
        )
        return transformers.Qwen3MoeForCausalLM(config)
    config = transformers.LlamaConfig(**common, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(config)


def transformers_rank(rank: int, world: int, port: int, env: dict[str, str], out: str) -> None:
    """Emits a tied-embedding Llama (checkpoint names: the tied copy dropped) and an MoE
    model (fused experts: names as given) wrapped with fully_shard, untrained."""
    os.environ.update(env)
    os.environ["DELTASYNC_DIFF_HOST"] = host_of(rank)
    os.environ["DELTASYNC_STAGING"] = str(Path(out) / host_of(rank) / "staging")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)

    import copy

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from pipeline.format.checkpoints.checkpoint_names import checkpoint_state
    from workers.trainers.sharded_trainer import ShardedEmitter

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for run, moe in (("llama", False), ("moe", True)):
            torch.manual_seed(SEED)
            model = _tiny_transformers(moe)
            if rank == 0:  # the same weights unsharded: what the checkpoint must hold
                state, _ = checkpoint_state(copy.deepcopy(model))
                expected = state if not moe else model.state_dict()
                torch.save({k: v.clone() for k, v in expected.items()}, Path(out) / f"{run}.pt")
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
            ShardedEmitter(run).emit_shards(0, model)
        dist.barrier()  # no rank tears gloo down while a peer's collective still runs
    finally:
        dist.destroy_process_group()


def plain_rank(rank: int, world: int, steps: list[int], out: Path, port: int) -> None:
    """Emit ``steps`` in turn; with several, the ranks wait for each other in between
    (a gloo barrier of this harness, as training steps would), never inside an emit."""
    import torch.distributed as dist

    from workers.trainers.sharded_trainer import ShardedEmitter, ShardPiece

    host = host_of(rank)
    # Settings from env: the parent sets this host's staging folder.
    emitter = ShardedEmitter("plain", rank=rank, world=world, host=host)
    together = len(steps) > 1
    if together:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for step in steps:
            rows = 10 // world + 1
            first = min(rank * rows, 10)
            piece = ShardPiece(plain_full(step)[first : first + rows], (10, 3), first)
            whole = {"b": torch.ones(3)} if rank == 0 else {}
            done = emitter.emit_shards(step, {"w": piece, **whole})
            _write(out, f"plain-{rank}-{step}.json", {"completed": done.completed})
            if together:
                dist.barrier()
    finally:
        if together:
            dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "plain":
        steps = [int(s) for s in sys.argv[4].split(",")]
        plain_rank(int(sys.argv[2]), int(sys.argv[3]), steps, Path(sys.argv[5]), int(sys.argv[6]))


def e2e_rank(
    rank: int, world: int, port: int, envs: dict[str, dict[str, str]], out: str, steps: int
) -> None:
    """One rank of tests/rollout/test_sharded_e2e.py: FSDP2 ``fully_shard`` over gloo, real AdamW
    steps, ``emit_shards`` after each, with this rank's host's settings (``envs``). Rank 0
    saves the gathered state of each step (test only) and waits, with every rank behind
    a barrier, for the test to write ``go-<step>`` before the next step; at step 2 rank 3
    raises before registering, so step 2 is never sent."""
    os.environ.update(envs[host_of(rank)])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)

    import time

    import torch.distributed as dist

    from pipeline.errors import DeltasyncError
    from workers.trainers.sharded_trainer import ShardedEmitter, ShardPiece

    dist.init_process_group("gloo", rank=rank, world_size=world)
    folder = Path(out)
    try:
        model, optimizer = sharded_model()
        emitter = ShardedEmitter("e2e")
        for step in range(1, steps + 1):
            train_step(model, optimizer, step)
            weights: Any = model
            if step == 2 and rank == 3:  # rows past the tensor's end: refused, unregistered
                weights = {**model.state_dict(), "bad": ShardPiece(torch.zeros(2, 2), (3, 2), 2)}
            try:
                emitter.emit_shards(step, weights)
            except DeltasyncError as exc:
                _write(folder, f"error-{rank}-{step}.json", {"error": str(exc)})
            full = {k: v.full_tensor().to(torch.bfloat16) for k, v in model.state_dict().items()}
            if rank == 0:
                _save(folder, f"expected-{step}.pt", full)
                go = folder / f"go-{step}"
                while not go.exists():
                    time.sleep(0.05)
            dist.barrier()
    finally:
        dist.destroy_process_group()


class TPBlock(nn.Module):
    """Attention-like and MLP-like halves: q/up made column-parallel (Shard(0) weights),
    o/down row-parallel (Shard(1) weights, replicated biases)."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(WIDTH, 10)
        self.o = nn.Linear(10, WIDTH)
        self.up = nn.Linear(WIDTH, 14)
        self.down = nn.Linear(14, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.o(torch.tanh(self.q(x)))
        return x + self.down(torch.relu(self.up(x)))


class TinyTP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)  # left out of TP: on the dp slice only
        self.blocks = nn.ModuleList([TPBlock(), TPBlock()])
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(x)
        return out


def tp_sharded_model() -> tuple[TinyTP, torch.optim.Optimizer]:
    """TinyTP on a (dp=2, tp=2) mesh: each block made tensor-parallel over ``tp`` (q/up
    column-parallel, o/down row-parallel), then FSDP2 ``fully_shard`` over ``dp``; its
    AdamW, the same on every rank (the process group initialised)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(SEED)
    model = TinyTP()
    for block in model.blocks:
        plan = {"q": ColwiseParallel(), "o": RowwiseParallel()}
        parallelize_module(
            block, mesh["tp"], plan | {"up": ColwiseParallel(), "down": RowwiseParallel()}
        )
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def tp_rank(
    rank: int, world: int, port: int, envs: dict[str, dict[str, str]], out: str, steps: int
) -> None:
    """One rank of a (dp=2, tp=2) mesh for tests/rollout/test_sharded_e2e.py: the blocks made
    tensor-parallel over ``tp``, then FSDP2 ``fully_shard`` over ``dp``, real AdamW
    steps, ``emit_shards`` after each; rank 0 saves the gathered state (test only) and
    all wait for ``go-<step>``, as in ``e2e_rank``."""
    os.environ.update(envs[host_of(rank)])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)

    import time

    import torch.distributed as dist

    from workers.trainers.sharded_trainer import ShardedEmitter

    dist.init_process_group("gloo", rank=rank, world_size=world)
    folder = Path(out)
    try:
        model, optimizer = tp_sharded_model()
        emitter = ShardedEmitter("e2e")
        for step in range(1, steps + 1):
            train_step(model, optimizer, step)
            emitter.emit_shards(step, model)
            full = {k: v.full_tensor().to(torch.bfloat16) for k, v in model.state_dict().items()}
            if rank == 0:
                _save(folder, f"expected-{step}.pt", full)
                while not (folder / f"go-{step}").exists():
                    time.sleep(0.05)
            dist.barrier()
    finally:
        dist.destroy_process_group()
