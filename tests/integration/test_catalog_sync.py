"""Catalog changes are acknowledged by the listening processes before the writer answers, so the
next message sees them without a per-turn stamp read (storage/repos/catalog_sync.py,
services/catalog_sync.py). Real Postgres; the runtime's listener runs in this event loop, so a
turn right after a write sees the change only if the writer waited for it."""

from __future__ import annotations

import asyncio
import time

import asyncpg
import pytest

from actors.runtime import Runtime
from services.builtins.appointments import service_from_body
from services.catalog_sync import CatalogSync
from services.settings import Settings
from services.tools.crypto import generate_key
from storage.pool import create_pool
from storage.repos import BotConfigRepo, TenantRepo, ToolRepo, listen_catalog
from storage.repos.builtins import AppointmentRepo, FormRepo
from storage.repos.catalog_sync import (
    LIVE_S,
    ListenerNotVisible,
    ListenerRow,
    announce_change,
    fence_number,
)

WEBHOOK = {
    "type": "webhook", "name": "check_order", "description": "Look up an order",
    "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}},
    "webhook_url": "http://127.0.0.1:9/orders",
}


async def wait_for(predicate, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.02)


async def wait_for_gone(pool, pid: int) -> None:
    for _ in range(250):
        if not await pool.fetchval("SELECT count(*) FROM pg_stat_get_activity($1)", pid):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"server process {pid} still there")


@pytest.fixture
async def stack(fresh_db):
    """A runtime that listens and is acknowledged (CE_CATALOG_CHECK=notify), an admin pool that
    writes as the gateway does, and a tenant whose catalog the runtime has cached."""
    url = await fresh_db()
    rt = await Runtime.open(Settings(database_url=url, anthropic_base_url="http://127.0.0.1:9",
                                     secret_keys=(generate_key(),)))
    admin = await create_pool(url, max_size=2)
    try:
        tenant, _ = await TenantRepo(admin).create_tenant("sync-test")
        await wait_for(rt.catalog_sync.trusted)
        await rt.tenants.env_for(tenant.id)
        yield rt, admin, tenant.id
    finally:
        await admin.close()
        await rt.close()


def names(env) -> set[str]:
    return set(env.catalog.names())


def slow_listener(rt, delay_s: float = 0.2) -> None:
    """Hand every notification to the runtime `delay_s` late, in order: a busy host."""
    handle = rt.catalog_sync.notified
    queue: asyncio.Queue[str] = asyncio.Queue()

    async def deliver() -> None:
        while True:
            payload = await queue.get()
            await asyncio.sleep(delay_s)
            handle(payload)

    rt._slow_delivery = asyncio.get_running_loop().create_task(deliver())
    rt.catalog_sync.notified = queue.put_nowait


async def test_a_new_tool_reaches_the_next_turn_with_no_stamp_read(stack):
    rt, admin, tenant = stack
    slow_listener(rt)
    reads = rt.tenants.stamp_reads
    await ToolRepo(admin).create(tenant, "check_order", "webhook", WEBHOOK)
    # the listener takes 0.2 s over each notification: only the writer's wait for its
    # acknowledgement lets this turn, right after the write's answer, see the change
    env = await rt.tenants.env_for(tenant)
    assert "check_order" in names(env)
    assert rt.tenants.stamp_reads == reads
    rt._slow_delivery.cancel()


async def test_disabling_deleting_and_config_changes_reach_the_next_turn(stack):
    rt, admin, tenant = stack
    tools = ToolRepo(admin)
    await tools.create(tenant, "check_order", "webhook", WEBHOOK)
    assert "check_order" in names(await rt.tenants.env_for(tenant))
    first = await rt.tenants.env_for(tenant)
    await tools.set_enabled(tenant, "check_order", False)
    assert await rt.tenants.env_for(tenant) is not first  # reloaded with the switch off
    await tools.delete(tenant, "check_order")
    assert "check_order" not in names(await rt.tenants.env_for(tenant))
    await BotConfigRepo(admin).put(tenant, {"main_model": "claude-test-model"})
    assert (await rt.tenants.env_for(tenant)).main_model == "claude-test-model"
    assert rt.tenants.stamp_reads == 0


async def test_the_first_form_and_service_reach_the_next_turn(stack):
    rt, admin, tenant = stack
    before = names(await rt.tenants.env_for(tenant))
    assert "submit_form" not in before
    await FormRepo(admin).put(tenant, "contact", {"type": "object", "properties": {"name": {"type": "string"}}})
    assert "submit_form" in names(await rt.tenants.env_for(tenant))
    await AppointmentRepo(admin).put_service(tenant, service_from_body(
        "haircut", {"duration_minutes": 30, "timezone": "UTC", "opening_hours": {"mon": ["09:00", "17:00"]}}))
    after = names(await rt.tenants.env_for(tenant))
    assert after - before - {"submit_form"}, "the booking tools joined the catalog"
    await FormRepo(admin).delete(tenant, "contact")
    assert "submit_form" not in names(await rt.tenants.env_for(tenant))
    assert rt.tenants.stamp_reads == 0


async def test_a_turn_reads_the_stamp_while_the_listener_is_down(stack):
    rt, admin, tenant = stack
    first = rt.listener
    killed = await admin.fetchval(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
        "WHERE datname = current_database() AND query LIKE 'LISTEN%'"
    )
    assert killed == 1
    await wait_for(lambda: not rt.catalog_sync.trusted())
    reads = rt.tenants.stamp_reads
    await rt.tenants.env_for(tenant)
    assert rt.tenants.stamp_reads == reads + 1
    # subscribed again and beating: trusted again, and a change still reaches the next turn
    await wait_for(lambda: rt.listener is not first and rt.catalog_sync.trusted())
    await ToolRepo(admin).create(tenant, "check_order", "webhook", WEBHOOK)
    reads = rt.tenants.stamp_reads
    assert "check_order" in names(await rt.tenants.env_for(tenant))
    assert rt.tenants.stamp_reads == reads


async def test_with_catalog_check_read_every_turn_reads_the_stamp(fresh_db, make_tenant):
    url = await fresh_db()
    rt = await Runtime.open(Settings(database_url=url, anthropic_base_url="http://127.0.0.1:9",
                                     catalog_check="read"))
    try:
        tenant, _ = await TenantRepo(rt.pool).create_tenant("read-test")
        assert rt.catalog_sync is None
        for _ in range(3):
            await rt.tenants.env_for(tenant.id)
        assert rt.tenants.stamp_reads == 3
        assert await rt.pool.fetchval("SELECT count(*) FROM ce_catalog_listeners") == 0
    finally:
        await rt.close()


async def test_closing_the_runtime_removes_its_listener_row(fresh_db):
    url = await fresh_db()
    rt = await Runtime.open(Settings(database_url=url, anthropic_base_url="http://127.0.0.1:9"))
    admin = await create_pool(url, max_size=1)
    try:
        await wait_for(rt.catalog_sync.trusted)
        listener_id = rt.catalog_sync.listener_id
        assert await admin.fetchval(
            "SELECT count(*) FROM ce_catalog_listeners WHERE listener_id = $1", listener_id) == 1
        await rt.close()
        assert await admin.fetchval("SELECT count(*) FROM ce_catalog_listeners") == 0
        # with nobody listening, a write does not wait
        tenant, _ = await TenantRepo(admin).create_tenant("nobody")
        started = time.monotonic()
        await ToolRepo(admin).create(tenant.id, "check_order", "webhook", WEBHOOK)
        assert time.monotonic() - started < 1.0
    finally:
        await admin.close()


# ------------------------------------------------------------------ the writer's side, row by row


async def test_a_writer_waits_for_a_live_listener_then_marks_it_lagging(fresh_db):
    url = await fresh_db()
    pool = await create_pool(url, max_size=2)
    try:
        row = ListenerRow(pool, "silent")
        pid = await pool.fetchval("SELECT pg_backend_pid()")  # a connection the pool keeps open
        assert await row.beat(pid) is False  # registered, never acknowledges
        started = time.monotonic()
        assert await announce_change(pool, timeout_s=0.3) is False
        assert time.monotonic() - started >= 0.3
        assert await pool.fetchval("SELECT lagging FROM ce_catalog_listeners WHERE listener_id = 'silent'")
        assert await row.beat(pid) is True  # the mark reaches the listener once, and is cleared
        assert await row.beat(pid) is False
    finally:
        await pool.close()


async def test_an_acknowledged_fence_ends_the_wait_and_a_stale_listener_is_not_waited_for(fresh_db):
    url = await fresh_db()
    pool = await create_pool(url, max_size=3)
    try:
        row = ListenerRow(pool, "prompt")
        fences: list[int] = []

        async def acknowledge() -> None:
            await wait_for(lambda: fences)
            await row.ack(fences[0])

        own = await asyncpg.connect(url)  # the listener's own connection, closed below
        listener = await listen_catalog(own, lambda p: fences.append(fence_number(p)) if fence_number(p) else None)
        await row.beat(listener.server_pid)
        try:
            acking = asyncio.get_running_loop().create_task(acknowledge())
            assert await announce_change(pool, timeout_s=5.0) is True
            await acking
            # a beat older than LIVE_S: a process that died (or cannot reach Postgres, and so
            # reads a stamp every turn): nobody waits for it
            await pool.execute(
                "UPDATE ce_catalog_listeners SET beat_at = now() - make_interval(secs => $1)", LIVE_S + 1)
            started = time.monotonic()
            assert await announce_change(pool, timeout_s=5.0) is True
            assert time.monotonic() - started < 1.0
            # beating, but its LISTEN connection's server process is gone (the process died
            # between beats): nobody waits for it either
            pid = listener.server_pid
            await row.beat(pid)
            await listener.close()
            await own.close()
            await wait_for_gone(pool, pid)
            started = time.monotonic()
            assert await announce_change(pool, timeout_s=5.0) is True
            assert time.monotonic() - started < 1.0
        finally:
            await listener.close()
            await own.close()
    finally:
        await pool.close()


async def test_trust_needs_a_recent_beat_and_comes_back_with_every_catalog_dropped(fresh_db):
    url = await fresh_db()
    pool = await create_pool(url, max_size=2)
    now = [100.0]
    dropped: list[object] = []
    sync = CatalogSync(pool, lambda tenant=None: dropped.append(tenant), beat_s=3600, trust_s=5.0,
                       clock=lambda: now[0], listener_id="clocked")
    try:
        assert not sync.trusted()
        sync.listener_up(await pool.fetchval("SELECT pg_backend_pid()"))
        await wait_for(sync.trusted)  # the first beat
        dropped.clear()
        now[0] += 4.9
        assert sync.trusted()
        now[0] += 0.2  # 5.1 s since the beat was sent
        assert not sync.trusted()
        await sync.beat()
        assert sync.trusted() and dropped == [None]  # back after a gap: everything dropped
        dropped.clear()
        await sync.beat()
        assert dropped == []  # a beat while trusted drops nothing
        sync.notified("tn_abc")
        assert dropped == ["tn_abc"]
        sync.listener_lost()
        assert not sync.trusted()
    finally:
        await sync.close()
        await pool.close()


async def test_a_fence_handled_before_the_listener_registered_counts_at_its_first_beat(fresh_db):
    url = await fresh_db()
    pool = await create_pool(url, max_size=2)
    sync = CatalogSync(pool, lambda tenant=None: None, beat_s=3600, listener_id="early")
    try:
        fence = await pool.fetchval("SELECT nextval('ce_catalog_fence')")
        sync.notified(f"fence:{fence}")  # arrives between LISTEN and the first beat: no row to mark yet
        await asyncio.sleep(0.1)
        assert await pool.fetchval("SELECT count(*) FROM ce_catalog_listeners") == 0
        sync.listener_up(await pool.fetchval("SELECT pg_backend_pid()"))
        await wait_for(sync.trusted)
        # else every writer of the next fences below it would wait 2 s and mark it lagging
        assert await pool.fetchval("SELECT seen FROM ce_catalog_listeners WHERE listener_id = 'early'") == fence
    finally:
        await sync.close()
        await pool.close()


async def test_a_listener_whose_server_process_cannot_be_seen_is_never_trusted(fresh_db):
    # behind a pooler the start-up message carries a made-up id: writers could not tell whether
    # the listener is alive, so it must not skip the stamp read
    url = await fresh_db()
    pool = await create_pool(url, max_size=2)
    sync = CatalogSync(pool, lambda tenant=None: None, beat_s=3600, listener_id="pooled")
    try:
        sync.listener_up(2_000_000_000)
        with pytest.raises(ListenerNotVisible, match="CE_CATALOG_CHECK=read"):
            await sync.beat()
        assert not sync.trusted()
        assert await pool.fetchval("SELECT count(*) FROM ce_catalog_listeners") == 0
    finally:
        await sync.close()
        await pool.close()


async def test_a_writer_past_its_timeout_waits_until_the_lagging_listener_has_dropped_its_catalogs(fresh_db):
    url = await fresh_db()
    pool = await create_pool(url, max_size=4)
    dropped: list[object] = []
    # trusted, but deaf: nothing hands it the notifications, so it never acknowledges
    sync = CatalogSync(pool, lambda tenant=None: dropped.append(tenant), beat_s=3600, listener_id="deaf")
    try:
        sync.listener_up(await pool.fetchval("SELECT pg_backend_pid()"))
        await wait_for(sync.trusted)
        dropped.clear()
        writer = asyncio.get_running_loop().create_task(announce_change(pool, timeout_s=0.3))
        await asyncio.sleep(0.8)
        # marked lagging at 0.3 s, but it still trusts its cache: answering now would let the
        # next message use the old catalog
        assert not writer.done()
        assert await pool.fetchval("SELECT lagging FROM ce_catalog_listeners WHERE listener_id = 'deaf'")
        await sync.beat()  # finds the mark: drops every catalog before it commits
        assert dropped == [None]
        assert await asyncio.wait_for(writer, 3) is False
        fence = await pool.fetchval("SELECT last_value FROM ce_catalog_fence")
        assert await pool.fetchval("SELECT seen FROM ce_catalog_listeners WHERE listener_id = 'deaf'") == fence
    finally:
        await sync.close()
        await pool.close()
