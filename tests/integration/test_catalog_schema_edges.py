"""A tenant's catalog and schemas at their edges, over the real Postgres and loopback servers.

- The bot config's backend auth header saved under a key the host no longer holds (CE_SECRET_KEY
  rotated, the old key dropped): the catalog loads, every tool but the backend bindings works,
  and each binding call fails in-band saying an admin must enter the header again; once the
  admin has, the bindings work. Before, the decrypt error escaped the catalog load and every
  message of the tenant failed.
- A form or tool schema whose `$schema` or `$id` is not a string, at any depth, is a 422 naming
  the path; before, jsonschema raised AttributeError inside the check: a 500.
- A form answer that breaks its field's declared format (date-time, time, uri, hostname...) is
  refused and not stored; before, those formats were not checked at all.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from actors.catalogs import TenantCatalogs
from actors.runtime import Runtime
from services.botconfig import botconfig_from_dict
from services.gateway.app import build_app
from services.gateway.common import GatewayDeps
from services.tools.crypto import SecretBox, generate_key
from services.tools.errors import InvalidArguments, ToolError
from services.tools.model import BackendBindingTool
from services.tools.registry import HandlerRegistry
from services.tools.ssrf import DestinationPolicy
from storage.repos import BotConfigRepo, SessionRepo, TenantRepo, ToolCallRepo, ToolRepo
from storage.repos.jobs import JobRepo
from tests.support.builtin_services import ctx, services
from tests.support.catalogs import loopback_runtime, no_builtins, through_catalog
from tests.support.gateways import FakeRouter

OLD_KEY, NEW_KEY = generate_key(), generate_key()
BACKEND_SECRET = "Bearer sk_backend_saved_under_the_old_key"


# --------------------------------------------------------------------------- backend credentials


class Backend:
    """The tenant's systems on loopback: `/orders/{id}` for its webhook tool, `/whoami` for its
    backend binding (answers whether an Authorization header came). Records every request."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str | None]] = []
        self.base = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> Backend:
        async def order(request: web.Request) -> web.Response:
            self.requests.append((request.path, request.headers.get("Authorization")))
            return web.json_response({"order_id": request.match_info["order_id"], "status": "shipped"})

        async def whoami(request: web.Request) -> web.Response:
            self.requests.append((request.path, request.headers.get("Authorization")))
            return web.json_response({"authorized": request.headers.get("Authorization") == BACKEND_SECRET})

        app = web.Application()
        app.router.add_get("/orders/{order_id}", order)
        app.router.add_get("/whoami", whoami)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.base = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@pytest_asyncio.fixture
async def backend() -> AsyncIterator[Backend]:
    server = await Backend().start()
    yield server
    await server.stop()


@pytest_asyncio.fixture
async def runtime() -> AsyncIterator[Runtime]:
    """A host's runtime holding only the new key, its webhook client on loopback only."""
    async with loopback_runtime(DestinationPolicy(allow=("127.0.0.1/32",)), keys=(NEW_KEY,)) as rt:
        yield rt


async def test_a_backend_auth_header_the_keys_no_longer_open_fails_only_the_bindings_in_band(
    pool, make_tenant, backend, runtime,
):
    tenant, _ = await make_tenant("rotated")
    configs, tools = BotConfigRepo(pool), ToolRepo(pool)
    old_box = SecretBox([OLD_KEY])
    await configs.put(tenant.id, {"backend": {"base_url": backend.base,
                                              "auth_header_enc": old_box.encrypt(BACKEND_SECRET)}})
    await tools.create(tenant.id, "check_order", "webhook", {
        "description": "Look up an order.", "webhook_url": backend.base + "/orders/{order_id}",
        "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]},
    })
    await tools.create(tenant.id, "whoami", "backend_binding", {
        "description": "Who the backend thinks we are.", "path": "/whoami",
        "parameters": {"type": "object", "properties": {}},
    })
    catalogs = TenantCatalogs(
        tools=tools, configs=configs, registry=HandlerRegistry(), backend_for=runtime._backend_for,
        builtins=no_builtins, llm=None, executor=None, main_model="m", cheap_model="c",
    )

    env = await catalogs.env_for(tenant.id)  # raised SecretDecryptError before: every message failed
    assert sorted(env.catalog.names()) == ["check_order", "whoami"] and env.catalog.problems == {}
    order = await through_catalog(catalogs, tenant.id, "check_order", {"order_id": "A1"})
    assert order.success and json.loads(order.content)["status"] == "shipped", order
    binding = await through_catalog(catalogs, tenant.id, "whoami", {})
    assert not binding.success
    assert "backend auth header of the bot config cannot be decrypted" in binding.error
    assert "an admin must enter backend.auth_header in the bot config again" in binding.error
    assert "update its backend's credentials" in binding.content  # what the model tells the contact
    assert BACKEND_SECRET not in binding.content and "sk_backend" not in (binding.error or "")
    assert backend.requests == [("/orders/A1", None)]  # nothing went to the backend without its header

    # the admin enters the header again (saved under the current key): the bindings work
    await configs.put(tenant.id, {"backend": {"base_url": backend.base,
                                              "auth_header_enc": runtime.secret_box.encrypt(BACKEND_SECRET)}})
    catalogs.invalidate(tenant.id)
    again = await through_catalog(catalogs, tenant.id, "whoami", {})
    assert again.success and json.loads(again.content) == {"authorized": True}, again


async def test_a_backend_auth_header_on_a_host_without_keys_fails_the_bindings_in_band(backend, runtime):
    """Before, the binding went to the backend without its header (and got a 401 there)."""
    runtime.secret_box = None  # CE_SECRET_KEY unset on this host
    config = botconfig_from_dict({"backend": {"base_url": backend.base,
                                              "auth_header_enc": SecretBox([OLD_KEY]).encrypt("x")}})
    tool_backend = runtime._backend_for(config)
    tool = BackendBindingTool(name="whoami", description="d", path="/whoami",
                              parameters={"type": "object", "properties": {}})
    with pytest.raises(ToolError, match="no CE_SECRET_KEY is set on this host") as info:
        await tool_backend.call_binding(tool, {}, ctx=ctx("t1"), timeout_s=1.0, idempotency_key=None)
    assert info.value.tool_name == "whoami" and backend.requests == []


# --------------------------------------------------------------------------- schemas through the API


@pytest_asyncio.fixture
async def gw(pool, make_tenant) -> AsyncIterator[tuple[TestClient, dict[str, str]]]:
    deps = GatewayDeps(router=FakeRouter(), tenants=TenantRepo(pool), tools=ToolRepo(pool), calls=ToolCallRepo(pool),
                       sessions=SessionRepo(pool), configs=BotConfigRepo(pool), secret_box=SecretBox([generate_key()]),
                       jobs=JobRepo(pool))
    _, key = await make_tenant("schema-edges")
    async with TestClient(TestServer(build_app(deps), host="127.0.0.1")) as client:
        yield client, {"Authorization": f"Bearer {key.api_key}"}


OBJECT = {"type": "object", "properties": {"a": {"type": "string"}}}


@pytest.mark.parametrize("schema,path", [
    ({**OBJECT, "$schema": 5}, "$.$schema"),
    ({**OBJECT, "$schema": ["x"]}, "$.$schema"),
    ({**OBJECT, "$id": 5}, "$.$id"),
    ({**OBJECT, "$id": {"x": 1}}, "$.$id"),
    ({"type": "object", "properties": {"a": {"$id": 5}}, "$ref": "#/properties/a"}, "$.properties.a.$id"),
    ({"type": "object", "properties": {"a": {"$schema": None}}}, "$.properties.a.$schema"),
])
async def test_put_form_with_a_non_string_schema_or_id_is_a_422_naming_the_path(gw, schema, path):
    client, headers = gw
    r = await client.put("/v1/forms/probe", headers=headers, json=schema)
    problem = await r.json()
    assert r.status == 422, problem
    assert "must be a string" in problem["detail"] and f"at `{path}`" in problem["detail"], problem
    assert (await client.get("/v1/forms/probe", headers=headers)).status == 404  # nothing was saved


@pytest.mark.parametrize("field,schema,path", [
    ("parameters", {**OBJECT, "$schema": 5}, "$.parameters.$schema"),
    ("parameters", {**OBJECT, "$id": 5}, "$.parameters.$id"),
    ("parameters", {**OBJECT, "$defs": {"d": {"$id": []}}}, "$.parameters.$defs.d.$id"),
    ("output_schema", {"type": "object", "$id": 5}, "$.output_schema.$id"),
])
async def test_post_tool_with_a_non_string_schema_or_id_is_a_422_naming_the_path(gw, field, schema, path):
    client, headers = gw
    body = {"name": "probe_tool", "description": "d", "webhook_url": "https://shop.example/x", "parameters": OBJECT}
    r = await client.post("/v1/tools", headers=headers, json={**body, field: schema})
    problem = await r.json()
    assert r.status == 422, problem
    assert "must be a string" in problem["detail"] and f"at `{path}`" in problem["detail"], problem


# --------------------------------------------------------------------------- form answers and formats

FORM = {"type": "object", "required": ["name"], "properties": {
    "name": {"type": "string"},
    "callback_at": {"type": "string", "format": "date-time"},
    "best_time": {"type": "string", "format": "time"},
    "website": {"type": "string", "format": "uri"},
    "domain": {"type": "string", "format": "hostname"},
    "how_long": {"type": "string", "format": "duration"},
}}


@pytest.mark.parametrize("field,value", [
    ("callback_at", "next tuesday, after lunch"),
    ("callback_at", "2026-07-01T25:00:00Z"),
    ("best_time", "25:61"),
    ("website", "not a url at all"),
    ("domain", "-not a host-"),
    ("how_long", "a couple of weeks"),
])
async def test_a_form_answer_that_breaks_its_declared_format_is_refused_and_not_stored(pool, make_tenant, field, value):
    tenant, _ = await make_tenant("form-format")
    async with services(pool) as (svc, _):
        await svc.repos.forms.put(tenant.id, "callback", FORM)
        with pytest.raises(InvalidArguments, match=f"'{field}': the value is not a valid") as info:
            await svc.forms.submit({"form": "callback", "data": {"name": "Ann", field: value}}, ctx(tenant.id))
        assert value not in str(info.value)  # the contact's answer is never repeated
        assert await svc.repos.forms.submissions(tenant.id, "callback") == []
        ok = {"name": "Ann", "callback_at": "2026-07-01T09:30:00Z", "best_time": "09:30:00Z",
              "website": "https://shop.example", "domain": "shop.example", "how_long": "P2W"}
        await svc.forms.submit({"form": "callback", "data": ok}, ctx(tenant.id))
        assert [s.data for s in await svc.repos.forms.submissions(tenant.id, "callback")] == [ok]


async def test_a_form_saved_before_formats_were_checked_lists_its_problem_until_fixed(gw, pool):
    # An older gateway stored `"format": "phone"` (checked nowhere: any answer was stored); the
    # form keeps working as saved, and GET says what a PUT today would refuse, and how to fix it.
    client, headers = gw
    good = {"type": "object", "properties": {"phone": {"type": "string", "pattern": "^[+0-9 ]{6,20}$"}}}
    assert (await client.put("/v1/forms/legacy_quote", headers=headers, json=good)).status == 200
    legacy = {"type": "object", "properties": {"phone": {"type": "string", "format": "phone"}}}
    await pool.execute("UPDATE ce_forms SET schema = $1 WHERE name = 'legacy_quote'", legacy)

    form = await (await client.get("/v1/forms/legacy_quote", headers=headers)).json()
    assert form["schema"] == legacy and len(form["problems"]) == 1, form
    assert "format 'phone' is not a format this engine checks; use a `pattern` for it" in form["problems"][0]
    assert "`$.properties.phone.format`" in form["problems"][0] and "PUT the form again" in form["problems"][0]
    listed = (await (await client.get("/v1/forms", headers=headers)).json())["forms"]
    assert [f["problems"] for f in listed] == [form["problems"]]

    assert (await client.put("/v1/forms/legacy_quote", headers=headers, json=good)).status == 200
    fixed = await (await client.get("/v1/forms/legacy_quote", headers=headers)).json()
    assert "problems" not in fixed and fixed["schema"] == good
