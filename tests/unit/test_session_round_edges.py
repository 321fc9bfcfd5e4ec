"""Edges of a turn's rounds (pure, fakes): what a round defines when nothing may be offered, which
calls count toward a tool's limits, what the turn cache keeps while turns are not written."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from actors.session import (
    CALLS_KEY,
    NO_TOOL_SPEC,
    TURN_CACHE,
    handle_approval,
    handle_message,
    new_state,
)
from services.botconfig import BotConfig
from services.llm.port import ToolResultBlock, ToolUseBlock
from services.tools.errors import InvalidArguments, PolicyDenied, ToolCrashed, UpstreamStatus
from services.tools.model import PythonTool
from services.tools.registry import HandlerRegistry
from tests.support.turns import ScriptedLLM, env_for

OPEN = {"type": "object", "properties": {"q": {"type": "string"}}}
CODE = {"type": "object", "properties": {"q": {"type": "string", "minLength": 3}}, "required": ["q"]}


@pytest.fixture
def reg() -> HandlerRegistry:
    r = HandlerRegistry()
    r.ran = []  # type: ignore[attr-defined]

    def handler(name, result=None, error=None, sleep=0.0):
        @r.register(name)
        async def run(args, ctx):
            r.ran.append((name, args.get("q")))
            if sleep:
                await asyncio.sleep(sleep)
            if error is not None:
                raise error
            return result or {"q": args.get("q")}

    handler("ok")
    handler("lead", {"lead": "saved"})
    handler("bad_input", error=InvalidArguments("'q' is not a known code", advice="Ask for the code."))
    handler("not_allowed", error=PolicyDenied("not for this customer", advice="Help another way."))
    handler("crashes", error=ToolCrashed("internal error in the tool"))
    handler("upstream_500", error=UpstreamStatus("upstream error (500)", status=500))
    handler("slow", sleep=0.2)
    return r


def tool(name, handler="ok", parameters=OPEN, **kw) -> PythonTool:
    return PythonTool(name=name, description=name, parameters=parameters, handler=handler, **kw)


#: a one-shot write (seed 000's dedup): once done it is offered no more in the session
LEAD = tool("collect_lead", "lead", mutability="write", requires_approval=False, completes_variable="lead_collected")


def names(request) -> list[str]:
    return [t.name for t in request.tools]


def has_tool_blocks(request) -> bool:
    return any(isinstance(b, (ToolUseBlock, ToolResultBlock)) for m in request.messages for b in m.content)


# -- a round with nothing to offer still defines tools -----------------------------------------


async def test_when_the_only_tool_is_used_up_the_next_rounds_define_it_and_forbid_its_use(reg):
    # The Messages API refuses tool_use/tool_result blocks in a request that defines no tools.
    state = new_state("t", "s")
    llm = ScriptedLLM([[("collect_lead", {"q": "ann@example.com"})], "Thanks, saved."])
    reply = await handle_message(state, "I'm Ann", "m1", env_for(llm, reg, [LEAD]))
    assert reply.reply == "Thanks, saved."
    assert has_tool_blocks(llm.requests[1])
    assert (names(llm.requests[1]), llm.requests[1].tool_choice) == (["collect_lead"], "none")
    llm = ScriptedLLM(["We open at nine."])
    await handle_message(state, "when do you open?", "m2", env_for(llm, reg, [LEAD]))
    assert (names(llm.requests[0]), llm.requests[0].tool_choice) == (["collect_lead"], "none")


async def test_a_call_made_anyway_where_tools_are_forbidden_is_refused_and_never_runs(reg):
    llm = ScriptedLLM([[("collect_lead", {"q": "a"})], [("collect_lead", {"q": "again"})], "Saved."])
    reply = await handle_message(new_state("t", "s"), "I'm Ann", "m1", env_for(llm, reg, [LEAD]))
    assert llm.requests[1].tool_choice == "none"
    assert reg.ran == [("lead", "a")]
    assert [c.success for c in reply.tool_calls] == [True, False]
    assert "already done" in reply.tool_calls[1].error and reply.reply == "Saved."


async def test_history_whose_tools_left_the_catalog_defines_a_placeholder_no_call_may_use(reg):
    state = new_state("t", "s")
    llm = ScriptedLLM([[("lookup", {"q": "7"})], "Found it."])
    await handle_message(state, "where is 7?", "m1", env_for(llm, reg, [tool("lookup")]))
    # the tenant removed its only tool; the history still holds its calls
    llm = ScriptedLLM([[("no_tool_available", {})], "Sorry, I can't look that up now."])
    reply = await handle_message(state, "and 8?", "m2", env_for(llm, reg, []))
    assert (llm.requests[0].tools, llm.requests[0].tool_choice) == ([NO_TOOL_SPEC], "none")
    assert not reply.tool_calls[0].success and "no tool named" in reply.tool_calls[0].error
    assert reg.ran == [("ok", "7")]
    assert "no_tool_available" not in state.snapshot.extra[CALLS_KEY]


async def test_a_tool_the_configuration_hides_is_never_defined_though_the_model_named_it(reg):
    # the model guessed a tool outside the agent's allowlist: refused, and never shown to it later
    lookup, admin = tool("lookup", max_calls_per_turn=1), tool("delete_account")
    turn_env = msgspec.structs.replace(env_for(ScriptedLLM([]), reg, [lookup, admin]),
                                       config=BotConfig(allowlist=("lookup",)))
    llm = ScriptedLLM([[("lookup", {"q": "7"}), ("delete_account", {"q": "7"})], "Done."])
    reply = await handle_message(new_state("t", "s"), "go", "m1", msgspec.structs.replace(turn_env, llm=llm))
    assert [c.success for c in reply.tool_calls] == [True, False] and reg.ran == [("ok", "7")]
    assert (names(llm.requests[1]), llm.requests[1].tool_choice) == (["lookup"], "none")
    # with nothing else named in the history, a placeholder no call may use
    llm = ScriptedLLM([[("delete_account", {"q": "7"})], "Sorry."])
    only_hidden = msgspec.structs.replace(env_for(llm, reg, [admin]), config=BotConfig(allowlist=("lookup",)))
    reply = await handle_message(new_state("t", "s2"), "go", "m1", only_hidden)
    assert (llm.requests[0].tools, llm.requests[0].tool_choice) == ([], "auto")
    assert (llm.requests[1].tools, llm.requests[1].tool_choice) == ([NO_TOOL_SPEC], "none")
    assert not reply.tool_calls[0].success and reg.ran == [("ok", "7")]


# -- per-turn limits in the offer --------------------------------------------------------------


async def test_a_tool_at_its_per_turn_limit_is_left_out_of_the_next_rounds_offer(reg):
    lookup, other = tool("lookup", max_calls_per_turn=1), tool("other")
    llm = ScriptedLLM([[("lookup", {"q": "abc"})], [("lookup", {"q": "def"})], "done"])
    reply = await handle_message(new_state("t", "s"), "go", "m1", env_for(llm, reg, [lookup, other]))
    assert names(llm.requests[0]) == ["lookup", "other"]
    assert (names(llm.requests[1]), llm.requests[1].tool_choice) == (["other"], "auto")
    # called anyway: refused for the same reason, and not run
    assert reg.ran == [("ok", "abc")]
    assert not reply.tool_calls[1].success and "at most 1 call(s) per message" in reply.tool_calls[1].error
    # the next message may call it again
    llm = ScriptedLLM([[("lookup", {"q": "ghi"})], "done"])
    state = new_state("t", "s2")
    await handle_message(state, "go", "m1", env_for(llm, reg, [lookup, other]))
    llm = ScriptedLLM(["hello"])
    await handle_message(state, "again", "m2", env_for(llm, reg, [lookup, other]))
    assert names(llm.requests[0]) == ["lookup", "other"]


async def test_a_turn_held_for_approval_keeps_its_per_turn_counts_past_the_decision(reg):
    lookup = tool("lookup", max_calls_per_turn=1)
    approve_me = tool("refund", mutability="write")
    state = new_state("t", "s")
    llm = ScriptedLLM([[("lookup", {"q": "1"})], [("refund", {"q": "1"})]])
    held = await handle_message(state, "refund order 1", "m1", env_for(llm, reg, [lookup, approve_me]))
    assert held.pending_approval is not None
    assert state.snapshot.pending.get("ran") == {"lookup": 1}
    llm = ScriptedLLM(["Refunded."])
    await handle_approval(state, held.pending_approval.approval_id, True, env_for(llm, reg, [lookup, approve_me]))
    assert names(llm.requests[0]) == ["refund"]
    assert reg.ran == [("ok", "1"), ("ok", "1")]


# -- what counts toward a tool's limits --------------------------------------------------------


async def test_only_calls_that_ran_count_toward_limits_and_made_up_names_are_not_kept(reg):
    tools = [tool("coded", parameters=CODE), tool("bad_input", "bad_input"), tool("not_allowed", "not_allowed"),
             tool("crashes", "crashes"), tool("upstream_500", "upstream_500"), tool("works")]
    batch = [("coded", {"q": "x"}),  # fails the schema: never reaches the handler
             ("bad_input", {"q": "1"}), ("not_allowed", {"q": "1"}),  # the handler refuses: nothing done
             ("crashes", {"q": "1"}), ("upstream_500", {"q": "1"}), ("works", {"q": "1"}),  # they ran
             ("made_up_" + "x" * 60, {})]  # no such tool
    state = new_state("t", "s")
    reply = await handle_message(state, "go", "m1", env_for(ScriptedLLM([batch, "ok"]), reg, tools))
    assert [c.success for c in reply.tool_calls] == [False, False, False, False, False, True, False]
    assert state.snapshot.extra[CALLS_KEY] == {"crashes": 1, "upstream_500": 1, "works": 1}


async def test_a_call_refused_for_its_arguments_leaves_the_per_session_limit_unused(reg):
    coded = tool("lookup", parameters=CODE, max_calls_per_session=1)
    state = new_state("t", "s")
    first = await handle_message(state, "go", "m1", env_for(ScriptedLLM([[("lookup", {"q": "x"})], "Which code?"]),
                                                              reg, [coded]))
    assert "invalid arguments" in first.tool_calls[0].error and reg.ran == []
    llm = ScriptedLLM([[("lookup", {"q": "xyz"})], "ok"])
    second = await handle_message(state, "it is xyz", "m2", env_for(llm, reg, [coded]))
    assert (names(llm.requests[0]), llm.requests[0].tool_choice) == (["lookup"], "auto")
    assert second.tool_calls[0].success and reg.ran == [("ok", "xyz")]


async def test_a_call_refused_for_its_arguments_leaves_the_per_turn_limit_unused(reg):
    coded = tool("lookup", parameters=CODE, max_calls_per_turn=1)
    llm = ScriptedLLM([[("lookup", {"q": "x"})], [("lookup", {"q": "xyz"})], "ok"])
    reply = await handle_message(new_state("t", "s"), "go", "m1", env_for(llm, reg, [coded]))
    assert names(llm.requests[1]) == ["lookup"]
    assert [c.success for c in reply.tool_calls] == [False, True] and reg.ran == [("ok", "xyz")]


async def test_a_declined_call_leaves_the_per_session_limit_unused(reg):
    refund = tool("refund", mutability="write", max_calls_per_session=1)
    state = new_state("t", "s")
    held = await handle_message(state, "refund", "m1", env_for(ScriptedLLM([[("refund", {"q": "1"})]]), reg, [refund]))
    await handle_approval(state, held.pending_approval.approval_id, False,
                          env_for(ScriptedLLM(["Not done."]), reg, [refund]))
    llm = ScriptedLLM(["ok"])
    await handle_message(state, "refund it after all", "m2", env_for(llm, reg, [refund]))
    assert names(llm.requests[0]) == ["refund"] and reg.ran == []
    assert CALLS_KEY not in state.snapshot.extra or state.snapshot.extra[CALLS_KEY] == {}


async def test_a_call_that_never_left_the_queue_leaves_the_per_session_limit_unused(reg):
    # one call at a time, 50 ms each: the first runs past its deadline, the second times out queued
    slow = tool("slow", "slow", timeout_ms=50, max_parallel=1, max_calls_per_session=2)
    state = new_state("t", "s")
    reply = await handle_message(state, "go", "m1", env_for(
        ScriptedLLM([[("slow", {"q": "1"}), ("slow", {"q": "2"})], "ok"]), reg, [slow]))
    assert [c.success for c in reply.tool_calls] == [False, False]
    assert reg.ran == [("slow", "1")]
    assert state.snapshot.extra[CALLS_KEY] == {"slow": 1}
    llm = ScriptedLLM(["ok"])
    await handle_message(state, "again", "m2", env_for(llm, reg, [slow]))
    assert names(llm.requests[0]) == ["slow"]


# -- the turn cache while turns are not written ------------------------------------------------


async def test_the_turn_cache_keeps_every_unwritten_answer_past_its_size(reg):
    state = new_state("t", "s")
    env = env_for(ScriptedLLM([]), reg, [])
    for i in range(TURN_CACHE + 10):  # Postgres away: no flush takes them
        await handle_message(state, f"msg {i}", f"m{i}", env)
    assert len(state.turns) == TURN_CACHE + 10 and state.turns_complete
    taken = state.take_turns()  # a flush takes them and fails: handed back
    await handle_message(state, "one more", "x1", env)
    state.restore_turns(taken)
    await handle_message(state, "and one more", "x2", env)
    assert "m0" in state.turns and len(state.turns) == TURN_CACHE + 12
    again = await handle_message(state, "msg 0", "m0", env)
    assert again.replay
    state.take_turns()  # this flush writes them (nothing handed back) ...
    await handle_message(state, "written?", "x3", env)
    assert "m0" in state.turns  # ... which the state learns when the next flush takes
    state.take_turns()
    await handle_message(state, "now written", "x4", env)
    assert len(state.turns) == TURN_CACHE and "m0" not in state.turns and not state.turns_complete
    assert "x4" in state.turns and "x3" in state.turns
