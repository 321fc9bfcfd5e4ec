"""Per-resource concurrency limits with a deadline that includes queue wait (seed 001)."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.tools.errors import DeadlineExceeded
from services.tools.limiter import ResourceLimiter
from tests.support.fakes import FakeClock
from tests.support.waits import spin

FAR = 60.0  # a deadline no test should reach: seconds from now


def far() -> float:
    return time.monotonic() + FAR


async def test_never_more_than_the_limit_run_at_once() -> None:
    limiter = ResourceLimiter(default_limit=8, limits={"crm": 2})
    gate = asyncio.Event()
    running = 0
    peak = 0
    started = 0

    async def work() -> int:
        nonlocal running, peak, started
        running += 1
        started += 1
        peak = max(peak, running)
        await gate.wait()
        for _ in range(3):  # let queued calls try to barge in while this one finishes
            await asyncio.sleep(0)
        running -= 1
        return 1

    tasks = [asyncio.create_task(limiter.run("crm", far(), work)) for _ in range(10)]
    await spin(lambda: started == 2)
    for _ in range(20):  # plenty of chances for an over-admission to show
        await asyncio.sleep(0)
    assert (started, running, limiter.in_use("crm")) == (2, 2, 2)
    gate.set()
    results = await asyncio.gather(*tasks)
    assert [r.value for r in results] == [1] * 10
    assert peak == 2
    assert limiter.in_use("crm") == 0


async def test_limits_are_per_resource() -> None:
    limiter = ResourceLimiter(default_limit=1)
    gate = asyncio.Event()
    started: list[str] = []

    def work(name: str):
        async def run() -> str:
            started.append(name)
            await gate.wait()
            return name

        return run

    a = asyncio.create_task(limiter.run("a", far(), work("a")))
    b = asyncio.create_task(limiter.run("b", far(), work("b")))
    await spin(lambda: len(started) == 2)  # a full "a" does not hold back "b"
    gate.set()
    assert [(await a).value, (await b).value] == ["a", "b"]


async def test_limits_are_per_owner_of_a_resource() -> None:
    # the executor passes the tenant as the owner: one tenant's full "crm" holds back no other's
    limiter = ResourceLimiter(limits={"crm": 1})
    gate = asyncio.Event()

    async def held() -> str:
        await gate.wait()
        return "a"

    a = asyncio.create_task(limiter.run("crm", far(), held, owner="tenant-a"))
    await spin(lambda: limiter.in_use("crm", owner="tenant-a") == 1)
    b = await asyncio.wait_for(limiter.run("crm", far(), lambda: asyncio.sleep(0, "b"), owner="tenant-b"), 5)
    assert b.value == "b" and limiter.in_use("crm", owner="tenant-b") == 0
    gate.set()
    assert (await a).value == "a"


async def test_a_resource_nobody_uses_keeps_no_state() -> None:
    # Keyed by tenant and tool, the table would otherwise grow with every tenant a host ever served.
    limiter = ResourceLimiter(limits={"crm": 1})
    for tenant in ("a", "b", "c"):
        await limiter.run("crm", far(), lambda: asyncio.sleep(0), owner=tenant)
    with pytest.raises(DeadlineExceeded):
        await limiter.run("crm", time.monotonic() + 0.01, lambda: asyncio.sleep(1), owner="d")
    assert limiter.tracked == 0


async def test_waiting_past_the_deadline_for_a_slot_fails_fast_and_never_starts_the_work() -> None:
    limiter = ResourceLimiter(limits={"crm": 1})
    holder_gate = asyncio.Event()
    holder_started = asyncio.Event()

    async def hold() -> str:
        holder_started.set()
        await holder_gate.wait()
        return "held"

    late_started = False

    async def late() -> str:
        nonlocal late_started
        late_started = True
        return "late"

    holder = asyncio.create_task(limiter.run("crm", far(), hold))
    await holder_started.wait()
    with pytest.raises(DeadlineExceeded, match=r"waited \d+ ms for a free slot and ran out of time"):
        await limiter.run("crm", time.monotonic() + 0.05, late)
    # it failed while the slot was still taken: the deadline, not the holder, ended the wait
    assert not holder.done()
    assert late_started is False
    holder_gate.set()
    assert (await holder).value == "held"
    assert late_started is False
    assert limiter.in_use("crm") == 0


async def test_deadline_exceeded_from_the_queue_is_retryable_with_advice() -> None:
    limiter = ResourceLimiter(limits={"crm": 1})
    gate = asyncio.Event()
    holder = asyncio.create_task(limiter.run("crm", far(), gate.wait))
    await spin(lambda: limiter.in_use("crm") == 1)
    with pytest.raises(DeadlineExceeded) as info:
        await limiter.run("crm", time.monotonic() + 0.02, gate.wait)
    assert info.value.retryable is True
    assert info.value.kind == "queue_timeout" and not info.value.counts_for_breaker
    assert "try again" in info.value.advice
    gate.set()
    await holder


@pytest.mark.parametrize("offset", [0.0, -1.0], ids=["deadline-now", "deadline-past"])
async def test_a_deadline_already_past_is_rejected_immediately(offset: float) -> None:
    clock = FakeClock(start=100.0)
    limiter = ResourceLimiter(clock=clock)
    called = False

    async def work() -> None:
        nonlocal called
        called = True

    with pytest.raises(DeadlineExceeded, match="deadline passed before the call could start"):
        await limiter.run("crm", clock.now + offset, work)
    assert called is False
    assert limiter.in_use("crm") == 0


async def test_queue_time_is_measured_apart_from_run_time() -> None:
    clock = FakeClock(start=1000.0)
    limiter = ResourceLimiter(limits={"crm": 1}, clock=clock)
    release = asyncio.Event()

    async def hold() -> str:
        await release.wait()
        return "first"

    async def quick() -> str:
        clock.advance(0.5)  # the call itself takes half a second
        return "second"

    first = asyncio.create_task(limiter.run("crm", clock.now + FAR, hold))
    await spin(lambda: limiter.in_use("crm") == 1)
    second = asyncio.create_task(limiter.run("crm", clock.now + FAR, quick))
    for _ in range(5):
        await asyncio.sleep(0)  # let it reach the queue
    clock.advance(3.0)  # three seconds pass while it waits for the slot
    release.set()
    timed_first, timed_second = await first, await second
    assert timed_first.queue_s == 0.0
    assert timed_first.run_s == 3.0
    assert (timed_second.value, timed_second.queue_s, timed_second.run_s) == ("second", 3.0, 0.5)


async def test_work_running_past_the_deadline_is_cancelled() -> None:
    limiter = ResourceLimiter()
    cancelled = asyncio.Event()

    async def slow() -> None:
        try:
            await asyncio.sleep(2)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(DeadlineExceeded, match="upstream timeout"):
        await limiter.run("crm", time.monotonic() + 0.05, slow)
    assert cancelled.is_set()
    assert limiter.in_use("crm") == 0


async def test_work_errors_propagate_and_free_the_slot() -> None:
    limiter = ResourceLimiter(limits={"crm": 1})

    async def boom() -> None:
        raise RuntimeError("handler bug")

    with pytest.raises(RuntimeError, match="handler bug"):
        await limiter.run("crm", far(), boom)
    assert limiter.in_use("crm") == 0


async def test_a_cancelled_waiter_frees_its_place_in_the_queue() -> None:
    limiter = ResourceLimiter(limits={"crm": 1})
    release = asyncio.Event()
    ran: list[str] = []

    def work(name: str, gate: asyncio.Event | None = None):
        async def run() -> str:
            ran.append(name)
            if gate is not None:
                await gate.wait()
            return name

        return run

    holder = asyncio.create_task(limiter.run("crm", far(), work("holder", release)))
    await spin(lambda: ran == ["holder"])
    waiter = asyncio.create_task(limiter.run("crm", far(), work("cancelled")))
    behind = asyncio.create_task(limiter.run("crm", far(), work("behind")))
    for _ in range(5):
        await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    release.set()
    assert (await holder).value == "holder"
    # the call queued behind the cancelled one gets the slot; the cancelled one never ran
    assert (await asyncio.wait_for(behind, 5)).value == "behind"
    assert ran == ["holder", "behind"]
    assert limiter.in_use("crm") == 0


async def test_a_cancelled_runner_frees_its_slot() -> None:
    limiter = ResourceLimiter(limits={"crm": 1})
    started = asyncio.Event()

    async def stuck() -> None:
        started.set()
        await asyncio.Event().wait()

    async def quick() -> str:
        return "next"

    runner = asyncio.create_task(limiter.run("crm", far(), stuck))
    await started.wait()
    queued = asyncio.create_task(limiter.run("crm", far(), quick))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not queued.done()
    runner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await runner
    assert (await asyncio.wait_for(queued, 5)).value == "next"
    assert (await limiter.run("crm", far(), quick)).value == "next"
    assert limiter.in_use("crm") == 0


def test_limit_for_uses_the_resource_limit_or_the_default() -> None:
    limiter = ResourceLimiter(default_limit=8, limits={"crm": 2})
    assert (limiter.limit_for("crm"), limiter.limit_for("other")) == (2, 8)
    assert limiter.in_use("never_used") == 0


@pytest.mark.parametrize("where", ["waiting_on_the_gate", "waiting_on_the_resource", "running"])
async def test_a_call_cancelled_anywhere_gives_back_its_max_parallel_gate(where: str) -> None:
    # a tool's `max_parallel` gate is taken before the resource's slot: a cancelled turn (the
    # client went away) must give back whatever it took, or that tool runs one fewer at a time
    # for the rest of the batch
    limiter = ResourceLimiter(limits={"crm": 1})
    gate = asyncio.Semaphore(1)
    started, hold = asyncio.Event(), asyncio.Event()

    async def held() -> str:
        started.set()
        await hold.wait()
        return "held"

    async def quick() -> str:
        return "next"

    if where == "waiting_on_the_gate":  # the gate is taken by another call of the same tool
        first = asyncio.create_task(limiter.run("crm", far(), held, gate=gate))
    elif where == "waiting_on_the_resource":  # the resource's slot is taken by another tool
        first = asyncio.create_task(limiter.run("crm", far(), held))
    else:
        first = None
    if first is not None:
        await started.wait()
        call = asyncio.create_task(limiter.run("crm", far(), quick, gate=gate))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not call.done()
    else:
        call = asyncio.create_task(limiter.run("crm", far(), held, gate=gate))
        await started.wait()
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    hold.set()
    if first is not None:
        assert (await first).value == "held"
    assert gate._value == 1 and limiter.in_use("crm") == 0
    assert (await asyncio.wait_for(limiter.run("crm", far(), quick, gate=gate), 5)).value == "next"
