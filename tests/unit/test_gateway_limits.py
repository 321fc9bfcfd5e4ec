"""Per-tenant rate and concurrency admission at the gateway."""

from __future__ import annotations

import pytest

from kernel.errors import Overloaded
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


def test_a_turn_refused_for_concurrency_spends_none_of_the_rate():
    clock = Clock()
    limiter = TenantLimiter(rate=1, burst=3, concurrency=1, clock=clock)
    with limiter.admit("a"):
        for _ in range(2):  # a client retrying on 429 while its one turn runs
            with pytest.raises(Overloaded, match="turns in progress"), limiter.admit("a"):
                pass
    for _ in range(2):  # the two tokens left are still there
        with limiter.admit("a"):
            pass


def test_buckets_that_refilled_are_forgotten_past_the_bound(monkeypatch):
    from services.gateway import limits

    monkeypatch.setattr(limits, "MAX_BUCKETS", 3)
    clock = Clock()
    limiter = TenantLimiter(rate=1, burst=2, concurrency=0, clock=clock)
    for tenant in ("a", "b", "c"):
        with limiter.admit(tenant):
            pass
    clock.now = 5.0  # a, b and c have refilled
    with limiter.admit("d"):
        pass
    with limiter.admit("e"):  # past the bound: the full ones go, the fresh ones stay
        pass
    assert sorted(limiter._rate._buckets) == ["d", "e"]
