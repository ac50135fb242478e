"""Applies that keep no decoded patches: proven tensors are written by walking their
deltas into the weights and walked back on failure (pipeline/targets/walking.py)."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

import pytest
import torch

from pipeline.codec import DeltaObject, HashedPatch, encode_delta, read_delta
from pipeline.errors import MismatchError, TargetError
from pipeline.format.hashes.hashing import content_hash
from pipeline.targets.base import ProvenDigest
from pipeline.targets.patching import int_view, split_for_two_writers
from pipeline.targets.proving import prove_entries
from pipeline.targets.torch import TorchTarget
from pipeline.targets.walking import Walk, written_patch
from tests.targets.test_torch_target import (
    assert_bitwise_equal,
    bits,
    make_delta,
    next_state,
    nudge,
    state,
)

pytestmark = pytest.mark.kernels  # rerun with bounds checks (scripts/test.sh)


def mixed_state() -> dict[str, torch.Tensor]:
    """``state`` plus a tensor that every step changes entirely (not a sparse walk)."""
    return dict(state("cpu"), **{"f.dense": torch.linspace(-2, 2, 512).to(torch.bfloat16)})


def mixed_next(held: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    new = next_state({n: t for n, t in held.items() if n != "f.dense"}, seed)
    dense = held["f.dense"].clone()
    bits(dense).add_(1)
    return dict(new, **{"f.dense": dense})


def chain(held: dict[str, torch.Tensor], steps: int) -> list[dict[str, torch.Tensor]]:
    versions = [{k: v.clone() for k, v in held.items()}]
    for step in range(steps):
        versions.append(mixed_next(versions[-1], seed=10 * step + 1))
    return versions


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.float8_e4m3fn]
)
def test_undo_apply_walks_a_delta_back_bit_for_bit(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    base = (torch.randn(4096, generator=g) * 8).to(dtype)
    new = base.clone()
    flat = new.view(-1).view(torch.uint8 if dtype.itemsize == 1 else base.view(-1).dtype)
    if dtype.itemsize > 1:
        flat = bits(new)
    positions = torch.randperm(4096, generator=g)[:60]
    flat[positions] += 1  # sparse: 1.5% changed, a walkable encoding
    obj = read_delta(encode_delta([("t", base, new)]), object_name="o")
    held = base.clone()
    obj.apply_to("t", held)
    assert torch.equal(bits(held), bits(new))
    obj.undo_apply("t", held)
    assert torch.equal(bits(held), bits(base))


def test_undo_apply_refuses_an_encoding_it_cannot_walk() -> None:
    base = torch.zeros(1024, dtype=torch.bfloat16)
    new = torch.ones(1024, dtype=torch.bfloat16)  # every element: not a sparse walk
    obj = read_delta(encode_delta([("t", base, new)]), object_name="o")
    with pytest.raises(TargetError, match="cannot be walked back"):
        obj.undo_apply("t", new.clone())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_the_patch_a_walk_wrote_is_read_back_from_the_written_tensor(dtype: torch.dtype) -> None:
    """``written_patch``: what a walk wrote (positions from the delta, contents from
    the tensor), for a whole tensor and for a tensor written as two pieces in either
    order; the same positions and bits as the patch the delta decodes."""
    g = torch.Generator().manual_seed(5)
    base = (torch.randn(64, 64, generator=g) * 4).to(dtype)
    new = base.clone()
    positions = torch.randperm(base.numel(), generator=g)[:80]
    int_view(new).view(-1)[positions] += 1
    delta = read_delta(encode_delta([("t", base, new)]), object_name="o")
    want = delta.decode("t", base)
    held = base.clone()
    walk = Walk("t", delta, 80)
    assert delta.walks("t", held)
    delta.apply_to("t", held)
    got = written_patch("t", [walk], held)
    assert torch.equal(got.positions, want.positions)
    assert torch.equal(got.values, want.values)
    assert torch.equal(bits(held), bits(new))

    # The same change in two flat pieces, each its own record.
    cut = 1500
    flat_base, flat_new = base.view(-1), new.view(-1)
    pieces = read_delta(
        encode_delta(
            [("lo", flat_base[:cut], flat_new[:cut]), ("hi", flat_base[cut:], flat_new[cut:])]
        ),
        object_name="p",
    )
    changed = {n: pieces.info(n).changed for n in ("lo", "hi")}
    assert all(changed.values())
    walks = [
        Walk("hi", pieces, changed["hi"], (cut, base.numel())),
        Walk("lo", pieces, changed["lo"], (0, cut)),
    ]
    got = written_patch("t", walks, new)
    assert torch.equal(got.positions, want.positions)
    assert torch.equal(got.values, want.values)


def test_walked_chain_is_bit_exact_and_keeps_no_patches() -> None:
    held = mixed_state()
    ids = {n: t.data_ptr() for n, t in held.items()}
    walked = TorchTarget(held, patch_memory_bytes=0)
    versions = chain(held, 3)
    twin = {k: v.clone() for k, v in versions[0].items()}
    patched = TorchTarget(twin)  # the default: patches kept
    for v, verify in zip(range(1, len(versions)), ["touched", "all", "touched"], strict=True):
        manifest, objects = make_delta(versions[v - 1], versions[v], version=v, parent=v - 1)
        proven = prove_entries(
            manifest.tensors, objects, walked.tensor, walked.specs(), keep_patches=False
        )
        changed = {e.name for e in manifest.tensors if e.changed}
        walks = {w.name for w in proven.walks}
        kept = {p.name for p in proven.patches}
        assert walks and kept  # sparse tensors walked, the dense one patched
        assert walks | kept == changed and not walks & kept
        assert not walks & set(proven.old_values)
        report = walked.apply_delta(manifest, objects, verify)  # type: ignore[arg-type]
        reference = patched.apply_delta(manifest, objects, verify)  # type: ignore[arg-type]
        assert (report.tensors, report.changed) == (reference.tensors, reference.changed)
        assert (report.walked, reference.walked) == (len(walks), 0)
        assert report.changed == sum(e.changed for e in manifest.tensors)
        assert_bitwise_equal(held, versions[v])
        assert walked.hashes() == {n: content_hash(t) for n, t in versions[v].items()}
    assert {n: t.data_ptr() for n, t in held.items()} == ids


def failing_on_tensor(number: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Walked writes failing at the ``number``-th tensor from now on: one at a time
    (``DeltaObject.apply_to`` raises) or in a batch (``DeltaObject.apply_many`` writes
    the tensors before it and reports the error)."""
    real_one, real_many = DeltaObject.apply_to, DeltaObject.apply_many
    calls = itertools.count(1)  # two writer threads may call at once

    def apply_to(self: DeltaObject, name: str, tensor: torch.Tensor, **kw: Any) -> Any:
        if next(calls) == number:
            raise RuntimeError("device lost during the write")
        return real_one(self, name, tensor, **kw)

    def apply_many(self: DeltaObject, items: Any, **kw: Any) -> Any:
        for k, _ in enumerate(items):
            if next(calls) == number:
                written, error = real_many(self, items[:k], **kw) if k else ([], None)
                assert error is None
                return written, RuntimeError("device lost during the write")
        return real_many(self, items, **kw)

    monkeypatch.setattr(DeltaObject, "apply_to", apply_to)
    monkeypatch.setattr(DeltaObject, "apply_many", apply_many)


@pytest.mark.parametrize("fail_on", [1, 2, 3])
def test_a_write_failing_midway_leaves_every_tensor_as_it_was(
    fail_on: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = mixed_state()
    target = TorchTarget(held, patch_memory_bytes=0)
    new = mixed_next(held, seed=4)
    manifest, objects = make_delta(held, new)
    proven = prove_entries(
        manifest.tensors, objects, target.tensor, target.specs(), keep_patches=False
    )
    assert len(proven.walks) >= 3 and proven.patches  # walked and patched tensors both
    before = {n: t.clone() for n, t in held.items()}
    hashes = target.hashes()
    failing_on_tensor(fail_on, monkeypatch)
    with pytest.raises(RuntimeError, match="device lost"):
        target.apply_delta(manifest, objects, "touched")
    assert_bitwise_equal(held, before)  # patched tensors and walked ones restored
    assert target.hashes() == hashes
    monkeypatch.undo()
    target.apply_delta(manifest, objects, "touched")
    assert_bitwise_equal(held, new)


@pytest.mark.parametrize("budget", [0, 1 << 30])
def test_early_proofs_keep_patches_only_within_the_budget(budget: int) -> None:
    held = mixed_state()
    target = TorchTarget(held, patch_memory_bytes=budget)
    new = mixed_next(held, seed=6)
    manifest, objects = make_delta(held, new)
    (entry,) = manifest.objects
    proof = target.prove_object(entry.key, objects[entry.key], entry.sha256)
    kinds = {type(result) for result in proof.hashed.values()}
    assert kinds == ({ProvenDigest} if budget == 0 else {HashedPatch})
    report = target.apply_delta(manifest, objects, "touched", early=[proof])
    assert report.changed == sum(e.changed for e in manifest.tensors)
    assert_bitwise_equal(held, new)


def test_a_lean_early_proof_with_a_wrong_hash_is_refused_before_any_write() -> None:
    held = mixed_state()
    target = TorchTarget(held, patch_memory_bytes=0)
    new = mixed_next(held, seed=8)
    manifest, objects = make_delta(held, new)
    (entry,) = manifest.objects
    proof = target.prove_object(entry.key, objects[entry.key], entry.sha256)
    name, result = next(iter(proof.hashed.items()))
    assert isinstance(result, ProvenDigest)
    forged = replace(proof, hashed={**proof.hashed, name: replace(result, digest="0" * 32)})
    before = {n: t.clone() for n, t in held.items()}
    with pytest.raises(MismatchError, match=name.replace(".", r"\.")):
        target.apply_delta(manifest, objects, "touched", early=[forged])
    assert_bitwise_equal(held, before)
    target.apply_delta(manifest, objects, "touched", early=[proof])
    assert_bitwise_equal(held, new)


def large_state() -> dict[str, torch.Tensor]:
    """Enough changes per version for the write to run on two threads."""
    g = torch.Generator().manual_seed(11)
    return {f"w{i}": torch.randn(512, 1024, generator=g).to(torch.bfloat16) for i in range(8)}


@pytest.mark.parametrize("fail_on", [1, 4, 8])
def test_a_two_thread_walked_write_failing_anywhere_is_walked_back(
    fail_on: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = large_state()
    target = TorchTarget(held, patch_memory_bytes=0)
    new = {n: nudge(t, 0.02, seed=i) for i, (n, t) in enumerate(held.items())}
    manifest, objects = make_delta(held, new)
    mine, other = split_for_two_writers(
        [e for e in manifest.tensors if e.changed], lambda e: e.changed, on_cpu=True
    )
    assert mine and other, "the write should run on two threads"
    before = {n: t.clone() for n, t in held.items()}
    failing_on_tensor(fail_on, monkeypatch)
    with pytest.raises(RuntimeError, match="device lost"):
        target.apply_delta(manifest, objects, "touched")
    assert_bitwise_equal(held, before)
    monkeypatch.undo()
    target.apply_delta(manifest, objects, "all")
    assert_bitwise_equal(held, new)
