"""The version gate of `deltasync serve` (pipeline/targets/vllm/engine.py): requests
are admitted under one label, a closer waits for the admitted ones and holds new
ones, and every request names the label it was admitted under; a request asking for
a version waits for it (or its time runs out, unadmitted). Ordering only, no timing:
each step is awaited to completion before the next is checked. The gate's headers
are parsed here too (pipeline/rollout/served.py, workers/nodes/serve.py)."""

from __future__ import annotations

import asyncio

import pytest

from pipeline.errors import ConfigError, VersionTimeoutError
from pipeline.rollout.served import (
    VersionClient,
    gate_headers,
    parse_label,
    parse_min_version,
    parse_wait_timeout,
)
from pipeline.targets.vllm.engine import VersionGate
from workers.nodes.serve import gate_request


async def _settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def test_requests_waiting_through_an_update_name_the_new_version() -> None:
    async def scenario() -> None:
        gate = VersionGate("run", 1)
        assert await gate.enter() == "run@1"  # a request in flight on v1
        closing = asyncio.create_task(gate.close())
        await _settle()
        assert not closing.done()  # the update waits for it
        late = asyncio.create_task(gate.enter())
        await _settle()
        assert not late.done()  # a new request waits for the update
        gate.leave()
        await closing
        assert not late.done()
        gate.reopen(2)
        assert await late == "run@2"  # it ran on the version it waited for
        gate.leave()
        assert gate.active == 0

    asyncio.run(scenario())


def test_a_load_without_a_known_version_stays_closed_and_an_unknown_state_refuses() -> None:
    async def scenario() -> None:
        gate = VersionGate("run")  # nothing loaded: closed
        assert not gate.is_open
        waiting = asyncio.create_task(gate.enter())
        await gate.close()
        gate.reopen(None, keep_closed=True)  # loaded, the version not named yet
        await _settle()
        assert not waiting.done()
        gate.reopen(0)  # the node names it
        assert await waiting == "run@0"
        gate.leave()
        await gate.close()
        gate.reopen(None)  # a failed load: open, and requests are refused
        assert await gate.enter() is None
        gate.leave()

    asyncio.run(scenario())


def test_the_gate_opens_only_when_every_closer_reopened() -> None:
    async def scenario() -> None:
        gate = VersionGate("run", 3)
        await gate.close()
        await gate.close()  # e.g. the app being built while an update runs
        gate.reopen(3)
        assert not gate.is_open
        gate.reopen(4)
        assert gate.is_open and await gate.enter() == "run@4"
        gate.leave()

    asyncio.run(scenario())


def test_requests_asking_for_a_version_wait_for_it_and_none_runs_below_it() -> None:
    """Hundreds of requests ask for the next version before it exists; an update to
    a version below it admits none of them, the update to it admits them all."""

    async def scenario() -> None:
        gate = VersionGate("run", 3)
        labels: list[str | None] = []

        async def request(min_version: int) -> None:
            labels.append(await gate.enter(min_version, timeout_s=3600))
            await asyncio.sleep(0)  # "generating"
            gate.leave()

        waiting = [asyncio.create_task(request(5)) for _ in range(200)]
        await _settle()
        assert gate.waiting == 200 and labels == []
        assert await gate.enter(3) == "run@3"  # asks for what is held: admitted at once
        gate.leave()
        for version in (4, 5):
            await gate.close()  # an update: nothing admitted is inside
            gate.reopen(version)
            await _settle()
            if version == 4:
                assert labels == [] and gate.waiting == 200
        await asyncio.gather(*waiting)
        assert labels == ["run@5"] * 200 and gate.waiting == 0 and gate.active == 0

    asyncio.run(scenario())


def test_a_request_whose_version_never_comes_times_out_unadmitted() -> None:
    async def scenario() -> None:
        gate = VersionGate("run", 1)
        with pytest.raises(VersionTimeoutError, match=r"version 2 not reached .* holds version 1"):
            await gate.enter(2, timeout_s=0.05)
        assert gate.active == 0 and gate.waiting == 0
        await gate.close()  # no admitted request holds an update back
        gate.reopen(2)
        assert await gate.enter(2, timeout_s=0.05) == "run@2"
        gate.leave()

    asyncio.run(scenario())


def test_a_long_poll_returns_once_the_version_is_held() -> None:
    async def scenario() -> None:
        gate = VersionGate("run", 7)
        await gate.wait_for(7)  # held already
        await gate.wait_for(0)
        poll = asyncio.create_task(gate.wait_for(8, timeout_s=3600))
        await _settle()
        assert not poll.done() and gate.waiting == 1
        await gate.close()
        gate.reopen(8)
        await poll
        with pytest.raises(VersionTimeoutError):
            await gate.wait_for(9, timeout_s=0.01)

    asyncio.run(scenario())


def test_a_recovering_server_refuses_plain_requests_and_holds_gated_ones() -> None:
    async def scenario() -> None:
        gate = VersionGate("run", 4)
        await gate.close()
        gate.reopen(None)  # a failed load: open, no known version
        assert await gate.enter() is None  # refused (503)
        gate.leave()
        gated = asyncio.create_task(gate.enter(4, timeout_s=3600))
        await _settle()
        assert not gated.done()
        await gate.close()
        gate.reopen(4)  # recovered
        assert await gated == "run@4"
        gate.leave()

    asyncio.run(scenario())


def test_gate_headers_parse_or_give_a_one_line_reason() -> None:
    assert gate_request({}, "run", 300.0) == (None, 300.0)
    assert gate_request({"x-deltasync-min-version": "12"}, "run", 300.0) == (12, 300.0)
    asked = {"x-deltasync-min-version": " run@12 ", "x-deltasync-wait-timeout": "2.5"}
    assert gate_request(asked, "run", 300.0) == (12, 2.5)
    assert parse_min_version("0") == 0
    for bad in ["", "abc", "-1", "1.5", "1e3", "@", "run@", "12@run", "²", "9" * 40]:
        with pytest.raises(ConfigError, match="x-deltasync-min-version must be a version") as err:
            parse_min_version(bad, "run")
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="names run 'other'; this server follows 'run'"):
        parse_min_version("other@3", "run")
    for bad_wait in ["", "x", "0", "-1", "nan", "inf", "1e9"]:
        with pytest.raises(ConfigError, match="x-deltasync-wait-timeout must be seconds"):
            parse_wait_timeout(bad_wait)
    assert gate_headers(5, 2.0) == {"x-deltasync-min-version": "5", "x-deltasync-wait-timeout": "2"}
    with pytest.raises(ConfigError):
        gate_headers(-1)
    assert parse_label("grpo-7@41") == ("grpo-7", 41)
    assert parse_label("a@b@3") == ("a@b", 3)
    with pytest.raises(ConfigError, match="not a version label"):
        parse_label("grpo-7")


def test_the_version_client_takes_a_server_or_openai_base_url() -> None:
    assert VersionClient("http://h:8000/v1/").url == "http://h:8000"
    assert VersionClient("http://h:8000").url == "http://h:8000"
    with pytest.raises(ConfigError, match="must look like http://host:port"):
        VersionClient("h:8000")
