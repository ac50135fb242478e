"""DamagedError, hostile and mismatched inputs raise the right error, naming the culprit."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from safetensors import safe_open

from pipeline.codec import (
    CODEC_NAME,
    TensorPatch,
    api,
    apply_patch,
    contents,
    encode_delta,
    read_delta,
)
from pipeline.codec.api import _checksum
from pipeline.codec.container import read_container, write_container
from pipeline.errors import (
    CodecError,
    CorruptObjectError,
    DeltasyncError,
    MismatchError,
    TargetError,
)
from tests import codec_reference

pytestmark = pytest.mark.kernels  # rerun with bounds checks (scripts/test.sh)


def _pairs() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for name, shape, density in [
        ("layer.sparse", (64, 48), 0.02),
        ("layer.bitmap", (40, 40), 0.3),
        ("layer.dense", (300,), 1.0),
        ("layer.same", (16,), 0.0),
    ]:
        base = torch.randn(shape, generator=gen).to(torch.bfloat16)
        flip = torch.rand(shape, generator=gen) < density
        step = torch.where(torch.rand(shape, generator=gen) < 0.5, 1, -1).to(torch.int16)
        if density == 1.0:  # arbitrary new bits everywhere
            step = torch.randint(1, 2**15, shape, generator=gen).to(torch.int16)
        new = torch.where(flip, base.view(torch.int16) + step, base.view(torch.int16))
        out.append((name, base, new.view(torch.bfloat16)))
    return out


PAIRS = _pairs()
BASES = {name: base for name, base, _ in PAIRS}


@pytest.fixture(scope="module")
def good() -> bytes:
    return encode_delta(PAIRS, level=1)


def rebuild(data: bytes, edit_meta: object = None, edit_entries: object = None) -> bytes:
    """Re-pack an object after editing its metadata or entries, with a valid checksum."""
    container = read_container(data, "x")
    meta = dict(container.metadata)
    entries = {k: v.copy() for k, v in container.streams.items()}
    records = json.loads(meta["tensors"])
    if callable(edit_meta):
        edit_meta(meta, records)
    if callable(edit_entries):
        edit_entries(entries)
    meta["tensors"] = json.dumps(records)
    meta["checksum"] = _checksum(meta["level"], meta["tensors"], entries)
    return write_container(entries, meta)


def with_last_stream(data: bytes, role: str, frame: np.ndarray) -> bytes:  # type: ignore[type-arg]
    """``data`` (one tensor, ``w``) with its record's last stream, ``role``, replaced by
    ``frame`` and the record's size for it updated (a valid checksum)."""
    streams = json.loads(read_container(data, "x").metadata["tensors"])[0]["streams"]
    assert list(streams)[-1] == role, streams
    old_size = streams[role]

    def resize(meta: dict[str, str], records: list[dict[str, object]]) -> None:
        sizes = records[0]["streams"]
        assert isinstance(sizes, dict)
        sizes[role] = int(frame.size)

    def replace(entries: dict[str, np.ndarray]) -> None:  # type: ignore[type-arg]
        blob = entries["w"]
        entries["w"] = np.concatenate([blob[: blob.size - old_size], frame])

    return rebuild(data, resize, replace)


def decode_all(data: bytes) -> None:
    obj = read_delta(data, object_name="obj")
    for name, base in BASES.items():
        obj.decode(name, base)


def test_encodings_in_the_fixture_object(good: bytes) -> None:
    encodings = {t.name: t.encoding for t in read_delta(good).tensors}
    assert encodings["layer.same"] == "same"
    assert encodings["layer.dense"] == "dense"
    assert encodings["layer.sparse"] == "sparse"


def test_safe_open_can_inspect(good: bytes, tmp_path: Path) -> None:
    path = tmp_path / "delta.safetensors"
    path.write_bytes(good)
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        keys = set(f.keys())
    assert meta["codec"] == CODEC_NAME
    assert meta["codec_version"] == "1"
    assert keys == {"layer.sparse", "layer.bitmap", "layer.dense"}
    names = [r["name"] for r in json.loads(meta["tensors"])]
    assert names == list(BASES)
    loaded = safetensors.torch.load(good)
    sizes = {t.name: t.nbytes for t in read_delta(good).tensors}
    assert {k: v.numel() for k, v in loaded.items()} == {
        k: v for k, v in sizes.items() if k != "layer.same"
    }
    assert all(v.dtype == torch.uint8 for v in loaded.values())
    assert encode_delta(PAIRS, level=read_delta(good).level) == good  # deterministic


@pytest.mark.parametrize("cut", [0, 3, 8, 20, -200, -1])
def test_truncated_objects_are_rejected(good: bytes, cut: int) -> None:
    with pytest.raises(CorruptObjectError, match="delta object obj"):
        read_delta(good[:cut], object_name="obj")


def test_every_sampled_bit_flip_is_caught(good: bytes) -> None:
    rng = np.random.default_rng(0)
    nbits = len(good) * 8
    # Every bit of the 8-byte length and the first header bytes, then a sample.
    picks = np.unique(np.concatenate([np.arange(160), rng.integers(0, nbits, 600)]))
    for bit in picks.tolist():
        damaged = bytearray(good)
        damaged[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises((CorruptObjectError, CodecError)):
            decode_all(bytes(damaged))


def test_absurd_header_length() -> None:
    data = struct.pack("<Q", 1 << 60) + b"{}"
    with pytest.raises(CorruptObjectError, match="header length"):
        read_delta(data, object_name="obj")


def test_header_pointing_outside_the_data(good: bytes) -> None:
    (hlen,) = struct.unpack("<Q", good[:8])
    header = json.loads(good[8 : 8 + hlen])
    header["layer.sparse"]["data_offsets"][1] += 10**9
    header["layer.sparse"]["shape"] = [header["layer.sparse"]["data_offsets"][1]]
    raw = json.dumps(header).encode()
    with pytest.raises(CorruptObjectError, match="past the data section"):
        read_delta(struct.pack("<Q", len(raw)) + raw + good[8 + hlen :], object_name="obj")


def test_unknown_codec_version_and_name(good: bytes) -> None:
    newer = rebuild(good, lambda meta, _: meta.update(codec_version="7"))
    with pytest.raises(CodecError, match="version '7'"):
        read_delta(newer, object_name="obj")
    other = rebuild(good, lambda meta, _: meta.update(codec="zip-of-weights"))
    with pytest.raises(CodecError, match="zip-of-weights"):
        read_delta(other, object_name="obj")


def test_an_object_of_a_retired_level_is_refused_saying_what_to_do(good: bytes) -> None:
    """Level 2 objects (positions per exponent class) are no longer read: one line
    naming the object and the levels to republish with, not a decoding error."""
    retired = rebuild(good, lambda meta, _: meta.update(level="2"))
    with pytest.raises(CodecError) as info:
        read_delta(retired, object_name="obj")
    assert str(info.value) == (
        "delta object obj: level 2 is no longer supported; republish with level 1 or 3"
    )


def _set(field: str, value: object, name: str = "layer.sparse") -> object:
    def edit(meta: dict[str, str], records: list[dict[str, object]]) -> None:
        for rec in records:
            if rec["name"] == name:
                rec[field] = value

    return edit


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_set("changed", 10**6), "changed count"),
        (_set("shape", [2**30, 2**30]), "absurd"),
        (_set("shape", [-1]), "shape"),
        (_set("dtype", "float128"), "unknown dtype"),
        (_set("encoding", "magic"), "unknown encoding"),
        (_set("streams", {"unary": 1}), "streams"),
        (_set("params", {"contents": "planes"}), "streams"),
        (_set("changed", 0), "changed elements"),
    ],
)
def test_insane_records_are_rejected_naming_the_tensor(
    good: bytes, edit: object, message: str
) -> None:
    with pytest.raises(CorruptObjectError, match=rf"layer\.sparse.*{message}"):
        read_delta(rebuild(good, edit), object_name="obj")


def test_insane_rice_parameter(good: bytes) -> None:
    def edit(meta: dict[str, str], records: list[dict[str, object]]) -> None:
        params = records[0]["params"]
        assert isinstance(params, dict)
        if "rice" in params:
            params["rice"] = 99
        else:
            params["classes"][0][2] = 99

    with pytest.raises(CorruptObjectError, match=r"layer\.sparse"):
        read_delta(rebuild(good, edit), object_name="obj")


def test_stray_entry_is_rejected(good: bytes) -> None:
    def add(entries: dict[str, np.ndarray]) -> None:  # type: ignore[type-arg]
        entries["extra"] = np.zeros(3, np.uint8)

    with pytest.raises(CorruptObjectError, match="extra"):
        read_delta(rebuild(good, edit_entries=add), object_name="obj")


def test_damaged_stream_with_valid_checksum_fails_at_decode(good: bytes) -> None:
    def smash(entries: dict[str, np.ndarray]) -> None:  # type: ignore[type-arg]
        entries["layer.sparse"][:2] = 0xFF  # extra unary terminators

    obj = read_delta(rebuild(good, edit_entries=smash), object_name="obj")
    with pytest.raises(CorruptObjectError, match=r"obj: tensor 'layer\.sparse'"):
        obj.decode("layer.sparse", BASES["layer.sparse"])


def test_wrong_base_dtype_or_shape(good: bytes) -> None:
    obj = read_delta(good, object_name="obj")
    base = BASES["layer.sparse"]
    with pytest.raises(MismatchError, match=r"layer\.sparse"):
        obj.decode("layer.sparse", base.to(torch.float16))
    with pytest.raises(MismatchError, match=r"layer\.sparse"):
        obj.decode("layer.sparse", base.reshape(48, 64))
    with pytest.raises(MismatchError, match="nope"):
        obj.decode("nope", base)
    with pytest.raises(MismatchError, match="nope"):
        obj.info("nope")


def test_apply_patch_refuses_bad_targets(good: bytes) -> None:
    obj = read_delta(good)
    base = BASES["layer.sparse"]
    patch = obj.decode("layer.sparse", base)
    wide = torch.zeros(64, 96, dtype=torch.bfloat16)
    with pytest.raises(TargetError, match=r"layer\.sparse"):
        apply_patch(wide[:, :48], patch)
    with pytest.raises(MismatchError, match=r"layer\.sparse"):
        apply_patch(base.clone().float(), patch)


def test_encode_input_errors() -> None:
    a = torch.zeros(4, dtype=torch.bfloat16)
    with pytest.raises(MismatchError, match="w"):
        encode_delta([("w", a, torch.zeros(5, dtype=torch.bfloat16))])
    with pytest.raises(MismatchError, match="w"):
        encode_delta([("w", a, a.float())])
    with pytest.raises(CodecError, match="complex"):
        encode_delta([("w", a.to(torch.complex64), a.to(torch.complex64))])
    with pytest.raises(CodecError, match="level"):
        encode_delta([("w", a, a)], level=9)
    with pytest.raises(CodecError, match="level 2 is no longer supported"):
        encode_delta([("w", a, a)], level=2)
    with pytest.raises(CodecError, match="twice"):
        encode_delta([("w", a, a), ("w", a, a)])


def test_a_bad_pair_anywhere_stops_the_object_before_any_encoding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[str] = []
    a = torch.zeros(4, dtype=torch.bfloat16)
    pairs = [*PAIRS, ("late", a, torch.zeros(5, dtype=torch.bfloat16))]
    for threads in (1, 2):
        monkeypatch.setattr(api, "ENCODE_THREADS", threads)
        with pytest.raises(MismatchError, match="late"):
            encode_delta(pairs, on_changes=lambda name, *_: seen.append(name))
    assert seen == []


def test_all_codec_errors_are_deltasync_errors() -> None:
    for cls in (CodecError, CorruptObjectError, MismatchError, TargetError):
        assert issubclass(cls, DeltasyncError)


def test_magnitude_wrapping_to_zero_is_caught() -> None:
    base = torch.arange(4000, dtype=torch.int16).to(torch.bfloat16)
    index = torch.arange(4000)
    step = torch.where(index % 50 == 0, 3, torch.where(index % 10 == 0, 1, 0))
    new = (base.view(torch.int16) + step).to(torch.int16)
    data = encode_delta([("w", base, new.view(torch.bfloat16))])
    record = json.loads(read_container(data, "x").metadata["tensors"])[0]
    assert record["params"]["contents"] == "signmag"
    big = record["params"]["big"]
    wrapped = contents.encode_planes(np.full(big, 0xFFFE, np.uint16))  # + 2 wraps to 0
    damaged = with_last_stream(data, "mags", wrapped)
    obj = read_delta(damaged, object_name="obj")
    with pytest.raises(CorruptObjectError, match="zero difference"):
        obj.decode("w", base)
    record_read = obj._records["w"]  # the contents as other devices read them
    streams = record_read.split(obj._entries["w"])
    with pytest.raises(contents.ContentsError, match="zero difference"):
        contents.decode_contents(streams, record_read.params, record_read.changed, np.uint16)
    with pytest.raises(codec_reference.DamagedError, match="zero difference"):
        codec_reference.decode(obj, "w", base)


def test_apply_patch_refuses_malformed_patches() -> None:
    target = torch.zeros(10, dtype=torch.bfloat16)
    good_values = torch.ones(2, dtype=torch.int16)
    for positions in ([3, 10], [-1, 2]):
        patch = TensorPatch("w", torch.bfloat16, (10,), torch.tensor(positions), good_values)
        with pytest.raises(CodecError, match="out of range"):
            apply_patch(target, patch)
        assert not target.view(torch.int16).any()  # nothing written
    wrong_dtype = TensorPatch("w", torch.bfloat16, (10,), torch.tensor([1]), good_values[:1].int())
    with pytest.raises(CodecError, match="malformed"):
        apply_patch(target, wrong_dtype)
    too_many = TensorPatch("w", torch.bfloat16, (10,), torch.tensor([1]), good_values)
    with pytest.raises(CodecError, match="malformed"):
        apply_patch(target, too_many)
