"""The dedicated session actors one gateway keeps alive are bounded (issue 39, item 3): pure, with
a fake clock; and the bound is checked before a call could create an actor."""

from __future__ import annotations

import pytest

from actors.actor_quota import ActorQuota
from actors.placement import Placement
from kernel.errors import Overloaded
from services.settings import Settings
from services.wire import Turn


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_past_the_total_a_new_session_is_refused_503_until_one_goes_idle():
    clock = Clock()
    quota = ActorQuota(total=2, per_tenant=0, ttl=300, clock=clock)
    quota.admit("tn_a", "s1")
    clock.now += 100
    quota.admit("tn_b", "s2")
    with pytest.raises(Overloaded) as refused:
        quota.admit("tn_c", "s3")
    assert refused.value.status == 503 and refused.value.reason == "dedicated_full"
    assert refused.value.retry_after == pytest.approx(200)  # s1 goes idle in 200 s
    clock.now += 150
    quota.admit("tn_a", "s1")  # a session already alive always gets through (and is fresh again)
    clock.now += 200  # s2 idle now (350 s), s1 not (200 s)
    quota.admit("tn_c", "s3")
    assert quota.live() == 2 and quota.live("tn_b") == 0


def test_past_its_share_a_tenant_is_refused_429_and_the_others_are_not():
    clock = Clock()
    quota = ActorQuota(total=10, per_tenant=2, ttl=300, clock=clock)
    quota.admit("tn_a", "a1")
    quota.admit("tn_a", "a2")
    with pytest.raises(Overloaded) as refused:
        quota.admit("tn_a", "a3")
    assert refused.value.status == 429 and refused.value.reason == "tenant_actors"
    assert "2 conversations" in str(refused.value)
    quota.admit("tn_b", "b1")  # another tenant has its own share
    assert quota.live("tn_a") == 2 and quota.live() == 3
    clock.now += 300
    quota.admit("tn_a", "a3")  # a1 and a2 went idle
    assert quota.live("tn_a") == 1


def test_no_bound_when_set_to_zero():
    quota = ActorQuota(total=0, per_tenant=0, ttl=300, clock=Clock())
    for i in range(5_000):
        quota.admit("tn_a", f"s{i}")
    assert quota.live("tn_a") == 5_000


async def test_a_dedicated_gateway_refuses_before_any_actor_is_created(monkeypatch):
    settings = Settings(placement="dedicated", dedicated_max_actors=5, dedicated_max_actors_per_tenant=1)
    placement = Placement(settings)
    created: list[str] = []

    def no_ray(name):
        created.append(name)
        raise LookupError("stop here: the test needs no actor")

    monkeypatch.setattr(placement, "_routed_handle", no_ray)
    with pytest.raises(LookupError):
        await placement.send(Turn(tenant_id="tn_a", session_id="first", text="hi"))
    with pytest.raises(Overloaded) as refused:
        await placement.send(Turn(tenant_id="tn_a", session_id="second", text="hi"))
    assert refused.value.reason == "tenant_actors"
    assert created == [placement.actor_name("tn_a", "first")]


def test_the_bounds_are_settings():
    settings = Settings.from_env({"CE_DEDICATED_MAX_ACTORS": "40", "CE_DEDICATED_MAX_ACTORS_PER_TENANT": "4"})
    assert (settings.dedicated_max_actors, settings.dedicated_max_actors_per_tenant) == (40, 4)
    assert (Settings().dedicated_max_actors, Settings().dedicated_max_actors_per_tenant) == (1_000, 250)
