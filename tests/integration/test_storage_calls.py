"""ToolCallRepo: the call log and per-tool analytics with real percentiles; BotConfigRepo."""

from __future__ import annotations

import secrets
from datetime import UTC, datetime, timedelta

import pytest

from kernel.errors import InvalidInput
from kernel.records import ToolCallRecord, session_uid
from storage.repos import BotConfigRepo, ToolCallRepo


@pytest.fixture
def calls(pool) -> ToolCallRepo:
    return ToolCallRepo(pool)


def record(tenant_id: str, tool: str, latency: int, *, ok: bool = True, session: str = "s1",
           at: datetime | None = None) -> ToolCallRecord:
    return ToolCallRecord(
        id=secrets.token_hex(8), tenant_id=tenant_id, session_id=session, message_id=None,
        tool_name=tool, parameters={"q": "[redacted]"}, result={"ok": ok}, success=ok,
        latency_ms=latency, queue_ms=1, error=None if ok else "boom", created_at=at,
    )


def percentile_cont(values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks, as Postgres's percentile_cont."""
    v = sorted(values)
    pos = p * (len(v) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


async def test_stats_per_tool_with_real_percentiles(calls, make_tenant):
    tenant, _ = await make_tenant()
    lookup = [7, 13, 21, 40, 41, 55, 60, 99, 120, 300, 1000]
    records = [record(tenant.id, "lookup", ms, ok=i % 4 != 0) for i, ms in enumerate(lookup)]
    records += [record(tenant.id, "book", ms) for ms in (100, 200)]
    old = datetime.now(UTC) - timedelta(days=3)
    records += [record(tenant.id, "book", 5, ok=False, at=old) for _ in range(20)]  # before `since`
    await calls.record_many(records)

    stats = await calls.stats(tenant.id, since=datetime.now(UTC) - timedelta(days=1))
    assert [s.name for s in stats] == ["lookup", "book"]  # most calls first
    lk, bk = stats
    assert lk.calls == 11
    assert lk.success_rate == pytest.approx(8 / 11)
    assert lk.p50_ms == pytest.approx(percentile_cont(lookup, 0.5)) == 55
    assert lk.p95_ms == pytest.approx(percentile_cont(lookup, 0.95)) == pytest.approx(650.0)
    assert (bk.calls, bk.success_rate, bk.p50_ms, bk.p95_ms) == (2, 1.0, 150.0, pytest.approx(195.0))

    everything = await calls.stats(tenant.id, since=old - timedelta(seconds=1))
    assert [(s.name, s.calls) for s in everything] == [("book", 22), ("lookup", 11)]


async def test_record_many_is_idempotent_and_recent_is_newest_first(calls, pool, make_tenant):
    tenant, _ = await make_tenant()
    now = datetime.now(UTC)
    batch = [record(tenant.id, f"t{i}", 10, at=now - timedelta(seconds=10 - i)) for i in range(5)]
    await calls.record_many(batch)
    await calls.record_many(batch)  # a retried batch
    await calls.record_many([record(tenant.id, "elsewhere", 1, session="s2")])
    await calls.record_many([])
    recent = await calls.recent(tenant.id, "s1", limit=3)
    assert [c.tool_name for c in recent] == ["t4", "t3", "t2"]
    assert recent[0] == batch[4]  # everything round-trips, with the tenant's own session id
    assert await pool.fetchval(
        "SELECT count(*) FROM ce_tool_calls WHERE session_id = $1", session_uid(tenant.id, "s1")
    ) == 5


async def test_bot_config_defaults_to_empty_and_replaces_whole(pool, make_tenant):
    repo = BotConfigRepo(pool)
    tenant, _ = await make_tenant()
    assert await repo.get(tenant.id) == {}
    await repo.put(tenant.id, {"persona": "p", "intents": {"order": {"phrases": ["order"], "tools": ["x"]}}})
    await repo.put(tenant.id, {"persona": "q"})
    assert await repo.get(tenant.id) == {"persona": "q"}
    with pytest.raises(InvalidInput, match="the bot config must be a JSON object"):
        await repo.put(tenant.id, ["not", "an", "object"])  # type: ignore[arg-type]
