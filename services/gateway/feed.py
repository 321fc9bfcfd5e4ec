"""The agents' feed (GET /v1/handoffs/events): every event of a tenant's sessions that a person
has, or that change hands, live, for the tenant's inbox.

A session's own stream comes from its host; the feed spans every session of a tenant, on every
host, so it comes from Postgres: a flush that writes such events sends a notice on commit
(storage.repos.sessions.FEED_CHANNEL: tenant, session, the numbers written), and each gateway
holds one LISTEN for all its feed watchers. A notice is read back (the events it numbers) once
per gateway, not per watcher, and notices are handled one after another, so each session's
events reach a watcher in order. A notice sent while this gateway's LISTEN was down is not seen:
a watcher is told (`reset`) and reloads the open handoffs (GET /v1/handoffs), as it does when it
connects. A watcher that cannot keep up (its queue full) is told likewise and dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import msgspec
import structlog

from kernel.records import SessionEvent
from storage.repos.notify import ChannelListener, listen
from storage.repos.sessions import FEED_CHANNEL, FeedNotice

log = structlog.get_logger(__name__)

#: events a feed watcher may have waiting before it is dropped (told to reload)
WATCHER_QUEUE = 1000
#: what a watcher's queue gets when it missed events: reload the open handoffs, then go on
RESET = "reset"

_notice_decoder = msgspec.json.Decoder(FeedNotice)

FeedItem = tuple[str, SessionEvent] | str  # (session id, event), or RESET


class AgentFeed:
    def __init__(self, pool: Any, sessions: Any) -> None:
        self._pool = pool
        self._sessions = sessions  # storage SessionRepo: events_after
        self._watchers: dict[str, set[asyncio.Queue[FeedItem]]] = {}
        self._listener: ChannelListener | None = None
        self._opening = asyncio.Lock()
        self._notices: asyncio.Queue[str] = asyncio.Queue()
        self._worker: asyncio.Task | None = None

    async def subscribe(self, tenant_id: str) -> asyncio.Queue[FeedItem]:
        """A queue of the tenant's feed items from now on; `unsubscribe` it when done. Raises
        StorageUnavailable when Postgres cannot be reached to listen."""
        await self._listen()
        queue: asyncio.Queue[FeedItem] = asyncio.Queue(maxsize=WATCHER_QUEUE)
        self._watchers.setdefault(tenant_id, set()).add(queue)
        return queue

    def unsubscribe(self, tenant_id: str, queue: asyncio.Queue[FeedItem]) -> None:
        watchers = self._watchers.get(tenant_id)
        if watchers is not None:
            watchers.discard(queue)
            if not watchers:
                del self._watchers[tenant_id]

    @property
    def watchers(self) -> int:
        return sum(map(len, self._watchers.values()))

    async def _listen(self) -> None:
        async with self._opening:
            if self._listener is not None and not self._listener.closed:
                return
            self._listener = await listen(self._pool, FEED_CHANNEL, self._notices.put_nowait,
                                          on_lost=self._lost, doing="listening for the agents' feed")
            if self._worker is None:
                self._worker = asyncio.get_running_loop().create_task(self._work(), name="agents-feed")

    def _lost(self) -> None:
        """The LISTEN connection died: notices meanwhile are lost. Every watcher reloads; the next
        subscription (or the watchers' reconnects) listens again."""
        log.warning("agents_feed_listener_lost", watchers=self.watchers)
        if self._listener is not None:
            self._listener.closed = True
        for watchers in self._watchers.values():
            for queue in list(watchers):
                self._put(queue, RESET)

    async def _work(self) -> None:
        while True:
            payload = await self._notices.get()
            try:
                await self._deliver(_notice_decoder.decode(payload))
            except Exception as exc:  # noqa: BLE001 - one notice lost; its watchers reload
                log.warning("agents_feed_notice_failed", error=type(exc).__name__)
                for queue in list(self._watchers.get(_tenant_of(payload), ())):
                    self._put(queue, RESET)

    async def _deliver(self, notice: FeedNotice) -> None:
        watchers = self._watchers.get(notice.t)
        if not watchers:
            return  # nobody of that tenant watches on this gateway: nothing is read
        events = [e for e in await self._sessions.events_after(notice.t, notice.s, notice.a) if e.seq <= notice.z]
        for queue in list(watchers):
            for event in events:
                if not self._put(queue, (notice.s, event)):
                    break

    def _put(self, queue: asyncio.Queue[FeedItem], item: FeedItem) -> bool:
        try:
            queue.put_nowait(item)
            return True
        except asyncio.QueueFull:  # too slow: dropped, told to reload when it reads again
            for watchers in self._watchers.values():
                watchers.discard(queue)
            with contextlib.suppress(asyncio.QueueEmpty):
                queue.get_nowait()
            queue.put_nowait(RESET)
            return False

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
        if self._listener is not None:
            await self._listener.close()


def _tenant_of(payload: str) -> str:
    try:
        return _notice_decoder.decode(payload).t
    except msgspec.DecodeError:
        return ""
