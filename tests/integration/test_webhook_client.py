"""WebhookClient against real HTTP servers on loopback: errors, bounds, the SSRF guard, secrets, bindings.

Safety: no test may send a packet off this machine, even with a broken guard. Every server binds a
loopback address; host names "resolve" only through `MapResolver`; and every client gets
`LoopbackOnlySockets` as its socket factory, which refuses (and records) any non-loopback connect
before a socket exists. The guard cases assert that nothing reached even that factory.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import structlog
from aiohttp import web

from services.tools.context import TrustedContext
from services.tools.crypto import SecretBox, generate_key
from services.tools.errors import (
    DeadlineExceeded,
    DestinationBlocked,
    PolicyDenied,
    ToolError,
    UpstreamMalformed,
    UpstreamStatus,
    UpstreamTimeout,
    UpstreamTooLarge,
    UpstreamUnreachable,
)
from services.tools.model import BackendBindingTool, WebhookTool
from services.tools.ssrf import DestinationPolicy
from services.tools.webhook import WebhookClient, WebhookResponse, WebhookToolBackend
from tests.support import net_fakes
from tests.support.net_fakes import LoopbackOnlySockets, MapResolver

sockets = net_fakes.sockets  # the fixture

LOOPBACK_ONLY = ("127.0.0.1/32",)
TEN_MB = 10 * 1024 * 1024


# --------------------------------------------------------------------------- safety fakes


# --------------------------------------------------------------------------- servers


class Upstream:
    """An aiohttp.web server on a loopback address that records every request it gets."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.port = 0
        self.requests: list[dict[str, Any]] = []
        self._runner: web.AppRunner | None = None
        self.redirect_to = ""

    @property
    def base(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def base_for(self, name: str) -> str:
        return f"http://{name}:{self.port}"

    async def start(self) -> Upstream:
        @web.middleware
        async def record(
            request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
        ):
            self.requests.append(
                {
                    "method": request.method,
                    "raw_path": request.raw_path,
                    "query": {k: request.query.getall(k) for k in request.query},
                    "headers": dict(request.headers),
                    "body": await request.text(),
                }
            )
            return await handler(request)

        app = web.Application(middlewares=[record])
        app.router.add_route("*", "/orders/{order_id}", self._order)
        app.router.add_route("*", "/echo", self._echo)
        app.router.add_route("*", "/echo-headers", self._echo_headers)
        app.router.add_get("/echo-url/{code}", self._echo_url)
        app.router.add_get("/php-echo", self._php_echo)
        app.router.add_route("*", "/example/catalog", self._echo)
        app.router.add_route("*", "/listings", self._echo)
        app.router.add_get("/slow", self._slow)
        app.router.add_get("/status/{code}", self._status)
        app.router.add_get("/redirect", self._redirect)
        app.router.add_get("/malformed", self._malformed)
        app.router.add_get("/text", self._text)
        app.router.add_get("/empty", self._empty)
        app.router.add_get("/no-content", self._no_content)
        app.router.add_get("/big", self._big_chunked)
        app.router.add_get("/big-declared", self._big_declared)
        app.router.add_get("/bytes/{n}", self._bytes)
        app.router.add_get("/gzip-bomb", self._gzip_bomb)
        self._runner = web.AppRunner(
            app, shutdown_timeout=0.5, handler_cancellation=True, access_log=None
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _order(self, request: web.Request) -> web.Response:
        return web.json_response({"order_id": request.match_info["order_id"], "status": "shipped"})

    async def _echo(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def _echo_headers(self, request: web.Request) -> web.Response:
        # a debugging endpoint, or a hostile one: the request's headers back in a 2xx body, the
        # credential after its scheme alone too
        auth = request.headers.get("Authorization", "")
        return web.json_response({"you_sent": dict(request.headers), "token": auth.partition(" ")[2]})

    async def _echo_url(self, request: web.Request) -> web.Response:
        # an upstream that quotes the url it was called with, in an error or in a 2xx
        return web.json_response({"error": f"bad request to {request.path_qs}", "you_called": request.path_qs},
                                 status=int(request.match_info["code"]))

    async def _php_echo(self, request: web.Request) -> web.Response:
        # a PHP upstream: json_encode writes "/" as "\/" by default
        body = json.dumps({"you_called": request.path_qs, "auth": request.headers.get("Authorization", ""),
                           "customer": "expand me"})
        return web.Response(text=body.replace("/", "\\/"), content_type="application/json")

    async def _slow(self, request: web.Request) -> web.Response:
        await asyncio.sleep(10)
        return web.json_response({"late": True})

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response({"error": "nope"}, status=int(request.match_info["code"]))

    async def _redirect(self, request: web.Request) -> web.Response:
        return web.Response(status=302, headers={"Location": self.redirect_to})

    async def _malformed(self, request: web.Request) -> web.Response:
        return web.Response(text='{"order": "A-1", ', content_type="application/json")

    async def _text(self, request: web.Request) -> web.Response:
        return web.Response(text="your order has shipped", content_type="text/plain")

    async def _empty(self, request: web.Request) -> web.Response:
        return web.Response(status=200, body=b"", content_type="application/json")

    async def _no_content(self, request: web.Request) -> web.Response:
        return web.Response(status=204)

    async def _big_chunked(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        chunk = b" " * 65536
        for _ in range(TEN_MB // len(chunk)):
            await response.write(chunk)  # raises once the client hangs up at its cap
        return response

    async def _big_declared(self, request: web.Request) -> web.Response:
        return web.Response(body=b" " * TEN_MB, content_type="application/json")

    async def _gzip_bomb(self, request: web.Request) -> web.Response:
        body = gzip.compress(b" " * TEN_MB)  # about 10 KB on the wire, 10 MB once inflated
        return web.Response(
            body=body, headers={"Content-Encoding": "gzip", "Content-Type": "application/json"}
        )

    async def _bytes(self, request: web.Request) -> web.Response:
        n = int(request.match_info["n"])
        return web.Response(body=b'"' + b"x" * (n - 2) + b'"', content_type="application/json")


class RawServer:
    """An asyncio TCP server on a loopback address with a scripted handler; counts connections."""

    def __init__(
        self,
        host: str,
        script: Callable[[RawServer, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
    ) -> None:
        self.host = host
        self.port = 0
        self.connections = 0
        self.received = bytearray()
        self.body_bytes_sent = 0
        self._script = script
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    async def start(self) -> RawServer:
        self._server = await asyncio.start_server(self._on_connect, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._script(self, reader, writer)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._tasks.discard(task)
            writer.close()

    async def read_request_head(self, reader: asyncio.StreamReader) -> bytes:
        head = await reader.readuntil(b"\r\n\r\n")
        self.received += head
        return head

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


async def drip_script(
    server: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """Headers at once, then one byte of body every 50 ms: each read is quick, the whole is not."""
    await server.read_request_head(reader)
    writer.write(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    )
    await writer.drain()
    for _ in range(200):
        writer.write(b" ")
        await writer.drain()
        server.body_bytes_sent += 1
        await asyncio.sleep(0.05)


async def close_mid_body_script(
    server: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    await server.read_request_head(reader)
    writer.write(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    )
    writer.write(b'{"orders": [' + b'"x",' * 25)
    await writer.drain()
    server.body_bytes_sent = 112


async def hang_up_script(
    server: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    await server.read_request_head(reader)


async def listen_script(
    server: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    server.received += await reader.read(65536)
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
    await writer.drain()


# --------------------------------------------------------------------------- fixtures


@pytest.fixture
def resolver() -> MapResolver:
    return MapResolver(
        {
            "api.test": ["127.0.0.1"],
            "internal.test": ["127.0.0.1"],
            "metadata.test": ["169.254.169.254"],
            "private.test": ["10.0.0.1"],
            "v6.test": ["::1"],
        }
    )


@pytest.fixture
async def make_client(sockets: LoopbackOnlySockets, resolver: MapResolver):
    clients: list[WebhookClient] = []

    async def make(
        allow: tuple[str, ...] = LOOPBACK_ONLY, resolver_: Any = None, **kwargs: Any
    ) -> WebhookClient:
        client = WebhookClient(
            policy=DestinationPolicy(allow=allow),
            resolver=resolver_ or resolver,
            socket_factory=sockets,
            **kwargs,
        )
        await client.start()
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()


@pytest.fixture
async def client(make_client) -> WebhookClient:
    return await make_client()


@pytest.fixture
async def upstream():
    server = await Upstream("127.0.0.1").start()
    yield server
    await server.stop()


@pytest.fixture
async def raw_server():
    servers: list[RawServer] = []

    async def start(script, host: str = "127.0.0.1") -> RawServer:
        server = await RawServer(host, script).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.stop()


async def get(
    client: WebhookClient, url: str, timeout_s: float = 3.0, **kwargs: Any
) -> WebhookResponse:
    return await client.call(
        url_template=url, method="GET", args=kwargs, headers={}, timeout_s=timeout_s
    )


def webhook_tool(url: str, **kwargs: Any) -> WebhookTool:
    return WebhookTool(
        name="check_order",
        description="Look up a customer order by order number.",
        parameters={"order_id": {"type": "string", "description": "The order number"}},
        webhook_url=url,
        **kwargs,
    )


# --------------------------------------------------------------------------- success paths


async def test_get_through_a_checked_host_name_returns_the_decoded_json(
    client, upstream, resolver, sockets
) -> None:
    response = await get(
        client, upstream.base_for("api.test") + "/orders/{order_id}", order_id="A-1"
    )
    assert response.status == 200
    assert response.json == {"order_id": "A-1", "status": "shipped"}
    assert response.elapsed_ms > 0
    assert upstream.requests[0]["raw_path"] == "/orders/A-1"
    assert upstream.requests[0]["headers"]["Host"] == f"api.test:{upstream.port}"
    assert resolver.calls == [("api.test", upstream.port)]
    assert sockets.connects == ["127.0.0.1"]


async def test_a_hostile_path_value_arrives_as_one_encoded_segment(client, upstream) -> None:
    await get(
        client, upstream.base_for("api.test") + "/orders/{order_id}", order_id="../admin?x=1#f"
    )
    assert upstream.requests[0]["raw_path"] == "/orders/..%2Fadmin%3Fx%3D1%23f"


async def test_the_connection_goes_to_the_checked_address_even_if_dns_changes(
    make_client, upstream, sockets
) -> None:
    rebinding = MapResolver({"rebind.test": [["127.0.0.1"], ["169.254.169.254"]]})
    client = await make_client(resolver_=rebinding)
    response = await get(client, upstream.base_for("rebind.test") + "/orders/1")
    assert response.status == 200
    assert rebinding.calls == [("rebind.test", upstream.port)]  # resolved once, by the guard
    assert sockets.connects == ["127.0.0.1"]
    with pytest.raises(DestinationBlocked):  # the next call checks the new answer and refuses it
        await get(client, upstream.base_for("rebind.test") + "/orders/1")
    assert len(upstream.requests) == 1


@pytest.mark.parametrize("path", ["/empty", "/no-content"])
async def test_a_2xx_with_an_empty_body_is_success_with_json_none(
    client, upstream, path: str
) -> None:
    response = await get(client, upstream.base_for("api.test") + path)
    assert response.json is None
    assert response.status in (200, 204)


async def test_post_sends_extra_arguments_as_json_with_the_idempotency_key(
    client, upstream
) -> None:
    response = await client.call(
        url_template=upstream.base_for("api.test") + "/orders/{order_id}",
        method="POST",
        args={"order_id": "A-1", "note": "leave at door", "qty": 2},
        headers={},
        timeout_s=3.0,
        idempotency_key="call-123",
    )
    assert response.status == 200
    seen = upstream.requests[0]
    assert seen["method"] == "POST"
    assert seen["raw_path"] == "/orders/A-1"
    assert json.loads(seen["body"]) == {"note": "leave at door", "qty": 2}
    assert seen["headers"]["Idempotency-Key"] == "call-123"
    assert seen["headers"]["Content-Type"] == "application/json"


async def test_a_body_at_the_cap_is_read_and_one_byte_more_is_refused(
    make_client, upstream
) -> None:
    client = await make_client(max_body_bytes=1000)
    assert (await get(client, upstream.base_for("api.test") + "/bytes/1000")).json == "x" * 998
    with pytest.raises(UpstreamTooLarge, match="larger than 1000 bytes"):
        await get(client, upstream.base_for("api.test") + "/bytes/1001")


# --------------------------------------------------------------------------- failures and bounds


async def test_a_slow_upstream_is_an_upstream_timeout(client, upstream) -> None:
    started = time.monotonic()
    with pytest.raises(UpstreamTimeout, match="^upstream timeout$") as info:
        await get(client, upstream.base_for("api.test") + "/slow", timeout_s=0.3)
    assert time.monotonic() - started < 2.0
    assert info.value.retryable


async def test_a_body_that_drips_past_the_deadline_is_a_timeout(client, raw_server) -> None:
    server = await raw_server(drip_script)
    started = time.monotonic()
    with pytest.raises(UpstreamTimeout, match="^upstream timeout$"):
        await get(client, f"http://api.test:{server.port}/orders", timeout_s=0.6)
    assert time.monotonic() - started < 2.0
    assert server.body_bytes_sent >= 3  # it was dripping (each read fast), not stalled


@pytest.mark.parametrize(
    ("code", "reason", "advice_part"),
    [
        (500, r"^upstream error \(500\)$", "cannot reach"),
        (503, r"^upstream error \(503\)$", "cannot reach"),
        # the server answers {"error": "nope"}: quoted for 400/404/409/422, never for the others
        (404, r'^not found \(404\); the service said: "nope"$', "double-check the identifier"),
        (401, r"^upstream refused credentials \(401\)$", "credentials"),
        (403, r"^upstream refused credentials \(403\)$", "credentials"),
        (429, r"^upstream rate limited \(429\)$", "try again"),
        (400, r'^upstream rejected the request \(400\); the service said: "nope"$', "Check the details"),
    ],
)
async def test_error_statuses_map_to_upstream_status_with_actionable_advice(
    client, upstream, code: int, reason: str, advice_part: str
) -> None:
    with pytest.raises(UpstreamStatus, match=reason) as info:
        await get(client, upstream.base_for("api.test") + f"/status/{code}")
    assert info.value.status == code
    assert advice_part in info.value.advice
    assert info.value.retryable == (code >= 500 or code == 429)


async def test_malformed_json_is_upstream_malformed(client, upstream) -> None:
    with pytest.raises(UpstreamMalformed, match="^upstream returned malformed json$"):
        await get(client, upstream.base_for("api.test") + "/malformed")


async def test_a_text_plain_2xx_is_upstream_malformed(client, upstream) -> None:
    with pytest.raises(UpstreamMalformed, match="^upstream returned text/plain, not json$"):
        await get(client, upstream.base_for("api.test") + "/text")


@pytest.mark.parametrize("path", ["/big", "/big-declared", "/gzip-bomb"])
async def test_a_10_mb_body_is_capped_and_refused(client, upstream, path: str) -> None:
    started = time.monotonic()
    with pytest.raises(UpstreamTooLarge, match=r"^upstream response is larger than 1048576 bytes$"):
        await get(client, upstream.base_for("api.test") + path, timeout_s=10)
    assert time.monotonic() - started < 5.0


async def test_a_connection_closed_mid_body_is_upstream_unreachable(client, raw_server) -> None:
    server = await raw_server(close_mid_body_script)
    with pytest.raises(UpstreamUnreachable, match="^upstream closed the connection mid-response$"):
        await get(client, f"http://api.test:{server.port}/orders")
    assert server.connections == 1


async def test_a_hang_up_before_any_response_is_upstream_unreachable(client, raw_server) -> None:
    server = await raw_server(hang_up_script)
    with pytest.raises(UpstreamUnreachable, match="^upstream closed the connection"):
        await get(client, f"http://api.test:{server.port}/orders")


async def test_a_refused_connection_is_upstream_unreachable(client) -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens there now
    with pytest.raises(UpstreamUnreachable, match="^upstream refused the connection$") as info:
        await get(client, f"http://api.test:{port}/orders")
    assert info.value.retryable


async def test_an_unknown_host_name_is_unreachable(client) -> None:
    with pytest.raises(UpstreamUnreachable, match="could not be resolved"):
        await get(client, "http://nowhere.test/orders")


async def test_no_time_left_is_a_deadline_error_and_nothing_is_sent(client, upstream) -> None:
    with pytest.raises(DeadlineExceeded):
        await get(client, upstream.base_for("api.test") + "/orders/1", timeout_s=0)
    assert upstream.requests == []


# --------------------------------------------------------------------------- SSRF guard


async def test_a_redirect_to_a_private_target_is_not_followed(
    make_client, upstream, raw_server
) -> None:
    try:
        target = await raw_server(listen_script, host="127.0.0.2")
    except OSError:
        pytest.skip("127.0.0.2 cannot be bound here")
    upstream.redirect_to = f"http://127.0.0.2:{target.port}/steal"
    # the allowlist would even permit the target: the point is that 3xx is never followed
    client = await make_client(allow=("127.0.0.0/8",))
    with pytest.raises(
        UpstreamStatus, match=r"^upstream redirected \(302\); redirects are not followed$"
    ) as info:
        await get(client, upstream.base_for("api.test") + "/redirect")
    assert info.value.status == 302
    await asyncio.sleep(0.05)
    assert target.connections == 0 and bytes(target.received) == b""
    assert "127.0.0.2" not in str(info.value) and "steal" not in str(info.value)


async def test_a_host_name_resolving_to_loopback_is_refused_without_allowlist(
    make_client, upstream, sockets
) -> None:
    client = await make_client(allow=())
    with pytest.raises(DestinationBlocked, match="^destination not allowed$") as info:
        await get(client, upstream.base_for("internal.test") + "/orders/1")
    assert info.value.rule == "loopback address"
    assert upstream.requests == []
    assert sockets.connects == []


@pytest.mark.parametrize(
    "url",
    [
        "http://metadata.test/latest/meta-data/",
        "http://169.254.169.254/latest/meta-data/",
        "http://private.test/",
    ],
)
async def test_metadata_and_private_addresses_are_refused_before_any_connect(
    client, sockets, url: str
) -> None:
    with pytest.raises(DestinationBlocked, match="^destination not allowed$") as info:
        await get(client, url)
    assert "169.254" not in info.value.reason + info.value.advice
    assert sockets.connects == [] and sockets.refused == []


async def test_ipv6_loopback_is_refused_without_allowlist_and_reachable_with_it(
    make_client, raw_server, sockets
) -> None:
    try:
        server = await raw_server(listen_script, host="::1")
    except OSError:
        pytest.skip("::1 is not available here")
    blocked_client = await make_client(allow=LOOPBACK_ONLY)
    for url in (f"http://[::1]:{server.port}/x", f"http://v6.test:{server.port}/x"):
        with pytest.raises(DestinationBlocked, match="^destination not allowed$"):
            await get(blocked_client, url)
    assert server.connections == 0 and sockets.connects == []

    allowed_client = await make_client(allow=("::1/128",))
    response = await get(allowed_client, f"http://[::1]:{server.port}/x")
    assert response.json == {}
    assert server.connections == 1
    assert sockets.connects == ["::1"]


async def test_userinfo_in_the_url_is_refused(client, upstream) -> None:
    with pytest.raises(DestinationBlocked):
        await get(client, f"http://user:pw@api.test:{upstream.port}/orders/1")
    assert upstream.requests == []


# --------------------------------------------------------------------------- secrets


SECRET = "Bearer sk-live-SUPERSECRET-42"


async def test_auth_header_arrives_decrypted_and_appears_in_no_log_line(client, upstream) -> None:
    box = SecretBox([generate_key()])
    ciphertext = box.encrypt(SECRET)
    tool = webhook_tool(
        upstream.base_for("api.test") + "/orders/{order_id}", auth_header_enc=ciphertext
    )
    with structlog.testing.capture_logs() as logs:
        response = await client.call_webhook(tool, {"order_id": "A-1"}, box, 3.0)
    assert response.json["order_id"] == "A-1"
    assert upstream.requests[0]["headers"]["Authorization"] == SECRET
    assert any(entry["event"] == "webhook_call_completed" for entry in logs)
    assert "SUPERSECRET" not in repr(logs) and ciphertext not in repr(logs)


@pytest.mark.parametrize("path", ["/status/401", "/status/500", "/slow", "/malformed"])
async def test_auth_header_appears_in_no_error_text_or_log(client, upstream, path: str) -> None:
    box = SecretBox([generate_key()])
    tool = webhook_tool(
        upstream.base_for("api.test") + path, auth_header_enc=box.encrypt(SECRET), timeout_ms=400
    )
    with structlog.testing.capture_logs() as logs, pytest.raises(ToolError) as info:
        await client.call_webhook(tool, {}, box)
    error = info.value
    assert error.tool_name == "check_order"
    rendered = "".join(traceback.format_exception(error)) + error.advice + repr(error.__dict__)
    assert "SUPERSECRET" not in rendered
    assert any(entry["event"] == "webhook_call_failed" for entry in logs)
    assert "SUPERSECRET" not in repr(logs)


async def test_an_auth_header_no_key_opens_fails_the_call_before_anything_is_sent(
    client, upstream
) -> None:
    ciphertext = SecretBox([generate_key()]).encrypt(SECRET)
    tool = webhook_tool(
        upstream.base_for("api.test") + "/orders/{order_id}", auth_header_enc=ciphertext
    )
    with pytest.raises(ToolError, match="^tool credentials cannot be decrypted$") as info:
        await client.call_webhook(tool, {"order_id": "1"}, SecretBox([generate_key()]))
    assert ciphertext not in str(info.value)
    assert upstream.requests == []


async def test_query_values_in_the_url_never_reach_error_texts_or_logs(client, upstream) -> None:
    with structlog.testing.capture_logs() as logs, pytest.raises(UpstreamStatus) as info:
        await get(client, upstream.base_for("api.test") + "/status/500?api_key=QUERYSECRET")
    assert "QUERYSECRET" not in str(info.value) + info.value.advice
    assert "QUERYSECRET" not in repr(logs)


async def test_the_tool_timeout_bounds_call_webhook_and_names_the_tool(client, upstream) -> None:
    tool = webhook_tool(upstream.base_for("api.test") + "/slow", timeout_ms=300)
    started = time.monotonic()
    with pytest.raises(UpstreamTimeout) as info:
        await client.call_webhook(tool, {}, None, 30.0)
    assert time.monotonic() - started < 2.0
    assert info.value.tool_name == "check_order"


# --------------------------------------------------------------------------- bindings


async def test_binding_sends_backend_names_from_parameter_map_and_trusted_scope(
    client, upstream
) -> None:
    tool = BackendBindingTool(
        name="example_catalog_search",
        description="Search the catalog.",
        parameters={"search": {"type": "string"}, "limit": {"type": "integer"}},
        mutability="read",
        method="GET",
        path="/example/catalog",
        parameter_map={"search": "q", "limit": "per_page"},
        scope=("account_id",),
    )
    await client.call_binding(
        upstream.base_for("api.test"),
        tool,
        {"search": "red shoes", "limit": 5, "account_id": "other-account"},
        {"account_id": "account-a"},
        {"X-Backend-Key": "k"},
    )
    seen = upstream.requests[0]
    assert seen["raw_path"].startswith("/example/catalog?")
    assert seen["query"] == {"q": ["red shoes"], "per_page": ["5"], "account_id": ["account-a"]}
    assert "search" not in seen["query"]
    assert "other-account" not in seen["raw_path"]
    assert seen["headers"]["X-Backend-Key"] == "k"


async def test_binding_model_supplied_account_never_reaches_the_backend_seed_001(
    client, upstream
) -> None:
    tool = BackendBindingTool(
        name="update_listing",
        description="Update a listing.",
        parameters={},
        mutability="write",
        method="POST",
        path="/listings",
        scope=("account_id", "listing_id"),
    )
    await client.call_binding(
        upstream.base_for("api.test"),
        tool,
        {"account_id": "other-account", "listing_id": "other-property"},
        {"account_id": "account-a", "listing_id": "property-a"},
        {},
    )
    seen = upstream.requests[0]
    assert json.loads(seen["body"]) == {"account_id": "account-a", "listing_id": "property-a"}
    assert "other-" not in seen["body"] + seen["raw_path"]


async def test_binding_without_its_trusted_scope_sends_nothing(client, upstream) -> None:
    tool = BackendBindingTool(
        name="t", description="d", parameters={}, path="/example/catalog", scope=("account_id",)
    )
    with pytest.raises(PolicyDenied) as info:
        await client.call_binding(upstream.base_for("api.test"), tool, {"account_id": "x"}, {}, {})
    assert info.value.tool_name == "t"
    assert upstream.requests == []


async def test_binding_goes_through_the_same_guard(make_client, upstream) -> None:
    client = await make_client(allow=())
    tool = BackendBindingTool(name="t", description="d", parameters={}, path="/example/catalog")
    with pytest.raises(DestinationBlocked):
        await client.call_binding(upstream.base_for("api.test"), tool, {}, {}, {})
    assert upstream.requests == []


async def test_a_body_echoing_the_credentials_reaches_the_model_and_the_record_redacted(client, upstream) -> None:
    # before, the decrypted header went into the tool result the model reads and ce_tool_calls
    from services.botconfig import BotConfig
    from services.tools.executor import Executor, ToolCall
    from services.tools.registry import HandlerRegistry, build_catalog
    from services.tools.toolset import SessionToolState

    box = SecretBox([generate_key()])
    secret = 'Token realm="shop", key=sk-live-SUPERSECRET-42'  # JSON escapes its quotes: both forms go
    tool = WebhookTool(name="lookup", description="look up", parameters={"type": "object", "properties": {}},
                       webhook_url=upstream.base_for("api.test") + "/echo-headers", auth_header_enc=box.encrypt(secret))
    catalog = build_catalog([], [(tool, 1)], registry=HandlerRegistry(),
                            backend=WebhookToolBackend(client, secret_box=box))
    executor = Executor()
    plan = await executor.prepare([ToolCall(id="c1", name="lookup", arguments={})], catalog=catalog, config=BotConfig(),
                                  session=SessionToolState(), scope={})
    [outcome] = await executor.execute(plan, TrustedContext(tenant_id="t1", session_id="s1", message_id="m1"))
    assert upstream.requests[-1]["headers"]["Authorization"] == secret  # sent as configured
    assert outcome.success, outcome.content
    echoed = json.loads(outcome.content)
    assert echoed["you_sent"]["Authorization"] == "[redacted]"
    assert echoed["token"] == "[redacted]"  # the credential alone ('realm="shop", key=...')
    assert echoed["you_sent"]["Accept"] == "application/json"  # headers that are no secret stay
    assert outcome.record.result == echoed
    assert "SUPERSECRET" not in outcome.content and "SUPERSECRET" not in json.dumps(outcome.record.result)


async def test_a_body_echoing_a_bindings_backend_credentials_is_redacted(client, upstream) -> None:
    backend = WebhookToolBackend(
        client, secret_box=None, binding_base_url=upstream.base_for("api.test"),
        binding_headers={"Authorization": "Bearer backend-SUPERSECRET-7", "X-Api-Key": "apikey-SUPERSECRET-8",
                         "X-Shop": "berlin-store"},
    )
    binding = BackendBindingTool(name="b", description="d", parameters={}, path="/echo-headers")
    result = await backend.call_binding(binding, {}, ctx=TrustedContext(tenant_id="t1", session_id="s1"),
                                        timeout_s=2.0, idempotency_key=None)
    sent = result["you_sent"]
    assert (sent["Authorization"], sent["X-Api-Key"], result["token"]) == ("[redacted]",) * 3
    assert sent["X-Shop"] == "berlin-store"  # a header with an ordinary name is no secret
    assert "SUPERSECRET" not in json.dumps(result)


@pytest.mark.parametrize("code", [200, 400])
async def test_a_credential_in_the_urls_query_is_never_echoed_back(client, upstream, code: int) -> None:
    # `?api_key=...` written into webhook_url by the tenant: an upstream quoting the url it was
    # called with put the key in the 4xx explanation (and a 2xx body) the model reads
    key = "sk_live_QUERY/SECRET+42"  # the upstream reads `+` as a space: either form is scrubbed
    template = upstream.base_for("api.test") + f"/echo-url/{code}?api_key={key}&order={{order_id}}"
    try:
        answer = await get(client, template, order_id="A-1001")
        text = json.dumps(answer.json)
    except UpstreamStatus as error:
        text = str(error)
    assert upstream.requests[-1]["query"]["api_key"] == [key.replace("+", " ")]  # sent as configured
    assert "QUERY/SECRET" not in text and "QUERY%2FSECRET" not in text, text
    assert "[redacted]" in text and "order=A-1001" in text  # what the model supplied is not scrubbed


async def test_a_credential_escaped_by_a_php_upstream_is_still_redacted(client, upstream) -> None:
    # base64-style keys hold "/", which PHP's json_encode writes as "\/": the raw body then held
    # neither form the scrubber looked for, and the decoded answer gave the key back
    key, token = "sk_live_AbC/dEf+GhI==", "tok/SECRET/0123456789"
    answer = await client.call(url_template=upstream.base_for("api.test") + f"/php-echo?api_key={key}",
                               method="GET", args={}, headers={"Authorization": f"Bearer {token}"}, timeout_s=3)
    text = json.dumps(answer.json)
    assert "AbC" not in text and "SECRET" not in text, text
    assert answer.json["auth"] == "[redacted]"


async def test_query_values_that_are_no_credential_are_not_scrubbed_from_the_answer(client, upstream) -> None:
    # `?expand=customer`: before, every "customer" in the answer became "[redacted]", keys too
    answer = await client.call(url_template=upstream.base_for("api.test") + "/php-echo?expand=customer&v=2024-10-21",
                               method="GET", args={}, headers={}, timeout_s=3)
    assert answer.json["customer"] == "expand me"
    assert answer.json["you_called"] == "/php-echo?expand=customer&v=2024-10-21"


# --------------------------------------------------------------------------- the registry's port


async def test_tool_backend_port_answers_json_and_fills_scope_from_the_trusted_context(
    client, upstream
) -> None:
    box = SecretBox([generate_key()])
    backend = WebhookToolBackend(
        client,
        secret_box=box,
        binding_base_url=lambda ctx: upstream.base_for("api.test"),
        binding_headers={"X-Backend-Key": "k"},
    )
    tool = webhook_tool(
        upstream.base_for("api.test") + "/orders/{order_id}", auth_header_enc=box.encrypt(SECRET)
    )
    assert await backend.call_webhook(
        tool, {"order_id": "7"}, timeout_s=2.0, idempotency_key=None
    ) == {
        "order_id": "7",
        "status": "shipped",
    }
    assert upstream.requests[-1]["headers"]["Authorization"] == SECRET

    binding = BackendBindingTool(
        name="example_catalog_search",
        description="d",
        parameters={},
        path="/example/catalog",
        parameter_map={"search": "q"},
        scope=("account_id",),
    )
    ctx = TrustedContext(
        tenant_id="t1", session_id="s1", scope={"account_id": "account-a"}, idempotency_key="m1:0"
    )
    result = await backend.call_binding(
        binding,
        {"search": "x", "account_id": "other"},
        ctx=ctx,
        timeout_s=2.0,
        idempotency_key=ctx.idempotency_key,
    )
    assert result == {"ok": True}
    seen = upstream.requests[-1]
    assert seen["query"] == {"q": ["x"], "account_id": ["account-a"]}
    assert seen["headers"]["Idempotency-Key"] == "m1:0"


async def test_tool_backend_without_a_backend_url_refuses_bindings(client, upstream) -> None:
    backend = WebhookToolBackend(client, secret_box=None)
    binding = BackendBindingTool(name="b", description="d", parameters={}, path="/example/catalog")
    ctx = TrustedContext(tenant_id="t1", session_id="s1")
    with pytest.raises(ToolError, match="no backend is configured") as info:
        await backend.call_binding(binding, {}, ctx=ctx, timeout_s=1.0, idempotency_key=None)
    assert info.value.tool_name == "b"
    assert upstream.requests == []


def test_a_2xx_body_nested_too_deeply_is_upstream_malformed_not_a_crash() -> None:
    # 10 KB of [[[[...]]]]: msgspec raises RecursionError, which escaped as a crash (and made the
    # notifier re-send an event its receiver had accepted, and left a workflow's job pending)
    from services.tools.webhook import _decode_json

    with pytest.raises(UpstreamMalformed, match="nested too deeply"):
        _decode_json(b"[" * 5000 + b"]" * 5000, "application/json")
    assert _decode_json(b"[" * 50 + b"]" * 50, "application/json") is not None
