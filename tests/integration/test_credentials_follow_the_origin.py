"""A stored write-only credential goes only to the origin it was written for.

A webhook tool's `auth_header`, the bot config's `backend.auth_header` and an MCP server's
`auth_header` are write-only: whoever holds the tenant's key can replace or remove them but never
read them. A change that moves the destination (`webhook_url`, `backend.base_url`, `url`) to
another origin (scheme, host, port) and does not send the credential anew is refused with 422
naming the credential's field, and nothing changes: before, the stored credential was kept and
the engine sent it, decrypted, to the new host (one the changer may own). A change of path or
query on the same origin keeps it, as before; the credential (or null) sent with the new URL is
taken. A real aiohttp server on loopback over the real Postgres repositories.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer

from services.gateway.app import build_app
from services.gateway.common import GatewayDeps
from services.tools.crypto import SecretBox, generate_key
from storage.repos import BotConfigRepo, SessionRepo, TenantRepo, ToolCallRepo, ToolRepo
from storage.repos.mcp_servers import McpServerRepo
from tests.support.gateways import FakeRouter, OriginGateway

SECRET = "Bearer sk_live_written_by_the_shop_owner"
NEW_SECRET = "Bearer sk_live_for_the_new_host"
ORDERS = "https://api.shop.example/orders/{order_id}"
#: webhook_url changes that reach another origin: host, port, scheme, a subdomain, a look-alike
OTHER_ORIGINS = [
    pytest.param("https://collector.attacker.example/orders/{order_id}", id="other-host"),
    pytest.param("https://api.shop.example:8443/orders/{order_id}", id="other-port"),
    pytest.param("http://api.shop.example/orders/{order_id}", id="other-scheme"),
    pytest.param("https://evil.api.shop.example/orders/{order_id}", id="subdomain"),
    pytest.param("https://api.shop.example.attacker.example/orders/{order_id}", id="look-alike"),
]
#: changes that stay on the origin: path and query, the host's case, the default port spelled out
SAME_ORIGIN = [
    pytest.param("https://api.shop.example/v2/orders/{order_id}?expand=items", id="path-and-query"),
    pytest.param("HTTPS://API.Shop.Example:443/orders/{order_id}", id="case-and-default-port"),
]


@pytest_asyncio.fixture
async def gw(pool, make_tenant) -> AsyncIterator[OriginGateway]:
    box = SecretBox([generate_key()])
    deps = GatewayDeps(router=FakeRouter(), tenants=TenantRepo(pool), tools=ToolRepo(pool), calls=ToolCallRepo(pool),
                       sessions=SessionRepo(pool), configs=BotConfigRepo(pool), secret_box=box)
    tenant, key = await make_tenant("origin")
    async with TestClient(TestServer(build_app(deps), host="127.0.0.1")) as client:
        yield OriginGateway(client, {"Authorization": f"Bearer {key.api_key}"}, tenant.id, box, pool)


def refused_for(problem: dict[str, Any], field: str, without: str) -> None:
    """A 422 problem naming the credential's field and both ways forward, never the secret."""
    detail = problem["detail"]
    assert problem["status"] == 422 and f"`$.{field}`" in detail, problem
    assert "again for the new host" in detail and without in detail, detail
    assert SECRET not in json.dumps(problem)


# -- webhook tools: PATCH /v1/tools/{name} ----------------------------------------------------------

async def make_tool(gw: OriginGateway, *, auth_header: str | None = SECRET) -> None:
    body = {"name": "order_status", "description": "Look up an order by its number.", "webhook_url": ORDERS,
            "parameters": {"order_id": {"type": "string"}}}
    if auth_header is not None:
        body["auth_header"] = auth_header
    status, created = await gw.call("POST", "/v1/tools", body)
    assert status == 201, created


@pytest.mark.parametrize("url", OTHER_ORIGINS)
async def test_a_tool_patch_moving_the_webhook_to_another_origin_without_the_auth_header_is_refused(gw, url):
    await make_tool(gw)
    status, problem = await gw.call("PATCH", "/v1/tools/order_status", {"webhook_url": url})
    assert status == 422
    refused_for(problem, "auth_header", "auth_header: null")
    assert "webhook_url" in problem["detail"]
    # nothing changed: no new version, the live one still points at the shop with its header
    _, versions = await gw.call("GET", "/v1/tools/order_status/versions")
    assert [v["version"] for v in versions["versions"]] == [1]
    _, tool = await gw.call("GET", "/v1/tools/order_status")
    assert tool["webhook_url"] == ORDERS and tool["auth_header_set"] is True
    assert await gw.tool_secret() == SECRET


@pytest.mark.parametrize("url", SAME_ORIGIN)
async def test_a_tool_patch_on_the_same_origin_keeps_the_auth_header(gw, url):
    await make_tool(gw)
    status, tool = await gw.call("PATCH", "/v1/tools/order_status", {"webhook_url": url})
    assert status == 200, tool
    assert tool["webhook_url"] == url and tool["auth_header_set"] is True and tool["version"] == 2
    assert await gw.tool_secret() == SECRET


async def test_a_tool_patch_to_another_origin_takes_the_auth_header_sent_with_it_or_null(gw):
    await make_tool(gw)
    moved = "https://api.newshop.example/orders/{order_id}"
    status, tool = await gw.call("PATCH", "/v1/tools/order_status", {"webhook_url": moved, "auth_header": NEW_SECRET})
    assert status == 200, tool
    assert tool["webhook_url"] == moved and tool["auth_header_set"] is True
    assert await gw.tool_secret() == NEW_SECRET
    elsewhere = "https://api.othershop.example/orders/{order_id}"
    status, tool = await gw.call("PATCH", "/v1/tools/order_status", {"webhook_url": elsewhere, "auth_header": None})
    assert status == 200, tool
    assert tool["webhook_url"] == elsewhere and tool["auth_header_set"] is False
    assert await gw.tool_secret() is None


async def test_a_tool_without_a_stored_auth_header_moves_to_another_origin(gw):
    await make_tool(gw, auth_header=None)
    moved = "https://api.newshop.example/orders/{order_id}"
    status, tool = await gw.call("PATCH", "/v1/tools/order_status", {"webhook_url": moved})
    assert status == 200, tool
    assert tool["webhook_url"] == moved and tool["auth_header_set"] is False


async def test_rolling_back_a_tool_brings_back_the_old_url_with_its_own_auth_header(gw):
    await make_tool(gw)
    moved = "https://api.newshop.example/orders/{order_id}"
    status, _ = await gw.call("PATCH", "/v1/tools/order_status", {"webhook_url": moved, "auth_header": None})
    assert status == 200
    status, tool = await gw.call("POST", "/v1/tools/order_status/versions/1/publish")
    assert status == 200, tool
    assert tool["version"] == 1 and tool["webhook_url"] == ORDERS and tool["auth_header_set"] is True
    assert await gw.tool_secret() == SECRET


# -- the bot config's backend: PUT /v1/bot-config ----------------------------------------------------

BACKEND_URL = "https://api.shop.example/v1"


async def put_backend(gw: OriginGateway, **backend: Any) -> tuple[int, dict[str, Any]]:
    return await gw.call("PUT", "/v1/bot-config", {"persona": "You help with orders.", "backend": backend})


@pytest.mark.parametrize("kept", [pytest.param({}, id="left-out"), pytest.param({"auth_header_set": True}, id="shown-as-set")])
@pytest.mark.parametrize("url", ["https://collector.attacker.example/v1", "https://api.shop.example:8443/v1",
                                 "http://api.shop.example/v1"])
async def test_a_backend_moved_to_another_origin_without_its_auth_header_is_refused(gw, url, kept):
    status, _ = await put_backend(gw, base_url=BACKEND_URL, auth_header=SECRET)
    assert status == 200
    before = await gw.backend()
    status, problem = await put_backend(gw, base_url=url, **kept)
    assert status == 422
    refused_for(problem, "backend.auth_header", "backend.auth_header_set: false")
    assert "backend.base_url" in problem["detail"]
    assert await gw.backend() == before and await gw.backend_secret() == SECRET


async def test_the_view_put_back_with_only_the_backend_host_changed_is_refused(gw):
    status, _ = await put_backend(gw, base_url=BACKEND_URL, auth_header=SECRET)
    assert status == 200
    _, view = await gw.call("GET", "/v1/bot-config")
    view["backend"]["base_url"] = "https://collector.attacker.example/v1"
    status, problem = await gw.call("PUT", "/v1/bot-config", view)
    assert status == 422
    refused_for(problem, "backend.auth_header", "backend.auth_header_set: false")
    assert (await gw.backend())["base_url"] == BACKEND_URL and await gw.backend_secret() == SECRET


async def test_a_backend_moved_on_its_origin_keeps_its_auth_header(gw):
    status, _ = await put_backend(gw, base_url=BACKEND_URL, auth_header=SECRET)
    assert status == 200
    status, config = await put_backend(gw, base_url="https://API.shop.example:443/v2?region=eu")
    assert status == 200, config
    assert config["backend"]["auth_header_set"] is True
    assert await gw.backend_secret() == SECRET


async def test_a_backend_moved_to_another_origin_takes_the_auth_header_sent_with_it_or_its_removal(gw):
    status, _ = await put_backend(gw, base_url=BACKEND_URL, auth_header=SECRET)
    assert status == 200
    status, config = await put_backend(gw, base_url="https://api.newshop.example/v1", auth_header=NEW_SECRET)
    assert status == 200, config
    assert config["backend"]["auth_header_set"] is True and await gw.backend_secret() == NEW_SECRET
    status, config = await put_backend(gw, base_url="https://api.othershop.example/v1", auth_header_set=False)
    assert status == 200, config
    assert config["backend"]["auth_header_set"] is False and await gw.backend_secret() is None


@pytest.mark.parametrize("stored", [pytest.param(None, id="no-config"), pytest.param(BACKEND_URL, id="backend-without-header")])
async def test_auth_header_set_true_with_no_backend_header_stored_is_refused(gw, stored):
    if stored is not None:
        status, _ = await put_backend(gw, base_url=stored)
        assert status == 200
    before = await BotConfigRepo(gw.pool).get(gw.tenant_id)
    status, problem = await put_backend(gw, base_url=BACKEND_URL, auth_header_set=True)
    assert status == 422, problem
    detail = problem["detail"]
    assert "`$.backend.auth_header_set`" in detail and "no backend auth header is stored" in detail, detail
    assert "send backend.auth_header" in detail
    assert await BotConfigRepo(gw.pool).get(gw.tenant_id) == before


# -- MCP servers: PATCH /v1/mcp-servers/{name} ----------------------------------------------------------

MCP_URL = "https://mcp.shop.example/mcp"


async def make_server(gw: OriginGateway, *, auth_header: str | None = SECRET) -> None:
    status, created = await gw.call("POST", "/v1/mcp-servers", {"name": "shop", "url": MCP_URL, "auth_header": auth_header})
    assert status == 201, created


@pytest.mark.parametrize("url", ["https://collector.attacker.example/mcp", "https://mcp.shop.example:8443/mcp",
                                 "http://mcp.shop.example/mcp"])
async def test_an_mcp_server_moved_to_another_origin_without_its_auth_header_is_refused(gw, url):
    await make_server(gw)
    status, problem = await gw.call("PATCH", "/v1/mcp-servers/shop", {"url": url, "enabled": False})
    assert status == 422
    refused_for(problem, "auth_header", "auth_header: null")
    record = await McpServerRepo(gw.pool).get(gw.tenant_id, "shop")
    assert record.url == MCP_URL and record.enabled is True and await gw.mcp_secret() == SECRET


async def test_an_mcp_server_moved_on_its_origin_keeps_its_auth_header(gw):
    await make_server(gw)
    status, view = await gw.call("PATCH", "/v1/mcp-servers/shop", {"url": "https://MCP.shop.example:443/v2/mcp"})
    assert status == 200, view
    assert view["url"] == "https://MCP.shop.example:443/v2/mcp" and view["auth_header_set"] is True
    assert await gw.mcp_secret() == SECRET


async def test_an_mcp_server_moved_to_another_origin_takes_the_auth_header_sent_with_it_or_null(gw):
    await make_server(gw)
    status, view = await gw.call("PATCH", "/v1/mcp-servers/shop",
                                 {"url": "https://mcp.newshop.example/mcp", "auth_header": NEW_SECRET})
    assert status == 200, view
    assert view["auth_header_set"] is True and await gw.mcp_secret() == NEW_SECRET
    status, view = await gw.call("PATCH", "/v1/mcp-servers/shop",
                                 {"url": "https://mcp.othershop.example/mcp", "auth_header": None})
    assert status == 200, view
    assert view["auth_header_set"] is False and await gw.mcp_secret() is None
    # with no header stored there is nothing to leak: the next move needs none
    status, view = await gw.call("PATCH", "/v1/mcp-servers/shop", {"url": "https://mcp.thirdshop.example/mcp"})
    assert status == 200 and view["url"] == "https://mcp.thirdshop.example/mcp", view


async def test_an_mcp_move_checks_the_header_stored_when_it_writes_not_when_it_read(gw):
    """A PATCH moving the URL while another request sets a header for the old host: the move is
    judged against the row it changes (locked), so the new host never gets that header."""
    await make_server(gw, auth_header=None)
    async with gw.pool.acquire() as conn, conn.transaction():
        # another writer holds the row and gives it a header for the old host
        await conn.execute("SELECT 1 FROM ce_mcp_servers WHERE tenant_id = $1 AND name = 'shop' FOR UPDATE",
                           gw.tenant_id)
        move = asyncio.create_task(gw.call("PATCH", "/v1/mcp-servers/shop", {"url": "https://collector.attacker.example/mcp"}))
        await wait_for_a_lock_wait(gw.pool)
        await conn.execute("UPDATE ce_mcp_servers SET auth_header_enc = $2 WHERE tenant_id = $1 AND name = 'shop'",
                           gw.tenant_id, gw.box.encrypt(SECRET))
    status, problem = await asyncio.wait_for(move, 10)
    assert status == 422, problem
    refused_for(problem, "auth_header", "auth_header: null")
    record = await McpServerRepo(gw.pool).get(gw.tenant_id, "shop")
    assert record.url == MCP_URL and await gw.mcp_secret() == SECRET


async def wait_for_a_lock_wait(pool, timeout_s: float = 10.0) -> None:
    """Until some session waits for a row lock on ce_mcp_servers (the PATCH reached the row)."""
    async with asyncio.timeout(timeout_s):
        while not await pool.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query ILIKE '%ce_mcp_servers%'"
        ):
            await asyncio.sleep(0.02)
