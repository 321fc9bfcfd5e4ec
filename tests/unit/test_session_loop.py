"""The tool loop of seed 000 driven by a scripted model: rounds, breakers, dedup, handoff, usage."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from actors.session import (
    MAX_ROUNDS,
    ROUND_CAP_REPLY,
    handle_approval,
    handle_message,
    new_state,
)
from services.llm.port import (
    ToolResultBlock,
)
from services.tools.model import PythonTool
from services.tools.redaction import REDACTED
from services.wire import StreamEvent
from tests.support import turns
from tests.support.fakes import StreamScriptedLLM
from tests.support.turns import LOOKUP, SCHEMA, WRITE, ScriptedLLM, make_env

registry = turns.registry  # the fixture


BROKEN = PythonTool(name="check_order", description="orders", parameters=SCHEMA, handler="broken")
LEAD = PythonTool(name="collect_lead", description="lead", parameters=SCHEMA, handler="lead",
                  mutability="write", requires_approval=False, completes_variable="lead_collected")
HANDOFF = PythonTool(name="escalate_to_human", description="human", handler="handoff",
                     parameters={"type": "object", "properties": {"reason": {"type": "string"}}})


async def test_zero_tool_rounds_is_one_model_call(registry):
    llm = ScriptedLLM(["hello there"])
    state = new_state("t1", "s1")
    reply = await handle_message(state, "hi", "m1", make_env(llm, registry, [LOOKUP]))
    assert reply.reply == "hello there"
    assert reply.rounds == 1 and reply.tool_calls == []
    assert llm.requests[0].model == "main"
    assert [t.name for t in llm.requests[0].tools] == ["lookup"]


async def test_one_tool_round_injects_result_and_routes_to_cheap_model(registry):
    llm = ScriptedLLM([[("lookup", {"q": "x"})], "done"])
    state = new_state("t1", "s1")
    reply = await handle_message(state, "find x", "m1", make_env(llm, registry, [LOOKUP]))
    assert reply.rounds == 2 and reply.reply == "done"
    assert [c.name for c in reply.tool_calls] == ["lookup"] and reply.tool_calls[0].success
    second = llm.requests[1]
    assert second.model == "cheap"
    result = second.messages[-1].content[0]
    assert isinstance(result, ToolResultBlock) and '"found":"x"' in result.content


async def test_five_rounds_is_the_cap_and_the_last_round_must_answer_in_text(registry):
    llm = ScriptedLLM([[("lookup", {"q": str(i)})] for i in range(4)] + ["final answer"])
    reply = await handle_message(new_state("t", "s"), "go", "m1", make_env(llm, registry, [LOOKUP]))
    assert reply.rounds == MAX_ROUNDS == 5
    assert reply.reply == "final answer"
    assert len(reply.tool_calls) == 4
    assert llm.requests[-1].tool_choice == "none"
    assert all(r.tool_choice == "auto" for r in llm.requests[:-1])


async def test_a_model_that_wants_a_sixth_round_never_gets_it_and_the_contact_gets_a_reply(registry):
    llm = ScriptedLLM([[("lookup", {"q": str(i)})] for i in range(10)])
    reply = await handle_message(new_state("t", "s"), "go", "m1", make_env(llm, registry, [LOOKUP]))
    assert len(llm.requests) == 5
    assert reply.rounds == 5
    assert len(registry.calls) == 4  # the fifth round's calls never run
    assert reply.reply == ROUND_CAP_REPLY


async def test_parallel_calls_in_one_round_all_get_results(registry):
    llm = ScriptedLLM([[("lookup", {"q": "a"}), ("lookup", {"q": "b"})], "ok"])
    reply = await handle_message(new_state("t", "s"), "go", "m1", make_env(llm, registry, [LOOKUP]))
    results = llm.requests[1].messages[-1].content
    assert [r.tool_use_id for r in results] == ["call_1_0", "call_1_1"]
    assert len(reply.tool_calls) == 2


async def test_breaker_trips_on_third_failure_and_the_fourth_message_does_not_offer_the_tool(registry):
    state = new_state("t", "s")
    for i in range(3):
        llm = ScriptedLLM([[("check_order", {"q": "1"})], "sorry"])
        reply = await handle_message(state, f"order? {i}", f"m{i}", make_env(llm, registry, [BROKEN, LOOKUP]))
        assert reply.tool_calls[0].error.startswith("Tool 'check_order' failed: upstream error (500).")
    assert state.open_breakers() == ["check_order"]
    llm = ScriptedLLM(["no tool"])
    await handle_message(state, "order?", "m4", make_env(llm, registry, [BROKEN, LOOKUP]))
    assert [t.name for t in llm.requests[0].tools] == ["lookup"]


async def test_second_message_after_two_failures_still_offers_the_tool(registry):
    state = new_state("t", "s")
    for i in range(2):
        llm = ScriptedLLM([[("check_order", {"q": "1"})], "sorry"])
        await handle_message(state, "order?", f"m{i}", make_env(llm, registry, [BROKEN]))
    llm = ScriptedLLM(["hi"])
    await handle_message(state, "order?", "m3", make_env(llm, registry, [BROKEN]))
    assert [t.name for t in llm.requests[0].tools] == ["check_order"]


async def test_collect_lead_is_not_offered_again_once_it_succeeded(registry):
    state = new_state("t", "s")
    llm = ScriptedLLM([[("collect_lead", {"q": "ada"})], "thanks"])
    await handle_message(state, "I'm Ada", "m1", make_env(llm, registry, [LEAD, LOOKUP]))
    assert state.variables["lead_collected"] == "true"
    llm = ScriptedLLM(["hello again"])
    await handle_message(state, "hi", "m2", make_env(llm, registry, [LEAD, LOOKUP]))
    assert [t.name for t in llm.requests[0].tools] == ["lookup"]


async def test_handoff_marker_in_model_text_marks_session_and_bot_stops_answering(registry):
    state = new_state("t", "s")
    llm = ScriptedLLM(["Let me get someone. [[HANDOFF]]"])
    reply = await handle_message(state, "human please", "m1", make_env(llm, registry, []))
    assert reply.handoff and "[[HANDOFF]]" not in reply.reply
    llm2 = ScriptedLLM(["should not be called"])
    reply2 = await handle_message(state, "hello?", "m2", make_env(llm2, registry, []))
    assert llm2.requests == [] and reply2.handoff and "member of our team" in reply2.reply


async def test_a_handoff_marker_records_the_handoff_as_the_tool_would_once_per_message(registry):
    recorded: list[tuple[dict, str, str]] = []

    async def handoff(args, ctx):
        recorded.append((args, ctx.session_id, ctx.idempotency_key))
        return {"handoff_id": "h1"}

    state = new_state("t", "s")
    env = msgspec.structs.replace(make_env(ScriptedLLM(["One moment. [[HANDOFF]]"]), registry, []), handoff=handoff)
    reply = await handle_message(state, "a person please", "m1", env)
    assert reply.handoff and state.snapshot.handoff_reason == "the assistant asked for a human"
    assert recorded == [({"reason": "the assistant asked for a human"}, "s", "m1")]


async def test_a_marker_after_the_escalation_tool_in_the_same_turn_records_no_second_handoff(registry):
    recorded: list[dict] = []

    async def handoff(args, ctx):
        recorded.append(args)

    state = new_state("t", "s")
    llm = ScriptedLLM([[("escalate_to_human", {"reason": "angry"})], "connecting you [[HANDOFF]]"])
    env = msgspec.structs.replace(make_env(llm, registry, [HANDOFF]), handoff=handoff)
    reply = await handle_message(state, "human", "m1", env)
    assert reply.handoff and state.snapshot.handoff_reason == "angry" and recorded == []


async def test_a_handoff_that_cannot_be_recorded_still_hands_the_session_over(registry):
    async def handoff(args, ctx):
        raise ConnectionError("database away")

    state = new_state("t", "s")
    env = msgspec.structs.replace(make_env(ScriptedLLM(["[[HANDOFF]]"]), registry, []), handoff=handoff)
    reply = await handle_message(state, "human", "m1", env)
    assert reply.handoff and "member of our team" in reply.reply


async def test_escalate_to_human_tool_marks_handoff(registry):
    state = new_state("t", "s")
    llm = ScriptedLLM([[("escalate_to_human", {"reason": "angry"})], "connecting you"])
    reply = await handle_message(state, "human", "m1", make_env(llm, registry, [HANDOFF]))
    assert reply.handoff and state.snapshot.handoff_reason == "angry"


async def test_usage_sums_every_round_per_turn_and_per_model_in_the_delta(registry):
    state = new_state("t", "s")
    llm = ScriptedLLM([[("lookup", {"q": "x"})], "done"])
    reply = await handle_message(state, "x", "m1", make_env(llm, registry, [LOOKUP]))
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (20, 6)
    delta = state.take_delta()
    assert {u.model: (u.input_tokens, u.output_tokens) for u in delta.usage} == {"main": (10, 3), "cheap": (10, 3)}
    assert [m.role for m in delta.messages] == ["user", "assistant", "user", "assistant"]
    assert len(delta.tool_calls) == 1 and delta.tool_calls[0].tool_name == "lookup"
    assert state.take_delta() is None


async def test_repeated_message_id_returns_the_first_answer_and_runs_nothing(registry):
    state = new_state("t", "s")
    llm = ScriptedLLM([[("lookup", {"q": "x"})], "done", "other"])
    env = make_env(llm, registry, [LOOKUP])
    first = await handle_message(state, "x", "m1", env)
    again = await handle_message(state, "x", "m1", env)
    assert again == msgspec.structs.replace(first, replay=True) and not first.replay
    assert len(registry.calls) == 1 and len(llm.requests) == 2


async def test_stream_emits_tool_call_before_final_text_and_done_last(registry):
    events: list[StreamEvent] = []

    async def emit(e):
        events.append(e)

    llm = ScriptedLLM([[("lookup", {"q": "x"})], "final"])
    await handle_message(new_state("t", "s"), "x", "m1", make_env(llm, registry, [LOOKUP]), emit)
    kinds = [e.event for e in events]
    assert kinds == ["tool_call", "tool_result", "text"]  # `done` is the host's, after the gate
    assert llm.completions == 0, "a watched turn streams every model call"


async def test_a_turn_nobody_streams_asks_the_model_for_whole_answers(registry):
    llm = ScriptedLLM([[("lookup", {"q": "x"})], "final"])
    reply = await handle_message(new_state("t", "s"), "x", "m1", make_env(llm, registry, [LOOKUP]))
    assert reply.reply == "final" and reply.rounds == 2
    assert llm.completions == 2


async def test_write_tool_holds_the_turn_until_approved_then_resumes(registry):
    state = new_state("t", "s")
    llm = ScriptedLLM([[("book", {"q": "10:00"})], "booked"])
    env = make_env(llm, registry, [WRITE])
    held = await handle_message(state, "book 10", "m1", env)
    assert held.pending_approval is not None and registry.calls == []
    assert held.pending_approval.summary == ["Run book with q=10:00?"]
    assert held.reply == "Before I go ahead, please confirm:\n- Run book with q=10:00?"
    # the pending approval survives a flush/activation round trip through the snapshot
    snapshot = msgspec.json.decode(msgspec.json.encode(state.snapshot), type=type(state.snapshot))
    assert snapshot.pending["approval_id"] == held.pending_approval.approval_id
    done = await handle_approval(state, held.pending_approval.approval_id, True, env)
    assert registry.calls == ["lookup"] and done.reply == "booked" and done.pending_approval is None
    again = await handle_approval(state, held.pending_approval.approval_id, True, env)  # decided: replayed
    assert again.replay and again.reply == "booked" and registry.calls == ["lookup"]


SECRET_ARGS = {"slot": "10:00", "api_key": "sk_live_APPROVE42", "note": "charge with sk_live_APPROVE42",
               "login": {"user": "ana", "password": "hunter2-pw"}, "card": "4111111111111111"}
SECRET_WRITE = PythonTool(
    name="book_paid", description="book and charge", handler="echo_args", mutability="write", sensitive=("card",),
    parameters={"type": "object", "properties": {
        "slot": {"type": "string"}, "api_key": {"type": "string"}, "note": {"type": "string"},
        "login": {"type": "object"}, "card": {"type": "string"}}},
)


async def test_an_approval_shows_secret_looking_arguments_redacted_and_runs_with_the_real_ones(registry):
    ran: list[dict[str, Any]] = []

    @registry.register("echo_args")
    async def echo_args(args, ctx):
        ran.append(args)
        return {"ok": True}

    state = new_state("t", "s")
    env = make_env(ScriptedLLM([[("book_paid", SECRET_ARGS)], "booked"]), registry, [SECRET_WRITE])
    events: list[StreamEvent] = []

    async def emit(event: StreamEvent) -> None:
        events.append(event)

    held = await handle_message(state, "book and pay", "m1", env, emit)
    [event] = [e for e in events if e.event == "approval_required"]
    shown = {"slot": "10:00", "api_key": REDACTED, "note": f"charge with {REDACTED}",
             "login": {"user": "ana", "password": REDACTED}, "card": REDACTED}
    # the SSE event and the message answer's pending_approval body: the same displayed copy
    assert event.data["calls"][0]["arguments"] == shown
    assert held.pending_approval.calls[0].arguments == shown
    body = msgspec.json.encode(held).decode() + msgspec.json.encode(event.data).decode()
    assert "sk_live_APPROVE42" not in body and "hunter2-pw" not in body and "4111111111111111" not in body
    done = await handle_approval(state, held.pending_approval.approval_id, True, env)
    assert done.reply == "booked"
    assert ran == [SECRET_ARGS]  # only the displayed copy is redacted: the call gets the real values


async def test_denied_approval_goes_back_to_the_model_in_band(registry):
    state = new_state("t", "s")
    llm = ScriptedLLM([[("book", {"q": "10:00"})], "ok, not booked"])
    env = make_env(llm, registry, [WRITE])
    held = await handle_message(state, "book 10", "m1", env)
    done = await handle_approval(state, held.pending_approval.approval_id, False, env)
    assert registry.calls == []
    result = llm.requests[-1].messages[-1].content[0]
    assert result.is_error and "declined" in result.content
    assert done.reply == "ok, not booked"


async def test_llm_failure_still_gives_the_contact_a_reply(registry):
    from services.llm.port import LLMError

    class DownLLM(StreamScriptedLLM):
        async def stream(self, request):
            raise LLMError("connection refused")
            yield  # pragma: no cover

    reply = await handle_message(new_state("t", "s"), "hi", "m1", make_env(DownLLM(), registry, []))
    assert "technical problem" in reply.reply


def test_restore_delta_puts_back_everything_a_failed_flush_held(registry):
    state = new_state("t", "s")
    llm = ScriptedLLM(["a", "b"])
    asyncio.run(handle_message(state, "x", "m1", make_env(llm, registry, [])))
    first = state.take_delta()
    asyncio.run(handle_message(state, "y", "m2", make_env(llm, registry, [])))
    state.restore_delta(first)
    merged = state.take_delta()
    assert [m.seq for m in merged.messages] == [0, 1, 2, 3]
    assert [t.message_id for t in merged.turns] == ["m1", "m2"]


async def test_a_delta_never_holds_a_turn_in_progress_and_sums_whole_turns_tokens(registry):
    state = new_state("t", "s")
    await handle_message(state, "hi", "m1", make_env(ScriptedLLM(["hello"]), registry, []))
    await handle_message(state, "again", "m2", make_env(ScriptedLLM(["hello again"]), registry, []))
    state.set_variable("half", "done")  # a turn in progress: not taken until its answer is
    delta = state.take_delta()
    assert [m.seq for m in delta.messages] == [0, 1, 2, 3] and delta.variables == {}
    assert [(u.model, u.input_tokens, u.through_seq) for u in delta.usage] == [("main", 20, 3)]
    assert state.dirty and state.take_delta() is None
    await handle_message(state, "more", "m3", make_env(ScriptedLLM(["ok"]), registry, []))
    assert state.take_delta().variables == {"half": "done"}


async def test_a_delta_holds_one_answer_per_message_id_the_latest(registry):
    # held, then decided before any flush (output gate off), or a failed flush put back: one
    # statement cannot write the same stored answer twice, and the latest is the one to keep
    state = new_state("t", "s")
    env = make_env(ScriptedLLM([[("book", {"q": "10:00"})], "booked"]), registry, [WRITE])
    held = await handle_message(state, "book 10", "m1", env)
    first = state.take_delta()
    await handle_approval(state, held.pending_approval.approval_id, True, env)
    state.restore_delta(first)
    turns = state.take_delta().turns
    assert [t.message_id for t in turns] == ["m1"] and turns[0].response["reply"] == "booked"
    held = await handle_message(state, "book 11", "m2", make_env(ScriptedLLM([[("book", {"q": "11:00"})]]), registry, [WRITE]))
    await handle_approval(state, held.pending_approval.approval_id, False, make_env(ScriptedLLM(["not booked"]), registry, [WRITE]))
    turns = state.take_delta().turns
    assert [(t.message_id, t.response["reply"]) for t in turns] == [("m2", "not booked")]


async def test_a_restored_deltas_tokens_keep_their_own_seq_so_a_retried_flush_cannot_add_them_twice(registry):
    state = new_state("t", "s")
    await handle_message(state, "hi", "m1", make_env(ScriptedLLM(["hello"]), registry, []))
    first = state.take_delta()
    assert [(u.model, u.through_seq) for u in first.usage] == [("main", 1)]  # seqs 0-1
    state.restore_delta(first)  # its flush failed, or its acknowledgement was lost
    await handle_message(state, "again", "m2", make_env(ScriptedLLM(["hello again"]), registry, []))
    retry = state.take_delta()
    assert [m.seq for m in retry.messages] == [0, 1, 2, 3]
    # not merged into one (main, 20 tokens, seq 3): the store skips what it already holds
    assert [(u.model, u.input_tokens, u.through_seq) for u in retry.usage] == [("main", 10, 1), ("main", 10, 3)]
