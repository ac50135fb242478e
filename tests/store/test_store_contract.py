"""The ObjectStore contract, run against every backend (file, S3, HF bucket).

Each backend gets a fresh root from the ``store`` fixture (conftest.py), backed by
real servers: a local folder, SeaweedFS over S3, and the Hub bucket stand-in with
real Xet storage underneath.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import random
import threading
from pathlib import Path

import pytest

from pipeline.errors import ConfigError, ObjectNotFoundError
from pipeline.store import ObjectStore, open_store, put_if_absent

SMALL = b"deltasync \x00\xff object"


def payload(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- round trips -----------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 1000, 6 * 1024 * 1024 + 17])
def test_put_get_round_trip_is_byte_exact(store: ObjectStore, size: int) -> None:
    data = payload(size, seed=size)
    store.put("run/deltas/0000000001/part-00000.safetensors", data)
    back = store.get("run/deltas/0000000001/part-00000.safetensors")
    assert len(back) == size
    assert sha(back) == sha(data)
    assert store.size("run/deltas/0000000001/part-00000.safetensors") == size
    assert store.exists("run/deltas/0000000001/part-00000.safetensors")


def test_put_file_get_file_round_trip(store: ObjectStore, tmp_path: Path) -> None:
    data = payload(3 * 1024 * 1024 + 5, seed=7)
    source = tmp_path / "source.bin"
    source.write_bytes(data)
    store.put_file("objects/blob.bin", source)
    assert store.size("objects/blob.bin") == len(data)

    target = tmp_path / "down" / "blob.bin"
    store.get_file("objects/blob.bin", target)
    assert sha(target.read_bytes()) == sha(data)
    assert sha(store.get("objects/blob.bin")) == sha(data)
    # The download is atomic: nothing but the target is left in its folder.
    assert sorted(p.name for p in target.parent.iterdir()) == ["blob.bin"]


def test_get_file_replaces_an_existing_local_file(store: ObjectStore, tmp_path: Path) -> None:
    store.put("a/new.bin", b"new contents")
    target = tmp_path / "existing.bin"
    target.write_bytes(b"old contents that are longer than the new ones")
    store.get_file("a/new.bin", target)
    assert target.read_bytes() == b"new contents"


def test_empty_object_round_trips_through_files(store: ObjectStore, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    store.put_file("e/empty", empty)
    assert store.exists("e/empty")
    assert store.size("e/empty") == 0
    assert store.get("e/empty") == b""
    store.get_file("e/empty", tmp_path / "out")
    assert (tmp_path / "out").read_bytes() == b""


def test_overwrite_replaces_the_whole_object(store: ObjectStore) -> None:
    store.put("k/v", payload(5000, seed=1))
    store.put("k/v", b"short")
    assert store.get("k/v") == b"short"
    assert store.size("k/v") == 5
    assert list(store.list("k")) == ["k/v"]


def test_put_if_absent_creates_once(store: ObjectStore) -> None:
    assert put_if_absent(store, "run/deltas/0000000003/manifest.json", b"first")
    assert not put_if_absent(store, "run/deltas/0000000003/manifest.json", b"second")
    assert store.get("run/deltas/0000000003/manifest.json") == b"first"
    assert list(store.list("run")) == ["run/deltas/0000000003/manifest.json"]


@pytest.mark.parametrize("store_url", ["file", "s3"], indirect=True)
def test_concurrent_creators_have_exactly_one_winner(store: ObjectStore) -> None:
    """On backends with an atomic create, racing writers cannot both publish."""
    payloads = [f"writer {i} ".encode() * 1000 for i in range(8)]
    barrier = threading.Barrier(len(payloads))
    results: list[bool] = [False] * len(payloads)

    def create(i: int) -> None:
        barrier.wait()
        results[i] = put_if_absent(store, "race/manifest.json", payloads[i])

    threads = [threading.Thread(target=create, args=(i,)) for i in range(len(payloads))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(results) == 1
    assert store.get("race/manifest.json") == payloads[results.index(True)]
    assert list(store.list("race")) == ["race/manifest.json"]


def _write_in_child(store: ObjectStore, key: str, data: bytes) -> None:
    store.put(key, data)
    assert store.get(key) == data


def test_store_works_in_a_forked_child(store: ObjectStore) -> None:
    """rq's default worker forks per job: a store opened before the fork must still work."""
    store.put("fork/parent", b"before fork")  # the parent's connections are now live
    child = multiprocessing.get_context("fork").Process(
        target=_write_in_child, args=(store, "fork/child", b"from the child")
    )
    child.start()
    child.join()
    assert child.exitcode == 0
    assert store.get("fork/child") == b"from the child"
    assert store.get("fork/parent") == b"before fork"


# -- ranges ----------------------------------------------------------------------------


def test_get_range(store: ObjectStore) -> None:
    data = payload(100_000, seed=3)
    store.put("r/obj", data)
    assert store.get_range("r/obj", 0, 10) == data[:10]
    assert store.get_range("r/obj", 12_345, 6_789) == data[12_345 : 12_345 + 6_789]
    assert store.get_range("r/obj", 99_990, 10) == data[99_990:]
    # Past the end: fewer bytes, then none.
    assert store.get_range("r/obj", 99_990, 1_000) == data[99_990:]
    assert store.get_range("r/obj", 100_000, 10) == b""
    assert store.get_range("r/obj", 200_000, 10) == b""
    assert store.get_range("r/obj", 50, 0) == b""


def test_get_range_of_empty_object(store: ObjectStore) -> None:
    store.put("r/empty", b"")
    assert store.get_range("r/empty", 0, 10) == b""


def test_get_range_rejects_negative_numbers(store: ObjectStore) -> None:
    store.put("r/obj", SMALL)
    with pytest.raises(ConfigError):
        store.get_range("r/obj", -1, 4)
    with pytest.raises(ConfigError):
        store.get_range("r/obj", 0, -4)


# -- listing ---------------------------------------------------------------------------


def test_list_is_sorted_and_scoped_to_the_folder(store: ObjectStore) -> None:
    keys = [
        "run/deltas/0000000010/manifest.json",
        "run/deltas/0000000002/part-00001.safetensors",
        "run/deltas/0000000002/part-00000.safetensors",
        "run/deltas/0000000002/manifest.json",
        "run/deltas-old/0000000001/manifest.json",
        "run/deltasx",
        "run/anchors/0000000000/manifest.json",
        "other/deltas/0000000002/manifest.json",
    ]
    for i, key in enumerate(keys):
        store.put(key, str(i).encode())

    under_deltas = [k for k in sorted(keys) if k.startswith("run/deltas/")]
    assert list(store.list("run/deltas")) == under_deltas
    assert list(store.list("run/deltas/")) == under_deltas
    assert list(store.list("run/deltas/0000000002")) == [
        "run/deltas/0000000002/manifest.json",
        "run/deltas/0000000002/part-00000.safetensors",
        "run/deltas/0000000002/part-00001.safetensors",
    ]
    assert list(store.list("run")) == sorted(k for k in keys if k.startswith("run/"))
    assert list(store.list("")) == sorted(keys)
    assert list(store.list("absent")) == []
    assert list(store.list("run/deltasx")) == []  # an object, not a folder


def test_list_of_empty_store_is_empty(store: ObjectStore) -> None:
    assert list(store.list("")) == []


def test_roots_do_not_leak_into_each_other(store: ObjectStore) -> None:
    sibling = open_store(store.url + "-sibling")
    sibling.put("a/key", b"sibling")
    store.put("a/key", b"mine")
    assert list(store.list("")) == ["a/key"]
    assert store.get("a/key") == b"mine"
    assert sibling.get("a/key") == b"sibling"


def test_reopening_the_url_sees_the_same_objects(store: ObjectStore) -> None:
    store.put("x/y", SMALL)
    again = open_store(store.url)
    assert again.url == store.url
    assert again.get("x/y") == SMALL


# -- delete and missing keys -------------------------------------------------------------


def test_delete_is_idempotent(store: ObjectStore) -> None:
    store.put("d/a", b"1")
    store.put("d/b", b"2")
    store.delete("d/a")
    assert not store.exists("d/a")
    assert list(store.list("d")) == ["d/b"]
    store.delete("d/a")
    store.delete("never/existed")
    assert store.get("d/b") == b"2"


def test_missing_key_raises_object_not_found(store: ObjectStore, tmp_path: Path) -> None:
    store.put("present/x", b"x")  # the folder exists, the key does not
    for key in ("present/missing", "absent/missing"):
        assert not store.exists(key)
        with pytest.raises(ObjectNotFoundError):
            store.get(key)
        with pytest.raises(ObjectNotFoundError):
            store.get_range(key, 0, 10)
        with pytest.raises(ObjectNotFoundError):
            store.size(key)
        with pytest.raises(ObjectNotFoundError):
            store.get_file(key, tmp_path / "out")
        assert not (tmp_path / "out").exists()


def test_not_found_message_names_the_key_and_store(store: ObjectStore) -> None:
    with pytest.raises(ObjectNotFoundError) as caught:
        store.get("no/such/key")
    message = str(caught.value)
    assert "no/such/key" in message
    assert store.url in message
    assert "\n" not in message


def test_a_folder_is_not_an_object(store: ObjectStore) -> None:
    store.put("f/inner/leaf", b"leaf")
    assert not store.exists("f/inner")
    with pytest.raises(ObjectNotFoundError):
        store.get("f/inner")


# -- invalid keys ------------------------------------------------------------------------

INVALID_KEYS = [
    "",
    "/abs/key",
    "../escape",
    "a/../../escape",
    "a/./b",
    "a//b",
    "a/",
    "a\nb",
    "a\x00b",
    "a\tb",
    "a b",
    "a\\b",
    "ümlaut",
]


@pytest.mark.parametrize("key", INVALID_KEYS)
def test_invalid_keys_are_rejected(store: ObjectStore, key: str, tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.write_bytes(b"x")
    with pytest.raises(ConfigError):
        store.put(key, b"x")
    with pytest.raises(ConfigError):
        store.put_file(key, source)
    with pytest.raises(ConfigError):
        store.get(key)
    with pytest.raises(ConfigError):
        store.get_range(key, 0, 1)
    with pytest.raises(ConfigError):
        store.exists(key)
    with pytest.raises(ConfigError):
        store.delete(key)
    assert list(store.list("")) == []


@pytest.mark.parametrize("prefix", ["/abs", "../up", "a/../b", "a//", "a\nb"])
def test_invalid_prefixes_are_rejected(store: ObjectStore, prefix: str) -> None:
    with pytest.raises(ConfigError):
        list(store.list(prefix))
