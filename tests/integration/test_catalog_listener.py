"""The catalog listener survives its connection dying: it subscribes again and changes made after
that still reach the cache (Postgres restarts, failovers, idle-connection killers)."""

from __future__ import annotations

import asyncio

from actors.runtime import Runtime
from services.settings import Settings
from services.tools.crypto import generate_key
from storage.pool import create_pool
from storage.repos import ToolRepo


async def wait_for(predicate, timeout: float = 10.0) -> None:
    end = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > end:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.05)


async def test_the_listener_resubscribes_after_its_connection_is_killed(fresh_db, make_tenant):
    url = await fresh_db()
    settings = Settings(database_url=url, anthropic_base_url="http://127.0.0.1:9", secret_keys=(generate_key(),))
    rt = await Runtime.open(settings)
    admin = await create_pool(url, max_size=1)
    try:
        from storage.repos import TenantRepo

        tenant, _ = await TenantRepo(admin).create_tenant("listener-test")
        # The first beat that makes the host trusted drops every catalog (trust after a gap,
        # services.catalog_sync): a load running then is not cached. Load once it is trusted.
        await wait_for(rt.catalog_sync.trusted)
        await rt.tenants.env_for(tenant.id)
        assert tenant.id in rt.tenants._cache
        first = rt.listener
        killed = await admin.fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND query LIKE 'LISTEN%'"
        )
        assert killed == 1
        await wait_for(lambda: rt.listener is not None and rt.listener is not first)
        await wait_for(rt.catalog_sync.trusted)  # trusted again, after that beat's drop
        await rt.tenants.env_for(tenant.id)
        assert tenant.id in rt.tenants._cache
        await ToolRepo(admin).create(tenant.id, "ping", "python", {
            "type": "python", "name": "ping", "description": "d", "parameters": {"type": "object"}, "handler": "x"})
        await wait_for(lambda: tenant.id not in rt.tenants._cache)
    finally:
        await admin.close()
        await rt.close()


async def test_closing_the_runtime_closes_its_model_client(fresh_db):
    url = await fresh_db()
    rt = await Runtime.open(Settings(database_url=url, anthropic_base_url="http://127.0.0.1:9"))
    assert not rt.llm.is_closed()
    await rt.close()
    assert rt.llm.is_closed()
