"""The MCP client against a real MCP server (official SDK, streamable HTTP, on 127.0.0.2), and
its SSRF guard: a URL whose host resolves to the metadata address is refused before any
connection, and a host name is connected to only at the address the guard checked."""

from __future__ import annotations

import httpcore2
import pytest

from services.tools.errors import DestinationBlocked, UpstreamTimeout, UpstreamUnreachable
from services.tools.mcp import McpToolFailed, result_value
from services.tools.mcp_client import McpHttpClient, _PinnedBackend
from services.tools.ssrf import CheckedDestination, DestinationPolicy
from tests.support.mcp_server import ShopMcpServer, serving
from tests.support.net_fakes import MapResolver

LOOPBACK_TWO = DestinationPolicy(allow=("127.0.0.2/32",))
TOKEN = "Bearer mcp-test-token"


class RecordingBackend(httpcore2.AsyncNetworkBackend):
    """The backend the pinned one dials through: records every connect, then really connects."""

    def __init__(self) -> None:
        self.connects: list[tuple[str, int]] = []
        self._real = httpcore2.AnyIOBackend()

    async def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        self.connects.append((host, port))
        return await self._real.connect_tcp(host, port, timeout=timeout, local_address=local_address,
                                             socket_options=socket_options)

    async def sleep(self, seconds: float) -> None:
        await self._real.sleep(seconds)


@pytest.fixture(scope="module")
def shop():
    with serving(ShopMcpServer(allowed_hosts=["127.0.0.2:*", "mcp.shop.test:*"])) as server:
        yield server


async def test_lists_the_servers_tools_with_their_hints_sending_the_auth_header(shop) -> None:
    client = McpHttpClient(policy=LOOPBACK_TWO)
    tools = {t.name: t for t in await client.list_tools(shop.url, auth_header=TOKEN, timeout_s=5)}
    assert set(tools) == {"lookup_order", "check_stock", "delete_customer", "archive_order"}
    assert tools["lookup_order"].read_only_hint is True and tools["delete_customer"].destructive_hint is True
    assert tools["lookup_order"].input_schema["required"] == ["order_id"]
    assert shop.requests and all(r["authorization"] == TOKEN for r in shop.requests)


async def test_calls_a_tool_and_gets_structured_content(shop) -> None:
    client = McpHttpClient(policy=LOOPBACK_TWO)
    result = await client.call_tool(shop.url, "lookup_order", {"order_id": "A7"}, auth_header=TOKEN,
                                    timeout_s=5, idempotency_key="key-1")
    assert result_value(result) == {"order_id": "A7", "status": "shipped"}
    assert {"order_id": "A7"} in shop.called("lookup_order")
    assert "key-1" in {r["idempotency_key"] for r in shop.requests}


async def test_a_failing_tool_is_an_error_result_not_an_exception(shop) -> None:
    client = McpHttpClient(policy=LOOPBACK_TWO)
    result = await client.call_tool(shop.url, "check_stock", {"sku": "X"}, auth_header=TOKEN, timeout_s=5)
    assert result.is_error
    with pytest.raises(McpToolFailed, match="the tool reported an error"):
        result_value(result)


async def test_a_server_echoing_the_auth_header_hands_back_only_redacted(shop) -> None:
    # before, the decrypted header came back in the tool's result: the model's context, the record
    try:
        echo = ShopMcpServer(echo_auth=True).start()
    except OSError:
        pytest.skip("127.0.0.2 cannot be bound here")
    try:
        client = McpHttpClient(policy=LOOPBACK_TWO)
        result = await client.call_tool(echo.url, "whoami", {}, auth_header=TOKEN, timeout_s=5)
    finally:
        echo.stop()
    assert echo.requests[-1]["authorization"] == TOKEN  # sent as configured
    assert result_value(result) == {"authorization": "[redacted]", "token": "[redacted]"}
    assert "mcp-test-token" not in repr(result)


async def test_a_server_echoing_its_url_hands_back_a_query_key_redacted() -> None:
    # hosted MCP servers are often set up with their key in the query (`/mcp?api_key=...`); before,
    # a server quoting the URL it was called at put the key in the model's context and the record
    key = "sk_live_MCPQUERYSECRET42"
    try:
        echo = ShopMcpServer(echo_auth=True).start()
    except OSError:
        pytest.skip("127.0.0.2 cannot be bound here")
    try:
        client = McpHttpClient(policy=LOOPBACK_TWO)
        result = await client.call_tool(f"{echo.url}?api_key={key}&region=eu", "whereami", {}, auth_header=TOKEN,
                                        timeout_s=5)
    finally:
        echo.stop()
    assert echo.requests[-1]["path_qs"].endswith(f"?api_key={key}&region=eu")  # sent as configured
    assert result_value(result) == {"called": "/mcp?api_key=[redacted]&region=eu"}


async def test_wrong_credentials_are_an_unreachable_tool_error_without_the_header(shop) -> None:
    client = McpHttpClient(policy=LOOPBACK_TWO)
    with pytest.raises(UpstreamUnreachable, match=r"refused the credentials \(401\)") as exc:
        await client.list_tools(shop.url, auth_header="Bearer wrong", timeout_s=5)
    assert "wrong" not in str(exc.value)


async def test_a_closed_port_is_unreachable(shop) -> None:
    client = McpHttpClient(policy=LOOPBACK_TWO)
    with pytest.raises(UpstreamUnreachable, match="could not connect"):
        await client.list_tools("http://127.0.0.2:1/mcp", auth_header=None, timeout_s=3)


async def test_a_host_resolving_to_the_metadata_address_is_refused_before_any_connect() -> None:
    resolver = MapResolver({"mcp.evil.test": ["169.254.169.254"]})
    backend = RecordingBackend()
    client = McpHttpClient(policy=LOOPBACK_TWO, resolver=resolver, network_backend=backend)
    with pytest.raises(DestinationBlocked, match="destination not allowed") as exc:
        await client.list_tools("http://mcp.evil.test/mcp", auth_header=TOKEN, timeout_s=3)
    assert exc.value.rule == "link-local address (cloud metadata)"
    assert resolver.asked == ["mcp.evil.test"] and backend.connects == []
    with pytest.raises(DestinationBlocked):
        await client.call_tool("http://169.254.169.254/mcp", "x", {}, auth_header=None, timeout_s=3)
    assert backend.connects == []


async def test_one_refused_address_among_several_refuses_the_host() -> None:
    resolver = MapResolver({"mixed.test": ["127.0.0.2", "10.0.0.7"]})
    backend = RecordingBackend()
    client = McpHttpClient(policy=LOOPBACK_TWO, resolver=resolver, network_backend=backend)
    with pytest.raises(DestinationBlocked):
        await client.list_tools("http://mixed.test/mcp", auth_header=None, timeout_s=3)
    assert backend.connects == []


async def test_a_host_name_is_connected_to_at_the_checked_address_only(shop) -> None:
    # mcp.shop.test does not exist in any DNS: the call works only because the connection goes to
    # the address the guard checked, and the request still names the host (Host header, TLS SNI).
    resolver = MapResolver({"mcp.shop.test": ["127.0.0.2"]})
    backend = RecordingBackend()
    client = McpHttpClient(policy=LOOPBACK_TWO, resolver=resolver, network_backend=backend)
    before = len(shop.requests)
    tools = await client.list_tools(f"http://mcp.shop.test:{shop.port}/mcp", auth_header=TOKEN, timeout_s=5)
    assert "lookup_order" in {t.name for t in tools}
    assert backend.connects and set(backend.connects) == {("127.0.0.2", shop.port)}
    assert resolver.asked == ["mcp.shop.test"]  # resolved once, by the guard
    assert {r["host"] for r in shop.requests[before:]} == {f"mcp.shop.test:{shop.port}"}


async def test_the_pinned_backend_refuses_a_host_or_port_it_was_not_given() -> None:
    destination = CheckedDestination(scheme="http", host="mcp.shop.test", port=8080, addresses=["127.0.0.2"],
                                     path_and_query="/mcp")
    backend = RecordingBackend()
    pinned = _PinnedBackend(destination, backend)
    with pytest.raises(httpcore2.ConnectError):
        await pinned.connect_tcp("elsewhere.test", 8080)
    with pytest.raises(httpcore2.ConnectError):
        await pinned.connect_tcp("mcp.shop.test", 9090)
    with pytest.raises(httpcore2.ConnectError):
        await pinned.connect_unix_socket("/var/run/docker.sock")
    assert backend.connects == []


async def test_a_slow_server_is_a_timeout_within_the_budget(shop) -> None:
    import asyncio
    import socket

    # a listener that accepts and never answers
    sock = socket.socket()
    sock.bind(("127.0.0.2", 0))
    sock.listen()
    try:
        port = sock.getsockname()[1]
        client = McpHttpClient(policy=LOOPBACK_TWO)
        started = asyncio.get_running_loop().time()
        with pytest.raises(UpstreamTimeout):
            await client.list_tools(f"http://127.0.0.2:{port}/mcp", auth_header=None, timeout_s=0.5)
        assert asyncio.get_running_loop().time() - started < 3
    finally:
        sock.close()


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_a_compressed_answer_is_refused_not_inflated(encoding) -> None:
    # The size cap counts bytes on the wire; httpx2 would inflate them after it. A tenant's server
    # answering 1 MB of gzip that inflates to 64 MB (1 GB in the review) would pass the cap and
    # fill the host's memory during a catalog load. The client asks for no compression and
    # refuses a compressed answer.
    import json
    import zlib

    from aiohttp import web

    from services.tools.errors import UpstreamMalformed

    message = json.dumps({"jsonrpc": "2.0", "id": 0, "result": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "serverInfo": {"name": "x", "version": "1"}}}).encode()
    packer = zlib.compressobj(9, zlib.DEFLATED, 31 if encoding == "gzip" else 15)
    body = packer.compress(message[:-1]) + b"".join(packer.compress(b" " * (1 << 20)) for _ in range(64))
    body += packer.compress(b"}") + packer.flush()
    asked: list[str | None] = []

    async def answer(request: web.Request) -> web.Response:
        asked.append(request.headers.get("Accept-Encoding"))
        await request.read()
        return web.Response(body=body, headers={"Content-Type": "application/json", "Content-Encoding": encoding})

    app = web.Application()
    app.router.add_post("/mcp", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.2", 0)
        await site.start()
    except OSError:
        await runner.cleanup()
        pytest.skip("127.0.0.2 cannot be bound here")
    port = site._server.sockets[0].getsockname()[1]
    try:
        client = McpHttpClient(policy=LOOPBACK_TWO, network_backend=RecordingBackend(), max_body_bytes=1 << 20)
        with pytest.raises(UpstreamMalformed, match=f"compressed .*{encoding}"):
            await client.list_tools(f"http://127.0.0.2:{port}/mcp", auth_header=None, timeout_s=10)
        assert asked and set(asked) == {"identity"}
    finally:
        await runner.cleanup()
