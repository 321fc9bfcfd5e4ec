"""A session's event log on its host, with fakes: numbered events written with their turn, pushed
to watchers only once written, read back after any number; an agent's messages and a handoff's
changes as the session runs them. No Postgres, no Ray (tests/support/host_fakes.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from actors.session import AGENT_WORDS, CLOSED_REPLY, HANDED_OFF_REPLY, SessionError, _mark_handoff
from services.llm.port import TextBlock
from services.wire import AgentMessage, HandoffChange, Turn
from tests.support import host_world
from tests.support.host_world import KEY, T, eventually, spin

world = host_world.world  # the fixture


def turn(text: str, message_id: str) -> Turn:
    return Turn(tenant_id="t1", session_id="s1", text=text, message_id=message_id)


def kinds(events) -> list[tuple[int, str, str | None]]:
    return [(e.seq, e.type, e.data.get("author")) for e in events]


async def hand_off(host) -> None:
    """The session as `escalate_to_human` or [[HANDOFF]] leaves it (that path is the turn's own)."""
    entry = await host._entry(KEY)
    _mark_handoff(entry.state, "test")
    entry.state._seal()
    await host.flush_all()


async def test_a_turn_logs_the_contacts_message_its_tool_activity_and_the_reply_numbered_from_1(world):
    store = world.store
    host = await world.host()
    await asyncio.wait_for(host.send(turn("use lookup boom", "m1")), T)
    assert kinds(store.events[KEY]) == [
        (1, "message", "contact"), (2, "tool_call", None), (3, "tool_result", None), (4, "message", "bot"),
    ]
    call, result = store.events[KEY][1].data, store.events[KEY][2].data
    assert call == {"id": call["id"], "name": "lookup"}  # never the arguments
    assert result == {"id": call["id"], "name": "lookup", "success": True}  # never the result
    assert store.events[KEY][3].data["text"] == 'done: {"found":"boom"}'
    assert store.snapshots[KEY].event_seq == 4
    # a repeated message id is answered from what is stored: nothing new in the log
    await asyncio.wait_for(host.send(turn("use lookup boom", "m1")), T)
    assert len(store.events[KEY]) == 4


async def test_turns_written_together_by_one_flush_keep_every_event_in_order(world):
    store = world.store
    store.hold = asyncio.Event()
    host = await world.host(output_gate=False)  # replies before their flush: turns pile up
    await asyncio.wait_for(host.send(turn("one", "m1")), T)
    await asyncio.wait_for(store.flush_entered.wait(), T)
    await asyncio.wait_for(host.send(turn("two", "m2")), T)
    await asyncio.wait_for(host.send(turn("three", "m3")), T)
    store.hold.set()
    await host.flush_all()
    assert [(e.seq, e.data["text"]) for e in store.events[KEY]] == [
        (1, "one"), (2, "echo: one"), (3, "two"), (4, "echo: two"), (5, "three"), (6, "echo: three")]
    assert max(store.deltas_per_flush) == 1 and len(store.deltas_per_flush) == 2  # two turns in one delta


async def test_numbers_go_on_after_passivation_and_a_new_activation(world):
    store = world.store
    host = await world.host()
    await asyncio.wait_for(host.send(turn("hello", "m1")), T)
    assert await host.passivate("t1", "s1")
    await asyncio.wait_for(host.send(turn("again", "m2")), T)
    assert [e.seq for e in store.events[KEY]] == [1, 2, 3, 4]


async def test_a_watcher_gets_the_events_after_the_one_it_names_and_waits_for_new_ones(world):
    store = world.store
    host = await world.host()
    await asyncio.wait_for(host.send(turn("hello", "m1")), T)
    assert [e.seq for e in await host.watch("t1", "s1", 0, 0)] == [1, 2]
    assert [e.seq for e in await host.watch("t1", "s1", 1, 0)] == [2]
    assert await host.watch("t1", "s1", 2, 0.05) == []  # nothing new within the wait

    waiting = asyncio.create_task(host.watch("t1", "s1", 2, T))
    await eventually(lambda: host.watchers == 1)
    await asyncio.wait_for(host.send(turn("again", "m2")), T)
    assert [e.seq for e in await asyncio.wait_for(waiting, T)] == [3, 4]
    assert host.watchers == 0
    reads = store.events_reads
    # pushed events are served from memory, and a watcher that has the newest waits without a read
    waiting = asyncio.create_task(host.watch("t1", "s1", 4, T))
    await eventually(lambda: host.watchers == 1)
    await asyncio.wait_for(host.send(turn("third", "m3")), T)
    assert [e.seq for e in await asyncio.wait_for(waiting, T)] == [5, 6]
    assert await host.watch("t1", "s1", 6, 0.01) == []  # asked again after its wait: known, no read
    assert store.events_reads == reads


async def test_an_idle_watcher_asking_again_and_again_costs_one_read_then_none(world):
    store = world.store
    host = await world.host()
    await asyncio.wait_for(host.send(turn("hello", "m1")), T)
    for _ in range(5):
        assert await host.watch("t1", "s1", 2, 0.01) == []
    assert store.events_reads == 1
    assert host.drop_idle_feeds(cutoff=time.monotonic() + 1) == 1  # nobody watched it since: forgotten
    assert await host.watch("t1", "s1", 2, 0.01) == [] and store.events_reads == 2


async def test_what_a_host_knows_of_a_watched_session_is_forgotten_when_it_is_activated_again(world):
    host = await world.host()
    await asyncio.wait_for(host.send(turn("hello", "m1")), T)
    assert await host.watch("t1", "s1", 2, 0.01) == []
    assert await host.passivate("t1", "s1")
    other = await world.host("h2")  # meanwhile another host has the session and writes to it
    await asyncio.wait_for(other.send(turn("elsewhere", "m2")), T)
    await asyncio.wait_for(host._entry(KEY), T)  # activated here again (a turn or a view would), after h2
    assert [e.data["text"] for e in await host.watch("t1", "s1", 2, 0)] == ["elsewhere", "echo: elsewhere"]


async def test_an_event_reaches_a_watcher_only_once_it_is_written(world):
    store = world.store
    host = await world.host()
    await asyncio.wait_for(host.send(turn("hello", "m1")), T)
    waiting = asyncio.create_task(host.watch("t1", "s1", 2, T))
    await eventually(lambda: host.watchers == 1)
    store.hold = asyncio.Event()
    sending = asyncio.create_task(host.send(turn("again", "m2")))
    await asyncio.wait_for(store.flush_entered.wait(), T)
    await spin()
    assert not waiting.done(), "an event was pushed before the flush holding it committed"
    store.hold.set()
    assert [e.seq for e in await asyncio.wait_for(waiting, T)] == [3, 4]
    await asyncio.wait_for(sending, T)


async def test_a_watcher_of_a_session_another_host_owns_is_told_it_moved(world):
    host = await world.host()
    host.set_ownership(lambda _t, _s: False)
    with pytest.raises(Exception, match="moving to another session host"):
        await host.watch("t1", "s1", 0, 0)


async def test_stopping_the_host_sends_its_watchers_back_at_once(world):
    host = await world.host()
    await asyncio.wait_for(host.send(turn("hello", "m1")), T)
    waiting = asyncio.create_task(host.watch("t1", "s1", 2, 60))
    await eventually(lambda: host.watchers == 1)
    await asyncio.wait_for(host.stop(), T)
    assert await asyncio.wait_for(waiting, T) == []


# -- a person in the conversation ------------------------------------------------------------------


def agent_says(text: str, message_id: str | None = None) -> AgentMessage:
    return AgentMessage(tenant_id="t1", session_id="s1", text=text, agent="Ana", message_id=message_id)


def change(state: str, **kw) -> HandoffChange:
    return HandoffChange(tenant_id="t1", session_id="s1", handoff_id="h1", state=state, **kw)


async def test_an_agent_may_write_only_to_a_session_handed_off(world):
    host = await world.host()
    await asyncio.wait_for(host.send(turn("hello", "m1")), T)
    with pytest.raises(SessionError, match="not handed off to a person") as refused:
        await asyncio.wait_for(host.act(agent_says("hi")), T)
    assert refused.value.kind == "conflict"


async def test_the_takeover_end_to_end_on_the_host(world):
    store, model = world.store, world.model
    host = await world.host()
    await asyncio.wait_for(host.send(turn("hello", "m1")), T)
    await hand_off(host)
    assert store.events[KEY][-1].data == {"state": "requested"}
    # requested, nobody has it yet: the contact is told a person will answer
    assert (await asyncio.wait_for(host.send(turn("anyone?", "m2")), T)).reply == HANDED_OFF_REPLY

    await asyncio.wait_for(host.act(change("assigned", agent="Ana")), T)
    await asyncio.wait_for(host.act(change("assigned", agent="Ana")), T)  # again: nothing new
    assert [e.data for e in store.events[KEY] if e.type == "handoff"][1:] == [
        {"state": "assigned", "handoff_id": "h1", "agent": "Ana"}]

    sent = await asyncio.wait_for(host.act(agent_says("Hi, I am Ana", "a1")), T)
    again = await asyncio.wait_for(host.act(agent_says("Hi, I am Ana", "a1")), T)
    assert sent.reply == "Hi, I am Ana" and again.replay and again.message_id == "a1"
    agent_events = [e.data for e in store.events[KEY] if e.data.get("author") == "agent"]
    assert agent_events == [{"author": "agent", "agent": "Ana", "text": "Hi, I am Ana", "message_id": "a1"}]

    # assigned: the contact's message is stored and logged, the model is not called, no bot reply
    asked = len(model.requests)
    reply = await asyncio.wait_for(host.send(turn("my order is late", "m3")), T)
    assert reply.reply == "" and reply.handoff and len(model.requests) == asked
    assert store.events[KEY][-1].data == {"author": "contact", "text": "my order is late", "message_id": "m3"}

    await asyncio.wait_for(host.act(change("resolved", return_to_bot=True)), T)
    assert store.events[KEY][-1].data == {"state": "resolved", "handoff_id": "h1", "return_to_bot": True}
    assert world.tenants.handoffs.changes == [("claim", "h1", "Ana"), ("claim", "h1", "Ana"), ("resolve", "h1", True)]
    back = await asyncio.wait_for(host.send(turn("thanks", "m4")), T)
    assert back.reply == "echo: thanks" and not back.handoff
    seen = [b.text for m in model.requests[-1].messages for b in m.content if isinstance(b, TextBlock)]
    assert AGENT_WORDS.format(agent="Ana", text="Hi, I am Ana") in seen and "my order is late" in seen
    seqs = [e.seq for e in store.events[KEY]]
    assert seqs == list(range(1, len(seqs) + 1))


async def test_a_handoff_resolved_without_the_bot_closes_the_conversation(world):
    store, model = world.store, world.model
    host = await world.host()
    await hand_off(host)
    await asyncio.wait_for(host.act(change("resolved", return_to_bot=False)), T)
    asked = len(model.requests)
    assert (await asyncio.wait_for(host.send(turn("hello?", "m1")), T)).reply == CLOSED_REPLY
    assert len(model.requests) == asked
    with pytest.raises(SessionError, match="closed"):
        await asyncio.wait_for(host.act(agent_says("late words")), T)
    assert store.snapshots[KEY].handoff_state == "resolved"
