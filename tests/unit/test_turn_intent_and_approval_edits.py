"""A turn keeps its detected intent across an approval (seed 000: only offer tools relevant to the
detected intent; the model never uses a tool it was not offered), and an approver's edit that sends
back a value shown to them redacted keeps the real value. Driven by a scripted model; no I/O.
"""

from __future__ import annotations

from typing import Any

import msgspec

from actors.session import (
    CALLS_KEY,
    PendingTurn,
    TurnEnv,
    handle_approval,
    handle_message,
    new_state,
)
from services.botconfig import BotConfig, Intent
from services.llm.port import LLMRequest
from services.tools.executor import Executor
from services.tools.model import PythonTool
from services.tools.redaction import REDACTED
from services.tools.registry import HandlerRegistry, build_catalog
from tests.support.turns import ScriptedLLM

SCHEMA = {"type": "object", "properties": {"q": {"type": "string"}}}


LOOKUP = PythonTool(name="lookup_order", description="orders", parameters=SCHEMA, handler="run")
REFUND = PythonTool(name="refund_order", description="refund", parameters=SCHEMA, handler="run",
                    mutability="write")  # held for approval
OTHER = PythonTool(name="delete_account", description="close the account", parameters=SCHEMA, handler="run",
                   mutability="write", requires_approval=False)
ORDERS = BotConfig(intents={"orders": Intent(phrases=("my order",), tools=("lookup_order", "refund_order"))})


def _env(llm, tools=(LOOKUP, REFUND, OTHER), config=ORDERS) -> tuple[TurnEnv, list[tuple[str, dict[str, Any]]]]:
    ran: list[tuple[str, dict[str, Any]]] = []
    reg = HandlerRegistry()

    @reg.register("run")
    async def run(args, ctx):
        ran.append((ctx.idempotency_key, dict(args)))
        return {"ok": True}

    catalog = build_catalog([], [(t, 1) for t in tools], registry=reg, backend=None)
    env = TurnEnv(llm=llm, executor=Executor(), catalog=catalog, config=config,
                  main_model="main", cheap_model="cheap", approval_keys=(b"k" * 32,))
    return env, ran


def offered(request: LLMRequest) -> list[str]:
    return sorted(t.name for t in request.tools)


async def test_the_rounds_after_an_approval_offer_only_the_turns_intent_tools() -> None:
    llm = ScriptedLLM([[("refund_order", {"q": "1"})], "refunded"])
    env, ran = _env(llm)
    state = new_state("t", "s")
    held = await handle_message(state, "refund my order please", "m1", env)
    assert held.pending_approval is not None and ran == []
    # the held turn keeps its intent through the snapshot (a flush and another activation)
    snapshot = msgspec.json.decode(msgspec.json.encode(state.snapshot), type=type(state.snapshot))
    assert msgspec.convert(snapshot.pending, PendingTurn).intent == "orders"
    done = await handle_approval(state, held.pending_approval.approval_id, True, env)
    assert done.reply == "refunded" and len(ran) == 1  # the held call ran: not refused on resume
    assert offered(llm.requests[0]) == offered(llm.requests[1]) == ["lookup_order", "refund_order"]


async def test_a_turn_held_before_the_intent_was_kept_still_resumes() -> None:
    llm = ScriptedLLM([[("refund_order", {"q": "1"})], "refunded"])
    env, ran = _env(llm)
    state = new_state("t", "s")
    held = await handle_message(state, "refund my order please", "m1", env)
    del state.snapshot.pending["intent"]  # as a snapshot written before the field existed
    done = await handle_approval(state, held.pending_approval.approval_id, True, env)
    assert done.reply == "refunded" and len(ran) == 1
    assert offered(llm.requests[1]) == ["delete_account", "lookup_order", "refund_order"]  # as before: no intent


async def test_a_tool_outside_the_intent_named_by_the_model_is_refused_in_band_and_not_counted() -> None:
    llm = ScriptedLLM([[("delete_account", {"q": "x"})], "I can only help with your order."])
    env, ran = _env(llm)
    state = new_state("t", "s")
    reply = await handle_message(state, "where is my order", "m1", env)
    assert offered(llm.requests[0]) == ["lookup_order", "refund_order"]
    assert ran == []
    [summary] = reply.tool_calls
    assert not summary.success and "not offered for what the customer asked" in summary.error
    result = llm.requests[1].messages[-1].content[0]
    assert result.is_error and "use only the tools you were offered" in result.content
    # busy-or-broken bookkeeping untouched: no breaker failure, no call toward its limits
    assert state.snapshot.breakers == {} and "delete_account" not in state.snapshot.extra.get(CALLS_KEY, {})


SECRET_WRITE = PythonTool(
    name="book_paid", description="book and charge", handler="run", mutability="write", sensitive=("card",),
    parameters={"type": "object", "properties": {
        "slot": {"type": "string"}, "api_key": {"type": "string"}, "note": {"type": "string"},
        "login": {"type": "object"}, "card": {"type": "string"}}},
)
SECRET_ARGS = {"slot": "10:00", "api_key": "sk_live_APPROVE42", "note": "charge with sk_live_APPROVE42",
               "login": {"user": "ana", "password": "hunter2-pw"}, "card": "4111111111111111"}


async def test_an_edited_value_sent_back_as_shown_redacted_keeps_the_real_value() -> None:
    env, ran = _env(ScriptedLLM([[("book_paid", SECRET_ARGS)], "booked"]), tools=(SECRET_WRITE,), config=BotConfig())
    state = new_state("t", "s")
    held = await handle_message(state, "book and pay", "m1", env)
    [shown] = held.pending_approval.calls
    # the approver's form sends every field back: the ones shown redacted unchanged, two edited
    edited = {**shown.arguments, "slot": "11:00", "login": {**shown.arguments["login"], "user": "bob"}}
    assert edited["card"] == edited["api_key"] == edited["login"]["password"] == REDACTED
    done = await handle_approval(state, held.pending_approval.approval_id, True, env,
                                 edited_arguments={shown.id: edited})
    assert done.reply == "booked"
    [(_, args)] = ran
    assert args == {**SECRET_ARGS, "slot": "11:00", "login": {"user": "bob", "password": "hunter2-pw"}}


async def test_an_edit_that_replaces_a_redacted_value_runs_with_the_new_value() -> None:
    env, ran = _env(ScriptedLLM([[("book_paid", SECRET_ARGS)], "booked"]), tools=(SECRET_WRITE,), config=BotConfig())
    state = new_state("t", "s")
    held = await handle_message(state, "book and pay", "m1", env)
    [shown] = held.pending_approval.calls
    await handle_approval(state, held.pending_approval.approval_id, True, env,
                          edited_arguments={shown.id: {"card": "5500000000000004", "api_key": REDACTED}})
    [(_, args)] = ran
    assert args == {**SECRET_ARGS, "card": "5500000000000004"}
