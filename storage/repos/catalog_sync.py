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
not acknowledge within ACK_TIMEOUT_S is marked `lagging`; its next beat drops its catalogs before
it clears the mark, and the writer waits until then (or until the listener's beat is TRUST_S old,
when it no longer trusts its cache and its next beat finds the mark first).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

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
#: the longest a writer waits for the acknowledgements before it marks the laggards
ACK_TIMEOUT_S = 2.0
#: a statement of the writer's wait (the wait for a pooled connection included)
QUERY_TIMEOUT_S = 1.0
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
# a marked listener that may still trust its cache: no beat has seen the mark (a beat that does
# drops every catalog before it commits), and its last beat is recent enough for trust
_STILL_TRUSTING = (
    "SELECT count(*) FROM ce_catalog_listeners WHERE seen < $1 AND lagging "
    "AND beat_at > now() - make_interval(secs => $2) "
    "AND EXISTS (SELECT 1 FROM pg_stat_get_activity(backend_pid))"
)
_BEAT = (
    "INSERT INTO ce_catalog_listeners (listener_id, backend_pid, seen) VALUES ($1, $2, $3) "
    "ON CONFLICT (listener_id) DO UPDATE SET beat_at = now(), lagging = false, backend_pid = $2, "
    "seen = greatest(ce_catalog_listeners.seen, $3)"
)
#: every fence given out so far (a sequence is not transactional: a fence taken is counted)
_LAST_FENCE = "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM ce_catalog_fence"
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
    """Call after a catalog change committed: returns once every live listener has seen it
    (True). A listener that has not acknowledged within `timeout_s` is marked lagging, and the
    wait goes on until none of those still trusts its cache: each has beaten since (a beat that
    finds the mark drops every catalog first), or its last beat is older than TRUST_S, or its
    LISTEN connection is gone; then False. That second wait ends within TRUST_S plus a query
    timeout. Never raises: the change is stored either way. When Postgres fails the fence or the
    wait twice, the failure is logged (`catalog_change_announce_failed`) and the listeners are
    left to the change's own NOTIFY."""
    for attempt in (1, 2):
        try:
            with translate("announcing a catalog change"):
                return await _announce(pool, timeout_s)
        except Exception as exc:  # noqa: BLE001 - the change itself is committed; see the docstring
            log.warning("catalog_change_announce_failed", error=type(exc).__name__, attempt=attempt)
    return False


async def _announce(pool: asyncpg.Pool, timeout_s: float) -> bool:
    fence = await _query(pool, _FENCE, timeout_s=QUERY_TIMEOUT_S)
    if await _wait(pool, _WAITING, fence, LIVE_S, until=time.monotonic() + timeout_s):
        return True
    late = await asyncio.wait_for(pool.fetch(_MARK_LAGGING, fence, LIVE_S), QUERY_TIMEOUT_S)
    log.warning("catalog_change_not_acknowledged", fence=fence, listeners=[r["listener_id"] for r in late],
                waited_s=timeout_s)
    if not await _wait(pool, _STILL_TRUSTING, fence, TRUST_S, until=time.monotonic() + TRUST_S + BEAT_S):
        log.error("catalog_change_lagging_listener_still_trusting", fence=fence)
    return False


async def _query(pool: asyncpg.Pool, sql: str, *args: object, timeout_s: float) -> object:
    """One value, the wait for a pooled connection included in the timeout."""
    return await asyncio.wait_for(pool.fetchval(sql, *args), timeout_s)


async def _wait(pool: asyncpg.Pool, counting: str, fence: int, seconds: float, *, until: float) -> bool:
    """Poll `counting` until it counts no listener (True) or `until` passes (False)."""
    pause = 0.001
    while True:
        left = until - time.monotonic()
        if not await _query(pool, counting, fence, seconds, timeout_s=max(left, 0.0) + QUERY_TIMEOUT_S):
            return True
        if time.monotonic() >= until:
            return False
        await asyncio.sleep(min(pause, max(left, 0.0)))
        pause = min(pause * 2, 0.02)


class ListenerNotVisible(Exception):
    """The LISTEN connection's server process is not among this Postgres's processes."""

    def __init__(self, pid: int) -> None:
        super().__init__(f"server process {pid} of the catalog listener is not visible in pg_stat_activity; "
                         "turns read the catalog stamp (behind a pooler, set CE_CATALOG_CHECK=read)")


class ListenerRow:
    """One listening process's row in ce_catalog_listeners."""

    def __init__(self, pool: asyncpg.Pool, listener_id: str) -> None:
        self._pool = pool
        self.listener_id = listener_id

    async def beat(self, backend_pid: int, seen: int = 0, *, drop_all: Callable[[bool], bool] | None = None) -> bool:
        """Record that this listener is alive, listening on the connection of server process
        `backend_pid` (creating its row), and has handled every fence up to `seen` (a fence
        acknowledged before the row existed, or whose acknowledgement failed, counts from here).

        Before the beat commits, `drop_all(lagging)` is called (lagging: a writer marked this
        listener since the last beat); it returns True when it dropped every cached catalog,
        which then counts as having seen every fence given out so far. A writer waiting on a
        lagging listener stops when the mark is cleared, so the drop must come first. Returns
        `lagging`. Raises ListenerNotVisible when `backend_pid` is not a server process of this
        Postgres: writers could not tell whether it is alive."""
        with translate("recording a catalog listener's beat"):
            async with self._pool.acquire() as conn, conn.transaction():
                # locked first: a writer's mark lands before this read or after the beat
                lagging = bool(await conn.fetchval(
                    "SELECT lagging FROM ce_catalog_listeners WHERE listener_id = $1 FOR UPDATE", self.listener_id))
                if not await conn.fetchval("SELECT EXISTS (SELECT 1 FROM pg_stat_get_activity($1))", backend_pid):
                    raise ListenerNotVisible(backend_pid)
                if drop_all is not None and drop_all(lagging):
                    seen = max(seen, await conn.fetchval(_LAST_FENCE))
                await conn.execute(_BEAT, self.listener_id, backend_pid, seen)
        return lagging

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
