"""Per-tenant caps on what a tenant registers (tools, MCP servers), through the gateway's real
HTTP routes on loopback with the real Postgres repositories; only the SessionRouter port is a
fake (no turn runs here).

The caps are monkeypatched down to LIMIT so each test fills a registry in a few requests; the
check and the insert are the production ones (storage.repos.quotas). Each test runs for both
kinds of registration: a tool (POST /v1/tools) and an MCP server (POST /v1/mcp-servers).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer

import storage.repos.mcp_servers as mcp_servers_repo
import storage.repos.tools as tools_repo
from services.gateway.app import build_app
from services.gateway.common import GatewayDeps
from services.tools.crypto import SecretBox, generate_key
from storage.repos import BotConfigRepo, SessionRepo, TenantRepo, ToolCallRepo, ToolRepo
from tests.support.gateways import FakeRouter, problem_of

LIMIT = 3


@dataclass(frozen=True)
class Kind:
    """One kind of registration as the API has it."""

    id: str
    path: str  # the collection: POST creates, GET lists
    listed: str  # the list body's key
    many: str  # as the refusal names them
    delete_hint: str  # what the refusal tells the admin to do
    change: dict[str, Any]  # a PATCH body that changes an existing one

    def body(self, name: str) -> dict[str, Any]:
        if self.id == "tool":
            return {"name": name, "description": "Look up an order.", "parameters": {},
                    "webhook_url": "https://shop.example.com/api/orders"}
        return {"name": name, "url": "https://mcp.example.com/mcp"}


TOOL = Kind(id="tool", path="/v1/tools", listed="tools", many="tools",
            delete_hint="DELETE /v1/tools/{name}", change={"description": "Look up an order by number."})
MCP = Kind(id="mcp", path="/v1/mcp-servers", listed="mcp_servers", many="mcp servers",
           delete_hint="DELETE /v1/mcp-servers/{name}", change={"enabled": False, "timeout_ms": 2000})
KINDS = pytest.mark.parametrize("kind", [TOOL, MCP], ids=lambda k: k.id)


@pytest.fixture(autouse=True)
def small_caps(monkeypatch):
    monkeypatch.setattr(tools_repo, "MAX_TOOLS_PER_TENANT", LIMIT)
    monkeypatch.setattr(mcp_servers_repo, "MAX_SERVERS_PER_TENANT", LIMIT)


@pytest_asyncio.fixture
async def client(pool) -> AsyncIterator[TestClient]:
    deps = GatewayDeps(router=FakeRouter(), tenants=TenantRepo(pool), tools=ToolRepo(pool), calls=ToolCallRepo(pool),
                       sessions=SessionRepo(pool), configs=BotConfigRepo(pool), secret_box=SecretBox([generate_key()]))
    async with TestClient(TestServer(build_app(deps), host="127.0.0.1")) as c:
        yield c


@pytest_asyncio.fixture
async def headers(make_tenant) -> dict[str, str]:
    _, key = await make_tenant("quota")
    return {"Authorization": f"Bearer {key.api_key}"}


async def fill(client: TestClient, headers: dict[str, str], kind: Kind, n: int = LIMIT) -> list[str]:
    names = [f"full{i}" for i in range(n)]
    for name in names:
        r = await client.post(kind.path, headers=headers, json=kind.body(name))
        assert r.status == 201, await r.text()
    return names


async def names_of(client: TestClient, headers: dict[str, str], kind: Kind) -> list[str]:
    r = await client.get(kind.path, headers=headers)
    assert r.status == 200
    return sorted(t["name"] for t in (await r.json())[kind.listed])


async def assert_limit_reached(resp, kind: Kind) -> None:
    """A 409 problem of its own type, naming the cap and saying what to do."""
    detail = await problem_of(resp, 409)
    body = json.loads(await resp.text())
    assert body["title"] == "Limit reached" and body["type"].endswith("/limit-reached")
    assert f"a tenant may register at most {LIMIT} {kind.many} and this one has {LIMIT}" in detail
    assert kind.delete_hint in detail


@KINDS
async def test_a_create_beyond_the_cap_is_refused_with_409_naming_the_limit(client, headers, kind):
    names = await fill(client, headers, kind)
    r = await client.post(kind.path, headers=headers, json=kind.body("onemore"))
    await assert_limit_reached(r, kind)
    assert await names_of(client, headers, kind) == names  # nothing was stored


@KINDS
async def test_one_that_exists_can_still_be_changed_at_the_cap(client, headers, kind):
    names = await fill(client, headers, kind)
    r = await client.patch(f"{kind.path}/{names[0]}", headers=headers, json=kind.change)
    assert r.status == 200, await r.text()
    changed = await (await client.get(f"{kind.path}/{names[0]}", headers=headers)).json()
    assert {k: changed[k] for k in kind.change} == kind.change
    if kind is TOOL:
        assert changed["version"] == 2
        r = await client.post(f"/v1/tools/{names[0]}/versions/1/publish", headers=headers)
        assert r.status == 200 and (await r.json())["version"] == 1  # a rollback is no creation either


@KINDS
async def test_a_duplicate_name_at_the_cap_is_still_the_duplicate_conflict(client, headers, kind):
    names = await fill(client, headers, kind)
    r = await client.post(kind.path, headers=headers, json=kind.body(names[0]))
    detail = await problem_of(r, 409)
    assert json.loads(await r.text())["title"] == "Conflict" and "already" in detail and "limit" not in detail


@KINDS
async def test_a_delete_makes_room_for_one_create(client, headers, kind):
    names = await fill(client, headers, kind)
    r = await client.delete(f"{kind.path}/{names[0]}", headers=headers)
    assert r.status == 204
    r = await client.post(kind.path, headers=headers, json=kind.body("replacement"))
    assert r.status == 201, await r.text()
    await assert_limit_reached(await client.post(kind.path, headers=headers, json=kind.body("onemore")), kind)
    assert await names_of(client, headers, kind) == sorted([*names[1:], "replacement"])


@KINDS
async def test_concurrent_creates_for_the_last_slot_let_exactly_one_in(client, headers, kind):
    # as two gateways would: separate requests on separate pooled connections, all at once
    await fill(client, headers, kind, LIMIT - 1)
    responses = await asyncio.gather(*(client.post(kind.path, headers=headers, json=kind.body(f"race{i}"))
                                       for i in range(6)))
    assert sorted(r.status for r in responses) == [201, 409, 409, 409, 409, 409]
    for r in responses:
        if r.status == 409:
            await assert_limit_reached(r, kind)
    assert len(await names_of(client, headers, kind)) == LIMIT


@KINDS
async def test_the_cap_is_per_tenant(client, headers, make_tenant, kind):
    await fill(client, headers, kind)
    _, other = await make_tenant("quota-other")
    r = await client.post(kind.path, headers={"Authorization": f"Bearer {other.api_key}"}, json=kind.body("full0"))
    assert r.status == 201, await r.text()
