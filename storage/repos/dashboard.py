"""DashboardRepo: the read-only queries behind the tenant dashboard that no other repository has.

Calls per tool per time bucket (for the calls-over-time chart) and a session's turns with the
user's text and the reply (to put the tool calls of a turn next to what was said). Every query
filters by tenant_id; sessions are addressed by the tenant's own id, like SessionRepo.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import asyncpg
import msgspec

from kernel.records import session_uid
from storage.errors import translate


class ToolCallBucket(msgspec.Struct, frozen=True, kw_only=True):
    """Calls of one tool that started in [bucket, bucket + width)."""

    name: str
    bucket: datetime
    calls: int
    successes: int


class TurnSummary(msgspec.Struct, frozen=True, kw_only=True):
    """One answered turn of a session: what the user wrote and what the bot replied."""

    message_id: str
    text: str | None
    reply: str | None
    created_at: datetime


class DashboardRepo:
    """Aggregates and joins for the dashboard; it writes nothing."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def call_buckets(self, tenant_id: str, since: datetime, width_s: int) -> list[ToolCallBucket]:
        """Tool calls since `since`, counted per tool and per `width_s`-second bucket aligned to
        the Unix epoch; oldest bucket first, then by tool name. Empty buckets are not returned."""
        with translate("bucketing tool calls"):
            rows = await self._pool.fetch(
                "SELECT tool_name, to_timestamp(floor(extract(epoch FROM created_at) / $3) * $3) AS bucket, "
                "count(*) AS calls, count(*) FILTER (WHERE success) AS successes "
                "FROM ce_tool_calls WHERE tenant_id = $1 AND created_at >= $2 "
                "GROUP BY 1, 2 ORDER BY 2, 1",
                tenant_id, since, float(width_s),
            )
        return [
            ToolCallBucket(name=r["tool_name"], bucket=r["bucket"], calls=r["calls"], successes=r["successes"])
            for r in rows
        ]

    async def turns(self, tenant_id: str, session_id: str, limit: int = 50) -> list[TurnSummary]:
        """The session's latest `limit` answered turns, newest first."""
        uid = session_uid(tenant_id, session_id)
        with translate("reading a session's turns"):
            rows = await self._pool.fetch(
                "SELECT t.message_id, t.response, t.created_at, ("
                "  SELECT m.content FROM ce_messages m WHERE m.tenant_id = $1 AND m.session_id = $2 "
                "  AND m.message_id = t.message_id AND m.role = 'user' ORDER BY m.seq LIMIT 1"
                ") AS content FROM ce_turns t WHERE t.tenant_id = $1 AND t.session_id = $2 "
                "ORDER BY t.created_at DESC, t.message_id LIMIT $3",
                tenant_id, uid, limit,
            )
        return [
            TurnSummary(
                message_id=r["message_id"], text=_user_text(r["content"]),
                reply=(r["response"] or {}).get("reply") if isinstance(r["response"], dict) else None,
                created_at=r["created_at"],
            )
            for r in rows
        ]


def _user_text(content: Any) -> str | None:
    """The text of a user message stored as LLM content blocks (or a plain string)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text"]
        return "\n".join(t for t in texts if t) or None
    return None
