"""NotificationRepo: the outbox of tenant notifications (ce_notifications).

Claiming is safe with any number of delivering processes: due rows are taken with
`FOR UPDATE SKIP LOCKED` and leased (their next attempt moved `lease_s` ahead) in one statement,
so a process that dies mid-delivery leaves the row to be claimed again once the lease ends.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import msgspec

from storage.errors import translate


class NewNotification(msgspec.Struct, frozen=True, kw_only=True):
    """An event to queue: written by the repository that writes the row it is about, in the same
    transaction (services.builtins.notify.Announcer builds it from that row)."""

    id: str
    tenant_id: str
    event_type: str
    payload: dict[str, Any]


_INSERT = ("INSERT INTO ce_notifications (id, tenant_id, event_type, payload) VALUES ($1, $2, $3, $4) "
           "ON CONFLICT (id) DO NOTHING")


async def insert_notification(conn: Any, n: NewNotification) -> bool:
    """Queue `n` on `conn` (inside the caller's transaction); False when its id is already queued."""
    done = await conn.execute(_INSERT, n.id, n.tenant_id, n.event_type, n.payload)
    return done.endswith(" 1")


class PendingNotification(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    tenant_id: str
    event_type: str
    payload: dict[str, Any]
    attempts: int  # this one included


_CLAIM = """
UPDATE ce_notifications n SET attempts = n.attempts + 1, next_attempt_at = now() + make_interval(secs => $2)
WHERE n.id IN (
  SELECT id FROM ce_notifications
  WHERE delivered_at IS NULL AND failed_at IS NULL AND next_attempt_at <= now()
  ORDER BY next_attempt_at LIMIT $1 FOR UPDATE SKIP LOCKED)
RETURNING n.id, n.tenant_id, n.event_type, n.payload, n.attempts
"""


_VIEW_COLUMNS = ("id, event_type, payload, attempts, last_error, created_at, next_attempt_at, delivered_at, "
                 "failed_at")


def _view(row: Any) -> dict[str, Any]:
    status = "delivered" if row["delivered_at"] else "failed" if row["failed_at"] else "pending"
    return {"id": row["id"], "event_type": row["event_type"], "status": status, "attempts": row["attempts"],
            "last_error": row["last_error"], "created_at": row["created_at"],
            "next_attempt_at": row["next_attempt_at"] if status == "pending" else None,
            "delivered_at": row["delivered_at"], "failed_at": row["failed_at"],
            "data": (row["payload"] or {}).get("data")}


class NotFailed(Exception):
    """A retry was asked for a notification that is pending or delivered."""


class NotificationRepo:
    def __init__(self, pool: Any) -> None:
        self._pool = pool

    async def enqueue(self, n: NewNotification) -> bool:
        """Queue the event on its own; False when an event with this id is already queued (or sent)."""
        with translate("queueing a notification"):
            return await insert_notification(self._pool, n)

    async def claim_due(self, limit: int, lease_s: float) -> list[PendingNotification]:
        with translate("claiming notifications"):
            rows = await self._pool.fetch(_CLAIM, limit, lease_s)
        return [PendingNotification(id=r["id"], tenant_id=r["tenant_id"], event_type=r["event_type"],
                                    payload=r["payload"], attempts=r["attempts"]) for r in rows]

    # Outcomes are written only by the attempt that holds the claim: a process whose lease ran out
    # while it sent (another process claimed the event again) changes nothing.
    _OPEN = "id = $1 AND attempts = $2 AND delivered_at IS NULL AND failed_at IS NULL"

    async def delivered(self, id: str, attempt: int) -> None:
        with translate("recording a delivered notification"):
            await self._pool.execute(
                f"UPDATE ce_notifications SET delivered_at = now(), last_error = NULL WHERE {self._OPEN}", id, attempt)

    async def retry_in(self, id: str, attempt: int, delay_s: float, error: str) -> None:
        with translate("scheduling a notification retry"):
            await self._pool.execute(
                "UPDATE ce_notifications SET next_attempt_at = now() + make_interval(secs => $3), last_error = $4 "
                f"WHERE {self._OPEN}", id, attempt, delay_s, error[:500])

    async def give_up(self, id: str, attempt: int, error: str) -> None:
        with translate("recording a failed notification"):
            await self._pool.execute(
                f"UPDATE ce_notifications SET failed_at = now(), last_error = $3 WHERE {self._OPEN}",
                id, attempt, error[:500])

    async def settled(self, ids: list[str]) -> set[str]:
        """Which of `ids` are delivered or given up."""
        with translate("reading notifications"):
            rows = await self._pool.fetch(
                "SELECT id FROM ce_notifications WHERE id = ANY($1) AND (delivered_at IS NOT NULL OR failed_at IS NOT NULL)",
                ids)
        return {r["id"] for r in rows}

    async def prune(self, older_than_s: float) -> int:
        """Delete notifications delivered or given up more than `older_than_s` ago (their
        payloads hold contact details); returns how many."""
        with translate("pruning notifications"):
            done = await self._pool.execute(
                "DELETE FROM ce_notifications WHERE coalesce(delivered_at, failed_at) < now() - make_interval(secs => $1)",
                older_than_s)
        return int(done.split()[-1])

    async def list(self, tenant_id: str, status: str | None = None, limit: int = 100, *,
                   before: tuple[datetime, str] | None = None) -> list[dict[str, Any]]:
        """The tenant's notifications, newest first (after the one `before` names: (created_at,
        id)); `status` one of pending, delivered, failed."""
        where = {None: "", "pending": " AND delivered_at IS NULL AND failed_at IS NULL",
                 "delivered": " AND delivered_at IS NOT NULL", "failed": " AND failed_at IS NOT NULL"}[status]
        at, key = before or (None, None)
        with translate("listing notifications"):
            rows = await self._pool.fetch(
                f"SELECT {_VIEW_COLUMNS} FROM ce_notifications WHERE tenant_id = $1{where} "
                "AND ($3::timestamptz IS NULL OR created_at < $3 OR (created_at = $3 AND id > $4::text)) "
                "ORDER BY created_at DESC, id LIMIT $2", tenant_id, limit, at, key)
        return [_view(r) for r in rows]

    async def retry(self, tenant_id: str, id: str) -> dict[str, Any] | None:
        """Queue a given-up notification again (a fresh schedule); returns it, or None when the
        tenant has no such notification. Raises NotFailed when it is not given up."""
        with translate("retrying a notification"):
            row = await self._pool.fetchrow(
                "UPDATE ce_notifications SET failed_at = NULL, attempts = 0, next_attempt_at = now(), last_error = NULL "
                f"WHERE tenant_id = $1 AND id = $2 AND failed_at IS NOT NULL RETURNING {_VIEW_COLUMNS}", tenant_id, id)
            if row is None:
                row = await self._pool.fetchrow(
                    f"SELECT {_VIEW_COLUMNS} FROM ce_notifications WHERE tenant_id = $1 AND id = $2", tenant_id, id)
                if row is None:
                    return None
                raise NotFailed(f"notification {id!r} is {_view(row)['status']}, not failed")
        return _view(row)
