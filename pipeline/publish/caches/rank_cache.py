"""A trainer host's cache of one rank's pieces: the base of that rank's parts.

In a sharded run each host diffs its ranks' parts against its own copy of what those
ranks held at the last published version: ``<cache_dir>/<run>/rank-<R:05d>/``, a
checkpoint folder of the rank's pieces (1-D tensors named by the tensors' names)
with ``state.json`` naming the version and its state hash. It advances by adopting
the rank's staging folder of the published step (a rename) when the manifest lists,
for every part of the rank, the object this host uploaded (recorded in ``uploaded/``
as it uploads); otherwise it is rebuilt from the store, each piece proven by its hash.
The diff worker's scrub (:mod:`pipeline.publish.caches.cache_scrub`) re-hashes its pieces in
the background under the same locks as a state cache's.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import structlog

from pipeline.errors import ChainError, CorruptObjectError, MismatchError
from pipeline.format.checkpoints.checkpoint import CheckpointReader
from pipeline.format.checkpoints.checkpoint_write import write_checkpoint
from pipeline.format.manifest import Manifest, check_run, dtype_name
from pipeline.publish.caches.state_cache import CacheFolder, flock, read_state_file
from pipeline.store.base import ObjectStore
from pipeline.versions import chain

log = structlog.get_logger(__name__)

WEIGHTS = "model.safetensors"


class RankCache(CacheFolder):
    """Rank ``rank``'s pieces of run ``run`` at its last published version, on this host."""

    def __init__(self, cache_dir: str | os.PathLike[str], run: str, rank: int) -> None:
        self.run, self.rank = run, rank
        self.root = Path(cache_dir) / check_run(run) / f"rank-{rank:05d}"

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The host's workers bring the cache up to date one at a time (and a scrub
        hashes nothing meanwhile)."""
        with flock(self.root / self.LOCK, exclusive=True):
            yield

    def _state(self) -> dict[str, Any] | None:
        doc = read_state_file(self.root / self.STATE, self.run)
        return None if doc is None or doc.get("rank") != self.rank else doc

    def reader(self) -> CheckpointReader:
        state = self._state()
        if state is None:
            raise ChainError(f"rank cache {self.root} holds no version of run {self.run}")
        return CheckpointReader(self.root / str(state["folder"]))

    def is_valid_for(self, manifest: Manifest, keys: Collection[str]) -> bool:
        """Does the cache hold this rank's pieces (parts ``keys``) of ``manifest``?"""
        state = self._state()
        if state is None or (state["version"], state["state_hash"]) != (
            manifest.version,
            manifest.state_hash,
        ):
            return False
        try:
            with self.reader() as reader:
                return _holds_pieces(reader, manifest, keys)
        except (ChainError, CorruptObjectError, MismatchError, OSError):
            return False

    def is_proven_for(self, manifest: Manifest, keys: Collection[str]) -> bool:
        """:meth:`is_valid_for`, and every piece proven: by a full hash (a rebuild) or by
        construction (an adoption, see :meth:`adopt`)."""
        state = self._state()
        return (
            state is not None and state.get("proven") is True and self.is_valid_for(manifest, keys)
        )

    # ------------------------------------------------------------ uploads of this host

    def _uploads(self, version: int) -> Path:
        return self.root / "uploaded" / f"{version:010d}"

    def record_upload(self, version: int, key: str, sha256: str) -> None:
        """This host uploaded object ``key`` of ``version`` with digest ``sha256``."""
        folder = self._uploads(version)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(sha256)
        os.replace(tmp, folder / key)

    def uploaded(self, version: int) -> dict[str, str]:
        folder = self._uploads(version)
        if not folder.is_dir():
            return {}
        return {p.name: p.read_text() for p in folder.iterdir() if not p.name.startswith(".")}

    # ------------------------------------------------------------ advancing

    def adopt(self, folder: Path, manifest: Manifest, keys: Collection[str]) -> bool:
        """Move the rank's staging ``folder`` of ``manifest``'s step into the cache (a
        rename), only when the manifest lists, for every part ``keys``, the object this
        host uploaded: the pieces it holds are those the published objects encode, and
        proven. False, with nothing changed, otherwise."""
        mine = self.uploaded(manifest.version)
        if not keys or any(mine.get(k) != manifest.object_entry(k).sha256 for k in keys):
            return False
        target = self._folder_for(manifest.version, clear=True)
        try:
            os.rename(folder, target)
        except OSError as e:
            log.info("staging folder cannot be moved into the rank cache", error=str(e))
            return False
        try:
            with CheckpointReader(target) as reader:
                held = _holds_pieces(reader, manifest, keys)
        except (ChainError, CorruptObjectError, MismatchError) as e:
            log.warning("adopted staging folder is not the rank's pieces", error=str(e))
            held = False
        if not held:
            shutil.rmtree(target, ignore_errors=True)
            return False
        # Proven by construction, as an unsharded cache adopting its staging copy: this
        # host recorded these objects only after their encoding had checked (or hashed)
        # its base against the parent's piece hashes and compared every element of this
        # folder with it, and the manifest's piece hashes come from that base and those
        # changes. A later change behind deltasync's back is the scrub's to find.
        self._switch(target, manifest, proven=True)
        return True

    def rebuild(self, store: ObjectStore, manifest: Manifest, keys: Collection[str]) -> None:
        """This rank's pieces of ``manifest``'s version from the store (anchor pieces and
        delta pieces), each proven by its piece hash."""
        target = self._folder_for(manifest.version)
        target.mkdir(exist_ok=True)

        def write() -> None:
            tensors = (
                item
                for _, part in chain.reconstruct_parts(store, self.run, manifest.version, only=keys)
                for item in part
            )
            write_checkpoint(target / WEIGHTS, tensors, overwrite=True)

        chain.across_compaction(store, self.run, manifest.version, write)
        self._switch(target, manifest, proven=True)
        log.info("rank cache rebuilt", run=self.run, rank=self.rank, version=manifest.version)

    def _switch(self, folder: Path, manifest: Manifest, proven: bool) -> None:
        doc = {
            "run": self.run,
            "rank": self.rank,
            "version": manifest.version,
            "state_hash": manifest.state_hash,
            "folder": folder.name,
            "proven": proven,
            "switched": uuid.uuid4().hex,  # tells each switch apart, even to the same version
        }
        self._write_state(doc)
        for other in self.root.iterdir():
            if other.is_dir() and other.name.startswith("v") and other != folder:
                shutil.rmtree(other, ignore_errors=True)
        uploads = self.root / "uploaded"
        if uploads.is_dir():
            for old in uploads.iterdir():
                if old.name.isdigit() and int(old.name) <= manifest.version:
                    shutil.rmtree(old, ignore_errors=True)

    # -- scrubbing (pipeline/publish/caches/cache_scrub.py) ---------------------------------

    def keys_of(self, manifest: Manifest) -> list[str]:
        """This rank's parts of ``manifest``."""
        prefix = f"part-r{self.rank:05d}-"
        return [key for key, _ in manifest.layout() if key.startswith(prefix)]

    def mark_proven(self, switched: str) -> bool:
        """Every piece of the state switched to as ``switched`` matched a scrub pass
        (rank caches are proven when switched to; kept for the scrub's one protocol)."""
        with flock(self.root / self.LOCK, exclusive=True):
            state = self._state()
            return state is not None and state.get("switched") == switched


def _holds_pieces(reader: CheckpointReader, manifest: Manifest, keys: Collection[str]) -> bool:
    specs = reader.specs()
    for key, held in manifest.layout():
        if key not in keys:
            continue
        for entry, piece in held:
            spec = specs.get(entry.name)
            if spec is None or (dtype_name(spec.dtype), spec.shape) != (
                entry.dtype,
                (piece.numel,),
            ):
                return False
    return True
