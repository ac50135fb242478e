"""A LOCAL STAND-IN for the Hugging Face Hub's bucket HTTP API, for tests only.

The Hub cannot be reached from CI, and there is no official emulator, so this
small HTTP server answers the routes that ``huggingface_hub.HfApi``'s bucket
methods call (create, info, tree, paths-info, batch, resolve, Xet tokens).
It is not the Hub: it keeps the bucket index in memory, does no auth beyond
recording the token it was sent, and implements only what deltasync uses.

The bytes themselves travel through real Xet storage: the token routes answer
with a ``local:///<dir>`` CAS URL, which the real ``hf_xet`` client accepts and
uses as a content-addressed store on disk. So an upload really chunks, hashes
and writes xorbs and shards, and a download really reconstructs the file from
them; only the Hub's metadata service is stood in for.

Limit: hf_xet's local CAS holds an exclusive lock on its dedup database while a
transfer is in flight, and a copy of the folder without that database cannot
serve reads, so Xet transfers from several PROCESSES at the same moment fail
("Database already open"). Sequential processes (a forked or spawned child
while the parent waits) and any number of threads in one process work. Tests
that run concurrent worker processes should use the file or S3 backends.
"""

from __future__ import annotations

import json
import struct
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

# What hf_xet reports for a zero-length upload.
EMPTY_FILE_XET_HASH = "0" * 64


@dataclass
class _Entry:
    xet_hash: str
    size: int
    mtime_ms: int
    uploaded: str


@dataclass
class _Bucket:
    private: bool
    created: str
    files: dict[str, _Entry] = field(default_factory=dict)


def _iso(moment: datetime) -> str:
    # The Hub's format, the only one huggingface_hub's parser accepts.
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def _now_iso() -> str:
    return _iso(datetime.now(UTC))


class HfBucketStandin:
    """The stand-in server: ``start()`` binds 127.0.0.1 on a free port in a thread."""

    def __init__(self, cas_dir: Path, page_size: int = 1000) -> None:
        self.cas_dir = Path(cas_dir).resolve()
        self.cas_dir.mkdir(parents=True, exist_ok=True)
        self.page_size = page_size
        self.buckets: dict[str, _Bucket] = {}
        self.lock = threading.Lock()
        self.tokens_seen: list[str] = []
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._size_lock = threading.Lock()
        self._sizes: dict[str, int] = {}
        self._shards_read: set[Path] = set()

    @property
    def endpoint(self) -> str:
        if self._server is None:
            raise RuntimeError("stand-in not started")
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    @property
    def cas_url(self) -> str:
        return "local://" + self.cas_dir.as_posix()

    def start(self) -> None:
        handler = type("Handler", (_Handler,), {"standin": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="hf-bucket-standin", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> HfBucketStandin:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def xet_file_size(self, xet_hash: str) -> int | None:
        """The size of an uploaded file, read from the shards in the local CAS.

        The Hub learns it from its CAS too (the batch call carries only the hash).
        The shards are parsed here rather than opened through hf_xet, because the
        local CAS keeps an exclusive lock while a client process has it open.
        """
        if xet_hash == EMPTY_FILE_XET_HASH:
            return 0
        with self._size_lock:
            if xet_hash not in self._sizes:
                for shard in sorted(self.cas_dir.rglob("*.mdb")):
                    if shard not in self._shards_read:
                        self._sizes.update(_shard_file_sizes(shard.read_bytes()))
                        self._shards_read.add(shard)
            return self._sizes.get(xet_hash)

    def create_bucket(self, bucket_id: str, private: bool = False) -> None:
        with self.lock:
            self.buckets.setdefault(bucket_id, _Bucket(private=private, created=_now_iso()))


# Xet "MDB" shard layout (little endian): a 48-byte header, then the file-info
# section: per file a 48-byte header (hash as 4 u64, flags u32, entry count u32),
# that many 48-byte segment entries (xorb hash, flags u32, unpacked bytes u32, ...),
# optional verification entries and metadata, and a bookend of 0xff bytes.
_SHARD_RECORD = 48
_FLAG_VERIFICATION = 1 << 31
_FLAG_METADATA_EXT = 1 << 30


def _shard_file_sizes(shard: bytes) -> dict[str, int]:
    sizes: dict[str, int] = {}
    offset = _SHARD_RECORD
    while offset + _SHARD_RECORD <= len(shard):
        raw_hash = shard[offset : offset + 32]
        if raw_hash == b"\xff" * 32:
            break
        flags, count = struct.unpack_from("<II", shard, offset + 32)
        words = struct.unpack("<4Q", raw_hash)
        size = 0
        for index in range(count):
            entry = offset + _SHARD_RECORD * (index + 1)
            size += struct.unpack_from("<I", shard, entry + 36)[0]
        records = 1 + count
        if flags & _FLAG_VERIFICATION:
            records += count
        if flags & _FLAG_METADATA_EXT:
            records += 1
        sizes["".join(f"{word:016x}" for word in words)] = size
        offset += _SHARD_RECORD * records
    return sizes


class _Handler(BaseHTTPRequestHandler):
    standin: HfBucketStandin
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet test output
        return

    # -- plumbing -------------------------------------------------------------------

    def _send(
        self,
        status: int,
        body: Any = None,
        headers: dict[str, str] | None = None,
        content_type: str = "application/json",
    ) -> None:
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _error(self, status: int, code: str, message: str) -> None:
        self._send(status, {"error": message}, {"X-Error-Code": code, "X-Error-Message": message})

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _record_token(self) -> None:
        auth = self.headers.get("Authorization", "")
        if auth:
            with self.standin.lock:
                self.standin.tokens_seen.append(auth)

    def _bucket(self, bucket_id: str) -> _Bucket | None:
        bucket = self.standin.buckets.get(bucket_id)
        if bucket is None:
            self._error(404, "RepoNotFound", f"Bucket {bucket_id} not found")
        return bucket

    def _route(self) -> tuple[list[str], dict[str, list[str]]]:
        parts = urlsplit(self.path)
        segments = [unquote(s) for s in parts.path.split("/") if s]
        return segments, parse_qs(parts.query)

    # -- verbs ---------------------------------------------------------------------

    def do_GET(self) -> None:
        self._record_token()
        segments, query = self._route()
        if len(segments) >= 4 and segments[:2] == ["api", "buckets"]:
            bucket_id = f"{segments[2]}/{segments[3]}"
            rest = segments[4:]
            if not rest:
                self._info(bucket_id)
            elif rest[0] in ("xet-read-token", "xet-write-token"):
                self._xet_token(bucket_id)
            elif rest[0] == "tree":
                self._tree(bucket_id, "/".join(rest[1:]), query)
            else:
                self._error(404, "NotFound", f"no route {self.path}")
            return
        if len(segments) >= 5 and segments[0] == "buckets" and segments[3] == "resolve":
            self._resolve(f"{segments[1]}/{segments[2]}", "/".join(segments[4:]))
            return
        self._error(404, "NotFound", f"no route {self.path}")

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_POST(self) -> None:
        self._record_token()
        segments, _ = self._route()
        body = self._body()
        if len(segments) >= 4 and segments[:2] == ["api", "buckets"]:
            bucket_id = f"{segments[2]}/{segments[3]}"
            rest = segments[4:]
            if not rest:
                self._create(bucket_id, body)
            elif rest == ["batch"]:
                self._batch(bucket_id, body)
            elif rest == ["paths-info"]:
                self._paths_info(bucket_id, body)
            else:
                self._error(404, "NotFound", f"no route {self.path}")
            return
        self._error(404, "NotFound", f"no route {self.path}")

    # -- routes --------------------------------------------------------------------

    def _create(self, bucket_id: str, body: bytes) -> None:
        payload = json.loads(body or b"{}")
        with self.standin.lock:
            url = f"{self.standin.endpoint}/buckets/{bucket_id}"
            if bucket_id in self.standin.buckets:
                message = f"Bucket {bucket_id} already exists"
                self._send(409, {"error": message, "url": url}, {"X-Error-Message": message})
                return
            private = payload.get("visibility") == "private"
            self.standin.buckets[bucket_id] = _Bucket(private=private, created=_now_iso())
        self._send(200, {"url": url})

    def _info(self, bucket_id: str) -> None:
        with self.standin.lock:
            bucket = self._bucket(bucket_id)
            if bucket is None:
                return
            info = {
                "id": bucket_id,
                "private": bucket.private,
                "createdAt": bucket.created,
                "size": sum(entry.size for entry in bucket.files.values()),
                "totalFiles": len(bucket.files),
            }
        self._send(200, info)

    def _xet_token(self, bucket_id: str) -> None:
        with self.standin.lock:
            if self._bucket(bucket_id) is None:
                return
        expires = int(time.time()) + 3600
        token = "standin-xet-token"
        cas_url = self.standin.cas_url
        body = {"accessToken": token, "exp": expires, "casUrl": cas_url}
        headers = {
            "X-Xet-Cas-Url": cas_url,
            "X-Xet-Access-Token": token,
            "X-Xet-Token-Expiration": str(expires),
        }
        self._send(200, body, headers)

    def _file_json(self, path: str, entry: _Entry) -> dict[str, Any]:
        return {
            "type": "file",
            "path": path,
            "size": entry.size,
            "xetHash": entry.xet_hash,
            "mtime": _iso(datetime.fromtimestamp(entry.mtime_ms / 1000, UTC)),
            "uploadedAt": entry.uploaded,
        }

    def _tree(self, bucket_id: str, prefix: str, query: dict[str, list[str]]) -> None:
        recursive = query.get("recursive", ["false"])[0].lower() == "true"
        cursor = int(query.get("cursor", ["0"])[0])
        with self.standin.lock:
            bucket = self._bucket(bucket_id)
            if bucket is None:
                return
            items: list[dict[str, Any]] = []
            folders: set[str] = set()
            base = prefix.rstrip("/")
            for path in sorted(bucket.files):
                if base and not (path == base or path.startswith(base + "/")):
                    continue
                relative = path[len(base) + 1 :] if base else path
                if not recursive and "/" in relative:
                    folder = (base + "/" if base else "") + relative.split("/", 1)[0]
                    if folder not in folders:
                        folders.add(folder)
                        items.append({"type": "directory", "path": folder})
                    continue
                items.append(self._file_json(path, bucket.files[path]))
        page = items[cursor : cursor + self.standin.page_size]
        headers = {}
        if cursor + self.standin.page_size < len(items):
            base_path = urlsplit(self.path).path
            next_url = (
                f"{self.standin.endpoint}{base_path}?recursive={str(recursive).lower()}"
                f"&cursor={cursor + self.standin.page_size}"
            )
            headers["Link"] = f'<{next_url}>; rel="next"'
        self._send(200, page, headers)

    def _paths_info(self, bucket_id: str, body: bytes) -> None:
        paths = json.loads(body or b"{}").get("paths", [])
        with self.standin.lock:
            bucket = self._bucket(bucket_id)
            if bucket is None:
                return
            found = [self._file_json(p, bucket.files[p]) for p in paths if p in bucket.files]
        self._send(200, found)

    def _batch(self, bucket_id: str, body: bytes) -> None:
        failed: list[dict[str, str]] = []
        with self.standin.lock:
            bucket = self._bucket(bucket_id)
            if bucket is None:
                return
            for line in body.splitlines():
                if not line.strip():
                    continue
                op = json.loads(line)
                path = op.get("path", "")
                if op["type"] in ("addFile", "copyFile"):
                    size = self._xet_file_size(op["xetHash"])
                    if size is None:
                        failed.append({"path": path, "error": "unknown xet hash"})
                        continue
                    bucket.files[path] = _Entry(
                        xet_hash=op["xetHash"],
                        size=size,
                        mtime_ms=int(op.get("mtime") or time.time() * 1000),
                        uploaded=_now_iso(),
                    )
                elif op["type"] == "deleteFile":
                    bucket.files.pop(path, None)
                else:
                    failed.append({"path": path, "error": f"unknown operation {op['type']}"})
        self._send(
            422 if failed and len(failed) == len(body.splitlines()) else 200, {"failed": failed}
        )

    def _xet_file_size(self, xet_hash: str) -> int | None:
        return self.standin.xet_file_size(xet_hash)

    def _resolve(self, bucket_id: str, path: str) -> None:
        with self.standin.lock:
            bucket = self._bucket(bucket_id)
            if bucket is None:
                return
            entry = bucket.files.get(path)
        if entry is None:
            self._error(404, "EntryNotFound", f"{path} not found in bucket {bucket_id}")
            return
        refresh = f"{self.standin.endpoint}/api/buckets/{bucket_id}/xet-read-token"
        headers = {
            "X-Xet-Hash": entry.xet_hash,
            "X-Xet-Refresh-Route": refresh,
            "X-Linked-Size": str(entry.size),
            "ETag": f'"{entry.xet_hash}"',
            "Location": f"{self.standin.endpoint}/buckets/{bucket_id}/xet/{quote(path)}",
        }
        self._send(200, None, headers)
