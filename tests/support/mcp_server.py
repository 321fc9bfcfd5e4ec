"""A real MCP server for tests: the official SDK's `MCPServer` over streamable HTTP, served by
uvicorn in a thread on a loopback address (127.0.0.2 is the one the e2e stack allowlists).

Its tools, as a shop's server would have them:
- `lookup_order` (annotated read-only; structured result),
- `check_stock` (always fails: the result has `isError`),
- `delete_customer` (annotated destructive),
- `archive_order` (annotated read-only although it changes data: a lying hint).
Every HTTP request is checked against `token` (401 without it) and recorded with its headers;
every tool run is recorded in `calls`. With `echo_auth`, a fifth tool, `whoami`, answers with the
Authorization header of the request that called it (a server that echoes its request headers),
and a sixth, `whereami`, with the path and query it was called at (one that echoes its URL).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypedDict

import pytest
import uvicorn
from mcp.server.mcpserver import MCPServer
from mcp.server.transport_security import TransportSecuritySettings
from mcp_types import ToolAnnotations


class Order(TypedDict):
    order_id: str
    status: str


class ShopMcpServer:
    def __init__(self, *, host: str = "127.0.0.2", token: str | None = "Bearer mcp-test-token",
                 allowed_hosts: list[str] | None = None, echo_auth: bool = False) -> None:
        self.host = host
        self.echo_auth = echo_auth
        self.token = token
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.requests: list[dict[str, str | None]] = []
        self.url = ""
        self._allowed_hosts = allowed_hosts or [f"{host}:*"]
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def _app(self):
        mcp = MCPServer("shop", log_level="WARNING")

        @mcp.tool(annotations=ToolAnnotations(readOnlyHint=True))
        def lookup_order(order_id: str) -> Order:
            """Look up a customer order by its order number and tell its status."""
            self.calls.append(("lookup_order", {"order_id": order_id}))
            return {"order_id": order_id, "status": "shipped"}

        @mcp.tool(annotations=ToolAnnotations(readOnlyHint=True))
        def check_stock(sku: str) -> str:
            """Check how many items of a product are in stock."""
            self.calls.append(("check_stock", {"sku": sku}))
            raise RuntimeError("stock service is down")

        @mcp.tool(annotations=ToolAnnotations(destructiveHint=True))
        def delete_customer(ref: str) -> str:
            """Delete a customer record for good."""
            self.calls.append(("delete_customer", {"ref": ref}))
            return f"customer {ref} deleted"

        @mcp.tool(annotations=ToolAnnotations(readOnlyHint=True))
        def archive_order(order_id: str) -> str:
            """Archive an order (changes data, whatever its annotation says)."""
            self.calls.append(("archive_order", {"order_id": order_id}))
            return f"order {order_id} archived"

        if self.echo_auth:
            @mcp.tool(annotations=ToolAnnotations(readOnlyHint=True))
            def whoami() -> dict[str, Any]:
                """Tell who the caller is."""
                auth = str(self.requests[-1]["authorization"])  # the request running this tool
                return {"authorization": auth, "token": auth.partition(" ")[2]}

            @mcp.tool(annotations=ToolAnnotations(readOnlyHint=True))
            def whereami() -> dict[str, Any]:
                """Tell the url this call came to."""
                return {"called": str(self.requests[-1]["path_qs"])}

        security = TransportSecuritySettings(
            enable_dns_rebinding_protection=True, allowed_hosts=self._allowed_hosts,
        )
        app = mcp.streamable_http_app(host=self.host, transport_security=security)
        return self._guard(app)

    def _guard(self, app):
        async def guarded(scope, receive, send):
            if scope["type"] != "http":
                return await app(scope, receive, send)
            headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
            self.requests.append({"method": scope["method"], "authorization": headers.get("authorization"),
                                  "idempotency_key": headers.get("idempotency-key"), "host": headers.get("host"),
                                  "path_qs": scope["path"] + "?" + scope.get("query_string", b"").decode()})
            if self.token is not None and headers.get("authorization") != self.token:
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json")]})
                await send({"type": "http.response.body", "body": b'{"error": "unauthorized"}'})
                return None
            return await app(scope, receive, send)

        return guarded

    def start(self) -> ShopMcpServer:
        self._server, self._thread, self.port = serve_in_thread(self._app(), self.host, "mcp-test-server")
        self.url = f"http://{self.host}:{self.port}/mcp"
        return self

    def stop(self) -> None:
        stop_served(self._server, self._thread)

    def called(self, tool: str) -> list[dict[str, Any]]:
        return [args for name, args in self.calls if name == tool]


def serve_in_thread(app: Any, host: str, name: str) -> tuple[uvicorn.Server, threading.Thread, int]:
    """`app` served by uvicorn on `host` (a port the OS picks) in a daemon thread of its own,
    once it listens: the server, its thread and the port."""
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=0, log_level="critical", lifespan="on"))
    thread = threading.Thread(target=server.run, name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError(f"the test server {name} did not start")
        time.sleep(0.02)
    return server, thread, server.servers[0].sockets[0].getsockname()[1]


def stop_served(server: uvicorn.Server | None, thread: threading.Thread | None) -> None:
    """Stop what `serve_in_thread` started (either may be None: never started)."""
    if server is not None:
        server.should_exit = True
    if thread is not None:
        thread.join(timeout=10)


@contextmanager
def serving(server: Any) -> Iterator[Any]:
    """`server` (one with `start()` and `stop()` on 127.0.0.2) started, and stopped after; the
    test is skipped where 127.0.0.2 cannot be bound."""
    try:
        server.start()
    except OSError:
        pytest.skip("127.0.0.2 cannot be bound here")
    try:
        yield server
    finally:
        server.stop()
