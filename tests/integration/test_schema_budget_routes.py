"""Schema work within budget through the admin API and a host's catalog, over the real Postgres
and the real worker process (issue 39): the issue's 240 KB schema is a 422 before any check, a
large schema is checked off the event loop and never again for the same content, and a catalog
loaded again compiles nothing it already knows."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer

from actors.catalogs import TenantCatalogs
from services.gateway.app import build_app
from services.tools import validation
from services.tools.registry import HandlerRegistry
from storage.repos import BotConfigRepo, ToolRepo
from storage.repos.jobs import JobRepo
from tests.support.gateways import repo_deps
from tests.support.offload_spy import spy_on_offload


@pytest_asyncio.fixture
async def gw(pool, make_tenant) -> AsyncIterator[tuple[TestClient, dict[str, str]]]:
    deps = repo_deps(pool, jobs=JobRepo(pool))
    _, key = await make_tenant("schema-budget")
    async with TestClient(TestServer(build_app(deps), host="127.0.0.1")) as client:
        yield client, {"Authorization": f"Bearer {key.api_key}"}


@pytest.fixture
def offloaded(monkeypatch) -> list[str]:
    """What went to the (real) worker process; a schema's check never runs in this one."""
    sent = spy_on_offload(monkeypatch)

    def here(*args, **kwargs):
        raise AssertionError("a large schema was checked on the serving process's loop")

    real_check = validation._check

    def small_only(schema, *args, **kwargs):
        if len(str(schema)) > 2_000:
            here()
        return real_check(schema, *args, **kwargs)

    monkeypatch.setattr(validation, "_check", small_only)
    return sent


def wide(properties: int, tag: str) -> dict:
    return {"type": "object", "properties": {f"{tag}{i}": {"type": "string", "description": f"field {i} of {tag}"}
                                             for i in range(properties)}}


def tool(name: str, parameters: dict) -> dict:
    return {"name": name, "description": "Looks things up.", "webhook_url": "https://shop.example/x",
            "parameters": parameters}


async def test_the_issues_giant_schema_is_a_422_before_any_check(gw, offloaded):
    client, headers = gw
    giant = {"type": "object", "properties": {"a": {"anyOf": [{}] * 60_000}}}  # 180 KB: under the body cap
    r = await client.post("/v1/tools", headers=headers, json=tool("giant", giant))
    problem = await r.json()
    assert r.status == 422, problem
    assert "more than the 65,536 allowed" in problem["detail"] and "at `$.parameters`" in problem["detail"]
    r = await client.put("/v1/forms/giant", headers=headers, json={"type": "object", "anyOf": [{}] * 1_500})
    problem = await r.json()
    assert r.status == 422 and "more than 1,000 subschemas" in problem["detail"], problem
    assert offloaded == []  # refused by their measure alone


async def test_a_large_tool_schema_is_checked_off_the_loop_once(gw, offloaded):
    client, headers = gw
    parameters = wide(60, "lookup")
    r = await client.post("/v1/tools", headers=headers, json=tool("wide_lookup", parameters))
    assert r.status == 201, await r.text()
    assert offloaded == ["schema_verdicts"]
    r = await client.patch("/v1/tools/wide_lookup", headers=headers, json={"description": "Looks more things up."})
    assert r.status == 200, await r.text()
    assert offloaded == ["schema_verdicts"]  # the same schema: its verdict was kept

    broken = wide(60, "broken")
    broken["properties"]["broken9"] = {"type": "strin"}
    r = await client.post("/v1/tools", headers=headers, json=tool("broken_lookup", broken))
    problem = await r.json()
    assert r.status == 422 and "at `$.parameters.properties.broken9.type`" in problem["detail"], problem


async def test_forms_are_checked_off_the_loop_when_saved_and_never_again_when_listed(gw, offloaded):
    client, headers = gw
    form = wide(40, "answer")
    assert (await client.put("/v1/forms/long_survey", headers=headers, json=form)).status == 200
    assert offloaded == ["schema_verdicts"]
    for _ in range(3):
        listed = await (await client.get("/v1/forms", headers=headers)).json()
        assert [f["name"] for f in listed["forms"]] == ["long_survey"] and "problems" not in listed["forms"][0]
        assert (await client.get("/v1/forms/long_survey", headers=headers)).status == 200
    assert offloaded == ["schema_verdicts"]


async def test_a_catalog_with_a_large_schema_loads_off_the_loop_and_again_without_checks(pool, make_tenant, offloaded):
    tenant, _ = await make_tenant("schema-budget-catalog")
    tools, configs = ToolRepo(pool), BotConfigRepo(pool)
    await tools.create(tenant.id, "wide_search", "webhook", {
        "description": "Search.", "webhook_url": "https://shop.example/search", "parameters": wide(50, "search"),
        "output_schema": wide(45, "found"),
    })

    async def no_builtins(tenant_id: str) -> tuple:
        return ()

    catalogs = TenantCatalogs(tools=tools, configs=configs, registry=HandlerRegistry(), backend_for=lambda c: None,
                              builtins=no_builtins, llm=None, executor=None, main_model="m", cheap_model="c")
    env = await catalogs.env_for(tenant.id)
    assert env.catalog.problems == {"wide_search": "no webhook client is configured"}
    assert offloaded == ["schema_verdicts"]  # parameters and output schema, in one task
    catalogs.invalidate(tenant.id)
    await catalogs.env_for(tenant.id)
    assert offloaded == ["schema_verdicts"]
