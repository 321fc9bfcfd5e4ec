"""The per-tenant environment cache of a host stays bounded however many tenants it serves."""

from __future__ import annotations

from services import catalogs
from services.catalogs import TenantCatalogs
from services.tools.registry import HandlerRegistry


class FakeTools:
    async def list_published(self, tenant_id: str) -> list:
        return []

    async def catalog_stamp(self, tenant_id: str) -> str:
        return "s1"


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
