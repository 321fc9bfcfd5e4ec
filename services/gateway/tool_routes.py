"""The tool routes: register, list, read, patch, delete, version and publish a tenant's tools, the
contract report and the tools' use."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import msgspec
from aiohttp import web

from kernel.errors import InvalidInput, NotFound
from services.builtins import DEFINITIONS as BUILTIN_DEFINITIONS
from services.gateway.bodies import (
    ToolCreate,
    ToolPatch,
    definition_from_body,
    patched_body,
    tool_view,
)
from services.gateway.common import (
    DEPS,
    TENANT,
    OutOfRange,
    decode_body,
    encrypter,
    json_response,
    page_of,
    paged,
    parse_since,
    tenant_policy,
    whole_number,
)
from services.tools.validation import schemas_checked
from storage.repos.tools import MAX_TOOLS_PER_TENANT, MAX_VERSIONS_KEPT, ToolChanged

#: the largest tool version (ce_tool_versions.version is a Postgres INTEGER)
MAX_TOOL_VERSION = 2**31 - 1
#: merges of a tool PATCH into the live version, each redone when a change was published meanwhile
#: (storage.repos.tools.ToolChanged); past the last, 409 asks for the PATCH to be sent again
PATCH_ATTEMPTS = 5
#: versions on one page by default: every one kept (the live one and the newest MAX_VERSIONS_KEPT)
VERSIONS_PAGE = MAX_VERSIONS_KEPT + 1
RESERVED_TOOL_NAMES = frozenset({"contract"})  # fixed segments under /v1/tools/
BUILTIN_TOOL_NAMES = frozenset(d.name for d in BUILTIN_DEFINITIONS)


def _published_view(row) -> dict[str, Any]:
    return tool_view(row.definition, version=row.version, extra={
        "enabled": row.enabled, "created_at": row.created_at, "updated_at": row.updated_at,
    })


async def create_tool(request: web.Request) -> web.Response:
    deps = request.app[DEPS]
    body: ToolCreate = await decode_body(request, ToolCreate)
    if body.name in RESERVED_TOOL_NAMES:
        # GET /v1/tools/contract is the contract report, so a tool of that name could never be read
        raise InvalidInput(f"name {body.name!r} is reserved by the API; choose another - at `$.name`", path="$.name")
    if body.name in BUILTIN_TOOL_NAMES:
        # a built-in wins over a tenant tool of its name, so such a tool would never run
        raise InvalidInput(f"name {body.name!r} is a built-in tool of the engine; choose another - at `$.name`",
                           path="$.name")
    definition = await schemas_checked(definition_from_body, body, encrypt=encrypter(deps),
                                       policy=await tenant_policy(deps, request[TENANT]),
                                       contact_scope=await _contact_scope(deps, request[TENANT]))
    data = msgspec.to_builtins(definition)
    version = await deps.tools.create(request[TENANT], definition.name, body.type, data)
    return json_response(tool_view(version.definition, version=version.version, extra={"published": True}), status=201)


async def _contact_scope(deps: Any, tenant_id: str) -> frozenset[str]:
    """The scope keys a verified contact's token gives this tenant's sessions (its scope_claims)."""
    stored = await deps.configs.get(tenant_id) or {}
    return frozenset(((stored.get("contact_verification") or {}).get("scope_claims") or {}).keys())


async def list_tools(request: web.Request) -> web.Response:
    deps = request.app[DEPS]
    limit, cursor = page_of(request, default=MAX_TOOLS_PER_TENANT)  # by default, every one
    rows, next_cursor = paged(await deps.tools.list_published(request[TENANT], after=cursor, limit=limit + 1),
                              limit, lambda row: row.name)
    return json_response({"tools": [_published_view(r) for r in rows], "next_cursor": next_cursor})


async def get_tool(request: web.Request) -> web.Response:
    deps = request.app[DEPS]
    row = await deps.tools.get(request[TENANT], request.match_info["name"])
    return json_response(_published_view(row))


async def patch_tool(request: web.Request) -> web.Response:
    deps = request.app[DEPS]
    tenant_id = request[TENANT]
    name = request.match_info["name"]
    patch: ToolPatch = await decode_body(request, ToolPatch)
    for attempt in range(1, PATCH_ATTEMPTS + 1):
        # Merged into the live version, and stored only while that version is still the live one:
        # a change published meanwhile (another PATCH, a rollback) is merged into again, so
        # neither is lost, and the origin rule is judged on the version the write replaces.
        current = await deps.tools.get(tenant_id, name)
        policy = await tenant_policy(deps, tenant_id)
        merged, kept_auth = patched_body(current.definition, patch, policy=policy)
        definition = await schemas_checked(definition_from_body, merged, encrypt=encrypter(deps), policy=policy,
                                           contact_scope=await _contact_scope(deps, tenant_id))
        data = msgspec.to_builtins(definition)
        if kept_auth and not data.get("auth_header_enc"):
            data["auth_header_enc"] = kept_auth
        try:
            version = await deps.tools.new_version(tenant_id, name, data, publish=patch.publish,
                                                   based_on=current)
        except ToolChanged:
            if attempt == PATCH_ATTEMPTS:
                raise  # 409: changed under it every time; the problem says to send it again
            # a moment apart, so PATCHes from several gateways that collided do not collide again in step
            await asyncio.sleep(random.uniform(0.005, 0.05) * attempt)
            continue
        # `based_on_version`: the version this PATCH was merged into, which is not the one the
        # client last read when another change (a rollback, say) was published in between
        return json_response(tool_view(version.definition, version=version.version,
                                       extra={"published": patch.publish, "based_on_version": current.version}))
    raise AssertionError("unreachable")  # the loop returns or raises


async def delete_tool(request: web.Request) -> web.Response:
    deps = request.app[DEPS]
    await deps.tools.delete(request[TENANT], request.match_info["name"])
    return web.Response(status=204)


async def tool_versions(request: web.Request) -> web.Response:
    deps = request.app[DEPS]
    limit, cursor = page_of(request, default=VERSIONS_PAGE)
    after = whole_number(cursor, name="cursor", low=0, high=MAX_TOOL_VERSION, at="?cursor") if cursor else 0
    versions, next_cursor = paged(
        await deps.tools.versions(request[TENANT], request.match_info["name"], after=after, limit=limit + 1),
        limit, lambda v: str(v.version))
    return json_response({"versions": [
        tool_view(v.definition, version=v.version, extra={"created_at": v.created_at, "published": v.published})
        for v in versions
    ], "next_cursor": next_cursor})


async def publish_tool(request: web.Request) -> web.Response:
    deps = request.app[DEPS]
    name = request.match_info["name"]
    raw = request.match_info["version"]
    try:
        version = whole_number(raw, name="version", low=1, high=MAX_TOOL_VERSION, at="{version}")
    except OutOfRange:
        # no version can be stored there, so none exists: the answer the repository gives a missing one
        raise NotFound(f"tool {name!r} has no version {raw[:20]}; list them with GET /v1/tools/{name}/versions",
                       kind="tool_version", key=f"{name}@{raw[:20]}") from None
    row = await deps.tools.publish(request[TENANT], name, version)
    return json_response(_published_view(row))


async def tool_contract(request: web.Request) -> web.Response:
    deps = request.app[DEPS]
    if deps.contract is None:
        raise NotFound("the contract report is not available in this process", kind="route", key="contract")
    report = await deps.contract(request[TENANT])
    if deps.egress is not None:  # what an operator let this tenant's tools reach beyond the guard
        report = {**report, "egress": msgspec.to_builtins(await deps.egress.list(request[TENANT]))}
    return json_response(report)


async def tool_analytics(request: web.Request) -> web.Response:
    deps = request.app[DEPS]
    since = parse_since(request.query.get("since"))
    stats = await deps.calls.stats(request[TENANT], since)
    tools = [msgspec.to_builtins(s) for s in stats]
    published = {r.name for r in await deps.tools.list_published(request[TENANT])}
    used = {t["name"] for t in tools}
    return json_response({
        "since": since.isoformat(), "tools": tools,
        "most_used": [t["name"] for t in tools[:5]],
        "never_used": sorted(published - used),
    })


def add_tool_routes(app: web.Application) -> None:
    """Register the routes above on the gateway app (called once from build_app)."""
    r = app.router
    r.add_post("/v1/tools", create_tool)
    r.add_get("/v1/tools", list_tools)
    r.add_get("/v1/tools/contract", tool_contract)
    r.add_get("/v1/tools/{name}", get_tool)
    r.add_patch("/v1/tools/{name}", patch_tool)
    r.add_delete("/v1/tools/{name}", delete_tool)
    r.add_get("/v1/tools/{name}/versions", tool_versions)
    r.add_post("/v1/tools/{name}/versions/{version}/publish", publish_tool)
    r.add_get("/v1/analytics/tools", tool_analytics)
