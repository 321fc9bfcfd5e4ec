"""Per-tenant rate and concurrency admission at the gateway."""

from __future__ import annotations

import pytest

from services.errors import Overloaded
from services.gateway.limits import TenantLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_rate_allows_a_burst_then_refuses_with_a_retry_after_until_tokens_refill():
    clock = Clock()
    limiter = TenantLimiter(rate=2, burst=3, concurrency=0, clock=clock)
    for _ in range(3):
        with limiter.admit("a"):
            pass
    with pytest.raises(Overloaded, match="over its message rate") as info, limiter.admit("a"):
        pass
    assert info.value.status == 429 and info.value.retry_after == pytest.approx(0.5)
    with limiter.admit("b"):  # another tenant is unaffected
        pass
    clock.now = 0.5
    with limiter.admit("a"):
        pass


def test_concurrency_caps_turns_in_flight_and_frees_the_slot_on_exit_even_on_error():
    limiter = TenantLimiter(rate=0, burst=1, concurrency=2)
    with limiter.admit("a"), limiter.admit("a"):
        with pytest.raises(Overloaded, match="turns in progress") as info, limiter.admit("a"):
            pass
        assert info.value.reason == "tenant_concurrency" and info.value.status == 429
    with pytest.raises(RuntimeError), limiter.admit("a"):
        raise RuntimeError("boom")
    assert limiter.inflight("a") == 0


@pytest.mark.parametrize(("reason", "status"), [
    ("mailbox", 429), ("tenant_rate", 429), ("tenant_concurrency", 429),
    ("host_busy", 503), ("shutting_down", 503), ("unsaved", 503), ("restarting", 503),
])
def test_overload_reasons_map_to_429_for_the_callers_excess_and_503_for_the_engines(reason, status):
    assert Overloaded("x", reason=reason).status == status
