"""A registered handler may set session variables by returning SetVariables (collect_lead sets the
contact variable this way); the model sees only the result, and nothing is set on failure."""

from __future__ import annotations

from typing import Any

import msgspec

from actors.session import TurnEnv, handle_message, new_state
from services.botconfig import BotConfig
from services.llm.port import (
    LLMRequest,
    LLMResponse,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
    Usage,
)
from services.tools.errors import InvalidArguments
from services.tools.executor import Executor
from services.tools.model import PythonTool
from services.tools.registry import HandlerRegistry, SetVariables, build_catalog
from tests.support.fakes import StreamScriptedLLM

SCHEMA = {"type": "object", "properties": {"email": {"type": "string"}}}


class OneCallLLM(StreamScriptedLLM):
    """Calls `tool` once with `args`, then answers with text."""

    def __init__(self, tool: str, args: dict[str, Any]) -> None:
        self.tool, self.args = tool, args
        self.requests: list[LLMRequest] = []

    async def stream(self, request: LLMRequest):
        self.requests.append(request)
        if len(self.requests) == 1:
            content = [ToolUseBlock(id="call_1", name=self.tool, input=self.args)]
            stop = "tool_use"
        else:
            content, stop = [TextBlock(text="done")], "end_turn"
        yield LLMResponse(content=content, stop_reason=stop, usage=Usage(input_tokens=1, output_tokens=1),
                          model=request.model)


def env_for(llm, registry: HandlerRegistry) -> TurnEnv:
    tools = [PythonTool(name="save", description="save it", parameters=SCHEMA, handler="save",
                        completes_variable="saved")]
    catalog = build_catalog([], [(t, 1) for t in tools], registry=registry, backend=None)
    return TurnEnv(llm=llm, executor=Executor(), catalog=catalog, config=BotConfig(), main_model="m",
                   cheap_model="c")


async def test_set_variables_result_sets_session_variables_and_the_model_sees_only_the_result():
    registry = HandlerRegistry()

    @registry.register("save")
    async def save(args, ctx):
        return SetVariables(result={"status": "saved"}, variables={"contact_id": args["email"]})

    llm = OneCallLLM("save", {"email": "jane@example.com"})
    state = new_state("t1", "s1")
    reply = await handle_message(state, "save me", "m1", env_for(llm, registry))

    assert reply.tool_calls[0].success
    assert state.variables == {"contact_id": "jane@example.com", "saved": "true"}
    delta = state.take_delta()
    assert delta is not None and delta.variables["contact_id"] == "jane@example.com"
    result = next(b for b in llm.requests[1].messages[-1].content if isinstance(b, ToolResultBlock))
    assert msgspec.json.decode(result.content) == {"status": "saved"}
    assert delta.tool_calls[0].result == {"status": "saved"}


async def test_a_failing_handler_sets_no_variables():
    registry = HandlerRegistry()

    @registry.register("save")
    async def save(args, ctx):
        raise InvalidArguments("'email' is not a valid email address")

    state = new_state("t1", "s1")
    reply = await handle_message(state, "save me", "m1", env_for(OneCallLLM("save", {"email": "x"}), registry))

    assert not reply.tool_calls[0].success
    assert state.variables == {}
