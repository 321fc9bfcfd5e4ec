"""Admin routes of MCP tool sources: a tenant registers remote MCP servers (streamable HTTP).

    POST   /v1/mcp-servers          body: McpServerIn (the auth header is write-only)
    GET    /v1/mcp-servers          the registrations
    GET    /v1/mcp-servers/{name}   one registration and its tools as the running catalog has them
    PATCH  /v1/mcp-servers/{name}   body: McpServerPatch (e.g. {"enabled": false})
    DELETE /v1/mcp-servers/{name}

A server's tools are listed from the server when a session host loads the tenant's catalog and are
offered as `<name>__<tool>`. Only the tools named in `read_only_tools` are reads; every other tool
of the server is a write held for approval, whatever the server's annotations say.

Tenant-scoped like every /v1 route (request[TENANT]). The auth header is encrypted before it is
stored and never returned (`auth_header_set` says whether there is one). It follows a PATCH of
`url` only on the same origin (scheme, host, port): a move elsewhere must send `auth_header` again
(or null), else 422. Errors are domain errors, made problem+json by services.gateway.middleware.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp import web

from kernel.errors import InvalidInput, NotFound
from kernel.records import McpServerRecord
from services.gateway.bodies import check_credential_stays
from services.gateway.bodies import check_url as check_destination
from services.gateway.common import (
    DEPS,
    TENANT,
    decode_body,
    json_response,
    page_of,
    paged,
    tenant_policy,
)
from services.tools.mcp import DEFAULT_TIMEOUT_MS, ORIGIN, SEPARATOR, check_server_name
from storage.repos.mcp_servers import MAX_SERVERS_PER_TENANT, McpServerRepo

MAX_TIMEOUT_MS = 60_000
MAX_NAMES = 256
UNSET: Any = msgspec.UNSET

MCP_REPO = web.AppKey("mcp_servers", McpServerRepo)


class McpServerIn(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/mcp-servers."""

    name: str
    url: str
    auth_header: str | None = None  # e.g. "Bearer …", sent as Authorization; write-only
    enabled: bool = True
    read_only_tools: list[str] = []  # remote tool names the tenant vouches for as read-only
    include_tools: list[str] | None = None  # only these remote tools (None: all)
    intents: list[str] = []
    timeout_ms: int = DEFAULT_TIMEOUT_MS


class McpServerPatch(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """PATCH /v1/mcp-servers/{name}: the fields given change; `auth_header: null` removes it."""

    url: str | msgspec.UnsetType = UNSET
    auth_header: str | None | msgspec.UnsetType = UNSET
    enabled: bool | msgspec.UnsetType = UNSET
    read_only_tools: list[str] | msgspec.UnsetType = UNSET
    include_tools: list[str] | None | msgspec.UnsetType = UNSET
    intents: list[str] | msgspec.UnsetType = UNSET
    timeout_ms: int | msgspec.UnsetType = UNSET


def _repo(request: web.Request) -> McpServerRepo:
    repo = request.app.get(MCP_REPO)
    if repo is None:
        raise NotFound("mcp servers cannot be managed in this process", kind="route", key=request.path)
    return repo


async def check_url(request: web.Request, url: str) -> str:
    """`url` when it is an http(s) URL with a host and no credentials, and its host is not an IP
    literal the SSRF guard refuses, the tenant's egress allowances counted (as for webhook tools);
    raises InvalidInput naming the problem.

    A host name is checked by the guard on every connection (it may resolve differently later).
    """
    if len(url) > 2048:
        raise InvalidInput("url is longer than 2048 characters - at `$.url`", path="$.url")
    if "{" in url or "}" in url:
        raise InvalidInput("url must be a plain URL without { or } - at `$.url`", path="$.url")
    policy = await tenant_policy(request.app[DEPS], request[TENANT])
    check_destination(url, field="url", policy=policy, example="https://mcp.example.com/mcp")
    return url


def _check_names(values: list[str] | None, field: str) -> None:
    if values is None:
        return
    if len(values) > MAX_NAMES:
        raise InvalidInput(f"{field} names more than {MAX_NAMES} entries - at `$.{field}`", path=f"$.{field}")
    for value in values:
        if not value or len(value) > 128:
            raise InvalidInput(f"{field} entries must be 1-128 characters - at `$.{field}`", path=f"$.{field}")


def _check_timeout(timeout_ms: int) -> None:
    if not 100 <= timeout_ms <= MAX_TIMEOUT_MS:
        raise InvalidInput(f"timeout_ms must be between 100 and {MAX_TIMEOUT_MS}, got {timeout_ms} - at "
                           "`$.timeout_ms`", path="$.timeout_ms")


def _encrypt(request: web.Request, plaintext: str) -> str:
    box = request.app[DEPS].secret_box
    if box is None:
        raise InvalidInput("this engine has no CE_SECRET_KEY, so it cannot store auth headers; set it and restart")
    return box.encrypt(plaintext)


def _view(record: McpServerRecord) -> dict[str, Any]:
    view = msgspec.to_builtins(record)
    view.pop("tenant_id", None)
    view["auth_header_set"] = bool(view.pop("auth_header_enc", None))
    view["tool_prefix"] = f"{record.name}{SEPARATOR}"
    return view


async def create_server(request: web.Request) -> web.Response:
    body: McpServerIn = await decode_body(request, McpServerIn)
    check_server_name(body.name)
    await check_url(request, body.url)
    _check_names(body.read_only_tools, "read_only_tools")
    _check_names(body.include_tools, "include_tools")
    _check_timeout(body.timeout_ms)
    enc = _encrypt(request, body.auth_header) if body.auth_header else None
    record = McpServerRecord(
        tenant_id=request[TENANT], name=body.name, url=body.url, auth_header_enc=enc, enabled=body.enabled,
        read_only_tools=tuple(body.read_only_tools),
        include_tools=tuple(body.include_tools) if body.include_tools is not None else None,
        intents=tuple(body.intents), timeout_ms=body.timeout_ms,
    )
    return json_response(_view(await _repo(request).create(record)), status=201)


async def list_servers(request: web.Request) -> web.Response:
    limit, cursor = page_of(request, default=MAX_SERVERS_PER_TENANT)  # by default, every one
    records, next_cursor = paged(await _repo(request).list(request[TENANT], after=cursor, limit=limit + 1),
                                 limit, lambda record: record.name)
    return json_response({"mcp_servers": [_view(r) for r in records], "next_cursor": next_cursor})


async def get_server(request: web.Request) -> web.Response:
    """The registration, plus `tools`: this server's entries of the tool-contract report (what
    the running catalog of a session host loaded from it, or why it could not)."""
    tenant_id = request[TENANT]
    record = await _repo(request).get(tenant_id, request.match_info["name"])
    view = _view(record)
    contract = request.app[DEPS].contract
    if contract is not None and record.enabled:
        prefix = f"{record.name}{SEPARATOR}"
        report = await contract(tenant_id)
        view["tools"] = [t for t in report.get("tools", [])
                         if t.get("origin") == ORIGIN and t.get("name", "").startswith(prefix)]
    else:
        view["tools"] = []
    return json_response(view)


async def patch_server(request: web.Request) -> web.Response:
    patch: McpServerPatch = await decode_body(request, McpServerPatch)
    changes: dict[str, Any] = {}
    if patch.url is not UNSET:
        changes["url"] = await check_url(request, patch.url)
    if patch.auth_header is not UNSET:
        changes["auth_header_enc"] = _encrypt(request, patch.auth_header) if patch.auth_header else None
    if patch.enabled is not UNSET:
        changes["enabled"] = patch.enabled
    if patch.read_only_tools is not UNSET:
        _check_names(patch.read_only_tools, "read_only_tools")
        changes["read_only_tools"] = tuple(patch.read_only_tools)
    if patch.include_tools is not UNSET:
        _check_names(patch.include_tools, "include_tools")
        changes["include_tools"] = tuple(patch.include_tools) if patch.include_tools is not None else None
    if patch.intents is not UNSET:
        changes["intents"] = tuple(patch.intents)
    if patch.timeout_ms is not UNSET:
        _check_timeout(patch.timeout_ms)
        changes["timeout_ms"] = patch.timeout_ms
    # a new url without a new auth_header keeps the stored one: only on its origin. Judged on the
    # row as the update finds it (locked), not on an earlier read, so a header another request
    # stores meanwhile cannot ride along to the new host.
    check = _header_stays_for(patch.url) if patch.url is not UNSET and patch.auth_header is UNSET else None
    record = await _repo(request).update(request[TENANT], request.match_info["name"], changes, check=check)
    return json_response(_view(record))


def _header_stays_for(new_url: str) -> Callable[[McpServerRecord], None]:
    """A check for McpServerRepo.update: raises InvalidInput at `$.auth_header` when the stored
    header would follow the registration to `new_url` on another origin."""
    def check(current: McpServerRecord) -> None:
        if current.auth_header_enc:
            check_credential_stays(current.url, new_url, url_field="url", credential_field="auth_header",
                                   without="auth_header: null")
    return check


async def delete_server(request: web.Request) -> web.Response:
    await _repo(request).delete(request[TENANT], request.match_info["name"])
    return web.Response(status=204)


def add_mcp_routes(app: web.Application) -> None:
    """Register the routes above on the gateway app (called once from build_app).

    The repository shares the gateway's pool, taken from its bot-config repository (GatewayDeps
    names no pool); without one (a gateway built on fakes) the routes answer 404.
    """
    pool = getattr(app[DEPS].configs, "_pool", None)
    if pool is not None:
        app[MCP_REPO] = McpServerRepo(pool)
    r = app.router
    r.add_post("/v1/mcp-servers", create_server)
    r.add_get("/v1/mcp-servers", list_servers)
    r.add_get("/v1/mcp-servers/{name}", get_server)
    r.add_patch("/v1/mcp-servers/{name}", patch_server)
    r.add_delete("/v1/mcp-servers/{name}", delete_server)
