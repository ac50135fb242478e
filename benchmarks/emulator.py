"""A fast update emulator: realistic bf16 weight changes without a backward pass.

    python benchmarks/emulator.py [--calibrate small] [--validate medium] [--steps 3]

Real AdamW updates at small learning rates change a bf16 element when the fp32
master weight crosses a rounding boundary; an update of roughly fixed size
crosses one far more often where the unit in the last place is small, so the
chance of a change depends on the element's exponent, and most changes are
+-1 unit in the last place. :class:`ChangeProfile` measures exactly those two
things on real optimizer steps of ``pipeline.testing.synthetic`` (change probability
per exponent, distribution of the bit-pattern difference per exponent), and
:class:`UpdateEmulator` draws new versions of any bf16 state from it: one
compiled pass over the integer view per step (about a nanosecond per element),
so a 0.5B-parameter state takes about a second per version where a real
optimizer step would need a model, data and a backward pass.

Run as a script, it calibrates on one preset and validates against real AdamW
steps of another (a larger model it has never seen): changed fraction, the
share of +-1 differences, and encoded bytes per changed element through the
real codec.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

try:
    import numba
except ImportError:  # pragma: no cover - numba is installed with the project's extras
    numba = None

MAX_DIFF = 16  # bit-pattern differences beyond +-MAX_DIFF are folded into the ends
_CLASSES = 256  # bf16 exponent values
_MIN_CLASS_CHANGES = 200  # fewer observed changes: the class uses the pooled distribution


def _exponents(bits: torch.Tensor) -> torch.Tensor:
    return ((bits.to(torch.int32) >> 7) & 0xFF).to(torch.int64)


@dataclass(frozen=True)
class ChangeProfile:
    """Per bf16 exponent: the chance an element changes in one step, and the
    distribution of its bit-pattern difference (new - old, int16 view)."""

    change_prob: npt.NDArray[np.float64]  # [256]
    diff_prob: npt.NDArray[np.float64]  # [256, 2 * MAX_DIFF + 1], rows sum to 1

    @classmethod
    def calibrate(cls, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> ChangeProfile:
        """Measure a profile from (before, after) bf16 tensor pairs of real steps."""
        seen = np.zeros(_CLASSES, np.float64)
        changed = np.zeros(_CLASSES, np.float64)
        diffs = np.zeros((_CLASSES, 2 * MAX_DIFF + 1), np.float64)
        for before, after in pairs:
            old = before.detach().reshape(-1).view(torch.int16)
            new = after.detach().reshape(-1).view(torch.int16)
            classes = _exponents(old)
            seen += np.bincount(classes.numpy(), minlength=_CLASSES)
            where = (old != new).nonzero().squeeze(1)
            if where.numel() == 0:
                continue
            cls_changed = classes[where]
            changed += np.bincount(cls_changed.numpy(), minlength=_CLASSES)
            step = (new[where].to(torch.int32) - old[where].to(torch.int32)).clamp(
                -MAX_DIFF, MAX_DIFF
            )
            flat = (cls_changed * (2 * MAX_DIFF + 1) + step + MAX_DIFF).numpy()
            diffs += np.bincount(flat, minlength=diffs.size).reshape(diffs.shape)
        prob = np.divide(changed, seen, out=np.zeros_like(changed), where=seen > 0)
        pooled = diffs.sum(axis=0)
        if pooled.sum() == 0:
            raise ValueError("calibration steps changed no element")
        pooled /= pooled.sum()
        rows = np.empty_like(diffs)
        for c in range(_CLASSES):
            total = diffs[c].sum()
            rows[c] = diffs[c] / total if total >= _MIN_CLASS_CHANGES else pooled
        # Unseen classes: extrapolate the change chance as halving per exponent step up
        # (a boundary twice as far away), from the nearest class that was seen.
        observed = np.flatnonzero(seen > 0)
        for c in range(_CLASSES):
            if seen[c] == 0:
                near = observed[np.argmin(np.abs(observed - c))]
                prob[c] = min(1.0, prob[near] * 2.0 ** (near - c))
        return cls(prob, rows)

    def scaled(self, factor: float) -> ChangeProfile:
        """The same shape with every change chance multiplied (capped at 1)."""
        return ChangeProfile(np.minimum(1.0, self.change_prob * factor), self.diff_prob)

    def expected_density(self, state: Iterable[torch.Tensor]) -> float:
        seen = np.zeros(_CLASSES, np.float64)
        for t in state:
            seen += np.bincount(
                _exponents(t.reshape(-1).view(torch.int16)).numpy(), minlength=_CLASSES
            )
        return float((seen * self.change_prob).sum() / seen.sum())

    def tuned_for(self, state: Iterable[torch.Tensor], density: float) -> ChangeProfile:
        """Scaled so that ``state`` is expected to change at ``density`` per step."""
        tensors = list(state)
        factor = density / max(self.expected_density(tensors), 1e-12)
        for _ in range(4):  # the cap at 1 makes the density sublinear in the factor
            got = self.scaled(factor).expected_density(tensors)
            factor *= density / max(got, 1e-12)
        return self.scaled(factor)


def _build_kernel() -> object:
    if numba is None:
        return None

    @numba.njit(nogil=True, cache=True)  # type: ignore[misc,untyped-decorator]
    def mutate(
        bits: npt.NDArray[np.int16],
        thresholds: npt.NDArray[np.uint32],
        cdf: npt.NDArray[np.uint32],
        seed: np.uint64,
    ) -> int:
        # xorshift64* per element; 32-bit draws against per-class thresholds.
        state = seed | np.uint64(1)
        width = cdf.shape[1]
        count = 0
        for i in range(bits.shape[0]):
            state ^= state >> np.uint64(12)
            state ^= state << np.uint64(25)
            state ^= state >> np.uint64(27)
            r = (state * np.uint64(2685821657736338717)) >> np.uint64(32)
            c = (np.int32(bits[i]) >> 7) & 0xFF
            if r < thresholds[c]:
                state ^= state >> np.uint64(12)
                state ^= state << np.uint64(25)
                state ^= state >> np.uint64(27)
                u = (state * np.uint64(2685821657736338717)) >> np.uint64(32)
                k = 0
                while k < width - 1 and u >= cdf[c, k]:
                    k += 1
                d = k - (width - 1) // 2
                if d != 0:
                    bits[i] = np.int16(np.int32(bits[i]) + d)
                    count += 1
        return count

    return mutate


_KERNEL = _build_kernel()


class UpdateEmulator:
    """Draws successive versions of a bf16 state from a :class:`ChangeProfile`."""

    def __init__(self, profile: ChangeProfile, seed: int = 0) -> None:
        if _KERNEL is None:
            raise RuntimeError("the update emulator needs numba")
        self.profile = profile
        self.rng = np.random.default_rng(seed)
        scale = float(1 << 32)
        self.thresholds = np.minimum(profile.change_prob * scale, scale - 1).astype(np.uint32)
        # A zero difference is never drawn: rows are renormalised without it.
        probs = profile.diff_prob.copy()
        probs[:, MAX_DIFF] = 0.0
        sums = probs.sum(axis=1, keepdims=True)
        probs = np.divide(probs, sums, out=np.zeros_like(probs), where=sums > 0)
        self.cdf = np.minimum(np.cumsum(probs, axis=1) * scale, scale - 1).astype(np.uint32)

    def step_(self, state: dict[str, torch.Tensor]) -> int:
        """Change ``state`` (bf16 CPU tensors) in place to its next version; returns
        the number of changed elements."""
        changed = 0
        for tensor in state.values():
            bits = tensor.view(torch.int16).reshape(-1).numpy()
            seed = np.uint64(self.rng.integers(1, 2**63))
            changed += int(_KERNEL(bits, self.thresholds, self.cdf, seed))  # type: ignore[operator]
        return changed


class UniformEmulator:
    """A harder update than the calibrated one: every tensor changes exactly
    ``density`` of its elements (at least one) at uniformly random positions, by +-1
    or +-2 units in the last place, a third of them +-2 (real AdamW steps: about 89%
    +-1). So every tensor is touched, norms and embeddings as much as the rest, and
    every change costs a scattered read and write on a replica: at 0.63B and 2%,
    the statistics of the independent measurement in issue 20 (3.1x a warm copy
    with xxh3-128 and 2 torch replicas on 2 cores)."""

    def __init__(self, density: float, seed: int = 0) -> None:
        self.density = density
        self.rng = np.random.default_rng(seed)
        self.steps = np.array([-2, -1, -1, 1, 1, 2], np.int16)

    def step_(self, state: dict[str, torch.Tensor]) -> int:
        changed = 0
        for tensor in state.values():
            bits = tensor.view(torch.int16).reshape(-1).numpy()
            count = min(bits.size, max(1, round(self.density * bits.size)))
            where = np.unique(self.rng.integers(0, bits.size, count))
            while where.size < count:  # drawn twice: top up to the exact count
                more = self.rng.integers(0, bits.size, count - where.size)
                where = np.union1d(where, more)
            bits[where] += self.rng.choice(self.steps, where.size)
            changed += int(where.size)
        return changed


def _build_magnitude_kernel() -> object:
    if numba is None:
        return None

    @numba.njit(nogil=True, cache=True)  # type: ignore[misc,untyped-decorator]
    def mutate_by_magnitude(
        bits: npt.NDArray[np.int16],
        below: np.uint16,
        small: np.uint32,
        large: np.uint32,
        two: np.uint32,
        seed: np.uint64,
    ) -> int:
        # xorshift64* per element: one 32-bit draw against the threshold of the
        # element's magnitude class, a second for the size and sign of a change.
        state = seed | np.uint64(1)
        count = 0
        for i in range(bits.shape[0]):
            state ^= state >> np.uint64(12)
            state ^= state << np.uint64(25)
            state ^= state >> np.uint64(27)
            r = (state * np.uint64(2685821657736338717)) >> np.uint64(32)
            magnitude = np.uint16(bits[i]) & np.uint16(0x7FFF)
            if r < (small if magnitude < below else large):
                state ^= state >> np.uint64(12)
                state ^= state << np.uint64(25)
                state ^= state >> np.uint64(27)
                u = (state * np.uint64(2685821657736338717)) >> np.uint64(32)
                d = 2 if (u >> np.uint64(1)) < two else 1
                bits[i] = np.int16(np.int32(bits[i]) + (d if u & np.uint64(1) else -d))
                count += 1
        return count

    return mutate_by_magnitude


_MAGNITUDE_KERNEL = _build_magnitude_kernel()


class MagnitudeEmulator:
    """Updates as hard as real training's for a replica: in every tensor, elements of
    less than the tensor's median magnitude change ``ratio`` times as often as the
    rest (``density`` changed on average), and ``two_ulp`` of the changes are +-2
    units in the last place, the rest +-1. Every tensor is touched (at least one
    change). Small weights change more often because an update of about fixed size
    crosses a bf16 rounding boundary more often where the unit in the last place is
    small; unlike ``UniformEmulator``, the changed elements depend on the base's
    contents, as a real step's do."""

    def __init__(
        self, density: float, seed: int = 0, ratio: float = 3.0, two_ulp: float = 0.1
    ) -> None:
        if _MAGNITUDE_KERNEL is None:
            raise RuntimeError("the update emulator needs numba")
        self.rng = np.random.default_rng(seed)
        scale = float(1 << 32)
        large = 2.0 * density / (1.0 + ratio)  # half the elements at each rate
        self.small = np.uint32(min(ratio * large * scale, scale - 1))
        self.large = np.uint32(min(large * scale, scale - 1))
        self.two = np.uint32(two_ulp * float(1 << 31))  # compared with a 31-bit draw
        self.medians: dict[str, np.uint16] = {}

    def step_(self, state: dict[str, torch.Tensor]) -> int:
        changed = 0
        for name, tensor in state.items():
            bits = tensor.view(torch.int16).reshape(-1).numpy()
            if name not in self.medians:  # 2% of +-1 ulp leaves the median where it was
                magnitude = bits.view(np.uint16) & np.uint16(0x7FFF)
                counts = np.cumsum(np.bincount(magnitude, minlength=1 << 15))
                self.medians[name] = np.uint16(np.searchsorted(counts, (bits.size + 1) // 2))
            seed = np.uint64(self.rng.integers(1, 2**63))
            count = int(
                _MAGNITUDE_KERNEL(  # type: ignore[operator]
                    bits, self.medians[name], self.small, self.large, self.two, seed
                )
            )
            if count == 0:  # every tensor touched
                at = int(self.rng.integers(0, bits.size))
                bits[at] = np.int16(int(bits[at]) + (1 if bits[at] < 0x7F7F else -1))
                count = 1
            changed += count
        return changed


# ---------------------------------------------------------------- emulated model


def qwen_like_shapes(
    params: float, vocab: int = 151936, hidden: int = 896, ratio: float = 5.43
) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Llama/Qwen2-style tensor names and shapes with about ``params`` parameters
    (Qwen2.5-0.5B: hidden 896, 24 layers, untied head here)."""
    inter = int(hidden * ratio) // 64 * 64
    mlp = [
        ("mlp.gate_proj.weight", (inter, hidden)),
        ("mlp.up_proj.weight", (inter, hidden)),
        ("mlp.down_proj.weight", (hidden, inter)),
    ]
    return _decoder_shapes(params, vocab, hidden, max(64, hidden // 7), mlp)


def moe_like_shapes(
    params: float,
    vocab: int = 151936,
    hidden: int = 1024,
    experts: int = 128,
    moe_inter: int = 384,
) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Qwen3-MoE-style tensor names and shapes with about ``params`` parameters:
    per layer attention (grouped KV), a router and ``experts`` experts of three
    projections each (Qwen3-30B-A3B's proportions at a smaller hidden size: 128
    experts, expert width 3/8 of hidden). Many small tensors per parameter, so a
    per-tensor cost shows where the dense shapes hide it."""
    mlp: list[tuple[str, tuple[int, ...]]] = [("mlp.gate.weight", (experts, hidden))]
    for e in range(experts):
        mlp += [
            (f"mlp.experts.{e}.gate_proj.weight", (moe_inter, hidden)),
            (f"mlp.experts.{e}.up_proj.weight", (moe_inter, hidden)),
            (f"mlp.experts.{e}.down_proj.weight", (hidden, moe_inter)),
        ]
    return _decoder_shapes(params, vocab, hidden, max(64, hidden // 8), mlp)


def _decoder_shapes(
    params: float,
    vocab: int,
    hidden: int,
    kv: int,
    mlp: list[tuple[str, tuple[int, ...]]],
) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Embedding, as many layers (norms, attention with ``kv`` key/value width, the
    ``mlp`` tensors) as make about ``params`` parameters, final norm, untied head."""
    attention = [
        ("input_layernorm.weight", (hidden,)),
        ("self_attn.q_proj.weight", (hidden, hidden)),
        ("self_attn.k_proj.weight", (kv, hidden)),
        ("self_attn.v_proj.weight", (kv, hidden)),
        ("self_attn.o_proj.weight", (hidden, hidden)),
        ("post_attention_layernorm.weight", (hidden,)),
    ]
    per_layer = sum(math.prod(shape) for _, shape in attention + mlp)
    layers = max(1, round((params - 2 * vocab * hidden) / per_layer))
    yield "model.embed_tokens.weight", (vocab, hidden)
    for i in range(layers):
        for suffix, shape in attention + mlp:
            yield f"model.layers.{i}.{suffix}", shape
    yield "model.norm.weight", (hidden,)
    yield "lm_head.weight", (vocab, hidden)


def make_state(
    shapes: Iterable[tuple[str, tuple[int, ...]]], seed: int = 0, std: float = 0.02
) -> dict[str, torch.Tensor]:
    """bf16 weights with trained-model statistics: N(0, std) matrices, norms near 1."""
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, shape in shapes:
        if len(shape) == 1:
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            t = std * torch.randn(shape, generator=gen)
        state[name] = t.to(torch.bfloat16)
    return state


# ---------------------------------------------------------------- validation


@dataclass(frozen=True)
class StepStats:
    density: float
    unit_share: float  # changes of exactly +-1 in the integer view
    bytes_per_change: float  # level-1 delta object bytes / changed elements


def step_stats(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> StepStats:
    from pipeline.codec import encode_delta

    total = changed = units = 0
    for name, old in before.items():
        a = old.reshape(-1).view(torch.int16).to(torch.int32)
        b = after[name].reshape(-1).view(torch.int16).to(torch.int32)
        diff = (b - a)[a != b]
        total += a.numel()
        changed += diff.numel()
        units += int((diff.abs() == 1).sum())
    data = encode_delta([(n, before[n], after[n]) for n in before], 1)
    return StepStats(changed / total, units / max(1, changed), len(data) / max(1, changed))


def _real_steps(
    preset: str, lr: float, warmup: int, steps: int, seed: int
) -> Iterator[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
    from pipeline.testing.synthetic import ModelConfig, UpdateGenerator

    generator = UpdateGenerator(ModelConfig.preset(preset), lr=lr, seed=seed)
    for _ in range(warmup):
        generator.step()
    before = generator.state()
    for _ in range(steps):
        after = generator.step()
        yield before, after
        before = after


def calibrated_profile(
    preset: str = "small", lr: float = 1e-6, warmup: int = 2, steps: int = 3
) -> ChangeProfile:
    """A profile measured on real AdamW steps of a synthetic preset."""
    pairs = [(b[n], a[n]) for b, a in _real_steps(preset, lr, warmup, steps, seed=1) for n in b]
    return ChangeProfile.calibrate(pairs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibrate", default="small", help="preset the profile is measured on")
    parser.add_argument("--validate", default="medium", help="preset compared against")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    profile = calibrated_profile(args.calibrate, args.lr, steps=args.steps)
    print(f"profile from {args.calibrate} (lr {args.lr:g}, {args.steps} steps)")
    print(
        "| step | real density | emulated | real +-1 share | emulated | real B/change | emulated |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    emulator = UpdateEmulator(profile, seed=7)
    for i, (before, after) in enumerate(_real_steps(args.validate, args.lr, 2, args.steps, seed=0)):
        real = step_stats(before, after)
        emulated_state = {n: t.clone() for n, t in before.items()}
        emulator.step_(emulated_state)
        emu = step_stats(before, emulated_state)
        print(
            f"| {i + 1} | {100 * real.density:.2f}% | {100 * emu.density:.2f}% "
            f"| {100 * real.unit_share:.1f}% | {100 * emu.unit_share:.1f}% "
            f"| {real.bytes_per_change:.3f} | {emu.bytes_per_change:.3f} |"
        )
    probs = profile.change_prob
    live = [c for c in range(_CLASSES) if 0 < probs[c] < 1]
    print("change probability per exponent (2^(e-127)):")
    for c in live[:: max(1, len(live) // 12)]:
        print(f"  2^{c - 127:+d}: {probs[c]:.2e}")


if __name__ == "__main__":
    main()
