"""The per-tenant environment cache of a host stays bounded however many tenants it serves."""

from __future__ import annotations

import asyncio

from actors import catalogs
from actors.catalogs import TenantCatalogs
from services.tools.registry import HandlerRegistry
from tests.support.catalog_fakes import FakeTools


class FakeConfigs:
    async def get(self, tenant_id: str) -> dict:
        return {}


async def _no_builtins(tenant_id: str) -> tuple:
    return ()


def _catalogs() -> TenantCatalogs:
    return TenantCatalogs(tools=FakeTools(), configs=FakeConfigs(), registry=HandlerRegistry(),
                          backend_for=lambda config: None, builtins=_no_builtins, llm=None, executor=None,
                          main_model="main", cheap_model="cheap")


async def test_past_the_bound_the_least_recently_loaded_tenant_is_dropped(monkeypatch):
    monkeypatch.setattr(catalogs, "MAX_CACHED", 3)
    c = _catalogs()
    for tenant in ("t1", "t2", "t3"):
        await c.env_for(tenant)
    assert c.reloads == 3
    again = await c.env_for("t1")  # cached: no reload
    assert c.reloads == 3
    await c.env_for("t4")  # a fourth tenant: the oldest load (t1) goes
    assert c.reloads == 4 and list(c._cache) == ["t2", "t3", "t4"]
    assert await c.env_for("t1") is not again and c.reloads == 5  # back: loaded again
    assert len(c._cache) == 3


class CountingTools(FakeTools):
    def __init__(self) -> None:
        self.listed = 0

    async def list_published(self, tenant_id: str) -> list:
        self.listed += 1
        await asyncio.sleep(0.05)  # a load takes a while: room for a change to land during it
        return []


def _counting() -> tuple[TenantCatalogs, CountingTools]:
    tools = CountingTools()
    c = TenantCatalogs(tools=tools, configs=FakeConfigs(), registry=HandlerRegistry(),
                       backend_for=lambda config: None, builtins=_no_builtins, llm=None, executor=None,
                       main_model="main", cheap_model="cheap")
    return c, tools


async def test_while_trusted_a_turn_reads_no_stamp_and_otherwise_every_turn_does():
    c, _ = _counting()
    trusted = [True]
    c.trust_while(lambda: trusted[0])
    for _ in range(3):
        await c.env_for("t1")
    assert c.stamp_reads == 0 and c.reloads == 1
    trusted[0] = False
    for _ in range(3):
        await c.env_for("t1")
    assert c.stamp_reads == 3


async def test_a_turn_arriving_after_a_change_does_not_join_a_load_that_began_before_it():
    c, tools = _counting()
    c.trust_while(lambda: True)
    before = asyncio.ensure_future(c.env_for("t1"))
    await asyncio.sleep(0.01)  # that load is reading the rows
    c.invalidate("t1")  # the change's notification: the rows it read are old
    after = await c.env_for("t1")
    old = await before
    assert after is not old and tools.listed == 2
    assert await c.env_for("t1") is after  # the fresh one is cached, the old one was not
