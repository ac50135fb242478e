"""Store registry and backend-specific behaviour (file atomicity, S3 outages, Hub/Xet path)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.errors import ConfigError, ObjectNotFoundError, StoreError
from pipeline.store import known_schemes, open_store, register_store
from pipeline.store.file import FileStore
from pipeline.store.hf_bucket import HfBucketStore
from pipeline.store.s3 import S3Store
from tests.conftest import HF_TEST_BUCKET, fresh_name
from tests.hf_bucket_standin import HfBucketStandin
from tests.servers import S3_SECRET_KEY, SeaweedS3Server, free_port

# -- registry ----------------------------------------------------------------------------


def test_unknown_scheme_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError) as caught:
        open_store("ftp://example.org/x")
    message = str(caught.value)
    assert "'ftp'" in message
    for scheme in ("file", "s3", "hf"):
        assert scheme in message
    assert set(known_schemes()) >= {"file", "s3", "hf"}


@pytest.mark.parametrize("url", [None, "", "   "])
def test_no_url_is_a_config_error(url: str | None) -> None:
    with pytest.raises(ConfigError):
        open_store(url)


def test_plain_path_means_a_local_folder(tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "plain"))
    assert isinstance(store, FileStore)
    assert store.url == (tmp_path / "plain").as_uri()
    store.put("k", b"v")
    assert (tmp_path / "plain" / "k").read_bytes() == b"v"


def test_registered_schemes_are_imported_only_when_opened(tmp_path: Path) -> None:
    register_store("later", "deltasync_no_such_module:Store")  # no import happens here
    assert "later" in known_schemes()
    with pytest.raises(ConfigError) as caught:
        open_store("later://x")
    assert "deltasync_no_such_module" in str(caught.value)


def test_registered_scheme_opens_its_class(tmp_path: Path) -> None:
    register_store("testlocal", "tests.store.test_store_backends:LocalAlias")
    store = open_store(f"testlocal://{tmp_path}/alias")
    assert isinstance(store, LocalAlias)
    store.put("a/b", b"via alias")
    assert (tmp_path / "alias" / "a" / "b").read_bytes() == b"via alias"


class LocalAlias(FileStore):
    """A FileStore under another scheme, to prove register_store wires classes up."""

    @classmethod
    def from_url(cls, url: str) -> LocalAlias:
        return cls(url.split("://", 1)[1])


@pytest.mark.parametrize(
    ("scheme", "target"),
    [("bad scheme", "a.b:C"), ("ok", "no_colon"), ("ok", "a.b:C:D"), ("9x", "a:B")],
)
def test_register_store_validates_its_arguments(scheme: str, target: str) -> None:
    with pytest.raises(ConfigError):
        register_store(scheme, target)


# -- file ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["file://otherhost/x", "file://", "s3://b/p"])
def test_file_store_url_errors(bad: str) -> None:
    with pytest.raises(ConfigError):
        FileStore.from_url(bad)


def test_file_store_url_forms(tmp_path: Path) -> None:
    assert FileStore.from_url(f"file://{tmp_path}/a").root == tmp_path / "a"
    assert FileStore.from_url(f"file://localhost{tmp_path}/a").root == tmp_path / "a"
    assert FileStore.from_url(str(tmp_path / "b")).url == (tmp_path / "b").as_uri()


_CRASHING_WRITER = """
import sys
from pathlib import Path
from pipeline.store.file import FileStore
FileStore(sys.argv[1]).put_file("run/obj", Path(sys.argv[2]))
"""


def test_file_write_killed_midway_leaves_no_partial_object(tmp_path: Path) -> None:
    """A writer process killed mid-write: readers still see the old object, whole."""
    root = tmp_path / "store"
    store = FileStore(root)
    old = os.urandom(1000)
    store.put("run/obj", old)

    # The writer streams from a FIFO, so it blocks mid-write until we feed it more.
    fifo = tmp_path / "feed"
    os.mkfifo(fifo)
    writer = subprocess.Popen(
        [sys.executable, "-c", _CRASHING_WRITER, str(root), str(fifo)],
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        with open(fifo, "wb") as feed:
            # Once this returns, the writer has consumed all but a pipe buffer of it.
            feed.write(os.urandom(4 * 1024 * 1024))
            feed.flush()
            temp_files = [p for p in (root / "run").iterdir() if p.name != "obj"]
            assert temp_files, "the writer should have a temporary file in progress"
            assert store.get("run/obj") == old
            assert list(store.list("")) == ["run/obj"]
            os.kill(writer.pid, signal.SIGKILL)
            writer.wait()
    except BrokenPipeError:
        pass  # the writer died while we were closing the feed
    finally:
        if writer.poll() is None:
            os.kill(writer.pid, signal.SIGKILL)
            writer.wait()
    assert writer.returncode == -signal.SIGKILL
    assert store.get("run/obj") == old
    assert store.size("run/obj") == len(old)
    assert list(store.list("")) == ["run/obj"]  # the orphaned temp file is never listed


def test_file_store_never_writes_outside_its_root(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "root")
    for key in ("../outside", "a/../../outside", "/tmp/outside"):
        with pytest.raises(ConfigError):
            store.put(key, b"x")
    assert not (tmp_path / "outside").exists()


def test_file_delete_prunes_empty_folders(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "root")
    store.put("run/deltas/0000000001/manifest.json", b"{}")
    store.put("run/anchors/0000000000/manifest.json", b"{}")
    store.delete("run/deltas/0000000001/manifest.json")
    assert not (tmp_path / "root" / "run" / "deltas").exists()
    assert (tmp_path / "root" / "run" / "anchors" / "0000000000").is_dir()


def test_file_key_under_an_object_is_a_store_error(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "root")
    store.put("a", b"object")
    with pytest.raises(StoreError) as caught:
        store.put("a/b", b"x")
    assert "'a/b'" in str(caught.value)
    assert store.get("a") == b"object"


# -- S3 ------------------------------------------------------------------------------------


def test_s3_url_parsing(s3_server: SeaweedS3Server) -> None:
    store = S3Store.from_url("s3://some-bucket/a/b/")
    assert (store.bucket, store.prefix, store.url) == ("some-bucket", "a/b", "s3://some-bucket/a/b")
    assert store.endpoint == s3_server.endpoint
    assert S3Store.from_url("s3://some-bucket").prefix == ""
    for bad in ("s3://", "s3:///prefix", "s3://b/p?x=1", "s3://b/../p"):
        with pytest.raises(ConfigError):
            S3Store.from_url(bad)


def test_s3_large_file_goes_up_as_multipart(
    s3_url: str, s3_server: SeaweedS3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DELTASYNC_S3_PART_SIZE", str(5 * 1024 * 1024))
    store = open_store(s3_url)
    data = os.urandom(11 * 1024 * 1024 + 3)
    (tmp_path / "big").write_bytes(data)
    store.put_file("big/object", tmp_path / "big")
    assert store.get("big/object") == data
    assert store.get_range("big/object", 5 * 1024 * 1024 - 2, 4) == data[5242878:5242882]
    assert isinstance(store, S3Store)
    head = s3_server.client().head_object(Bucket=s3_server.bucket, Key=f"{store.prefix}/big/object")
    assert head["ETag"].strip('"').endswith("-3")  # three parts, so multipart was used


def test_s3_ensure_bucket_creates_it(s3_server: SeaweedS3Server) -> None:
    name = f"deltasync-{fresh_name('b')}"
    store = S3Store.from_url(f"s3://{name}/p")
    with pytest.raises(StoreError):
        store.get("k")
    store.ensure_bucket()
    store.ensure_bucket()  # exists already: fine
    store.put("k", b"v")
    assert s3_server.client().get_object(Bucket=name, Key="p/k")["Body"].read() == b"v"


def test_s3_missing_bucket_is_named(s3_server: SeaweedS3Server) -> None:
    # (SeaweedFS creates buckets on a first PUT by an admin key, so read.)
    store = open_store("s3://no-such-bucket-deltasync/p")
    with pytest.raises(StoreError) as caught:
        store.get("k")
    assert "no-such-bucket-deltasync" in str(caught.value)
    assert not isinstance(caught.value, ObjectNotFoundError)


def test_s3_outage_is_a_clear_error_then_recovers(
    s3_url: str, s3_server: SeaweedS3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("DELTASYNC_S3_MAX_ATTEMPTS", "2")
    local = tmp_path / "local"
    local.write_bytes(b"local file")
    store = open_store(s3_url)
    store.put("survives/restart", b"persisted")
    s3_server.stop()
    try:
        for action in (
            lambda: store.get("survives/restart"),
            lambda: store.put("during/outage", b"x"),
            lambda: list(store.list("")),
            lambda: store.exists("survives/restart"),
            lambda: store.put_file("during/outage", local),
            lambda: store.get_file("survives/restart", tmp_path / "down"),
        ):
            with pytest.raises(StoreError) as caught:
                action()
            message = str(caught.value)
            assert not isinstance(caught.value, ObjectNotFoundError)
            assert f"cannot reach S3 at {s3_server.endpoint}" in message
            assert S3_SECRET_KEY not in message
            assert "\n" not in message
    finally:
        s3_server.restart()
    assert not (tmp_path / "down").exists()
    assert store.get("survives/restart") == b"persisted"
    store.put("after/restart", b"ok")
    assert list(store.list("")) == ["after/restart", "survives/restart"]


# -- Hugging Face bucket ----------------------------------------------------------------------


def test_hf_url_parsing(hf_bucket: HfBucketStandin) -> None:
    store = HfBucketStore.from_url("hf://buckets/ns/name/a/b/")
    assert (store.bucket_id, store.prefix) == ("ns/name", "a/b")
    assert store.url == "hf://buckets/ns/name/a/b"
    assert store.endpoint == hf_bucket.endpoint
    assert HfBucketStore.from_url("hf://buckets/ns/name").prefix == ""
    for bad in ("hf://ns/name", "hf://buckets/ns", "hf://buckets//name", "hf://buckets/a/b/../c"):
        with pytest.raises(ConfigError):
            HfBucketStore.from_url(bad)


def test_hf_bytes_move_through_xet_storage(hf_url: str, hf_bucket: HfBucketStandin) -> None:
    store = open_store(hf_url)
    before = _xorb_files(hf_bucket)
    data = os.urandom(2 * 1024 * 1024)
    store.put("xet/object", data)
    assert _xorb_files(hf_bucket) - before, "the upload should have written new xorbs"
    assert store.get("xet/object") == data
    assert store.get_range("xet/object", 1_000_000, 10) == data[1_000_000:1_000_010]


def _xorb_files(standin: HfBucketStandin) -> set[Path]:
    return {p for p in standin.cas_dir.rglob("*") if p.is_file() and "xorbs" in p.parts}


def test_hf_token_comes_from_the_environment(
    hf_url: str, hf_bucket: HfBucketStandin, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_deltasync_test_token")
    store = open_store(hf_url)
    store.put("auth/object", b"x")
    assert "Bearer hf_deltasync_test_token" in hf_bucket.tokens_seen


def test_hf_missing_bucket_is_named(hf_bucket: HfBucketStandin) -> None:
    store = open_store(f"hf://buckets/{HF_TEST_BUCKET}-absent/{fresh_name()}")
    with pytest.raises(StoreError) as caught:
        store.get("k")
    assert f"{HF_TEST_BUCKET}-absent" in str(caught.value)
    assert not isinstance(caught.value, ObjectNotFoundError)


def test_hf_create_bucket(hf_bucket: HfBucketStandin) -> None:
    bucket_id = f"deltasync-tests/{fresh_name('b')}"
    store = HfBucketStore(bucket_id, "p", endpoint=hf_bucket.endpoint)
    store.ensure_bucket()
    store.ensure_bucket()  # exists already: fine
    store.put("k", b"v")
    assert list(store.list("")) == ["k"]


def test_hf_listing_follows_pages(hf_bucket: HfBucketStandin, hf_url: str) -> None:
    store = open_store(hf_url)
    keys = [f"page/{i:04d}" for i in range(7)]
    for key in keys:
        store.put(key, key.encode())
    page_size = hf_bucket.page_size
    hf_bucket.page_size = 2
    try:
        assert list(store.list("page")) == keys
    finally:
        hf_bucket.page_size = page_size


def test_hf_unreachable_endpoint_is_a_store_error() -> None:
    # create_bucket makes one attempt; the read paths retry with backoff for ~20 s
    # (huggingface_hub's http_backoff) before failing the same way.
    endpoint = f"http://127.0.0.1:{free_port()}"
    store = HfBucketStore("ns/name", "p", endpoint=endpoint)
    with pytest.raises(StoreError) as caught:
        store.ensure_bucket()
    assert str(caught.value).startswith(f"cannot reach the Hub at {endpoint}")
