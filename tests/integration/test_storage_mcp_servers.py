"""McpServerRepo on a real Postgres: registrations scoped by tenant, changes announced on
ce_catalog after commit, a stamp that moves with every write."""

from __future__ import annotations

import asyncio

import pytest

from kernel.errors import Conflict, InvalidInput, NotFound
from kernel.records import McpServerRecord
from storage.repos import ToolRepo, listen_catalog
from storage.repos.catalog_sync import fence_number
from storage.repos.mcp_servers import McpServerRepo


def record(tenant_id: str, name: str = "shop", **kw) -> McpServerRecord:
    return McpServerRecord(tenant_id=tenant_id, name=name, url="https://mcp.example.com/mcp", **kw)


async def test_create_read_update_delete_round_trip(pool, make_tenant):
    repo = McpServerRepo(pool)
    tenant, _ = await make_tenant()
    created = await repo.create(record(tenant.id, auth_header_enc="ciphertext", read_only_tools=("a", "b"),
                                       intents=("orders",), timeout_ms=2000))
    assert created.read_only_tools == ("a", "b") and created.include_tools is None and created.created_at
    assert await repo.get(tenant.id, "shop") == created
    changed = await repo.update(tenant.id, "shop", {"enabled": False, "include_tools": ("a",)})
    assert not changed.enabled and changed.include_tools == ("a",) and changed.auth_header_enc == "ciphertext"
    assert [r.name for r in await repo.list(tenant.id)] == ["shop"]
    await repo.delete(tenant.id, "shop")
    with pytest.raises(NotFound, match="not registered"):
        await repo.get(tenant.id, "shop")


async def test_a_second_registration_of_one_name_conflicts_and_another_tenant_sees_nothing(pool, make_tenant):
    repo = McpServerRepo(pool)
    tenant, _ = await make_tenant()
    other, _ = await make_tenant()
    await repo.create(record(tenant.id))
    with pytest.raises(Conflict, match="already registered"):
        await repo.create(record(tenant.id))
    assert await repo.list(other.id) == []
    with pytest.raises(NotFound):
        await repo.get(other.id, "shop")
    with pytest.raises(NotFound):
        await repo.update(other.id, "shop", {"enabled": False})
    with pytest.raises(NotFound):
        await repo.delete(other.id, "shop")
    assert (await repo.get(tenant.id, "shop")).enabled


async def test_only_known_columns_may_change(pool, make_tenant):
    repo = McpServerRepo(pool)
    tenant, _ = await make_tenant()
    await repo.create(record(tenant.id))
    with pytest.raises(InvalidInput, match="cannot be changed"):
        await repo.update(tenant.id, "shop", {"tenant_id": "someone-else"})


async def test_every_change_moves_the_catalog_stamp_and_is_announced(pool, make_tenant):
    repo = McpServerRepo(pool)
    stamp = ToolRepo(pool).catalog_stamp  # the one stamp a turn reads covers the registrations
    tenant, _ = await make_tenant()
    received: asyncio.Queue[str] = asyncio.Queue()
    listener = await listen_catalog(pool, received.put_nowait)
    try:
        stamps = [await stamp(tenant.id)]
        await repo.create(record(tenant.id))
        stamps.append(await stamp(tenant.id))
        await repo.update(tenant.id, "shop", {"enabled": False})
        stamps.append(await stamp(tenant.id))
        await repo.delete(tenant.id, "shop")
        stamps.append(await stamp(tenant.id))
        got = [await asyncio.wait_for(received.get(), 5) for _ in range(6)]
        assert got[::2] == [tenant.id] * 3
        assert all(fence_number(payload) is not None for payload in got[1::2])  # each change's fence
        assert len(set(stamps[:3])) == 3 and stamps[3] == stamps[0]  # back to none registered
    finally:
        await listener.close()
