"""Fair shares of a session host's event loop among tenants.

A host runs many tenants' turns on one event loop, which serves whatever is ready first: a burst of
one tenant's turns queues every other tenant's work behind it. `FairShare` bounds how many turns run
their own code at once (`slots`), and gives a freed slot to the waiting tenant with the fewest
running (ties: the one that has waited longest), so a tenant sending one turn at a time is never
behind another's hundred.

A turn holds its slot only while it computes: around the waits that are not the loop's work (the
model's answer, a webhook's, a worker process's) it steps aside with `waiting()`, and others run.
Code anywhere below a turn calls `waiting()`; outside a turn it does nothing.

Pure asyncio: no I/O.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from contextvars import ContextVar

import structlog

log = structlog.get_logger(__name__)


#: the longest a turn waits for a slot before it runs anyway, one over the bound: a wait that would
#: last for ever (slot holders waiting on what only a waiter can do) becomes a slow turn, not a hang
MAX_WAIT_S = 1.0


class FairShare:
    """`slots` turns compute at once (0: no bound); the next slot goes to the tenant with the fewest.
    `overruns` counts the turns that waited `max_wait_s` and ran over the bound."""

    def __init__(self, slots: int, *, max_wait_s: float = MAX_WAIT_S) -> None:
        self.slots = slots
        self.max_wait_s = max_wait_s
        self.overruns = 0
        self._free = slots
        self._running: dict[str, int] = {}
        self._waiting: dict[str, deque[tuple[int, asyncio.Future[None]]]] = {}
        self._order = itertools.count()

    def running(self, tenant_id: str) -> int:
        return self._running.get(tenant_id, 0)

    def waiting(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    async def acquire(self, tenant_id: str) -> None:
        if not self.slots:
            return
        if self._free > 0 and not self._waiting:
            self._free -= 1
            self._take(tenant_id)
            return
        future = asyncio.get_running_loop().create_future()
        entry = (next(self._order), future)
        self._waiting.setdefault(tenant_id, deque()).append(entry)
        try:
            async with asyncio.timeout(self.max_wait_s):
                await future
        except TimeoutError:
            if future.done() and not future.cancelled():  # handed a slot as the wait ended: it is this turn's
                return
            self._forget(tenant_id, entry)
            self._free -= 1  # one over the bound, given back by its release like any slot
            self._take(tenant_id)
            self.overruns += 1
            log.warning("fair_share_overrun", tenant_id=tenant_id, waited_s=self.max_wait_s, slots=self.slots)
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release(tenant_id)  # handed a slot just as it was cancelled: pass it on
            else:
                self._forget(tenant_id, entry)
            raise

    def release(self, tenant_id: str) -> None:
        if not self.slots:
            return
        left = self._running[tenant_id] - 1
        if left:
            self._running[tenant_id] = left
        else:
            del self._running[tenant_id]
        while self._waiting:
            # the waiting tenant with the fewest turns computing; of those, the one waiting longest
            tenant = min(self._waiting, key=lambda t: (self._running.get(t, 0), self._waiting[t][0][0]))
            queue = self._waiting[tenant]
            _, future = queue.popleft()
            if not queue:
                del self._waiting[tenant]
            if not future.done():
                self._take(tenant)
                future.set_result(None)
                return
        self._free += 1

    def _take(self, tenant_id: str) -> None:
        self._running[tenant_id] = self._running.get(tenant_id, 0) + 1

    def _forget(self, tenant_id: str, entry: tuple[int, asyncio.Future[None]]) -> None:
        queue = self._waiting.get(tenant_id)
        if queue is not None and entry in queue:
            queue.remove(entry)
            if not queue:
                del self._waiting[tenant_id]


class Hold:
    """A turn's slot: `away` counts its tasks inside `waiting()` (a batch's calls wait at once);
    `waited_s` is how long the turn has waited for its slot, first and after each step aside."""

    __slots__ = ("away", "away_s", "back", "held", "share", "tenant_id", "waited_s")

    def __init__(self, share: FairShare, tenant_id: str) -> None:
        self.share = share
        self.tenant_id = tenant_id
        self.held = False
        self.away = 0
        self.waited_s = 0.0
        self.away_s: dict[str, float] = {}  # time spent inside `waiting(kind)`, by kind
        self.back = asyncio.Lock()  # one of its tasks takes the slot back, never two

    async def take(self) -> None:
        started = time.perf_counter()
        await self.share.acquire(self.tenant_id)
        self.held = True
        self.waited_s += time.perf_counter() - started


_hold: ContextVar[Hold | None] = ContextVar("fairshare_hold", default=None)


@asynccontextmanager
async def turn_slot(share: FairShare, tenant_id: str) -> AsyncIterator[Hold]:
    """Run the block as one of `share`'s turns: it waits for a slot first, and holds it (save
    inside `waiting()`) until the block ends."""
    hold = Hold(share, tenant_id)
    await hold.take()
    token = _hold.set(hold)
    try:
        yield hold
    finally:
        _hold.reset(token)
        if hold.held:
            hold.held = False
            share.release(tenant_id)


@asynccontextmanager
async def waiting(kind: str | None = None) -> AsyncIterator[None]:
    """Around a wait that is not the loop's work: the turn's slot goes to others meanwhile and is
    taken back (fairly) after; its time is added to the turn's `away_s[kind]` when a kind is
    named ("model", "upstream": where a turn's time went). Outside a turn, nothing."""
    hold = _hold.get()
    if hold is None:
        yield
        return
    if kind is not None:
        started = time.perf_counter()
        try:
            async with waiting():
                yield
        finally:
            hold.away_s[kind] = hold.away_s.get(kind, 0.0) + time.perf_counter() - started
        return
    hold.away += 1
    if hold.away == 1 and hold.held:
        hold.held = False
        hold.share.release(hold.tenant_id)
    try:
        yield
    finally:
        hold.away -= 1
        if hold.away == 0:
            async with hold.back:
                if hold.away == 0 and not hold.held:  # another task may have taken it back, or gone away
                    await hold.take()


def fair_batch(keys: Iterable[tuple[str, str]], limit: int) -> list[tuple[str, str]]:
    """At most `limit` of `keys` ((tenant_id, session_id), oldest first), taken one tenant at a
    time in turn: a tenant with one session waiting is in the next batch however many another
    has (limit 0: every key)."""
    keys = list(keys)
    if not limit or len(keys) <= limit:
        return keys
    by_tenant: dict[str, deque[tuple[str, str]]] = {}
    for key in keys:
        by_tenant.setdefault(key[0], deque()).append(key)
    batch: list[tuple[str, str]] = []
    while len(batch) < limit:
        for tenant in list(by_tenant):
            queue = by_tenant[tenant]
            batch.append(queue.popleft())
            if not queue:
                del by_tenant[tenant]
            if len(batch) == limit:
                break
    return batch
