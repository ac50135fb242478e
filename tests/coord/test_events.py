"""Typed events on a real Redis stream: round trips, validation, following, trimming."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from structlog.testing import capture_logs

from pipeline.coord.connection import redis_client
from pipeline.coord.events import (
    EVENT_TYPES,
    MAX_EVENT_BYTES,
    AnchorAvailable,
    CompactionRequested,
    DeltaApplied,
    DeltaAvailable,
    DeltaPart,
    Event,
    JobRefused,
    ReplicaError,
    StepCompleted,
    StepFailed,
    check_run_name,
    parse_event,
)
from pipeline.coord.stream import ENTRY_FIELD, EventStream, list_runs, stream_key, wait_for
from pipeline.errors import ConfigError, EventError, ServiceUnavailableError
from tests.servers import free_port

RUN = "run-1"


def sample_events(run: str = RUN) -> list[Event]:
    return [
        StepCompleted.now(run=run, version=0, checkpoint="/staging/step-0", owned=True, level=3),
        StepCompleted(run=run, version=1, checkpoint="s3://b/ckpt", owned=False, level=None),
        StepFailed.now(run=run, version=3, reason="TypeError: not a path", checkpoint="?"),
        JobRefused.now(
            run=run,
            version=0,
            job_id="b1c2",
            queue="deltasync:diff",
            function="os.system",
            reason="function 'os.system' is not a deltasync job of queue deltasync:diff",
        ),
        DeltaAvailable.now(
            run=run,
            version=1,
            kind="delta",
            parent=0,
            anchor=0,
            bytes=1234,
            changed=17,
            total=1000,
            manifest=f"{run}/deltas/0000000001/manifest.json",
        ),
        DeltaAvailable.now(
            run=run,
            version=0,
            kind="anchor",
            parent=None,
            anchor=0,
            bytes=9,
            changed=0,
            total=1000,
            manifest=f"{run}/anchors/0000000000/manifest.json",
        ),
        AnchorAvailable.now(
            run=run, version=5, bytes=10, manifest="m.json", reason="chain of 20 deltas"
        ),
        CompactionRequested.now(run=run, version=5, reason="manual", requested_by="ops@host"),
        DeltaApplied.now(
            run=run,
            version=1,
            node="node-a",
            fetch_s=0.5,
            apply_s=0.25,
            pause_s=0.0,
            latency_s=1.75,
            state_hash="ab" * 16,
        ),
        DeltaApplied.now(run=run, version=2, node="node-b", fetch_s=1, apply_s=2, pause_s=3),
        ReplicaError.now(
            run=run, version=3, node="node-a", error="hash mismatch in w.0", recovering=True
        ),
        DeltaPart.now(
            run=run, version=4, parent=3, key="part-00002.safetensors", size=77, sha256="0f" * 32
        ),
    ]


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    return redis_client(redis_url)


def valid_doc() -> dict[str, Any]:
    return sample_events()[0].to_dict()


# --------------------------------------------------------------------------- parsing


@pytest.mark.parametrize("event", sample_events(), ids=lambda e: e.type)
def test_json_round_trip_of_every_type(event: Event) -> None:
    text = event.to_json()
    assert parse_event(text) == event
    assert parse_event(text.encode()) == event
    assert parse_event(json.loads(text)) == event
    doc = json.loads(text)
    assert doc["type"] == event.type
    assert doc["schema"] == 1
    assert doc["time"].endswith("Z")


def test_every_type_is_covered() -> None:
    assert {e.type for e in sample_events()} == set(EVENT_TYPES)


def test_ints_for_floats_become_floats() -> None:
    event = DeltaApplied.now(run=RUN, version=2, node="n", fetch_s=1, apply_s=2, pause_s=3)
    assert isinstance(event.fetch_s, float)
    assert parse_event(event.to_json()) == event


def test_unknown_extra_fields_are_ignored() -> None:
    doc = valid_doc()
    doc["added_in_a_later_release"] = {"x": [1, 2]}
    event = parse_event(doc)
    assert isinstance(event, StepCompleted)
    assert event.version == 0


def _with(**changes: Any) -> dict[str, Any]:
    doc = valid_doc()
    for key, value in changes.items():
        if value is _DROP:
            del doc[key]
        else:
            doc[key] = value
    return doc


_DROP = object()

BAD_DOCS: dict[str, Any] = {
    "missing field": _with(checkpoint=_DROP),
    "missing version": _with(version=_DROP),
    "missing type": _with(type=_DROP),
    "unknown type": _with(type="step-exploded"),
    "type not a string": _with(type=["step-completed"]),
    "schema 2": _with(schema=2),
    "schema as text": _with(schema="1"),
    "schema as bool": _with(schema=True),
    "missing schema": _with(schema=_DROP),
    "run with space": _with(run="my run"),
    "run with newline": _with(run="run\n"),
    "run starting with dot": _with(run=".hidden"),
    "run too long": _with(run="r" * 129),
    "run not a string": _with(run=7),
    "negative version": _with(version=-1),
    "version as text": _with(version="3"),
    "version as float": _with(version=3.0),
    "version as bool": _with(version=True),
    "owned as int": _with(owned=1),
    "level as text": _with(level="2"),
    "checkpoint as number": _with(checkpoint=5),
    "control character": _with(checkpoint="/tmp/a\x1b[31mred"),
    "delete character": _with(checkpoint="/tmp/a\x7f"),
    "naive time": _with(time="2025-01-01T00:00:00"),
    "bad time": _with(time="yesterday"),
    "not an object": [1, 2, 3],
}


def _part(**changes: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "type": "delta-part",
        "schema": 1,
        "run": RUN,
        "version": 4,
        "time": "2026-01-01T00:00:00Z",
        "parent": 3,
        "key": "part-00000.safetensors",
        "size": 10,
        "sha256": "ab" * 32,
    }
    doc.update(changes)
    return doc


BAD_DOCS.update(
    {
        "part: parent not before version": _part(parent=4),
        "part: key with a slash": _part(key="../part-00000.safetensors"),
        "part: empty key": _part(key=""),
        "part: negative size": _part(size=-1),
        "part: short sha256": _part(sha256="ab" * 31),
        "part: upper-case sha256": _part(sha256="AB" * 32),
    }
)


@pytest.mark.parametrize("doc", BAD_DOCS.values(), ids=list(BAD_DOCS))
def test_malformed_events_raise_one_line_event_errors(doc: Any) -> None:
    with pytest.raises(EventError) as info:
        parse_event(doc)
    assert "\n" not in str(info.value)
    with pytest.raises(EventError):
        parse_event(json.dumps(doc))


@pytest.mark.parametrize(
    "text",
    [b"{not json", b"\xff\xfe", "", json.dumps({**valid_doc(), "pad": "x" * MAX_EVENT_BYTES})],
    ids=["not json", "not utf-8", "empty", "oversized"],
)
def test_malformed_payloads_raise_event_errors(text: str | bytes) -> None:
    with pytest.raises(EventError):
        parse_event(text)


def test_type_specific_rules() -> None:
    base: dict[str, Any] = dict(
        run=RUN, version=1, kind="delta", parent=0, anchor=0, bytes=1, changed=1, total=1
    )
    with pytest.raises(EventError, match="changed > total"):
        DeltaAvailable.now(**{**base, "changed": 2}, manifest="m")
    with pytest.raises(EventError, match="kind"):
        DeltaAvailable.now(**{**base, "kind": "full"}, manifest="m")
    with pytest.raises(EventError, match="negative"):
        DeltaAvailable.now(**{**base, "bytes": -1}, manifest="m")
    with pytest.raises(EventError, match="negative"):
        DeltaApplied.now(run=RUN, version=1, node="n", fetch_s=-1.0, apply_s=0, pause_s=0)
    with pytest.raises(EventError, match="finite"):
        DeltaApplied.now(run=RUN, version=1, node="n", fetch_s=float("nan"), apply_s=0, pause_s=0)
    with pytest.raises(EventError, match="run name"):
        StepCompleted.now(run="a/b", version=1, checkpoint="x", owned=False)


def test_check_run_name() -> None:
    assert check_run_name("Run_1.a-b") == "Run_1.a-b"
    for bad in ["", "-a", "a b", "a/b", "a\n", "x" * 129]:
        with pytest.raises(ConfigError):
            check_run_name(bad)
    assert stream_key("r") == "deltasync:run:r:events"


# --------------------------------------------------------------------------- the stream


def test_publish_read_round_trip_on_redis(client: redis.Redis) -> None:
    stream = EventStream(client, RUN)
    events = sample_events()
    ids = [stream.publish(event) for event in events]
    assert len(set(ids)) == len(ids)
    entries = stream.read()
    assert [entry_id for entry_id, _ in entries] == ids
    assert [event for _, event in entries] == events
    assert stream.last_id() == ids[-1]
    assert stream.first_id() == ids[0]
    assert stream.read(after_id=ids[-1]) == []
    assert [e for _, e in stream.read(after_id=ids[2], count=2)] == events[3:5]


def test_publish_in_a_callers_transaction(client: redis.Redis) -> None:
    stream = EventStream(client, RUN)
    event = sample_events()[0]
    with client.pipeline(transaction=True) as pipe:
        assert stream.publish(event, pipeline=pipe) is None
        pipe.set("other-key", 1)
        results = pipe.execute()
    event_id = results[0].decode()
    assert stream.read() == [(event_id, event)]
    assert client.get("other-key") == b"1"


def test_publish_refuses_wrong_run_and_oversized_events(client: redis.Redis) -> None:
    stream = EventStream(client, RUN)
    with pytest.raises(EventError, match="other"):
        stream.publish(sample_events("other")[0])
    huge = StepCompleted.now(run=RUN, version=1, checkpoint="x" * MAX_EVENT_BYTES, owned=False)
    with pytest.raises(EventError, match="exceeds"):
        stream.publish(huge)
    assert stream.length() == 0


def test_runs_are_listed(client: redis.Redis) -> None:
    assert list_runs(client) == []
    EventStream(client, "zeta").publish(sample_events("zeta")[0])
    EventStream(client, "alpha").publish(sample_events("alpha")[0])
    EventStream(client, "alpha").publish(sample_events("alpha")[1])
    assert list_runs(client) == ["alpha", "zeta"]


def test_read_skips_malformed_entries_with_a_log(client: redis.Redis) -> None:
    stream = EventStream(client, RUN)
    good = sample_events()
    bad_payloads: list[dict[str, str | bytes]] = [
        {ENTRY_FIELD: "{not json"},
        {ENTRY_FIELD: json.dumps({**valid_doc(), "type": "step-exploded"})},
        {ENTRY_FIELD: json.dumps({**valid_doc(), "schema": 99})},
        {ENTRY_FIELD: json.dumps({**valid_doc(), "run": "bad run"})},
        {ENTRY_FIELD: json.dumps({**valid_doc(), "pad": "x" * MAX_EVENT_BYTES})},
        {ENTRY_FIELD: json.dumps({**valid_doc(), "checkpoint": "a\u0000b"})},
        {ENTRY_FIELD: json.dumps({**valid_doc(), "run": "another-run"})},
        {ENTRY_FIELD: b"\xff\xfe\x00"},
        {"something-else": "1"},
    ]
    expected: list[tuple[str, Event | None]] = []
    with capture_logs() as logs:
        for index, payload in enumerate(bad_payloads):
            expected.append((stream.publish(good[index % len(good)]), good[index % len(good)]))
            expected.append((client.xadd(stream.key, payload).decode(), None))
        entries = stream.read(count=1000)
    assert entries == expected
    warnings = [entry for entry in logs if entry["event"] == "skipping malformed event"]
    assert len(warnings) >= len(bad_payloads)
    assert {w["id"] for w in warnings} >= {i for i, e in expected if e is None}
    assert all(w["log_level"] == "warning" and "\n" not in w["error"] for w in warnings)


def test_follow_skips_malformed_entries(client: redis.Redis) -> None:
    stream = EventStream(client, RUN)
    events = sample_events()[:3]
    stream.publish(events[0])
    client.xadd(stream.key, {ENTRY_FIELD: "garbage"})
    stream.publish(events[1])
    client.xadd(stream.key, {ENTRY_FIELD: json.dumps({"type": "nope"})})
    last = stream.publish(events[2])
    seen: list[tuple[str, Event]] = []
    with capture_logs():
        for entry in stream.follow(
            block_ms=10, stop=until(lambda: bool(seen) and seen[-1][0] == last)
        ):
            seen.append(entry)
    assert [event for _, event in seen] == events


def until(done: Callable[[], bool], limit_s: float = 120.0) -> Callable[[], bool]:
    """``done``, or a safety stop so that a lost event fails the test instead of hanging it."""
    deadline = time.monotonic() + limit_s
    return lambda: done() or time.monotonic() > deadline


def _step(version: int) -> StepCompleted:
    return StepCompleted.now(run=RUN, version=version, checkpoint=f"/c/{version}", owned=False)


def test_follow_does_not_lose_events_written_between_reads(client: redis.Redis) -> None:
    stream = EventStream(client, RUN)
    for version in range(3):
        stream.publish(_step(version))
    seen: list[int] = []
    for _, event in stream.follow(block_ms=50, count=2, stop=until(lambda: len(seen) >= 10)):
        seen.append(event.version)
        if len(seen) == 1:  # the follower holds a batch; more arrive before its next read
            stream.publish(_step(3))
            stream.publish(_step(4))
        if len(seen) == 5:  # caught up: the next read waits for these
            for version in range(5, 10):
                stream.publish(_step(version))
    assert seen == list(range(10))


def test_follow_keeps_up_with_a_concurrent_writer(redis_url: str) -> None:
    reader = EventStream(redis_client(redis_url), RUN)
    start = reader.last_id()
    total = 300

    failed: list[BaseException] = []

    def write() -> None:
        try:
            writer = EventStream(redis_client(redis_url), RUN)
            for version in range(total):
                writer.publish(_step(version))
        except BaseException as exc:
            failed.append(exc)
            raise

    thread = threading.Thread(target=write)
    thread.start()
    seen: list[int] = []
    try:
        for _, event in reader.follow(
            start, block_ms=200, count=7, stop=until(lambda: len(seen) >= total or bool(failed))
        ):
            seen.append(event.version)
    finally:
        thread.join()
    assert not failed
    assert seen == list(range(total))


def test_follow_from_last_id_sees_only_new_events(client: redis.Redis) -> None:
    stream = EventStream(client, RUN)
    stream.publish(_step(0))
    stream.publish(_step(1))
    position = stream.last_id()
    stream.publish(_step(2))
    found = wait_for(stream, lambda e: True, after_id=position, timeout_s=30)
    assert found is not None
    assert found[1].version == 2
    assert EventStream(client, "empty-run").last_id() == "0-0"


def test_trimmed_stream_is_detected(client: redis.Redis) -> None:
    stream = EventStream(client, RUN)
    ids = [stream.publish(_step(v)) for v in range(50)]
    assert not stream.check_gap("0-0")  # never trimmed: nothing lost
    assert not stream.check_gap(ids[9])
    consumer_position = ids[9]

    assert stream.trim(5, approximate=False) == 45
    assert stream.first_id() == ids[45]
    assert stream.check_gap("0-0")
    assert stream.check_gap(consumer_position)  # ids[10..44] are gone
    assert not stream.check_gap(ids[45])
    assert not stream.check_gap(ids[49])

    # XREAD still works from a trimmed-away position; follow reports the gap first.
    gaps: list[str] = []
    got: list[int] = []
    for _, event in stream.follow(
        consumer_position, block_ms=10, on_gap=gaps.append, stop=until(lambda: len(got) >= 5)
    ):
        got.append(event.version)
    assert gaps == [consumer_position]
    assert got == [45, 46, 47, 48, 49]


def test_missing_stream_has_no_gap(client: redis.Redis) -> None:
    stream = EventStream(client, "never-written")
    assert not stream.check_gap("0-0")
    assert stream.read() == []
    assert stream.first_id() is None
    assert stream.length() == 0


def test_blocking_read_stays_below_the_socket_timeout(redis_url: str) -> None:
    stream = EventStream(redis_client(redis_url, socket_timeout_s=1.2, retries=0), RUN)
    assert stream.read(block_ms=60_000) == []  # capped; a socket timeout would raise


def test_unreachable_redis_names_the_url_without_password() -> None:
    port = free_port()  # nothing listens there
    client = redis_client(
        f"redis://:s3cret-pw@127.0.0.1:{port}/0", retries=0, connect_timeout_s=1.0
    )
    stream = EventStream(client, RUN)
    for action in (lambda: stream.publish(_step(1)), stream.read, stream.last_id):
        with pytest.raises(ServiceUnavailableError) as info:
            action()
        message = str(info.value)
        assert f"127.0.0.1:{port}" in message
        assert "s3cret" not in message
        assert "\n" not in message
    with pytest.raises(ServiceUnavailableError):
        list_runs(client)


def test_server_side_errors_are_service_errors(client: redis.Redis) -> None:
    stream = EventStream(client, RUN)
    client.set(stream.key, "not a stream")
    with pytest.raises(ServiceUnavailableError, match="failed while reading"):
        stream.read()
    with pytest.raises(ServiceUnavailableError, match="failed while publishing"):
        stream.publish(_step(1))
