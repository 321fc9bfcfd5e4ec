"""/openapi.json, generated from the msgspec types the gateway decodes and encodes.

What each route answers (its success status and every problem status its handler can give) is
the table ANSWERS, read from the handlers and from how services.gateway.common.failure() maps the
errors they raise; tests/integration/test_openapi_statuses.py checks it against what they answer.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any

import msgspec

from services.gateway.bodies import BotConfigIn, ToolCreate, ToolPatch
from services.gateway.common import CHAT_ROUTES, CONFIG_PREFIXES, WRITE_METHODS
from services.wire import DecideApproval, SendMessage, SessionView, TurnReply

PROBLEM = {"$ref": "#/components/schemas/Problem"}

#: every /v1 route: no or an unknown key (401); a NUL in the URL (422, also on routes without a
#: parameter); Postgres unreachable while the key or anything else is looked up (503, Retry-After);
#: and every one but CHAT_ROUTES: a chat key (403, added by _responses)
_V1 = ("401", "422", "503")
#: a route that decodes a JSON body: not JSON or cut short (400), over MAX_BODY (413), not its shape (422)
_BODY = ("400", "413", "422")
#: a turn: the tenant limiter or the session's mailbox (429), the host's admission (503: busy,
#: shutting down, restarting, a reply not saved yet), a host refusing it (400), a host that failed (500)
_TURN = (*_V1, *_BODY, "429", "500", "503")

#: (METHOD, path) -> (success status, problem statuses). A route missing here gets _DEFAULT.
ANSWERS: dict[tuple[str, str], tuple[str, tuple[str, ...]]] = {
    ("POST", "/v1/sessions/{session_id}/messages"): ("200", _TURN),
    ("GET", "/v1/sessions/{session_id}"): ("200", (*_V1, "404")),
    ("POST", "/v1/sessions/{session_id}/approvals/{approval_id}"): ("200", (*_TURN, "404")),
    ("POST", "/v1/tools"): ("201", (*_V1, *_BODY, "409")),
    ("GET", "/v1/tools"): ("200", _V1),
    ("GET", "/v1/tools/contract"): ("200", _V1),
    ("GET", "/v1/tools/{name}"): ("200", (*_V1, "404")),
    ("PATCH", "/v1/tools/{name}"): ("200", (*_V1, *_BODY, "404", "409")),  # 409: changed under it PATCH_ATTEMPTS times
    ("DELETE", "/v1/tools/{name}"): ("204", (*_V1, "404")),
    ("GET", "/v1/tools/{name}/versions"): ("200", (*_V1, "404")),
    ("POST", "/v1/tools/{name}/versions/{version}/publish"): ("200", (*_V1, "404")),  # reads no body
    ("GET", "/v1/analytics/tools"): ("200", _V1),
    ("POST", "/v1/jobs/{job_id}/result"): ("200", (*_V1, *_BODY, "404", "409")),  # 409: another outcome, or an engine-run job
    ("GET", "/v1/jobs/{job_id}"): ("200", (*_V1, "404")),
    ("GET", "/v1/bot-config"): ("200", _V1),
    ("PUT", "/v1/bot-config"): ("200", (*_V1, *_BODY)),
    ("POST", "/v1/contact-tokens"): ("200", (*_V1, *_BODY, "409")),  # 409: the tenant verifies no contact
    ("GET", "/healthz"): ("200", ("422",)),
    ("GET", "/readyz"): ("200", ("422", "503")),
    ("GET", "/metrics"): ("200", ("401", "403", "422")),  # an operator token, or a loopback peer
    # services.gateway.builtin_routes
    ("GET", "/v1/forms"): ("200", _V1),
    ("PUT", "/v1/forms/{name}"): ("200", (*_V1, *_BODY, "409")),  # 409: a new form past the tenant's cap
    ("GET", "/v1/forms/{name}"): ("200", (*_V1, "404")),
    ("DELETE", "/v1/forms/{name}"): ("204", (*_V1, "404")),
    ("GET", "/v1/forms/{name}/submissions"): ("200", _V1),  # an unknown form has none: []
    ("GET", "/v1/appointment-services"): ("200", _V1),
    ("PUT", "/v1/appointment-services/{name}"): ("200", (*_V1, *_BODY, "409")),  # 409: a new one past the cap
    ("GET", "/v1/appointment-services/{name}"): ("200", (*_V1, "404")),
    ("DELETE", "/v1/appointment-services/{name}"): ("204", (*_V1, "404")),
    ("GET", "/v1/appointments"): ("200", _V1),
    ("GET", "/v1/leads"): ("200", _V1),
    ("GET", "/v1/notifications"): ("200", _V1),
    ("POST", "/v1/notifications/{id}/retry"): ("200", (*_V1, "404")),  # reads no body; 422: not failed
    # services.gateway.live_routes (a person's message and a handoff's change run in the session: _TURN's refusals)
    ("GET", "/v1/sessions/{session_id}/events"): ("200", _V1),
    ("GET", "/v1/sessions/{session_id}/ws"): ("101", (*_V1, "400")),  # 400: not a WebSocket upgrade
    ("POST", "/v1/sessions/{session_id}/agent-messages"): ("200", (*_TURN, "409")),
    ("GET", "/v1/handoffs"): ("200", _V1),
    ("GET", "/v1/handoffs/events"): ("200", _V1),
    ("POST", "/v1/handoffs/{handoff_id}/claim"): ("200", (*_TURN, "404", "409")),
    ("POST", "/v1/handoffs/{handoff_id}/resolve"): ("200", (*_TURN, "404", "409")),
    # services.gateway.dashboard
    ("GET", "/v1/sessions"): ("200", _V1),
    ("GET", "/v1/keys"): ("200", _V1),
    ("GET", "/v1/sessions/{session_id}/calls"): ("200", (*_V1, "404")),
    ("GET", "/v1/analytics/tools/timeseries"): ("200", _V1),
    # services.gateway.mcp_routes
    ("POST", "/v1/mcp-servers"): ("201", (*_V1, *_BODY, "409")),  # 409: duplicate name or registry full
    ("GET", "/v1/mcp-servers"): ("200", _V1),
    ("GET", "/v1/mcp-servers/{name}"): ("200", (*_V1, "404")),
    ("PATCH", "/v1/mcp-servers/{name}"): ("200", (*_V1, *_BODY, "404")),
    ("DELETE", "/v1/mcp-servers/{name}"): ("204", (*_V1, "404")),
}
_DEFAULT = ("200", (*_V1, "404"))

#: why a turn is refused, as a client reads it (kernel.errors.Overloaded's reasons; the problem's
#: detail says which): each is sent again after Retry-After, with the same message_id
_TURN_429 = ("problem: the tenant's message rate or turns in flight, or the session's queue of waiting "
             "messages, is full; nothing was run: send it again after Retry-After")
_TURN_503 = (
    "problem, one of: the session host is at its admission limit, shutting down, restarting, or the session "
    "is moving to another host (nothing was run); the reply is ready but its state could not be saved yet "
    "(database unavailable: the same message_id gets it once saved); the host, or this session, already "
    "holds the most turns it may hold unsaved (database unavailable: this message was not run, nothing of "
    "it happened); the session host has not answered for 5 s or more (hung: a turn that reached it runs once "
    "when it wakes); the gateway could not reach the database to check the key. Send it again after "
    "Retry-After with the same message_id (a message sent without one: the X-Message-Id header of this answer)"
)
_RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before sending the same request again",
                                "schema": {"type": "string"}}}
_SSE = {"text/event-stream": {
    "schema": {"type": "string"},
    "description": "with `Accept: text/event-stream`: the turn as server-sent events `text` (a delta), "
                   "`tool_call`, `tool_result`, `approval_required`, `client_action`, then `done` carrying "
                   "the TurnReply, or `error` ({title, status, detail, retry_after?}) when it failed after "
                   "the first event (a failure before it is answered as for JSON: a problem with its status)",
}}


def _problem(status: str) -> dict[str, Any]:
    response: dict[str, Any] = {"description": "problem", "content": {"application/problem+json": {"schema": PROBLEM}}}
    if status in ("429", "503"):
        response["headers"] = dict(_RETRY_AFTER)
    return response


def _responses(method: str, path: str, ok_schema: dict | None = None) -> dict[str, Any]:
    """The responses of `method path` as ANSWERS has them; a 204 carries no body."""
    status, errors = ANSWERS.get((method.upper(), path), _DEFAULT)
    if path.startswith("/v1/") and (method.upper(), path) not in CHAT_ROUTES:
        errors = (*errors, "403")  # a chat key on a route it may not use
    if "503" not in errors:
        errors = (*errors, "503")  # any route: past the gateway's connection limit (CE_GATEWAY_MAX_CONNECTIONS)
    if method.upper() in WRITE_METHODS and path.startswith(CONFIG_PREFIXES) and "429" not in errors:
        errors = (*errors, "429")  # a configuration write past the tenant's rate (CE_ADMIN_WRITE_RATE)
    responses: dict[str, Any] = {
        status: {"description": "deleted"} if status == "204" else
        {"description": "ok", "content": {"application/json": {"schema": ok_schema or {"type": "object"}}}}}
    for e in errors:
        responses[e] = _problem(e)
    return responses


def _reads_body(method: str, path: str) -> bool:
    return "413" in ANSWERS.get((method.upper(), path), _DEFAULT)[1]


def openapi_document(routes: tuple[tuple[str, str, str], ...] = ()) -> dict[str, Any]:
    """The document: the typed core below, plus every other route the app serves (`routes`:
    (method, path, summary)) with its parameters, so nothing the gateway answers is missing."""
    doc = _core_document()
    paths = {k: dict(v) for k, v in doc["paths"].items()}
    for method, path, summary in routes:
        m = method.lower()
        if m == "head" or path in ("/", "/openapi.json") or path.startswith("/static") or m in paths.get(path, {}):
            continue
        params = [{"name": n, "in": "path", "required": True, "schema": {"type": "string"}}
                  for n in re.findall(r"{([^}:]+)", path)]
        op: dict[str, Any] = {"summary": summary or f"{method} {path}", "parameters": params,
                              "responses": _responses(method, path)}
        if _reads_body(method, path):
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": {"type": "object"}}}}
        paths.setdefault(path, {})[m] = op
    for path in PAGED:
        if "get" in paths.get(path, {}):
            get = paths[path]["get"] = dict(paths[path]["get"])
            get["parameters"] = [*get["parameters"], *_PAGE_PARAMS]
    return {**doc, "paths": paths}


#: list routes that answer a page: `?limit=` and `?cursor=` in, `next_cursor` out
PAGED = ("/v1/tools", "/v1/tools/{name}/versions", "/v1/forms", "/v1/appointment-services", "/v1/mcp-servers",
         "/v1/forms/{name}/submissions", "/v1/appointments", "/v1/leads", "/v1/notifications", "/v1/handoffs")
_PAGE_PARAMS = (
    {"name": "limit", "in": "query", "required": False,
     "schema": {"type": "integer", "minimum": 1, "maximum": 1000},
     "description": "items on this page (by default every one the tenant may have)"},
    {"name": "cursor", "in": "query", "required": False, "schema": {"type": "string", "maxLength": 256},
     "description": "the next_cursor of the page before"},
)


@cache
def _core_document() -> dict[str, Any]:
    types = [SendMessage, DecideApproval, TurnReply, SessionView, ToolCreate, ToolPatch, BotConfigIn]
    (refs, components) = msgspec.json.schema_components(types, ref_template="#/components/schemas/{name}")
    components["Problem"] = {
        "type": "object", "required": ["type", "title", "status", "detail"],
        "properties": {"type": {"type": "string"}, "title": {"type": "string"},
                       "status": {"type": "integer"}, "detail": {"type": "string"}},
    }
    reply = components["TurnReply"]
    for internal in ("replay", "timing"):  # the gateway strips them: X-Replayed, Server-Timing instead
        reply["properties"].pop(internal, None)
    # reply_body() puts `handoff` in every reply, true or false (docs/api.md's body)
    required = reply.setdefault("required", [])
    if "handoff" not in required:
        required.append("handoff")
    components.pop("TurnTiming", None)
    ref = dict(zip([t.__name__ for t in types], refs))
    sid = {"name": "session_id", "in": "path", "required": True,
           "schema": {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$"}}
    name = {"name": "name", "in": "path", "required": True, "schema": {"type": "string", "pattern": "^[a-zA-Z][a-zA-Z0-9_-]{0,63}$"}}

    def op(method: str, path: str, summary: str, *, body: dict | None = None, ok: dict | None = None,
           params: list | None = None) -> dict:
        o: dict[str, Any] = {"summary": summary, "parameters": params or [], "responses": _responses(method, path, ok)}
        if body is not None:
            o["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
        return o

    def turn(o: dict) -> dict:
        o["responses"]["200"]["content"].update(_SSE)
        o["responses"]["429"]["description"] = _TURN_429
        o["responses"]["503"]["description"] = _TURN_503
        o["responses"]["200"]["headers"] = {
            "Server-Timing": {"description": "ms: gateway (the whole turn here), host (the session host's part), "
                              "gate (the host's wait for durability), share (its wait for a compute slot); "
                              "JSON replies only",
                              "schema": {"type": "string"}},
            "X-Replayed": {"description": "true: the stored answer to a repeated message_id or an approval already decided", "schema": {"type": "string"}},
        }
        return o

    messages = "/v1/sessions/{session_id}/messages"
    approval = "/v1/sessions/{session_id}/approvals/{approval_id}"
    send = turn(op("POST", messages, "Send a message (JSON, or SSE with Accept: text/event-stream)",
                   body=ref["SendMessage"], ok=ref["TurnReply"], params=[sid]))
    message_id = {"description": "the turn's message_id (the client's, or the one made up for it), on every "
                  "answer to a message, failures included: the id a retry sends", "schema": {"type": "string"}}
    for status in ("200", "429", "503"):  # a turn that was admitted, answered or refused
        send["responses"][status].setdefault("headers", {})["X-Message-Id"] = message_id
    tools, tool = "/v1/tools", "/v1/tools/{name}"
    publish = "/v1/tools/{name}/versions/{version}/publish"
    paths = {
        messages: {"post": send},
        "/v1/sessions/{session_id}": {"get": op("GET", "/v1/sessions/{session_id}", "Inspect a session",
                                                ok=ref["SessionView"], params=[sid])},
        approval: {"post": turn(op(
            "POST", approval, "Approve or deny a held turn (JSON, or SSE with Accept: text/event-stream)",
            body=ref["DecideApproval"], ok=ref["TurnReply"],
            params=[sid, {"name": "approval_id", "in": "path", "required": True, "schema": {"type": "string"}}]))},
        tools: {"post": op("POST", tools, "Register a tool", body=ref["ToolCreate"]),
                "get": op("GET", tools, "List published tools")},
        "/v1/tools/contract": {"get": op("GET", "/v1/tools/contract", "Tool-contract report")},
        tool: {"get": op("GET", tool, "Get a tool", params=[name]),
               "patch": op("PATCH", tool, "New version of a tool", body=ref["ToolPatch"], params=[name]),
               "delete": op("DELETE", tool, "Delete a tool", params=[name])},
        "/v1/tools/{name}/versions": {"get": op("GET", "/v1/tools/{name}/versions", "Versions of a tool", params=[name])},
        publish: {"post": op("POST", publish, "Publish a version", params=[
            name, {"name": "version", "in": "path", "required": True, "schema": {"type": "integer", "minimum": 1}}])},
        "/v1/analytics/tools": {"get": op("GET", "/v1/analytics/tools", "Per-tool analytics", params=[
            {"name": "since", "in": "query", "required": False, "schema": {"type": "string"}}])},
        "/v1/bot-config": {"get": op("GET", "/v1/bot-config", "Bot configuration"),
                           "put": op("PUT", "/v1/bot-config", "Replace the bot configuration", body=ref["BotConfigIn"])},
        "/healthz": {"get": op("GET", "/healthz", "Liveness")},
        "/readyz": {"get": op("GET", "/readyz", "Readiness")},
        "/metrics": {"get": op("GET", "/metrics", "Prometheus metrics")},
    }
    paths["/metrics"]["get"]["responses"]["200"] = {
        "description": "text exposition", "content": {"text/plain": {"schema": {"type": "string"}}}}
    del paths["/readyz"]["get"]["responses"]["503"]["headers"]  # not ready says no time to retry after
    for path in ("/healthz", "/readyz", "/metrics"):
        paths[path]["get"]["security"] = []  # operations: no tenant key (docs/api.md)
    return {
        "openapi": "3.1.0",
        "info": {"title": "chat-engine", "version": "0.1.0"},
        "components": {"schemas": components,
                       "securitySchemes": {"tenantKey": {"type": "http", "scheme": "bearer"}}},
        "security": [{"tenantKey": []}],
        "paths": paths,
    }
