"""Two tool PATCHes at once: each applies to the version the other published, none is lost.

A PATCH reads the live tool, merges its fields into it and stores the result as a new version.
Two admins patching one tool at once both read the same live version; before, the second write
stored its merge of that version, and the first admin's change was gone from the live tool
without a word. Now the write is refused inside its transaction when the live version is not
the one the merge read (`ToolRepo.new_version(based_on=...)`: ToolChanged, a Conflict), and the
gateway merges again onto the new live version. A real aiohttp server on loopback over the real
Postgres repositories; the two PATCHes are held after their reads until both have read.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer

from kernel.records import PublishedTool
from services.gateway.app import build_app
from services.gateway.common import GatewayDeps
from services.gateway.tool_routes import PATCH_ATTEMPTS
from services.tools.crypto import SecretBox, generate_key
from storage.repos import BotConfigRepo, SessionRepo, TenantRepo, ToolCallRepo, ToolRepo
from storage.repos.tools import ToolChanged
from tests.support.gateways import FakeRouter, OriginGateway

TOOL = {"name": "order_status", "description": "Look up an order by its number.",
        "webhook_url": "https://api.shop.example/orders/{order_id}", "parameters": {"order_id": {"type": "string"}}}


class ReadsTogether(ToolRepo):
    """The real repository, whose first `parties` reads of a tool wait until all of them are done:
    the PATCHes making them then write one after the other, each from the same live version."""

    def __init__(self, pool: Any, parties: int) -> None:
        super().__init__(pool)
        self.held = parties
        self.together = asyncio.Barrier(parties)

    async def get(self, tenant_id: str, name: str) -> PublishedTool:
        tool = await super().get(tenant_id, name)
        if self.held > 0:
            self.held -= 1
            await asyncio.wait_for(self.together.wait(), 10)
        return tool


@dataclass
class Gateway(OriginGateway):  # its `call`: one request, (status, the JSON answer)
    tools: ReadsTogether | None = None


@pytest_asyncio.fixture
async def gw(pool, make_tenant) -> AsyncIterator[Gateway]:
    tools, box = ReadsTogether(pool, parties=2), SecretBox([generate_key()])
    deps = GatewayDeps(router=FakeRouter(), tenants=TenantRepo(pool), tools=tools, calls=ToolCallRepo(pool),
                       sessions=SessionRepo(pool), configs=BotConfigRepo(pool), secret_box=box)
    tenant, key = await make_tenant("patches")
    async with TestClient(TestServer(build_app(deps), host="127.0.0.1")) as client:
        gateway = Gateway(client, {"Authorization": f"Bearer {key.api_key}"}, tenant.id, box, pool, tools)
        tools.held = 0  # the tool's creation reads nothing to hold
        status, created = await gateway.call("POST", "/v1/tools", TOOL)
        assert status == 201, created
        tools.held = 2
        yield gateway


async def test_two_patches_at_once_both_reach_the_live_tool(gw: Gateway) -> None:
    first, second = await asyncio.gather(
        gw.call("PATCH", "/v1/tools/order_status", {"description": "Look up an order and its delivery."}),
        gw.call("PATCH", "/v1/tools/order_status", {"timeout_ms": 9000}),
    )
    assert (first[0], second[0]) == (200, 200), (first, second)
    status, live = await gw.call("GET", "/v1/tools/order_status")
    assert status == 200 and live["version"] == 3, live
    # before: one of the two changes was missing here (the later write merged into version 1)
    assert live["description"] == "Look up an order and its delivery." and live["timeout_ms"] == 9000, live
    assert gw.tools.held == 0, "both PATCHes read the same live version before either wrote"


async def test_a_patch_racing_a_rollback_applies_to_the_version_published_last(gw: Gateway) -> None:
    gw.tools.held = 0
    first = (await gw.call("GET", "/v1/tools/order_status"))[1]
    assert first["timeout_ms"] != 7000, first
    status, second = await gw.call("PATCH", "/v1/tools/order_status", {"timeout_ms": 7000})
    assert status == 200 and (second["version"], second["based_on_version"]) == (2, 1), second  # version 2, live
    gw.tools.held = 1
    gw.tools.together = asyncio.Barrier(2)
    patch = asyncio.create_task(gw.call("PATCH", "/v1/tools/order_status", {"description": "Orders, v3."}))

    async def read_by_the_patch() -> None:
        while gw.tools.held:  # the PATCH has read version 2
            await asyncio.sleep(0.01)

    await asyncio.wait_for(read_by_the_patch(), 10)
    assert (await gw.call("POST", "/v1/tools/order_status/versions/1/publish"))[0] == 200  # rolled back to 1
    await asyncio.wait_for(gw.tools.together.wait(), 10)
    status, patched = await asyncio.wait_for(patch, 10)
    assert status == 200, patched
    assert patched["version"] == 3 and patched["based_on_version"] == 1, patched  # the answer says onto what
    live = (await gw.call("GET", "/v1/tools/order_status"))[1]
    # merged onto version 1 (the rollback), not onto version 2 the PATCH first read
    assert live["version"] == 3 and live["description"] == "Orders, v3.", live
    assert live["timeout_ms"] == first["timeout_ms"], live


async def test_the_repository_refuses_a_version_built_on_one_no_longer_live(pool, make_tenant) -> None:
    tenant, _key = await make_tenant("stale")
    repo = ToolRepo(pool)
    await repo.create(tenant.id, "ping", "webhook", {**TOOL, "name": "ping"})
    live = await repo.get(tenant.id, "ping")
    await repo.new_version(tenant.id, "ping", {**TOOL, "name": "ping", "timeout_ms": 5000}, publish=True,
                           based_on=live)
    with pytest.raises(ToolChanged, match=r"tool 'ping' changed while this change was prepared \(version 2 is live"):
        await repo.new_version(tenant.id, "ping", {**TOOL, "name": "ping", "timeout_ms": 6000}, publish=True,
                               based_on=live)
    assert [v.version for v in await repo.versions(tenant.id, "ping")] == [1, 2], "nothing stored"


class ChangedAfterEachRead(ToolRepo):
    """The real repository, where another admin publishes a change right after every read."""

    async def get(self, tenant_id: str, name: str) -> PublishedTool:
        tool = await super().get(tenant_id, name)
        await super().new_version(tenant_id, name, {**tool.definition, "timeout_ms": 1000 + tool.version},
                                  publish=True)
        return tool


async def test_a_patch_the_tool_keeps_changing_under_is_409_and_stores_nothing_of_it(pool, make_tenant) -> None:
    tools = ChangedAfterEachRead(pool)
    deps = GatewayDeps(router=FakeRouter(), tenants=TenantRepo(pool), tools=tools, calls=ToolCallRepo(pool),
                       sessions=SessionRepo(pool), configs=BotConfigRepo(pool), secret_box=SecretBox([generate_key()]))
    tenant, key = await make_tenant("busy")
    await ToolRepo(pool).create(tenant.id, "order_status", "webhook", TOOL)
    async with TestClient(TestServer(build_app(deps), host="127.0.0.1")) as client:
        r = await client.patch("/v1/tools/order_status", headers={"Authorization": f"Bearer {key.api_key}"},
                               json={"description": "Never stored."})
        problem = await r.json()
    assert r.status == 409, problem
    assert "changed while this change was prepared" in problem["detail"] and "send it again" in problem["detail"]
    versions = await ToolRepo(pool).versions(tenant.id, "order_status")
    assert len(versions) == 1 + PATCH_ATTEMPTS, "one change published after each of the PATCH's reads"
    assert all(v.definition["description"] != "Never stored." for v in versions)


async def test_a_version_built_before_the_tool_was_switched_off_is_refused(pool, make_tenant) -> None:
    # the same version stays live when a tool is switched off: a merge of what was read before
    # would publish it switched on again
    tenant, _key = await make_tenant("switched")
    repo = ToolRepo(pool)
    await repo.create(tenant.id, "ping", "webhook", {**TOOL, "name": "ping"})
    live = await repo.get(tenant.id, "ping")
    off = await repo.set_enabled(tenant.id, "ping", False)
    assert off.version == live.version
    with pytest.raises(ToolChanged):
        await repo.new_version(tenant.id, "ping", {**live.definition, "timeout_ms": 6000}, publish=True, based_on=live)
    now = await repo.get(tenant.id, "ping")
    assert now.enabled is False and now.version == live.version
