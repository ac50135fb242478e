"""The diff worker's state cache: the last published version on local disk.

One safetensors file per part, memory-mapped for the next diff; trusted only
when its recorded version and state hash equal the head's. With linking on, the
cache holds hard links to the trainer's own checkpoint files instead of a copy;
their (inode, size, mtime) is recorded and checked before every use, and files
shared with anyone else are never written in place.

Every write (rebuild, advance, adopt, link) holds ``<run>/.lock`` exclusively; the
diff worker's background scrub (:mod:`pipeline.publish.caches.cache_scrub`) hashes one
tensor at a time under the shared lock and judges only a state that did not switch
meanwhile (``switched`` in the state file names each switch), so a version being
written is never reported as damaged.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import json
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar, cast

import structlog
import torch

from pipeline import config
from pipeline.errors import ChainError, ConfigError, CorruptObjectError, LockError, MismatchError
from pipeline.format.checkpoints.checkpoint import INDEX_NAME, CheckpointReader
from pipeline.format.checkpoints.checkpoint_write import write_sharded
from pipeline.format.hashes import content_hashes
from pipeline.format.manifest import Manifest, check_run
from pipeline.format.matching import check_tensors
from pipeline.store.base import ObjectStore
from pipeline.versions import chain

log = structlog.get_logger(__name__)

_F = TypeVar("_F", bound=Callable[..., Any])
_held = threading.local()  # per thread: lock files this thread holds exclusively


class CacheBusyError(ChainError):
    """The state cache is being written right now (a scrub tries again later)."""


@contextlib.contextmanager
def flock(path: Path, exclusive: bool, wait: bool = True) -> Iterator[None]:
    """``flock`` on ``path``: held per open file, so threads of one process exclude
    each other like processes do. A thread holding it exclusively enters again freely."""
    held: set[Path] = _held.__dict__.setdefault("paths", set())
    if path in held:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _take(fd, path, exclusive, config.CACHE_LOCK_WAIT_S if wait else 0.0)
        if exclusive:
            held.add(path)
        try:
            yield
        finally:
            held.discard(path)
    finally:
        os.close(fd)  # releases the lock


def _take(fd: int, path: Path, exclusive: bool, wait_s: float) -> None:
    """flock ``fd``, polling for up to ``wait_s``: CacheBusyError at once without a wait,
    LockError (transient: the job is retried) once the wait is over. Every write holds
    it for one version and a scrub for one tensor, so a long wait means a holder that
    never lets go; it is logged while it lasts."""
    flags = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
    started = time.monotonic()
    delay, logged = 0.005, started
    while True:
        try:
            fcntl.flock(fd, flags)
            return
        except BlockingIOError:
            if wait_s <= 0:
                raise CacheBusyError(f"state cache lock {path} is held") from None
        waited = time.monotonic() - started
        if waited >= wait_s:
            raise LockError(
                f"state cache lock {path} still held by another process after {waited:.0f} s"
            )
        if time.monotonic() - logged >= config.CACHE_LOCK_LOG_S:
            logged = time.monotonic()
            log.warning("waiting for the state cache lock", lock=str(path), waited_s=round(waited))
        time.sleep(min(delay, wait_s - waited))
        delay = min(delay * 2, 0.05)  # a scrub's tensor is short: no long sleeps past it


class CacheFolder:
    """What a state cache and a rank cache share: under ``root``, one folder per version
    and the state file naming the one held, written under the exclusive lock."""

    STATE = "state.json"
    LOCK = ".lock"  # exclusive while the cache is written, shared while a scrub hashes
    root: Path

    def _state(self) -> dict[str, Any] | None:
        raise NotImplementedError

    @property
    def version(self) -> int | None:
        state = self._state()
        return None if state is None else int(state["version"])

    def _write_state(self, doc: dict[str, Any]) -> None:
        tmp = self.root / f".{self.STATE}.tmp"
        tmp.write_text(json.dumps(doc, sort_keys=True) + "\n")
        os.replace(tmp, self.root / self.STATE)

    def _folder_for(self, version: int, clear: bool = False) -> Path:
        """The folder of ``version``; ``clear``: without what a crashed rewrite left there."""
        self.root.mkdir(parents=True, exist_ok=True)
        folder = self.root / f"v{version:010d}"
        if clear and folder.exists():
            shutil.rmtree(folder)
        return folder

    # -- scrubbing (pipeline/publish/caches/cache_scrub.py) ---------------------------------

    def current(self) -> dict[str, Any] | None:
        """The state file's record (version, state hash, folder, proven, switched), or
        None when the cache holds no version."""
        return self._state()

    def scrub_lock(self) -> contextlib.AbstractContextManager[None]:
        """The shared lock a scrub holds while it hashes one tensor (every write holds
        it exclusively); CacheBusyError at once while the cache is being written."""
        return flock(self.root / self.LOCK, exclusive=False, wait=False)

    def mark_damaged(self, switched: str) -> bool:
        """Forget the state switched to as ``switched`` (a tensor failed its scrub): the
        next step rebuilds the cache from the store. False, with nothing changed, when
        the cache has switched since (what was hashed is not what it holds now)."""
        with flock(self.root / self.LOCK, exclusive=True):
            state = self._state()
            if state is None or state.get("switched") != switched:
                return False
            (self.root / self.STATE).unlink(missing_ok=True)
            return True


def _exclusive(method: _F) -> _F:
    """Run a method that writes the cache under its exclusive lock: a scrub hashes a
    tensor only under the shared lock, so it never sees a version half written."""

    @functools.wraps(method)
    def locked(self: StateCache, *args: Any, **kwargs: Any) -> Any:
        with flock(self.root / self.LOCK, exclusive=True):
            return method(self, *args, **kwargs)

    return cast(_F, locked)


def _remove_in_background(folders: list[Path]) -> None:
    """Delete ``folders`` on a thread at the lowest CPU priority: freeing a large
    version's pages takes a core for a while, and replicas applying the version just
    announced should not wait for it."""

    def remove() -> None:
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)

    threading.Thread(target=remove, name="deltasync-cache-cleanup", daemon=True).start()


def _fingerprint(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


def read_state_file(path: Path, run: str) -> dict[str, Any] | None:
    """A cache's ``state.json`` (state cache or rank cache), or None when it is missing,
    unreadable, of another run, or lacks a version, a state hash or a plain folder name."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if (
        not isinstance(doc, dict)
        or doc.get("run") != run
        or not isinstance(doc.get("version"), int)
        or not isinstance(doc.get("state_hash"), str)
        or not isinstance(doc.get("folder"), str)
        or "/" in doc["folder"]
    ):
        return None
    return doc


# Bytes a copy between files moves per call (bounded: the fallback's buffer).
COPY_STEP = 64 << 20


def copy_range(
    source: int, source_offset: int, target: int, offset: int, size: int, where: object
) -> None:
    """``size`` bytes of file ``source`` from ``source_offset`` into file ``target`` at
    ``offset``: in the kernel where the file systems allow it, else through a bounded
    buffer. CorruptObjectError when ``source`` (named ``where``) ends first."""
    in_kernel = hasattr(os, "copy_file_range")
    while size:
        step = min(size, COPY_STEP)
        done = 0
        if in_kernel:
            try:
                done = os.copy_file_range(source, target, step, source_offset, offset)
            except OSError as exc:  # another file system, an old kernel
                if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                in_kernel = False
        if not in_kernel:
            data = os.pread(source, step, source_offset)
            view = memoryview(data)
            while view:
                written = os.pwrite(target, view, offset + len(data) - len(view))
                view = view[written:]
            done = len(data)
        if done == 0:
            raise CorruptObjectError(f"checkpoint {where}: a file ends before its header says")
        size, source_offset, offset = size - done, source_offset + done, offset + done


class StateCache(CacheFolder):
    """The diff worker's local copy of a run's last published version.

    ``<cache_dir>/<run>/state.json`` names the version, its state hash and the folder
    holding its tensors (one safetensors file per part, with an index). A new folder is
    written completely before ``state.json`` switches to it, so a crash leaves the old
    state valid.
    """

    LINKS_OFF = "links-off"  # written when a linked checkpoint was rewritten in place

    def __init__(self, cache_dir: str | os.PathLike[str], run: str) -> None:
        self.run = run
        self.root = Path(cache_dir) / check_run(run)

    def _state(self) -> dict[str, Any] | None:
        doc = read_state_file(self.root / self.STATE, self.run)
        if doc is None or not isinstance(doc.get("linked", {}), dict):
            return None
        return doc

    @property
    def folder(self) -> Path | None:
        state = self._state()
        return None if state is None else self.root / str(state["folder"])

    def reader(self) -> CheckpointReader:
        folder = self.folder
        if folder is None:
            raise ChainError(f"state cache {self.root} holds no version of run {self.run}")
        return CheckpointReader(folder)

    def is_valid_for(self, manifest: Manifest) -> bool:
        """Does the cache hold exactly ``manifest``'s state (by version and state hash)?"""
        state = self._state()
        if (
            state is None
            or (state["version"], state["state_hash"]) != (manifest.version, manifest.state_hash)
            or not self._links_unchanged(state)
        ):
            return False
        try:
            with self.reader() as reader:
                check_tensors(
                    manifest, reader.specs(), holder=f"state cache {self.root}", complete=True
                )
        except (ChainError, MismatchError, CorruptObjectError):
            return False
        return True

    def linked_files_unchanged(self) -> bool:
        """False when a file the cache links to was modified since it was linked (the
        trainer rewrote its checkpoint in place); linking is then turned off for the run."""
        state = self._state()
        return state is None or self._links_unchanged(state)

    def _links_unchanged(self, state: dict[str, Any]) -> bool:
        """False (and linking turned off) when a linked file's fingerprint differs from
        the recorded one."""
        folder = self.root / str(state["folder"])
        for name, recorded in state.get("linked", {}).items():
            try:
                unchanged = _fingerprint(folder / str(name)) == recorded
            except (OSError, TypeError):
                unchanged = False
            if not unchanged:
                self._links_off(str(name))
                return False
        return True

    def _links_off(self, name: str) -> None:
        marker = self.root / self.LINKS_OFF
        if marker.exists():
            return
        log.warning(
            "a checkpoint linked into the state cache was modified after it was published; "
            "rebuilding the cache, and copying instead of linking from now on for this run "
            "(write each step's checkpoint to a new path to keep linking)",
            run=self.run,
            file=name,
        )
        marker.touch()

    def is_proven_for(self, manifest: Manifest) -> bool:
        """:meth:`is_valid_for`, and the cached bytes were proven by a full hash (a
        rebuild, a rewrite, an adopted anchor) or follow from a proven state by a
        published delta whose checkpoint deltasync owned (adopted): its encoding
        compared every element with the proven base. A diff against a proven base
        need not hash it again.

        An advanced or linked cache is not proven when it switches (the trainer's file
        could have changed after it was published); the diff worker's scrub gives it
        its one full proof off the critical path: a pass that hashes every tensor of
        that very state and matches marks it proven (:meth:`mark_proven`). Until then
        each diff hashes its base as it reads it."""
        state = self._state()
        return state is not None and state.get("proven") is True and self.is_valid_for(manifest)

    def _switch(
        self,
        folder: Path,
        manifest: Manifest,
        linked: dict[str, list[int]] | None = None,
        proven: bool = False,
    ) -> None:
        doc: dict[str, Any] = {
            "run": self.run,
            "version": manifest.version,
            "state_hash": manifest.state_hash,
            "folder": folder.name,
            "proven": proven,
            "switched": uuid.uuid4().hex,  # tells each switch apart, even to the same version
        }
        if linked:
            doc["linked"] = linked
        self._write_state(doc)
        # Out of the way at once (a rename), deleted later; a dead process's leftovers
        # in the trash are taken along by the next switch.
        trash = self.root.parent / ".trash"
        trash.mkdir(exist_ok=True)
        doomed = [p for p in trash.glob(f"{self.run}.*") if p.is_dir()]
        for other in self.root.iterdir():
            if other.is_dir() and other.name != folder.name:
                moved = trash / f"{self.run}.{other.name}.{uuid.uuid4().hex[:12]}"
                try:
                    os.replace(other, moved)
                    doomed.append(moved)
                except OSError:
                    shutil.rmtree(other, ignore_errors=True)
        if doomed:
            _remove_in_background(doomed)

    @_exclusive
    def rebuild(self, store: ObjectStore, run: str, version: int) -> Manifest:
        """Rebuild ``version`` from the store (anchor + chain) into the cache."""
        if run != self.run:
            raise ConfigError(f"state cache {self.root} is for run {self.run}, not {run}")
        folder = self._folder_for(version)
        manifest = chain.across_compaction(
            store,
            run,
            version,
            lambda: chain.reconstruct(store, run, version, folder, by_part=True, overwrite=True),
        )
        self._switch(folder, manifest, proven=True)  # every tensor hashed on the way
        log.info("state cache rebuilt", run=run, version=version)
        return manifest

    @_exclusive
    def advance(self, new: CheckpointReader, manifest: Manifest) -> None:
        """Make the cache hold ``new`` as ``manifest``'s version, checking every hash.

        When the cache holds the same tensors (names, dtypes, shapes), their bytes are
        overwritten in place in the cached files: no new files and no fsync. The state
        file is removed first, so a crash midway leaves a cache that is rebuilt, never
        trusted; bytes that differ from the manifest (the checkpoint changed while it
        was published, or a write was lost) are caught by the base-hash check of the
        next diff, which rebuilds the cache from the store.
        """
        folder = self.folder
        if folder is not None and folder.is_dir():
            try:
                self._advance_in_place(folder, new, manifest)
                return
            except (ChainError, CorruptObjectError) as e:
                log.info("state cache cannot be updated in place, rewriting", error=str(e))
        self._rewrite(new, manifest)

    @_exclusive
    def adopt(self, checkpoint: Path, manifest: Manifest, proven: bool = False) -> bool:
        """Move ``checkpoint`` (a file or folder holding exactly ``manifest``'s state,
        owned by deltasync) into the cache as that version: a rename, no copy. False,
        with nothing changed, when it cannot be renamed here (another file system).
        ``proven``: it was just published as a delta from a proven base."""
        if not checkpoint.exists():
            return False
        # Until the switch, the state file still names the parent's untouched folder.
        folder = self._folder_for(manifest.version, clear=True)
        try:
            if checkpoint.is_dir():
                os.rename(checkpoint, folder)
            else:
                folder.mkdir()
                os.rename(checkpoint, folder / "model.safetensors")
        except OSError as e:
            log.info("checkpoint cannot be moved into the state cache, copying", error=str(e))
            shutil.rmtree(folder, ignore_errors=True)
            return False
        # Unless ``proven``, the next diff checks its base hashes.
        self._switch(folder, manifest, proven=proven)
        return True

    @_exclusive
    def link(self, checkpoint: Path, manifest: Manifest) -> bool:
        """Hard-link the files of ``checkpoint`` (the trainer's own, holding exactly
        ``manifest``'s state) into the cache as that version: no byte is copied. False,
        with nothing changed, when linking is off for this run or not possible here
        (another file system)."""
        if (self.root / self.LINKS_OFF).exists():
            return False
        with CheckpointReader(checkpoint) as reader:
            files = {reader.location(n)[0] for n in reader.names()}
        if (checkpoint / INDEX_NAME).is_file():
            files.add(checkpoint / INDEX_NAME)
        folder = self._folder_for(manifest.version, clear=True)
        linked: dict[str, list[int]] = {}
        try:
            folder.mkdir()
            for source in sorted(files):
                name = source.name if checkpoint.is_dir() else "model.safetensors"
                os.link(source, folder / name)
                linked[name] = _fingerprint(folder / name)
        except OSError as e:
            log.info("checkpoint cannot be linked into the state cache, copying", error=str(e))
            shutil.rmtree(folder, ignore_errors=True)
            return False
        self._switch(folder, manifest, linked)
        return True

    def _advance_in_place(self, folder: Path, new: CheckpointReader, manifest: Manifest) -> None:
        with CheckpointReader(folder) as cached:
            specs = cached.specs()
            if specs != new.specs() or set(specs) != {t.name for t in manifest.tensors}:
                raise ChainError(f"state cache {self.root} holds other tensors than {new.path}")
            locations = {n: cached.location(n) for n in specs}
        if any(path.stat().st_nlink > 1 for path, _, _ in locations.values()):
            # Linked from a trainer's checkpoint: writing here would change the trainer's file.
            raise ChainError(f"state cache {self.root} shares its files with a checkpoint")
        (self.root / self.STATE).unlink(missing_ok=True)
        # The manifest's hashes were taken from ``new`` while publishing, and every diff
        # checks its base's hashes before use (a mismatch rebuilds the cache), so the
        # bytes are written here without a second hash pass: one page-cache copy, file
        # to file, nothing mapped (a mapping per tensor cost a parse of the file's
        # header per tensor: 0.4 s a version at 785 tensors).
        fds: dict[Path, int] = {}
        try:
            for entry in manifest.tensors:
                path, offset, size = locations[entry.name]
                source, source_offset, source_size = new.location(entry.name)
                if source_size != size:
                    raise ChainError(
                        f"state cache {self.root}: tensor {entry.name!r} is {size} bytes, "
                        f"{source_size} in {new.path}"
                    )
                if size == 0:
                    continue
                for file, flags in ((path, os.O_WRONLY), (source, os.O_RDONLY)):
                    if file not in fds:
                        fds[file] = os.open(file, flags)
                copy_range(fds[source], source_offset, fds[path], offset, size, new.path)
        finally:
            for fd in fds.values():
                os.close(fd)
        renamed = self._folder_for(manifest.version)
        if renamed != folder:
            os.replace(folder, self._folder_for(manifest.version, clear=True))
        self._switch(renamed, manifest)

    def _rewrite(self, new: CheckpointReader, manifest: Manifest) -> None:
        entries = {t.name: t for t in manifest.tensors}
        algorithm = content_hashes.of(manifest)

        def part(names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
            for n in names:
                t = new.get(n)
                if algorithm.full(t) != entries[n].hash:
                    raise MismatchError(
                        f"tensor {n!r} in {new.path} does not match version {manifest.version}"
                    )
                yield n, t
            new.close()  # unmap the part's pages once it is read

        folder = self._folder_for(manifest.version)
        write_sharded(
            folder, ((key, part(names)) for key, names in manifest.parts()), overwrite=True
        )
        self._switch(folder, manifest, proven=True)  # every tensor hashed

    # -- scrubbing (pipeline/publish/caches/cache_scrub.py) ---------------------------------

    def still_holds_state(self) -> bool:
        """Asked by a diff before its manifest: the state file still names a version (a
        scrub that found a tensor damaged removed it) and no linked file changed."""
        state = self._state()
        return state is not None and self._links_unchanged(state)

    @_exclusive
    def mark_proven(self, switched: str) -> bool:
        """Record that every tensor of the state switched to as ``switched`` was hashed
        in full and matched (a scrub pass): later diffs need not hash their base.
        False, with nothing changed, when the cache has switched since."""
        state = self._state()
        if state is None or state.get("switched") != switched:
            return False
        if state.get("proven") is not True:
            self._write_state({**state, "proven": True})
        return True
