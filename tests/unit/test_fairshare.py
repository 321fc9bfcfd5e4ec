"""services.fairshare: a freed slot goes to the tenant with the fewest turns computing, and a turn
waiting on the model or a webhook holds none."""

from __future__ import annotations

import asyncio

import pytest

from services.fairshare import FairShare, fair_batch, turn_slot, waiting


async def _started(share: FairShare, tenant: str, order: list[str], gate: asyncio.Event) -> None:
    async with turn_slot(share, tenant):
        order.append(tenant)
        await gate.wait()


async def _until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0)


async def test_a_freed_slot_goes_to_the_tenant_with_fewest_running_not_the_first_in_line():
    share, order, gate = FairShare(2), [], asyncio.Event()
    tasks = [asyncio.create_task(_started(share, "a", order, gate)) for _ in range(50)]
    await _until(lambda: share.waiting() == 48)
    tasks.append(asyncio.create_task(_started(share, "b", order, gate)))
    await _until(lambda: share.waiting() == 49)
    assert order == ["a", "a"]
    gate.set()
    await asyncio.gather(*tasks)
    # b came last, behind 48 of a's, and ran third: as soon as one slot was free
    assert order[:3] == ["a", "a", "b"] and len(order) == 51


async def test_ties_go_to_the_one_waiting_longest():
    share, order, gate = FairShare(1), [], asyncio.Event()
    first = asyncio.create_task(_started(share, "x", order, gate))
    await _until(lambda: order == ["x"])
    rest = [asyncio.create_task(_started(share, t, order, gate)) for t in ("c", "d", "e")]
    await _until(lambda: share.waiting() == 3)
    gate.set()
    await asyncio.gather(first, *rest)
    assert order == ["x", "c", "d", "e"]


async def test_waiting_gives_the_slot_to_others_and_takes_it_back():
    share = FairShare(1)
    model = asyncio.Event()
    seen: list[str] = []

    async def asks_the_model() -> None:
        async with turn_slot(share, "a"):
            seen.append("a computes")
            async with waiting():
                await model.wait()
            seen.append(f"a back, b running {share.running('b')}")

    async def quick() -> None:
        async with turn_slot(share, "b"):
            seen.append("b computes")

    a = asyncio.create_task(asks_the_model())
    await _until(lambda: seen == ["a computes"])
    assert share.running("a") == 0  # waiting on the model, it holds no slot
    await quick()  # runs at once, though there is one slot
    model.set()
    await a
    assert seen == ["a computes", "b computes", "a back, b running 0"]
    assert share.running("a") == 0 and share.waiting() == 0


async def test_parallel_waits_of_one_turn_take_one_slot_back():
    share = FairShare(1)
    done = asyncio.Event()

    async def call() -> None:
        async with waiting():
            await done.wait()

    async def turn() -> None:
        async with turn_slot(share, "a"):
            await asyncio.gather(call(), call(), call())
            assert share.running("a") == 1

    task = asyncio.create_task(turn())
    await _until(lambda: share.running("a") == 0)
    done.set()
    await task
    assert share.running("a") == 0
    async with turn_slot(share, "b"):  # the slot is free again: nothing leaked
        assert share.running("b") == 1


async def test_a_cancelled_waiter_leaves_no_trace_and_a_cancelled_holder_frees_its_slot():
    share, order, gate = FairShare(1), [], asyncio.Event()
    holder = asyncio.create_task(_started(share, "a", order, gate))
    await _until(lambda: order == ["a"])
    queued = asyncio.create_task(_started(share, "b", order, gate))
    await _until(lambda: share.waiting() == 1)
    queued.cancel()
    with pytest.raises(asyncio.CancelledError):
        await queued
    assert share.waiting() == 0
    holder.cancel()
    with pytest.raises(asyncio.CancelledError):
        await holder
    async with turn_slot(share, "c"):
        assert share.running("c") == 1


async def test_a_slot_handed_over_as_the_waiter_is_cancelled_passes_on():
    share = FairShare(1)
    await share.acquire("a")
    doomed = asyncio.create_task(share.acquire("b"))
    after = asyncio.create_task(share.acquire("c"))
    await _until(lambda: share.waiting() == 2)
    share.release("a")  # the slot is b's now (b is first in line and has none)...
    doomed.cancel()  # ...and b is cancelled before it could resume
    with pytest.raises(asyncio.CancelledError):
        await doomed
    await asyncio.wait_for(after, 5)  # b passed it on
    assert share.running("b") == 0 and share.running("c") == 1 and share.waiting() == 0


async def test_no_slots_means_no_bound_and_waiting_outside_a_turn_does_nothing():
    share, order, gate = FairShare(0), [], asyncio.Event()
    tasks = [asyncio.create_task(_started(share, "a", order, gate)) for _ in range(10)]
    await _until(lambda: len(order) == 10)
    gate.set()
    await asyncio.gather(*tasks)
    async with waiting():
        pass


def test_a_flush_batch_takes_every_tenant_in_turn_oldest_first():
    keys = [("a", f"s{i}") for i in range(100)] + [("b", "late")] + [("c", "x"), ("c", "y")]
    batch = fair_batch(keys, 6)
    assert batch == [("a", "s0"), ("b", "late"), ("c", "x"), ("a", "s1"), ("c", "y"), ("a", "s2")]
    assert fair_batch(keys, 0) == keys and fair_batch(keys[:3], 5) == keys[:3]


async def test_a_wait_that_would_never_end_runs_over_the_bound_instead():
    # the one slot's holder waits (holding it) on what only the waiter can do: without the bound on
    # waiting, both would wait for ever
    share = FairShare(1, max_wait_s=0.05)
    done = asyncio.Event()

    async def holder() -> None:
        async with turn_slot(share, "a"):
            await done.wait()

    async def waiter() -> None:
        async with turn_slot(share, "b"):
            done.set()

    first = asyncio.create_task(holder())
    await _until(lambda: share.running("a") == 1)
    await asyncio.wait_for(asyncio.gather(first, waiter()), 5)
    assert share.overruns == 1 and share.waiting() == 0
    assert share.running("a") == share.running("b") == 0
    async with turn_slot(share, "c"):  # the count is whole again: one slot, free
        assert share.running("c") == 1 and share._free == 0
