"""docs/FORMAT.md is enough to read deltasync: tests/format_reader.py, written from it
alone, decodes what the library writes bit for bit, and hashes it as the manifests do.

The library writes (deltas of every dtype the codec takes, anchors, whole runs in a
store, a sharded run); the reader reads; the test compares with the weights the
library was given, never with the library's own decoding.
"""

from __future__ import annotations

import ast
import base64
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
import xxhash
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from pipeline.codec import encode_anchor, encode_delta
from pipeline.format.checkpoints.checkpoint import CheckpointReader
from pipeline.format.checkpoints.checkpoint_write import write_checkpoint
from pipeline.format.hashes import content_hashes
from pipeline.format.manifest import Manifest
from pipeline.format.regions import Region
from pipeline.format.tensors import BY_TORCH, DTYPE_TABLE
from pipeline.publish.diff import publish_delta
from pipeline.publish.version import PublishOptions, publish_anchor
from pipeline.store.file import FileStore
from tests import format_reader as spec
from tests.sharded_store import build_pieced_run

REPO = Path(__file__).resolve().parents[2]
MIXSUM = content_hashes.get(content_hashes.MIXSUM)
CODEC_DTYPES = [d.dtype for d in DTYPE_TABLE if d.codec]
ALL_DTYPES = [d.dtype for d in DTYPE_TABLE]


def xxh3(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def name_of(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def bits_of(t: torch.Tensor) -> npt.NDArray[Any]:
    """A tensor's bits, flat, as the reader holds them."""
    width = t.element_size()
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return raw.view(spec.UNSIGNED[width]).copy()


def tensor_of(bits: npt.NDArray[Any], dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if bits.size == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.from_numpy(np.ascontiguousarray(bits).view(np.uint8).copy())
    return raw.view(dtype).reshape(shape)


# ---------------------------------------------------------------- test weights


def specials(dtype: torch.dtype) -> list[int]:
    """Bit patterns a codec could get wrong: signed zeros, infinities, NaNs with payloads,
    subnormals, the extremes and the half-way difference of the width."""
    width = torch.empty(0, dtype=dtype).element_size()
    top = 1 << (8 * width - 1)
    info = BY_TORCH[dtype]
    if dtype == torch.bool:
        return [0, 1]
    out = [0, top, top - 1, 2 * top - 1, 1, top | 1]
    if info.exponent is not None:
        shift, mask = info.exponent
        out += [mask << shift, (mask << shift) | 1, (mask << shift) | ((1 << shift) - 1)]
        out += [top | (mask << shift), top | (mask << shift) | 3]
    return out


def random_bits(
    dtype: torch.dtype, n: int, rng: np.random.Generator
) -> npt.NDArray[np.unsignedinteger[Any]]:
    width = torch.empty(0, dtype=dtype).element_size()
    unsigned = spec.UNSIGNED[width]
    if dtype == torch.bool:
        return rng.integers(0, 2, n).astype(unsigned)
    raw = rng.integers(0, 256, n * width, dtype=np.uint8).view(unsigned).copy()
    pick = rng.random(n) < 0.2
    raw[pick] = rng.choice(np.array(specials(dtype), dtype=np.uint64), int(pick.sum()))
    return raw


def changed_bits(
    dtype: torch.dtype,
    base: npt.NDArray[Any],
    share: float,
    rng: np.random.Generator,
    *,
    far: bool,
    block: bool = False,
) -> npt.NDArray[Any]:
    """``base`` with about ``share`` of its elements changed, at random or in one
    ``block``: by +-1 in the bits (a few by more), or to other bits (``far``),
    specials among them."""
    new = base.copy()
    if base.size == 0:
        return new
    if block:
        where = np.arange(base.size // 4, base.size // 4 + int(share * base.size))
    else:
        where = np.flatnonzero(rng.random(base.size) < share)
    if where.size == 0:
        where = np.array([rng.integers(0, base.size)])
    if dtype == torch.bool:
        new[where] ^= 1
        return new
    unsigned = base.dtype.type
    if far:
        new[where] = random_bits(dtype, where.size, rng)
        new[where[::3]] = rng.choice(np.array(specials(dtype), np.uint64), where[::3].size)
    else:
        step = rng.choice(np.array([1, -1, 1, -1, 1, -1, 2, -3, 77, -300]), where.size)
        new[where] = base[where] + step.astype(np.int64).astype(base.dtype)
        new[where[:1]] = base[where[:1]] + unsigned(1 << (8 * base.itemsize - 1))  # the half
    unchanged = where[new[where] == base[where]]
    new[unchanged] ^= unsigned(1)  # a random pick that landed on its base
    return new


CASES = {  # name: (shape, share changed, far, in one block)
    "ulp": ((4000,), 0.01, False, False),
    "far": ((4000,), 0.01, True, False),
    "mask": ((40, 100), 0.2, False, False),
    "block": ((4000,), 0.4, False, True),
    "block_far": ((4000,), 0.4, True, True),
    "dense": ((4000,), 0.7, True, False),
    "matrix": ((37, 29), 0.03, False, False),
    "scalar": ((), 1.0, True, False),
    "one": ((1,), 0.0, False, False),
    "empty": ((0,), 0.0, False, False),
    "empty_3d": ((2, 0, 3), 0.0, False, False),
    "all": ((9,), 1.0, False, False),
}


def pairs_of(
    dtype: torch.dtype, seed: int
) -> list[tuple[str, npt.NDArray[Any], npt.NDArray[Any], tuple[int, ...]]]:
    """(name, base bits, new bits, shape) of every case, for one dtype."""
    rng = np.random.default_rng(seed)
    out = []
    for case, (shape, share, far, block) in CASES.items():
        n = math.prod(shape)
        base = random_bits(dtype, n, rng)
        new = changed_bits(dtype, base, share, rng, far=far, block=block) if share else base.copy()
        out.append((f"{case}.{name_of(dtype)}", base, new, shape))
    return out


def encode(
    dtype: torch.dtype, pairs: list[tuple[str, Any, Any, tuple[int, ...]]], level: int
) -> bytes:
    return encode_delta(
        [(n, tensor_of(b, dtype, s), tensor_of(t, dtype, s)) for n, b, t, s in pairs], level
    )


# ---------------------------------------------------------------- the reader stands alone


def test_the_reader_imports_nothing_of_deltasync() -> None:
    """Its imports: the standard library, numpy and zstandard, nothing else."""
    tree = ast.parse((REPO / "tests" / "format_reader.py").read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "a relative import"
            roots.add((node.module or "").split(".")[0])
    foreign = {r for r in roots if r not in sys.stdlib_module_names} - {"numpy", "zstandard"}
    assert foreign == set()
    assert "written from docs/FORMAT.md alone" in (spec.__doc__ or "")


def test_the_specs_dtype_table_is_the_librarys() -> None:
    """Every dtype the library moves, with the same safetensors code and width, and
    floating exactly where torch says so."""
    assert set(spec.DTYPES) == {d.name for d in DTYPE_TABLE}
    for d in DTYPE_TABLE:
        code, width, floating = spec.DTYPES[d.name]
        assert (code, width, floating) == (d.safetensors, d.width, d.dtype.is_floating_point)
    text = (REPO / "docs" / "FORMAT.md").read_text()
    for d in DTYPE_TABLE:
        assert f"`{d.name}`" in text and f"`{d.safetensors}`" in text, d.name
        if d.exponent is not None:
            assert f"({d.exponent[0]}, 0x{d.exponent[1]:X})" in text, d.name


# ---------------------------------------------------------------- level 1 objects


def test_level_1_objects_of_every_dtype_decode_bit_for_bit() -> None:
    """One object per dtype, each with many tensors: NaN payloads, -0.0, infinities,
    the half-way difference, empty, 0-dim and 1-element tensors; the reader's patch
    on the base gives the new bits, and its mixsum-128 is the library's."""
    seen: set[tuple[str, str | None, bool]] = set()
    for seed, dtype in enumerate(CODEC_DTYPES):
        pairs = pairs_of(dtype, seed)
        level, records = spec.read_delta(encode(dtype, pairs, 1), xxh3)
        assert level == 1
        assert [r.name for r in records] == [n for n, *_ in pairs]
        for record, (name, base, new, shape) in zip(records, pairs, strict=True):
            assert (record.dtype, record.shape) == (name_of(dtype), shape)
            assert record.changed == int((base != new).sum()), name
            where, values = spec.decode(record, base)
            got = base.copy()
            got[where] = values
            assert np.array_equal(got, new), name
            want = MIXSUM.full(tensor_of(new, dtype, shape))
            assert spec.mixsum(got) == want, name
            p = record.params
            seen.add((record.encoding, p.get("contents"), bool(p.get("big"))))
    # Every level-1 layout was read: the test cannot pass on a subset.
    assert {
        ("same", None, False),
        ("sparse", "signmag", True),
        ("sparse", "signmag", False),
        ("sparse", "planes", False),
        ("bitmap", "signmag", True),
        ("bitmap", "planes", False),
        ("dense", None, False),
    } <= seen, seen


def test_mixsum_of_pieces_and_boxes_is_the_librarys() -> None:
    """A piece's hash mixes its elements at their flat positions in the whole tensor
    (boxes laid out as the spec says), and pieces sum to the whole."""
    rng = np.random.default_rng(7)
    shape = [6, 5, 8]
    whole = random_bits(torch.bfloat16, math.prod(shape), rng)
    for offset, size in (([0, 0, 0], [6, 5, 8]), ([2, 1, 0], [3, 4, 8]), ([1, 0, 3], [4, 5, 2])):
        region = Region(tuple(shape), tuple(offset), tuple(size))
        at = spec.box_positions(shape, offset, size)
        assert np.array_equal(at, region.positions(np.arange(region.numel, dtype=np.int64)))
        piece = tensor_of(whole[at], torch.bfloat16, (region.numel,))
        assert spec.mixsum(whole[at], at) == MIXSUM.piece(piece, region)
    halves = [
        spec.mixsum(whole[:100], np.arange(100)),
        spec.mixsum(whole[100:], np.arange(100, 240)),
    ]
    assert (
        spec.lane_sum(halves)
        == spec.mixsum(whole)
        == MIXSUM.full(tensor_of(whole, torch.bfloat16, tuple(shape)))
    )


# ---------------------------------------------------------------- level 3 objects


def test_level_3_objects_decode_bit_for_bit() -> None:
    """Chunked records (several chunks, the last one partial; one bucket and several;
    large magnitudes) and the level-1 records a level-3 object falls back to."""
    rng = np.random.default_rng(3)
    seen: set[tuple[str, int, bool]] = set()
    for dtype, n, noise in (
        (torch.bfloat16, (5 << 19) + 77, 2e-6),
        (torch.float16, 1 << 20, 2e-7),
        (torch.float32, 1 << 20, 1e-10),
        (torch.int16, 1 << 20, 0.0),
    ):
        if dtype.is_floating_point:  # a small update of weights: changes where values are small
            weights = 0.02 * torch.from_numpy(rng.standard_normal(n))
            base_t = weights.to(dtype)
            new_t = (weights + noise * torch.from_numpy(rng.standard_normal(n))).to(dtype)
            base, new = bits_of(base_t), bits_of(new_t)
        else:  # +-1 at 1.5%, one in 50 by more
            base = random_bits(dtype, n, rng)
            where = np.flatnonzero(rng.random(n) < 0.015)
            step = rng.choice(np.array([1, -1] * 25 + [7]), where.size).astype(np.int64)
            new = base.copy()
            new[where] = base[where] + step.astype(base.dtype)
        pairs = [(f"big.{name_of(dtype)}", base, new, (n,)), *pairs_of(dtype, 11)[:4]]
        level, records = spec.read_delta(encode(dtype, pairs, 3), xxh3)
        assert level == 3
        for record, (name, old, want, _) in zip(records, pairs, strict=True):
            positions, values = spec.decode(record, old)
            got = old.copy()
            got[positions] = values
            assert np.array_equal(got, want), name
            groups = len(record.params.get("bounds", [])) + 1
            seen.add((record.encoding, groups, bool(record.params.get("big"))))
    encodings = {e for e, _, _ in seen}
    assert {"chunked", "sparse"} <= encodings, seen
    assert ("chunked", 1, True) in seen and any(e == "chunked" and g > 1 for e, g, _ in seen), seen


# ---------------------------------------------------------------- anchors


@pytest.mark.parametrize("method", ["none", "zstd"])
def test_anchor_objects_of_every_dtype(method: str) -> None:
    rng = np.random.default_rng(5)
    tensors = {}
    for dtype in ALL_DTYPES:
        for shape in ((0,), (), (3, 7)):
            bits = random_bits(dtype, math.prod(shape), rng)
            tensors[f"{name_of(dtype)}.{len(shape)}.{math.prod(shape)}"] = (dtype, shape, bits)
    data = encode_anchor(((n, tensor_of(b, d, s)) for n, (d, s, b) in tensors.items()), method)
    got = spec.read_anchor(data)
    assert list(got) == list(tensors)
    for name, (dtype, shape, bits) in tensors.items():
        assert (got[name].dtype, got[name].shape) == (name_of(dtype), shape), name
        assert np.array_equal(got[name].data, bits), name


# ---------------------------------------------------------------- a run in a store


def state(seed: int) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(seed)
    out = {}
    for dtype in CODEC_DTYPES:
        for shape in ((300,), (12, 10), (0,)):
            out[f"w.{name_of(dtype)}.{len(shape)}"] = tensor_of(
                random_bits(dtype, math.prod(shape), rng), dtype, shape
            )
    return out


def step(previous: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, t in previous.items():
        share = rng.choice([0.0, 0.02, 0.3])
        far = bool(rng.integers(0, 2))
        bits = changed_bits(t.dtype, bits_of(t), share, rng, far=far) if share else bits_of(t)
        out[name] = tensor_of(bits, t.dtype, tuple(t.shape))
    return out


def check_signed(store_root: Path, manifest: Manifest, raw_public: bytes) -> dict[str, Any]:
    """The stored manifest is an envelope whose header's signature verifies over the
    reader's statement of the signed bytes, which are the manifest's canonical JSON."""
    folder = "deltas" if manifest.kind == "delta" else "anchors"
    doc = spec.Store(store_root).manifest(manifest.run, folder, manifest.version)
    stored = (store_root / manifest.key).read_bytes()
    payload, signature = spec.open_envelope(stored)
    assert signature is not None
    assert signature["alg"] == "ed25519"
    assert signature["key_id"] == spec.key_id(raw_public)
    Ed25519PublicKey.from_public_bytes(raw_public).verify(
        base64.b64decode(signature["sig"], validate=True),
        spec.signed_statement(signature, "manifest"),
    )
    assert payload == spec.canonical(doc) and "signature" not in doc
    return doc


def check_signed_record(store_root: Path, run: str, raw_public: bytes) -> None:
    """``run.json`` of a signed run is signed the same way, as a ``run record``."""
    payload, signature = spec.open_envelope((store_root / run / "run.json").read_bytes())
    assert signature is not None and signature["key_id"] == spec.key_id(raw_public)
    Ed25519PublicKey.from_public_bytes(raw_public).verify(
        base64.b64decode(signature["sig"], validate=True),
        spec.signed_statement(signature, "run record"),
    )
    assert set(json.loads(payload)) == {"instance", "since"}


def test_a_signed_run_rebuilds_from_the_store_alone(tmp_path: Path) -> None:
    """Anchors in both forms, deltas at levels 1 and 3 (the compact container), several
    parts a version: every version rebuilt by the reader from the store folder equals
    the trainer's weights, each tensor's mixsum-128 is its manifest's hash, the state
    hash holds, and each signature verifies over the reader's payload."""
    root = tmp_path / "store"
    store = FileStore(root)
    key = Ed25519PrivateKey.generate()
    raw_public = key.public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )
    run = "spec-run"
    states = {0: state(0)}
    for version, previous in ((1, 0), (3, 1), (4, 3), (7, 4)):
        states[version] = step(states[previous], version)
    paths = {}
    for version, tensors in states.items():
        paths[version] = tmp_path / f"ckpt-{version}.safetensors"
        write_checkpoint(paths[version], tensors.items())

    def reader(version: int) -> CheckpointReader:
        return CheckpointReader(paths[version])

    manifests = [
        publish_anchor(
            store,
            run,
            0,
            reader(0),
            PublishOptions(signing_key=key, part_bytes=4096, anchor_compression="zstd"),
            parent=None,
            reason="first version",
        )
    ]
    for version, parent, level in ((1, 0, 1), (3, 1, 3), (4, 3, 1)):
        manifests.append(
            publish_delta(
                store,
                run,
                version,
                reader(parent),
                reader(version),
                manifests[-1],
                PublishOptions(level=level, signing_key=key),
            )
        )
    manifests.append(
        publish_anchor(
            store,
            run,
            4,
            reader(4),
            PublishOptions(signing_key=key),
            parent=3,
            reason="compaction",
            expected=manifests[-1],
            parent_state_hash=manifests[-1].parent_state_hash,
        )
    )
    manifests.append(
        publish_delta(
            store, run, 7, reader(4), reader(7), manifests[-1], PublishOptions(signing_key=key)
        )
    )
    assert [m.codec.level for m in manifests] == [1, 1, 3, 1, 0, 1]
    assert len(manifests[1].objects) > 1

    read = spec.Store(root, xxh3)
    assert read.versions(run, "deltas") == [1, 3, 4, 7]
    assert read.versions(run, "anchors") == [0, 4]
    assert [m["version"] for _, m in read.chain(run, 7)] == [4, 7]
    check_signed_record(root, run, raw_public)
    for manifest in manifests:
        doc = check_signed(root, manifest, raw_public)
        got = read.rebuild(run, manifest.version)
        assert list(got) == list(states[manifest.version])
        for entry in doc["tensors"]:
            t = got[entry["name"]]
            assert np.array_equal(t.data, bits_of(states[manifest.version][entry["name"]]))
            assert spec.mixsum(t.data) == entry["hash"], entry["name"]
        assert spec.state_hash(doc["tensors"], xxh3) == doc["state_hash"]


def test_a_sharded_run_rebuilds_from_its_pieces(tmp_path: Path) -> None:
    """Schema 3: tensors in pieces over every rank's objects, anchors and deltas."""
    built = build_pieced_run(FileStore(tmp_path / "store"), "pieced", deltas=2)
    read = spec.Store(tmp_path / "store", xxh3)
    for version, want in enumerate(built.states):
        kind = "anchors" if version == 0 else "deltas"
        doc = read.manifest("pieced", kind, version)
        assert doc["schema"] == 3 and all("pieces" in t for t in doc["tensors"])
        got = read.rebuild("pieced", version)
        for name, tensor in want.items():
            assert np.array_equal(got[name].data, bits_of(tensor)), (version, name)
