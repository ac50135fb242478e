"""`deltasync watch DIR`: emit once per new complete checkpoint in a folder."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

from pipeline.errors import ChainError, DeltasyncError
from pipeline.format.checkpoints.checkpoint import CheckpointReader
from pipeline.logs import get_logger
from workers.runtime import Runtime
from workers.trainers.trainer import Emitter

log = get_logger(__name__)

_STEP = re.compile(r"(\d+)(?:\.safetensors)?$")


def step_of(path: Path) -> int | None:
    """The step a checkpoint's name ends with (step-120, model-120.safetensors)."""
    if path.name.startswith("."):
        return None  # temporary files of writers that rename into place
    match = _STEP.search(path.name)
    return int(match.group(1)) if match else None


def _fingerprint(path: Path) -> tuple[tuple[str, int, int], ...]:
    files = sorted(path.rglob("*")) if path.is_dir() else [path]
    return tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file())


class CheckpointWatcher:
    """Decides when a candidate checkpoint is complete; emits each step once."""

    def __init__(self, emitter: Emitter, directory: Path, settle_s: float) -> None:
        self.emitter = emitter
        self.directory = directory
        self.settle_s = settle_s
        self.emitted: set[int] = set()
        self._seen: dict[Path, tuple[tuple[tuple[str, int, int], ...], float]] = {}

    def scan(self) -> list[int]:
        """Emit every checkpoint that is complete and has not changed for settle_s."""
        done: list[int] = []
        now = time.monotonic()
        for path in sorted(self.directory.iterdir()):
            step = step_of(path)
            if step is None or step in self.emitted:
                continue
            try:
                fingerprint = _fingerprint(path)
            except FileNotFoundError:
                continue
            previous = self._seen.get(path)
            if previous is None or previous[0] != fingerprint:
                self._seen[path] = (fingerprint, now)
                continue
            if now - previous[1] < self.settle_s:
                continue
            try:
                CheckpointReader(path)
            except DeltasyncError as exc:
                log.debug("checkpoint not complete yet", path=str(path), reason=str(exc))
                continue
            try:
                self.emitter.emit_checkpoint(step, path)
            except ChainError as exc:
                log.warning("checkpoint skipped", path=str(path), reason=str(exc))
            self.emitted.add(step)
            done.append(step)
        return done


def watch_directory(
    runtime: Runtime,
    directory: Path,
    run: str,
    *,
    settle_s: float = 2.0,
    stop: threading.Event | None = None,
) -> None:
    """Watch with watchfiles; rescan on every change and on a timer (for settling)."""
    from watchfiles import watch

    watcher = CheckpointWatcher(Emitter(run, settings=runtime.settings), directory, settle_s)
    log.info("watching for checkpoints", directory=str(directory), run=run)
    watcher.scan()
    stop_event = stop or threading.Event()
    tick_ms = max(int(settle_s * 500), 100)
    for _changes in watch(
        directory,
        stop_event=stop_event,
        rust_timeout=tick_ms,
        yield_on_timeout=True,
        recursive=True,
    ):
        for step in watcher.scan():
            log.info("checkpoint emitted", step=step)
