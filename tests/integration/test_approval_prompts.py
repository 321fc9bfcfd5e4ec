"""A tool's `approval_prompt` through registration: POST/GET/PATCH /v1/tools keep and show it, the
API document lists it, a template no call could fill is a 422 at `$.approval_prompt` storing
nothing, and the stored definition, compiled as a session host compiles it, asks the contact its
question before the held call runs. A real aiohttp server on loopback over real Postgres."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer

from actors.session import handle_message, new_state
from services.gateway.app import build_app
from services.tools.model import ToolDefinition
from services.tools.registry import HandlerRegistry, build_catalog
from storage.repos import ToolRepo
from tests.support import gateways
from tests.support.fakes import FakeToolBackend
from tests.support.turns import ScriptedLLM, env_for

TOOL = {"name": "book_visit", "description": "Book a visit. Use when the customer picks a slot.",
        "type": "webhook", "webhook_url": "https://example.com/visits", "mutability": "write",
        "parameters": {"service": {"type": "string"}, "start": {"type": "string"}, "card": {"type": "string"}},
        "sensitive": ["card"], "approval_prompt": "Book {service} on {start}?"}
#: what a view carries that a PATCH body does not take
NOT_PATCHED = {"auth_header_set", "version", "published", "based_on_version", "created_at", "updated_at", "name",
               "type"}


@pytest_asyncio.fixture
async def gateway(pool) -> AsyncIterator[tuple[TestClient, dict[str, str], str]]:
    deps, key = await gateways.scripted_deps(pool, gateways.ScriptedRouter())
    async with TestClient(TestServer(build_app(deps), host="127.0.0.1")) as client:
        yield client, {"Authorization": f"Bearer {key.api_key}"}, key.tenant_id


async def test_a_registered_approval_prompt_is_shown_and_is_what_the_contact_is_asked(gateway, pool):
    client, headers, tenant_id = gateway
    created = await client.post("/v1/tools", headers=headers, json=TOOL)
    assert created.status == 201, await created.text()
    assert (await created.json())["approval_prompt"] == "Book {service} on {start}?"
    got = await client.get("/v1/tools/book_visit", headers=headers)
    assert (await got.json())["approval_prompt"] == "Book {service} on {start}?"
    # the stored definition, compiled as a host compiles it: the held turn asks the template's question
    row = await ToolRepo(pool).get(tenant_id, "book_visit")
    catalog_tool = (msgspec.convert(row.definition, ToolDefinition), row.version)
    backend = FakeToolBackend()
    env = env_for(ScriptedLLM([[("book_visit", {"service": "cut", "start": "2026-12-08T10:00", "card": "4111"})]]),
                  HandlerRegistry(), [])
    env = msgspec.structs.replace(env, catalog=build_catalog([], [catalog_tool], registry=HandlerRegistry(),
                                                              backend=backend))
    held = await handle_message(new_state(tenant_id, "s1"), "book me in", "m1", env)
    assert held.pending_approval is not None and backend.calls == []
    assert held.pending_approval.summary == ["Book cut on 2026-12-08T10:00?"]
    assert held.reply == "Before I go ahead, please confirm:\n- Book cut on 2026-12-08T10:00?"
    assert "Use when" not in held.reply and "4111" not in held.reply  # never the description, nor a sensitive value


async def test_the_api_document_lists_approval_prompt_for_create_and_patch(gateway):
    client, _headers, _ = gateway
    doc = await (await client.get("/openapi.json")).json()
    schemas = doc["components"]["schemas"]
    assert "approval_prompt" in schemas["ToolCreate"]["properties"]
    assert "approval_prompt" in schemas["ToolPatch"]["properties"]


async def test_a_template_naming_no_parameter_is_a_422_at_the_field_and_stores_nothing(gateway):
    client, headers, _ = gateway
    bad = await client.post("/v1/tools", headers=headers, json={**TOOL, "approval_prompt": "Book {servce}?"})
    detail = await gateways.problem_of(bad, 422)
    assert "approval_prompt uses {servce}, but parameters has no 'servce'" in detail
    assert "name one of the parameters, or take {servce} out" in detail and "`$.approval_prompt`" in detail
    assert (await client.get("/v1/tools/book_visit", headers=headers)).status == 404


async def test_a_template_naming_a_sensitive_parameter_is_a_422(gateway):
    client, headers, _ = gateway
    bad = await client.post("/v1/tools", headers=headers, json={**TOOL, "approval_prompt": "Charge {card}?"})
    detail = await gateways.problem_of(bad, 422)
    assert "whose value is never shown to the contact (`sensitive` lists it)" in detail


async def test_patch_changes_and_clears_the_template_and_refuses_one_that_no_longer_fits(gateway):
    client, headers, _ = gateway
    assert (await client.post("/v1/tools", headers=headers, json=TOOL)).status == 201
    changed = await client.patch("/v1/tools/book_visit", headers=headers, json={"approval_prompt": "Book {service}?"})
    assert changed.status == 200 and (await changed.json())["approval_prompt"] == "Book {service}?"
    bad = await client.patch("/v1/tools/book_visit", headers=headers,
                             json={"parameters": {"start": {"type": "string"}}, "sensitive": []})
    assert "approval_prompt uses {service}" in await gateways.problem_of(bad, 422)
    cleared = await client.patch("/v1/tools/book_visit", headers=headers, json={"approval_prompt": None})
    assert cleared.status == 200 and (await cleared.json())["approval_prompt"] is None


async def test_a_tool_stored_before_the_field_shows_it_as_null_and_takes_its_view_back(gateway, pool):
    client, headers, tenant_id = gateway
    old = {k: v for k, v in TOOL.items() if k != "approval_prompt"}
    assert (await client.post("/v1/tools", headers=headers, json=old)).status == 201
    row = await ToolRepo(pool).get(tenant_id, "book_visit")
    legacy = {k: v for k, v in row.definition.items() if k != "approval_prompt"}  # as stored before the field
    await ToolRepo(pool).new_version(tenant_id, "book_visit", legacy, publish=True)
    view = await (await client.get("/v1/tools/book_visit", headers=headers)).json()
    assert view["approval_prompt"] is None
    sent_back = {k: v for k, v in view.items() if k not in NOT_PATCHED}
    back = await client.patch("/v1/tools/book_visit", headers=headers, json=sent_back)
    assert back.status == 200, await back.text()

