"""A small sharded trainer's states for tests: full tensors, each split into flat pieces
over ``world`` ranks, and realistic steps.

The split is uneven on purpose: a tensor held by one rank only, one with a one-element
piece, ranks that hold nothing of some tensors, and an fp32 tensor among the bf16 ones.
Each step changes about ``fraction`` of every tensor's elements (bf16 by one unit in
the last place, as most bf16 updates of a trainer do; fp32 by a small float), so every
tensor is touched. Deterministic by seed. Writing these into a store as a pieced run is
the test helper ``tests/sharded_store.py``'s job (it needs the publish layer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pipeline.errors import ConfigError


@dataclass(frozen=True)
class RankRange:
    """Flat elements ``[start, stop)`` of tensor ``name`` held by ``rank``."""

    rank: int
    name: str
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class ShardedTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    # (rank, stop) in order: rank r holds [previous stop, stop); the last stop is numel.
    cuts: tuple[tuple[int, int], ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


# Three ranks. Cuts are uneven; the norm is rank 1's alone, q_proj's first piece is one
# element, up_proj skips rank 1, the fp32 bias skips rank 0.
_BF16 = torch.bfloat16
DEFAULT_TENSORS: tuple[ShardedTensor, ...] = (
    ShardedTensor("model.embed_tokens.weight", _BF16, (96, 32), ((0, 1000), (1, 1900), (2, 3072))),
    ShardedTensor("model.layers.0.self_attn.q_proj.weight", _BF16, (32, 32), ((0, 1), (1, 600), (2, 1024))),  # noqa: E501
    ShardedTensor("model.layers.0.mlp.up_proj.weight", _BF16, (64, 32), ((0, 1500), (2, 2048))),
    ShardedTensor("model.norm.weight", _BF16, (32,), ((1, 32),)),
    ShardedTensor("score.bias", torch.float32, (48,), ((1, 20), (2, 48))),
    ShardedTensor("lm_head.weight", _BF16, (96, 32), ((0, 700), (1, 2500), (2, 3072))),
)  # fmt: skip


def split_state(
    state: dict[str, torch.Tensor], world: int, *, small: int = 256
) -> tuple[ShardedTensor, ...]:
    """Uneven cuts of any state's tensors over ``world`` ranks, as FSDP-like flat
    shards that are not quite equal: tensors under ``small`` elements are held by
    one rank (in turn), larger ones are cut near ``numel * k / world``, each cut
    moved by a few elements so that no two tensors split alike."""
    out: list[ShardedTensor] = []
    for i, (name, t) in enumerate(state.items()):
        numel = t.numel()
        if numel < small or world == 1:
            cuts: tuple[tuple[int, int], ...] = ((i % world, numel),)
        else:
            stops = [
                min(numel - 1, max(1, numel * k // world + (i * 7) % 13 - 6))
                for k in range(1, world)
            ]
            stops = sorted(set(stops))
            cuts = tuple((r, stop) for r, stop in enumerate([*stops, numel]))
        out.append(ShardedTensor(name, t.dtype, tuple(t.shape), cuts))
    return tuple(out)


def rank_ranges(tensors: tuple[ShardedTensor, ...] = DEFAULT_TENSORS) -> dict[int, list[RankRange]]:
    """Each rank's pieces in checkpoint order (what its sidecar would list)."""
    out: dict[int, list[RankRange]] = {}
    for t in tensors:
        at = 0
        for rank, stop in t.cuts:
            if stop <= at:
                raise ConfigError(f"tensor {t.name!r}: cut {stop} does not advance from {at}")
            out.setdefault(rank, []).append(RankRange(rank, t.name, at, stop))
            at = stop
        if at != t.numel:
            raise ConfigError(f"tensor {t.name!r}: cuts end at {at}, not {t.numel}")
    return dict(sorted(out.items()))


def piece_of(state: dict[str, torch.Tensor], r: RankRange) -> torch.Tensor:
    """The 1-D piece ``r`` of ``state`` (a contiguous copy, as a rank stages it)."""
    return state[r.name].reshape(-1)[r.start : r.stop].clone()


class ShardedTrainer:
    """Successive full states of a sharded model, deterministic by seed."""

    def __init__(
        self,
        tensors: tuple[ShardedTensor, ...] = DEFAULT_TENSORS,
        *,
        seed: int = 0,
        fraction: float = 0.02,
    ) -> None:
        self.tensors = tensors
        self.fraction = fraction
        self.gen = torch.Generator().manual_seed(seed)
        self.ranges = rank_ranges(tensors)
        self.state: dict[str, torch.Tensor] = {
            t.name: (torch.randn(t.shape, generator=self.gen) * 0.02).to(t.dtype) for t in tensors
        }

    def step(self) -> dict[str, torch.Tensor]:
        """Change about ``fraction`` of every tensor's elements (at least one each);
        returns the new state (new tensors: earlier states stay as they were)."""
        new: dict[str, torch.Tensor] = {}
        for t in self.tensors:
            flat = self.state[t.name].reshape(-1).clone()
            count = max(1, round(self.fraction * t.numel))
            where = torch.randperm(t.numel, generator=self.gen)[:count]
            if t.dtype == torch.bfloat16:
                ulps = torch.randint(0, 2, (count,), generator=self.gen, dtype=torch.int16) * 2 - 1
                bits = flat.view(torch.int16)
                bits[where] += ulps
            else:
                flat[where] += torch.randn(count, generator=self.gen).to(t.dtype) * 1e-3
            new[t.name] = flat.view(t.shape)
        self.state = new
        return new
