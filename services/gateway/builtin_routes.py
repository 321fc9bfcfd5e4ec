"""Admin routes of the built-in tools: forms, appointment services, and what the tools recorded.

    PUT    /v1/forms/{name}                     body: the form's JSON schema (an object schema)
    GET    /v1/forms                            GET /v1/forms/{name}    DELETE /v1/forms/{name}
                                                a form saved before a check it fails has `problems`
    GET    /v1/forms/{name}/submissions
    PUT    /v1/appointment-services/{name}      body: {"duration_minutes", "timezone"?, "opening_hours"}
    GET    /v1/appointment-services             GET/DELETE /v1/appointment-services/{name}
    GET    /v1/appointments?service=&since=
    GET    /v1/leads                            (handoffs: services.gateway.live_routes)
    GET    /v1/notifications?status=pending|delivered|failed
    POST   /v1/notifications/{id}/retry         a given-up notification, on a fresh schedule

Tenant-scoped like every /v1 route: the tenant comes from the API key (request[TENANT]). Errors
are raised as domain errors and become problem+json in services.gateway.middleware.
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from kernel.errors import InvalidInput, NotFound
from services.builtins.appointments import service_from_body
from services.builtins.forms import check_form, form_problems
from services.gateway.common import (
    DEPS,
    TENANT,
    decode_body,
    json_response,
    keyset_cursor,
    keyset_of,
    page_of,
    paged,
    parse_since,
)
from services.tools.validation import schemas_checked
from storage.repos.builtins import MAX_FORMS_PER_TENANT, MAX_SERVICES_PER_TENANT, BuiltinRepos
from storage.repos.notifications import NotFailed


def _repos(request: web.Request) -> BuiltinRepos:
    # The gateway's repositories share one pool; GatewayDeps does not expose it by name, so it is
    # taken from the bot-config repository (same process, same pool).
    pool = getattr(request.app[DEPS].configs, "_pool", None)
    if pool is None:
        raise NotFound("the built-in tool admin routes are not available in this process", kind="route",
                       key=request.path)
    return BuiltinRepos(pool)


def _view(record: Any) -> dict[str, Any]:
    return msgspec.to_builtins(record)


# -- forms --------------------------------------------------------------------------------------

def _form_view(form: Any) -> dict[str, Any]:
    """A stored form, with `problems` when a check added since it was saved would refuse it."""
    problems = form_problems(form.schema)
    return {**_view(form), "problems": problems} if problems else _view(form)


async def put_form(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    schema = await schemas_checked(check_form, name, await decode_body(request, dict))
    form = await _repos(request).forms.put(request[TENANT], name, schema)
    return json_response(_view(form))


async def get_form(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    form = await _repos(request).forms.get(request[TENANT], name)
    if form is None:
        raise NotFound(f"form {name[:64]!r} does not exist for this tenant; create it with PUT /v1/forms/{{name}}",
                       kind="form", key=name)
    return json_response(await schemas_checked(_form_view, form))


async def list_forms(request: web.Request) -> web.Response:
    limit, cursor = page_of(request, default=MAX_FORMS_PER_TENANT)  # by default, every one
    forms, next_cursor = paged(await _repos(request).forms.list(request[TENANT], after=cursor, limit=limit + 1),
                               limit, lambda form: form.name)
    # each form's verdict is kept by its schema's content: listing again checks nothing again
    return json_response({"forms": await schemas_checked(lambda: [_form_view(f) for f in forms]),
                          "next_cursor": next_cursor})


async def delete_form(request: web.Request) -> web.Response:
    await _repos(request).forms.delete(request[TENANT], request.match_info["name"])
    return web.Response(status=204)


async def form_submissions(request: web.Request) -> web.Response:
    limit, cursor = page_of(request, default=100)
    rows, next_cursor = paged(
        await _repos(request).forms.submissions(request[TENANT], request.match_info["name"], limit + 1,
                                                before=keyset_of(cursor)),
        limit, lambda row: keyset_cursor(row.created_at, row.id))
    return json_response({"submissions": [_view(r) for r in rows], "next_cursor": next_cursor})


# -- appointments -------------------------------------------------------------------------------

async def put_service(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    service = service_from_body(name, await decode_body(request, dict))
    saved = await _repos(request).appointments.put_service(request[TENANT], service)
    return json_response(_view(saved))


async def get_service(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    service = await _repos(request).appointments.get_service(request[TENANT], name)
    if service is None:
        raise NotFound(f"appointment service {name[:64]!r} does not exist for this tenant; create it with "
                       "PUT /v1/appointment-services/{name}", kind="appointment_service", key=name)
    return json_response(_view(service))


async def list_services(request: web.Request) -> web.Response:
    limit, cursor = page_of(request, default=MAX_SERVICES_PER_TENANT)  # by default, every one
    services, next_cursor = paged(
        await _repos(request).appointments.list_services(request[TENANT], after=cursor, limit=limit + 1),
        limit, lambda service: service.name)
    return json_response({"services": [_view(s) for s in services], "next_cursor": next_cursor})


async def delete_service(request: web.Request) -> web.Response:
    await _repos(request).appointments.delete_service(request[TENANT], request.match_info["name"])
    return web.Response(status=204)


async def list_appointments(request: web.Request) -> web.Response:
    since = parse_since(request.query["since"]) if request.query.get("since") else None
    limit, cursor = page_of(request, default=200)
    rows, next_cursor = paged(await _repos(request).appointments.list(
        request[TENANT], service=request.query.get("service") or None, since=since, limit=limit + 1,
        after=keyset_of(cursor)), limit, lambda row: keyset_cursor(row.starts_at, row.id))
    return json_response({"appointments": [_view(r) for r in rows], "next_cursor": next_cursor})


# -- leads -------------------------------------------------------------------------

async def list_leads(request: web.Request) -> web.Response:
    limit, cursor = page_of(request, default=100)
    rows, next_cursor = paged(await _repos(request).leads.list(request[TENANT], limit + 1, before=keyset_of(cursor)),
                              limit, lambda row: keyset_cursor(row.created_at, row.id))
    return json_response({"leads": [_view(r) for r in rows], "next_cursor": next_cursor})


# -- notifications (the outbox of tenant events) -------------------------------------------------

_STATUSES = ("pending", "delivered", "failed")


async def list_notifications(request: web.Request) -> web.Response:
    status = request.query.get("status")
    if status is not None and status not in _STATUSES:
        raise InvalidInput(f"status must be one of {', '.join(_STATUSES)}, got {status[:20]!r}")
    limit, cursor = page_of(request, default=100)
    rows, next_cursor = paged(
        await _repos(request).notifications.list(request[TENANT], status, limit + 1, before=keyset_of(cursor)),
        limit, lambda row: keyset_cursor(row["created_at"], row["id"]))
    return json_response({"notifications": rows, "next_cursor": next_cursor})


async def retry_notification(request: web.Request) -> web.Response:
    event_id = request.match_info["id"]
    try:
        row = await _repos(request).notifications.retry(request[TENANT], event_id)
    except NotFailed as exc:
        raise InvalidInput(f"{exc}; only a failed notification can be retried") from None
    if row is None:
        raise NotFound(f"notification {event_id[:64]!r} does not exist for this tenant; list them with "
                       "GET /v1/notifications", kind="notification", key=event_id)
    return json_response(row)


def add_builtin_routes(app: web.Application) -> None:
    """Register the routes above on the gateway app (called once from build_app)."""
    r = app.router
    r.add_get("/v1/forms", list_forms)
    r.add_put("/v1/forms/{name}", put_form)
    r.add_get("/v1/forms/{name}", get_form)
    r.add_delete("/v1/forms/{name}", delete_form)
    r.add_get("/v1/forms/{name}/submissions", form_submissions)
    r.add_get("/v1/appointment-services", list_services)
    r.add_put("/v1/appointment-services/{name}", put_service)
    r.add_get("/v1/appointment-services/{name}", get_service)
    r.add_delete("/v1/appointment-services/{name}", delete_service)
    r.add_get("/v1/appointments", list_appointments)
    r.add_get("/v1/leads", list_leads)
    r.add_get("/v1/notifications", list_notifications)
    r.add_post("/v1/notifications/{id}/retry", retry_notification)
