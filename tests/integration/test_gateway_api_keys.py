"""The gateway's API-key checks against the real TenantRepo and Postgres: a revoked key is refused
once its cache entry has expired, repeated unknown keys are answered from the negative cache
without a Postgres lookup each, and a key added meanwhile works at once.

A real aiohttp server on loopback; the caches get a FakeClock so that no test sleeps 30 s. The
router is never reached (GET /v1/tools is answered from the ToolRepo).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer
from cachetools import TTLCache

from services.gateway.app import build_app
from services.gateway.common import KEY_CACHE_TTL_S, UNKNOWN_KEY_TTL_S, GatewayDeps
from storage.repos import BotConfigRepo, SessionRepo, TenantRepo, ToolCallRepo, ToolRepo
from tests.support.fakes import FakeClock


class CountingTenants:
    """The real TenantRepo, counting the key lookups that reach Postgres."""

    def __init__(self, repo: TenantRepo) -> None:
        self._repo = repo
        self.lookups = 0

    async def key_holder(self, api_key: str) -> Any:
        self.lookups += 1
        return await self._repo.key_holder(api_key)


class Gateway:
    def __init__(
        self, client: TestClient, tenants: CountingTenants, clock: FakeClock, deps: GatewayDeps
    ) -> None:
        self.client, self.tenants, self.clock, self.deps = client, tenants, clock, deps

    async def status(self, key: str) -> int:
        async with self.client.get("/v1/tools", headers={"Authorization": f"Bearer {key}"}) as r:
            if r.status == 401:
                body = await r.json(content_type=None)
                assert (
                    "unknown or revoked" in body["detail"]
                    and "chat-engine tenant add-key" in body["detail"]
                )
            return r.status


@pytest_asyncio.fixture
async def gateway(pool) -> AsyncIterator[Gateway]:
    clock = FakeClock(1000.0)
    tenants = CountingTenants(TenantRepo(pool))
    deps = GatewayDeps(
        router=None,
        tenants=tenants,
        tools=ToolRepo(pool),
        calls=ToolCallRepo(pool),
        sessions=SessionRepo(pool),
        configs=BotConfigRepo(pool),
        secret_box=None,
        key_cache=TTLCache(maxsize=100, ttl=KEY_CACHE_TTL_S, timer=clock.monotonic),
        unknown_keys=TTLCache(maxsize=8, ttl=UNKNOWN_KEY_TTL_S, timer=clock.monotonic),
    )
    async with TestClient(TestServer(build_app(deps), host="127.0.0.1")) as client:
        yield Gateway(client, tenants, clock, deps)


async def test_a_revoked_key_is_refused_once_its_cache_entry_has_expired(
    gateway, make_tenant, pool
):
    tenant, key = await make_tenant("revoked-gw")
    assert await gateway.status(key.api_key) == 200
    await TenantRepo(pool).revoke_key(tenant.id, key.key_id)
    gateway.clock.advance(KEY_CACHE_TTL_S + 0.1)
    assert await gateway.status(key.api_key) == 401
    assert await gateway.status(key.api_key) == 401


async def test_a_revoked_key_is_accepted_at_most_for_the_cache_ttl(gateway, make_tenant, pool):
    # the documented bound: a gateway that saw the key keeps accepting it until its entry expires
    tenant, key = await make_tenant("revoked-ttl")
    assert await gateway.status(key.api_key) == 200
    await TenantRepo(pool).revoke_key(tenant.id, key.key_id)
    gateway.clock.advance(KEY_CACHE_TTL_S - 1)
    assert await gateway.status(key.api_key) == 200
    gateway.clock.advance(1.1)
    assert await gateway.status(key.api_key) == 401


async def test_a_repeated_unknown_key_costs_one_postgres_lookup_per_ttl(gateway):
    bogus = "ce_" + "b" * 43
    for _ in range(20):
        assert await gateway.status(bogus) == 401
    assert gateway.tenants.lookups == 1
    gateway.clock.advance(UNKNOWN_KEY_TTL_S + 0.1)
    assert await gateway.status(bogus) == 401
    assert gateway.tenants.lookups == 2


async def test_the_negative_cache_is_bounded_and_forgets_the_least_recently_seen_key(gateway):
    bogus = ["ce_" + f"{i:02d}" * 21 + "x" for i in range(9)]  # one more than the cache holds
    for key in bogus:
        assert await gateway.status(key) == 401
    assert gateway.tenants.lookups == 9 and len(gateway.deps.unknown_keys) == 8
    assert await gateway.status(bogus[0]) == 401  # the first was pushed out: asked again
    assert gateway.tenants.lookups == 10
    assert await gateway.status(bogus[-1]) == 401  # the last is still known to be unknown
    assert gateway.tenants.lookups == 10


async def test_a_key_added_while_bogus_keys_are_cached_works_at_once(gateway, make_tenant, pool):
    tenant, first = await make_tenant("rotate-gw")
    assert await gateway.status("ce_" + "n" * 43) == 401  # the negative cache is not empty
    second = await TenantRepo(pool).issue_key(tenant.id)
    assert await gateway.status(second.api_key) == 200
    assert await gateway.status(first.api_key) == 200  # the old key too, until it is revoked
    assert gateway.tenants.lookups == 3


async def test_a_known_key_is_looked_up_once_per_ttl(gateway, make_tenant):
    _tenant, key = await make_tenant("cached-gw")
    for _ in range(5):
        assert await gateway.status(key.api_key) == 200
    assert gateway.tenants.lookups == 1


async def test_requests_with_the_same_key_at_once_share_one_postgres_lookup(gateway, make_tenant):
    # a flood of one bogus key (or a client's burst with a new key) before the first answer is
    # cached: before, each request looked the key up itself
    _tenant, key = await make_tenant("burst-key")
    bogus = "ce_" + "z" * 43
    real_lookup = gateway.tenants.key_holder

    async def slow_lookup(api_key: str) -> Any:
        await asyncio.sleep(0.2)
        return await real_lookup(api_key)

    gateway.tenants.key_holder = slow_lookup
    statuses = await asyncio.gather(*(gateway.status(k) for k in [bogus] * 10 + [key.api_key] * 10))
    assert statuses == [401] * 10 + [200] * 10
    assert gateway.tenants.lookups == 2 and gateway.deps.key_lookups == {}
