"""/openapi.json, generated from the msgspec types the gateway decodes and encodes."""

from __future__ import annotations

import re
from functools import cache
from typing import Any

import msgspec

from services.gateway.bodies import ToolCreate, ToolPatch
from services.wire import DecideApproval, SendMessage, SessionView, TurnReply

PROBLEM = {"$ref": "#/components/schemas/Problem"}


def openapi_document(routes: tuple[tuple[str, str, str], ...] = ()) -> dict[str, Any]:
    """The document: the typed core below, plus every other route the app serves (`routes`:
    (method, path, summary)) with its parameters, so nothing the gateway answers is missing."""
    doc = _core_document()
    if not routes:
        return doc
    paths = {k: dict(v) for k, v in doc["paths"].items()}
    for method, path, summary in routes:
        m = method.lower()
        if m == "head" or path in ("/", "/openapi.json") or path.startswith("/static") or m in paths.get(path, {}):
            continue
        params = [{"name": n, "in": "path", "required": True, "schema": {"type": "string"}}
                  for n in re.findall(r"{([^}:]+)", path)]
        op: dict[str, Any] = {"summary": summary or f"{method} {path}", "parameters": params,
                              "responses": {"200": {"description": "ok", "content": {"application/json": {"schema": {}}}},
                                            "401": {"description": "problem", "content": {"application/problem+json": {"schema": PROBLEM}}},
                                            "404": {"description": "problem", "content": {"application/problem+json": {"schema": PROBLEM}}},
                                            "422": {"description": "problem", "content": {"application/problem+json": {"schema": PROBLEM}}}}}
        if m in ("post", "put", "patch"):
            op["requestBody"] = {"required": False, "content": {"application/json": {"schema": {"type": "object"}}}}
            for e in ("400", "413"):
                op["responses"][e] = {"description": "problem", "content": {"application/problem+json": {"schema": PROBLEM}}}
        paths.setdefault(path, {})[m] = op
    return {**doc, "paths": paths}


@cache
def _core_document() -> dict[str, Any]:
    from services.gateway.app import BotConfigIn

    types = [SendMessage, DecideApproval, TurnReply, SessionView, ToolCreate, ToolPatch, BotConfigIn]
    (refs, components) = msgspec.json.schema_components(types, ref_template="#/components/schemas/{name}")
    components["Problem"] = {
        "type": "object", "required": ["type", "title", "status", "detail"],
        "properties": {"type": {"type": "string"}, "title": {"type": "string"},
                       "status": {"type": "integer"}, "detail": {"type": "string"}},
    }
    for internal in ("replay", "timing"):  # the gateway strips them: X-Replayed, Server-Timing instead
        components["TurnReply"]["properties"].pop(internal, None)
    components.pop("TurnTiming", None)
    ref = dict(zip([t.__name__ for t in types], refs))
    sid = {"name": "session_id", "in": "path", "required": True,
           "schema": {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$"}}
    name = {"name": "name", "in": "path", "required": True, "schema": {"type": "string", "pattern": "^[a-zA-Z][a-zA-Z0-9_-]{0,63}$"}}

    def op(summary: str, *, body: dict | None = None, ok: dict | None = None, status: str = "200",
           params: list | None = None, errors: tuple[str, ...] = ("401", "404", "422")) -> dict:
        o: dict[str, Any] = {"summary": summary, "parameters": params or [],
                             "responses": {status: {"description": "ok", "content": {"application/json": {"schema": ok or {"type": "object"}}}}}}
        if status == "204":
            o["responses"][status] = {"description": "deleted"}
        for e in errors:
            o["responses"][e] = {"description": "problem", "content": {"application/problem+json": {"schema": PROBLEM}}}
        if body is not None:
            o["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
            for e in ("400", "413"):  # a body that is not JSON (or not UTF-8); one over MAX_BODY
                o["responses"][e] = {"description": "problem", "content": {"application/problem+json": {"schema": PROBLEM}}}
        return o

    def turn(o: dict) -> dict:
        o["responses"]["200"]["headers"] = {
            "Server-Timing": {"description": "ms: gateway (the whole turn here), host (the session host's part), "
                              "gate (the host's wait for durability); JSON replies only",
                              "schema": {"type": "string"}},
            "X-Replayed": {"description": "true: the stored answer to a repeated message_id or an approval already decided", "schema": {"type": "string"}},
        }
        return o

    send = turn(op("Send a message (JSON or SSE)", body=ref["SendMessage"], ok=ref["TurnReply"], params=[sid],
                   errors=("401", "422", "429", "503")))
    message_id = {"description": "the turn's message_id (the client's, or the one made up for it), on every "
                  "answer to a message, failures included: the id a retry sends", "schema": {"type": "string"}}
    send["responses"]["200"]["headers"]["X-Message-Id"] = message_id
    for status in ("429", "503"):
        send["responses"][status]["headers"] = {"X-Message-Id": message_id}
    paths = {
        "/v1/sessions/{session_id}/messages": {"post": send},
        "/v1/sessions/{session_id}": {"get": op("Inspect a session", ok=ref["SessionView"], params=[sid])},
        "/v1/sessions/{session_id}/approvals/{approval_id}": {"post": turn(op(
            "Approve or deny a held turn", body=ref["DecideApproval"], ok=ref["TurnReply"],
            params=[sid, {"name": "approval_id", "in": "path", "required": True, "schema": {"type": "string"}}]))},
        "/v1/tools": {"post": op("Register a tool", body=ref["ToolCreate"], status="201", errors=("401", "409", "422")),
                      "get": op("List published tools", errors=("401",))},
        "/v1/tools/contract": {"get": op("Tool-contract report", errors=("401",))},
        "/v1/tools/{name}": {"get": op("Get a tool", params=[name]),
                             "patch": op("New version of a tool", body=ref["ToolPatch"], params=[name]),
                             "delete": op("Delete a tool", params=[name], status="204")},
        "/v1/tools/{name}/versions": {"get": op("Versions of a tool", params=[name])},
        "/v1/tools/{name}/versions/{version}/publish": {"post": op("Publish a version", params=[
            name, {"name": "version", "in": "path", "required": True, "schema": {"type": "integer", "minimum": 1}}])},
        "/v1/analytics/tools": {"get": op("Per-tool analytics", params=[
            {"name": "since", "in": "query", "required": False, "schema": {"type": "string"}}], errors=("401", "422"))},
        "/v1/bot-config": {"get": op("Bot configuration", errors=("401",)),
                           "put": op("Replace the bot configuration", body=ref["BotConfigIn"], errors=("401", "422"))},
        "/healthz": {"get": op("Liveness", errors=())},
        "/readyz": {"get": op("Readiness", errors=("503",))},
        "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": {"description": "text exposition"}}}},
    }
    for path in ("/healthz", "/readyz", "/metrics"):
        paths[path]["get"]["security"] = []  # operations: no tenant key (CONTRACT.md)
    return {
        "openapi": "3.1.0",
        "info": {"title": "chat-engine", "version": "0.1.0"},
        "components": {"schemas": components,
                       "securitySchemes": {"tenantKey": {"type": "http", "scheme": "bearer"}}},
        "security": [{"tenantKey": []}],
        "paths": paths,
    }
