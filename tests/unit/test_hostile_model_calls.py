"""What a hostile or broken model sends, through the pure session loop (ScriptedLLM, no I/O):
arguments nested thousands of levels deep, and a forged approval id that is not ASCII."""

from __future__ import annotations

import pytest

from actors.session import SessionError, handle_approval, handle_message, new_state
from services.tools.executor import MAX_ARGUMENT_DEPTH
from tests.support import turns
from tests.support.turns import LOOKUP, WRITE, ScriptedLLM, make_env

registry = turns.registry  # the fixture


def nested(levels: int) -> object:
    value: object = "x"
    for _ in range(levels):
        value = {"a": value}
    return value


@pytest.mark.parametrize("name", ["no_such_tool", "lookup"])
async def test_arguments_nested_past_the_limit_are_refused_in_band_and_not_kept(registry, name):
    # before: recording the call redacted its arguments recursively and ran out of stack at ~550
    # levels (4 KB of JSON): the turn failed with a 500
    llm = ScriptedLLM([[(name, {"q": nested(700)})], "sorry, let me ask again"])
    state = new_state("t1", "s1")
    reply = await handle_message(state, "hi", "m1", make_env(llm, registry, [LOOKUP]))
    assert reply.reply == "sorry, let me ask again" and registry.calls == []
    [call] = reply.tool_calls
    assert not call.success and f"more than {MAX_ARGUMENT_DEPTH} levels" in call.error
    delta = state.take_delta()
    [record] = delta.tool_calls
    assert record.parameters == {"_": f"the arguments nested more than {MAX_ARGUMENT_DEPTH} levels deep and were "
                                      "not kept"}


async def test_arguments_at_the_limit_are_checked_as_usual(registry):
    llm = ScriptedLLM([[("lookup", {"q": nested(MAX_ARGUMENT_DEPTH - 1)})], "done"])
    state = new_state("t1", "s1")
    reply = await handle_message(state, "hi", "m1", make_env(llm, registry, [LOOKUP]))
    [call] = reply.tool_calls
    assert "levels" not in (call.error or "") and "invalid arguments" in call.error  # the schema's own answer


async def test_a_forged_non_ascii_approval_id_is_not_found_with_a_turn_held(registry):
    # no approval keys configured: the id is compared with the held one; before, TypeError (a 500)
    state = new_state("t", "s")
    env = make_env(ScriptedLLM([[("book", {"q": "10:00"})], "booked"]), registry, [WRITE])
    held = await handle_message(state, "book 10", "m1", env)
    assert held.pending_approval is not None
    with pytest.raises(SessionError) as info:
        await handle_approval(state, "apr_é" + held.pending_approval.approval_id[5:], True, env)
    assert info.value.kind == "not_found" and registry.calls == []


async def test_a_tool_call_id_repeated_in_one_answer_is_made_unique(registry):
    # before: both calls and both results went back to the model under one id (a model API
    # refuses that conversation), and approvals keyed by id mixed the two calls up
    from services.llm.port import LLMResponse, TextBlock, ToolUseBlock, Usage

    class RepeatsAnId(ScriptedLLM):
        async def stream(self, request):
            self.requests.append(request)
            if len(self.requests) == 1:
                content = [ToolUseBlock(id="same", name="lookup", input={"q": "a"}),
                           ToolUseBlock(id="same", name="lookup", input={"q": "b"})]
            else:
                content = [TextBlock(text="both found")]
            yield LLMResponse(content=content, stop_reason="end_turn", usage=Usage(input_tokens=1, output_tokens=1),
                              model=request.model)

    llm = RepeatsAnId([])
    reply = await handle_message(new_state("t1", "s1"), "hi", "m1", make_env(llm, registry, [LOOKUP]))
    assert reply.reply == "both found" and registry.calls == ["lookup", "lookup"]
    assert [c.id for c in reply.tool_calls] == ["same", "same_2"]
    history = llm.requests[1].messages
    uses = [b.id for m in history for b in m.content if isinstance(b, ToolUseBlock)]
    results = [b.tool_use_id for m in history for b in m.content if hasattr(b, "tool_use_id")]
    assert uses == results == ["same", "same_2"]
