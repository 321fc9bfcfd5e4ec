"""The operations routes: liveness, readiness, Prometheus metrics and /openapi.json."""

from __future__ import annotations

import hmac
import ipaddress

import structlog
from aiohttp import web

from kernel.errors import Forbidden, Unauthorized
from services.gateway.common import DEPS, json_response, problem
from services.gateway.openapi import openapi_document

log = structlog.get_logger(__name__)


async def healthz(request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    deps = request.app[DEPS]
    ok = True if deps.ready is None else await deps.ready()
    if not ok:
        return problem(503, "Not ready", "the database or the session hosts are not reachable yet")
    return json_response({"status": "ready"})


def metrics_refusal(remote: str | None, authorization: str | None, token: str | None) -> Exception | None:
    """Why GET /metrics is refused to this peer, or None. Its `tool` labels name every tenant's
    tools, and each scrape costs a stats read of every host: with an operator token set
    (CE_METRICS_TOKEN) only a scraper sending it reads them; without one, only a loopback peer."""
    if token is not None:
        if hmac.compare_digest((authorization or "").encode(), f"Bearer {token}".encode()):
            return None
        return Unauthorized("GET /metrics needs the operator token: send 'Authorization: Bearer <CE_METRICS_TOKEN>'")
    try:
        if remote is not None and ipaddress.ip_address(remote.split("%")[0]).is_loopback:
            return None
    except ValueError:
        pass
    return Forbidden("GET /metrics answers only loopback peers when no operator token is set: set "
                     "CE_METRICS_TOKEN on the gateway and scrape with 'Authorization: Bearer <token>'")


async def metrics(request: web.Request) -> web.Response:
    deps = request.app[DEPS]
    refused = metrics_refusal(request.remote, request.headers.get("Authorization"), deps.metrics_token)
    if refused is not None:
        raise refused
    # the hosts the shard count says exist: one that did not answer in time is reported down
    expected = deps.router.host_names() if hasattr(deps.router, "host_names") else ()
    try:
        stats = await deps.router.stats()
    except Exception:  # metrics must render even when the stats read fails
        log.warning("host_stats_unavailable", exc_info=True)
        stats = []  # every expected host is then reported down, with its last values
    deps.metrics.observe_hosts(stats, expected=expected)
    return web.Response(body=deps.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"})


async def openapi(request: web.Request) -> web.Response:
    routes = tuple(
        (r.method, r.resource.canonical, (r.handler.__doc__ or "").strip().split("\n")[0])
        for r in request.app.router.routes() if r.resource is not None
    )
    return json_response(openapi_document(routes))


def add_ops_routes(app: web.Application) -> None:
    """Register the routes above on the gateway app (called once from build_app)."""
    r = app.router
    r.add_get("/healthz", healthz)
    r.add_get("/readyz", readyz)
    r.add_get("/metrics", metrics)
    r.add_get("/openapi.json", openapi)
