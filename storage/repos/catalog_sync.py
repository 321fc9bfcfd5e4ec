"""Catalog changes acknowledged by the processes that cache catalogs before the writer answers.

A write of a tenant's tools, bot config, MCP servers, forms or appointment services commits with
`NOTIFY ce_catalog, '<tenant_id>'`. A notification reaches a listener a moment after the commit,
so a message sent right after the write could overtake it. Rather than have every turn read a
stamp of the catalog from Postgres to catch that (a round trip per message), the writer closes the
gap: `announce_change` sends a fence (`NOTIFY ce_catalog, 'fence:<n>'`, committed after the
change) and waits until every live listener has acknowledged a fence >= n. Notifications reach a
listener in commit order, so a listener acknowledging the fence has already dropped the changed
tenant's catalog. Fence numbers come from a sequence, each taken after its change committed: any
fence >= n was committed after the change too.

A listener is live while its beat (`ListenerRow.beat`, every BEAT_S) is younger than LIVE_S and
the server process of its LISTEN connection is still there (a listener that died or lost that
connection is left out at once). A
listener trusts its cache without reading a stamp only while its own last successful beat was
sent less than TRUST_S ago (see services.catalog_sync); LIVE_S > TRUST_S, so a listener a writer
leaves out of its wait is one that already reads a stamp every turn. A live listener that does
not acknowledge within ACK_TIMEOUT_S is marked `lagging`, and its next beat drops its catalogs.
"""

from __future__ import annotations

import asyncio
import time

import asyncpg
import structlog

from storage.errors import translate

log = structlog.get_logger(__name__)

#: sent in the transaction of every catalog change, with the tenant's id
NOTIFY_CHANGE = "SELECT pg_notify('ce_catalog', $1)"
#: a notification payload naming a fence rather than a tenant (tenant ids start with "tn_")
FENCE_PREFIX = "fence:"
#: seconds between a listener's beats
BEAT_S = 2.0
#: a listener trusts its cached catalogs while its last successful beat was sent this recently
TRUST_S = 5.0
#: writers wait for listeners whose last beat is younger than this (> TRUST_S: see above)
LIVE_S = 10.0
#: the longest a writer waits for the acknowledgements before it answers anyway
ACK_TIMEOUT_S = 2.0
#: a listener's row left behind by a process that died is removed after this long without a beat
FORGET_S = 3600.0

_FENCE = (
    "WITH f AS (SELECT nextval('ce_catalog_fence') AS n) "
    "SELECT n, pg_notify('ce_catalog', 'fence:' || n) FROM f"
)
# a live listener: beat recently, and its LISTEN connection's server process still there
_LIVE = (
    "beat_at > now() - make_interval(secs => $2) "
    "AND EXISTS (SELECT 1 FROM pg_stat_get_activity(backend_pid))"
)
_WAITING = f"SELECT count(*) FROM ce_catalog_listeners WHERE seen < $1 AND {_LIVE}"
_MARK_LAGGING = f"UPDATE ce_catalog_listeners SET lagging = true WHERE seen < $1 AND {_LIVE} RETURNING listener_id"
_BEAT = (
    "INSERT INTO ce_catalog_listeners (listener_id, backend_pid, seen) VALUES ($1, $2, $3) "
    "ON CONFLICT (listener_id) DO UPDATE SET beat_at = now(), lagging = false, backend_pid = $2, "
    "seen = greatest(ce_catalog_listeners.seen, $3)"
)
_ACK = "UPDATE ce_catalog_listeners SET seen = greatest(seen, $2) WHERE listener_id = $1"
_FORGET = "DELETE FROM ce_catalog_listeners WHERE beat_at < now() - make_interval(secs => $1)"


def fence_number(payload: str) -> int | None:
    """The fence a notification payload names, or None when it names a tenant."""
    if not payload.startswith(FENCE_PREFIX):
        return None
    try:
        return int(payload[len(FENCE_PREFIX):])
    except ValueError:
        return None


async def announce_change(pool: asyncpg.Pool, *, timeout_s: float = ACK_TIMEOUT_S) -> bool:
    """Call after a catalog change committed: returns once every live listener has seen it (True),
    or after `timeout_s` with the laggards marked (False). Never raises: the change is stored
    either way, and a listener that missed it still gets its NOTIFY (or drops its catalogs at
    its next beat)."""
    try:
        with translate("announcing a catalog change"):
            fence = await pool.fetchval(_FENCE)
            deadline = time.monotonic() + timeout_s
            pause = 0.001
            while await pool.fetchval(_WAITING, fence, LIVE_S):
                if time.monotonic() >= deadline:
                    late = await pool.fetch(_MARK_LAGGING, fence, LIVE_S)
                    log.warning("catalog_change_not_acknowledged", fence=fence,
                                listeners=[r["listener_id"] for r in late], waited_s=timeout_s)
                    return False
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.02)
            return True
    except Exception as exc:  # noqa: BLE001 - the change itself is committed; see the docstring
        log.warning("catalog_change_announce_failed", error=type(exc).__name__)
        return False


class ListenerRow:
    """One listening process's row in ce_catalog_listeners."""

    def __init__(self, pool: asyncpg.Pool, listener_id: str) -> None:
        self._pool = pool
        self.listener_id = listener_id

    async def beat(self, backend_pid: int, seen: int = 0) -> bool:
        """Record that this listener is alive, listening on the connection of server process
        `backend_pid` (creating its row), and has handled every fence up to `seen` (a fence
        acknowledged before the row existed, or whose acknowledgement failed, counts from here);
        True when a writer marked it lagging since the last beat (the mark is cleared)."""
        with translate("recording a catalog listener's beat"):
            async with self._pool.acquire() as conn, conn.transaction():
                # locked first: a writer's mark lands before this read or after the beat
                lagging = await conn.fetchval(
                    "SELECT lagging FROM ce_catalog_listeners WHERE listener_id = $1 FOR UPDATE", self.listener_id)
                await conn.execute(_BEAT, self.listener_id, backend_pid, seen)
        return bool(lagging)

    async def ack(self, fence: int) -> None:
        with translate("acknowledging a catalog fence"):
            await self._pool.execute(_ACK, self.listener_id, fence)

    async def remove(self) -> None:
        with translate("removing a catalog listener"):
            await self._pool.execute("DELETE FROM ce_catalog_listeners WHERE listener_id = $1", self.listener_id)

    async def forget_dead(self) -> None:
        """Remove the rows of listeners that have not beaten for FORGET_S (processes that died)."""
        with translate("removing dead catalog listeners"):
            await self._pool.execute(_FORGET, FORGET_S)
