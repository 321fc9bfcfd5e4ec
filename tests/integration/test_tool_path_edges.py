"""A tool call's whole path against real servers on loopback (an aiohttp upstream, MCP servers of
the official SDK): a 2xx result nested too deeply to record, protected keys in another spelling,
and an Idempotency-Key made of a message id that is not ASCII.

Safety as in test_webhook_client: servers bind loopback, host names resolve through MapResolver
only, and the webhook client's sockets refuse any non-loopback connect.
"""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgspec
import pytest
import pytest_asyncio
import uvicorn
from aiohttp import web
from mcp.server.mcpserver import MCPServer
from mcp.server.transport_security import TransportSecuritySettings

from actors.session import TurnEnv, handle_message, new_state
from kernel.records import McpServerRecord
from services.botconfig import BotConfig
from services.tools.context import TrustedContext
from services.tools.executor import Executor, ToolCall, idempotency_key
from services.tools.mcp import McpToolInfo, compile_server_tools
from services.tools.mcp_client import McpHttpClient
from services.tools.model import MAX_VALUE_DEPTH, WebhookTool
from services.tools.registry import Catalog, HandlerRegistry, build_catalog
from services.tools.ssrf import DestinationPolicy
from services.tools.toolset import SessionToolState
from services.tools.webhook import WebhookClient, WebhookToolBackend
from tests.support.mcp_server import ShopMcpServer, serve_in_thread, serving, stop_served
from tests.support.net_fakes import LoopbackOnlySockets, MapResolver
from tests.support.turns import ScriptedLLM

SCOPE = {"tenant_id": "tn_A", "tenantId": "tn_A", "account_id": "tn_A", "accountId": "tn_A"}
LOOPBACK_TWO = DestinationPolicy(allow=("127.0.0.2/32",))
TOKEN = "Bearer mcp-test-token"


def ctx(message_id: str = "m1") -> TrustedContext:
    return TrustedContext(tenant_id="tn_A", session_id="s1", message_id=message_id, scope=SCOPE)


def nested_json(levels: int) -> str:
    """`levels` arrays and objects within each other around a 1: valid JSON, a few bytes a level."""
    opens = "".join("[" if i % 2 else '{"a":' for i in range(levels))
    closes = "".join("]" if i % 2 else "}" for i in reversed(range(levels)))
    return opens + "1" + closes


# --------------------------------------------------------------------------- a loopback upstream


class Upstream:
    """Records each request (path, headers, body); `/deep/{n}` answers a body `n` levels deep,
    anything else `{"ok": true}`."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(self) -> Upstream:
        async def handle(request: web.Request) -> web.Response:
            self.requests.append({"path": request.path, "headers": dict(request.headers),
                                  "body": await request.text()})
            if request.path.startswith("/deep/"):
                return web.Response(text=nested_json(int(request.path.rsplit("/", 1)[1])),
                                    content_type="application/json")
            return web.json_response({"ok": True})

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = self._runner.addresses[0][1]
        return self

    def url(self, path: str) -> str:
        return f"http://api.test:{self.port}{path}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@pytest_asyncio.fixture
async def upstream() -> AsyncIterator[Upstream]:
    server = await Upstream().start()
    try:
        yield server
    finally:
        await server.stop()


@pytest_asyncio.fixture
async def client() -> AsyncIterator[WebhookClient]:
    sockets = LoopbackOnlySockets()
    webhooks = WebhookClient(policy=DestinationPolicy(allow=("127.0.0.1/32",)),
                             resolver=MapResolver({"api.test": ["127.0.0.1"]}), socket_factory=sockets)
    await webhooks.start()
    try:
        yield webhooks
    finally:
        await webhooks.close()
    assert sockets.refused == [], "a client tried to connect off loopback"


def webhook_catalog(client: WebhookClient, *tools: WebhookTool) -> Catalog:
    return build_catalog([], [(t, 1) for t in tools], registry=HandlerRegistry(),
                         backend=WebhookToolBackend(client, secret_box=None))


async def run_one(catalog: Catalog, name: str, arguments: dict[str, Any], context: TrustedContext | None = None):
    executor = Executor()
    plan = await executor.prepare([ToolCall(id="c1", name=name, arguments=arguments)], catalog=catalog,
                                  config=BotConfig(), session=SessionToolState(), scope=SCOPE)
    [outcome] = await executor.execute(plan, context or ctx(), approved=True)
    return plan.calls[0], outcome


def order_tool(url: str) -> WebhookTool:
    return WebhookTool(name="check_order", description="orders", webhook_url=url,
                       parameters={"type": "object", "properties": {"order_id": {"type": "string"}}})


# --------------------------------------------------------------------------- results nested too deeply


async def test_a_webhooks_2xx_body_nested_600_levels_is_an_in_band_failure_and_a_notification_still_reads_it(
    client: WebhookClient, upstream: Upstream,
) -> None:
    # 1.2 KB of valid JSON: before, the call record's redaction ran out of stack and RecursionError
    # left Executor.execute, failing the turn (recorded interrupted, so every retry failed alike)
    _, outcome = await run_one(webhook_catalog(client, order_tool(upstream.url("/deep/600"))), "check_order",
                               {"order_id": "7"})
    assert not outcome.success and outcome.error_kind == "upstream_malformed"
    assert f"upstream returned json nested more than {MAX_VALUE_DEPTH} levels deep" in outcome.content
    assert "calling it again will not help" in outcome.content
    assert outcome.counts_for_breaker and outcome.record.result is None
    # a body the engine never reads as a tool result (a notification's answer, a workflow start's)
    # is not judged by its depth: the receiver took the event, it must not be sent again
    plain = await client.call(url_template=upstream.url("/deep/600"), method="POST", args={}, headers={},
                              timeout_s=3.0)
    assert plain.status == 200


async def test_a_webhook_result_is_read_up_to_the_bound_and_refused_past_it(
    client: WebhookClient, upstream: Upstream,
) -> None:
    catalog = webhook_catalog(client, order_tool(upstream.url(f"/deep/{MAX_VALUE_DEPTH}")))
    _, at_bound = await run_one(catalog, "check_order", {"order_id": "7"})
    assert at_bound.success, at_bound.content
    catalog = webhook_catalog(client, order_tool(upstream.url(f"/deep/{MAX_VALUE_DEPTH + 1}")))
    _, past = await run_one(catalog, "check_order", {"order_id": "7"})
    assert not past.success and past.error_kind == "upstream_malformed"


async def test_the_turn_goes_on_when_a_tool_answers_a_deeply_nested_body(client: WebhookClient,
                                                                         upstream: Upstream) -> None:
    llm = ScriptedLLM([[("check_order", {"order_id": "1"})], "I cannot read that order right now."])
    env = TurnEnv(llm=llm, executor=Executor(), main_model="m", cheap_model="c", config=BotConfig(),
                  catalog=webhook_catalog(client, order_tool(upstream.url("/deep/600"))))
    reply = await handle_message(new_state("tn_A", "s1"), "where is order 1", "m1", env)
    assert reply.reply == "I cannot read that order right now."
    [call] = reply.tool_calls
    assert not call.success and f"more than {MAX_VALUE_DEPTH} levels" in call.error
    # the model was told in-band, in the tool_result of its call
    assert "nested more than" in msgspec.json.encode(llm.requests[-1].messages).decode()


class DeepMcpServer:
    """An MCP server (official SDK, streamable HTTP on 127.0.0.2) whose one tool `nest` answers
    structured content `levels` deep: the SDK's own decoder takes some 200 levels."""

    def __init__(self, levels: int) -> None:
        self.levels = levels
        self.url = ""
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> DeepMcpServer:
        mcp = MCPServer("deep", log_level="WARNING")

        @mcp.tool()
        def nest() -> dict[str, Any]:
            """Answer a deeply nested order."""
            value: Any = 1
            for _ in range(self.levels):
                value = {"a": value}
            return value

        app = mcp.streamable_http_app(host="127.0.0.2", transport_security=TransportSecuritySettings(
            enable_dns_rebinding_protection=True, allowed_hosts=["127.0.0.2:*"]))
        self._server, self._thread, port = serve_in_thread(app, "127.0.0.2", "deep-mcp-server")
        self.url = f"http://127.0.0.2:{port}/mcp"
        return self

    def stop(self) -> None:
        stop_served(self._server, self._thread)


@pytest.fixture(scope="module")
def deep_mcp() -> Iterator[DeepMcpServer]:
    with serving(DeepMcpServer(150)) as server:
        yield server


async def test_an_mcp_tools_structured_result_nested_past_the_bound_is_an_in_band_failure(deep_mcp) -> None:
    record = McpServerRecord(tenant_id="tn_A", name="deep", url=deep_mcp.url, read_only_tools=["nest"])
    tools, _ = compile_server_tools(record, [McpToolInfo(name="nest", description="nest")],
                                    McpHttpClient(policy=LOOPBACK_TWO), open_auth=lambda: None)
    _, outcome = await run_one(Catalog({t.name: t for t in tools}, {}), "deep__nest", {})
    assert not outcome.success and outcome.error_kind == "upstream_malformed"
    assert f"nests more than {MAX_VALUE_DEPTH} levels deep" in outcome.content


# --------------------------------------------------------------------------- protected keys in any spelling


async def test_no_spelling_of_a_protected_key_from_the_model_reaches_a_webhook_body(
    client: WebhookClient, upstream: Upstream,
) -> None:
    # Go's encoding/json and ASP.NET Core bind `Account_ID` or `ACCOUNTID` to an AccountID field:
    # before, only the exact spellings were stripped and the model chose the account
    tool = WebhookTool(name="create_note", description="d", method="POST", mutability="write",
                       requires_approval=False, webhook_url=upstream.url("/accounts/{account_id}/notes"),
                       parameters={"type": "object", "properties": {
                           "note": {"type": "string"}, "filter": {"type": "object"}, "account_id": {}}})
    arguments = {"note": "hi", "Account_ID": "victim", "filter": {"ACCOUNTID": "victim", "account-id": "victim",
                                                                  "TENANT_ID": "victim", "q": 1}}
    _, outcome = await run_one(webhook_catalog(client, tool), "create_note", arguments)
    assert outcome.success, outcome.content
    [request] = upstream.requests
    assert request["path"] == "/accounts/tn_A/notes"  # the trusted account still fills its hole
    assert json.loads(request["body"]) == {"note": "hi", "filter": {"q": 1}}


async def test_a_url_hole_named_by_another_spelling_of_a_protected_key_is_never_filled_by_the_model(
    client: WebhookClient, upstream: Upstream,
) -> None:
    # before: `{AccountId}` was an ordinary hole, filled with the model's value
    tool = WebhookTool(name="check_account", description="d", webhook_url=upstream.url("/accounts/{AccountId}"),
                       parameters={"type": "object", "properties": {"AccountId": {"type": "string"}}})
    _, outcome = await run_one(webhook_catalog(client, tool), "check_account", {"AccountId": "victim"})
    assert not outcome.success and outcome.error_kind == "policy_denied"
    assert "the tool is misconfigured" in outcome.content
    assert upstream.requests == []


# --------------------------------------------------------------------------- the Idempotency-Key header


def write_tool(url: str) -> WebhookTool:
    return WebhookTool(name="cancel_order", description="d", method="POST", mutability="write",
                       requires_approval=False, webhook_url=url,
                       parameters={"type": "object", "properties": {"order_id": {"type": "string"}}})


async def test_a_webhook_write_sends_the_idempotency_key_as_ascii(client: WebhookClient, upstream: Upstream) -> None:
    # before, a non-ASCII key went out as raw UTF-8 (the MCP client could not send it at all);
    # a printable ASCII one goes out byte for byte as before
    catalog = webhook_catalog(client, write_tool(upstream.url("/cancel")))
    for message_id, sent_as in (("commande-é-1", "commande-%C3%A9-1"), ("m_17:retry", "m_17:retry")):
        prepared, outcome = await run_one(catalog, "cancel_order", {"order_id": "7"}, ctx(message_id))
        assert outcome.success, outcome.content
        key = idempotency_key(ctx(message_id), prepared)
        assert key.startswith(f"{message_id}:")
        assert upstream.requests[-1]["headers"]["Idempotency-Key"] == sent_as + key[len(message_id):]


@pytest.fixture(scope="module")
def shop() -> Iterator[ShopMcpServer]:
    with serving(ShopMcpServer(allowed_hosts=["127.0.0.2:*"])) as server:
        yield server


async def test_an_mcp_write_whose_message_id_is_not_ascii_reaches_the_server(shop: ShopMcpServer) -> None:
    # before: httpx2 could not encode the header, the call failed "not valid mcp" before anything
    # was sent, and it counted against the server's breaker
    record = McpServerRecord(tenant_id="tn_A", name="shop", url=shop.url, include_tools=["archive_order"])
    info = McpToolInfo(name="archive_order", description="archive",
                       input_schema={"type": "object", "properties": {"order_id": {"type": "string"}}})
    tools, _ = compile_server_tools(record, [info], McpHttpClient(policy=LOOPBACK_TWO), open_auth=lambda: TOKEN)
    assert tools[0].definition.mutability == "write"
    catalog = Catalog({t.name: t for t in tools}, {})
    for message_id, sent_as in (("commande-é-1", "commande-%C3%A9-1"), ("注文7", "%E6%B3%A8%E6%96%877"),
                                ("m_17:retry", "m_17:retry")):
        before = len(shop.requests)
        prepared, outcome = await run_one(catalog, "shop__archive_order", {"order_id": message_id},
                                          ctx(message_id))
        assert outcome.success, outcome.content
        key = idempotency_key(ctx(message_id), prepared)
        assert {r["idempotency_key"] for r in shop.requests[before:]} == {sent_as + key[len(message_id):]}
        assert {"order_id": message_id} in shop.called("archive_order")
