"""ToolCallRepo: the ce_tool_calls log (seed 000) and the per-tool analytics read from it.

Rows store `session_id` as session_uid(tenant_id, session id); records in and out carry the
tenant's own session id. Inserting is idempotent by call id, so a retried flush cannot duplicate.
"""

from __future__ import annotations

from datetime import datetime

import asyncpg

from kernel.records import ToolCallRecord, ToolStats, session_uid
from storage.errors import translate
from storage.pool import storable_text

INSERT_CALL_SQL = (
    "INSERT INTO ce_tool_calls (id, session_id, tenant_id, message_id, tool_name, parameters, "
    "result, success, latency_ms, queue_ms, error, created_at, trace_id) "
    "VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, coalesce($12, now()), $13) "
    "ON CONFLICT (id) DO NOTHING"
)


def call_row(rec: ToolCallRecord, tenant_id: str, session_id: str) -> tuple:
    """Arguments of INSERT_CALL_SQL for one record, under the given tenant and session."""
    return (
        rec.id, session_uid(tenant_id, session_id), tenant_id, storable_text(rec.message_id),
        storable_text(rec.tool_name), rec.parameters, rec.result, rec.success, rec.latency_ms,
        rec.queue_ms, storable_text(rec.error), rec.created_at, rec.trace_id,
    )


class ToolCallRepo:
    """Write the tool-call log in batches; read a session's recent calls and per-tool stats."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def record_many(self, records: list[ToolCallRecord]) -> None:
        """Insert the records in one round trip (each under its own tenant_id/session_id);
        ids already stored are skipped."""
        if not records:
            return
        rows = [call_row(r, r.tenant_id, r.session_id) for r in records]
        with translate("recording tool calls"):
            await self._pool.executemany(INSERT_CALL_SQL, rows)

    async def stats(self, tenant_id: str, since: datetime) -> list[ToolStats]:
        """Per tool since `since`: calls, success rate, median and 95th percentile latency
        (continuous percentiles, ms); most-called first."""
        with translate("computing tool analytics"):
            rows = await self._pool.fetch(
                "SELECT tool_name, count(*) AS calls, avg(success::int)::float8 AS success_rate, "
                "percentile_cont(0.5) WITHIN GROUP (ORDER BY latency_ms) AS p50, "
                "percentile_cont(0.95) WITHIN GROUP (ORDER BY latency_ms) AS p95 "
                "FROM ce_tool_calls WHERE tenant_id = $1 AND created_at >= $2 "
                "GROUP BY tool_name ORDER BY calls DESC, tool_name",
                tenant_id, since,
            )
        return [
            ToolStats(
                name=r["tool_name"], calls=r["calls"], success_rate=r["success_rate"],
                p50_ms=r["p50"] or 0.0, p95_ms=r["p95"] or 0.0,
            )
            for r in rows
        ]

    async def failures_matching(self, tenant_id: str, since: datetime, fragment: str) -> dict[str, int]:
        """Per tool, how many failed calls since `since` have `fragment` in their error text."""
        with translate("counting tool failures"):
            rows = await self._pool.fetch(
                "SELECT tool_name, count(*) AS n FROM ce_tool_calls WHERE tenant_id = $1 AND created_at >= $2 "
                "AND NOT success AND strpos(error, $3) > 0 GROUP BY tool_name",
                tenant_id, since, fragment,
            )
        return {r["tool_name"]: r["n"] for r in rows}

    async def recent(self, tenant_id: str, session_id: str, limit: int = 50) -> list[ToolCallRecord]:
        """The session's latest `limit` tool calls, newest first."""
        with translate("reading recent tool calls"):
            rows = await self._pool.fetch(
                "SELECT id, message_id, tool_name, parameters, result, success, latency_ms, "
                "queue_ms, error, created_at, trace_id FROM ce_tool_calls "
                "WHERE tenant_id = $1 AND session_id = $2 "
                "ORDER BY created_at DESC, id DESC LIMIT $3",
                tenant_id, session_uid(tenant_id, session_id), limit,
            )
        return [
            ToolCallRecord(
                id=r["id"], tenant_id=tenant_id, session_id=session_id, message_id=r["message_id"],
                tool_name=r["tool_name"], parameters=r["parameters"], result=r["result"],
                success=r["success"], latency_ms=r["latency_ms"] or 0, queue_ms=r["queue_ms"] or 0,
                error=r["error"], created_at=r["created_at"], trace_id=r["trace_id"],
            )
            for r in rows
        ]
