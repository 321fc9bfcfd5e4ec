"""The executor pipeline of seed 001, stage by stage, with fake handlers and a fake backend.

resolve -> strip protected keys -> validate -> policy -> approval -> trusted context ->
bounded execution -> normalise -> record. Every failure is an in-band result for the model.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest
from structlog.testing import capture_logs

from services.botconfig import BotConfig
from services.tools.context import TrustedContext
from services.tools.errors import DEFAULT_ADVICE, InvalidArguments, UpstreamStatus, UpstreamTimeout
from services.tools.executor import (
    BatchPlan,
    Executor,
    ToolCall,
    ToolOutcome,
    failure_text,
    scoped_args,
)
from services.tools.limiter import ResourceLimiter
from services.tools.model import PROTECTED_KEYS
from services.tools.redaction import REDACTED
from services.tools.registry import Catalog, ClientAction
from services.tools.toolset import SessionToolState
from tests.support.fakes import (
    FakeClock,
    FakeHandler,
    FakeToolBackend,
    binding_tool,
    client_tool,
    make_catalog,
    python_tool,
    webhook_tool,
)

CTX = TrustedContext(tenant_id="tenant-a", session_id="sess-1", message_id="msg-1")
NO_STATE = SessionToolState()


def call(name: str, call_id: str = "call-1", **arguments: Any) -> ToolCall:
    return ToolCall(id=call_id, name=name, arguments=arguments)


async def plan_for(
    executor: Executor,
    catalog: Catalog,
    *calls: ToolCall,
    config: BotConfig | None = None,
    session: SessionToolState = NO_STATE,
    scope: dict[str, Any] | None = None,
) -> BatchPlan:
    return await executor.prepare(
        list(calls), catalog=catalog, config=config or BotConfig(), session=session, scope=scope or {}
    )


async def run(
    catalog: Catalog,
    *calls: ToolCall,
    executor: Executor | None = None,
    ctx: TrustedContext = CTX,
    approved: bool = True,
    **prepare: Any,
) -> list[ToolOutcome]:
    executor = executor or Executor()
    plan = await plan_for(executor, catalog, *calls, **prepare)
    return await executor.execute(plan, ctx, approved=approved)


async def run_one(catalog: Catalog, c: ToolCall, **kw: Any) -> ToolOutcome:
    [outcome] = await run(catalog, c, **kw)
    return outcome


# -- stage 1: resolve ------------------------------------------------------------------------------


async def test_unknown_tool_fails_in_band_and_nothing_is_looked_up_elsewhere() -> None:
    # a handler named "x" is registered in code, but no published definition binds it
    stray = FakeHandler("x")
    known = FakeHandler("lookup")
    catalog = make_catalog(python_tool("lookup"), handlers=(stray, known))
    outcome = await run_one(catalog, call("x", q="1"))
    assert outcome.content.startswith("Tool 'x' failed: there is no tool named 'x'. ")
    assert outcome.content == (
        "Tool 'x' failed: there is no tool named 'x'. "
        "Do not call it again; answer with what you know or ask a clarifying question."
    )
    assert (outcome.success, outcome.error, outcome.error_kind) == (False, outcome.content, "unknown_tool")
    assert outcome.counts_for_breaker is False
    assert (stray.count, known.count) == (0, 0)
    assert outcome.record.tool_name == "x"
    assert outcome.record.success is False


async def test_unknown_tool_name_is_shortened_in_the_failure_text() -> None:
    name = "n" * 500
    outcome = await run_one(make_catalog(), call(name))
    assert len(outcome.name) == 64
    assert outcome.content.startswith(f"Tool '{'n' * 63}…' failed")
    assert len(outcome.content) < 300


# -- stage 2: strip protected keys, merge trusted scope ------------------------------------------


@pytest.mark.parametrize("key", ["tenant_id", "tenantId", "account_id", "accountId", "store_id"])
async def test_protected_keys_from_the_model_never_reach_the_handler(key: str) -> None:
    handler = FakeHandler("lookup")
    catalog = make_catalog(python_tool("lookup", protected=("store_id",)), handlers=(handler,))
    outcome = await run_one(catalog, call("lookup", **{"q": "lamp", key: "other-tenant"}))
    assert outcome.success is True
    [(args, _ctx)] = handler.calls
    assert args == {"q": "lamp"}
    assert key not in outcome.record.parameters


async def test_protected_keys_are_stripped_even_when_the_schema_declares_them() -> None:
    handler = FakeHandler("lookup")
    schema = {"type": "object", "properties": {"tenant_id": {"type": "string"}, "q": {"type": "string"}}}
    catalog = make_catalog(python_tool("lookup", parameters=schema), handlers=(handler,))
    await run_one(catalog, call("lookup", q="x", tenant_id="tenant-b"))
    assert handler.calls[0][0] == {"q": "x"}


def test_scoped_args_seed_example_trusted_scope_overwrites_the_model() -> None:
    # seed 001, verbatim semantics
    assert scoped_args(
        {"account_id": "other-account", "listing_id": "other-property"},
        {"account_id": "account-a", "listing_id": "property-a"},
        protected=PROTECTED_KEYS,
    )["listing_id"] == "property-a"
    assert scoped_args(
        {"account_id": "other-account", "listing_id": "other-property", "nights": 2},
        {"account_id": "account-a", "listing_id": "property-a"},
        protected=PROTECTED_KEYS,
    ) == {"nights": 2, "account_id": "account-a", "listing_id": "property-a"}


async def test_trusted_scope_overwrites_model_arguments_in_the_pipeline() -> None:
    handler = FakeHandler("availability")
    schema = {
        "type": "object",
        "properties": {
            "account_id": {"type": "string"},
            "listing_id": {"type": "string"},
            "nights": {"type": "integer"},
        },
        "required": ["account_id", "listing_id"],
    }
    catalog = make_catalog(python_tool("availability", parameters=schema), handlers=(handler,))
    outcome = await run_one(
        catalog,
        call("availability", account_id="other-account", listing_id="other-property", nights=2),
        scope={"account_id": "account-a", "listing_id": "property-a", "contact_id": "c-9"},
    )
    assert outcome.success is True
    # contact_id is trusted but undeclared: not injected into a schema that does not ask for it
    assert handler.calls[0][0] == {"nights": 2, "account_id": "account-a", "listing_id": "property-a"}


async def test_trusted_scope_fills_a_required_protected_field_the_model_may_not_supply() -> None:
    handler = FakeHandler("orders")
    schema = {"type": "object", "properties": {"account_id": {"type": "string"}}, "required": ["account_id"]}
    catalog = make_catalog(python_tool("orders", parameters=schema), handlers=(handler,))
    outcome = await run_one(catalog, call("orders"), scope={"account_id": "account-a"})
    assert outcome.success is True
    assert handler.calls[0][0] == {"account_id": "account-a"}


# -- stage 3: validate ---------------------------------------------------------------------------

STRICT_ORDER_SCHEMA = {
    "type": "object",
    "properties": {"order_id": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
    "required": ["order_id"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({}, "invalid arguments: 'order_id' is required"),
        ({"order_id": 5}, "invalid arguments: 'order_id': 5 is not of type 'string'"),
        ({"order_id": "1", "qty": 0}, "invalid arguments: 'qty': 0 is less than the minimum of 1"),
        ({"order_id": "1", "colour": "red"}, r"invalid arguments: unknown argument \('colour' was unexpected\)"),
    ],
    ids=["missing", "wrong-type", "below-minimum", "unknown-argument"],
)
async def test_invalid_arguments_name_the_field_and_the_handler_is_not_called(
    arguments: dict[str, Any], message: str
) -> None:
    handler = FakeHandler("check_order")
    catalog = make_catalog(python_tool("check_order", parameters=STRICT_ORDER_SCHEMA), handlers=(handler,))
    outcome = await run_one(catalog, ToolCall(id="c1", name="check_order", arguments=arguments))
    assert outcome.success is False
    assert outcome.content.startswith("Tool 'check_order' failed: invalid arguments: ")
    assert re.search(message, outcome.content)
    assert outcome.content.endswith("Ask the customer for the missing or corrected details, then call the tool again.")
    assert (outcome.error_kind, outcome.counts_for_breaker) == ("invalid_arguments", False)
    assert handler.count == 0


# -- stage 4: policy -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "config", "session", "reason"),
    [
        ({"enabled": False}, BotConfig(), NO_STATE, "this tool is disabled"),
        ({}, BotConfig(), SessionToolState(breakers={"t": 3}), "switched off for it"),
        ({}, BotConfig(allowlist=("other",)), NO_STATE, "this tool is not in the agent's allowlist"),
        ({"mutability": "write"}, BotConfig(allow_writes=False), NO_STATE, "this assistant may not change records"),
        ({"completes_variable": "done"}, BotConfig(), SessionToolState(variables={"done": "true"}),
         "this was already done in this conversation"),
    ],
    ids=["disabled", "breaker-open", "allowlist", "writes-off", "completed"],
)
async def test_policy_denial_is_in_band_and_runs_nothing(
    fields: dict[str, Any], config: BotConfig, session: SessionToolState, reason: str
) -> None:
    handler = FakeHandler("t")
    catalog = make_catalog(python_tool("t", **fields), handlers=(handler,))
    outcome = await run_one(catalog, call("t"), config=config, session=session)
    assert outcome.success is False
    assert outcome.content.startswith("Tool 't' failed: ")
    assert reason in outcome.content
    assert (outcome.error_kind, outcome.counts_for_breaker) == ("policy_denied", False)
    assert handler.count == 0


# -- stage 5: approval ---------------------------------------------------------------------------


def _approval_catalog(*handlers: FakeHandler) -> Catalog:
    return make_catalog(
        python_tool("lookup"),
        python_tool("cancel_order", mutability="write"),  # approval by default
        python_tool("add_note", mutability="write", requires_approval=False),
        handlers=handlers,
    )


async def test_prepare_marks_write_tools_as_needing_approval() -> None:
    executor = Executor()
    plan = await plan_for(executor, _approval_catalog(), call("lookup", "c1"), call("cancel_order", "c2"),
                          call("add_note", "c3"))
    assert [p.needs_approval for p in plan.calls] == [False, True, False]
    assert plan.needs_approval is True
    assert (await plan_for(executor, _approval_catalog(), call("lookup"), call("add_note", "c2"))).needs_approval is False


async def test_a_call_that_fails_its_checks_does_not_ask_for_approval() -> None:
    plan = await plan_for(Executor(), _approval_catalog(), call("cancel_order", q=5))
    assert plan.calls[0].error is not None
    assert plan.needs_approval is False


async def test_executing_an_unapproved_batch_that_needs_approval_raises() -> None:
    cancel = FakeHandler("cancel_order")
    executor = Executor()
    plan = await plan_for(executor, _approval_catalog(cancel), call("cancel_order"))
    with pytest.raises(ValueError, match="this batch needs approval before it runs"):
        await executor.execute(plan, CTX)
    assert cancel.count == 0


async def test_a_mixed_write_batch_runs_nothing_before_approval_and_everything_after() -> None:
    lookup, cancel, note = FakeHandler("lookup"), FakeHandler("cancel_order"), FakeHandler("add_note")
    executor = Executor()
    plan = await plan_for(
        executor, _approval_catalog(lookup, cancel, note),
        call("add_note", "c1"), call("cancel_order", "c2"), call("lookup", "c3"),
    )
    with pytest.raises(ValueError, match="needs approval"):
        await executor.execute(plan, CTX)
    # seed 001's strong guarantee: the unrelated write did not slip through before the pause
    assert (lookup.count, cancel.count, note.count) == (0, 0, 0)

    outcomes = await executor.execute(plan, CTX, approved=True)
    assert [o.success for o in outcomes] == [True, True, True]
    assert [o.call_id for o in outcomes] == ["c1", "c2", "c3"]
    assert (lookup.count, cancel.count, note.count) == (1, 1, 1)


async def test_a_read_only_batch_runs_without_approval() -> None:
    lookup = FakeHandler("lookup")
    [outcome] = await run(_approval_catalog(lookup), call("lookup"), approved=False)
    assert outcome.success is True
    assert lookup.count == 1


async def test_deny_returns_approval_denied_for_every_call_and_runs_nothing() -> None:
    lookup, cancel, note = FakeHandler("lookup"), FakeHandler("cancel_order"), FakeHandler("add_note")
    executor = Executor()
    plan = await plan_for(
        executor, _approval_catalog(lookup, cancel, note),
        call("cancel_order", "c1"), call("add_note", "c2"), call("lookup", "c3"),
    )
    outcomes = executor.deny(plan, CTX, reason="the manager declined the cancellation")
    assert [o.error_kind for o in outcomes] == ["approval_denied"] * 3
    assert [o.success for o in outcomes] == [False] * 3
    assert [o.counts_for_breaker for o in outcomes] == [False] * 3
    assert outcomes[0].content == (
        "Tool 'cancel_order' failed: the manager declined the cancellation. "
        "Tell the customer it was not done and ask how they would like to proceed."
    )
    assert "not run because the other actions in this step were declined" in outcomes[1].content
    assert "not run because the other actions in this step were declined" in outcomes[2].content
    assert [o.record.success for o in outcomes] == [False] * 3
    assert (lookup.count, cancel.count, note.count) == (0, 0, 0)


async def test_deny_keeps_a_calls_own_check_failure() -> None:
    executor = Executor()
    plan = await plan_for(executor, _approval_catalog(), call("cancel_order", "c1"), call("nope", "c2"))
    outcomes = executor.deny(plan, CTX, reason="declined")
    assert [o.error_kind for o in outcomes] == ["approval_denied", "unknown_tool"]


async def test_plan_summary_asks_about_each_runnable_call_with_sensitive_values_redacted_and_no_description() -> None:
    executor = Executor()
    catalog = make_catalog(
        python_tool("pay", mutability="write", sensitive=("card",), description="Charge the card on file."),
        python_tool("lookup"),
    )
    plan = await plan_for(executor, catalog, call("pay", "c1", card="4111"), call("lookup", "c2", q="x"),
                          call("nope", "c3"))
    assert plan.summary() == [f"Run pay with card={REDACTED}?", "Run lookup with q=x?"]


async def test_plan_summary_fills_a_tools_approval_prompt_from_the_arguments_as_the_approver_sees_them() -> None:
    catalog = make_catalog(python_tool(
        "pay", mutability="write", sensitive=("card",), approval_prompt="Charge {amount} to card {card}? ({memo})",
    ))
    # the memo repeats the card number: the approver's copy scrubs it there too
    plan = await plan_for(Executor(), catalog, call("pay", amount=40, card="4111222233334444", memo="for 4111222233334444"))
    assert plan.summary() == [f"Charge 40 to card {REDACTED}? (for {REDACTED})"]


# -- stage 7: concurrency ------------------------------------------------------------------------


async def test_consecutive_reads_run_concurrently() -> None:
    both_started = asyncio.Event()
    started: list[str] = []

    class Barrier(FakeHandler):
        async def __call__(self, args, ctx):
            started.append(self.name)
            if len(started) == 2:
                both_started.set()
            await both_started.wait()  # sequential execution would never get past this
            return {"read": self.name}

    a, b = Barrier("read_a"), Barrier("read_b")
    catalog = make_catalog(python_tool("read_a"), python_tool("read_b"), handlers=(a, b))
    outcomes = await asyncio.wait_for(run(catalog, call("read_a", "c1"), call("read_b", "c2")), 10)
    assert [o.success for o in outcomes] == [True, True]
    assert [o.content for o in outcomes] == ['{"read":"read_a"}', '{"read":"read_b"}']


async def test_writes_run_alone_and_in_call_order() -> None:
    journal: list[tuple[str, str]] = []
    handlers = tuple(FakeHandler(n, journal=journal, yields=5) for n in ("r1", "w1", "w2", "r2", "r3", "w3"))
    catalog = make_catalog(
        python_tool("r1"), python_tool("r2"), python_tool("r3"),
        *(python_tool(w, mutability="write", requires_approval=False) for w in ("w1", "w2", "w3")),
        handlers=handlers,
    )
    calls = [call(n, f"c{i}") for i, n in enumerate(("r1", "w1", "w2", "r2", "r3", "w3"))]
    outcomes = await run(catalog, *calls)
    assert [o.name for o in outcomes] == ["r1", "w1", "w2", "r2", "r3", "w3"]
    assert all(o.success for o in outcomes)
    expected_prefix = [("start", "r1"), ("end", "r1"), ("start", "w1"), ("end", "w1"), ("start", "w2"), ("end", "w2")]
    assert journal[:6] == expected_prefix
    # r2 and r3 overlap each other, but both finish before w3 starts
    assert sorted(journal[6:10]) == sorted([("start", "r2"), ("start", "r3"), ("end", "r2"), ("end", "r3")])
    assert journal[6:8] == [("start", "r2"), ("start", "r3")]
    assert journal[10:] == [("start", "w3"), ("end", "w3")]


async def test_progress_goes_to_the_batch_that_asked_for_it_when_two_batches_run_at_once() -> None:
    """One executor serves every session of a host: a batch's progress reports reach only its
    own callback (they carry tool names and messages; another session's stream must not see
    them), also for a call that starts after another session's batch began."""
    reads_go, write_goes = asyncio.Event(), asyncio.Event()
    handlers = (FakeHandler("a_read", gate=reads_go), FakeHandler("a_write", gate=write_goes),
                FakeHandler("b_read", gate=reads_go))
    catalog = make_catalog(
        python_tool("a_read"), python_tool("b_read"),
        python_tool("a_write", mutability="write", requires_approval=False), handlers=handlers,
    )
    executor = Executor(progress_after_ms=20)
    seen: dict[str, list[str]] = {"a": [], "b": []}

    def reporter(batch: str):
        async def on_progress(prepared, elapsed_ms, message) -> None:
            seen[batch].append(prepared.call.id)
        return on_progress

    plan_a = await plan_for(executor, catalog, call("a_read", "a1"), call("a_write", "a2"))
    plan_b = await plan_for(executor, catalog, call("b_read", "b1"))
    a = asyncio.create_task(executor.execute(plan_a, CTX, on_progress=reporter("a")))
    await asyncio.sleep(0.05)
    b = asyncio.create_task(executor.execute(plan_b, CTX, on_progress=reporter("b")))
    await asyncio.sleep(0.05)
    reads_go.set()  # a's write starts now, after b's batch began
    await asyncio.sleep(0.1)
    write_goes.set()
    await asyncio.wait_for(asyncio.gather(a, b), 10)
    assert seen == {"a": ["a1", "a2"], "b": ["b1"]}


async def test_a_batch_stopped_half_way_keeps_the_outcomes_of_calls_that_finished() -> None:
    """Cancelled (a host stopping with the turn still running), the calls that had finished are
    in `finished`, by call id, for the session to record: their effects are real."""
    hold = asyncio.Event()
    handlers = (FakeHandler("quick"), FakeHandler("stuck", gate=hold), FakeHandler("booked"))
    catalog = make_catalog(
        python_tool("quick"), python_tool("stuck"),
        python_tool("booked", mutability="write", requires_approval=False), handlers=handlers,
    )
    executor = Executor()
    plan = await plan_for(executor, catalog, call("booked", "w1"), call("quick", "r1"), call("stuck", "r2"))
    finished: dict[str, ToolOutcome] = {}
    task = asyncio.create_task(executor.execute(plan, CTX, finished=finished))
    for _ in range(50):
        await asyncio.sleep(0)
        if handlers[1].count:
            break
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sorted(finished) == ["r1", "w1"] and all(o.success for o in finished.values())
    assert finished["w1"].record.tool_name == "booked"


async def test_interrupted_gives_every_call_its_finished_outcome_or_one_saying_it_may_have_run() -> None:
    executor = Executor()
    catalog = make_catalog(python_tool("quick"), python_tool("stuck"), handlers=(FakeHandler("quick"), FakeHandler("stuck")))
    plan = await plan_for(executor, catalog, call("quick", "r1"), call("stuck", "r2"), call("nope", "r3"))
    done = ToolOutcome(call_id="r1", name="quick", success=True, content="{}", record=executor.interrupted(
        plan, CTX, {})[0].record)
    outcomes = executor.interrupted(plan, CTX, {"r1": done})
    assert [o.call_id for o in outcomes] == ["r1", "r2", "r3"]
    assert outcomes[0] is done
    stuck = outcomes[1]
    assert not stuck.success and stuck.error_kind == "interrupted" and not stuck.counts_for_breaker
    assert "may have run" in stuck.content and stuck.record.tool_name == "stuck" and stuck.record.success is False
    assert outcomes[2].error_kind == "unknown_tool"  # a call that failed its checks keeps its own error


# -- stage 7: deadlines and failures -------------------------------------------------------------


async def test_handler_slower_than_its_timeout_fails_with_deadline_exceeded() -> None:
    slow = FakeHandler("slow", gate=asyncio.Event())  # never released
    catalog = make_catalog(python_tool("slow", timeout_ms=50), handlers=(slow,))
    outcome = await asyncio.wait_for(run_one(catalog, call("slow")), 10)
    assert outcome.success is False
    assert outcome.error_kind == "deadline_exceeded"
    assert outcome.content.startswith("Tool 'slow' failed: upstream timeout. ")
    assert outcome.counts_for_breaker is True
    assert slow.cancelled == 1  # the handler was stopped, not left running


async def test_turn_deadline_already_past_rejects_the_call_before_it_starts() -> None:
    clock = FakeClock(start=50.0)
    handler = FakeHandler("lookup")
    executor = Executor(clock=clock)
    plan = await plan_for(executor, make_catalog(python_tool("lookup"), handlers=(handler,)), call("lookup"))
    [outcome] = await executor.execute(plan, CTX, deadline=clock.now)
    assert outcome.error_kind == "queue_timeout"  # busy, not broken: the breaker ignores it
    assert not outcome.counts_for_breaker
    assert "deadline passed before the call could start" in outcome.content
    assert handler.count == 0


async def test_executor_clock_is_the_limiters_clock_by_default() -> None:
    # deadlines are computed on the executor's clock; the limiter must compare on the same one
    handler = FakeHandler("lookup")
    executor = Executor(clock=FakeClock(start=0.0))
    [outcome] = await run(make_catalog(python_tool("lookup"), handlers=(handler,)), call("lookup"), executor=executor)
    assert outcome.success is True, outcome.content
    assert handler.count == 1


async def test_unexpected_handler_exception_is_an_opaque_internal_error_that_counts_for_the_breaker() -> None:
    secret = "password=hunter2 at db.internal:5432"
    boom = FakeHandler("boom", result=RuntimeError(secret))
    catalog = make_catalog(python_tool("boom"), handlers=(boom,))
    with capture_logs() as logs:
        outcome = await run_one(catalog, call("boom"))
    assert outcome.content == f"Tool 'boom' failed: internal error in the tool. {DEFAULT_ADVICE}"
    assert (outcome.success, outcome.error_kind, outcome.counts_for_breaker) == (False, "tool_crashed", True)
    for text in (outcome.content, outcome.record.error):
        assert secret not in text
        assert "Traceback" not in text
        assert "RuntimeError" not in text
    # the details go to the log for operators
    assert [(e["event"], e["tool_name"]) for e in logs if e["event"] == "tool_crashed"] == [("tool_crashed", "boom")]


async def test_a_result_that_cannot_be_encoded_is_an_in_band_internal_error() -> None:
    weird = FakeHandler("weird", result={"value": object()})
    catalog = make_catalog(python_tool("weird"), handlers=(weird,))
    outcome = await run_one(catalog, call("weird"))
    assert outcome.success is False
    assert outcome.content == f"Tool 'weird' failed: internal error in the tool. {DEFAULT_ADVICE}"
    assert outcome.counts_for_breaker is True


ORDER_ADVICE = "Inform the customer you cannot retrieve their order right now."


@pytest.mark.parametrize(
    ("error", "reason", "kind"),
    [
        (UpstreamTimeout("upstream timeout", advice=ORDER_ADVICE), "upstream timeout", "upstream_timeout"),
        (UpstreamStatus("upstream returned status 500", status=500, advice=ORDER_ADVICE),
         "upstream returned status 500", "upstream_status"),
    ],
    ids=["timeout", "status-500"],
)
async def test_backend_tool_errors_map_to_seed_000_failure_text(error: Exception, reason: str, kind: str) -> None:
    backend = FakeToolBackend({"check_order": error})
    catalog = make_catalog(webhook_tool("check_order"), backend=backend)
    outcome = await run_one(catalog, call("check_order", order_id="12345"))
    assert outcome.content == f"Tool 'check_order' failed: {reason}. {ORDER_ADVICE}"
    assert (outcome.success, outcome.error_kind, outcome.counts_for_breaker) == (False, kind, True)
    assert outcome.record.error == outcome.content
    assert backend.calls[0].args == {"order_id": "12345"}


def test_failure_text_is_seed_000s_sentence() -> None:
    assert failure_text("check_order", UpstreamTimeout("upstream timeout", advice=ORDER_ADVICE)) == (
        "Tool 'check_order' failed: upstream timeout. Inform the customer you cannot retrieve their order right now."
    )


# -- stages 8-9: normalise and record ------------------------------------------------------------


async def test_sensitive_parameters_are_redacted_in_the_record_but_reach_the_handler() -> None:
    handler = FakeHandler("collect_lead")
    schema = {"type": "object", "properties": {"email": {"type": "string"}, "phone": {"type": "string"},
                                               "full_name": {"type": "string"}}}
    catalog = make_catalog(
        python_tool("collect_lead", parameters=schema, sensitive=("email", "phone")), handlers=(handler,)
    )
    outcome = await run_one(catalog, call("collect_lead", email="a@b.test", phone="+351 900", full_name="Ana"))
    assert outcome.record.parameters == {"email": REDACTED, "phone": REDACTED, "full_name": "Ana"}
    assert handler.calls[0][0] == {"email": "a@b.test", "phone": "+351 900", "full_name": "Ana"}


async def test_sensitive_parameters_are_redacted_in_the_record_of_a_failed_call() -> None:
    schema = {"type": "object", "properties": {"card": {"type": "string"}}, "required": ["card"],
              "additionalProperties": False}
    catalog = make_catalog(python_tool("pay", parameters=schema, sensitive=("card",)))
    outcome = await run_one(catalog, call("pay", card="4111111111111111", extra=1))
    assert outcome.success is False
    assert outcome.record.parameters["card"] == REDACTED


async def test_a_results_sensitive_values_stay_out_of_the_record_but_reach_the_model() -> None:
    # before, ce_tool_calls.result kept what the handler echoed (collect_lead returned the email)
    email = "ana.private@example.com"
    handler = FakeHandler("collect_lead", result={
        "lead": {"email": email, "id": "L1"}, "echo": email, "note": f"confirmation sent to {email}",
        "contacts": [{"phone": "+351 900 000 000"}], "status": "saved",
    })
    schema = {"type": "object", "properties": {"email": {"type": "string"}, "phone": {"type": "string"}}}
    catalog = make_catalog(python_tool("collect_lead", parameters=schema, sensitive=("email", "phone")),
                           handlers=(handler,))
    outcome = await run_one(catalog, call("collect_lead", email=email))
    assert outcome.record.result == {
        "lead": {"email": REDACTED, "id": "L1"}, "echo": REDACTED, "note": f"confirmation sent to {REDACTED}",
        "contacts": [{"phone": REDACTED}], "status": "saved",
    }
    assert email in outcome.content and "+351 900 000 000" in outcome.content  # the model reads it whole


async def test_a_client_tools_record_redacts_its_sensitive_arguments_the_client_gets_them_whole() -> None:
    schema = {"type": "object", "properties": {"card": {"type": "string"}, "q": {"type": "string"}}}
    catalog = make_catalog(client_tool("show_card", parameters=schema, sensitive=("card",)))
    outcome = await run_one(catalog, call("show_card", card="4111111111111111", q="visa"))
    assert outcome.record.result == {"name": "show_card", "arguments": {"card": REDACTED, "q": "visa"}}
    # the turn's client_actions go to the client app, which needs the value to show it
    assert outcome.client_action == ClientAction(name="show_card", arguments={"card": "4111111111111111", "q": "visa"})


@pytest.mark.parametrize("name", ["password", "api_key", "apiKey", "X-Api-Key", "access_token", "client_secret",
                                  "cvv", "card_number", "pin", "card_pin", "Authorization"])
async def test_values_under_secret_looking_names_are_redacted_in_the_record_whatever_the_tool_declares(name) -> None:
    # the dashboard already hid them on display (services.tools.redaction.secret_name, one rule)
    handler = FakeHandler("login", result={"session": {name: "s3cr3t-out"}, "user": "ana"})
    catalog = make_catalog(python_tool("login"), handlers=(handler,))
    outcome = await run_one(catalog, call("login", **{name: "s3cr3t-in", "q": "ana"}))
    assert outcome.record.parameters == {name: REDACTED, "q": "ana"}
    assert outcome.record.result == {"session": {name: REDACTED}, "user": "ana"}
    assert handler.calls[0][0][name] == "s3cr3t-in"


@pytest.mark.parametrize("name", ["shipping", "spinner", "description", "quantity"])
async def test_ordinary_names_are_kept_in_the_record(name) -> None:
    catalog = make_catalog(python_tool("lookup"))
    outcome = await run_one(catalog, call("lookup", **{name: "value"}))
    assert outcome.record.parameters == {name: "value"}


async def test_a_failure_text_quoting_a_sensitive_value_has_it_replaced_everywhere_it_goes() -> None:
    # a handler (or a check) that quotes the value: the text is the model's tool_result, the API's
    # tool_calls[].error, SSE, ce_turns and ce_tool_calls.error
    card = "4111 1111 1111 1111"
    form = {"iban": "DE89370400440532013000", "city": "Lisbon"}
    handler = FakeHandler("pay", result=InvalidArguments(f"card {card!r} declined for {form['iban']}; ok"))
    schema = {"type": "object", "properties": {"card": {"type": "string"}, "form": {"type": "object"}}}
    catalog = make_catalog(python_tool("pay", parameters=schema, sensitive=("card", "form")), handlers=(handler,))
    outcome = await run_one(catalog, call("pay", card=card, form=form))
    assert outcome.content == (
        f"Tool 'pay' failed: card '{REDACTED}' declined for {REDACTED}; ok. {DEFAULT_ADVICE}"
    )
    assert outcome.error == outcome.record.error == outcome.content


EMAIL = "ana.private@example.com"


async def test_an_output_contract_failure_on_the_whole_result_never_quotes_its_secrets() -> None:
    # before, a rule on the result as a whole quoted all of it ("{'api_key': 'sk_live_…', …} has
    # too many properties"): the text is the model's tool_result, tool_calls[].error, ce_tool_calls
    result = {"api_key": "sk_live_RESULT99", "email": EMAIL, "pin": 4321, "session": {"access_token": "tok_abcdefgh1"},
              "note": f"confirmation sent to {EMAIL}"}
    handler = FakeHandler("login", result=result)
    schema = {"type": "object", "properties": {"email": {"type": "string"}}}
    catalog = make_catalog(python_tool("login", parameters=schema, sensitive=("email",), output_schema={
        "type": "object", "required": ["status"], "maxProperties": 2}), handlers=(handler,))
    outcome = await run_one(catalog, call("login", email="someone@example.com"))
    assert (outcome.success, outcome.error_kind) == (False, "output_contract")
    assert outcome.error == outcome.record.error == outcome.content
    for secret in ("sk_live_RESULT99", EMAIL, "4321", "tok_abcdefgh1"):
        assert secret not in outcome.content
    # the problems still say what is wrong
    assert outcome.content.startswith("Tool 'login' failed: result does not match its declared output schema: "
                                      "'status' is required; the result has more than 2 properties. ")


@pytest.mark.parametrize("result, rule, secret", [
    ({"api_key": "sk_live_RESULT99"}, {"api_key": {"type": "integer"}}, "sk_live_RESULT99"),
    ({"email": EMAIL}, {"email": {"pattern": "^x"}}, EMAIL),
    ({"pin": 4321}, {"pin": {"type": "string"}}, "4321"),
    ({"session": {"access_token": "tok_abcdefgh1"}}, {"session": {"properties": {"access_token": {"maxLength": 4}}}},
     "tok_abcdefgh1"),
    ({"email": EMAIL, "note": f"sent to {EMAIL}"}, {"note": {"maxLength": 4}}, EMAIL),
])
async def test_an_output_contract_problem_never_quotes_a_secret_or_sensitive_value_of_the_result(
    result, rule, secret,
) -> None:
    handler = FakeHandler("login", result=result)
    schema = {"type": "object", "properties": {"email": {"type": "string"}}}
    catalog = make_catalog(python_tool("login", parameters=schema, sensitive=("email",), output_schema={
        "type": "object", "properties": rule}), handlers=(handler,))
    # the argument differs from the result's value: the result's own values must be found
    outcome = await run_one(catalog, call("login", email="someone@example.com"))
    assert outcome.error_kind == "output_contract"
    assert secret not in outcome.content and secret not in outcome.record.error
    [field] = rule
    assert f"'{field}" in outcome.content  # the field is still named


async def test_an_output_contract_problem_quoting_a_whole_list_result_leaves_its_secrets_out() -> None:
    # a result that is not an object at all: the problem quotes it whole
    handler = FakeHandler("login", result=[{"access_token": "tok_abcdefgh1", "user": "ana"}])
    catalog = make_catalog(python_tool("login", output_schema={"type": "object"}), handlers=(handler,))
    outcome = await run_one(catalog, call("login"))
    assert outcome.error_kind == "output_contract"
    assert "tok_abcdefgh1" not in outcome.content and "is not of type 'object'" in outcome.content
    assert f"'access_token': '{REDACTED}'" in outcome.content  # the rest of the quote is kept


async def test_the_plan_summary_hides_secret_looking_arguments_too() -> None:
    catalog = make_catalog(python_tool("login", mutability="write", description="Sign in."))
    plan = await plan_for(Executor(), catalog, call("login", password="hunter22", q="ana"))
    assert plan.summary() == [f"Run login with password={REDACTED}, q=ana?"]


async def test_record_fields_of_a_successful_call() -> None:
    handler = FakeHandler("lookup", result={"found": 3})
    executor = Executor(new_id=lambda: "rec-1")
    outcome = await run_one(make_catalog(python_tool("lookup"), handlers=(handler,)), call("lookup", q="x"),
                            executor=executor)
    r = outcome.record
    assert (r.id, r.tenant_id, r.session_id, r.message_id, r.tool_name) == (
        "rec-1", "tenant-a", "sess-1", "msg-1", "lookup")
    assert (r.parameters, r.result, r.success, r.error) == ({"q": "x"}, {"found": 3}, True, None)
    assert r.latency_ms >= 0 and r.queue_ms >= 0
    assert r.created_at is not None and r.created_at.tzinfo is not None
    assert (outcome.success, outcome.error, outcome.error_kind, outcome.counts_for_breaker) == (True, None, None, False)
    assert outcome.latency_ms == r.latency_ms


async def test_record_fields_of_a_failed_call() -> None:
    backend = FakeToolBackend({"check_order": UpstreamTimeout("upstream timeout")})
    outcome = await run_one(make_catalog(webhook_tool(), backend=backend), call("check_order", order_id="9"),
                            executor=Executor(new_id=lambda: "rec-2"))
    r = outcome.record
    assert (r.id, r.tenant_id, r.session_id, r.message_id, r.tool_name) == (
        "rec-2", "tenant-a", "sess-1", "msg-1", "check_order")
    assert (r.success, r.result, r.parameters) == (False, None, {"order_id": "9"})
    assert r.error == outcome.content
    assert r.latency_ms >= 0


async def test_completes_variable_is_reported_on_success() -> None:
    handler = FakeHandler("collect_lead")
    catalog = make_catalog(
        python_tool("collect_lead", mutability="write", completes_variable="lead_collected"), handlers=(handler,)
    )
    outcome = await run_one(catalog, call("collect_lead"))
    assert outcome.completes_variable == "lead_collected"


async def test_a_large_result_is_truncated_for_the_model_and_kept_whole_in_the_record() -> None:
    big = {"blob": "x" * 500}
    handler = FakeHandler("dump", result=big)
    executor = Executor(max_result_chars=100)
    outcome = await run_one(make_catalog(python_tool("dump"), handlers=(handler,)), call("dump"),
                            executor=executor)
    full = '{"blob":"' + "x" * 500 + '"}'
    assert outcome.success is True
    assert outcome.content == full[:100] + f" [result truncated: 100 of {len(full)} characters shown]"
    assert outcome.record.result == big


async def test_a_result_within_the_limit_is_not_truncated() -> None:
    handler = FakeHandler("small", result={"ok": True})
    outcome = await run_one(make_catalog(python_tool("small"), handlers=(handler,)), call("small"),
                            executor=Executor(max_result_chars=12))
    assert outcome.content == '{"ok":true}'


async def test_a_handler_returning_none_reports_done() -> None:
    class ReturnsNone(FakeHandler):
        async def __call__(self, args, ctx):
            return None

    outcome = await run_one(make_catalog(python_tool("noop"), handlers=(ReturnsNone("noop"),)), call("noop"))
    assert (outcome.success, outcome.content, outcome.record.result) == (True, "done (no content)", None)


async def test_client_tool_returns_a_client_action_and_succeeds() -> None:
    outcome = await run_one(make_catalog(client_tool("show_map")), call("show_map", q="Lisbon"))
    assert outcome.success is True
    assert outcome.client_action == ClientAction(name="show_map", arguments={"q": "Lisbon"})
    assert outcome.content == "Shown to the customer in the app: show_map. Continue the conversation."
    assert outcome.record.result == {"name": "show_map", "arguments": {"q": "Lisbon"}}


# -- idempotency --------------------------------------------------------------------------------


async def test_idempotency_key_is_stable_per_message_and_call_across_a_resumed_or_rerun_turn() -> None:
    handler = FakeHandler("book")
    executor = Executor()
    catalog = make_catalog(python_tool("book", mutability="write"), handlers=(handler,))
    plan = await plan_for(executor, catalog, call("book", "toolu_1", q="a"))
    await executor.execute(plan, CTX, approved=True)
    # the turn is resumed (e.g. after a restart): the same call executes again
    await executor.execute(plan, CTX, approved=True)
    # a re-run of the message where the model names the same call differently
    await executor.execute(await plan_for(executor, catalog, call("book", "toolu_2", q="a")), CTX, approved=True)
    # a different call of the same message, and the same call of another message
    await executor.execute(await plan_for(executor, catalog, call("book", "toolu_3", q="b")), CTX, approved=True)
    other_message = TrustedContext(tenant_id="tenant-a", session_id="sess-1", message_id="msg-2")
    await executor.execute(plan, other_message, approved=True)
    keys = [ctx.idempotency_key for _args, ctx in handler.calls]
    assert keys[0] == keys[1] == keys[2] and keys[0].startswith("msg-1:")
    assert len({keys[0], keys[3], keys[4]}) == 3 and keys[4].startswith("msg-2:")


async def test_idempotency_keys_of_two_sessions_or_tenants_differ_when_their_message_ids_match() -> None:
    # Message ids are the client's and unique within a session only: two contacts whose apps both
    # number their messages from "1" place the same order. A backend that honours the key must not
    # take the second contact's order for a retry of the first's (and show them the first's).
    handler = FakeHandler("place_order")
    executor = Executor()
    catalog = make_catalog(python_tool("place_order", mutability="write"), handlers=(handler,))
    for tenant, session in (("tenant-a", "alice"), ("tenant-a", "bob"), ("tenant-b", "alice")):
        ctx = TrustedContext(tenant_id=tenant, session_id=session, message_id="1", idempotency_key="1")
        await executor.execute(await plan_for(executor, catalog, call("place_order", item="coffee")), ctx, approved=True)
    keys = [ctx.idempotency_key for _args, ctx in handler.calls]
    assert len(set(keys)) == 3 and all(k.startswith("1:") for k in keys)


async def test_a_definition_names_the_arguments_that_make_a_call_the_same_call() -> None:
    # A re-run turn's model may word free text differently: a handoff is one per message, a form
    # submission one per form and message, whatever the reason or answers say this time.
    escalate, submit = FakeHandler("escalate"), FakeHandler("submit")
    executor = Executor()
    catalog = make_catalog(python_tool("escalate", idempotency_arguments=()),
                           python_tool("submit", mutability="write", idempotency_arguments=("form",)),
                           handlers=(escalate, submit))

    async def key(c: ToolCall, ctx: TrustedContext = CTX) -> str:
        await executor.execute(await plan_for(executor, catalog, c), ctx, approved=True)
        handler = escalate if c.name == "escalate" else submit
        return handler.calls[-1][1].idempotency_key

    handoff = await key(call("escalate", "toolu_1", reason="wants a refund"))
    assert re.fullmatch(r"msg-1:[0-9a-f]{24}", handoff)
    assert await key(call("escalate", "toolu_2", reason="the customer asks for a refund")) == handoff
    assert await key(call("escalate", reason="x"), TrustedContext(tenant_id="tenant-a", session_id="sess-1",
                                                                   message_id="msg-2")) != handoff
    assert await key(call("escalate", reason="x"), TrustedContext(tenant_id="tenant-a", session_id="sess-2",
                                                                   message_id="msg-1")) != handoff
    quote = await key(call("submit", form="quote", data={"email": "a@b.test"}))
    assert await key(call("submit", "toolu_9", form="quote", data={"email": "A@b.test", "note": "hi"})) == quote
    assert await key(call("submit", form="contact", data={"email": "a@b.test"})) not in (quote, handoff)


async def test_a_tools_concurrency_slots_are_per_tenant_not_shared_across_the_host() -> None:
    # One executor (and limiter) serves every tenant of a host: tenant A's eight slow calls of its
    # `check_order` must not queue tenant B's unrelated `check_order` out of its deadline.
    gate = asyncio.Event()
    slow_a, fast_b = FakeHandler("a_check", gate=gate), FakeHandler("b_check")
    cat_a = make_catalog(python_tool("check_order", handler="a_check", timeout_ms=5000), handlers=(slow_a,))
    cat_b = make_catalog(python_tool("check_order", handler="b_check", timeout_ms=300), handlers=(fast_b,))
    executor = Executor(limiter=ResourceLimiter(default_limit=8))
    ctx_a = TrustedContext(tenant_id="tenant-a", session_id="s", message_id="m")
    ctx_b = TrustedContext(tenant_id="tenant-b", session_id="s", message_id="m")
    busy = [asyncio.create_task(executor.execute(await plan_for(executor, cat_a, call("check_order", f"c{i}")), ctx_a))
            for i in range(9)]
    await asyncio.sleep(0.01)
    [out] = await executor.execute(await plan_for(executor, cat_b, call("check_order", "b1")), ctx_b)
    gate.set()
    results = await asyncio.wait_for(asyncio.gather(*busy), 10)
    assert out.success, out.error
    assert slow_a.count == 9 and all(o.success for [o] in results)  # A's ninth waited for A's own slot


async def test_arguments_the_schema_does_not_declare_never_reach_the_backend() -> None:
    # The model may send what the schema never declared: a binding's backend names directly
    # (past the pattern and enum on the declared names), a second api_key for a webhook's query,
    # {"role": "admin"} into a JSON body. Only declared arguments are sent.
    backend = FakeToolBackend()
    order = webhook_tool(parameters={"type": "object", "properties": {"order_id": {"type": "string"}}})
    search = binding_tool(parameters={"type": "object", "properties": {
        "search": {"type": "string", "maxLength": 5}, "limit": {"type": "integer"}}})
    catalog = make_catalog(order, search, backend=backend)
    await run(catalog, call("check_order", "c1", order_id="42", api_key="attacker", role="admin"),
              scope={"account_id": "acct-1"})
    await run(catalog, call("example_catalog_search", "c2", search="tea", q="a" * 500, per_page=10_000),
              scope={"account_id": "acct-1"})
    assert backend.calls[0].args == {"order_id": "42"}
    assert backend.calls[1].args == {"search": "tea"}  # mapped to the backend's names after this


async def test_a_schema_that_allows_more_arguments_passes_them_on() -> None:
    backend = FakeToolBackend()
    open_tool = webhook_tool(parameters={"type": "object", "properties": {"order_id": {"type": "string"}},
                                         "additionalProperties": True})
    await run(make_catalog(open_tool, backend=backend), call("check_order", order_id="42", note="gift"))
    assert backend.calls[0].args == {"order_id": "42", "note": "gift"}


async def test_idempotency_key_reaches_the_webhook_backend() -> None:
    backend = FakeToolBackend()
    catalog = make_catalog(webhook_tool(mutability="write", requires_approval=False), backend=backend)
    for _ in range(2):
        await run_one(catalog, call("check_order", "toolu_9", order_id="1"))
    keys = [c.idempotency_key for c in backend.calls]
    assert len(keys) == 2 and keys[0] == keys[1] and keys[0].startswith("msg-1:")


async def test_handler_context_is_the_trusted_context_not_the_models() -> None:
    handler = FakeHandler("lookup")
    ctx = TrustedContext(tenant_id="tenant-a", session_id="sess-1", message_id="msg-1", scope={"account_id": "a"})
    await run_one(make_catalog(python_tool("lookup"), handlers=(handler,)), call("lookup", tenant_id="evil"),
                  ctx=ctx)
    [(_args, seen)] = handler.calls
    assert (seen.tenant_id, seen.session_id, seen.scope) == ("tenant-a", "sess-1", {"account_id": "a"})


async def test_outcomes_keep_call_order_across_failures_and_successes() -> None:
    catalog = make_catalog(python_tool("a"), python_tool("b", enabled=False), python_tool("c"))
    outcomes = await run(catalog, call("a", "1"), call("zz", "2"), call("b", "3"), call("c", "4"))
    assert [(o.call_id, o.success) for o in outcomes] == [("1", True), ("2", False), ("3", False), ("4", True)]
