"""Gates a batch meets before and while it runs: the turn's intent, one-shot tools called twice in
one round, the `max_parallel` wait inside the call's deadline, and queue time kept apart from run
time on failures as on successes (seed 000's intent gating and dedup, seed 001's bounded
execution). Pure: fake handlers, a fake clock, no I/O.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from structlog.testing import capture_logs

from services.botconfig import BotConfig, Intent
from services.tools.context import TrustedContext
from services.tools.errors import QueueTimeout, UpstreamStatus
from services.tools.executor import Executor, ToolCall, ToolOutcome
from services.tools.limiter import ResourceLimiter
from services.tools.registry import Catalog
from services.tools.toolset import SessionToolState
from tests.support.fakes import FakeClock, FakeHandler, make_catalog, python_tool
from tests.support.waits import spin

CTX = TrustedContext(tenant_id="tenant-a", session_id="sess-1", message_id="msg-1")
ORDERS = BotConfig(intents={"orders": Intent(phrases=("my order",), tools=("lookup_order",))})


def call(name: str, call_id: str, **arguments: Any) -> ToolCall:
    return ToolCall(id=call_id, name=name, arguments=arguments)


# -- the turn's intent -------------------------------------------------------------------------


def _intent_catalog() -> tuple[Catalog, dict[str, FakeHandler]]:
    handlers = {n: FakeHandler(n) for n in ("lookup_order", "track_parcel", "delete_account")}
    catalog = make_catalog(
        python_tool("lookup_order"),
        python_tool("track_parcel", intents=("orders",)),  # tagged with the intent: offered with it
        python_tool("delete_account", mutability="write", requires_approval=False),
        handlers=tuple(handlers.values()),
    )
    return catalog, handlers


async def test_a_call_to_a_tool_outside_the_turns_intent_is_refused_in_band_and_runs_nothing() -> None:
    catalog, handlers = _intent_catalog()
    executor = Executor()
    plan = await executor.prepare([call("delete_account", "c1", q="me")], catalog=catalog, config=ORDERS,
                                  session=SessionToolState(), scope={}, intent="orders")
    assert not plan.needs_approval
    [outcome] = await executor.execute(plan, CTX)
    assert (outcome.success, outcome.error_kind, outcome.counts_for_breaker) == (False, "policy_denied", False)
    assert outcome.content.startswith("Tool 'delete_account' failed: this tool is not offered for "
                                      "what the customer asked ('orders'). ")
    assert "use only the tools you were offered" in outcome.content
    assert handlers["delete_account"].count == 0


@pytest.mark.parametrize(
    ("name", "intent"),
    [("lookup_order", "orders"), ("track_parcel", "orders"), ("delete_account", None),
     ("delete_account", "no_longer_configured")],
    ids=["named-by-the-intent", "tagged-with-the-intent", "no-intent", "intent-since-removed"],
)
async def test_a_tool_the_offer_would_include_for_the_intent_runs(name: str, intent: str | None) -> None:
    catalog, handlers = _intent_catalog()
    executor = Executor()
    plan = await executor.prepare([call(name, "c1")], catalog=catalog, config=ORDERS,
                                  session=SessionToolState(), scope={}, intent=intent)
    [outcome] = await executor.execute(plan, CTX)
    assert outcome.success, outcome.content
    assert handlers[name].count == 1


# -- one-shot tools called twice in one round ---------------------------------------------------


async def test_a_one_shot_tool_called_twice_in_one_batch_runs_once_and_the_second_is_refused() -> None:
    handler = FakeHandler("capture_lead")
    catalog = make_catalog(
        python_tool("capture_lead", mutability="write", completes_variable="lead_captured"), handlers=(handler,)
    )
    executor = Executor()
    plan = await executor.prepare([call("capture_lead", "a", q="ana@example.com"), call("capture_lead", "b", q="ana@example.com")],
                                  catalog=catalog, config=BotConfig(), session=SessionToolState(), scope={})
    assert [p.error is None for p in plan.calls] == [True, False]
    assert [p.needs_approval for p in plan.calls] == [True, False]  # the refused call asks no approver
    first, second = await executor.execute(plan, CTX, approved=True)
    assert first.success and first.completes_variable == "lead_captured"
    assert (second.success, second.error_kind, second.counts_for_breaker) == (False, "policy_denied", False)
    assert "already called for this in this step" in second.content
    assert handler.count == 1


async def test_a_one_shot_tool_whose_first_call_in_the_batch_was_refused_may_still_run_once() -> None:
    # the first call fails its argument checks, so it cannot complete anything: the second runs
    handler = FakeHandler("capture_lead")
    schema = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
    catalog = make_catalog(
        python_tool("capture_lead", parameters=schema, requires_approval=False, completes_variable="lead_captured"),
        handlers=(handler,),
    )
    executor = Executor()
    plan = await executor.prepare([call("capture_lead", "a"), call("capture_lead", "b", q="ana")],
                                  catalog=catalog, config=BotConfig(), session=SessionToolState(), scope={})
    first, second = await executor.execute(plan, CTX)
    assert (first.error_kind, second.success) == ("invalid_arguments", True)
    assert handler.count == 1


# -- max_parallel: the wait is inside the deadline and measured --------------------------------


async def _two_calls_behind_max_parallel(wait_s: float, *, timeout_ms: int) -> tuple[list[ToolOutcome], FakeHandler]:
    """Two calls of a `max_parallel=1` tool: the first holds its slot while `wait_s` pass on the
    clock, then finishes; returns both outcomes and the handler."""
    clock = FakeClock(start=1000.0)
    release = asyncio.Event()
    handler = FakeHandler("lookup", gate=release)
    catalog = make_catalog(python_tool("lookup", max_parallel=1, timeout_ms=timeout_ms), handlers=(handler,))
    executor = Executor(clock=clock)
    plan = await executor.prepare([call("lookup", "c1", q="a"), call("lookup", "c2", q="b")],
                                  catalog=catalog, config=BotConfig(), session=SessionToolState(), scope={})
    task = asyncio.create_task(executor.execute(plan, CTX))
    await spin(lambda: handler.count == 1)
    for _ in range(10):
        await asyncio.sleep(0)  # the second call reaches its wait
    clock.advance(wait_s)
    release.set()
    return await asyncio.wait_for(task, 10), handler


async def test_a_call_whose_deadline_passes_while_waiting_on_max_parallel_is_refused_as_a_queue_timeout() -> None:
    (first, second), handler = await _two_calls_behind_max_parallel(2.0, timeout_ms=1000)
    assert first.success, first.content
    assert (second.success, second.error_kind, second.counts_for_breaker) == (False, "queue_timeout", False)
    assert handler.count == 1  # never admitted after its deadline
    assert second.queue_ms == second.record.queue_ms == 2000
    assert second.latency_ms == second.record.latency_ms == 0


async def test_the_wait_on_max_parallel_counts_in_queue_ms() -> None:
    (first, second), handler = await _two_calls_behind_max_parallel(0.3, timeout_ms=5000)
    assert first.success and second.success, second.content
    assert (first.queue_ms, second.queue_ms) == (0, 300)
    assert second.record.queue_ms == 300
    assert handler.count == 2


# -- failures keep queue and run time apart -----------------------------------------------------


async def _fail_behind_a_shared_resource(failing: FakeHandler) -> ToolOutcome:
    """A call that waits 0.4 s (clock) for a resource another call holds, then fails at once."""
    clock = FakeClock(start=1000.0)
    release = asyncio.Event()
    holder = FakeHandler("hold", gate=release)
    catalog = make_catalog(
        python_tool("hold", resource="shared"), python_tool(failing.name, resource="shared"),
        handlers=(holder, failing),
    )
    executor = Executor(clock=clock, limiter=ResourceLimiter(default_limit=1, clock=clock))
    plan = await executor.prepare([call("hold", "c1"), call(failing.name, "c2")],
                                  catalog=catalog, config=BotConfig(), session=SessionToolState(), scope={})
    task = asyncio.create_task(executor.execute(plan, CTX))
    await spin(lambda: holder.count == 1)
    for _ in range(10):
        await asyncio.sleep(0)
    clock.advance(0.4)
    release.set()
    _, outcome = await asyncio.wait_for(task, 10)
    return outcome


async def test_a_failed_calls_queue_wait_is_recorded_apart_from_its_run_time() -> None:
    outcome = await _fail_behind_a_shared_resource(FakeHandler("bad", result=UpstreamStatus("upstream error (500)",
                                                                                            status=500)))
    assert (outcome.success, outcome.error_kind) == (False, "upstream_status")
    assert (outcome.queue_ms, outcome.latency_ms) == (400, 0)
    assert (outcome.record.queue_ms, outcome.record.latency_ms) == (400, 0)


async def test_a_crashed_calls_queue_wait_is_recorded_apart_and_the_crash_is_still_logged() -> None:
    with capture_logs() as logs:
        outcome = await _fail_behind_a_shared_resource(FakeHandler("boom", result=RuntimeError("handler bug")))
    assert (outcome.success, outcome.error_kind, outcome.counts_for_breaker) == (False, "tool_crashed", True)
    assert "handler bug" not in outcome.content
    assert (outcome.record.queue_ms, outcome.record.latency_ms) == (400, 0)
    assert [e["tool_name"] for e in logs if e["event"] == "tool_crashed"] == ["boom"]


async def test_a_queue_timeout_records_how_long_it_waited() -> None:
    clock = FakeClock(start=1000.0)
    release = asyncio.Event()
    holder = FakeHandler("hold", gate=release)
    waiter = FakeHandler("late")
    catalog = make_catalog(
        python_tool("hold", resource="shared"), python_tool("late", resource="shared", timeout_ms=150),
        handlers=(holder, waiter),
    )
    executor = Executor(clock=clock, limiter=ResourceLimiter(default_limit=1, clock=clock))
    plan = await executor.prepare([call("hold", "c1"), call("late", "c2")],
                                  catalog=catalog, config=BotConfig(), session=SessionToolState(), scope={})
    task = asyncio.create_task(executor.execute(plan, CTX))
    await spin(lambda: holder.count == 1)
    for _ in range(10):
        await asyncio.sleep(0)
    clock.advance(0.2)  # past the waiting call's 150 ms deadline on the clock
    release.set()
    _, late = await asyncio.wait_for(task, 10)
    assert (late.error_kind, late.record.queue_ms, late.record.latency_ms) == ("queue_timeout", 200, 0)
    assert waiter.count == 0


async def test_the_limiter_attaches_queue_and_run_time_to_the_tool_error_it_raises() -> None:
    clock = FakeClock(start=100.0)
    limiter = ResourceLimiter(limits={"crm": 1}, clock=clock)
    release = asyncio.Event()

    async def hold() -> None:
        await release.wait()

    async def fails() -> None:
        clock.advance(0.25)
        raise UpstreamStatus("upstream error (502)", status=502)

    holder = asyncio.create_task(limiter.run("crm", clock.now + 60, hold))
    await spin(lambda: limiter.in_use("crm") == 1)
    waiting = asyncio.create_task(limiter.run("crm", clock.now + 60, fails))
    for _ in range(5):
        await asyncio.sleep(0)
    clock.advance(3.0)
    release.set()
    await holder
    with pytest.raises(UpstreamStatus) as failed:
        await waiting
    assert (failed.value.queue_s, failed.value.run_s) == (3.0, 0.25)
    with pytest.raises(QueueTimeout) as timed_out:
        await limiter.run("crm", clock.now - 1, hold)
    assert (timed_out.value.queue_s, timed_out.value.run_s) == (0.0, 0.0)
