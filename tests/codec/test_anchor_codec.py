"""Anchor objects: the zstd byte-plane form round-trips bit for bit, plain anchors stay
readable, hostile objects are refused, and runs with compressed anchors rebuild and
bootstrap exactly."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.torch
import torch
import zstandard

from pipeline.codec.anchor import (
    FORMAT,
    FORMAT_KEY,
    TENSORS_KEY,
    anchor_tensors,
    encode_anchor,
)
from pipeline.codec.dtypes import BY_DTYPE
from pipeline.config import Settings
from pipeline.errors import ConfigError, CorruptObjectError
from pipeline.format.checkpoints.checkpoint import parse_header
from pipeline.format.checkpoints.checkpoint_write import safetensors_bytes
from pipeline.format.manifest import Manifest
from pipeline.format.tensors import DTYPES
from pipeline.publish.caches.state_cache import StateCache
from pipeline.publish.compaction import compact
from pipeline.publish.version import PublishOptions, publish_anchor
from pipeline.rollout.node import NodeOptions, RolloutNode
from pipeline.store.file import FileStore
from pipeline.targets.torch import TorchTarget
from pipeline.testing.synthetic import ModelConfig, UpdateGenerator
from pipeline.versions import chain
from tests.codec.test_codec_roundtrip import special_values
from tests.format.test_checkpoint import same_bits, special_tensors
from tests.publish.test_chain import SyntheticRun

SHAPES = [(), (0,), (3, 0, 2), (1,), (33, 17), (20000,)]


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Arbitrary bit patterns, and for floats the special ones (+-0.0, +-inf, NaNs with
    payloads, subnormals) on about half the elements."""
    gen = np.random.default_rng(seed)
    if dtype in BY_DTYPE:
        return special_values(shape, dtype, gen)
    # Formats the delta codec has no table entry for (float8_e8m0fnu): raw bytes.
    raw = gen.integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).reshape(shape)


def roundtrip(tensors: dict[str, torch.Tensor]) -> bytes:
    data = encode_anchor(tensors.items(), "zstd", metadata={"deltasync.run": "r"})
    assert encode_anchor(tensors.items(), "zstd", metadata={"deltasync.run": "r"}) == data
    back = list(anchor_tensors(data, "obj"))
    assert [n for n, _ in back] == list(tensors)
    for name, got in back:
        assert same_bits(got, tensors[name]), name
        got.view(-1)[:1] = got.view(-1)[:1]  # owned and writable
    return data


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_every_dtype_round_trips_bit_exactly(dtype: torch.dtype) -> None:
    tensors = {
        f"t{i}.{'x'.join(map(str, shape))}": sample(dtype, shape, i)
        for i, shape in enumerate(SHAPES)
    }
    data = roundtrip(tensors)
    # Still a well-formed safetensors file: one uint8 entry per tensor.
    loaded = safetensors.torch.load(data)
    assert sorted(loaded) == sorted(tensors)
    assert all(t.dtype == torch.uint8 and t.dim() == 1 for t in loaded.values())


def test_special_tensors_and_a_non_contiguous_one() -> None:
    tensors = special_tensors()
    tensors["transposed"] = sample(torch.bfloat16, (40, 30), 7).t()
    roundtrip(tensors)


def test_planes_of_trained_bf16_weights() -> None:
    """The exponent plane compresses, the sign and mantissa plane stays raw."""
    weight = (torch.randn(64, 512, generator=torch.Generator().manual_seed(0)) * 0.02).to(
        torch.bfloat16
    )
    data = roundtrip({"w": weight})
    meta = parse_header(data, len(data), "obj").metadata
    assert meta[FORMAT_KEY] == FORMAT
    (record,) = json.loads(meta[TENSORS_KEY])
    assert record["dtype"] == "bfloat16" and record["shape"] == [64, 512]
    (low_method, low_size), (top_method, top_size) = record["planes"]
    assert (low_method, low_size) == ("raw", weight.numel())
    assert top_method == "zstd" and top_size < 0.5 * weight.numel()


def test_plain_anchors_are_read_as_before() -> None:
    tensors = special_tensors()
    plain = safetensors_bytes(tensors.items(), metadata={"deltasync.run": "r"})
    assert encode_anchor(tensors.items(), "none", metadata={"deltasync.run": "r"}) == plain
    back = dict(anchor_tensors(plain, "obj"))
    assert list(back) == list(tensors)
    assert all(same_bits(back[n], t) for n, t in tensors.items())


def test_unknown_compression_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="lz4"):
        encode_anchor([], "lz4")
    store = FileStore(tmp_path / "store")
    with pytest.raises(ConfigError, match="lz4"):
        publish_anchor(
            store,
            "r",
            0,
            special_tensors().items(),
            PublishOptions(anchor_compression="lz4"),
            parent=None,
            reason="t",
        )
    assert list(store.list("r/")) == []


def test_setting() -> None:
    assert Settings.from_env({}).anchor_compression == "none"
    env = {"DELTASYNC_ANCHOR_COMPRESSION": " ZSTD "}
    assert Settings.from_env(env).anchor_compression == "zstd"
    with pytest.raises(ConfigError, match="DELTASYNC_ANCHOR_COMPRESSION"):
        Settings.from_env({"DELTASYNC_ANCHOR_COMPRESSION": "gzip"})


# ---------------------------------------------------------------- hostile objects


def good_object() -> bytes:
    gen = torch.Generator().manual_seed(1)
    return encode_anchor(
        [
            ("w", (torch.randn(128, 64, generator=gen) * 0.02).to(torch.bfloat16)),
            ("ids", torch.arange(300, dtype=torch.int32)),
            ("zeros", torch.zeros(4096, dtype=torch.uint8)),
        ],
        "zstd",
    )


def split(data: bytes) -> tuple[dict[str, Any], bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def join(header: dict[str, Any], body: bytes) -> bytes:
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + body


def rebuild(
    data: bytes,
    edit: Callable[[dict[str, str], list[dict[str, Any]], dict[str, bytes]], None],
) -> bytes:
    """Re-assemble an object after ``edit`` changed its metadata, records or stored
    bytes (entries' offsets are recomputed, so only what was edited is wrong)."""
    header, body = split(data)
    meta = header.pop("__metadata__")
    original = meta[TENSORS_KEY]
    records = json.loads(original)
    stored = {name: body[e["data_offsets"][0] : e["data_offsets"][1]] for name, e in header.items()}
    edit(meta, records, stored)
    if meta.get(TENSORS_KEY) == original:  # else the edit replaced the list itself
        meta[TENSORS_KEY] = json.dumps(records)
    out: dict[str, Any] = {"__metadata__": meta}
    offset = 0
    for name, chunk in stored.items():
        out[name] = {
            "dtype": "U8",
            "shape": [len(chunk)],
            "data_offsets": [offset, offset + len(chunk)],
        }
        offset += len(chunk)
    return join(out, b"".join(stored.values()))


def w_record(records: list[dict[str, Any]]) -> dict[str, Any]:
    return next(r for r in records if r["name"] == "w")


def replace_top_plane(frame: bytes) -> Callable[..., None]:
    """Put ``frame`` in place of the bf16 tensor's (zstd) exponent plane."""

    def edit(meta: dict[str, str], records: list[dict[str, Any]], stored: dict[str, bytes]) -> None:
        record = w_record(records)
        (_, low), (method, _) = record["planes"]
        assert method == "zstd"
        stored["w"] = stored["w"][:low] + frame
        record["planes"][1] = ["zstd", len(frame)]

    return edit


N_W = 128 * 64
HOSTILE: dict[str, Callable[..., None]] = {
    "unknown format version": lambda m, r, s: m.update({FORMAT_KEY: "planes-zstd/2"}),
    "no tensor list": lambda m, r, s: m.pop(TENSORS_KEY),
    "tensor list not JSON": lambda m, r, s: m.update({TENSORS_KEY: "[{"}),
    "tensor list not a list": lambda m, r, s: m.update({TENSORS_KEY: '{"w": 1}'}),
    "record not an object": lambda m, r, s: r.append("w"),
    "repeated record": lambda m, r, s: r.append(dict(w_record(r))),
    "empty tensor list": lambda m, r, s: r.clear(),
    "record without a tensor": lambda m, r, s: s.pop("ids"),
    "unknown plane method": lambda m, r, s: w_record(r)["planes"][1].__setitem__(0, "lz4"),
    "unknown dtype": lambda m, r, s: w_record(r).update(dtype="float128"),
    "extra record field": lambda m, r, s: w_record(r).update(level=9),
    "too few planes": lambda m, r, s: w_record(r)["planes"].pop(),
    "negative dimension": lambda m, r, s: w_record(r).update(shape=[-128, -64]),
    "absurd shape": lambda m, r, s: w_record(r).update(shape=[1 << 40, 1 << 40]),
    "shape larger than its planes": lambda m, r, s: w_record(r).update(shape=[1 << 30, 64]),
    "shape of other size": lambda m, r, s: w_record(r).update(shape=[64, 64]),
    "plane lengths do not add up": lambda m, r, s: w_record(r)["planes"][0].__setitem__(1, N_W - 1),
    "stored bytes cut short": lambda m, r, s: s.update(w=s["w"][:-3]),
    "zstd frame of another size": replace_top_plane(zstandard.compress(b"\x7f" * (N_W + 1))),
    "zstd frame without its size": replace_top_plane(
        zstandard.ZstdCompressor(write_content_size=False).compress(b"\x7f" * N_W)
    ),
    "zstd frame with trailing bytes": replace_top_plane(zstandard.compress(b"\x7f" * N_W) + b"x"),
    "zstd frame cut short": replace_top_plane(zstandard.compress(bytes(range(256)) * 32)[:-4]),
    "not a zstd frame": replace_top_plane(b"\x00" * 64),
    # A few bytes of zstd can stand for many zeros, but not for a terabyte.
    "zstd plane claims too much": lambda m, r, s: next(x for x in r if x["name"] == "zeros").update(
        shape=[1 << 40]
    ),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_objects_are_refused(case: str) -> None:
    data = rebuild(good_object(), HOSTILE[case])
    with pytest.raises(CorruptObjectError) as info:
        list(anchor_tensors(data, "run/anchors/0000000004/part-00000.safetensors"))
    message = str(info.value)
    assert "\n" not in message and "part-00000.safetensors" in message


def test_the_rebuild_helper_changes_nothing_by_itself() -> None:
    data = rebuild(good_object(), lambda m, r, s: None)
    assert [n for n, _ in anchor_tensors(data, "obj")] == ["w", "ids", "zeros"]


@pytest.mark.parametrize("cut", [1, 8, 100, -1])
def test_truncated_and_garbage_objects_are_refused(cut: int) -> None:
    data = good_object()
    with pytest.raises(CorruptObjectError, match="obj"):
        list(anchor_tensors(data[:cut], "obj"))
    with pytest.raises(CorruptObjectError, match="obj"):
        list(anchor_tensors(bytes(len(data)), "obj"))


def test_hostile_errors_name_the_tensor() -> None:
    data = rebuild(good_object(), HOSTILE["zstd frame of another size"])
    with pytest.raises(CorruptObjectError, match="tensor 'w'"):
        list(anchor_tensors(data, "obj"))


# ---------------------------------------------------------------- runs


def anchor_object(store: FileStore, manifest: Manifest) -> bytes:
    return store.get(manifest.object_key(manifest.objects[0].key))


def test_chain_with_compressed_anchors_rebuilds_bit_exactly(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    run = SyntheticRun(tmp_path, store)
    assert run.publish(0, PublishOptions(anchor_compression="zstd")).status == "published"
    for step in (1, 2):
        run.publish(step, PublishOptions(anchor_compression="zstd"))
    first = chain.load_manifest(store, run.run, "anchor", 0)
    assert first.codec.name == "safetensors-planes-zstd" and len(first.objects) > 1
    data = anchor_object(store, first)
    assert parse_header(data, len(data), "o").metadata[FORMAT_KEY] == FORMAT
    compacted = compact(store, run.run, 2, PublishOptions(anchor_compression="zstd"))
    assert compacted.codec.name == "safetensors-planes-zstd"
    run.publish(3)
    for version in (0, 1, 2, 3):
        run.assert_rebuilds(version)
    # A state cache rebuilt from the store reads the compressed anchor 2.
    shutil.rmtree(tmp_path / "cache")
    run.cache = StateCache(tmp_path / "cache2", run.run)
    assert run.publish(4).status == "published"
    run.assert_rebuilds(4)


def test_plain_and_compressed_anchors_in_one_run(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    run = SyntheticRun(tmp_path, store)
    run.publish(0)  # plain, as every run before compression existed
    run.publish(1)
    assert chain.load_manifest(store, run.run, "anchor", 0).codec.name == "safetensors"
    zstd = compact(store, run.run, 1, PublishOptions(anchor_compression="zstd"))
    run.publish(2)
    plain = chain.load_manifest(store, run.run, "anchor", 0)
    assert zstd.total_bytes < 0.8 * plain.total_bytes
    for version in (0, 1, 2):
        run.assert_rebuilds(version)


def test_rollout_node_bootstraps_from_a_compressed_anchor(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    run = SyntheticRun(tmp_path, store)
    run.publish(0)
    run.publish(1)
    compact(store, run.run, 1, PublishOptions(anchor_compression="zstd"))
    run.publish(2)
    held = {n: torch.zeros_like(t) for n, t in run.states[2].items()}
    node = RolloutNode(store, run.run, TorchTarget(held), NodeOptions(node_id="n", progress=False))
    try:
        assert node.step_once() == 2
        assert node.last_error is None
    finally:
        node.close()
    for name, tensor in run.states[2].items():
        assert same_bits(held[name], tensor), name


def test_compressed_anchor_of_realistic_weights_is_smaller() -> None:
    state = UpdateGenerator(ModelConfig.preset("tiny"), lr=1e-5, seed=0).state()
    plain = encode_anchor(state.items(), "none")
    packed = encode_anchor(state.items(), "zstd")
    # bf16 exponents take few values: about 0.68 of the plain bytes.
    assert len(packed) < 0.75 * len(plain)
    back = dict(anchor_tensors(packed, "obj"))
    assert all(same_bits(back[n], t) for n, t in state.items())
