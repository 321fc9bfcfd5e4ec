"""An approval runs exactly the tool definitions the approver was shown, or nothing: a turn held
for approval keeps the version of each held call's tool, and a tool a tenant admin changed (a new
published version: another handler, URL, method, mutability) or removed while the approval was
pending is not run on approve. The whole held batch stops, in-band, as a decline does (seed 001:
a batch with an approval-gated call runs nothing until the whole batch, as shown, is approved).
Driven by a scripted model and catalogs built per step; no I/O.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
import pytest

from actors.session import (
    CALLS_KEY,
    PendingTurn,
    TurnEnv,
    handle_approval,
    handle_message,
    new_state,
)
from services.botconfig import BotConfig
from services.tools.executor import Executor
from services.tools.model import PythonTool
from services.tools.registry import HandlerRegistry, build_catalog
from tests.support.turns import ScriptedLLM

SCHEMA = {"type": "object", "properties": {"q": {"type": "string"}}}
KEYS = (b"k" * 32,)

REFUND = PythonTool(name="refund_order", description="refund to the card on file", parameters=SCHEMA,
                    handler="refund_to_card", mutability="write")  # held for approval
#: what an admin's PATCH publishes while the approval is pending: the same name, another target
REFUND_RETARGETED = PythonTool(name="refund_order", description="refund to the card on file", parameters=SCHEMA,
                               handler="refund_to_wallet", mutability="write")
LOOKUP = PythonTool(name="lookup_order", description="orders", parameters=SCHEMA, handler="lookup")
CHANGED = "changed while the approval was pending"


@pytest.fixture
def ran() -> list[tuple[str, Any]]:
    return []


@pytest.fixture
def registry(ran) -> HandlerRegistry:
    reg = HandlerRegistry()
    for name in ("refund_to_card", "refund_to_wallet", "lookup"):
        async def handler(args, ctx, _name=name):
            ran.append((_name, args.get("q")))
            return {"ok": True}

        reg.register(name)(handler)
    return reg


def env_with(llm, registry: HandlerRegistry, tools: list[tuple[PythonTool, int]]) -> TurnEnv:
    """The env a turn gets with the tenant's catalog as published now (`tools`: definition, version)."""
    catalog = build_catalog([], tools, registry=registry, backend=None)
    return TurnEnv(llm=llm, executor=Executor(), catalog=catalog, config=BotConfig(),
                   main_model="main", cheap_model="cheap", approval_keys=KEYS)


def results_read_by_model(llm) -> list[Any]:
    """The tool results of the round after the decision, as the model read them."""
    return llm.requests[-1].messages[-1].content


async def test_a_tool_changed_while_its_approval_was_pending_does_not_run_on_approve(registry, ran):
    llm = ScriptedLLM([[("refund_order", {"q": "A1"})], "It changed; shall I go ahead again?"])
    held = await handle_message(state := new_state("t", "s"), "refund A1", "m1",
                                env_with(llm, registry, [(REFUND, 1)]))
    assert held.pending_approval is not None and ran == []
    # the admin publishes version 2 (another target); the approver, shown version 1, says yes
    done = await handle_approval(state, held.pending_approval.approval_id, True,
                                 env_with(llm, registry, [(REFUND_RETARGETED, 2)]))
    assert ran == []  # neither the approved definition nor the new one ran
    [summary] = done.tool_calls
    assert not summary.success and CHANGED in summary.error
    [result] = results_read_by_model(llm)
    assert result.is_error and CHANGED in result.content and "version 1" in result.content
    assert "ask the customer to confirm again" in result.content
    assert done.reply == "It changed; shall I go ahead again?" and done.pending_approval is None
    # the engine's doing, not the tool's: no breaker failure, nothing counted toward its limits
    assert state.snapshot.breakers == {} and "refund_order" not in state.snapshot.extra.get(CALLS_KEY, {})
    [record] = state.take_delta().tool_calls
    assert record.tool_name == "refund_order" and not record.success and CHANGED in record.error


async def test_a_tool_removed_while_its_approval_was_pending_does_not_run_on_approve(registry, ran):
    llm = ScriptedLLM([[("refund_order", {"q": "A1"})], "That is no longer available."])
    held = await handle_message(state := new_state("t", "s"), "refund A1", "m1",
                                env_with(llm, registry, [(REFUND, 1)]))
    done = await handle_approval(state, held.pending_approval.approval_id, True, env_with(llm, registry, []))
    assert ran == []
    [result] = results_read_by_model(llm)
    assert result.is_error and CHANGED in result.content and "removed" in result.content
    assert not done.tool_calls[0].success


async def test_one_changed_tool_stops_the_whole_held_batch_and_the_model_is_told_why(registry, ran):
    llm = ScriptedLLM([[("lookup_order", {"q": "A1"}), ("refund_order", {"q": "A1"})], "ok"])
    held = await handle_message(state := new_state("t", "s"), "refund A1", "m1",
                                env_with(llm, registry, [(LOOKUP, 1), (REFUND, 1)]))
    assert [c.name for c in held.pending_approval.calls] == ["lookup_order", "refund_order"]
    done = await handle_approval(state, held.pending_approval.approval_id, True,
                                 env_with(llm, registry, [(LOOKUP, 1), (REFUND_RETARGETED, 2)]))
    assert ran == []  # the unchanged read does not run either: the batch runs whole, as shown, or not at all
    lookup, refund = results_read_by_model(llm)
    assert lookup.is_error and "another action in this step" in lookup.content and CHANGED in lookup.content
    assert refund.is_error and CHANGED in refund.content
    assert [s.success for s in done.tool_calls] == [False, False]
    assert state.snapshot.extra.get(CALLS_KEY, {}) == {}


async def test_a_tool_added_under_a_name_that_was_unknown_when_held_does_not_run(registry, ran):
    # held: a gated refund plus a call of a tool that did not exist (refused in-band, not shown to the approver)
    llm = ScriptedLLM([[("refund_order", {"q": "A1"}), ("lookup_order", {"q": "A1"})], "ok"])
    held = await handle_message(state := new_state("t", "s"), "refund A1", "m1",
                                env_with(llm, registry, [(REFUND, 1)]))
    assert [c.name for c in held.pending_approval.calls] == ["refund_order"]
    await handle_approval(state, held.pending_approval.approval_id, True,
                          env_with(llm, registry, [(REFUND, 1), (LOOKUP, 1)]))
    assert ran == []
    refund, lookup = results_read_by_model(llm)
    assert CHANGED in lookup.content and "added" in lookup.content and "another action" in refund.content


async def test_an_unchanged_version_in_a_reloaded_catalog_runs_as_approved(registry, ran):
    llm = ScriptedLLM([[("lookup_order", {"q": "A1"}), ("refund_order", {"q": "A1"})], "refunded"])
    held = await handle_message(state := new_state("t", "s"), "refund A1", "m1",
                                env_with(llm, registry, [(LOOKUP, 3), (REFUND, 7)]))
    # the catalog was rebuilt (another tool published, a cache reload): these two are as they were
    other = PythonTool(name="other", description="other", parameters=SCHEMA, handler="lookup")
    done = await handle_approval(state, held.pending_approval.approval_id, True,
                                 env_with(llm, registry, [(LOOKUP, 3), (REFUND, 7), (other, 1)]))
    assert ran == [("lookup", "A1"), ("refund_to_card", "A1")] and done.reply == "refunded"
    assert [s.success for s in done.tool_calls] == [True, True]


async def test_the_held_turn_keeps_each_calls_tool_version_through_the_snapshot(registry, ran):
    llm = ScriptedLLM([[("refund_order", {"q": "A1"}), ("nope", {})], "ok"])
    await handle_message(state := new_state("t", "s"), "refund A1", "m1", env_with(llm, registry, [(REFUND, 4)]))
    snapshot = msgspec.json.decode(msgspec.json.encode(state.snapshot), type=type(state.snapshot))
    assert msgspec.convert(snapshot.pending, PendingTurn).tool_versions == [4, None]


async def test_a_turn_held_before_versions_were_kept_resumes_as_before(registry, ran):
    llm = ScriptedLLM([[("refund_order", {"q": "A1"})], "refunded"])
    held = await handle_message(state := new_state("t", "s"), "refund A1", "m1",
                                env_with(llm, registry, [(REFUND, 1)]))
    del state.snapshot.pending["tool_versions"]  # as a snapshot written before the field existed
    assert msgspec.convert(state.snapshot.pending, PendingTurn).tool_versions is None
    done = await handle_approval(state, held.pending_approval.approval_id, True,
                                 env_with(llm, registry, [(REFUND_RETARGETED, 2)]))
    assert ran == [("refund_to_wallet", "A1")] and done.reply == "refunded"  # as before: the current catalog


@pytest.mark.parametrize("approve, later, says", [
    (False, 0, "the customer declined"),
    (True, 61, "the approval expired before anyone decided"),
])
async def test_a_decline_or_expiry_with_a_changed_tool_ends_as_it_did(registry, ran, approve, later, says):
    llm = ScriptedLLM([[("refund_order", {"q": "A1"})], "ok"])
    env = msgspec.structs.replace(env_with(llm, registry, [(REFUND, 1)]), approval_ttl_s=60)
    held = await handle_message(state := new_state("t", "s"), "refund A1", "m1", env)
    changed = msgspec.structs.replace(env_with(llm, registry, [(REFUND_RETARGETED, 2)]), approval_ttl_s=60)
    done = await handle_approval(state, held.pending_approval.approval_id, approve, changed,
                                 now=datetime.now(UTC) + timedelta(seconds=later))
    assert ran == []
    [result] = results_read_by_model(llm)
    assert says in result.content and CHANGED not in result.content
    assert done.tool_calls[0].error == result.content


async def test_an_approvers_edits_do_not_run_a_changed_tool(registry, ran):
    llm = ScriptedLLM([[("refund_order", {"q": "A1"})], "ok"])
    held = await handle_message(state := new_state("t", "s"), "refund A1", "m1",
                                env_with(llm, registry, [(REFUND, 1)]))
    [shown] = held.pending_approval.calls
    done = await handle_approval(state, held.pending_approval.approval_id, True,
                                 env_with(llm, registry, [(REFUND_RETARGETED, 2)]),
                                 edited_arguments={shown.id: {"q": "B2"}})
    assert ran == [] and CHANGED in done.tool_calls[0].error


async def test_a_resumed_call_keeps_the_idempotency_key_it_would_have_had_unheld(registry, ran):
    keys: list[str | None] = []

    async def keyed(args, ctx):
        keys.append(ctx.idempotency_key)
        return {}

    registry.register("keyed")(keyed)
    gated = PythonTool(name="pay", description="pay", parameters=SCHEMA, handler="keyed", mutability="write")
    ungated = msgspec.structs.replace(gated, requires_approval=False)
    llm = ScriptedLLM([[("pay", {"q": "1"})], "paid", [("pay", {"q": "1"})], "paid"])
    held = await handle_message(state := new_state("t", "s"), "pay", "m1", env_with(llm, registry, [(gated, 2)]))
    await handle_approval(state, held.pending_approval.approval_id, True, env_with(llm, registry, [(gated, 2)]))
    # the same message of the same session, its tool not gated: the upstream sees the same key
    await handle_message(new_state("t", "s"), "pay", "m1", env_with(llm, registry, [(ungated, 2)]))
    assert len(keys) == 2 and keys[0] == keys[1] and keys[0].startswith("m1:")
