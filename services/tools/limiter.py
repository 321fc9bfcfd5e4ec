"""Bounded execution: a per-resource concurrency limit and a deadline that includes queue wait.

Seed 001: "a handler can be fast once admitted while users spend most of their time waiting for a
slot". Queue time is measured apart from run time (a failure's as a success's), work whose deadline
passed is rejected before it starts, and a cancelled caller frees its slot (or its place in the
queue).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Generic, Protocol, TypeVar

from services.fairshare import waiting
from services.tools.errors import DeadlineExceeded, QueueTimeout, ToolError

T = TypeVar("T")


class Clock(Protocol):
    def monotonic(self) -> float: ...


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()


class Timed(Generic[T]):
    __slots__ = ("queue_s", "run_s", "value")

    def __init__(self, value: T, queue_s: float, run_s: float) -> None:
        self.value = value
        self.queue_s = queue_s
        self.run_s = run_s


class _Slots:
    __slots__ = ("semaphore", "users")

    def __init__(self, limit: int) -> None:
        self.semaphore = asyncio.Semaphore(limit)
        self.users = 0  # running and queued: at 0 the entry goes


class ResourceLimiter:
    """At most `limit_for(resource)` calls run at once per resource and owner; the rest queue,
    FIFO. The owner is the tenant: one limiter serves every tenant of a host, and one tenant's
    load must not queue another's calls of a tool of the same name. An entry lives while someone
    runs or waits, so the table holds only what is in use."""

    def __init__(self, *, default_limit: int = 8, limits: dict[str, int] | None = None, clock: Clock | None = None) -> None:
        self._default = default_limit
        self._limits = dict(limits or {})
        self._slots: dict[tuple[str, str], _Slots] = {}
        self._clock = clock or SystemClock()

    def limit_for(self, resource: str) -> int:
        return self._limits.get(resource, self._default)

    def in_use(self, resource: str, *, owner: str = "") -> int:
        slots = self._slots.get((owner, resource))
        return 0 if slots is None else self.limit_for(resource) - slots.semaphore._value

    @property
    def tracked(self) -> int:
        """Resources with someone running or waiting."""
        return len(self._slots)

    async def run(
        self, resource: str, deadline: float, work: Callable[[], Awaitable[T]], *, owner: str = "",
        gate: asyncio.Semaphore | None = None,
    ) -> Timed[T]:
        """Run `work()` under the resource's limit for `owner`, all of it before `deadline` (clock time).

        `gate`, when given, is a narrower limit taken first (a tool's `max_parallel` within one
        batch); waiting on it is queue time like waiting for the resource, inside the same deadline.

        Returns the value with queue and run seconds. Raises QueueTimeout when the deadline passes
        in the queue (work never starts), DeadlineExceeded when it passes while running (work is
        cancelled), and any ToolError of `work` as it came; each of those carries the call's
        `queue_s` and `run_s` (a failure is measured as a success is). Anything else `work` raises
        propagates unmeasured: callers that want it measured turn it into a ToolError inside `work`.
        """
        key = (owner, resource)
        slots = self._slots.get(key)
        if slots is None:
            slots = self._slots[key] = _Slots(self.limit_for(resource))
        slots.users += 1
        try:
            return await self._run(slots.semaphore, deadline, work, gate)
        finally:
            slots.users -= 1
            if slots.users == 0:
                del self._slots[key]

    async def _run(
        self, sem: asyncio.Semaphore, deadline: float, work: Callable[[], Awaitable[T]], gate: asyncio.Semaphore | None
    ) -> Timed[T]:
        start = self._clock.monotonic()
        if start >= deadline:
            raise _timed(QueueTimeout("deadline passed before the call could start", advice=_ADVICE), 0.0, 0.0)
        admitted_here = False
        try:
            try:
                async with asyncio.timeout(deadline - start):
                    # queued behind calls that need a compute slot to finish: the wait holds none
                    # (services.fairshare), and the turn's slot is taken back within the deadline
                    async with waiting():
                        if gate is not None:
                            await gate.acquire()
                        try:
                            await sem.acquire()
                        except BaseException:
                            if gate is not None:
                                gate.release()
                            raise
                        admitted_here = True
            except BaseException:
                if admitted_here:  # given up while taking the compute slot back: the call's slots go too
                    sem.release()
                    if gate is not None:
                        gate.release()
                raise
        except TimeoutError:
            waited = self._clock.monotonic() - start
            raise _timed(QueueTimeout(
                f"waited {waited * 1000:.0f} ms for a free slot and ran out of time", advice=_ADVICE
            ), waited, 0.0) from None
        admitted = self._clock.monotonic()
        try:
            remaining = deadline - admitted
            if remaining <= 0:
                raise _timed(QueueTimeout("deadline passed while queued", advice=_ADVICE), admitted - start, 0.0)
            try:
                async with asyncio.timeout(remaining):
                    value = await work()
            except TimeoutError:
                raise _timed(DeadlineExceeded("upstream timeout", advice=_ADVICE),
                             admitted - start, self._clock.monotonic() - admitted) from None
            except ToolError as exc:
                _timed(exc, admitted - start, self._clock.monotonic() - admitted)
                raise
            return Timed(value, admitted - start, self._clock.monotonic() - admitted)
        finally:
            sem.release()
            if gate is not None:
                gate.release()


def _timed(error: ToolError, queue_s: float, run_s: float) -> ToolError:
    """`error` with the call's queue and run seconds on it (ToolError.queue_s, .run_s)."""
    error.queue_s, error.run_s = queue_s, run_s
    return error


_ADVICE = "Tell the customer this is taking too long right now and offer to try again shortly."
