"""Per-tenant admission at the gateway: a token bucket for rate and a cap on turns in flight.

Pure (an injectable clock, no aiohttp). Limits are per gateway process: with N gateways a tenant
may reach N times each limit, which is what a horizontally scaled edge usually promises.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from kernel.errors import Overloaded


class _Bucket:
    __slots__ = ("stamp", "tokens")

    def __init__(self, tokens: float, stamp: float) -> None:
        self.tokens = tokens
        self.stamp = stamp


#: tenants' buckets kept before the full ones (as good as none) are dropped
MAX_BUCKETS = 4096


class TenantRate:
    """A token bucket per tenant: `rate` a second, `burst` at once (0: unlimited). `take` spends a
    token or raises Overloaded(`reason`: a 429 with Retry-After) saying what is limited (`what`)."""

    def __init__(self, *, rate: float, burst: float, reason: str, what: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._rate = rate
        self._burst = max(burst, 1.0)
        self._reason = reason
        self._what = what
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}

    def take(self, tenant_id: str) -> None:
        if self._rate <= 0:
            return
        now = self._clock()
        bucket = self._buckets.get(tenant_id)
        if bucket is None:
            bucket = self._buckets[tenant_id] = _Bucket(self._burst, now)
        bucket.tokens = min(self._burst, bucket.tokens + (now - bucket.stamp) * self._rate)
        bucket.stamp = now
        if bucket.tokens < 1.0:
            wait = (1.0 - bucket.tokens) / self._rate
            raise Overloaded(f"this tenant is over its {self._what} ({self._rate:g}/s); slow down and retry",
                             retry_after=wait, reason=self._reason)
        bucket.tokens -= 1.0
        if len(self._buckets) > MAX_BUCKETS:
            self._drop_full(now)

    def _drop_full(self, now: float) -> None:
        """Forget the buckets that have refilled: a new one starts full, so nothing changes."""
        full = [t for t, b in self._buckets.items() if b.tokens + (now - b.stamp) * self._rate >= self._burst]
        for tenant_id in full:
            del self._buckets[tenant_id]


class TenantLimiter:
    def __init__(
        self, *, rate: float, burst: float, concurrency: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._rate = TenantRate(rate=rate, burst=burst, reason="tenant_rate", what="message rate", clock=clock)
        self._concurrency = concurrency
        self._inflight: dict[str, int] = {}

    def inflight(self, tenant_id: str) -> int:
        return self._inflight.get(tenant_id, 0)

    @contextmanager
    def admit(self, tenant_id: str) -> Iterator[None]:
        """Hold one of the tenant's turn slots for the block. Raises Overloaded (429) when the
        tenant has too many turns in flight or is over its rate (checked in that order: a turn
        refused for concurrency spends none of the rate)."""
        current = self._inflight.get(tenant_id, 0)
        if self._concurrency > 0 and current >= self._concurrency:
            raise Overloaded(
                f"this tenant has {current} turns in progress (the limit); wait for replies, then retry",
                retry_after=1.0, reason="tenant_concurrency",
            )
        self._rate.take(tenant_id)
        self._inflight[tenant_id] = current + 1
        try:
            yield
        finally:
            left = self._inflight[tenant_id] - 1
            if left:
                self._inflight[tenant_id] = left
            else:
                del self._inflight[tenant_id]
