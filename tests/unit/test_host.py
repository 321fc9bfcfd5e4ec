"""The session host with fakes: output gate, group commit, fencing, Postgres away, passivation.

No Postgres, no Ray: `FakeSessionStore` keeps the lease and transaction semantics the host relies
on, and its switches (`hold`, `down`, `fail_next`) stand in for a slow or absent database. Waits
are on Events; every await that could hang is bounded (`asyncio.wait_for(..., 5)`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec
import pytest

from actors.host import LeaseLost
from kernel.errors import ChatEngineError, Overloaded
from services.llm.port import ToolResultBlock, ToolUseBlock
from services.wire import ApprovalDecision, Turn
from tests.support import host_world
from tests.support.host_fakes import FakeSessionStore
from tests.support.host_world import KEY, T, answer, eventually, offer_only_book, spin

world = host_world.world  # the fixture


# -- output gate ---------------------------------------------------------------------------------


async def test_with_the_output_gate_a_reply_waits_for_the_flush_that_holds_its_state(world):
    store = world.store
    store.hold = asyncio.Event()
    host = await world.host(output_gate=True)
    seen_at_return: list[bool] = []
    task = asyncio.create_task(host.send(Turn(tenant_id="t1", session_id="s1", text="hello", message_id="m1")))
    task.add_done_callback(lambda _t: seen_at_return.append("m1" in store.turns[KEY]))

    await asyncio.wait_for(store.flush_entered.wait(), T)
    await spin()
    assert not task.done(), "the reply was released while its flush had not committed"
    assert store.turns[KEY] == {}

    store.hold.set()
    reply = await asyncio.wait_for(task, T)
    assert reply.reply == "echo: hello"
    assert seen_at_return == [True]
    assert not reply.replay
    assert reply.timing is not None and reply.timing.host_ms >= reply.timing.gate_ms > 0
    # stored as the session code made it: the host's timing is only on the reply it released
    assert store.turns[KEY]["m1"] == msgspec.to_builtins(msgspec.structs.replace(reply, timing=None))
    assert "timing" not in store.turns[KEY]["m1"]


async def test_the_reply_says_how_long_its_turn_took_and_how_much_of_it_was_the_gate(world):
    store = world.store
    _host, task = await world.turn_at_the_gate()
    await asyncio.sleep(0.2)  # the flush holding this turn's state takes 200 ms
    store.hold.set()
    timing = (await asyncio.wait_for(task, T)).timing
    assert timing is not None
    assert 200 <= timing.gate_ms <= timing.host_ms

    ungated = await world.host("h2", output_gate=False)
    timing = (await asyncio.wait_for(ungated.send(Turn(tenant_id="t1", session_id="s2", text="hello", message_id="m2")), T)).timing
    assert timing is not None and timing.gate_ms == 0 and timing.host_ms > 0


async def test_a_turn_that_waited_while_its_session_was_passivated_is_timed_across_reactivation(world):
    store = world.store
    store.hold = asyncio.Event()  # every flush waits until the end of the wait below
    host = await world.host(output_gate=False)
    await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="hello", message_id="m1")), T)  # released; its flush held
    entry = host._sessions[KEY]
    passivating = asyncio.create_task(host.passivate("t1", "s1"))  # holds the session until flushed
    await eventually(entry.lock.locked)
    waiting = asyncio.create_task(host.send(Turn(tenant_id="t1", session_id="s1", text="again", message_id="m2")))  # queued behind it
    await eventually(lambda: entry.queued == 1)
    await asyncio.sleep(0.1)
    store.hold.set()
    assert await asyncio.wait_for(passivating, T) is True
    reply = await asyncio.wait_for(waiting, T)  # ran on the session activated again
    assert reply.reply == "echo: again" and len(store.activations) == 2
    assert reply.timing is not None and reply.timing.host_ms >= 100 and reply.timing.gate_ms == 0


async def test_without_the_output_gate_a_reply_does_not_wait_for_the_database(world):
    store = world.store
    store.hold = asyncio.Event()  # every flush hangs until the end of the test
    host = await world.host(output_gate=False)
    reply = await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="hello", message_id="m1")), T)
    assert reply.reply == "echo: hello"
    assert store.turns[KEY] == {}  # not durable yet: the lossy benchmark mode
    store.hold.set()
    await eventually(lambda: "m1" in store.turns[KEY])


async def test_with_the_output_gate_the_session_view_waits_for_what_it_shows_to_be_durable(world):
    # GET /v1/sessions/{id}: a turn set a variable and waits at the gate while its flush is in
    # flight. The view waits with it (before, it showed the variable at once, and a host dying
    # then would have shown the client state that vanished).
    store = world.store
    host, turn = await world.turn_at_the_gate("use collect_lead ada")
    view = asyncio.create_task(host.view("t1", "s1"))
    await spin()
    assert not view.done(), "the view showed state whose flush had not committed"
    store.hold.set()
    shown = await asyncio.wait_for(view, T)
    await asyncio.wait_for(turn, T)
    assert shown.variables == store.variables[KEY] == {"lead_collected": "true"}
    assert shown.messages == store.snapshots[KEY].message_count == 4


async def test_the_session_view_is_503_while_its_state_cannot_be_saved_and_reads_the_store_mid_turn(world):
    store, model = world.store, world.model
    host = await world.host(gate_timeout_s=0.1, max_backoff_s=0.02)
    store.down = True
    with pytest.raises(Overloaded, match="retry with the same message_id"):
        await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="use collect_lead ada", message_id="m1")), T)
    with pytest.raises(Overloaded, match="could not be saved yet") as info:
        await asyncio.wait_for(host.view("t1", "s1"), T)
    assert info.value.reason == "unsaved" and info.value.retry_after > 0
    store.down = False
    assert (await asyncio.wait_for(host.view("t1", "s1"), T)).variables == {"lead_collected": "true"}

    # half a turn in memory (its message taken, its model call running): not shown; the caller
    # reads the stored session, which holds every acknowledged turn
    slow = model.hold("use lookup q")
    turn = asyncio.create_task(host.send(Turn(tenant_id="t1", session_id="s1", text="use lookup q", message_id="m2")))
    await asyncio.wait_for(model.entered("use lookup q").wait(), T)
    assert await asyncio.wait_for(host.view("t1", "s1"), T) is None
    slow.set()
    await asyncio.wait_for(turn, T)
    assert (await asyncio.wait_for(host.view("t1", "s1"), T)).messages == 8


# -- group commit --------------------------------------------------------------------------------


async def test_fifty_sessions_sending_at_once_share_a_few_flushes(world):
    store, model = world.store, world.model
    hold = model.hold("go")
    host = await world.host(flush_interval_s=0.02)
    tasks = [asyncio.create_task(host.send(Turn(tenant_id="t1", session_id=f"s{i}", text="go", message_id=f"m{i}"))) for i in range(50)]
    await eventually(lambda: sum(1 for kind, text in model.log if kind == "enter" and text == "go") == 50)
    hold.set()  # all fifty turns finish in one burst
    replies = await asyncio.wait_for(asyncio.gather(*tasks), T)

    assert [r.reply for r in replies] == ["echo: go"] * 50
    assert all(store.seqs(("t1", f"s{i}")) == [0, 1] for i in range(50))
    assert all(f"m{i}" in store.turns[("t1", f"s{i}")] for i in range(50))
    assert sum(store.deltas_per_flush) == 50
    assert store.commits < 50 // 2, store.deltas_per_flush
    assert max(store.deltas_per_flush) >= 10, store.deltas_per_flush
    assert host.flushes == store.commits and host.flushed_sessions == 50


async def test_a_turn_alone_on_its_host_is_flushed_without_waiting_out_the_group_commit_window(world):
    # A window far longer than the bound: waiting it out would fail the wait_for below.
    host = await world.host(flush_interval_s=60.0)
    for n in range(3):  # each turn alone: each flushed at once, in a transaction of its own
        reply = await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text=f"hello {n}", message_id=f"m{n}")), T)
        assert reply.reply == f"echo: hello {n}"
    assert world.store.deltas_per_flush == [1, 1, 1]
    assert set(world.store.turns[KEY]) == {"m0", "m1", "m2"}


async def test_a_turn_finishing_while_another_runs_waits_for_it_and_both_share_one_flush(world):
    # A window far longer than the bound: the flush must come when the other turn reaches the
    # gate (nothing else is running then), not when the window runs out.
    store, model = world.store, world.model
    slow = model.hold("slow")
    host = await world.host(flush_interval_s=60.0)
    running = asyncio.create_task(host.send(Turn(tenant_id="t1", session_id="s2", text="slow", message_id="m-slow")))
    await asyncio.wait_for(model.entered("slow").wait(), T)
    fast = asyncio.create_task(host.send(Turn(tenant_id="t1", session_id="s1", text="fast", message_id="m-fast")))
    await eventually(lambda: ("exit", "fast") in model.log)
    await spin()
    assert not fast.done(), "a turn was released before the window of the other running turn closed"
    assert store.commits == 0

    slow.set()  # the other turn reaches the gate: one flush holds both, at once
    replies = await asyncio.wait_for(asyncio.gather(fast, running), T)
    assert [r.reply for r in replies] == ["echo: fast", "echo: slow"]
    assert store.deltas_per_flush == [2]


async def test_a_flush_never_takes_a_turn_half_done(world):
    # The session's next message starts while its first waits at the gate: the flush must write
    # the first turn whole and nothing of the second (a host dying then would leave half a turn
    # stored, which a retry of its message id would run again on top of).
    store, model = world.store, world.model
    other, second = model.hold("other"), model.hold("second")
    host = await world.host(flush_interval_s=0.2)
    busy = asyncio.create_task(host.send(Turn(tenant_id="t1", session_id="s2", text="other", message_id="m-other")))  # keeps the window open
    await asyncio.wait_for(model.entered("other").wait(), T)
    first = asyncio.create_task(host.send(Turn(tenant_id="t1", session_id="s1", text="first", message_id="m1")))
    await eventually(lambda: ("exit", "first") in model.log)
    running = asyncio.create_task(host.send(Turn(tenant_id="t1", session_id="s1", text="second", message_id="m2")))
    await asyncio.wait_for(model.entered("second").wait(), T)  # its user message is in memory now
    assert (await asyncio.wait_for(first, T)).reply == "echo: first"  # flushed when the window ran out
    assert store.texts(KEY) == ["first", "echo: first"], "a flush wrote part of a turn in progress"
    second.set()
    other.set()
    assert (await asyncio.wait_for(running, T)).reply == "echo: second"
    await asyncio.wait_for(busy, T)
    assert store.texts(KEY) == ["first", "echo: first", "second", "echo: second"] and store.duplicates == []


def failing_after_tools(model):
    """Make the model client raise (a bug, not an LLMError) once a tool's result comes back;
    returns the scripted stream to put back."""
    scripted = model.stream

    def stream(request):
        if any(isinstance(b, ToolResultBlock) for b in request.messages[-1].content):
            raise RuntimeError("a bug in the turn")
        return scripted(request)

    model.stream = stream
    return scripted


def assert_paired(messages) -> None:
    """As the model API requires: the results of an assistant message's tool calls, each once, all
    in the very next message, and no result anywhere else."""
    for i, m in enumerate(messages):
        results = [b.tool_use_id for b in m.content if isinstance(b, ToolResultBlock)]
        before = messages[i - 1] if i else None
        calls = [b.id for b in before.content if isinstance(b, ToolUseBlock)] if before and before.role == "assistant" else []
        assert sorted(results) == sorted(calls) or (not results and not calls and m.role == "user") \
            or m.role == "assistant", messages
        if m.role == "assistant" and any(isinstance(b, ToolUseBlock) for b in m.content):
            assert i + 1 < len(messages), "a tool call without its result ends the conversation"


async def test_a_turn_that_fails_half_way_is_kept_whole_but_unanswered_and_its_id_runs_anew(world):
    # Something unexpected raises after the tool ran (model and tool errors are answered in-band):
    # what ran is written (the tool did run, the model spent its tokens), nothing is answered.
    store, model = world.store, world.model
    scripted = failing_after_tools(model)
    host = await world.host()
    with pytest.raises(RuntimeError, match="a bug in the turn"):
        await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="use lookup boom", message_id="m1")), T)
    await eventually(lambda: store.seqs(KEY) == [0, 1, 2])  # flushed without waiting for a next turn
    assert store.texts(KEY) == ["use lookup boom"] and "m1" not in store.turns[KEY]
    assert [c.tool_name for c in store.tool_calls[KEY]] == ["lookup"]
    assert store.usage[KEY] == {"main": [10, 3]} and store.snapshots[KEY].message_count == 3
    model.stream = scripted
    assert (await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="hello", message_id="m2")), T)).reply == "echo: hello"
    assert [m.role for m in model.requests[-1].messages] == ["user", "assistant", "user", "user"]
    assert_paired(model.requests[-1].messages)
    # never answered, so the same message id runs again (its tool with the same idempotency key)
    retried = await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="use lookup boom", message_id="m1")), T)
    assert retried.reply.startswith("done: ") and world.calls() == [("lookup", "boom")] * 2
    assert store.seqs(KEY) == list(range(9)) and set(store.turns[KEY]) == {"m1", "m2"}


async def test_a_turn_that_fails_between_a_tool_call_and_its_result_leaves_the_conversation_valid(world, monkeypatch):
    # Without the closing result, every later request would show the model a tool call with no
    # result after it, which the model API refuses: the session would answer nothing again.
    import actors.session as core
    from actors.session import INTERRUPTED_RESULT

    store, model = world.store, world.model

    def broken(*args, **kwargs):
        raise RuntimeError("the executor broke")

    monkeypatch.setattr(core, "_prepare", broken)
    host = await world.host()
    with pytest.raises(RuntimeError, match="the executor broke"):
        await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="use lookup q", message_id="m1")), T)
    monkeypatch.undo()
    assert (await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="hello", message_id="m2")), T)).reply == "echo: hello"
    shown = model.requests[-1].messages
    assert_paired(shown)
    assert [(b.content, b.is_error) for b in shown[2].content] == [(INTERRUPTED_RESULT, True)]
    assert store.seqs(KEY) == [0, 1, 2, 3, 4] and store.texts(KEY) == ["use lookup q", "hello", "echo: hello"]


async def test_an_approval_whose_resumed_turn_failed_stays_decided_and_never_runs_its_tools_twice(world):
    from actors.session import SessionError

    store, tenants, model = world.store, world.tenants, world.model
    offer_only_book(tenants)
    host = await world.host()
    held = await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="use book q", message_id="m0")), T)
    approval = held.pending_approval.approval_id
    scripted = failing_after_tools(model)
    with pytest.raises(RuntimeError, match="a bug in the turn"):
        await asyncio.wait_for(host.decide(ApprovalDecision(tenant_id="t1", session_id="s1", approval_id=approval, approve=True)), T)
    model.stream = scripted
    assert world.calls() == [("lookup", "q")]
    with pytest.raises(SessionError, match="was decided but the turn it resumed stopped"):
        await asyncio.wait_for(host.decide(ApprovalDecision(tenant_id="t1", session_id="s1", approval_id=approval, approve=True)), T)
    assert world.calls() == [("lookup", "q")]
    await eventually(lambda: store.snapshots[KEY].pending is None)
    assert (await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="hello", message_id="m1")), T)).reply == "echo: hello"
    assert_paired(model.requests[-1].messages)
    assert world.calls() == [("lookup", "q")]


async def test_a_turn_that_fails_as_it_holds_calls_for_approval_leaves_no_approval_behind(world):
    # The calls got their closing results: the approval cannot run them too, and the next message
    # does not decline them a second time.

    store, tenants, model = world.store, world.tenants, world.model
    offer_only_book(tenants)
    host = await world.host()

    async def emit(event):
        if event.event == "approval_required":
            raise RuntimeError("the watcher broke")

    with pytest.raises(RuntimeError, match="the watcher broke"):
        await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="use book q", message_id="m0"), emit), T)
    await eventually(lambda: store.seqs(KEY) == [0, 1, 2])
    assert store.snapshots[KEY].pending is None
    assert (await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="hello", message_id="m1")), T)).reply == "echo: hello"
    assert_paired(model.requests[-1].messages)
    assert world.calls() == []


async def test_a_turn_cancelled_half_way_is_kept_and_written(world):
    store, model = world.store, world.model
    model.hold("use lookup q")
    host = await world.host()
    task = asyncio.create_task(host.send(Turn(tenant_id="t1", session_id="s1", text="use lookup q", message_id="m1")))
    await asyncio.wait_for(model.entered("use lookup q").wait(), T)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await eventually(lambda: store.texts(KEY) == ["use lookup q"])
    assert (await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="hello", message_id="m2")), T)).reply == "echo: hello"
    assert store.texts(KEY) == ["use lookup q", "hello", "echo: hello"] and set(store.turns[KEY]) == {"m2"}


async def test_a_message_turn_that_fails_after_taking_over_a_held_approval_closes_its_calls(world, monkeypatch):
    # The new message ends the held calls (declined), then something raises before that is
    # recorded: the held calls get their closing results, never none and never two.
    import actors.session as core

    store, tenants, model = world.store, world.tenants, world.model
    offer_only_book(tenants)
    host = await world.host()
    held = await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="use book q", message_id="m0")), T)
    assert held.pending_approval is not None

    def broken(*args):
        raise RuntimeError("a bug in the turn")

    monkeypatch.setattr(core, "_declined_results", broken)
    with pytest.raises(RuntimeError, match="a bug in the turn"):
        await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="never mind", message_id="m1")), T)
    monkeypatch.undo()
    assert (await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="hello", message_id="m2")), T)).reply == "echo: hello"
    assert_paired(model.requests[-1].messages)
    assert store.snapshots[KEY].pending is None and world.calls() == []


# -- Postgres away -------------------------------------------------------------------------------


async def test_while_the_database_is_down_replies_wait_and_after_it_recovers_all_is_written_once(world):
    store = world.store
    host = await world.host(max_backoff_s=0.02)
    store.down = True
    sessions = [f"s{i}" for i in range(5)]
    tasks = []
    for sid in sessions:  # two turns per session: the second runs while the first waits
        tasks.append(asyncio.create_task(host.send(Turn(tenant_id="t1", session_id=sid, text=f"use collect_lead {sid}", message_id=f"{sid}-a"))))
        tasks.append(asyncio.create_task(host.send(Turn(tenant_id="t1", session_id=sid, text=f"use lookup {sid}", message_id=f"{sid}-b"))))

    await eventually(lambda: store.failed_flushes >= 3 and len(world.tenants.handler_calls) == 10)
    await spin()
    assert not any(t.done() for t in tasks), "a reply was released while nothing was durable"
    assert all(store.messages[("t1", sid)] == [] for sid in sessions)

    store.down = False
    replies = await asyncio.wait_for(asyncio.gather(*tasks), T)
    assert [r.reply for r in replies[:2]] == ['done: {"lead":"saved"}', 'done: {"found":"s0"}']
    assert store.duplicates == []
    for sid in sessions:
        key = ("t1", sid)
        assert store.seqs(key) == list(range(8))  # 4 messages per tool turn, contiguous, once
        assert set(store.turns[key]) == {f"{sid}-a", f"{sid}-b"}
        assert store.variables[key] == {"lead_collected": "true"}
        assert store.snapshots[key].completed == ["collect_lead"]
        assert sorted(c.tool_name for c in store.tool_calls[key]) == ["collect_lead", "lookup"]
        assert store.usage[key] == {"main": [20, 6], "cheap": [20, 6]}
    assert len(world.tenants.handler_calls) == 10  # nothing ran twice


async def test_a_flush_whose_acknowledgement_was_lost_is_retried_and_nothing_is_counted_twice(world):
    # The flush committed, then the connection dropped before its answer: the host cannot tell,
    # so it writes the turn again, joined with the turn that ran meanwhile. Rows are keyed and the
    # tokens guarded by their message seq, so the retry counts nothing twice and loses nothing.
    store = world.store
    host = await world.host()
    store.lose_ack_next = 1
    first = asyncio.create_task(host.send(Turn(tenant_id="t1", session_id="s1", text="use lookup q", message_id="m1")))
    await eventually(lambda: store.failed_flushes == 1)  # committed, unacknowledged: 50 ms of backoff
    second = await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="hello", message_id="m2")), T)
    assert (await asyncio.wait_for(first, T)).reply.startswith("done: ") and second.reply == "echo: hello"
    assert store.skipped_usage, "the retry carried the first turn's tokens again, and they were skipped"
    assert store.usage[KEY] == {"main": [20, 6], "cheap": [10, 3]}
    assert store.duplicates == [] and store.seqs(KEY) == list(range(6)) and set(store.turns[KEY]) == {"m1", "m2"}
    assert [c.tool_name for c in store.tool_calls[KEY]] == ["lookup"]


async def test_a_reply_that_cannot_be_saved_in_time_is_overloaded_and_a_retry_returns_it(world):
    store = world.store
    host = await world.host(gate_timeout_s=0.1, max_backoff_s=0.02)
    store.down = True
    with pytest.raises(Overloaded, match="retry with the same message_id") as info:
        await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="use lookup q1", message_id="m1")), T)
    assert info.value.retry_after > 0
    assert world.calls() == [("lookup", "q1")]

    # still down: the retry is not answered from memory either, and runs nothing
    with pytest.raises(Overloaded, match="retry with the same message_id"):
        await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="use lookup q1", message_id="m1")), T)

    store.down = False
    reply = await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="use lookup q1", message_id="m1")), T)
    assert reply.message_id == "m1" and reply.reply == 'done: {"found":"q1"}'
    assert [c.name for c in reply.tool_calls] == ["lookup"]
    assert world.calls() == [("lookup", "q1")]  # the retry ran no tool again
    assert reply.replay  # the stored answer, marked as a replay for the gateway
    assert store.turns[KEY]["m1"] == msgspec.to_builtins(msgspec.structs.replace(reply, replay=False, timing=None))
    assert store.seqs(KEY) == [0, 1, 2, 3] and store.duplicates == []


async def test_a_retried_message_id_is_not_answered_before_the_first_answer_is_durable(world):
    store = world.store
    host = await world.host(gate_timeout_s=0.1, max_backoff_s=0.02)
    store.down = True
    with pytest.raises(Overloaded):
        await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="hello", message_id="m1")), T)
    # the database comes back, but the flush carrying m1 is still in flight
    store.hold = asyncio.Event()
    store.flush_entered.clear()
    store.down = False
    await asyncio.wait_for(store.flush_entered.wait(), T)
    retry = asyncio.create_task(host.send(Turn(tenant_id="t1", session_id="s1", text="hello", message_id="m1")))
    await spin()
    assert not retry.done(), "the retry was answered while its state was not yet written"
    store.hold.set()
    reply = await asyncio.wait_for(retry, T)
    assert reply.reply == "echo: hello" and "m1" in store.turns[KEY]


async def test_an_idle_session_with_unsaved_state_still_takes_messages_while_the_database_is_down(world):
    store, model = world.store, world.model
    host = await world.host(idle_seconds=0.05, gate_timeout_s=0.1, max_backoff_s=0.02)
    store.down = True
    with pytest.raises(Overloaded):
        await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="first", message_id="m1")), T)
    await asyncio.sleep(0.3)  # several idle sweeps pass over the unsaved session
    assert host.live_sessions == 1  # its state exists only here: it must not be dropped
    second = asyncio.create_task(host.send(Turn(tenant_id="t1", session_id="s1", text="second", message_id="m2")))
    await asyncio.wait_for(model.entered("second").wait(), T)  # not stuck behind a passivation
    store.down = False
    reply = await asyncio.wait_for(second, T)
    assert reply.reply == "echo: second"
    assert store.texts(KEY) == ["first", "echo: first", "second", "echo: second"]
    await eventually(lambda: host.live_sessions == 0)  # passivated once clean


async def test_past_its_session_cap_a_host_passivates_the_least_recently_used_idle_sessions(world):
    # sessions are named by clients: a host must not keep every one until the idle time runs out
    store = world.store
    host = await world.host(max_sessions=10)
    for i in range(14):
        await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id=f"s{i}", text="hello", message_id=f"m{i}")), T)
    assert host.live_sessions == 14  # the sweep, every few seconds, brings it down
    assert await host.sweep(cutoff=0.0) == 5  # the 4 over the cap, and a tenth of it more
    assert sorted(k[1] for k in host._sessions) == sorted(f"s{i}" for i in range(5, 14))
    assert all(f"m{i}" in store.turns[("t1", f"s{i}")] for i in range(14))  # written, nothing lost
    reply = await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s0", text="again", message_id="m20")), T)  # re-activated from the store
    assert reply.reply == "echo: again" and store.texts(("t1", "s0"))[:2] == ["hello", "echo: hello"]
    assert await host.sweep(cutoff=0.0) == 0  # at the cap: nothing more


# -- fencing -------------------------------------------------------------------------------------


async def test_a_takeover_by_another_host_refuses_the_stale_copy_and_the_next_message_reactivates(world):
    store, model = world.store, world.model
    h1 = await world.host("h1")
    h2 = await world.host("h2")
    await asyncio.wait_for(h1.send(Turn(tenant_id="t1", session_id="s1", text="hello", message_id="m1")), T)
    await asyncio.wait_for(h2.send(Turn(tenant_id="t1", session_id="s1", text="from h2", message_id="m2")), T)  # takes the lease: epoch 2
    assert store.epochs[KEY] == 2

    with pytest.raises(LeaseLost, match="taken over by another activation"):
        await asyncio.wait_for(h1.send(Turn(tenant_id="t1", session_id="s1", text="stale", message_id="m3")), T)
    assert store.refused == [(KEY, 1)]
    assert h1.live_sessions == 0  # the stale copy is gone
    assert "stale" not in store.texts(KEY)

    reply = await asyncio.wait_for(h1.send(Turn(tenant_id="t1", session_id="s1", text="again", message_id="m4")), T)
    assert reply.reply == "echo: again"
    assert store.epochs[KEY] == 3 and store.activations[-1] == (KEY, h1.owner, 3)
    seen = [b.text for m in model.requests[-1].messages for b in m.content]
    assert "from h2" in seen  # re-activated from the store, not from the stale memory
    assert store.seqs(KEY) == list(range(6))
    assert store.texts(KEY) == ["hello", "echo: hello", "from h2", "echo: from h2", "again", "echo: again"]


async def test_a_turn_that_ran_on_a_copy_evicted_meanwhile_is_not_reported_as_saved(world):
    store, model = world.store, world.model
    h1 = await world.host("h1")
    await asyncio.wait_for(h1.send(Turn(tenant_id="t1", session_id="s1", text="hello", message_id="m1")), T)
    await store.activate("t1", "s1", "elsewhere")  # another host takes the lease
    slow = model.hold("second")
    first = asyncio.create_task(h1.send(Turn(tenant_id="t1", session_id="s1", text="first", message_id="m2")))
    second = asyncio.create_task(h1.send(Turn(tenant_id="t1", session_id="s1", text="second", message_id="m3")))
    await asyncio.wait_for(model.entered("second").wait(), T)  # runs on the stale copy
    with pytest.raises(LeaseLost):
        await asyncio.wait_for(first, T)  # its flush was refused and the copy evicted
    slow.set()
    with pytest.raises(LeaseLost):
        await asyncio.wait_for(second, T)
    assert "second" not in store.texts(KEY)


async def test_a_turn_finished_while_the_refused_flush_was_in_flight_is_not_reported_as_saved(world):
    store, model = world.store, world.model
    h1 = await world.host("h1")
    await asyncio.wait_for(h1.send(Turn(tenant_id="t1", session_id="s1", text="hello", message_id="m1")), T)
    await store.activate("t1", "s1", "elsewhere")  # another host takes the lease
    store.hold = asyncio.Event()
    store.flush_entered.clear()
    first = asyncio.create_task(h1.send(Turn(tenant_id="t1", session_id="s1", text="first", message_id="m2")))
    await asyncio.wait_for(store.flush_entered.wait(), T)  # first's delta is in flight
    second = asyncio.create_task(h1.send(Turn(tenant_id="t1", session_id="s1", text="second", message_id="m3")))
    await eventually(lambda: ("exit", "second") in model.log)  # done, its delta not yet taken
    store.hold.set()  # the flush comes back refused: the copy is evicted
    with pytest.raises(LeaseLost):
        await asyncio.wait_for(first, T)
    with pytest.raises(LeaseLost, match="retry the message"):
        await asyncio.wait_for(second, T)
    assert "second" not in store.texts(KEY)


# -- activation, ordering, admission --------------------------------------------------------------


async def test_twenty_concurrent_first_messages_activate_the_session_once(world):
    store = world.store
    store.activate_hold = asyncio.Event()
    host = await world.host(mailbox=32)
    tasks = [asyncio.create_task(host.send(Turn(tenant_id="t1", session_id="s1", text=f"hi {i}", message_id=f"m{i}"))) for i in range(20)]
    await asyncio.wait_for(store.activate_entered.wait(), T)
    await spin()
    store.activate_hold.set()
    replies = await asyncio.wait_for(asyncio.gather(*tasks), T)
    assert sorted(r.reply for r in replies) == sorted(f"echo: hi {i}" for i in range(20))
    assert [a[0] for a in store.activations] == [KEY]
    assert store.seqs(KEY) == list(range(40)) and store.duplicates == []


async def test_turns_of_one_session_run_one_after_another(world):
    model = world.model
    slow = model.hold("slow")
    host = await world.host()
    first = asyncio.create_task(host.send(Turn(tenant_id="t1", session_id="s1", text="slow", message_id="m1")))
    await asyncio.wait_for(model.entered("slow").wait(), T)
    second = asyncio.create_task(host.send(Turn(tenant_id="t1", session_id="s1", text="fast", message_id="m2")))
    await spin()
    assert not model.entered("fast").is_set(), "a second turn started while the first was running"
    slow.set()
    await asyncio.wait_for(asyncio.gather(first, second), T)
    assert model.log == [("enter", "slow"), ("exit", "slow"), ("enter", "fast"), ("exit", "fast")]


async def test_a_full_mailbox_turns_away_the_flood_and_the_admitted_messages_complete(world):
    model = world.model
    slow = model.hold("busy")
    host = await world.host(mailbox=2)
    running = asyncio.create_task(host.send(Turn(tenant_id="t1", session_id="s1", text="busy", message_id="m0")))
    await asyncio.wait_for(model.entered("busy").wait(), T)
    flood = [asyncio.create_task(host.send(Turn(tenant_id="t1", session_id="s1", text=f"more {i}", message_id=f"m{i + 1}"))) for i in range(10)]
    await eventually(lambda: sum(t.done() for t in flood) >= 8)
    await spin()
    refused = [t for t in flood if t.done()]
    assert len(refused) == 8  # one running + two queued admitted, the rest turned away
    for t in refused:
        with pytest.raises(Overloaded, match="too many messages waiting") as info:
            t.result()
        assert info.value.retry_after > 0
        assert info.value.status == 429  # the caller's own excess
    slow.set()
    admitted = await asyncio.wait_for(asyncio.gather(running, *[t for t in flood if t not in refused]), T)
    assert [r.reply for r in admitted] == ["echo: busy", "echo: more 0", "echo: more 1"]


async def test_a_host_at_capacity_sheds_new_turns_with_503_and_admits_again_when_free(world):
    model = world.model
    slow = model.hold("busy")
    host = await world.host(max_inflight=2)
    running = [asyncio.create_task(host.send(Turn(tenant_id=f"t{i}", session_id=f"s{i}", text="busy", message_id=f"m{i}"))) for i in range(2)]
    await asyncio.wait_for(model.entered("busy").wait(), T)
    with pytest.raises(Overloaded, match="at capacity") as info:
        await host.send(Turn(tenant_id="t3", session_id="s9", text="hello", message_id="m9"))
    assert info.value.status == 503 and info.value.retry_after > 0
    slow.set()
    await asyncio.wait_for(asyncio.gather(*running), T)
    reply = await asyncio.wait_for(host.send(Turn(tenant_id="t3", session_id="s9", text="hello", message_id="m9")), T)
    assert reply.reply == "echo: hello"


async def test_one_tenant_takes_at_most_half_a_host_and_the_others_still_get_in(world):
    # session ids are the tenant's to pick: it could aim every turn at one host
    model = world.model
    slow = model.hold("busy")
    host = await world.host(max_inflight=4)
    running = [asyncio.create_task(host.send(Turn(tenant_id="t1", session_id=f"s{i}", text="busy", message_id=f"m{i}"))) for i in range(2)]
    await eventually(lambda: len(model.requests) == 2)
    with pytest.raises(Overloaded, match="the most one tenant may have there") as info:
        await host.send(Turn(tenant_id="t1", session_id="s9", text="hello", message_id="m9"))
    assert info.value.status == 429 and info.value.reason == "tenant_concurrency"
    other = await asyncio.wait_for(host.send(Turn(tenant_id="t2", session_id="s1", text="hello", message_id="m1")), T)  # another tenant is served
    assert other.reply == "echo: hello"
    slow.set()
    await asyncio.wait_for(asyncio.gather(*running), T)
    assert host._tenant_running == {}  # released, nothing kept per tenant
    reply = await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s9", text="hello", message_id="m9")), T)
    assert reply.reply == "echo: hello"


async def test_a_turn_waiting_on_the_model_holds_no_compute_slot(world):
    # one slot: were it held across the model's answer, the other tenant's turn would wait for it
    slow = world.model.hold("busy")
    host = await world.host(cpu_slots=1)
    waiting = asyncio.create_task(host.send(Turn(tenant_id="t1", session_id="s1", text="busy", message_id="m1")))
    await eventually(lambda: len(world.model.requests) == 1)
    other = await asyncio.wait_for(host.send(Turn(tenant_id="t2", session_id="s1", text="hello", message_id="m1")), T)
    assert other.reply == "echo: hello"
    slow.set()
    assert (await asyncio.wait_for(waiting, T)).reply == "echo: busy"
    assert host._share.running("t1") == host._share.running("t2") == 0 and host._share.waiting() == 0
    assert (host.stats()["share_waiting"], host.stats()["share_overruns"]) == (0, 0)


async def test_a_turns_timing_says_how_long_it_waited_on_the_model_and_for_a_slot(world):
    slow = world.model.hold("busy")
    host = await world.host(cpu_slots=1)
    turn = asyncio.create_task(host.send(Turn(tenant_id="t1", session_id="s1", text="busy", message_id="m1")))
    await eventually(lambda: len(world.model.requests) == 1)
    await asyncio.sleep(0.01)  # the model "thinks": the turn waits on it, holding no slot
    slow.set()
    timing = (await asyncio.wait_for(turn, T)).timing
    assert timing.model_ms >= 10 and timing.upstream_ms == 0.0  # no tool called
    assert 0.0 <= timing.share_ms < timing.model_ms and timing.host_ms >= timing.model_ms


async def test_a_tenant_with_one_session_to_write_is_in_the_next_flush_however_many_another_has(world):
    store, model = world.store, world.model
    hold = model.hold("go")
    host = await world.host(flush_interval_s=0.02, flush_batch=8)
    tasks = [asyncio.create_task(host.send(Turn(tenant_id="t1", session_id=f"s{i}", text="go", message_id=f"m{i}")))
             for i in range(40)]
    await eventually(lambda: sum(1 for kind, text in model.log if kind == "enter" and text == "go") == 40)
    tasks.append(asyncio.create_task(host.send(Turn(tenant_id="t2", session_id="b", text="go", message_id="m1"))))
    await eventually(lambda: sum(1 for kind, text in model.log if kind == "enter" and text == "go") == 41)
    hold.set()  # all 41 turns reach the gate at once: t2's one came last
    await asyncio.wait_for(asyncio.gather(*tasks), T)
    assert sum(store.deltas_per_flush) == 41 and max(store.deltas_per_flush) <= 8, store.deltas_per_flush
    first_with_t1 = next(i for i, keys in enumerate(store.keys_per_flush) if any(k[0] == "t1" for k in keys))
    with_t2 = next(i for i, keys in enumerate(store.keys_per_flush) if ("t2", "b") in keys)
    assert with_t2 <= first_with_t1 + 1, store.keys_per_flush  # not behind t1's five batches


# -- passivation ---------------------------------------------------------------------------------


async def test_an_idle_session_is_flushed_dropped_and_reactivated_with_its_state(world):
    store, model = world.store, world.model
    host = await world.host(idle_seconds=0.05)
    first = await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="use collect_lead ada", message_id="m1")), T)
    assert [c.name for c in first.tool_calls] == ["collect_lead"]
    assert {t.name for t in model.requests[0].tools} == {"lookup", "collect_lead"}

    await eventually(lambda: host.live_sessions == 0)
    assert store.variables[KEY] == {"lead_collected": "true"}

    model.requests.clear()
    reply = await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="hello", message_id="m2")), T)
    assert reply.reply == "echo: hello"
    assert len(store.activations) == 2
    request = model.requests[0]
    assert [t.name for t in request.tools] == ["lookup"]  # the one-shot tool stays done
    assert "use collect_lead ada" in [b.text for m in request.messages for b in m.content if hasattr(b, "text")]
    view = await host.view("t1", "s1")
    assert view is not None and view.variables == {"lead_collected": "true"} and view.messages == 6


async def test_passivating_while_a_flush_is_in_flight_loses_nothing_when_that_flush_fails(world):
    store = world.store
    host = await world.host(max_backoff_s=0.02)
    store.hold = asyncio.Event()
    send = asyncio.create_task(host.send(Turn(tenant_id="t1", session_id="s1", text="hello", message_id="m1")))
    await asyncio.wait_for(store.flush_entered.wait(), T)  # the turn's state is in flight
    passivate = asyncio.create_task(host.passivate("t1", "s1"))
    await spin()
    store.fail_next = 1  # ... and that flush fails; the retry succeeds
    store.hold.set()
    reply = await asyncio.wait_for(send, T)
    assert await asyncio.wait_for(passivate, T) is True
    assert reply.reply == "echo: hello"
    assert store.failed_flushes == 1
    assert "m1" in store.turns[KEY] and store.texts(KEY) == ["hello", "echo: hello"]
    assert host.live_sessions == 0


async def test_a_message_id_answered_before_passivation_returns_the_stored_reply_and_runs_nothing(world):
    store, model = world.store, world.model
    host = await world.host()
    first = await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="use lookup q", message_id="m1")), T)
    assert await host.passivate("t1", "s1") is True
    assert host.live_sessions == 0
    requests, get_turns = len(model.requests), store.get_turn_calls

    again = await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="use lookup q", message_id="m1")), T)
    assert answer(again) == answer(msgspec.structs.replace(first, replay=True))
    # re-activation loads the recent answers, so the retry needs no per-message read
    assert store.get_turn_calls == get_turns and len(store.activations) == 2
    assert len(model.requests) == requests and world.calls() == [("lookup", "q")]
    assert store.seqs(KEY) == [0, 1, 2, 3]


async def test_a_session_lets_go_of_what_a_flush_took_once_it_is_written(world):
    """An idle session holds its state, not also the delta its last flush wrote (a copy of the
    snapshot, the turn's messages, tool calls and answer): with 10,000 cached sessions that was
    about a kilobyte each. A flush that fails still hands its turns back (Postgres away, below)."""
    host = await world.host(output_gate=True)
    await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="use lookup q", message_id="m1")), T)
    state = host._sessions[KEY].state
    assert not state.dirty
    assert state._taken == [] and state._unwritten_turns() == set()

    world.store.down = True  # the next flush fails: its turn is unwritten again, not let go
    ungated = await world.host("h2", output_gate=False)
    await asyncio.wait_for(ungated.send(Turn(tenant_id="t1", session_id="s2", text="hello", message_id="m2")), T)
    other = ungated._sessions[("t1", "s2")].state
    await eventually(lambda: world.store.failed_flushes > 0 and other._taken == [])
    assert other.dirty and other._unwritten_turns() == {"m2"}
    world.store.down = False
    # `dirty` is False as soon as a flush takes the turn; written is when the store holds it (the
    # flusher lets go in the same step, before it next waits)
    await eventually(lambda: "m2" in world.store.turns[("t1", "s2")])
    assert not other.dirty and other._taken == [] and other._unwritten_turns() == set()


async def test_a_message_id_older_than_the_turn_cache_is_looked_up_in_the_store(world):
    from actors.session import TURN_CACHE

    store, model = world.store, world.model
    host = await world.host()
    first = await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="use lookup q", message_id="m0")), T)
    for i in range(1, TURN_CACHE + 1):
        await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="hello", message_id=f"m{i}")), T)
    requests, get_turns = len(model.requests), store.get_turn_calls
    again = await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="use lookup q", message_id="m0")), T)
    assert answer(again) == answer(msgspec.structs.replace(first, replay=True))
    assert store.get_turn_calls == get_turns + 1 and host.stats()["stored_turn_reads"] == 1
    assert len(model.requests) == requests and world.calls() == [("lookup", "q")]


async def test_an_id_made_up_for_the_message_is_not_looked_up_even_past_the_turn_cache(world):
    from actors.session import TURN_CACHE

    store = world.store
    host = await world.host()
    for i in range(TURN_CACHE + 4):  # from the 66th on, the cache has dropped m0: any id may be stored
        await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="hello", message_id=f"m{i}"), new_id=True), T)
    assert store.get_turn_calls == 0
    reply = await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="hello again", message_id="made-up"), new_id=True), T)
    assert not reply.replay and store.get_turn_calls == 0
    events = [e async for e in host.stream(Turn(tenant_id="t1", session_id="s1", text="and again", message_id="made-up-2"), new_id=True)]
    assert events[-1].event == "done" and store.get_turn_calls == 0

    # a client's id (or a retry's) is looked for: it may be the answer to an old message
    await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="hello", message_id="client-id")), T)
    again = await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="hello", message_id="m0")), T)
    assert again.replay and store.get_turn_calls == 2 and host.stats()["stored_turn_reads"] == 2
    for i in range(10):  # old answers read back stay within the cache's bound
        await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="hello", message_id=f"m{i}")), T)
    assert len(host._sessions[KEY].state.turns) <= TURN_CACHE


async def test_an_approval_decided_long_ago_answers_again_from_the_store_and_runs_nothing(world):
    from actors.session import TURN_CACHE

    store, tenants = world.store, world.tenants
    offer_only_book(tenants)
    host = await world.host()
    held = await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="use book q", message_id="m0")), T)
    approval = held.pending_approval.approval_id
    first = await asyncio.wait_for(host.decide(ApprovalDecision(tenant_id="t1", session_id="s1", approval_id=approval, approve=True)), T)
    assert first.reply == "done: {\"found\":\"q\"}" and world.calls() == [("lookup", "q")]
    for i in range(1, TURN_CACHE + 1):  # m0's answer leaves the turn cache
        await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="hello", message_id=f"m{i}")), T)
    assert await host.passivate("t1", "s1") is True
    requests, get_turns = len(world.model.requests), store.get_turn_calls

    again = await asyncio.wait_for(host.decide(ApprovalDecision(tenant_id="t1", session_id="s1", approval_id=approval, approve=False)), T)
    assert answer(again) == answer(msgspec.structs.replace(first, replay=True))
    assert store.get_turn_calls == get_turns + 1 and host.stats()["stored_turn_reads"] == 1
    assert len(world.model.requests) == requests and world.calls() == [("lookup", "q")]
    assert store.duplicates == []  # the held answer gave way to the finished one, once


# -- shutdown ------------------------------------------------------------------------------------


async def test_stop_finishes_the_running_turn_flushes_it_and_turns_later_messages_away(world):
    store, model = world.store, world.model
    host = await world.host(flush_interval_s=30.0)  # only stop() will flush
    slow = model.hold("last words")
    send = asyncio.create_task(host.send(Turn(tenant_id="t1", session_id="s1", text="last words", message_id="m1")))
    await asyncio.wait_for(model.entered("last words").wait(), T)
    stop = asyncio.create_task(host.stop())
    await spin()
    assert not stop.done()
    slow.set()
    await asyncio.wait_for(stop, T)
    reply = await asyncio.wait_for(send, T)
    assert reply.reply == "echo: last words" and "m1" in store.turns[KEY]
    with pytest.raises(Overloaded, match="shutting down") as info:
        await host.send(Turn(tenant_id="t1", session_id="s1", text="anyone?", message_id="m2"))
    assert info.value.retry_after > 0


async def test_a_turn_admitted_just_before_stop_runs_nothing_once_stop_has_begun(world):
    # The turn passed admission, then waited (its tenant's env was reloading) while stop() began.
    # It must not run its tools on a host whose flusher is about to stop: its state could never
    # be saved, and the retry on the next host would run them a second time. It is turned away
    # having run nothing, and stop() waits for it before stopping the flusher.
    store, tenants = world.store, world.tenants
    host = await world.host(output_gate=False, flush_interval_s=30.0)  # only stop() will flush
    await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="warm up", message_id="m0")), T)
    tenants.env_hold, tenants.env_entered = asyncio.Event(), asyncio.Event()
    send = asyncio.create_task(host.send(Turn(tenant_id="t1", session_id="s1", text="use lookup 7", message_id="m1")))
    await asyncio.wait_for(tenants.env_entered.wait(), T)
    stop = asyncio.create_task(host.stop())
    await spin()
    assert not stop.done()  # the admitted turn is still out
    tenants.env_hold.set()
    await asyncio.wait_for(stop, T)
    with pytest.raises(Overloaded, match="shutting down"):
        await asyncio.wait_for(send, T)
    assert world.calls() == [] and "m1" not in store.turns[KEY]
    assert "m0" in store.turns[KEY]


async def test_stop_flushes_state_that_was_not_yet_written(world):
    store, model = world.store, world.model
    slow = model.hold("slow")
    host = await world.host(output_gate=False, flush_interval_s=30.0)
    # another turn running keeps the flusher in its (long) group-commit window
    other = asyncio.create_task(host.send(Turn(tenant_id="t1", session_id="s2", text="slow", message_id="m2")))
    await asyncio.wait_for(model.entered("slow").wait(), T)
    await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="hello", message_id="m1")), T)
    assert store.turns[KEY] == {}
    stopping = asyncio.create_task(host.stop())
    await spin()
    slow.set()
    await asyncio.wait_for(stopping, T)
    assert (await other).reply == "echo: slow"
    assert "m1" in store.turns[KEY] and store.texts(KEY) == ["hello", "echo: hello"]
    assert "m2" in store.turns[("t1", "s2")]


async def test_stop_is_bounded_by_a_turn_stuck_in_a_model_call_and_keeps_what_it_did(world, monkeypatch):
    # The turn's tool ran, then its next model call never answers. stop() gives up waiting after
    # the gate timeout and its grace, cancels the turn (which keeps and writes what it did) and
    # stops; before, it waited for the turn's session lock for ever.
    import actors.host as host_module

    store, model = world.store, world.model
    monkeypatch.setattr(host_module, "STOP_GRACE_S", 0.1)
    host = await world.host(gate_timeout_s=0.1)
    model.hold("")  # the round after the tool result
    turn = asyncio.create_task(host.send(Turn(tenant_id="t1", session_id="s1", text="use lookup q", message_id="m1")))
    await asyncio.wait_for(model.entered("<tool results>").wait(), T)
    await asyncio.wait_for(host.stop(), 2.0)
    with pytest.raises(Overloaded, match="stopped while the turn was still running") as info:
        await asyncio.wait_for(turn, T)
    assert info.value.reason == "shutting_down" and not turn.cancelled()
    assert world.calls() == [("lookup", "q")] and [c.tool_name for c in store.tool_calls[KEY]] == ["lookup"]
    assert store.seqs(KEY) == [0, 1, 2] and "m1" not in store.turns[KEY]  # kept, unanswered: sent again it runs anew


# -- streaming -----------------------------------------------------------------------------------


async def test_stream_yields_tool_events_and_text_then_done_once_durable(world):
    store = world.store
    host = await world.host()
    events = []
    durable_at_done = None
    async with asyncio.timeout(T):
        async for event in host.stream(Turn(tenant_id="t1", session_id="s1", text="use lookup q", message_id="m1")):
            events.append(event)
            if event.event == "done":
                durable_at_done = "m1" in store.turns[KEY]
    assert [e.event for e in events] == ["tool_call", "tool_result", "text", "done"]
    assert events[0].data["name"] == "lookup"
    assert events[-1].data["reply"] == 'done: {"found":"q"}'
    assert events[-1].data["message_id"] == "m1"
    assert durable_at_done is True


async def test_a_stream_whose_turn_fails_raises_its_error_after_the_events_before_it(world):
    # As `send` raises: the router and the gateway then answer it as they answer a JSON turn's error
    store = world.store
    host = await world.host(gate_timeout_s=0.1, max_backoff_s=0.02)
    store.down = True
    events = []
    with pytest.raises(Overloaded, match="retry with the same message_id") as info:
        async with asyncio.timeout(T):
            async for event in host.stream(Turn(tenant_id="t1", session_id="s1", text="use lookup q", message_id="m1")):
                events.append(event.event)
    assert events == ["tool_call", "tool_result", "text"] and info.value.reason == "unsaved"


async def test_a_stream_abandoned_after_its_first_event_still_completes_and_is_saved(world):
    store = world.store
    host = await world.host()
    gen = host.stream(Turn(tenant_id="t1", session_id="s1", text="use lookup q", message_id="m1"))
    first = await asyncio.wait_for(gen.__anext__(), T)
    assert first.event == "tool_call"
    await gen.aclose()
    await eventually(lambda: "m1" in store.turns[KEY])
    assert world.calls() == [("lookup", "q")]
    assert store.seqs(KEY) == [0, 1, 2, 3]


class DataRefused(ChatEngineError):
    """Postgres refusing a value for good (not a lost connection)."""

    retryable = False


def refuse_flushes(store: FakeSessionStore, refused: Callable[[object], bool]) -> None:
    """Make `store` refuse for good every flush holding a delta `refused` picks."""
    real_flush = store.flush

    async def flush(deltas):
        if any(refused(d) for d in deltas):
            raise DataRefused("postgres refused a value")
        return await real_flush(deltas)

    store.flush = flush


async def test_one_sessions_unsavable_data_does_not_hold_the_other_sessions_replies(world):
    from actors.host import TurnNotSaved

    store = world.store
    refuse_flushes(store, lambda d: d.session_id == "bad")
    host = await world.host()
    results = await asyncio.wait_for(asyncio.gather(
        *(host.send(Turn(tenant_id="t1", session_id=f"s{i}", text="hello", message_id=f"m{i}")) for i in range(5)),
        host.send(Turn(tenant_id="t1", session_id="bad", text="hello", message_id="mbad")), return_exceptions=True), T)
    assert [r.reply for r in results[:5]] == ["echo: hello"] * 5  # the others were written
    assert isinstance(results[5], TurnNotSaved) and "send the message again" in str(results[5])
    assert all("m" + str(i) in store.turns[("t1", f"s{i}")] for i in range(5))
    assert ("t1", "bad") not in host._sessions


async def test_a_good_turn_is_kept_when_a_later_turn_of_its_session_is_unsavable(world):
    # m1's first flush fails (a blip); m2 runs meanwhile and its data is refused for good. The
    # two went back as one delta: both were dropped, m1 answered "not saved" though its tool ran
    # (sent again, it would run twice). Turn by turn, m1 is written and answered; m2 is not.
    from actors.host import TurnNotSaved

    store = world.store
    refuse_flushes(store, lambda d: any("POISON" in str(m.content) for m in d.messages))
    host = await world.host()
    store.fail_next = 1
    first = asyncio.create_task(host.send(Turn(tenant_id="t1", session_id="s1", text="use lookup good", message_id="m1")))
    await eventually(lambda: store.failed_flushes == 1)  # m1 back in its session: 50 ms of backoff
    second = asyncio.create_task(host.send(Turn(tenant_id="t1", session_id="s1", text="POISON", message_id="m2")))
    r1, r2 = await asyncio.wait_for(asyncio.gather(first, second, return_exceptions=True), T)
    assert isinstance(r2, TurnNotSaved) and "send the message again" in str(r2)
    assert not isinstance(r1, Exception) and r1.reply == 'done: {"found":"good"}'
    assert set(store.turns[KEY]) == {"m1"} and store.seqs(KEY) == [0, 1, 2, 3]
    assert [c.tool_name for c in store.tool_calls[KEY]] == ["lookup"]
    assert store.usage[KEY] == {"main": [10, 3], "cheap": [10, 3]} and store.duplicates == []
    assert KEY not in host._sessions  # the copy holding m2 is dropped; the session goes on from the store
    again = await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="use lookup good", message_id="m1")), T)
    assert again.replay and world.calls() == [("lookup", "good")]  # m1's tool ran once
