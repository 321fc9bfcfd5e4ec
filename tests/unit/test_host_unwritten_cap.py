"""The session host's cap on unwritten turns: while Postgres is away, new turns are refused.

A turn run while no flush gets through calls the model and runs tools whose results cannot be
stored, and the host holds what it did in memory until Postgres is back. Past `max_unwritten`
turns on a host (counting the new turns running now), or `max_unwritten_per_session` in one
session, a new turn is refused, Overloaded 'storage_unavailable' (503 + Retry-After), having run
nothing; a retry of a message id whose answer is held (written or not) still gets that answer;
nothing held is dropped, and once the flusher gets through the count falls and turns run again.

No Postgres, no Ray: the fakes of tests/support/host_world.py (`FakeSessionStore.down` is Postgres away).
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from actors.host import MAX_UNWRITTEN_PER_SESSION, UNWRITTEN_PER_INFLIGHT, HostSettings, SessionHost
from actors.session import TURN_CACHE
from kernel.errors import Overloaded
from services.wire import ApprovalDecision, Turn
from tests.support import host_world
from tests.support.host_world import KEY, T, answer, eventually, offer_only_book, spin

world = host_world.world  # the fixture

#: a host that gives up waiting at the gate fast and retries its flush often
FAST = {"gate_timeout_s": 0.1, "max_backoff_s": 0.02}
REFUSED = "could not be saved yet .*this message was not run .*send it again in a moment"


async def unsaved(host: SessionHost, session_id: str, text: str, message_id: str, tenant_id: str = "t1") -> None:
    """Run a turn while Postgres is away: it runs, and its reply times out at the gate."""
    with pytest.raises(Overloaded) as info:
        await asyncio.wait_for(host.send(Turn(tenant_id=tenant_id, session_id=session_id, text=text, message_id=message_id)), T)
    assert info.value.reason == "unsaved", info.value


def refused(info: pytest.ExceptionInfo[Overloaded]) -> None:
    assert info.value.reason == "storage_unavailable"
    assert info.value.status == 503 and info.value.retry_after > 0


async def test_past_the_hosts_cap_a_new_turn_is_refused_having_run_nothing_and_runs_once_it_drains(world):
    store, model = world.store, world.model
    host = await world.host(max_unwritten=3, **FAST)
    store.down = True
    for i in range(3):
        await unsaved(host, f"s{i}", f"use lookup q{i}", f"m{i}")
    assert host.stats()["unwritten_turns"] == 3 and host.stats()["unwritten_turns_cap"] == 3
    requests = len(model.requests)

    with pytest.raises(Overloaded, match=rf"this session host holds 3 turns whose state {REFUSED}") as info:
        await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s9", text="use lookup q9", message_id="m9")), T)
    refused(info)
    # nothing of it ran: no model call, no tool, nothing held for it
    assert len(model.requests) == requests and [q for _, _, q in world.tenants.handler_calls] == ["q0", "q1", "q2"]
    assert "m9" not in host._sessions[("t1", "s9")].state.turns and host.stats()["unwritten_turns"] == 3

    store.down = False
    await eventually(lambda: host.stats()["unwritten_turns"] == 0)
    reply = await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s9", text="use lookup q9", message_id="m9")), T)
    assert reply.reply == 'done: {"found":"q9"}' and not reply.replay
    for i in range(3):  # nothing that ran while Postgres was away was dropped
        assert set(store.turns[("t1", f"s{i}")]) == {f"m{i}"}
    assert store.duplicates == [] and len(world.tenants.handler_calls) == 4
    assert host.stats()["unwritten_turns"] == 0


async def test_a_retry_of_an_answer_held_written_or_not_gets_it_at_the_cap_and_runs_nothing(world):
    store = world.store
    host = await world.host(max_unwritten=2, **FAST)
    written = await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s0", text="use lookup q0", message_id="m0")), T)
    assert await host.passivate("t1", "s0")  # its answer is only in Postgres now
    store.down = True
    await unsaved(host, "s1", "use lookup q1", "m1")
    await unsaved(host, "s2", "use lookup q2", "m2")
    with pytest.raises(Overloaded, match=REFUSED):
        await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s3", text="hello", message_id="m3")), T)

    # written: read back (the session activated again) and replayed
    again = await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s0", text="use lookup q0", message_id="m0")), T)
    assert again.replay and answer(again) == answer(msgspec.structs.replace(written, replay=True))
    # not written: held, so not refused; it waits for its answer to be saved, as before the cap
    with pytest.raises(Overloaded, match="retry with the same message_id") as info:
        await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="use lookup q1", message_id="m1")), T)
    assert info.value.reason == "unsaved"
    retry = asyncio.create_task(host.send(Turn(tenant_id="t1", session_id="s2", text="use lookup q2", message_id="m2")))
    await spin()
    store.down = False
    reply = await asyncio.wait_for(retry, T)
    assert reply.replay and reply.reply == 'done: {"found":"q2"}'
    assert [q for _, _, q in world.tenants.handler_calls] == ["q0", "q1", "q2"]  # no retry ran again


async def test_turns_running_now_count_towards_the_cap_so_a_burst_cannot_pass_it(world):
    model = world.model
    slow = model.hold("busy")
    host = await world.host(max_unwritten=2, **FAST)
    world.store.down = True
    running = [asyncio.create_task(host.send(Turn(tenant_id="t1", session_id=f"s{i}", text="busy", message_id=f"m{i}"))) for i in range(2)]
    await eventually(lambda: len(model.requests) == 2)
    assert host.stats()["unwritten_turns"] == 0  # none sealed yet, but each is about to hold one
    with pytest.raises(Overloaded, match=REFUSED) as info:
        await asyncio.wait_for(host.send(Turn(tenant_id="t2", session_id="s9", text="hello", message_id="m9")), T)
    refused(info)
    assert len(model.requests) == 2
    slow.set()
    for task in running:
        with pytest.raises(Overloaded, match="retry with the same message_id"):
            await asyncio.wait_for(task, T)
    assert host.stats()["unwritten_turns"] == 2


async def test_one_session_past_its_own_cap_is_refused_while_other_sessions_still_run(world):
    store = world.store
    host = await world.host(max_unwritten_per_session=2, **FAST)
    store.down = True
    await unsaved(host, "s1", "use lookup a", "m1")
    await unsaved(host, "s1", "use lookup b", "m2")
    with pytest.raises(Overloaded, match=rf"session 's1' has 2 turns whose state {REFUSED}") as info:
        await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="use lookup c", message_id="m3")), T)
    refused(info)
    await unsaved(host, "s2", "use lookup d", "m1")  # another session has room of its own
    assert world.calls("s1") == [("lookup", "a"), ("lookup", "b")] and world.calls("s2") == [("lookup", "d")]
    assert host.stats()["unwritten_turns"] == 3

    store.down = False
    await eventually(lambda: host.stats()["unwritten_turns"] == 0)
    reply = await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="use lookup c", message_id="m3")), T)
    assert reply.reply == 'done: {"found":"c"}'
    assert list(store.turns[KEY]) == ["m1", "m2", "m3"] and store.duplicates == []


async def test_a_message_queued_behind_the_turn_that_fills_its_session_is_refused_when_its_turn_comes(world):
    model = world.model
    slow = model.hold("busy")
    host = await world.host(max_unwritten_per_session=1, **FAST)
    world.store.down = True
    first = asyncio.create_task(host.send(Turn(tenant_id="t1", session_id="s1", text="busy", message_id="m1")))
    await asyncio.wait_for(model.entered("busy").wait(), T)
    queued = asyncio.create_task(host.send(Turn(tenant_id="t1", session_id="s1", text="use lookup q", message_id="m2")))  # admitted to the mailbox
    await eventually(lambda: host._sessions[KEY].queued == 1)
    slow.set()
    with pytest.raises(Overloaded, match=REFUSED) as info:
        await asyncio.wait_for(queued, T)
    refused(info)
    assert world.calls() == [] and [label for kind, label in model.log if kind == "enter"] == ["busy"]
    with pytest.raises(Overloaded, match="retry with the same message_id"):
        await asyncio.wait_for(first, T)


async def test_an_approval_is_not_resumed_at_the_cap_but_one_decided_already_is_answered_again(world):
    store, tenants = world.store, world.tenants
    offer_only_book(tenants)
    host = await world.host(max_unwritten=2, **FAST)
    held = await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="use book q", message_id="m0")), T)
    approval = held.pending_approval.approval_id
    store.down = True
    await unsaved(host, "s2", "hello", "m1")
    await unsaved(host, "s3", "hello", "m1")
    with pytest.raises(Overloaded, match=REFUSED) as info:
        await asyncio.wait_for(host.decide(ApprovalDecision(tenant_id="t1", session_id="s1", approval_id=approval, approve=True)), T)
    refused(info)
    assert world.calls() == [] and store.snapshots[KEY].pending is not None  # still held, nothing ran

    store.down = False
    await eventually(lambda: host.stats()["unwritten_turns"] == 0)
    first = await asyncio.wait_for(host.decide(ApprovalDecision(tenant_id="t1", session_id="s1", approval_id=approval, approve=True)), T)
    assert first.reply == 'done: {"found":"q"}' and world.calls() == [("lookup", "q")]

    store.down = True  # at the cap again: the decided approval is answered from what is held
    await unsaved(host, "s4", "hello", "m1")
    await unsaved(host, "s5", "hello", "m1")
    again = await asyncio.wait_for(host.decide(ApprovalDecision(tenant_id="t1", session_id="s1", approval_id=approval, approve=True)), T)
    assert again.replay and answer(again) == answer(msgspec.structs.replace(first, replay=True))
    assert world.calls() == [("lookup", "q")]


async def test_a_streamed_turn_at_the_cap_is_refused_before_its_first_event(world):
    host = await world.host(max_unwritten=1, **FAST)
    world.store.down = True
    await unsaved(host, "s1", "hello", "m1")
    events = []
    with pytest.raises(Overloaded, match=REFUSED) as info:
        async with asyncio.timeout(T):
            async for event in host.stream(Turn(tenant_id="t1", session_id="s2", text="use lookup q", message_id="m2")):
                events.append(event)
    refused(info)
    assert events == [] and world.calls("s2") == []


async def test_a_copy_taken_over_by_another_host_stops_counting_once_its_flush_is_refused(world):
    store = world.store
    h1 = await world.host("h1", max_unwritten=1, **FAST)
    store.down = True
    await unsaved(h1, "s1", "hello", "m1")
    with pytest.raises(Overloaded, match=REFUSED):
        await asyncio.wait_for(h1.send(Turn(tenant_id="t1", session_id="s2", text="hello", message_id="m2")), T)
    h2 = await world.host("h2", **FAST)
    await unsaved(h2, "s1", "hello again", "m9")  # takes the session over: h1's copy is stale
    store.down = False
    await eventually(lambda: h1.stats()["unwritten_turns"] == 0)  # refused, dropped, not held for good
    reply = await asyncio.wait_for(h1.send(Turn(tenant_id="t1", session_id="s2", text="hello", message_id="m2")), T)
    assert reply.reply == "echo: hello"


async def test_a_healthy_host_counts_nothing_after_its_flushes_and_the_defaults_leave_room_for_every_admitted_turn(world):
    host = await world.host()
    replies = await asyncio.wait_for(asyncio.gather(*(
        host.send(Turn(tenant_id="t1", session_id=f"s{i % 5}", text="hello", message_id=f"m{i}")) for i in range(30))), T)
    assert all(r.reply == "echo: hello" for r in replies)
    await eventually(lambda: host.stats()["unwritten_turns"] == 0)
    settings = HostSettings()
    assert host.stats()["unwritten_turns_cap"] == UNWRITTEN_PER_INFLIGHT * settings.max_inflight > settings.max_inflight
    assert settings.max_unwritten_per_session == MAX_UNWRITTEN_PER_SESSION == TURN_CACHE
