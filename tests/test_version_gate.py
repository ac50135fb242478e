"""The version gate of `deltasync serve` (pipeline/targets/vllm/engine.py): requests
are admitted under one label, a closer waits for the admitted ones and holds new
ones, and every request names the label it was admitted under. Ordering only, no
timing: each step is awaited to completion before the next is checked."""

from __future__ import annotations

import asyncio

from pipeline.targets.vllm.engine import VersionGate


async def _settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def test_requests_waiting_through_an_update_name_the_new_version() -> None:
    async def scenario() -> None:
        gate = VersionGate("run@1")
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
        gate.reopen("run@2")
        assert await late == "run@2"  # it ran on the version it waited for
        gate.leave()
        assert gate.active == 0

    asyncio.run(scenario())


def test_a_load_without_a_known_version_stays_closed_and_an_unknown_state_refuses() -> None:
    async def scenario() -> None:
        gate = VersionGate()  # nothing loaded: closed
        assert not gate.is_open
        waiting = asyncio.create_task(gate.enter())
        await gate.close()
        gate.reopen(None, keep_closed=True)  # loaded, the version not named yet
        await _settle()
        assert not waiting.done()
        gate.reopen("run@0")  # the node names it
        assert await waiting == "run@0"
        gate.leave()
        await gate.close()
        gate.reopen(None)  # a failed load: open, and requests are refused
        assert await gate.enter() is None
        gate.leave()

    asyncio.run(scenario())


def test_the_gate_opens_only_when_every_closer_reopened() -> None:
    async def scenario() -> None:
        gate = VersionGate("run@3")
        await gate.close()
        await gate.close()  # e.g. the app being built while an update runs
        gate.reopen("run@3")
        assert not gate.is_open
        gate.reopen("run@4")
        assert gate.is_open and await gate.enter() == "run@4"
        gate.leave()

    asyncio.run(scenario())
