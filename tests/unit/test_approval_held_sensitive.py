"""A held call's record keeps the values its tool declared sensitive when it was held: a turn held
for approval keeps each call's `sensitive` names, and whatever is recorded of the held calls after
the decision (refused because a tool changed, declined, expired) is redacted with those names and
the current definition's, so a tenant who drops a name from `sensitive`, or removes the tool, while
the approval is pending does not put the contact's email in clear into ce_tool_calls or a trace.
Driven by a scripted model and catalogs built per step; no I/O.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from actors.session import PendingTurn, TurnEnv, handle_approval, handle_message, new_state
from kernel.records import SessionSnapshot
from services.botconfig import BotConfig
from services.tools.executor import Executor
from services.tools.model import PythonTool
from services.tools.redaction import REDACTED
from services.tools.registry import HandlerRegistry, build_catalog
from tests.support import tracing
from tests.support.turns import ScriptedLLM

spans = tracing.spans  # the fixture

KEYS = (b"k" * 32,)
EMAIL = "ana.lopez@example.com"
IBAN = "DE89370400440532013000"
SCHEMA = {"type": "object", "properties": {
    "email": {"type": "string"}, "iban": {"type": "string"}, "amount": {"type": "integer"}}}
ARGS = {"email": EMAIL, "iban": IBAN, "amount": 40}

#: held for approval (a write): the contact's email and IBAN are declared sensitive
PAYOUT = PythonTool(name="send_payout", description="pay out to the contact's account", parameters=SCHEMA,
                    handler="payout", mutability="write", sensitive=("email", "iban"))
#: what the tenant publishes while the approval is pending: the same tool, `sensitive` emptied
PAYOUT_UNMARKED = msgspec.structs.replace(PAYOUT, sensitive=())
#: the same, with a rule the held email breaks: its validator error quotes the value it refuses
PAYOUT_STRICT = msgspec.structs.replace(PAYOUT_UNMARKED, parameters={**SCHEMA, "properties": {
    **SCHEMA["properties"], "email": {"type": "string", "pattern": "^[0-9]+$"}}})
#: an unrelated read held in the same batch: nothing of it is sensitive
LOOKUP = PythonTool(name="lookup_order", description="orders", handler="lookup",
                    parameters={"type": "object", "properties": {"q": {"type": "string"}}})


@pytest.fixture
def ran() -> list[str]:
    return []


@pytest.fixture
def registry(ran) -> HandlerRegistry:
    reg = HandlerRegistry()
    for name in ("payout", "lookup"):
        async def handler(args, ctx, _name=name):
            ran.append(_name)
            return {"ok": True}

        reg.register(name)(handler)
    return reg


def env_with(llm, registry: HandlerRegistry, tools: list[tuple[PythonTool, int]], ttl_s: float = 900.0) -> TurnEnv:
    """The env a turn gets with the tenant's catalog as published now (`tools`: definition, version)."""
    catalog = build_catalog([], tools, registry=registry, backend=None)
    return TurnEnv(llm=llm, executor=Executor(), catalog=catalog, config=BotConfig(),
                   main_model="main", cheap_model="cheap", approval_keys=KEYS, approval_ttl_s=ttl_s)


def stored_and_traced(state, spans: InMemorySpanExporter, done) -> str:
    """Everything the decision left in ce_tool_calls, ce_turns, the traces and the reply, as text."""
    delta = state.take_delta()
    return "\n".join([
        msgspec.json.encode(delta.tool_calls).decode(),
        msgspec.json.encode(delta.turns).decode(),
        msgspec.json.encode(done).decode(),
        *(msgspec.json.encode(dict(s.attributes or {})).decode() for s in spans.get_finished_spans()),
    ])


async def held_payout(registry, llm, *, ttl_s: float = 900.0):
    state = new_state("t", "s")
    held = await handle_message(state, "pay me out", "m1", env_with(llm, registry, [(PAYOUT, 1)], ttl_s))
    assert held.pending_approval is not None
    [shown] = held.pending_approval.calls
    assert shown.arguments["email"] == shown.arguments["iban"] == REDACTED  # as the approver saw it
    state.take_delta()  # the held turn's own writes: not what this file is about
    return state, held.pending_approval.approval_id


@pytest.mark.parametrize("now_published", [
    pytest.param([(PAYOUT_UNMARKED, 2)], id="republished-without-sensitive"),
    pytest.param([], id="removed"),
])
async def test_a_call_refused_because_its_tool_changed_keeps_the_values_it_was_held_as_sensitive_redacted(
    registry, ran, spans, now_published,
):
    llm = ScriptedLLM([[("send_payout", ARGS)], "That changed; shall I try again?"])
    state, approval_id = await held_payout(registry, llm)
    done = await handle_approval(state, approval_id, True, env_with(llm, registry, now_published))
    assert ran == [] and "changed while the approval was pending" in done.tool_calls[0].error
    text = stored_and_traced(state, spans, done)
    [record] = msgspec.json.decode(text.split("\n")[0].encode())
    assert record["parameters"]["email"] == record["parameters"]["iban"] == REDACTED
    assert record["parameters"]["amount"] == 40  # what was never sensitive stays readable
    assert EMAIL not in text and IBAN not in text


@pytest.mark.parametrize("approve, later, says", [
    (False, 0, "the customer declined"),
    (True, 61, "the approval expired before anyone decided"),
])
@pytest.mark.parametrize("now_published", [
    pytest.param([(PAYOUT_UNMARKED, 2)], id="republished-without-sensitive"),
    pytest.param([(PAYOUT_STRICT, 2)], id="republished-with-a-rule-that-quotes-the-value"),
    pytest.param([], id="removed"),
])
async def test_a_declined_or_expired_call_keeps_the_values_it_was_held_as_sensitive_redacted(
    registry, ran, spans, approve, later, says, now_published,
):
    llm = ScriptedLLM([[("send_payout", ARGS)], "ok"])
    state, approval_id = await held_payout(registry, llm, ttl_s=60)
    done = await handle_approval(state, approval_id, approve, env_with(llm, registry, now_published, ttl_s=60),
                                 now=datetime.now(UTC) + timedelta(seconds=later))
    assert ran == []
    text = stored_and_traced(state, spans, done)
    [record] = msgspec.json.decode(text.split("\n")[0].encode())
    assert record["parameters"]["email"] == REDACTED and record["parameters"]["amount"] == 40
    assert EMAIL not in text and IBAN not in text
    if now_published and now_published[0][0] is PAYOUT_STRICT:
        # the current definition's checks refuse it first; what they quote of the value is scrubbed
        assert "does not match" in done.tool_calls[0].error
    elif now_published:
        assert says in done.tool_calls[0].error


async def test_an_approved_call_of_a_tool_whose_sensitive_names_changed_without_a_new_version_stays_redacted(
    registry, ran, spans,
):
    # a built-in is always version 1: a deploy that drops a name from its `sensitive` while the
    # approval is pending changes no version, so the held call runs, with the approver's edits
    llm = ScriptedLLM([[("send_payout", ARGS)], "paid"])
    state = new_state("t", "s")
    env = TurnEnv(llm=llm, executor=Executor(), catalog=build_catalog([PAYOUT], [], registry=registry, backend=None), config=BotConfig(),
                  main_model="main", cheap_model="cheap", approval_keys=KEYS)
    held = await handle_message(state, "pay me out", "m1", env)
    [shown] = held.pending_approval.calls
    received: list[dict[str, Any]] = []

    @registry.register("payout_v2")
    async def payout_v2(args, ctx):
        received.append(dict(args))
        return {"ok": True, "paid_to": args["iban"]}  # a handler that echoes what it was given

    after = build_catalog([msgspec.structs.replace(PAYOUT_UNMARKED, handler="payout_v2")], [],
                          registry=registry, backend=None)
    # the approver's form comes back whole, the amount changed, the email and IBAN as shown
    done = await handle_approval(state, held.pending_approval.approval_id, True,
                                 msgspec.structs.replace(env, catalog=after),
                                 edited_arguments={shown.id: {**shown.arguments, "amount": 50}})
    assert done.reply == "paid"
    assert received == [{**ARGS, "amount": 50}]  # the real email and IBAN, not the text "[redacted]"
    text = stored_and_traced(state, spans, done)
    [record] = [r for r in msgspec.json.decode(text.split("\n")[0].encode()) if r["success"]]
    assert record["parameters"] == {"email": REDACTED, "iban": REDACTED, "amount": 50}
    assert record["result"] == {"ok": True, "paid_to": REDACTED}
    assert EMAIL not in text and IBAN not in text


async def test_a_held_batch_keeps_each_calls_sensitive_names_through_the_snapshot(registry, ran):
    llm = ScriptedLLM([[("lookup_order", {"q": "A1"}), ("send_payout", ARGS), ("nope", {})], "ok"])
    state = new_state("t", "s")
    await handle_message(state, "pay me out", "m1", env_with(llm, registry, [(LOOKUP, 1), (PAYOUT, 1)]))
    snapshot = msgspec.json.decode(msgspec.json.encode(state.snapshot), type=SessionSnapshot)
    assert msgspec.convert(snapshot.pending, PendingTurn).tool_sensitive == [[], ["email", "iban"], []]


#: a held turn's snapshot as stored before `tool_sensitive` existed (ce_sessions.snapshot JSONB)
OLD_SNAPSHOT = b"""{"breakers": {}, "completed": [], "handoff": false, "handoff_reason": null,
 "message_count": 2, "extra": {}, "pending": {
  "approval_id": "%s", "message_id": "m1",
  "calls": [{"id": "call_1_0", "name": "send_payout",
             "arguments": {"email": "ana.lopez@example.com", "iban": "DE89370400440532013000", "amount": 40}}],
  "round": 1, "summary": ["send_payout(email=[redacted], iban=[redacted], amount=40) - will change data"],
  "tools": ["send_payout"], "expires_at": "2999-01-01T00:00:00+00:00", "usage": {"main": [10, 3]},
  "tool_calls": [], "client_actions": [], "deliveries": [], "intent": null, "tool_versions": [1]}}"""


async def test_a_turn_held_before_sensitive_names_were_kept_still_decodes_and_resumes(registry, ran, spans):
    llm = ScriptedLLM([[("send_payout", ARGS)], "paid"])
    state = new_state("t", "s")
    held = await handle_message(state, "pay me out", "m1", env_with(llm, registry, [(PAYOUT, 1)]))
    approval_id = held.pending_approval.approval_id
    stored = msgspec.json.decode(OLD_SNAPSHOT % approval_id.encode(), type=SessionSnapshot)
    old = msgspec.convert(stored.pending, PendingTurn)
    assert old.tool_sensitive is None and old.tool_versions == [1]
    state.snapshot.pending = stored.pending  # another activation loads the old row
    done = await handle_approval(state, approval_id, True, env_with(llm, registry, [(PAYOUT, 1)]))
    assert done.reply == "paid" and ran == ["payout"]
    [record] = [r for r in state.take_delta().tool_calls if r.success]
    assert record.parameters["email"] == REDACTED  # redacted with the current definition's names, as before
