"""End-to-end fixtures: the real stack (gateway + local Ray + Postgres + local model + demo store).

One stack per test run (Ray takes seconds to start on 2 cores): `stack` is the same code path as
`chat-engine run`, on a migrated test database and a free loopback port, with two sharded
session hosts. `dedicated_gateway` serves the same database through dedicated per-session actors.
`client` is an aiohttp client session for talking to gateways as a contact or an admin would.
`browser` and `tab` (tests.support.browser) drive the dashboard in Debian's headless chromium.
"""

from __future__ import annotations

import tempfile
from collections.abc import AsyncIterator

import aiohttp
import asyncpg
import msgspec
import pytest_asyncio

from services.settings import Settings
from tests.support.browser import browser, tab  # noqa: F401  (fixtures of the dashboard's browser tests)


@pytest_asyncio.fixture(scope="session")
async def stack(fresh_db) -> AsyncIterator[object]:
    from app.stack import Stack

    data_dir = tempfile.mkdtemp(prefix="ce-e2e-")
    settings = Settings.from_env({
        "DATABASE_URL": await fresh_db(), "CE_DATA_DIR": data_dir, "CE_SHARDS": "2",
        "CE_LOG_LEVEL": "warning", "CE_LOG_FORMAT": "json", "CE_FLUSH_INTERVAL_MS": "2",
        # load tests drive bursts far beyond one tenant's default rate; test_overload checks the limits
        "CE_TENANT_RATE": "0", "CE_TENANT_CONCURRENCY": "0",
    })
    s = await Stack.start(settings, port=0)
    try:
        yield s
    finally:
        await s.stop()


@pytest_asyncio.fixture(scope="session")
async def dedicated_gateway(stack) -> AsyncIterator[object]:
    """A second gateway over the same database whose sessions are dedicated actors."""
    from actors.placement import Placement
    from services.gateway.server import open_gateway

    settings = msgspec.structs.replace(stack.settings, placement="dedicated", idle_seconds=30.0)
    placement = Placement(settings)
    gateway = await open_gateway(settings, placement, port=0)
    gateway.placement = placement
    try:
        yield gateway
    finally:
        await placement.shutdown_hosts()
        await gateway.close()


@pytest_asyncio.fixture(scope="session")
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        yield session


@pytest_asyncio.fixture
async def tenant(stack, client):
    """A new tenant on the stack: (tenant_id, api_key, headers)."""
    from tests.support.e2e import new_tenant

    tenant_id, api_key = await new_tenant(stack)
    return tenant_id, api_key, {"Authorization": f"Bearer {api_key}"}


@pytest_asyncio.fixture(scope="module")
async def db(stack) -> AsyncIterator[asyncpg.Connection]:
    """A plain connection to the stack's database (no JSON codecs: rows read as the text Postgres
    stores). Modules that need a pool define their own `db`."""
    conn = await asyncpg.connect(stack.settings.database_url)
    try:
        yield conn
    finally:
        await conn.close()
