"""Each turn is a trace: turn -> round -> tool call, with attributes; call records carry the id."""

from __future__ import annotations

from actors.session import TurnEnv, handle_message, new_state
from services.botconfig import BotConfig
from services.tools.executor import Executor
from services.tools.model import PythonTool
from services.tools.registry import HandlerRegistry, build_catalog
from tests.support import tracing
from tests.support.turns import ScriptedLLM

spans = tracing.spans  # the fixture


async def test_a_turn_is_one_trace_of_rounds_and_tool_calls_with_redacted_arguments(spans):
    registry = HandlerRegistry()

    @registry.register("pay")
    async def pay(args, ctx):
        return {"paid": True}

    tool = PythonTool(name="pay", description="pay", handler="pay", sensitive=("card",),
                      parameters={"type": "object", "properties": {"card": {"type": "string"}, "amount": {"type": "integer"}}})
    catalog = build_catalog([], [(tool, 1)], registry=registry, backend=None)
    env = TurnEnv(llm=ScriptedLLM([[("pay", {"card": "4111111111111111", "amount": 5})], "paid"]),
                  executor=Executor(), catalog=catalog, config=BotConfig(), main_model="main", cheap_model="cheap")
    state = new_state("t1", "s1")
    await handle_message(state, "pay", "m1", env)
    finished = {s.name: s for s in spans.get_finished_spans()}
    turn, tool_span = finished["turn"], finished["tool_call"]
    rounds = [s for s in spans.get_finished_spans() if s.name == "round"]
    assert len(rounds) == 2 and all(r.parent.span_id == turn.context.span_id for r in rounds)
    assert tool_span.parent.span_id == rounds[0].context.span_id
    assert {s.context.trace_id for s in spans.get_finished_spans()} == {turn.context.trace_id}
    assert tool_span.attributes["ce.outcome"] == "success" and "ce.queue_ms" in tool_span.attributes
    assert "4111111111111111" not in tool_span.attributes["ce.arguments"] and "[redacted]" in tool_span.attributes["ce.arguments"]
    assert turn.attributes["ce.rounds"] == 2 and rounds[0].attributes["ce.model"] == "main"
    record = state.take_delta().tool_calls[0]
    assert record.trace_id == format(turn.context.trace_id, "032x")


async def test_a_tool_spans_arguments_hide_secret_looking_names_the_tool_did_not_declare(spans):
    registry = HandlerRegistry()

    @registry.register("login")
    async def login(args, ctx):
        return {"ok": True}

    tool = PythonTool(name="login", description="login", handler="login",
                      parameters={"type": "object", "properties": {"user": {"type": "string"},
                                                                   "password": {"type": "string"}}})
    catalog = build_catalog([], [(tool, 1)], registry=registry, backend=None)
    env = TurnEnv(llm=ScriptedLLM([[("login", {"user": "ana", "password": "hunter2-long"})], "in"]),
                  executor=Executor(), catalog=catalog, config=BotConfig(), main_model="main", cheap_model="cheap")
    await handle_message(new_state("t1", "s1"), "sign me in", "m1", env)
    (tool_span,) = [s for s in spans.get_finished_spans() if s.name == "tool_call"]
    assert tool_span.attributes["ce.arguments"] == '{"user":"ana","password":"[redacted]"}'


def test_the_mcp_sdk_cannot_log_a_tenant_servers_answer():
    # it logs an unparsable answer with its body at ERROR; the engine logs the failure without it
    # (in a process of its own: configure_logging sets process-wide state)
    import subprocess
    import sys

    check = ("import logging; from services.logging import configure_logging; configure_logging(); "
             "sdk = logging.getLogger('mcp.client.streamable_http'); "
             "assert not sdk.isEnabledFor(logging.ERROR) and sdk.isEnabledFor(logging.CRITICAL)")
    subprocess.run([sys.executable, "-c", check], check=True, timeout=60)


def test_no_mcp_sdk_logger_can_log_a_servers_payload_after_configure_logging():
    # mcp/client/session.py logs under "client" (a notification that fails validation: WARNING,
    # exc_info, pydantic's input_value from the server's payload) and mcp.shared.* log handler
    # errors with exc_info; before, only "mcp.client" was quieted. Every logger the SDK's modules
    # hold, found by walking them (a renamed logger is caught), in a process of its own.
    import subprocess
    import sys

    check = """
import logging, sys
import services.tools.mcp_client, mcp.client.session, mcp.shared.jsonrpc_dispatcher, mcp.shared.dispatcher
from services.logging import configure_logging
configure_logging()
held = {m.logger.name for name, m in list(sys.modules.items())
        if name.split(".")[0] == "mcp" and isinstance(getattr(m, "logger", None), logging.Logger)}
assert {"client", "mcp.shared.jsonrpc_dispatcher", "mcp.shared.dispatcher"} <= held, held
loud = sorted(n for n in held if logging.getLogger(n).isEnabledFor(logging.WARNING))
assert not loud, loud
assert logging.getLogger("services.tools.mcp_client").isEnabledFor(logging.WARNING)  # the engine's own
"""
    subprocess.run([sys.executable, "-c", check], check=True, timeout=60)
