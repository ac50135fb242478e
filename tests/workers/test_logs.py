"""Logging: JSON lines off a terminal, console on one, stdlib records routed alike."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from pipeline import logs
from pipeline.errors import ConfigError
from pipeline.logs import bind_context, clear_context, configure_logging, get_logger
from pipeline.publish.uploads import PublishTimings, Uploader
from pipeline.rollout import fetch as rollout_fetch
from pipeline.store.file import FileStore
from pipeline.versions import chain
from tests.publish.test_chain import SyntheticRun


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        clear_context()
        root.handlers[:] = handlers
        root.setLevel(level)
        structlog.reset_defaults()


def lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_lines_when_not_a_terminal() -> None:
    out = io.StringIO()
    configure_logging("info", stream=out)
    bind_context(run="run-1", version=7, job_id="job-9")
    get_logger("pipeline.test").info("delta published", bytes=123)
    logging.getLogger("rq.worker").warning("job %s finished", "job-9")
    get_logger("pipeline.test").debug("not shown at info")
    logging.getLogger("rq.worker").debug("nor this")

    records = lines(out)
    assert len(records) == 2
    ours, theirs = records
    assert ours["event"] == "delta published"
    assert ours["bytes"] == 123
    assert ours["level"] == "info"
    assert ours["logger"] == "pipeline.test"
    assert theirs["event"] == "job job-9 finished"
    assert theirs["level"] == "warning"
    assert theirs["logger"] == "rq.worker"
    for record in records:  # the same processors for both
        assert (record["run"], record["version"], record["job_id"]) == ("run-1", 7, "job-9")
        assert record["timestamp"].endswith("Z")

    clear_context()
    get_logger("pipeline.test").info("after clear")
    assert "run" not in lines(out)[-1]


def test_chatty_library_info_shows_only_at_debug() -> None:
    for level, shown in (("info", ["warned"]), ("debug", ["credentials found", "warned"])):
        out = io.StringIO()
        configure_logging(level, json=True, stream=out)
        logging.getLogger("botocore.credentials").info("credentials found")
        logging.getLogger("botocore.credentials").warning("warned")
        assert [r["event"] for r in lines(out)] == shown, level


def test_exceptions_render_as_data_without_locals() -> None:
    out = io.StringIO()
    configure_logging("info", json=True, stream=out)
    secret_local = "hunter2"
    try:
        raise ValueError(f"bad {len(secret_local)}")
    except ValueError:
        get_logger("x").exception("failed")
    (record,) = lines(out)
    assert record["exception"][0]["exc_type"] == "ValueError"
    assert "hunter2" not in out.getvalue()


def test_console_on_a_terminal_and_when_forced() -> None:
    tty = FakeTerminal()
    configure_logging("debug", stream=tty)
    get_logger("x").debug("hello console", answer=42)
    text = tty.getvalue()
    assert "hello console" in text and "answer" in text
    with pytest.raises(json.JSONDecodeError):
        json.loads(text.splitlines()[0])

    forced = io.StringIO()
    configure_logging("info", json=False, stream=forced)
    get_logger("x").info("plain text")
    assert "plain text" in forced.getvalue()
    assert not forced.getvalue().lstrip().startswith("{")

    forced_json = FakeTerminal()
    configure_logging("info", json=True, stream=forced_json)
    get_logger("x").info("json on a terminal")
    assert lines(forced_json)[0]["event"] == "json on a terminal"


def test_reconfiguring_replaces_the_handler() -> None:
    first, second = io.StringIO(), io.StringIO()
    configure_logging("info", stream=first)
    logger = get_logger("x")  # made before the second configuration
    configure_logging("warning", stream=second)
    logger.info("dropped at warning")
    logger.warning("once")
    logging.getLogger("other").error("stdlib once")
    assert first.getvalue() == ""
    assert [r["event"] for r in lines(second)] == ["once", "stdlib once"]


def test_bad_level_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="loud"):
        configure_logging("loud")


def test_a_long_publish_logs_its_upload_progress_with_the_callers_context(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(logs, "PROGRESS_EVERY_S", 0.0)
    out = io.StringIO()
    configure_logging("info", json=True, stream=out)
    bind_context(run="run-7", version=3)
    timings = PublishTimings()
    with Uploader(FileStore(tmp_path), "publish", timings) as uploader:
        for i in range(3):
            uploader.submit(f"run-7/part-{i}", bytes(1_000_000))
        uploader.finish()
    clear_context()
    progress = [r for r in lines(out) if r["event"] == "upload progress"]
    assert [(r["objects"], r["mb"], r["last"]) for r in progress] == [
        (1, 1.0, "run-7/part-0"),
        (2, 2.0, "run-7/part-1"),
        (3, 3.0, "run-7/part-2"),
    ]
    assert all((r["run"], r["version"]) == ("run-7", 3) for r in progress)
    assert FileStore(tmp_path).get("run-7/part-2") == bytes(1_000_000)

    monkeypatch.undo()  # the default interval: a short publish logs no progress
    quiet = io.StringIO()
    configure_logging("info", json=True, stream=quiet)
    with Uploader(FileStore(tmp_path), "publish", PublishTimings()) as uploader:
        uploader.submit("run-7/part-3", b"x")
        uploader.finish()
    assert not [r for r in lines(quiet) if r["event"] == "upload progress"]


def test_a_long_rebuild_logs_its_progress(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logs, "PROGRESS_EVERY_S", 0.0)
    store = FileStore(tmp_path / "store")
    trainer = SyntheticRun(tmp_path, store)
    for step in (0, 1):
        trainer.publish(step)
    out = io.StringIO()
    configure_logging("info", json=True, stream=out)
    parts = list(chain.reconstruct_parts(store, trainer.run, 1))
    progress = [r for r in lines(out) if r["event"] == "rebuild progress"]
    assert len(parts) >= 3
    assert [(r["parts_done"], r["parts"], r["version"]) for r in progress] == [
        (done, len(parts), 1) for done in range(len(parts))
    ]


def test_large_downloads_off_a_terminal_log_their_progress(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = io.StringIO()
    configure_logging("info", json=True, stream=out)
    monkeypatch.setattr(logs, "PROGRESS_EVERY_S", 0.0)
    with rollout_fetch.progress_bar(False, "anchor v4", 200_000_000) as advance:
        for _ in range(4):
            advance(50_000_000)
    with rollout_fetch.progress_bar(False, "delta v5", 1_000_000) as advance:
        advance(1_000_000)  # small: no lines
    progress = [r for r in lines(out) if r["event"] == "download progress"]
    assert [(r["what"], r["mb"], r["of_mb"]) for r in progress] == [
        ("anchor v4", mb, 200.0) for mb in (50.0, 100.0, 150.0, 200.0)
    ]
