"""The gateway's middlewares: a request id and one problem+json answer for every failure, then the
tenant from the API key (cached by the key's digest; one Postgres lookup per key at a time)."""

from __future__ import annotations

import asyncio
import hashlib
import math
import uuid
from typing import Any

import structlog
from aiohttp import web

from services.gateway.common import (
    CHAT_ROUTES,
    CONFIG_PREFIXES,
    DEPS,
    KEY_KIND,
    MESSAGE_ID,
    REQUEST_ID,
    TENANT,
    WRITE_METHODS,
    GatewayDeps,
    count_refusal,
    failure,
    problem,
)


def _http_problem(exc: web.HTTPException, request: web.Request) -> tuple[int, str, str, dict[str, str] | None]:
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        return 405, exc.reason, f"{request.method} is not allowed on {request.path}; use {allowed}", {"Allow": allowed}
    if isinstance(exc, web.HTTPNotFound):
        return 404, exc.reason, f"there is no route {request.path}; the routes are listed in /openapi.json", None
    return exc.status, exc.reason, exc.text or exc.reason, None


@web.middleware
async def errors_middleware(request: web.Request, handler):
    request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex[:16]
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(request_id=request_id)
    request[REQUEST_ID] = request_id
    # the answer is made here, not in a helper: a stream (an idle watcher) holds this frame for
    # as long as it is open, and every frame of its chain is memory per watcher
    if "\x00" in request.path or "\x00" in request.query_string:
        # Postgres cannot store or compare a NUL character: refuse it here, not as a storage error
        response = problem(422, "Invalid request", "the URL holds a NUL character (%00); remove it")
    else:
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            status, title, detail, headers = _http_problem(exc, request)
            response = problem(status, title, detail, headers=headers)
        except Exception as exc:  # noqa: BLE001 - failure() logs what it does not know
            count_refusal(request, exc)
            status, title, detail, retry_after = failure(exc, request_id, request.path)
            retry = None if retry_after is None else {"Retry-After": str(max(1, math.ceil(retry_after)))}
            response = problem(status, title, detail, headers=retry)
    # on every answer, errors most of all: the id to quote to support and to find in the logs
    response.headers.setdefault("X-Request-Id", request_id)
    message_id = request.get(MESSAGE_ID)
    if message_id is not None and not response.prepared:
        # a turn's answer, a failed one most of all (a 503 "retry with the same message_id"):
        # the id to send again when the client sent none and the gateway made one up
        response.headers.setdefault("X-Message-Id", message_id)
    return response


@web.middleware
async def auth_middleware(request: web.Request, handler):
    if not request.path.startswith("/v1/"):
        return await handler(request)
    header = request.headers.get("Authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return problem(401, "Unauthorized", "send the tenant API key as 'Authorization: Bearer <key>'",
                       headers={"WWW-Authenticate": "Bearer"})
    deps = request.app[DEPS]
    key = key.strip()
    # keys are printable ASCII: anything else cannot match (nor be hashed or sent to Postgres as is)
    printable = key.isascii() and key.isprintable()
    digest = hashlib.sha256(key.encode()).hexdigest() if printable else ""  # no raw key kept in memory
    known = deps.key_cache.get(digest) if printable else None
    if known is None:
        holder = None
        if printable and not deps.unknown_keys.get(digest):
            holder = await _key_lookup(deps, digest, key)
            if holder is None:  # only a definite "unknown": a failed lookup raised and is not cached
                deps.unknown_keys[digest] = True
        if holder is None:
            return problem(401, "Unauthorized", "this API key is unknown or revoked; ask the tenant's operator "
                           "for a key ('chat-engine tenant add-key NAME')", headers={"WWW-Authenticate": "Bearer"})
        known = (holder.tenant.id, holder.kind)
        deps.key_cache[digest] = known
    tenant_id, kind = known
    request[TENANT] = tenant_id
    request[KEY_KIND] = kind
    structlog.contextvars.bind_contextvars(tenant_id=tenant_id)
    if kind != "admin" and (request.method, _route_of(request)) not in CHAT_ROUTES:
        return problem(403, "Forbidden", f"this is a {kind} key: it may only send messages and approvals to a "
                       f"session, read the session and watch its events; {request.method} {request.path} needs "
                       "an admin key ('chat-engine tenant add-key NAME --kind admin')")
    if request.method in WRITE_METHODS and request.path.startswith(CONFIG_PREFIXES):
        deps.admin_writes.take(tenant_id)  # Overloaded: 429 admin_rate with Retry-After
    return await handler(request)


def _route_of(request: web.Request) -> str | None:
    """The route `request` matched, as registered (`/v1/sessions/{session_id}`), or None."""
    resource = request.match_info.route.resource
    return None if resource is None else resource.canonical


async def _key_lookup(deps: GatewayDeps, digest: str, key: str) -> Any:
    """The tenant of `key`, and its kind, from Postgres, one lookup for every request that asks for the same key
    at once (a client's burst, or a flood of one bogus key before it is cached as unknown)."""
    pending = deps.key_lookups.get(digest)
    if pending is None:
        pending = asyncio.ensure_future(deps.tenants.key_holder(key))
        deps.key_lookups[digest] = pending

        def forget(done: asyncio.Future) -> None:
            deps.key_lookups.pop(digest, None)
            if not done.cancelled():
                done.exception()  # retrieved: every waiter may have gone (their requests cancelled)

        pending.add_done_callback(forget)
    return await asyncio.shield(pending)  # one waiter cancelled does not cancel the others' lookup
