"""A credential written into a tool's URL outside its query (a token as a path segment, a
password in userinfo) never comes back to the model through the upstream's answer: webhooks
and MCP servers on loopback that quote the URL they were called at, or the token alone.

Safety as in test_webhook_client.py: servers bind loopback addresses, host names "resolve" only
through `MapResolver`, and the webhook client's sockets are `LoopbackOnlySockets`.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import structlog
from aiohttp import web

from services.tools.errors import DestinationBlocked, UpstreamStatus
from services.tools.mcp import result_value
from services.tools.mcp_client import McpHttpClient
from services.tools.model import WebhookTool
from services.tools.ssrf import DestinationPolicy
from services.tools.webhook import WebhookClient
from tests.support import net_fakes
from tests.support.mcp_server import ShopMcpServer
from tests.support.net_fakes import LoopbackApp, LoopbackOnlySockets, MapResolver

sockets = net_fakes.sockets  # the fixture

SLACK_TOKEN = "Ab3dEf6hIj9kLm2nOp5qRs8t"  # a Slack-style incoming-webhook token: letters and digits
HEX_TOKEN = "0123456789abcdef0123456789abcdef01234567"
MCP_KEY = "mcpk-9f8e7d6c5b4a3210fedc"  # a hosted MCP server's `/s/<key>/mcp`
PASSWORD = "s3cretpass-42"
MCP_POLICY = DestinationPolicy(allow=("127.0.0.2/32",))
MCP_TOKEN = "Bearer mcp-test-token"


class EchoUpstream(LoopbackApp):
    """An aiohttp server on 127.0.0.1 that answers any path with the url it was called at, each
    path segment alone, and the status its first segment names (a 2xx, or a 4xx whose `error`
    the model reads as the upstream's explanation)."""

    def __init__(self) -> None:
        super().__init__()
        self.paths: list[str] = []

    async def start(self) -> EchoUpstream:
        app = web.Application()
        app.router.add_get(r"/{code:\d{3}}/{tail:.*}", self._echo)
        await self.serve(app)
        return self

    async def _echo(self, request: web.Request) -> web.Response:
        self.paths.append(request.raw_path)
        return web.json_response(
            {"error": f"no hook at {request.path_qs}", "you_called": request.path_qs,
             "segments": request.path.split("/")},
            status=int(request.match_info["code"]),
        )


@pytest.fixture
async def client(sockets: LoopbackOnlySockets):
    async with WebhookClient(policy=DestinationPolicy(allow=("127.0.0.1/32",)),
                             resolver=MapResolver({"hooks.test": ["127.0.0.1"]}), socket_factory=sockets) as c:
        yield c


@pytest.fixture
async def upstream():
    server = await EchoUpstream().start()
    yield server
    await server.stop()


async def _answer_text(call) -> str:
    """What the model reads of the call: the 2xx JSON, or the 4xx's reason and advice."""
    try:
        return json.dumps((await call).json)
    except UpstreamStatus as error:
        return f"{error} {error.advice}"


@pytest.mark.parametrize("code", [200, 400])
async def test_a_token_in_a_webhook_urls_path_is_never_echoed_back(client, upstream, code: int) -> None:
    # a Slack-style webhook url: before, an upstream quoting the url (or the token alone) handed the
    # token to the model in its 2xx answer or its 4xx explanation, and to ce_tool_calls with it
    template = (f"http://hooks.test:{upstream.port}/{code}/services/T0001ABCD/B0002EFGH/{SLACK_TOKEN}"
                f"?order={{order_id}}")
    with structlog.testing.capture_logs() as logs:
        text = await _answer_text(client.call(url_template=template, method="GET", args={"order_id": "A-1001"},
                                              headers={}, timeout_s=3))
    assert upstream.paths[-1].endswith(f"/B0002EFGH/{SLACK_TOKEN}?order=A-1001")  # sent as configured
    assert SLACK_TOKEN not in text and "[redacted]" in text, text
    assert "/services/T0001ABCD/B0002EFGH/[redacted]" in text  # the ordinary segments stay
    assert "order=A-1001" in text  # what the model supplied is not scrubbed
    assert SLACK_TOKEN not in repr(logs)


@pytest.mark.parametrize("code", [200, 404])
async def test_a_webhook_tools_hex_token_in_its_path_is_redacted_from_its_result_and_explanation(
    client, upstream, code: int
) -> None:
    # `/api/<40-hex token>/orders/{order_id}` through the tool's own route (call_webhook)
    tool = WebhookTool(name="check_order", description="Look up a customer order by order number.",
                       parameters={"order_id": {"type": "string", "description": "The order number"}},
                       webhook_url=f"http://hooks.test:{upstream.port}/{code}/api/{HEX_TOKEN}/orders/{{order_id}}")
    text = await _answer_text(client.call_webhook(tool, {"order_id": "A-1001"}, None, 3))
    assert HEX_TOKEN in upstream.paths[-1]
    assert HEX_TOKEN not in text and f"/{code}/api/[redacted]/orders/A-1001" in text, text


class KeyInPathMcpServer(ShopMcpServer):
    """The test shop's MCP server reached at `/s/<key>/mcp`, as hosted servers hand out their URL:
    the recorded request (and so `whereami`) keeps the path as called; the SDK's app is served it as
    `/mcp`, where it is mounted."""

    def __init__(self, key: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._prefix = f"/s/{key}"

    def _guard(self, app):
        async def unmounted(scope, receive, send):
            if scope["type"] == "http" and scope["path"].startswith(self._prefix + "/"):
                path = scope["path"][len(self._prefix):]
                scope = {**scope, "path": path, "raw_path": path.encode()}
            return await app(scope, receive, send)

        return super()._guard(unmounted)

    def start(self) -> KeyInPathMcpServer:
        super().start()
        self.url = f"http://{self.host}:{self.port}{self._prefix}/mcp"
        return self


async def test_an_mcp_servers_key_in_its_url_path_is_redacted_from_a_result_quoting_it() -> None:
    # before, only a key in the query was: the server's `whereami` handed `/s/<key>/mcp` to the model
    try:
        server = KeyInPathMcpServer(MCP_KEY, echo_auth=True).start()
    except OSError:
        pytest.skip("127.0.0.2 cannot be bound here")
    try:
        client = McpHttpClient(policy=MCP_POLICY)
        result = await client.call_tool(server.url, "whereami", {}, auth_header=MCP_TOKEN, timeout_s=5)
    finally:
        server.stop()
    assert server.requests[-1]["path_qs"] == f"/s/{MCP_KEY}/mcp?"  # sent as configured
    assert result_value(result) == {"called": "/s/[redacted]/mcp?"}
    assert MCP_KEY not in repr(result)


async def test_a_url_with_userinfo_is_refused_before_sending_and_no_error_or_log_quotes_its_password(
    client, upstream
) -> None:
    # the reason a userinfo password needs no scrub in an answer today: the guard refuses the url
    # before any connection (webhooks and MCP servers alike), and its refusal quotes no part of it
    mcp = McpHttpClient(policy=MCP_POLICY, resolver=MapResolver({"hooks.test": ["127.0.0.2"]}))
    with structlog.testing.capture_logs() as logs:
        with pytest.raises(DestinationBlocked) as webhook_refusal:
            await client.call(url_template=f"http://user:{PASSWORD}@hooks.test:{upstream.port}/200/orders/{{id}}",
                              method="GET", args={"id": "A-1"}, headers={}, timeout_s=3)
        with pytest.raises(DestinationBlocked) as mcp_refusal:
            await mcp.call_tool(f"http://user:{PASSWORD}@hooks.test:1/mcp", "whereami", {}, auth_header=None,
                                timeout_s=3)
    assert upstream.paths == []
    for refusal in (webhook_refusal.value, mcp_refusal.value):
        assert refusal.rule == "userinfo in url"  # type: ignore[attr-defined]
        shown = f"{refusal} {refusal.advice} {refusal.detail}"  # type: ignore[attr-defined]
        assert PASSWORD not in shown
    assert PASSWORD not in repr(logs)
