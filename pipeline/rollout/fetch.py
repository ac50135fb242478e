"""Downloads for the rollout node: a delta's objects whole, an anchor's tensors
part by part, each checked before it is handed over, with a progress bar for
large ones on a terminal and progress log lines elsewhere."""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import structlog
import torch
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from pipeline.codec.anchor import anchor_tensors
from pipeline.errors import CorruptObjectError
from pipeline.format.hashes import content_hashes
from pipeline.format.manifest import Manifest, ObjectEntry
from pipeline.logs import Throttle
from pipeline.store.base import ObjectStore
from pipeline.targets.pieced import AnchorPiece, anchor_pieces
from pipeline.testing import faults
from pipeline.versions import chain

log = structlog.get_logger(__name__)

_PROGRESS_MIN_BYTES = 64 << 20  # show progress for downloads larger than this

# Runs a download now or in the background; the result comes as a future.
Submit = Callable[..., Future[Any]]


@dataclass(frozen=True)
class Fetched:
    """A version's objects, downloaded and checked (size and sha256)."""

    manifest: Manifest
    objects: dict[str, bytes]
    fetch_s: float


@contextlib.contextmanager
def progress_bar(enabled: bool, label: str, total: int) -> Iterator[Callable[[int], None]]:
    """A bar on a terminal (``enabled``), else log lines (``logs.PROGRESS_EVERY_S``);
    nothing for small downloads. Yields ``advance(bytes)``."""
    if total < _PROGRESS_MIN_BYTES:
        yield lambda _n: None
        return
    if not enabled:
        yield _progress_lines(label, total)
        return
    columns = (TextColumn(label), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    with Progress(*columns, transient=True) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)


def _progress_lines(label: str, total: int) -> Callable[[int], None]:
    throttle = Throttle()
    done = 0

    def advance(n: int) -> None:
        nonlocal done
        done += n
        if throttle.due():
            log.info(
                "download progress",
                what=label,
                mb=round(done / 1e6, 1),
                of_mb=round(total / 1e6, 1),
                mb_per_s=round(done / 1e6 / max(throttle.elapsed, 1e-9), 1),
            )

    return advance


def fetch_delta(
    store: ObjectStore,
    manifest: Manifest,
    progress: bool,
    have: Callable[[int, str, str], bytes | None] | None = None,
) -> Fetched:
    """Every object of ``manifest``, checked; ``have(version, key, sha256)`` may hand
    over bytes already fetched (and checked against that sha256) instead."""
    started = time.perf_counter()
    objects: dict[str, bytes] = {}
    total = sum(e.size for e in manifest.objects)
    with progress_bar(progress, f"delta v{manifest.version}", total) as advance:
        for entry in manifest.objects:
            held = None if have is None else have(manifest.version, entry.key, entry.sha256)
            if held is None or len(held) != entry.size:
                held = chain.fetch_object(store, manifest, entry)
                faults.point("rollout.mid_fetch")
            objects[entry.key] = held
            advance(entry.size)
    return Fetched(manifest, objects, time.perf_counter() - started)


def _anchor_objects(
    store: ObjectStore, manifest: Manifest, submit: Submit, ahead: int, progress: bool
) -> Iterator[tuple[ObjectEntry, bytes]]:
    """The anchor's objects in order, checked (up to ``ahead`` download meanwhile)."""
    entries = list(manifest.objects)
    total = sum(e.size for e in entries)
    with progress_bar(progress, f"anchor v{manifest.version}", total) as advance:
        pending = deque(submit(chain.fetch_object, store, manifest, e) for e in entries[:ahead])
        for i, entry in enumerate(entries):
            data = pending.popleft().result()
            nxt = i + len(pending) + 1
            if nxt < len(entries):
                pending.append(submit(chain.fetch_object, store, manifest, entries[nxt]))
            advance(entry.size)
            yield entry, data


def stream_anchor(
    store: ObjectStore, manifest: Manifest, submit: Submit, ahead: int, progress: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """The anchor's tensors, part by part (up to ``ahead`` parts download meanwhile),
    each checked against the manifest's content hash before it is handed over."""
    expected = {t.name: t.hash for t in manifest.tensors}
    shapes = {t.name: (t.dtype, t.shape) for t in manifest.tensors}
    algorithm = content_hashes.of(manifest)
    for entry, data in _anchor_objects(store, manifest, submit, ahead, progress):
        for name, tensor in anchor_tensors(data, entry.key, shapes):
            want = expected.get(name)
            if want is None:
                raise CorruptObjectError(
                    f"object {entry.key} of anchor v{manifest.version} holds tensor "
                    f"{name!r} that the manifest does not list"
                )
            if algorithm.full(tensor) != want:
                raise CorruptObjectError(
                    f"tensor {name!r} of anchor v{manifest.version}: content hash "
                    "does not match the manifest"
                )
            yield name, tensor
            faults.point("rollout.mid_bootstrap")


def stream_anchor_pieces(
    store: ObjectStore, manifest: Manifest, submit: Submit, ahead: int, progress: bool
) -> Iterator[AnchorPiece]:
    """A pieced anchor's pieces (a sharded run), object by object as
    :func:`stream_anchor` downloads them, each checked against its piece hash."""
    for entry, data in _anchor_objects(store, manifest, submit, ahead, progress):
        for piece in anchor_pieces(data, manifest, entry.key):
            yield piece
            faults.point("rollout.mid_bootstrap")
