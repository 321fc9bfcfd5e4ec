"""How many dedicated session actors one gateway may keep alive. Pure (an injectable clock).

With `CE_PLACEMENT=dedicated` every new session id is a detached Ray actor: a process of about
85 MB with its own Postgres pool, alive until its session has been idle for `idle_seconds`.
Without a bound, one tenant sending messages under ever new session ids exhausts the nodes'
memory and Postgres' `max_connections` for everyone. A gateway counts the sessions it routed to
within `idle_seconds` (each one's actor is alive, or about to exit), at most `total` of them and
`per_tenant` of one tenant; a session already counted always gets through, and one more is
refused, having created nothing: 503 `dedicated_full` past the total, 429 `tenant_actors` past
the tenant's share, with Retry-After the time until the oldest counted one goes idle. Like the
other gateway limits it is per gateway: N gateways may keep N times as many.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from kernel.errors import Overloaded


class ActorQuota:
    """The dedicated sessions this gateway routed to within `ttl` seconds, least recently first."""

    def __init__(self, *, total: int, per_tenant: int, ttl: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._total = total  # 0: no bound
        self._per_tenant = per_tenant  # 0: no bound
        self._ttl = ttl
        self._clock = clock
        self._live: OrderedDict[str, tuple[str, float]] = OrderedDict()  # actor name -> (tenant, last routed)
        self._counts: dict[str, int] = {}

    def live(self, tenant_id: str | None = None) -> int:
        """The sessions counted now (of `tenant_id`, when given)."""
        self._expire(self._clock())
        return len(self._live) if tenant_id is None else self._counts.get(tenant_id, 0)

    def admit(self, tenant_id: str, name: str) -> None:
        """Count a call to the actor `name` of `tenant_id`'s session; raises Overloaded, counting
        nothing, when it would be one session more than the bounds allow."""
        now = self._clock()
        self._expire(now)
        if self._live.pop(name, None) is None:
            if self._total and len(self._live) >= self._total:
                raise Overloaded(
                    f"this gateway keeps {self._total} dedicated session actors alive, its limit; a new "
                    "conversation may start once one goes idle", retry_after=self._wait(now), reason="dedicated_full")
            held = self._counts.get(tenant_id, 0)
            if self._per_tenant and held >= self._per_tenant:
                raise Overloaded(
                    f"this tenant has {held} conversations with a dedicated actor alive at this gateway, its limit; "
                    "a new one may start once one goes idle", retry_after=self._wait(now, tenant_id),
                    reason="tenant_actors")
            self._counts[tenant_id] = held + 1
        self._live[name] = (tenant_id, now)

    def _expire(self, now: float) -> None:
        while self._live:
            name, (tenant_id, used) = next(iter(self._live.items()))
            if now - used < self._ttl:
                return
            del self._live[name]
            left = self._counts[tenant_id] - 1
            if left:
                self._counts[tenant_id] = left
            else:
                del self._counts[tenant_id]

    def _wait(self, now: float, tenant_id: str | None = None) -> float:
        """Seconds until the least recently routed session (of `tenant_id`) goes idle."""
        for owner, used in self._live.values():
            if tenant_id is None or owner == tenant_id:
                return max(1.0, self._ttl - (now - used))
        return 1.0
