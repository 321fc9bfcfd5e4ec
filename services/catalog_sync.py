"""When a process may trust its cached catalogs without reading a stamp on every turn.

A process that caches tenants' catalogs (actors.catalogs.TenantCatalogs) listens on the catalog
channel and registers as a listener (storage.repos.catalog_sync): writers of a change then wait
for its acknowledgement before they answer, so the change reaches its next message with no read.
That holds only while the process's LISTEN connection is up and its beats reach Postgres; the
rest of the time each turn reads the tenant's catalog stamp, as it did before listeners were
acknowledged. `trusted()` says which of the two a turn does.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable
from typing import Any

import structlog

from storage.repos.catalog_sync import (
    BEAT_S,
    TRUST_S,
    ListenerNotVisible,
    ListenerRow,
    fence_number,
)

log = structlog.get_logger(__name__)


class CatalogSync:
    """Beats, acknowledges fences and decides trust for one process's catalog cache.

    `notified(payload)` is the catalog listener's callback: a tenant's id drops that tenant
    (`invalidate(tenant_id)`), a fence is acknowledged once every notification before it was
    handled. `listener_up()` / `listener_lost()` follow the LISTEN connection. `invalidate()`
    (no argument) drops every catalog: called when trust comes back after a gap, since a writer
    may have left this process out of its wait meanwhile."""

    def __init__(
        self, pool: Any, invalidate: Callable[..., None], *, beat_s: float = BEAT_S, trust_s: float = TRUST_S,
        clock: Callable[[], float] = time.monotonic, listener_id: str | None = None,
    ) -> None:
        self._row = ListenerRow(pool, listener_id or f"{uuid.uuid4().hex}")
        self._invalidate = invalidate
        self._beat_s = beat_s
        self._trust_s = trust_s
        self._clock = clock
        self._listening = False
        self._beat_sent: float | None = None  # when the last successful beat was sent
        self._backend_pid = 0  # the server process of the LISTEN connection
        self._epoch = 0  # moves on every listener_up/listener_lost: a beat begun before is void
        self._acked = 0
        self._ack_target = 0
        self._acking: asyncio.Task[None] | None = None
        self._beating: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def listener_id(self) -> str:
        return self._row.listener_id

    def trusted(self) -> bool:
        """True when this process's cached catalogs are as fresh as a stamp read would make them."""
        return (self._listening and self._beat_sent is not None
                and self._clock() - self._beat_sent < self._trust_s)

    # ------------------------------------------------------------------ the listener's events

    def notified(self, payload: str) -> None:
        fence = fence_number(payload)
        if fence is None:
            self._invalidate(payload)
            return
        if fence > self._ack_target:
            self._ack_target = fence
            if self._acking is None or self._acking.done():
                self._acking = asyncio.get_running_loop().create_task(self._ack_loop())

    def listener_up(self, backend_pid: int) -> None:
        """The LISTEN connection (server process `backend_pid`) is (again) up: trusted from the
        next successful beat on."""
        self._backend_pid = backend_pid
        self._epoch += 1
        self._listening = True
        self._beat_sent = None
        if self._beating is None or self._beating.done():
            self._beating = asyncio.get_running_loop().create_task(self._beat_loop())

    def listener_lost(self) -> None:
        self._epoch += 1
        self._listening = False
        self._beat_sent = None

    # ------------------------------------------------------------------ background work

    async def beat(self) -> None:
        """One beat: on success the process is trusted for TRUST_S from when it was sent. Trust
        that comes back after a gap, or a writer's lagging mark, first drops every catalog
        (before the beat commits: a writer waiting on the mark stops when it is cleared)."""
        sent = self._clock()
        epoch, previous = self._epoch, self._beat_sent
        dropped = False

        def drop_all(lagging: bool) -> bool:
            nonlocal dropped
            if lagging or not self.trusted():
                self._invalidate()
                dropped = True
            return dropped

        lagging = await self._row.beat(self._backend_pid, self._ack_target, drop_all=drop_all)
        if epoch != self._epoch or not self._listening:
            return  # the listener went or came back meanwhile: this beat speaks for the old one
        if lagging:
            log.warning("catalog_listener_was_lagging", listener_id=self.listener_id)
        if not dropped and (previous is None or self._clock() - previous >= self._trust_s):
            self._invalidate()  # trust lapsed while the beat ran: writers may have left us out
        self._beat_sent = sent

    async def _beat_loop(self) -> None:
        try:
            await self._row.forget_dead()
        except Exception as exc:  # noqa: BLE001 - housekeeping only
            log.info("catalog_listeners_cleanup_failed", error=type(exc).__name__)
        while not self._closed and self._listening:
            try:
                await self.beat()
            except ListenerNotVisible as exc:  # a pooler between us and Postgres: stay untrusted
                log.warning("catalog_listener_not_visible", detail=str(exc))
            except Exception as exc:  # noqa: BLE001 - untrusted until a beat gets through
                log.info("catalog_listener_beat_failed", error=type(exc).__name__)
            await asyncio.sleep(self._beat_s)

    async def _ack_loop(self) -> None:
        while self._acked < self._ack_target and not self._closed:
            target = self._ack_target
            try:
                await self._row.ack(target)
                self._acked = target
            except Exception as exc:  # noqa: BLE001 - the writer times out and marks this listener
                log.info("catalog_fence_ack_failed", error=type(exc).__name__)
                return

    async def close(self) -> None:
        """Stop beating and remove this listener's row, so writers stop waiting for it."""
        self._closed = True
        self._listening = False
        for task in (self._beating, self._acking):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):  # closing anyway
                    await task
        try:
            await self._row.remove()
        except Exception as exc:  # noqa: BLE001 - its beat goes stale and writers leave it out
            log.info("catalog_listener_remove_failed", error=type(exc).__name__)
