"""Tenant isolation through every repository function: tenant A never reads or changes B's rows.

Both tenants use the same tool names, session id, message id and variable keys, so any query
missing its tenant filter would surface the other tenant's row here.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from kernel.errors import NotFound
from kernel.records import SessionDelta, SessionSnapshot, ToolCallRecord, TurnRecord, UsageDelta
from storage.repos import BotConfigRepo, SessionRepo, TenantRepo, ToolCallRepo, ToolRepo

DEF = {"description": "d", "parameters": {}, "webhook_url": "https://x.example/{id}"}


def _state(tenant_id: str, epoch: int, tag: str) -> SessionDelta:
    return SessionDelta(
        tenant_id=tenant_id, session_id="s1", epoch=epoch,
        snapshot=SessionSnapshot(breakers={f"tool_{tag}": 3}, message_count=1, handoff=tag == "b"),
        variables={"who": tag},
        tool_calls=[ToolCallRecord(
            id=f"{tenant_id}-c1", tenant_id=tenant_id, session_id="s1", message_id="m1",
            tool_name=f"tool_{tag}", parameters=None, result=None, success=True, latency_ms=1,
        )],
        usage=[UsageDelta(model=f"model_{tag}", input_tokens=1, output_tokens=1)],
        turns=[TurnRecord(message_id="m1", response={"reply": tag})],
    )


@pytest.fixture
async def two_tenants(pool, make_tenant):
    a, _ = await make_tenant("a")
    b, b_key = await make_tenant("b")
    tools, sessions, config = ToolRepo(pool), SessionRepo(pool), BotConfigRepo(pool)
    for t in (a, b):
        await tools.create(t.id, "shared", "webhook", DEF)
    await tools.create(b.id, "only_b", "webhook", DEF)
    for t, tag in ((a, "a"), (b, "b")):
        lease = await sessions.activate(t.id, "s1", owner=tag)
        result = await sessions.flush([_state(t.id, lease.epoch, tag)])
        assert result.written
        await config.put(t.id, {"persona": tag})
    return a, b, b_key


async def test_tools_of_another_tenant_are_invisible_and_untouchable(pool, two_tenants):
    a, b, _ = two_tenants
    tools = ToolRepo(pool)
    for attempt in (
        lambda: tools.get(a.id, "only_b"),
        lambda: tools.versions(a.id, "only_b"),
        lambda: tools.publish(a.id, "only_b", 1),
        lambda: tools.new_version(a.id, "only_b", DEF, publish=True),
        lambda: tools.set_enabled(a.id, "only_b", False),
        lambda: tools.delete(a.id, "only_b"),
    ):
        with pytest.raises(NotFound):
            await attempt()
    assert [t.name for t in await tools.list_published(a.id)] == ["shared"]

    # A changing its own "shared" leaves B's "shared" exactly as it was
    b_before = await tools.get(b.id, "shared")
    await tools.new_version(a.id, "shared", {**DEF, "description": "a2"}, publish=True)
    await tools.set_enabled(a.id, "shared", False)
    await tools.delete(a.id, "shared")
    assert await tools.get(b.id, "shared") == b_before
    assert [v.version for v in await tools.versions(b.id, "shared")] == [1]
    assert [v.version for v in await tools.versions(a.id, "shared")] == [1, 2]

    # names are per tenant: A may create what B has
    assert (await tools.create(a.id, "only_b", "webhook", DEF)).version == 1
    assert (await tools.get(b.id, "only_b")).tenant_id == b.id


async def test_calls_sessions_variables_turns_usage_and_config_are_per_tenant(pool, two_tenants):
    a, b, b_key = two_tenants
    calls, sessions, config = ToolCallRepo(pool), SessionRepo(pool), BotConfigRepo(pool)

    stats = await calls.stats(a.id, since=datetime.now(UTC) - timedelta(hours=1))
    assert [s.name for s in stats] == ["tool_a"]
    assert [c.tool_name for c in await calls.recent(a.id, "s1")] == ["tool_a"]

    view = await sessions.get_session_view(a.id, "s1")
    assert (view.variables, view.open_breakers, view.handoff) == ({"who": "a"}, ["tool_a"], False)
    assert await sessions.get_turn(a.id, "s1", "m1") == {"reply": "a"}
    assert [s.session_id for s in await sessions.list_sessions(a.id)] == ["s1"]
    assert [u.model for u in await sessions.usage_totals(a.id)] == ["model_a"]
    assert await config.get(a.id) == {"persona": "a"}

    # A's activation and flushes of its "s1" never fence or overwrite B's "s1"
    a_again = await sessions.activate(a.id, "s1", owner="a2")
    assert a_again.variables == {"who": "a"}
    assert (await sessions.flush([_state(b.id, 1, "b")])).written == [(b.id, "s1")]
    await sessions.flush([_state(a.id, a_again.epoch, "a")])
    assert (await sessions.get_session_view(b.id, "s1")).variables == {"who": "b"}
    assert await sessions.current_epoch(b.id, "s1") == 1

    # a delta naming A cannot land in B's session even with B's epoch
    assert (await sessions.flush([_state(a.id, 1, "b")])).refused == [(a.id, "s1")]
    assert await sessions.release(a.id, "s1", 1) is False  # B's epoch, A's tenant
    assert await TenantRepo(pool).tenant_for_key(b_key.api_key) == b
