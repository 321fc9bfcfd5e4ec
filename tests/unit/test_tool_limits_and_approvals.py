"""Limits per tool, progress, safe retries, output contracts and signed approvals (pure, fakes)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import msgspec
import pytest

from actors.session import (
    DECIDED_KEPT,
    DECIDED_KEY,
    JOBS_KEY,
    SessionError,
    decided_turn,
    handle_approval,
    handle_message,
    new_state,
    remember_decided,
)
from kernel.records import JobRecord, SessionSnapshot
from services.approvals import approval_keys, new_approval_id, verify_approval_id
from services.llm.port import ToolUseBlock
from services.tools.errors import UpstreamStatus, UpstreamTimeout
from services.tools.model import PythonTool
from services.tools.registry import HandlerRegistry
from tests.support.turns import KEYS, ScriptedLLM, env_for

SCHEMA = {"type": "object", "properties": {"q": {"type": "string"}}}


@pytest.fixture
def reg():
    r = HandlerRegistry()
    r.log = []  # type: ignore[attr-defined]
    r.flaky = [UpstreamTimeout("upstream timeout"), UpstreamStatus("upstream error (503)", status=503)]  # type: ignore[attr-defined]

    @r.register("ok")
    async def ok(args, ctx):
        r.log.append(("ok", args.get("q")))
        return {"q": args.get("q"), "text": "x" * 100}

    @r.register("flaky")
    async def flaky(args, ctx):
        r.log.append(("flaky", ctx.idempotency_key))
        if r.flaky:
            raise r.flaky.pop(0)
        return {"ok": True}

    @r.register("slow")
    async def slow(args, ctx):
        await asyncio.sleep(0.3)
        return {"done": True}

    @r.register("running")
    async def running(args, ctx):
        r.log.append(("start", args.get("q")))
        await asyncio.sleep(0.05)
        r.log.append(("end", args.get("q")))
        return {}

    return r


def tool(name, handler, **kw):
    return PythonTool(name=name, description=name, parameters=SCHEMA, handler=handler, **kw)


async def test_calls_beyond_the_per_turn_limit_are_refused_in_band(reg):
    t = tool("lookup", "ok", max_calls_per_turn=2)
    llm = ScriptedLLM([[("lookup", {"q": "1"}), ("lookup", {"q": "2"}), ("lookup", {"q": "3"})], "done"])
    reply = await handle_message(new_state("t", "s"), "go", "m1", env_for(llm, reg, [t]))
    assert [c.success for c in reply.tool_calls] == [True, True, False]
    assert "at most 2 call(s) per message" in reply.tool_calls[2].error
    assert [q for name, q in reg.log] == ["1", "2"]


async def test_the_per_session_limit_stops_calls_and_then_the_offer(reg):
    t = tool("lookup", "ok", max_calls_per_session=1)
    state = new_state("t", "s")
    llm = ScriptedLLM([[("lookup", {"q": "1"})], "ok"])
    await handle_message(state, "a", "m1", env_for(llm, reg, [t]))
    llm = ScriptedLLM([[("lookup", {"q": "2"})], "ok"])
    reply = await handle_message(state, "b", "m2", env_for(llm, reg, [t]))
    # the history holds the first turn's call, so the tool stays defined, its use forbidden
    assert llm.requests[0].tool_choice == "none" and not reply.tool_calls[0].success
    assert "per conversation" in reply.tool_calls[0].error or "allowed" in reply.tool_calls[0].error
    assert len(reg.log) == 1


async def test_max_parallel_bounds_one_tools_concurrency_within_a_round(reg):
    t = tool("fetch", "running", max_parallel=1)
    llm = ScriptedLLM([[("fetch", {"q": "a"}), ("fetch", {"q": "b"})], "ok"])
    await handle_message(new_state("t", "s"), "go", "m1", env_for(llm, reg, [t]))
    assert reg.log == [("start", "a"), ("end", "a"), ("start", "b"), ("end", "b")]


async def test_a_result_over_the_tools_cap_is_truncated_for_the_model_and_kept_whole_in_the_record(reg):
    t = tool("lookup", "ok", max_result_chars=40)
    state = new_state("t", "s")
    llm = ScriptedLLM([[("lookup", {"q": "1"})], "ok"])
    await handle_message(state, "go", "m1", env_for(llm, reg, [t]))
    seen = llm.requests[1].messages[-1].content[0].content
    assert seen.endswith("characters shown]") and "result truncated: 40 of" in seen
    assert state.take_delta().tool_calls[0].result["text"] == "x" * 100


async def test_a_slow_tool_reports_progress_on_the_stream_before_its_result(reg):
    t = tool("slow_lookup", "slow", progress_message="Still checking your order…")
    events = []

    async def emit(e):
        events.append(e)

    llm = ScriptedLLM([[("slow_lookup", {"q": "1"})], "ok"])
    await handle_message(new_state("t", "s"), "go", "m1", env_for(llm, reg, [t]), emit)
    kinds = [e.event for e in events]
    assert kinds.index("tool_progress") < kinds.index("tool_result")
    progress = events[kinds.index("tool_progress")].data
    assert progress["message"] == "Still checking your order…" and progress["elapsed_ms"] >= 40


async def test_an_idempotent_read_retries_retryable_failures_with_the_same_idempotency_key(reg):
    t = tool("lookup", "flaky", retries=2)
    llm = ScriptedLLM([[("lookup", {"q": "1"})], "ok"])
    reply = await handle_message(new_state("t", "s"), "go", "m1", env_for(llm, reg, [t]))
    assert reply.tool_calls[0].success and len(reg.log) == 3
    assert len({key for _, key in reg.log}) == 1


async def test_a_write_never_retries(reg):
    t = tool("save", "flaky", mutability="write", requires_approval=False, retries=2)
    llm = ScriptedLLM([[("save", {"q": "1"})], "ok"])
    reply = await handle_message(new_state("t", "s"), "go", "m1", env_for(llm, reg, [t]))
    assert not reply.tool_calls[0].success and len(reg.log) == 1


async def test_a_result_breaking_its_output_schema_is_a_contract_failure_in_band(reg):
    t = tool("lookup", "ok", output_schema={"type": "object", "required": ["status"]})
    llm = ScriptedLLM([[("lookup", {"q": "1"})], "ok"])
    reply = await handle_message(new_state("t", "s"), "go", "m1", env_for(llm, reg, [t]))
    assert not reply.tool_calls[0].success
    assert "does not match its declared output schema" in reply.tool_calls[0].error and "status" in reply.tool_calls[0].error


def test_approval_ids_are_signed_for_one_tenants_session():
    approval = new_approval_id(KEYS, "t1", "s1")
    assert verify_approval_id(KEYS, "t1", "s1", approval)
    assert not verify_approval_id(KEYS, "t1", "s2", approval)
    assert not verify_approval_id(KEYS, "t2", "s1", approval)
    assert not verify_approval_id(KEYS, "t1", "s1", approval[:-2] + "AA")
    assert not verify_approval_id(approval_keys(["b" * 44]), "t1", "s1", approval)
    # rotation: a newer first key still verifies ids signed with the older one
    assert verify_approval_id(approval_keys(["b" * 44, "a" * 44]), "t1", "s1", approval)


WRITE = PythonTool(name="book", description="book", parameters=SCHEMA, handler="ok", mutability="write")


async def test_a_forged_approval_id_is_refused_and_runs_nothing(reg):
    state = new_state("t", "s")
    env = env_for(ScriptedLLM([[("book", {"q": "1"})], "ok"]), reg, [WRITE])
    held = await handle_message(state, "book", "m1", env)
    forged = held.pending_approval.approval_id.split(".")[0] + ".forgedforgedforgedforged"
    with pytest.raises(SessionError, match="not valid for this session"):
        await handle_approval(state, forged, True, env)
    assert reg.log == [] and state.snapshot.pending is not None


async def test_a_decided_approval_answers_again_with_its_reply_and_runs_nothing(reg):
    state = new_state("t", "s")
    env = env_for(ScriptedLLM([[("book", {"q": "1"})], "booked", "again"]), reg, [WRITE])
    held = await handle_message(state, "book", "m1", env)
    approval = held.pending_approval.approval_id
    first = await handle_approval(state, approval, True, env)
    assert first.reply == "booked" and not first.replay
    # a client that lost the answer asks again, even with the other decision: the first stands
    again = await handle_approval(state, approval, False, env)
    assert again.replay and again.reply == "booked" and again.tool_calls == first.tool_calls
    assert reg.log == [("ok", "1")]


async def test_a_decided_approval_is_known_after_a_reactivation_and_only_the_latest_are_kept(reg):
    state = new_state("t", "s")
    env = env_for(ScriptedLLM([[("book", {"q": "1"})], "booked"]), reg, [WRITE])
    held = await handle_message(state, "book", "m1", env)
    await handle_approval(state, held.pending_approval.approval_id, True, env)
    # the record travels with the snapshot that is flushed, as a list (jsonb keeps no key order)
    stored = msgspec.json.decode(msgspec.json.encode(state.take_delta().snapshot), type=SessionSnapshot)
    assert decided_turn(stored, held.pending_approval.approval_id) == "m1"
    for n in range(DECIDED_KEPT + 5):
        remember_decided(stored, f"apr_{n}", f"m_{n}")
    assert decided_turn(stored, held.pending_approval.approval_id) is None
    assert decided_turn(stored, "apr_4") is None and decided_turn(stored, "apr_5") == "m_5"
    assert len(stored.extra[DECIDED_KEY]) == DECIDED_KEPT


async def test_a_decision_whose_turn_never_finished_is_refused_not_replayed_as_still_pending(reg):
    state = new_state("t", "s")
    env = env_for(ScriptedLLM([[("book", {"q": "1"})], "booked"]), reg, [WRITE])
    held = await handle_message(state, "book", "m1", env)
    approval = held.pending_approval.approval_id
    # what a host that stopped mid-resume leaves saved: decided, but the answer is the held one
    state.snapshot.pending = None
    remember_decided(state.snapshot, approval, "m1")
    with pytest.raises(SessionError, match="stopped before it finished"):
        await handle_approval(state, approval, True, env)
    assert reg.log == []


async def test_a_job_delivered_to_a_held_turn_is_in_its_final_answer_too(reg):
    state = new_state("t", "s")
    env = env_for(ScriptedLLM([[("book", {"q": "1"})], "booked"]), reg, [WRITE])
    state.snapshot.extra[JOBS_KEY] = ["j1"]
    job = JobRecord(id="j1", tenant_id="t", session_id="s", tool_name="export", status="succeeded", result={"n": 1})
    held = await handle_message(state, "book", "m1", env, finished_jobs=[job])
    assert [d["job_id"] for d in held.deliveries] == ["j1"] and state.snapshot.extra[JOBS_KEY] == []
    # the answer stored for m1 becomes the final one: it must still carry the delivery
    done = await handle_approval(state, held.pending_approval.approval_id, True, env)
    assert [d["job_id"] for d in done.deliveries] == ["j1"]
    assert [d["job_id"] for d in state.turns["m1"]["deliveries"]] == ["j1"]


async def test_an_approval_never_decided_is_refused_once_a_newer_message_replaced_it(reg):
    state = new_state("t", "s")
    env = env_for(ScriptedLLM([[("book", {"q": "1"})], "moved on", "again"]), reg, [WRITE])
    held = await handle_message(state, "book", "m1", env)
    await handle_message(state, "never mind", "m2", env)
    with pytest.raises(SessionError, match="no pending approval"):
        await handle_approval(state, held.pending_approval.approval_id, True, env)
    assert reg.log == []


async def test_an_expired_approval_ends_in_an_in_band_result_and_runs_nothing(reg):
    state = new_state("t", "s")
    llm = ScriptedLLM([[("book", {"q": "1"})], "it expired"])
    env = env_for(llm, reg, [WRITE], approval_ttl_s=60)
    held = await handle_message(state, "book", "m1", env)
    later = datetime.now(UTC) + timedelta(seconds=61)
    done = await handle_approval(state, held.pending_approval.approval_id, True, env, now=later)
    assert reg.log == [] and "expired" in done.tool_calls[0].error


async def test_the_approver_may_edit_arguments_which_are_validated_before_anything_runs(reg):
    state = new_state("t", "s")
    env = env_for(ScriptedLLM([[("book", {"q": "1"})], "ok"]), reg, [WRITE])
    held = await handle_message(state, "book", "m1", env)
    call_id = msgspec.convert(state.snapshot.pending, dict)["calls"][0]["id"]
    done = await handle_approval(state, held.pending_approval.approval_id, True, env,
                                 edited_arguments={call_id: {"q": 42}})
    assert reg.log == [] and "'q'" in done.tool_calls[0].error  # 42 is not a string: refused in-band
    state2 = new_state("t", "s2")
    env2 = env_for(ScriptedLLM([[("book", {"q": "1"})], "ok"]), reg, [WRITE])
    held2 = await handle_message(state2, "book", "m1", env2)
    call_id2 = msgspec.convert(state2.snapshot.pending, dict)["calls"][0]["id"]
    await handle_approval(state2, held2.pending_approval.approval_id, True, env2, edited_arguments={call_id2: {"q": "2"}})
    assert reg.log == [("ok", "2")]


async def test_a_turn_stopped_while_its_tools_run_keeps_what_finished_and_closes_the_rest(reg):
    # A host stopping cancels a turn stuck in a tool: the write that finished is recorded with its
    # real result (its effect is real: a later turn must not book again blind), the stuck call
    # gets a result saying it may have run, and the conversation stays valid for the model API.
    book = tool("book", "ok", mutability="write", requires_approval=False)
    state = new_state("t", "s")
    llm = ScriptedLLM([[("book", {"q": "1"}), ("slow_lookup", {"q": "2"})], "never asked"])
    task = asyncio.create_task(handle_message(state, "go", "m1", env_for(llm, reg, [book, tool("slow_lookup", "slow")])))
    async with asyncio.timeout(5):
        while reg.log != [("ok", "1")]:
            await asyncio.sleep(0.005)
    await asyncio.sleep(0.05)  # the slow lookup is running now
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    closing = state.history[-1]
    assert closing.role == "user" and [b.tool_use_id for b in closing.content] == [
        b.id for b in state.history[-2].content if isinstance(b, ToolUseBlock)]
    booked, lookup = closing.content
    assert not booked.is_error and '"q":"1"' in booked.content
    assert lookup.is_error and "may have run" in lookup.content
    state.close_failed_turn()  # what the host does next: nothing left unanswered, the turn is sealed
    delta = state.take_delta()
    assert [(c.tool_name, c.success) for c in delta.tool_calls] == [("book", True), ("slow_lookup", False)]
    assert [m.role for m in delta.messages] == ["user", "assistant", "user"]
