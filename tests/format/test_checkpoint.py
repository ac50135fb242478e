"""Checkpoints: lazy reading, validation on open, atomic writing (files and shards)."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.errors import ConfigError, CorruptObjectError, MismatchError
from pipeline.format.checkpoints.checkpoint import (
    INDEX_NAME,
    CheckpointReader,
    parse_header,
    tensors_from_bytes,
    unmap_later,
)
from pipeline.format.checkpoints.checkpoint_write import safetensors_bytes, write_checkpoint
from pipeline.format.hashes.hashing import content_hash

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of the same width: compares NaN payloads and -0.0 exactly."""
    return t.contiguous().view(_BITS[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def special_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Every dtype, with raw random bit patterns (NaN payloads, -0.0, infinities) and
    awkward shapes (0-dim, empty)."""
    g = torch.Generator().manual_seed(seed)

    def raw(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        width = torch.empty(0, dtype=dtype).element_size()
        n = 1
        for d in shape:
            n *= d
        r = torch.randint(0, 256, (n * width,), dtype=torch.uint8, generator=g)
        return r.view(dtype).reshape(shape)

    out = {
        "bf16.weight": raw(torch.bfloat16, (33, 17)),
        "fp16.weight": raw(torch.float16, (5, 7)),
        "fp32.weight": raw(torch.float32, (64,)),
        "fp64.scalar": raw(torch.float64, ()),
        "fp8a.weight": raw(torch.float8_e4m3fn, (3, 9)),
        "fp8b.weight": raw(torch.float8_e5m2, (11,)),
        "i64.ids": torch.arange(-5, 5, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "empty.bias": torch.empty(0, 4, dtype=torch.bfloat16),
    }
    specials = torch.tensor([0x8000, 0x7F80, 0xFF80, 0x7FC1, 0x7F81, 0x0001], dtype=torch.int32)
    out["bf16.specials"] = specials.to(torch.int16).view(torch.bfloat16)
    return out


def test_file_round_trip_is_bit_exact_and_standard(tmp_path: Path) -> None:
    tensors = special_tensors()
    path = write_checkpoint(tmp_path / "m.safetensors", tensors.items(), metadata={"k": "v"})
    reader = CheckpointReader(path)
    assert reader.names() == list(tensors)  # file order is write order
    assert not reader.sharded
    assert reader.metadata["k"] == "v" and reader.metadata["format"] == "pt"
    assert reader.total_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    for name, t in tensors.items():
        assert reader.spec(name).dtype == t.dtype and reader.spec(name).shape == tuple(t.shape)
        assert same_bits(reader.get(name), t), name
    # Any safetensors reader loads what we write.
    loaded = safetensors.torch.load_file(str(path))
    assert all(same_bits(loaded[n], t) for n, t in tensors.items())
    CheckpointReader(path).close()  # every shard present and sized
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]  # no temp leftovers


def test_get_returns_an_owned_copy(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "m.safetensors", [("w", torch.zeros(8))])
    reader = CheckpointReader(path)
    first = reader.get("w")
    first.add_(1)  # patching in place must not leak into the file or later reads
    assert torch.equal(bits(reader.get("w")), bits(torch.zeros(8)))
    assert torch.equal(bits(CheckpointReader(path).get("w")), bits(torch.zeros(8)))


def test_mapped_reads_are_bit_exact_and_never_reach_the_file(tmp_path: Path) -> None:
    """read_mapped maps each tensor's own bytes (odd offsets, 0-dim and empty tensors
    included) without opening the file's safetensors handle; a write into the view,
    even one ``use`` keeps, stays in private pages."""
    tensors = special_tensors(2)
    path = write_checkpoint(tmp_path / "ckpt", tensors.items(), max_shard_bytes=1200)
    reader = CheckpointReader(path)
    for name, t in tensors.items():
        assert reader.read_mapped(name, lambda view, t=t: same_bits(view, t)), name
    maps = Path("/proc/self/maps")
    if maps.exists():  # each call unmapped its tensor: nothing of the shards stays mapped
        assert str(path) not in maps.read_text()
    kept = reader.read_mapped("bf16.weight", lambda view: bits(view).add_(1))
    assert not same_bits(kept.view(torch.bfloat16), tensors["bf16.weight"])
    assert same_bits(CheckpointReader(path).get("bf16.weight"), tensors["bf16.weight"])
    assert not reader._maps


def test_views_are_bit_exact_share_one_mapping_and_never_reach_the_file(tmp_path: Path) -> None:
    """view builds each tensor on one private mapping of its file (odd offsets, 0-dim
    and empty tensors included); a write into a view stays in private pages, and the
    mapping lives until its last view is gone, after ``close`` (which hands it to a
    thread that unmaps)."""
    tensors = special_tensors(2)
    path = write_checkpoint(tmp_path / "ckpt", tensors.items(), max_shard_bytes=1200)
    reader = CheckpointReader(path)
    views = {name: reader.view(name) for name in tensors}
    for name, t in tensors.items():
        assert views[name].dtype == t.dtype and views[name].shape == t.shape, name
        assert same_bits(views[name], t), name
    assert len(reader._maps) == len(reader.shards())  # one mapping a file
    reader.close()
    assert not reader._maps
    bits(views["bf16.weight"]).add_(1)  # still mapped after close, and private
    assert not same_bits(views["bf16.weight"], tensors["bf16.weight"])
    assert same_bits(CheckpointReader(path).view("bf16.weight"), tensors["bf16.weight"])
    del views
    unmap_later([]).result()  # one thread drops them in order: the reader's are gone
    maps = Path("/proc/self/maps")
    if maps.exists():  # the last view gone, nothing of the shards stays mapped
        assert str(path) not in maps.read_text()


@pytest.mark.parametrize("change", ["cut short", "replaced"])
def test_a_file_changed_after_open_is_refused_naming_it(tmp_path: Path, change: str) -> None:
    """Views map the very file whose header was read: one cut short or replaced (an
    atomic rename of another checkpoint, of the same size) after open is refused
    instead of read at the old header's offsets."""
    path = write_checkpoint(
        tmp_path / "m.safetensors", [("a", torch.ones(4)), ("b", torch.ones(8))]
    )
    reader = CheckpointReader(path)
    if change == "cut short":
        with path.open("r+b") as f:
            f.truncate(path.stat().st_size - 4)
        with pytest.raises(CorruptObjectError, match=r"m\.safetensors: tensor 'b'"):
            reader.read_mapped("b", torch.sum)
    else:
        other = write_checkpoint(
            tmp_path / "o.safetensors", [("a", torch.zeros(4)), ("b", torch.zeros(8))]
        )
        assert other.stat().st_size == path.stat().st_size
        other.replace(path)
    with pytest.raises(CorruptObjectError, match=r"m\.safetensors was replaced or resized"):
        reader.view("a")
    if change == "replaced":  # opened again, it reads what is there now
        assert torch.equal(CheckpointReader(path).view("a"), torch.zeros(4))
    else:
        with pytest.raises(CorruptObjectError, match="truncated"):
            CheckpointReader(path)


def test_sharded_round_trip(tmp_path: Path) -> None:
    tensors = special_tensors(1)
    path = write_checkpoint(tmp_path / "ckpt", tensors.items(), max_shard_bytes=1200)
    files = sorted(p.name for p in path.iterdir())
    assert INDEX_NAME in files
    shards = [f for f in files if f != INDEX_NAME]
    assert len(shards) >= 2
    assert all(f.endswith(f"-of-{len(shards):05d}.safetensors") for f in shards)
    index = json.loads((path / INDEX_NAME).read_text())
    assert set(index["weight_map"]) == set(tensors)
    reader = CheckpointReader(path)
    assert reader.sharded
    assert reader.names() == list(tensors)
    for name, t in tensors.items():
        assert same_bits(reader.get(name), t), name
    for fname, names in reader.shards():
        size = sum(reader.nbytes(n) for n in names)
        assert size <= 1200 or len(names) == 1, fname
    CheckpointReader(path).close()  # every shard present and sized


def test_reads_hf_style_sharded_folder(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    folder.mkdir()
    a = {"model.embed.weight": torch.randn(4, 3).bfloat16()}
    b = {"model.layers.0.w": torch.randn(2, 2).bfloat16(), "lm_head.weight": torch.randn(3)}
    safetensors.torch.save_file(a, str(folder / "model-00001-of-00002.safetensors"))
    safetensors.torch.save_file(b, str(folder / "model-00002-of-00002.safetensors"))
    weight_map = {n: "model-00001-of-00002.safetensors" for n in a}
    weight_map.update({n: "model-00002-of-00002.safetensors" for n in b})
    (folder / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text("{}")
    reader = CheckpointReader(folder)
    assert set(reader.names()) == set(weight_map)
    for name, t in {**a, **b}.items():
        assert same_bits(reader.get(name), t)


def test_folder_without_index(tmp_path: Path) -> None:
    folder = tmp_path / "plain"
    folder.mkdir()
    safetensors.torch.save_file({"w": torch.ones(3)}, str(folder / "model.safetensors"))
    reader = CheckpointReader(folder)
    assert reader.names() == ["w"] and not reader.sharded


def test_folder_still_being_written_is_incomplete(tmp_path: Path) -> None:
    """A trainer's save writes shards one by one and the index last."""
    folder = tmp_path / "saving"
    folder.mkdir()
    first = folder / "model-00001-of-00002.safetensors"
    safetensors.torch.save_file({"a": torch.ones(2)}, str(first))
    with pytest.raises(CorruptObjectError, match="lacks shard 2 of 2"):
        CheckpointReader(folder)
    safetensors.torch.save_file(
        {"b": torch.ones(3)}, str(folder / "model-00002-of-00002.safetensors")
    )
    assert CheckpointReader(folder).names() == ["a", "b"]


@pytest.mark.parametrize(
    "damage",
    ["truncated", "short", "header_length", "not_json", "offsets", "empty"],
)
def test_damaged_file_is_refused_naming_it(tmp_path: Path, damage: str) -> None:
    path = write_checkpoint(tmp_path / "m.safetensors", special_tensors().items())
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    if damage == "truncated":
        path.write_bytes(data[:-3])
    elif damage == "short":
        path.write_bytes(data[:5])
    elif damage == "header_length":
        path.write_bytes(struct.pack("<Q", 1 << 40) + data[8:])
    elif damage == "not_json":
        path.write_bytes(data[:8] + b"\xff" * n + data[8 + n :])
    elif damage == "offsets":
        header = json.loads(data[8 : 8 + n])
        header["bf16.weight"]["data_offsets"][1] += 2
        raw = json.dumps(header).encode()
        path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
    else:
        path.write_bytes(b"")
    with pytest.raises(CorruptObjectError, match=str(path.name)):
        CheckpointReader(path)


def test_index_naming_a_missing_shard(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "ckpt", special_tensors().items(), max_shard_bytes=1200)
    victim = sorted(p for p in path.iterdir() if p.name != INDEX_NAME)[-1]
    victim.unlink()
    with pytest.raises(CorruptObjectError, match=victim.name):
        CheckpointReader(path)


def test_missing_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CorruptObjectError, match="nope"):
        CheckpointReader(tmp_path / "nope")


def _failing(n: int) -> Iterator[tuple[str, torch.Tensor]]:
    for i in range(n):
        yield f"t{i}", torch.full((100,), float(i))
    raise RuntimeError("source died")


@pytest.mark.parametrize("shard", [None, 500])
def test_write_is_atomic(tmp_path: Path, shard: int | None) -> None:
    target = tmp_path / "out"
    with pytest.raises(RuntimeError, match="source died"):
        write_checkpoint(target, _failing(5), max_shard_bytes=shard)
    assert list(tmp_path.iterdir()) == []  # neither the output nor a temp sibling


def test_existing_output_is_refused_unless_overwrite(tmp_path: Path) -> None:
    target = write_checkpoint(tmp_path / "x", [("a", torch.zeros(2))], max_shard_bytes=10)
    with pytest.raises(ConfigError, match="already exists"):
        write_checkpoint(target, [("a", torch.ones(2))], max_shard_bytes=10)
    write_checkpoint(target, [("b", torch.ones(3))], max_shard_bytes=10, overwrite=True)
    assert CheckpointReader(target).names() == ["b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]


def test_duplicate_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(MismatchError, match="'a'"):
        write_checkpoint(tmp_path / "d.safetensors", [("a", torch.zeros(1)), ("a", torch.ones(1))])
    assert list(tmp_path.iterdir()) == []


def test_in_memory_buffer_round_trip() -> None:
    tensors = special_tensors(2)
    data = safetensors_bytes(tensors.items())
    back = dict(tensors_from_bytes(data, "buf"))
    assert list(back) == list(tensors)
    assert all(same_bits(back[n], t) for n, t in tensors.items())
    assert all(content_hash(back[n]) == content_hash(t) for n, t in tensors.items())
    back["bf16.weight"].add_(1)  # writable, owned
    assert safetensors.torch.load(data).keys() == tensors.keys()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300), st.integers(min_value=0, max_value=300))
def test_header_parser_never_crashes(garbage: bytes, claimed: int) -> None:
    """Arbitrary bytes either parse or raise CorruptObjectError, never anything else."""
    data = struct.pack("<Q", claimed) + garbage
    try:
        header = parse_header(data, len(data), "fuzz")
    except CorruptObjectError as e:
        assert "fuzz" in str(e)
    else:
        assert header.data_start == 8 + claimed


def test_one_dtype_table_agrees_with_torch_and_safetensors(tmp_path: Path) -> None:
    from pipeline.format.tensors import BY_NAME, BY_SAFETENSORS, DTYPE_TABLE

    assert len(BY_NAME) == len(BY_SAFETENSORS) == len(DTYPE_TABLE)
    for row in DTYPE_TABLE:
        assert row.width == row.dtype.itemsize == row.view.itemsize, row.name
        assert str(row.dtype) == f"torch.{row.name}"
        assert not row.view.is_floating_point
        assert (row.exponent is None) == (not row.dtype.is_floating_point), row.name
    # Our header codes are the ones safetensors itself writes and reads.
    tensors = {row.name: torch.zeros(3, dtype=row.dtype) for row in DTYPE_TABLE}
    path = tmp_path / "all.safetensors"
    safetensors.torch.save_file(tensors, path)
    header = json.loads(path.read_bytes()[8 : 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]])
    for row in DTYPE_TABLE:
        assert header[row.name]["dtype"] == row.safetensors, row.name
    with CheckpointReader(path) as reader:
        assert {n: reader.get(n).dtype for n in reader.names()} == {
            r.name: r.dtype for r in DTYPE_TABLE
        }


def _declared_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "a": torch.randn(7, 3, generator=g).to(torch.bfloat16),
        "b": torch.arange(5, dtype=torch.int64),
        "c": torch.randn(0, 4, generator=g),
        "d": torch.randn(2, 2, generator=g).to(torch.float16),
    }


def test_tensors_declared_up_front_give_the_same_bytes(tmp_path: Path) -> None:
    state = _declared_state()
    specs = [(n, t.dtype, tuple(t.shape)) for n, t in state.items()]
    plain = write_checkpoint(tmp_path / "plain.safetensors", iter(state.items()))
    declared = write_checkpoint(tmp_path / "declared.safetensors", iter(state.items()), specs=specs)
    assert declared.read_bytes() == plain.read_bytes()
    loaded = safetensors.torch.load_file(declared)
    assert all(torch.equal(loaded[n], t) for n, t in state.items())


@pytest.mark.parametrize(
    ("change", "fault"),
    [
        (lambda s: s[:-1], "declared and not given"),
        (lambda s: [*s, ("e", torch.zeros(1))], "given and not declared"),
        (lambda s: [(n, t.float()) if n == "a" else (n, t) for n, t in s], "declared as"),
        (lambda s: [(n, t.reshape(-1)) if n == "a" else (n, t) for n, t in s], "declared as"),
        (lambda s: [("z", t) if n == "a" else (n, t) for n, t in s], "declared as"),
    ],
)
def test_tensors_not_as_declared_leave_no_file(tmp_path: Path, change: object, fault: str) -> None:
    state = _declared_state()
    specs = [(n, t.dtype, tuple(t.shape)) for n, t in state.items()]
    given = change(list(state.items()))  # type: ignore[operator]
    with pytest.raises(MismatchError, match=fault):
        write_checkpoint(tmp_path / "x.safetensors", iter(given), specs=specs)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ConfigError, match="one file"):
        write_checkpoint(tmp_path / "y", iter(state.items()), specs=specs, max_shard_bytes=64)
