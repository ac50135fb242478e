"""Offline deltas: create, apply and inspect between files and sharded folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.errors import ConfigError, CorruptObjectError, MismatchError
from pipeline.format.checkpoints.checkpoint import INDEX_NAME, CheckpointReader
from pipeline.format.checkpoints.checkpoint_write import write_checkpoint
from pipeline.format.manifest import MANIFEST_NAME
from pipeline.format.manifest_parse import parse_manifest
from pipeline.publish.offline import apply_delta, create_delta, inspect_delta
from pipeline.testing.synthetic import UpdateGenerator
from tests.format.test_checkpoint import bits, same_bits, special_tensors
from tests.publish.test_chain import SMALL


def _training_pair(tmp: Path, *, sharded: bool) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """Two consecutive bf16 states of a model under AdamW, plus odd dtypes that change
    bit patterns freely (NaN payloads, -0.0, infinities)."""
    gen = UpdateGenerator(SMALL, lr=1e-5, seed=1)
    base = dict(gen.state())
    new = dict(gen.step())
    odd_base, odd_new = special_tensors(3), special_tensors(4)
    base.update(odd_base)
    new.update(odd_new)
    shard = 120_000 if sharded else None
    suffix = "" if sharded else ".safetensors"
    a = write_checkpoint(tmp / f"a{suffix}", base.items(), max_shard_bytes=shard)
    b = write_checkpoint(tmp / f"b{suffix}", new.items(), max_shard_bytes=shard)
    return a, b, new


@pytest.mark.parametrize("sharded", [False, True])
def test_round_trip(tmp_path: Path, sharded: bool) -> None:
    a, b, new = _training_pair(tmp_path, sharded=sharded)
    if sharded:
        (a / "config.json").write_text('{"model_type": "llama"}')
    summary = create_delta(a, b, tmp_path / "d", level=3, part_bytes=50_000)
    assert 0 < summary.changed < summary.total
    assert summary.bytes < sum(t.numel() * t.element_size() for t in new.values())
    manifest = parse_manifest((tmp_path / "d" / MANIFEST_NAME).read_bytes())
    assert (manifest.kind, manifest.run, manifest.parent) == ("delta", "offline", 0)
    assert manifest.parent_state_hash is not None
    assert len(manifest.objects) > 1
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == sorted(
        [MANIFEST_NAME, *(o.key for o in manifest.objects)]
    )

    out = tmp_path / ("c" if sharded else "c.safetensors")
    apply_delta(a, tmp_path / "d", out)
    with CheckpointReader(out) as result, CheckpointReader(a) as base:
        assert result.names() == base.names()
        if sharded:
            assert result.shards() == base.shards()  # file for file
        else:
            assert [n for _, n in result.shards()] == [n for _, n in base.shards()]
        for name, tensor in new.items():
            assert same_bits(result.get(name), tensor), name
    if sharded:
        assert (out / INDEX_NAME).exists()
        assert (out / "config.json").read_text() == '{"model_type": "llama"}'
    else:
        assert out.is_file()


def test_inspect_counts_match_an_independent_diff(tmp_path: Path) -> None:
    a, b, _ = _training_pair(tmp_path, sharded=False)
    create_delta(a, b, tmp_path / "d")
    report = inspect_delta(tmp_path / "d")
    with CheckpointReader(a) as base, CheckpointReader(b) as new:
        expected = {n: int((bits(base.get(n)) != bits(new.get(n))).sum()) for n in base.names()}
        assert [r.name for r in report.rows] == base.names()
    assert {r.name: r.changed for r in report.rows} == expected
    assert report.changed == sum(expected.values())
    assert report.total == sum(_numel(r.shape) for r in report.rows)
    assert report.bytes == sum(p.stat().st_size for p in (tmp_path / "d").glob("part-*"))
    assert all(r.encoding for r in report.rows)
    doc = report.to_dict()
    assert json.loads(json.dumps(doc))["changed"] == report.changed
    assert len(doc["tensors"]) == len(report.rows)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_wrong_base_is_refused_and_leaves_no_output(tmp_path: Path) -> None:
    a, b, _ = _training_pair(tmp_path, sharded=False)
    create_delta(a, b, tmp_path / "d")
    with CheckpointReader(a) as reader:
        state = dict(reader.tensors())
    victim = "model.layers.1.self_attn.o_proj.weight"
    state[victim].view(-1).view(torch.int16)[0] ^= 1
    wrong = write_checkpoint(tmp_path / "wrong.safetensors", state.items())
    out = tmp_path / "c.safetensors"
    with pytest.raises(MismatchError, match=victim):
        apply_delta(wrong, tmp_path / "d", out)
    assert not out.exists() and _leftovers(tmp_path) == []
    # Applying the delta to its own result is just as wrong.
    with pytest.raises(MismatchError):
        apply_delta(b, tmp_path / "d", out)
    assert not out.exists()


@pytest.mark.parametrize("change", ["shape", "missing", "dtype"])
def test_base_of_another_model_is_refused(tmp_path: Path, change: str) -> None:
    a, b, _ = _training_pair(tmp_path, sharded=False)
    create_delta(a, b, tmp_path / "d")
    with CheckpointReader(a) as reader:
        state = dict(reader.tensors())
    victim = "model.norm.weight"
    if change == "shape":
        state[victim] = state[victim][:-1]
    elif change == "dtype":
        state[victim] = state[victim].float()
    else:
        del state[victim]
    other = write_checkpoint(tmp_path / "other.safetensors", state.items())
    with pytest.raises(MismatchError, match=victim):
        apply_delta(other, tmp_path / "d", tmp_path / "c.safetensors")
    assert not (tmp_path / "c.safetensors").exists()


def test_damaged_delta_is_refused(tmp_path: Path) -> None:
    a, b, _ = _training_pair(tmp_path, sharded=True)
    create_delta(a, b, tmp_path / "d", part_bytes=50_000)
    part = sorted((tmp_path / "d").glob("part-*"))[1]
    data = part.read_bytes()
    part.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(CorruptObjectError, match=part.name):
        apply_delta(a, tmp_path / "d", tmp_path / "c")
    assert not (tmp_path / "c").exists() and _leftovers(tmp_path) == []
    with pytest.raises(CorruptObjectError, match=part.name):
        inspect_delta(tmp_path / "d")
    part.unlink()
    with pytest.raises(CorruptObjectError, match=part.name):
        apply_delta(a, tmp_path / "d", tmp_path / "c")
    (tmp_path / "d" / MANIFEST_NAME).write_text("{}")
    with pytest.raises(CorruptObjectError, match=MANIFEST_NAME):
        inspect_delta(tmp_path / "d")


def test_create_checks_inputs(tmp_path: Path) -> None:
    a, b, _ = _training_pair(tmp_path, sharded=False)
    (tmp_path / "d").mkdir()
    with pytest.raises(ConfigError, match="already exists"):
        create_delta(a, b, tmp_path / "d")
    small = write_checkpoint(tmp_path / "small.safetensors", [("x", torch.zeros(2))])
    with pytest.raises(MismatchError):
        create_delta(a, small, tmp_path / "e")
    assert not (tmp_path / "e").exists() and _leftovers(tmp_path) == []
