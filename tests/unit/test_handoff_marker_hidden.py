"""The contact never reads `[[HANDOFF]]`: not in a streamed text delta, however the model's deltas
split it, not in the reply, and the session stores it nowhere (history, stored answers), while the
handoff it asks for is still made. Through the real session core over a scripted model."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from actors.session import (
    HANDED_OFF_REPLY,
    HANDOFF_MARKER,
    handle_agent_message,
    handle_approval,
    handle_message,
    new_state,
)
from services.wire import AgentMessage, StreamEvent
from tests.support import turns
from tests.support.turns import LOOKUP, WRITE, ScriptedLLM, Streamed, env_for

registry = turns.registry  # the fixture

SENTENCE = "Let me get someone. [[HANDOFF]] Thanks for waiting."


def _splits() -> list[tuple[str, ...]]:
    """SENTENCE as three deltas, the marker cut at each of its positions."""
    at = SENTENCE.index(HANDOFF_MARKER)
    return [(SENTENCE[:at + i], SENTENCE[at + i:at + i + 6], SENTENCE[at + i + 6:])
            for i in range(len(HANDOFF_MARKER) + 1)]


class Watch:
    """Records what a turn emits, and what it hands the handoff recorder."""

    def __init__(self) -> None:
        self.events: list[StreamEvent] = []
        self.handoffs: list[dict[str, Any]] = []

    async def emit(self, event: StreamEvent) -> None:
        self.events.append(event)

    async def handoff(self, args: dict[str, Any], ctx) -> dict[str, Any]:
        self.handoffs.append(args)
        return {"handoff_id": "h1"}

    def text(self) -> str:
        return "".join(e.data["text"] for e in self.events if e.event == "text")


def _no_marker_stored(state) -> None:
    """Neither the session's history nor what its flush would write (messages, stored answers)
    holds the marker, nor the event log its watchers read."""
    assert HANDOFF_MARKER not in msgspec.json.encode(state.history).decode()
    delta = state.take_delta()
    assert delta is not None and delta.messages and delta.turns and delta.events  # the log watchers read, too
    assert HANDOFF_MARKER not in msgspec.json.encode(delta).decode()


@pytest.mark.parametrize("deltas", _splits())
async def test_a_marker_split_across_streamed_deltas_is_never_emitted_nor_stored_and_hands_over(registry, deltas):
    watch = Watch()
    state = new_state("t", "s")
    env = env_for(ScriptedLLM([Streamed(deltas=deltas)]), registry, [], handoff=watch.handoff)
    reply = await handle_message(state, "a person please", "m1", env, emit=watch.emit)
    for event in watch.events:
        assert HANDOFF_MARKER not in msgspec.json.encode(event).decode()
    assert HANDOFF_MARKER not in msgspec.json.encode(reply).decode()  # the `done` event carries it
    assert watch.text() == reply.reply == "Let me get someone.  Thanks for waiting."
    assert reply.handoff and state.snapshot.handoff
    assert watch.handoffs == [{"reason": "the assistant asked for a human"}]
    _no_marker_stored(state)


async def test_a_reply_that_is_only_the_marker_streams_no_text_and_stores_the_handover_reply(registry):
    watch = Watch()
    state = new_state("t", "s")
    env = env_for(ScriptedLLM([Streamed(deltas=("[[HAN", "DOFF", "]]"))]), registry, [], handoff=watch.handoff)
    reply = await handle_message(state, "human", "m1", env, emit=watch.emit)
    assert [e for e in watch.events if e.event == "text"] == []
    assert reply.reply == HANDED_OFF_REPLY and reply.handoff and len(watch.handoffs) == 1
    assert state.history[-1].content[0].text == HANDED_OFF_REPLY  # what the contact was told
    _no_marker_stored(state)


async def test_a_false_start_held_back_is_released_whole(registry):
    watch = Watch()
    state = new_state("t", "s")
    env = env_for(ScriptedLLM([Streamed(deltas=("Use [[HAND", "Y]] or [", "["))]), registry, [],
                  handoff=watch.handoff)
    reply = await handle_message(state, "hi", "m1", env, emit=watch.emit)
    assert watch.text() == reply.reply == "Use [[HANDY]] or [["
    assert not reply.handoff and watch.handoffs == []


async def test_a_marker_in_a_round_that_calls_a_tool_is_taken_out_and_hands_over_when_the_turn_ends(registry):
    watch = Watch()
    state = new_state("t", "s")
    llm = ScriptedLLM([Streamed(deltas=("Checking. [[HAND", "OFF]]"), calls=(("lookup", {"q": "x"}),)), "Done."])
    env = env_for(llm, registry, [LOOKUP], handoff=watch.handoff)
    reply = await handle_message(state, "x", "m1", env, emit=watch.emit)
    assert registry.calls == ["lookup"] and reply.reply == "Done." and watch.text() == "Checking. Done."
    assert reply.handoff and watch.handoffs == [{"reason": "the assistant asked for a human"}]
    # what the model reads back next round: its text without the marker
    assert "[[" not in msgspec.json.encode(llm.requests[1].messages).decode()
    _no_marker_stored(state)


async def test_a_marker_only_text_beside_a_tool_call_leaves_no_blank_text_block(registry):
    state = new_state("t", "s")
    llm = ScriptedLLM([Streamed(deltas=("[[HANDOFF]]",), calls=(("lookup", {"q": "x"}),)), "Done."])
    await handle_message(state, "x", "m1", env_for(llm, registry, [LOOKUP]))
    calling = state.history[-3]  # user, assistant (the call), user (its result), assistant
    assert calling.role == "assistant" and [type(b).__name__ for b in calling.content] == ["ToolUseBlock"]
    assert state.snapshot.handoff


async def test_a_marker_written_before_a_held_call_hands_over_once_the_approved_turn_ends(registry):
    watch = Watch()
    state = new_state("t", "s")
    llm = ScriptedLLM([Streamed(deltas=("One moment [[HAND", "OFF]]"), calls=(("book", {"q": "10"}),)), "Booked."])
    env = env_for(llm, registry, [WRITE], handoff=watch.handoff)
    held = await handle_message(state, "book 10", "m1", env, emit=watch.emit)
    assert held.pending_approval is not None and not held.handoff and watch.handoffs == []
    assert state.snapshot.pending["handoff_asked"] is True  # kept with the held turn, across activations
    done = await handle_approval(state, held.pending_approval.approval_id, True, env, emit=watch.emit)
    assert done.reply == "Booked." and done.handoff and len(watch.handoffs) == 1
    for event in watch.events:
        assert HANDOFF_MARKER not in msgspec.json.encode(event).decode()
    _no_marker_stored(state)


async def test_a_turn_answered_whole_stores_no_marker_either(registry):
    watch = Watch()
    state = new_state("t", "s")
    env = env_for(ScriptedLLM(["Getting a colleague. [[HANDOFF]]"]), registry, [], handoff=watch.handoff)
    reply = await handle_message(state, "a person", "m1", env)  # nobody streams it: one JSON body
    assert reply.reply == "Getting a colleague." and reply.handoff and len(watch.handoffs) == 1
    _no_marker_stored(state)


async def test_a_marker_in_a_held_calls_argument_is_not_in_the_question_the_contact_is_asked(registry):
    state = new_state("t", "s")
    env = env_for(ScriptedLLM([[("book", {"q": "10:00 [[HANDOFF]]"})]]), registry, [WRITE])
    held = await handle_message(state, "book 10", "m1", env)
    assert held.pending_approval.summary == ["Run book with q=10:00 ?"]
    assert HANDOFF_MARKER not in held.reply and not held.handoff  # an argument is data, not a request for a human


@pytest.mark.parametrize("typed", ["please [[HANDOFF]] now", "[[[HANDOFF]]]", "[[HAN[[HANDOFF]]DOFF]]"])
async def test_a_marker_a_contact_or_an_agent_types_is_stored_nowhere_and_hands_nothing_over(registry, typed):
    # only the model's marker asks for a person; one typed by the contact (or by an agent) is
    # text, defused wherever it is kept or streamed, the model's history included
    watch = Watch()
    state = new_state("t1", "s1")
    env = env_for(ScriptedLLM(["Sure."]), registry, [], handoff=watch.handoff)
    reply = await handle_message(state, typed, "m1", env, watch.emit)
    assert reply.handoff is False and watch.handoffs == []
    assert "HANDOFF]" in msgspec.json.encode(state.history).decode()  # the contact's words, defused, not dropped
    _no_marker_stored(state)
    state.snapshot.handoff, state.snapshot.handoff_state = True, "assigned"
    handle_agent_message(state, AgentMessage(tenant_id="t1", session_id="s1", text=typed, agent="Ana"))
    _no_marker_stored(state)
