"""A parameter named by another spelling of a tenant/account key (`AccountId`, `account-id`,
`TENANT_ID`), end to end: the real gateway on loopback over real Postgres repositories, a loopback
upstream for the webhook, and a session turn with a scripted model.

The executor hides such a name from the model and strips the model's value for it, but the trusted
scope holds the exact spellings only (`account_id`, `accountId`, `tenant_id`, `tenantId`), as it
does for URL holes and a binding's `scope`: nothing ever fills it. So registration refuses it
(422 naming the parameter and the spellings that are filled); a row stored before that is found
by the contract report, and its calls fail in-band as the business's misconfiguration.

Safety as in test_tool_path_edges: the upstream binds 127.0.0.1, its host name resolves through
MapResolver only, and the webhook client's sockets refuse any non-loopback connect.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from actors.session import TurnEnv, handle_message, new_state
from services.botconfig import BotConfig
from services.contract import build_report
from services.gateway.app import build_app
from services.gateway.common import GatewayDeps
from services.tools.crypto import SecretBox, generate_key
from services.tools.executor import Executor
from services.tools.model import ToolDefinition
from services.tools.registry import Catalog, HandlerRegistry, build_catalog
from services.tools.ssrf import DestinationPolicy
from services.tools.webhook import WebhookClient, WebhookToolBackend
from storage.repos import BotConfigRepo, SessionRepo, TenantRepo, ToolCallRepo, ToolRepo
from tests.support.net_fakes import LoopbackApp, LoopbackOnlySockets, MapResolver
from tests.support.turns import ScriptedLLM


class Upstream(LoopbackApp):
    """A loopback webhook that records each request's path and answers `{"ok": true}`."""

    def __init__(self) -> None:
        super().__init__()
        self.paths: list[str] = []

    async def start(self) -> Upstream:
        async def handle(request: web.Request) -> web.Response:
            self.paths.append(request.path_qs)
            return web.json_response({"ok": True})

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        await self.serve(app)
        return self


@pytest_asyncio.fixture
async def upstream() -> AsyncIterator[Upstream]:
    server = await Upstream().start()
    try:
        yield server
    finally:
        await server.stop()


@pytest_asyncio.fixture
async def webhooks() -> AsyncIterator[WebhookClient]:
    sockets = LoopbackOnlySockets()
    client = WebhookClient(policy=DestinationPolicy(allow=("127.0.0.1/32",)),
                           resolver=MapResolver({"api.test": ["127.0.0.1"]}), socket_factory=sockets)
    await client.start()
    try:
        yield client
    finally:
        await client.close()
    assert sockets.refused == [], "a client tried to connect off loopback"


class Api:
    """The gateway's real routes and repositories for one new tenant; the contract report is
    made as actors.runtime.Runtime.contract_report makes it, from the tenant's published rows."""

    def __init__(self, client: TestClient, pool, tenant_id: str, api_key: str, webhooks: WebhookClient) -> None:
        self.client = client
        self.pool = pool
        self.tenant_id = tenant_id
        self.headers = {"Authorization": f"Bearer {api_key}"}
        self.webhooks = webhooks

    async def call(self, method: str, path: str, body: Any = None) -> tuple[int, dict[str, Any]]:
        async with self.client.request(method, path, headers=self.headers, json=body) as r:
            return r.status, json.loads(await r.text())

    async def catalog(self) -> tuple[list[tuple[ToolDefinition, int]], Catalog]:
        rows = await ToolRepo(self.pool).list_published(self.tenant_id)
        published = [(msgspec.convert(row.definition, ToolDefinition), row.version) for row in rows]
        catalog = build_catalog([], published, registry=HandlerRegistry(),
                                backend=WebhookToolBackend(self.webhooks, secret_box=None))
        return published, catalog


@pytest_asyncio.fixture
async def api(pool, make_tenant, webhooks) -> AsyncIterator[Api]:
    tenant, key = await make_tenant("spellings")
    holder: dict[str, Api] = {}

    async def contract(tenant_id: str) -> dict:
        published, catalog = await holder["api"].catalog()
        return msgspec.to_builtins(build_report(tenant_id, published, catalog, BotConfig()))

    deps = GatewayDeps(router=None, tenants=TenantRepo(pool), tools=ToolRepo(pool), calls=ToolCallRepo(pool),
                       sessions=SessionRepo(pool), configs=BotConfigRepo(pool), secret_box=SecretBox([generate_key()]),
                       contract=contract)
    async with TestClient(TestServer(build_app(deps), host="127.0.0.1")) as client:
        holder["api"] = Api(client, pool, tenant.id, key.api_key, webhooks)
        yield holder["api"]


def lookup_body(parameter: str, **fields: Any) -> dict[str, Any]:
    body = {"name": "lookup_order", "description": "Look up an order.",
            "webhook_url": "https://shop.example/orders/{order_id}",
            "parameters": {"order_id": {"type": "string"}, parameter: {"type": "string"}}}
    body.update(fields)
    return body


@pytest.mark.parametrize(("spelling", "held"), [
    ("AccountId", "'account_id' or 'accountId'"),
    ("account-id", "'account_id' or 'accountId'"),
    ("TENANT_ID", "'tenant_id' or 'tenantId'"),
])
async def test_a_tool_saved_with_a_parameter_spelling_a_tenant_key_another_way_is_refused_and_not_stored(
    api: Api, spelling: str, held: str,
) -> None:
    # before: 201, and the model was never offered it nor was it ever filled
    status, problem = await api.call("POST", "/v1/tools", lookup_body(spelling))
    assert status == 422, problem
    assert problem["detail"].startswith(f"parameters declares '{spelling}', another spelling of a protected key")
    assert f"rename it to {held}" in problem["detail"] and problem["detail"].endswith("- at `$.parameters`")
    assert (await api.call("GET", "/v1/tools/lookup_order"))[0] == 404

    status, created = await api.call("POST", "/v1/tools", lookup_body("accountId"))
    assert status == 201 and "accountId" in created["parameters"]["properties"]
    # nor can a change bring one in later
    status, problem = await api.call("PATCH", "/v1/tools/lookup_order", {"parameters": {
        "order_id": {"type": "string"}, spelling: {"type": "string"}}})
    assert status == 422 and f"'{spelling}'" in problem["detail"]
    assert (await api.call("GET", "/v1/tools/lookup_order"))[1]["version"] == 1


async def test_a_binding_saved_with_a_path_hole_spelling_a_tenant_key_another_way_is_refused(api: Api) -> None:
    # before: 201 (the rename onto it counted as filling it), and every call went out without it
    status, problem = await api.call("POST", "/v1/tools", {
        "name": "list_orders", "type": "backend_binding", "description": "List an account's orders.",
        "path": "/accounts/{AccountId}/orders", "parameters": {"acct": {"type": "string"}},
        "parameter_map": {"acct": "AccountId"}})
    assert status == 422, problem
    assert "the path uses {AccountId}, another spelling of a protected key" in problem["detail"]
    assert "write the hole as {account_id} or {accountId} and list that key in `scope`" in problem["detail"]


async def test_a_binding_renaming_a_parameter_onto_the_account_key_is_refused_at_save_and_by_patch(api: Api) -> None:
    # before: 201, and every call dropped the model's value (only `scope` sends the tenant's id)
    tool = {"name": "list_orders", "type": "backend_binding", "description": "List an account's orders.",
            "path": "/orders", "parameters": {"acct": {"type": "string"}, "q": {"type": "string"}}}
    status, problem = await api.call("POST", "/v1/tools", {**tool, "parameter_map": {"acct": "account_id"}})
    assert status == 422, problem
    assert "parameter_map renames 'acct' onto 'account_id', a protected key" in problem["detail"]
    assert (await api.call("GET", "/v1/tools/list_orders"))[0] == 404, "nothing stored"
    status, created = await api.call("POST", "/v1/tools", {**tool, "parameter_map": {"q": "query"}})
    assert status == 201, created
    status, problem = await api.call("PATCH", "/v1/tools/list_orders", {"parameter_map": {"acct": "accountId"}})
    assert status == 422 and "onto 'accountId', a protected key" in problem["detail"], problem
    assert (await api.call("GET", "/v1/tools/list_orders"))[1]["version"] == 1


async def test_a_row_stored_before_with_a_required_misspelt_key_is_reported_and_fails_in_band_as_misconfigured(
    api: Api, upstream: Upstream,
) -> None:
    # a definition stored before registration refused it (written straight to the repository)
    await ToolRepo(api.pool).create(api.tenant_id, "check_order", "webhook", {
        "name": "check_order", "type": "webhook", "description": "Look up an order.",
        "webhook_url": f"http://api.test:{upstream.port}/orders/{{order_id}}",
        "parameters": {"type": "object", "properties": {"order_id": {"type": "string"},
                                                        "AccountId": {"type": "string"}},
                       "required": ["order_id", "AccountId"]},
    })

    # the report: before, ok with `AccountId` listed as a model argument
    status, report = await api.call("GET", "/v1/tools/contract")
    assert status == 200 and report["ok"] is False
    [tool] = report["tools"]
    assert {(f["model_name"], f["source"]) for f in tool["fields"]} == {("order_id", "path")}
    [finding] = tool["findings"]
    assert (finding["kind"], finding["severity"]) == ("missing_required_parameter", "error")
    assert "'AccountId'" in finding["message"] and "'account_id' or 'accountId'" in finding["fix"]

    # a turn: before, "invalid arguments: 'AccountId' is required ... Ask the customer", and the
    # model asked the contact for an account id the engine would drop again
    _, catalog = await api.catalog()
    llm = ScriptedLLM([[("check_order", {"order_id": "7", "AccountId": "tn_other"})],
                       "I cannot look that order up right now."])
    env = TurnEnv(llm=llm, executor=Executor(), catalog=catalog, config=BotConfig(), main_model="m", cheap_model="c")
    reply = await handle_message(new_state(api.tenant_id, "s1"), "where is order 7", "m1", env)
    [call] = reply.tool_calls
    assert not call.success and "the tool is misconfigured" in call.error
    told = msgspec.json.encode(llm.requests[-1].messages).decode()
    assert "configuration problem of the business" in told and "Ask the customer" not in told
    assert upstream.paths == []  # nothing was sent, with or without the model's value
