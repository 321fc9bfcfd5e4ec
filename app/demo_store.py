"""The demo store backend `make run` starts on loopback: orders and a catalog, with an OpenAPI doc.

It is what seed 000's `check_order` example calls (`GET /api/orders/{order_id}`) and what seed
001's catalog-search binding calls (`GET /example/catalog?q=&per_page=`). Deterministic data; a
real HTTP server, nothing mocked.
"""

from __future__ import annotations

import argparse
import hashlib

from aiohttp import web

STATUSES = ("processing", "shipped", "out for delivery", "delivered")
PRODUCTS = [
    {"sku": "MUG-01", "name": "Blue ceramic mug", "price": 12.5},
    {"sku": "MUG-02", "name": "Travel mug", "price": 19.0},
    {"sku": "TEE-01", "name": "Logo t-shirt", "price": 24.0},
    {"sku": "CAP-01", "name": "Baseball cap", "price": 16.0},
    {"sku": "BAG-01", "name": "Canvas tote bag", "price": 14.0},
]

OPENAPI = {
    "openapi": "3.1.0",
    "info": {"title": "demo store", "version": "1"},
    "paths": {
        "/api/orders/{order_id}": {"get": {"parameters": [
            {"name": "order_id", "in": "path", "required": True, "schema": {"type": "string"}}]}},
        "/example/catalog": {"get": {"parameters": [
            {"name": "q", "in": "query", "required": True, "schema": {"type": "string"}},
            {"name": "per_page", "in": "query", "required": False, "schema": {"type": "integer"}},
            {"name": "tenant_id", "in": "query", "required": True, "schema": {"type": "string"}}]}},
    },
}


def order(order_id: str) -> dict:
    digest = hashlib.sha256(order_id.encode()).digest()
    return {
        "order_id": order_id,
        "status": STATUSES[digest[0] % len(STATUSES)],
        "eta": f"2026-12-{(digest[1] % 20) + 5:02d}",
        "items": 1 + digest[2] % 3,
    }


async def get_order(request: web.Request) -> web.Response:
    order_id = request.match_info["order_id"]
    if not order_id.isdigit():
        return web.json_response({"error": "order not found"}, status=404)
    return web.json_response(order(order_id))


async def catalog(request: web.Request) -> web.Response:
    q = request.query.get("q", "").lower()
    per_page = int(request.query.get("per_page", "10") or 10)
    hits = [p for p in PRODUCTS if q and q in p["name"].lower()] if q else []
    return web.json_response({"query": q, "tenant_id": request.query.get("tenant_id"), "results": hits[:per_page]})


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(OPENAPI)


def make_app() -> web.Application:
    app = web.Application()
    app.router.add_get("/api/orders/{order_id}", get_order)
    app.router.add_get("/example/catalog", catalog)
    app.router.add_get("/openapi.json", openapi)
    return app


class DemoStore:
    def __init__(self, runner: web.AppRunner, url: str) -> None:
        self._runner = runner
        self.url = url

    async def stop(self) -> None:
        await self._runner.cleanup()


async def start_demo_store(host: str = "127.0.0.2", port: int = 0) -> DemoStore:
    """Serve the demo store on loopback; returns it with its base URL."""
    runner = web.AppRunner(make_app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    return DemoStore(runner, f"http://{host}:{bound}")


def main() -> None:
    parser = argparse.ArgumentParser(description="the demo store backend")
    parser.add_argument("--host", default="127.0.0.2")
    parser.add_argument("--port", type=int, default=8090)
    args = parser.parse_args()
    web.run_app(make_app(), host=args.host, port=args.port)


if __name__ == "__main__":  # pragma: no cover
    main()
