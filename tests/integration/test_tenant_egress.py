"""Egress allowances per tenant (issue 39, item 4): an operator lets one tenant's tools reach a
destination the SSRF guard refuses, without opening it to every tenant as CE_WEBHOOK_ALLOW does.
Real Postgres, the CLI as a subprocess, the tenant's upstream on loopback. The guard refuses
loopback unless allowed, so loopback stands in for a tenant's private backend; every client
socket is loopback-only (LoopbackOnlySockets) and names resolve through a map (MapResolver)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
import yarl
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from actors.catalogs import TenantCatalogs
from actors.runtime import Runtime
from kernel.records import McpServerRecord
from services.gateway.app import build_app
from services.tools.mcp import McpCatalogSource
from services.tools.mcp_client import McpHttpClient
from services.tools.registry import HandlerRegistry
from services.tools.ssrf import DestinationPolicy
from storage.pool import create_pool
from storage.repos import BotConfigRepo, TenantRepo, ToolRepo
from storage.repos.egress import EgressRepo
from storage.repos.mcp_servers import McpServerRepo
from tests.support.catalogs import loopback_runtime, no_builtins, through_catalog
from tests.support.cli import run_cli
from tests.support.gateways import problem_of, repo_deps
from tests.support.mcp_server import ShopMcpServer, serving


@pytest_asyncio.fixture
async def upstream() -> AsyncIterator[int]:
    """The tenant's private backend (on loopback): its port."""
    async def order(request: web.Request) -> web.Response:
        return web.json_response({"order": request.match_info["id"], "status": "shipped"})

    app = web.Application()
    app.router.add_get("/orders/{id}", order)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield runner.addresses[0][1]
    await runner.cleanup()


@pytest_asyncio.fixture
async def runtime() -> AsyncIterator[Runtime]:
    async with loopback_runtime(DestinationPolicy()) as rt:
        yield rt


def _order_tool(port: int) -> dict:
    return {"description": "Look up an order.", "webhook_url": f"http://127.0.0.1:{port}/orders/{{id}}",
            "parameters": {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]}}


async def test_an_allowance_opens_a_destination_to_one_tenant_on_one_port_only(pool, make_tenant, upstream, runtime):
    (mine, _), (theirs, _) = await make_tenant("egress-mine"), await make_tenant("egress-theirs")
    tools, egress = ToolRepo(pool), EgressRepo(pool)
    for tenant in (mine, theirs):
        await tools.create(tenant.id, "check_order", "webhook", _order_tool(upstream))
    catalogs = TenantCatalogs(tools=tools, configs=BotConfigRepo(pool), registry=HandlerRegistry(),
                              backend_for=runtime._backend_for, builtins=no_builtins, llm=None, executor=None,
                              main_model="m", cheap_model="c", egress=egress)

    refused = await through_catalog(catalogs, mine.id, "check_order", {"id": "A1"})
    assert not refused.success and "destination not allowed" in (refused.error or ""), refused

    assert await egress.allow(mine.id, "127.0.0.1/32", upstream)
    catalogs.invalidate(mine.id)
    ok = await through_catalog(catalogs, mine.id, "check_order", {"id": "A1"})
    assert ok.success and json.loads(ok.content) == {"order": "A1", "status": "shipped"}, ok
    other = await through_catalog(catalogs, theirs.id, "check_order", {"id": "A1"})  # the other tenant: still refused
    assert not other.success and "destination not allowed" in (other.error or "")

    await egress.revoke(mine.id, "127.0.0.1/32", upstream)
    assert await egress.allow(mine.id, "127.0.0.1/32", upstream + 1)  # another port only
    catalogs.invalidate(mine.id)
    wrong_port = await through_catalog(catalogs, mine.id, "check_order", {"id": "A1"})
    assert not wrong_port.success and "destination not allowed" in (wrong_port.error or "")


async def test_the_gateway_checks_a_tenants_urls_with_its_allowances_and_the_report_lists_them(pool, make_tenant):
    (mine, key), (_, other_key) = await make_tenant("egress-gw"), await make_tenant("egress-gw-other")
    await EgressRepo(pool).allow(mine.id, "10.20.0.0/16", 8443)
    deps = repo_deps(pool, egress=EgressRepo(pool))

    async def contract(tenant_id: str) -> dict:
        return {"tenant_id": tenant_id, "tools": []}

    deps.contract = contract
    body = {"name": "erp_lookup", "description": "Look up in the ERP.", "parameters": {},
            "webhook_url": "https://10.20.0.5:8443/lookup"}
    async with TestClient(TestServer(build_app(deps), host="127.0.0.1")) as client:
        r = await client.post("/v1/tools", headers={"Authorization": f"Bearer {other_key.api_key}"}, json=body)
        refused = await problem_of(r, 422)  # the other tenant: the guard's answer
        assert "webhook_url" in refused and "private" in refused, refused
        r = await client.post("/v1/tools", headers={"Authorization": f"Bearer {key.api_key}"}, json=body)
        assert r.status == 201, await r.text()
        r = await client.post("/v1/tools", headers={"Authorization": f"Bearer {key.api_key}"},
                              json={**body, "name": "erp_other_port", "webhook_url": "https://10.20.0.5:9000/x"})
        assert "private" in await problem_of(r, 422)  # allowed on 8443 only
        report = await (await client.get("/v1/tools/contract", headers={"Authorization": f"Bearer {key.api_key}"})).json()
        assert report["egress"] == [{"entry": "10.20.0.0/16", "port": 8443}]
        theirs_report = await (await client.get("/v1/tools/contract",
                                                headers={"Authorization": f"Bearer {other_key.api_key}"})).json()
        assert theirs_report["egress"] == []


async def cli(url: str, *args: str):
    return await asyncio.to_thread(run_cli, "tenant", *args, env={"DATABASE_URL": url})


async def test_operators_grant_list_and_revoke_allowances_with_the_cli(fresh_db):
    url = await fresh_db()
    assert (await cli(url, "create", "acme")).returncode == 0
    granted = await cli(url, "allow-egress", "acme", "ERP.Internal.", "--port", "8443")
    assert granted.returncode == 0, granted.stderr
    assert json.loads(granted.stdout) | {"tenant_id": None} == {
        "tenant_id": None, "name": "acme", "entry": "erp.internal", "port": 8443, "allowed": True, "changed": True}
    assert (await cli(url, "allow-egress", "acme", "10.20.0.0/16")).returncode == 0
    listed = json.loads((await cli(url, "egress", "acme")).stdout)
    assert listed["egress"] == [{"entry": "10.20.0.0/16", "port": 0}, {"entry": "erp.internal", "port": 8443}]

    bad = await cli(url, "allow-egress", "acme", "10.20.0.1/16")
    assert bad.returncode == 2 and "has host bits set" in bad.stderr and "10.20.0.0/16" in bad.stderr
    bad = await cli(url, "allow-egress", "acme", "not a host")
    assert bad.returncode == 2 and "neither a CIDR" in bad.stderr
    assert (await cli(url, "allow-egress", "acme", "x.example", "--port", "70000")).returncode == 2

    assert (await cli(url, "revoke-egress", "acme", "erp.internal", "--port", "8443")).returncode == 0
    missing = await cli(url, "revoke-egress", "acme", "erp.internal", "--port", "8443")
    assert missing.returncode == 2 and "holds no egress allowance 'erp.internal' on port 8443" in missing.stderr
    pool = await create_pool(url, max_size=1)
    try:
        tenant = await TenantRepo(pool).get_by_name("acme")
        assert [(a.entry, a.port) for a in await EgressRepo(pool).list(tenant.id)] == [("10.20.0.0/16", 0)]
    finally:
        await pool.close()


@pytest.mark.parametrize("entry", ["10.0.0.1/0", "169.254.0.1/16"])
def test_a_tenant_policy_parses_its_allowances_strictly(entry):
    from kernel.errors import ConfigError

    with pytest.raises(ConfigError, match="host bits set"):
        DestinationPolicy().for_tenant([(entry, 0)])


@pytest.fixture(scope="module")
def shop_mcp():
    with serving(ShopMcpServer(token=None, allowed_hosts=["127.0.0.2:*"])) as server:
        yield server


async def test_an_allowance_opens_an_mcp_server_to_one_tenant(pool, make_tenant, shop_mcp):
    # the guard refuses loopback (no CE_WEBHOOK_ALLOW here): only an allowance lets a tenant list it
    (mine, _), (theirs, _) = await make_tenant("egress-mcp-mine"), await make_tenant("egress-mcp-theirs")
    servers, egress = McpServerRepo(pool), EgressRepo(pool)
    for tenant in (mine, theirs):
        await servers.create(McpServerRecord(tenant_id=tenant.id, name="shop", url=shop_mcp.url))
    source = McpCatalogSource(servers, McpHttpClient(policy=DestinationPolicy()), secret_box=None, egress=egress)

    refused = await source.load(mine.id)
    assert refused.tools == [] and "could not be listed" in next(iter(refused.problems.values()))

    port = yarl.URL(shop_mcp.url).port
    assert await egress.allow(mine.id, "127.0.0.2/32", port)
    listed = await source.load(mine.id)
    assert {t.name for t in listed.tools} >= {"shop__lookup_order"} and listed.problems == {}, listed.problems
    other = await source.load(theirs.id)  # the other tenant: still refused
    assert other.tools == [] and other.problems


async def test_the_gateway_checks_a_tenants_mcp_server_url_with_its_allowances(pool, make_tenant):
    (mine, key), (_, other_key) = await make_tenant("egress-mcp-gw"), await make_tenant("egress-mcp-gw-other")
    await EgressRepo(pool).allow(mine.id, "10.20.0.0/16", 8443)
    body = {"name": "erp", "url": "https://10.20.0.5:8443/mcp"}
    async with TestClient(TestServer(build_app(repo_deps(pool, egress=EgressRepo(pool))), host="127.0.0.1")) as client:
        r = await client.post("/v1/mcp-servers", headers={"Authorization": f"Bearer {other_key.api_key}"}, json=body)
        assert "private" in await problem_of(r, 422)
        r = await client.post("/v1/mcp-servers", headers={"Authorization": f"Bearer {key.api_key}"}, json=body)
        assert r.status == 201, await r.text()


async def test_the_gateway_checks_a_tenants_notification_webhook_with_its_allowances(pool, make_tenant):
    (mine, key), (_, other_key) = await make_tenant("egress-notify"), await make_tenant("egress-notify-other")
    await EgressRepo(pool).allow(mine.id, "10.20.0.0/16", 8443)
    body = {"notification_webhook": "https://10.20.0.5:8443/events"}
    async with TestClient(TestServer(build_app(repo_deps(pool, egress=EgressRepo(pool))), host="127.0.0.1")) as client:
        r = await client.put("/v1/bot-config", headers={"Authorization": f"Bearer {other_key.api_key}"}, json=body)
        assert "notification_webhook" in await problem_of(r, 422)
        r = await client.put("/v1/bot-config", headers={"Authorization": f"Bearer {key.api_key}"}, json=body)
        assert r.status == 200, await r.text()
