"""ToolRepo: create, version, publish, roll back, enable, delete; catalog NOTIFY on every change."""

from __future__ import annotations

import asyncio

import pytest

from kernel.errors import Conflict, InvalidInput, NotFound
from storage.repos import ToolRepo, listen_catalog
from storage.repos.catalog_sync import fence_number

CHECK_ORDER = {
    "description": "Look up a customer order by order number.",
    "parameters": {"order_id": {"type": "string", "description": "The order number"}},
    "webhook_url": "https://mystore.example/api/orders/{order_id}",
    "auth_header_enc": "v1:ciphertext-not-a-secret",
    "timeout_ms": 4000,
}


@pytest.fixture
def tools(pool) -> ToolRepo:
    return ToolRepo(pool)


async def test_create_fills_the_seed_columns_and_publishes_version_1(tools, pool, make_tenant):
    tenant, _ = await make_tenant()
    v1 = await tools.create(tenant.id, "check_order", "webhook", CHECK_ORDER)
    assert (v1.version, v1.published, v1.tenant_id) == (1, True, tenant.id)
    assert v1.definition == {**CHECK_ORDER, "name": "check_order", "type": "webhook"}

    row = await pool.fetchrow(
        "SELECT * FROM ce_custom_tools WHERE tenant_id = $1 AND name = 'check_order'", tenant.id
    )
    assert row["description"] == CHECK_ORDER["description"]
    assert row["parameters"] == CHECK_ORDER["parameters"]
    assert row["webhook_url"] == CHECK_ORDER["webhook_url"]
    assert row["auth_header"] == "v1:ciphertext-not-a-secret"
    assert (row["timeout_ms"], row["enabled"], row["type"], row["version"]) == (4000, True, "webhook", 1)

    live = await tools.get(tenant.id, "check_order")
    assert (live.version, live.type, live.enabled) == (1, "webhook", True)
    assert live.definition == v1.definition


async def test_non_webhook_tools_store_an_empty_webhook_url_and_no_auth(tools, pool, make_tenant):
    tenant, _ = await make_tenant()
    await tools.create(tenant.id, "reorder", "python", {
        "description": "Reorder", "parameters": {"type": "object", "properties": {}}, "handler": "reorder",
    })
    row = await pool.fetchrow(
        "SELECT webhook_url, auth_header, type FROM ce_custom_tools WHERE tenant_id = $1", tenant.id
    )
    assert tuple(row) == ("", None, "python")


async def test_duplicate_name_is_a_conflict(tools, make_tenant):
    tenant, _ = await make_tenant()
    await tools.create(tenant.id, "check_order", "webhook", CHECK_ORDER)
    with pytest.raises(Conflict, match="a tool named 'check_order' already exists"):
        await tools.create(tenant.id, "check_order", "webhook", CHECK_ORDER)


async def test_plaintext_auth_headers_and_mismatched_names_are_refused(tools, make_tenant):
    tenant, _ = await make_tenant()
    with pytest.raises(InvalidInput, match="plaintext auth_header") as info:
        await tools.create(tenant.id, "t", "webhook", {**CHECK_ORDER, "auth_header": "Bearer sk-live"})
    assert "sk-live" not in str(info.value)
    with pytest.raises(InvalidInput, match="definition name 'other' does not match 't'"):
        await tools.create(tenant.id, "t", "webhook", {**CHECK_ORDER, "name": "other"})
    with pytest.raises(InvalidInput, match="timeout_ms must be a positive whole number"):
        await tools.create(tenant.id, "t", "webhook", {**CHECK_ORDER, "timeout_ms": -1})


async def test_versions_publish_and_rollback(tools, pool, make_tenant):
    tenant, _ = await make_tenant()
    await tools.create(tenant.id, "check_order", "webhook", CHECK_ORDER)
    draft = await tools.new_version(tenant.id, "check_order", {**CHECK_ORDER, "timeout_ms": 9000})
    assert (draft.version, draft.published) == (2, False)
    assert (await tools.get(tenant.id, "check_order")).version == 1  # a draft changes nothing live

    v3 = await tools.new_version(
        tenant.id, "check_order", {**CHECK_ORDER, "description": "v3"}, publish=True
    )
    live = await tools.get(tenant.id, "check_order")
    assert (v3.version, live.version, live.definition["description"]) == (3, 3, "v3")
    assert await pool.fetchval(
        "SELECT description FROM ce_custom_tools WHERE tenant_id = $1", tenant.id
    ) == "v3"

    published = await tools.publish(tenant.id, "check_order", 2)
    assert (published.version, published.definition["timeout_ms"]) == (2, 9000)
    assert await pool.fetchval("SELECT timeout_ms FROM ce_custom_tools WHERE tenant_id = $1", tenant.id) == 9000

    rolled_back = await tools.publish(tenant.id, "check_order", 1)
    assert rolled_back.definition == {**CHECK_ORDER, "name": "check_order", "type": "webhook", "enabled": True}
    history = await tools.versions(tenant.id, "check_order")
    assert [(v.version, v.published) for v in history] == [(1, True), (2, False), (3, False)]

    with pytest.raises(NotFound, match="tool 'check_order' has no version 7"):
        await tools.publish(tenant.id, "check_order", 7)


async def test_disable_survives_a_rollback_and_delete_keeps_history(tools, make_tenant):
    tenant, _ = await make_tenant()
    await tools.create(tenant.id, "check_order", "webhook", CHECK_ORDER)
    await tools.new_version(tenant.id, "check_order", CHECK_ORDER, publish=True)
    off = await tools.set_enabled(tenant.id, "check_order", False)
    assert (off.enabled, off.definition["enabled"]) == (False, False)
    again = await tools.publish(tenant.id, "check_order", 1)
    assert (again.enabled, again.definition["enabled"]) == (False, False)

    await tools.delete(tenant.id, "check_order")
    with pytest.raises(NotFound, match="tool 'check_order' does not exist for this tenant"):
        await tools.get(tenant.id, "check_order")
    assert await tools.list_published(tenant.id) == []
    assert [v.published for v in await tools.versions(tenant.id, "check_order")] == [False, False]
    with pytest.raises(NotFound):
        await tools.delete(tenant.id, "check_order")
    with pytest.raises(NotFound):
        await tools.new_version(tenant.id, "check_order", CHECK_ORDER)

    # re-creating continues the numbering instead of overwriting the kept history
    recreated = await tools.create(tenant.id, "check_order", "webhook", CHECK_ORDER)
    assert recreated.version == 3


async def test_list_published_is_by_name(tools, make_tenant):
    tenant, _ = await make_tenant()
    for name in ("zeta", "alpha", "mid"):
        await tools.create(tenant.id, name, "webhook", CHECK_ORDER)
    assert [t.name for t in await tools.list_published(tenant.id)] == ["alpha", "mid", "zeta"]


async def test_every_change_notifies_the_catalog_channel_after_commit(tools, pool, make_tenant):
    tenant, _ = await make_tenant()
    other, _ = await make_tenant()
    received: asyncio.Queue[str] = asyncio.Queue()

    async def on_change(payload: str) -> None:
        await received.put("fence" if fence_number(payload) is not None else payload)

    listener = await listen_catalog(pool, on_change)
    try:
        await tools.create(tenant.id, "t1", "webhook", CHECK_ORDER)
        await tools.new_version(tenant.id, "t1", CHECK_ORDER)  # a draft: not announced
        await tools.new_version(tenant.id, "t1", CHECK_ORDER, publish=True)
        await tools.publish(tenant.id, "t1", 1)
        await tools.set_enabled(tenant.id, "t1", False)
        await tools.delete(tenant.id, "t1")
        await tools.create(other.id, "t1", "webhook", CHECK_ORDER)
        with pytest.raises(Conflict):  # rolled back: must not be announced
            await tools.create(other.id, "t1", "webhook", CHECK_ORDER)
        got = [await asyncio.wait_for(received.get(), 5) for _ in range(12)]
        # each change is followed by the fence its writer waited on (storage/repos/catalog_sync.py)
        assert got == [tenant.id, "fence"] * 5 + [other.id, "fence"]
        await asyncio.sleep(0.1)
        assert received.empty()
    finally:
        await listener.close()
    await tools.create(tenant.id, "t2", "webhook", CHECK_ORDER)
    await asyncio.sleep(0.1)
    assert received.empty()  # closed: no more callbacks


async def test_a_lost_listener_connection_is_reported(pool):
    lost = asyncio.Event()
    listener = await listen_catalog(pool, lambda tenant_id: None, on_lost=lost.set)
    try:
        killed = await pool.fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND query LIKE 'LISTEN %ce_catalog%'"
        )
        assert killed == 1
        await asyncio.wait_for(lost.wait(), 5)
    finally:
        await listener.close()  # closing a dead subscription is fine


async def test_a_listener_reports_outside_the_logging_context_its_connection_was_opened_in(fresh_db):
    # A host binds a turn's tenant and session for its log lines; a connection the pool opens for
    # that turn keeps a copy of that context for its callbacks. A listener later holding it must
    # not report (nor resubscribe, nor invalidate) under that turn's ids: they are a stranger's.
    import structlog

    from storage.pool import create_pool

    pool = await create_pool(await fresh_db(), min_size=0, max_size=2)
    seen: list[dict] = []
    lost = asyncio.Event()

    def on_lost() -> None:
        seen.append(structlog.contextvars.get_contextvars())
        lost.set()

    def on_change(_tenant_id: str) -> None:
        seen.append(structlog.contextvars.get_contextvars())

    async def turn() -> None:  # as the host runs one: ids bound, then a query opens a connection
        structlog.contextvars.bind_contextvars(tenant_id="tenant-a", session_id="alice")
        await pool.fetchval("SELECT 1")

    try:
        await asyncio.create_task(turn())
        listener = await listen_catalog(pool, on_change, on_lost=on_lost)
        await pool.execute("SELECT pg_notify('ce_catalog', 'tenant-x')")
        async with asyncio.timeout(5):
            while not seen:
                await asyncio.sleep(0.01)
        await pool.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND query LIKE 'LISTEN %ce_catalog%'")
        await asyncio.wait_for(lost.wait(), 5)
        await listener.close()
        assert seen == [{}, {}]
    finally:
        await pool.close()
