"""/openapi.json says every status each route answers, and only those; and its media types.

Two halves. A table, read from the handlers (and the errors they raise, as the gateway maps them),
of (method, path) -> statuses, checked against the document for every route the app registers: a
new route, or a status added to a handler, fails here until the table and the document say it.
Then real requests over HTTP on loopback to a gateway with the real Postgres repositories and a
real SessionHost in process (LocalRouter; the session store and the model are the unit tests'
fakes, so no Ray), each answer checked to be documented with its content type.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from services.gateway.common import CHAT_ROUTES
from services.gateway.limits import TenantLimiter
from tests.support import gateways
from tests.support.gateways import DocumentedGateway

gateway = gateways.documented_gateway  # the fixture

#: every /v1 route: no or an unknown key (401), a NUL in the URL (422), Postgres unreachable while
#: the key or anything else is looked up (503 with Retry-After)
V1 = {401, 422, 503}
#: a route that decodes a JSON body: not JSON or cut short (400), over MAX_BODY (413), not the shape (422)
BODY = {400, 413, 422}
#: a turn (a message, an approval): as V1 and BODY, plus the tenant limiter and the host's admission
#: (429: the tenant's own excess; 503: host busy, restarting, unsaved), a host refusing the turn
#: (400) and a host that failed on its side (500)
TURN = V1 | BODY | {200, 429, 500, 503}

EXPECTED: dict[tuple[str, str], set[int]] = {
    ("POST", "/v1/sessions/{session_id}/messages"): TURN,
    ("GET", "/v1/sessions/{session_id}"): V1 | {200, 404},
    ("POST", "/v1/sessions/{session_id}/approvals/{approval_id}"): TURN | {404},
    ("POST", "/v1/tools"): V1 | BODY | {201, 409},
    ("GET", "/v1/tools"): V1 | {200},
    ("GET", "/v1/tools/contract"): V1 | {200},
    ("GET", "/v1/tools/{name}"): V1 | {200, 404},
    ("PATCH", "/v1/tools/{name}"): V1 | BODY | {200, 404, 409},  # 409: the live tool kept changing under it
    ("DELETE", "/v1/tools/{name}"): V1 | {204, 404},
    ("GET", "/v1/tools/{name}/versions"): V1 | {200, 404},
    ("POST", "/v1/tools/{name}/versions/{version}/publish"): V1 | {200, 404},
    ("GET", "/v1/analytics/tools"): V1 | {200},
    ("POST", "/v1/jobs/{job_id}/result"): V1 | BODY | {200, 404, 409},
    ("GET", "/v1/jobs/{job_id}"): V1 | {200, 404},
    ("GET", "/v1/bot-config"): V1 | {200},
    ("PUT", "/v1/bot-config"): V1 | BODY | {200},
    ("POST", "/v1/contact-tokens"): V1 | BODY | {200, 409},  # 409: the tenant verifies no contact
    ("GET", "/healthz"): {200, 422, 503},  # 503: past the gateway's connection limit, as every route
    ("GET", "/readyz"): {200, 422, 503},
    ("GET", "/metrics"): {200, 401, 403, 422, 503},
    ("GET", "/v1/forms"): V1 | {200},
    ("PUT", "/v1/forms/{name}"): V1 | BODY | {200, 409},  # 409: a new form past the tenant's cap
    ("GET", "/v1/forms/{name}"): V1 | {200, 404},
    ("DELETE", "/v1/forms/{name}"): V1 | {204, 404},
    ("GET", "/v1/forms/{name}/submissions"): V1 | {200},
    ("GET", "/v1/appointment-services"): V1 | {200},
    ("PUT", "/v1/appointment-services/{name}"): V1 | BODY | {200, 409},  # 409: past the tenant's cap
    ("GET", "/v1/appointment-services/{name}"): V1 | {200, 404},
    ("DELETE", "/v1/appointment-services/{name}"): V1 | {204, 404},
    ("GET", "/v1/appointments"): V1 | {200},
    ("GET", "/v1/leads"): V1 | {200},
    ("GET", "/v1/handoffs"): V1 | {200},
    ("GET", "/v1/sessions/{session_id}/events"): V1 | {200},
    ("GET", "/v1/handoffs/events"): V1 | {200},
    ("GET", "/v1/sessions/{session_id}/ws"): V1 | {101, 400},
    ("POST", "/v1/sessions/{session_id}/agent-messages"): TURN | {409},
    ("POST", "/v1/handoffs/{handoff_id}/claim"): TURN | {404, 409},
    ("POST", "/v1/handoffs/{handoff_id}/resolve"): TURN | {404, 409},
    ("GET", "/v1/notifications"): V1 | {200},
    ("POST", "/v1/notifications/{id}/retry"): V1 | {200, 404},
    ("GET", "/v1/sessions"): V1 | {200},
    ("GET", "/v1/keys"): V1 | {200},
    ("GET", "/v1/sessions/{session_id}/calls"): V1 | {200, 404},
    ("GET", "/v1/analytics/tools/timeseries"): V1 | {200},
    ("POST", "/v1/mcp-servers"): V1 | BODY | {201, 409},
    ("GET", "/v1/mcp-servers"): V1 | {200},
    ("GET", "/v1/mcp-servers/{name}"): V1 | {200, 404},
    ("PATCH", "/v1/mcp-servers/{name}"): V1 | BODY | {200, 404},
    ("DELETE", "/v1/mcp-servers/{name}"): V1 | {204, 404},
}
#: a chat key on any /v1 route but the few it may use: 403
EXPECTED.update({route: statuses | {403} for route, statuses in EXPECTED.items()
                 if route[1].startswith("/v1/") and route not in CHAT_ROUTES})
#: a configuration write (tools, forms, services, MCP servers, bot config): past the tenant's write rate, 429
EXPECTED.update({route: statuses | {429} for route, statuses in EXPECTED.items()
                 if route[0] in ("POST", "PUT", "PATCH", "DELETE") and route[1].startswith(
                     ("/v1/tools", "/v1/forms", "/v1/appointment-services", "/v1/mcp-servers", "/v1/bot-config"))})
#: served but not part of the API the document describes: the dashboard page, its files, the document
NOT_DOCUMENTED = {("GET", "/"), ("GET", "/static/{file}"), ("GET", "/openapi.json")}
DELETES = [path for (method, path), statuses in EXPECTED.items() if method == "DELETE"]


def _served(gateway: DocumentedGateway) -> set[tuple[str, str]]:
    app = gateway.client.server.app
    return {(r.method, r.resource.canonical) for r in app.router.routes()
            if r.resource is not None and r.method != "HEAD"}


# -- the table --------------------------------------------------------------------------------


async def test_every_route_the_app_serves_is_in_the_table(gateway):
    # a new route fails here until its statuses are read from its handler into EXPECTED
    assert _served(gateway) - NOT_DOCUMENTED == set(EXPECTED)


async def test_the_document_lists_exactly_the_statuses_each_handler_answers(gateway):
    wrong = {}
    for (method, path), statuses in EXPECTED.items():
        documented = {int(s) for s in gateway.doc["paths"].get(path, {}).get(method.lower(), {}).get("responses", {})}
        if documented != statuses:
            wrong[f"{method} {path}"] = {"undocumented": sorted(statuses - documented),
                                         "never answered": sorted(documented - statuses)}
    assert not wrong, json.dumps(wrong, indent=1)


@pytest.mark.parametrize("path", DELETES)
async def test_a_delete_is_documented_as_204_without_a_body(gateway, path):
    responses = gateway.doc["paths"][path]["delete"]["responses"]
    assert "200" not in responses
    assert "content" not in responses["204"]


@pytest.mark.parametrize("path", ["/v1/sessions/{session_id}/messages",
                                  "/v1/sessions/{session_id}/approvals/{approval_id}"])
async def test_a_turn_documents_its_json_reply_and_its_event_stream(gateway, path):
    ok = gateway.doc["paths"][path]["post"]["responses"]["200"]["content"]
    assert ok["application/json"]["schema"] == {"$ref": "#/components/schemas/TurnReply"}
    assert "text/event-stream" in ok
    for status in ("429", "503"):
        assert "Retry-After" in gateway.doc["paths"][path]["post"]["responses"][status]["headers"]
    # what each refusal means for the message: run or not, and what a retry gets
    refused = gateway.doc["paths"][path]["post"]["responses"]["503"]["description"]
    for cause in ("admission limit", "shutting down", "restarting", "moving to another host",
                  "could not be saved yet", "or this session", "this message was not run", "same message_id",
                  "X-Message-Id"):
        assert cause in refused, cause
    assert "nothing was run" in gateway.doc["paths"][path]["post"]["responses"]["429"]["description"]


async def test_every_field_a_turn_reply_always_carries_is_required(gateway):
    # reply_body() puts `handoff` in every reply, true or false (docs/api.md's body)
    required = set(gateway.doc["components"]["schemas"]["TurnReply"]["required"])
    assert {"session_id", "message_id", "reply", "tool_calls", "rounds", "usage", "handoff"} <= required


# -- real answers over HTTP -------------------------------------------------------------------


async def test_an_mcp_server_registration_answers_201_then_409_then_204_as_documented(gateway):
    c, h = gateway.client, gateway.headers
    body = {"name": "docs", "url": "https://mcp.example.com/mcp"}
    r = await c.post("/v1/mcp-servers", headers=h, json=body)
    assert r.status == 201
    await gateway.documented(r, "POST", "/v1/mcp-servers")
    r = await c.post("/v1/mcp-servers", headers=h, json=body)  # the same name again
    assert r.status == 409
    await gateway.documented(r, "POST", "/v1/mcp-servers")
    r = await c.delete("/v1/mcp-servers/docs", headers=h)
    assert r.status == 204
    await gateway.documented(r, "DELETE", "/v1/mcp-servers/{name}")


async def test_deleting_a_form_and_an_appointment_service_answers_204_as_documented(gateway):
    c, h = gateway.client, gateway.headers
    r = await c.put("/v1/forms/quote", headers=h, json={"type": "object", "properties": {"rooms": {"type": "integer"}}})
    await gateway.documented(r, "PUT", "/v1/forms/{name}")
    r = await c.delete("/v1/forms/quote", headers=h)
    assert r.status == 204
    await gateway.documented(r, "DELETE", "/v1/forms/{name}")
    r = await c.put("/v1/appointment-services/consult", headers=h,
                    json={"duration_minutes": 30, "opening_hours": {"mon": ["09:00", "17:00"]}})
    await gateway.documented(r, "PUT", "/v1/appointment-services/{name}")
    r = await c.delete("/v1/appointment-services/consult", headers=h)
    assert r.status == 204
    await gateway.documented(r, "DELETE", "/v1/appointment-services/{name}")


async def test_a_second_job_result_with_another_outcome_answers_409_as_documented(gateway):
    c, h = gateway.client, gateway.headers
    await gateway.deps.jobs.create(gateway.tenant_id, "s-job", "job-openapi-1", "order_status", {})
    r = await c.post("/v1/jobs/job-openapi-1/result", headers=h, json={"status": "succeeded", "result": {"ok": 1}})
    assert r.status == 200
    await gateway.documented(r, "POST", "/v1/jobs/{job_id}/result")
    r = await c.post("/v1/jobs/job-openapi-1/result", headers=h, json={"status": "failed", "error": "late"})
    assert r.status == 409
    await gateway.documented(r, "POST", "/v1/jobs/{job_id}/result")


async def test_a_result_posted_for_a_job_the_engine_runs_answers_409_and_changes_nothing(gateway):
    # a `handler` workflow runs in the session host, which records its outcome; before, the
    # tenant's key could finish it first with an outcome of its own making
    c, h = gateway.client, gateway.headers
    await gateway.deps.jobs.create(gateway.tenant_id, "s-job", "job-engine-1", "export", {}, runner="engine")
    r = await c.post("/v1/jobs/job-engine-1/result", headers=h, json={"status": "succeeded", "result": {"url": "x"}})
    assert r.status == 409 and "run by the engine itself" in (await r.json())["detail"]
    await gateway.documented(r, "POST", "/v1/jobs/{job_id}/result")
    assert (await gateway.deps.jobs.get(gateway.tenant_id, "job-engine-1")).status == "running"
    done = await gateway.deps.jobs.finish(gateway.tenant_id, "job-engine-1", succeeded=True, result={"url": "y"})
    assert (done.status, done.result) == ("succeeded", {"url": "y"})  # the engine's own report is taken


APPROVAL = "/v1/sessions/{session_id}/approvals/{approval_id}"
MESSAGES = "/v1/sessions/{session_id}/messages"


async def test_an_approval_over_the_tenant_rate_answers_429_as_documented(gateway):
    c, h = gateway.client, gateway.headers
    gateway.deps.limiter = TenantLimiter(rate=0.001, burst=1, concurrency=0)
    r = await c.post("/v1/sessions/s-rate/messages", headers=h, json={"text": "hello"})
    assert r.status == 200  # the one token of the burst
    await gateway.documented(r, "POST", MESSAGES)
    r = await c.post("/v1/sessions/s-rate/approvals/ap-1", headers=h, json={"approve": True})
    assert r.status == 429
    await gateway.documented(r, "POST", APPROVAL)


async def test_an_approval_to_a_host_shutting_down_answers_503_as_documented(gateway):
    c, h = gateway.client, gateway.headers
    r = await c.post("/v1/sessions/s-stop/approvals/ap-1", headers=h, json={"approve": True})
    assert r.status == 404  # no such approval: the host refuses it as a forged id
    await gateway.documented(r, "POST", APPROVAL)
    await asyncio.wait_for(gateway.host.stop(), 10)
    r = await c.post("/v1/sessions/s-stop/approvals/ap-1", headers=h, json={"approve": True})
    assert r.status == 503 and "Retry-After" in r.headers
    await gateway.documented(r, "POST", APPROVAL)


async def test_reading_a_session_whose_turn_is_not_saved_yet_answers_503_as_documented(gateway):
    c, h = gateway.client, gateway.headers
    gateway.store.hold = asyncio.Event()  # the flush holding the turn's state does not commit
    r = await c.post("/v1/sessions/s-unsaved/messages", headers=h, json={"text": "hello", "message_id": "m1"})
    assert r.status == 503  # the reply is ready but not durable within the gate's timeout
    await gateway.documented(r, "POST", MESSAGES)
    r = await c.get("/v1/sessions/s-unsaved", headers=h)
    assert r.status == 503 and r.headers["Retry-After"] == "2"
    await gateway.documented(r, "GET", "/v1/sessions/{session_id}")
    gateway.store.hold.set()
    r = await c.get("/v1/sessions/s-unsaved", headers=h)
    assert r.status == 200
    await gateway.documented(r, "GET", "/v1/sessions/{session_id}")


async def test_a_streamed_turn_answers_the_documented_event_stream(gateway):
    c, h = gateway.client, gateway.headers
    r = await c.post("/v1/sessions/s-sse/messages", headers={**h, "Accept": "text/event-stream"},
                     json={"text": "hello"})
    assert r.status == 200 and r.headers["Content-Type"] == "text/event-stream"
    await gateway.documented(r, "POST", MESSAGES)
    assert "event: done" in await r.text()


async def test_a_json_turn_reply_carries_every_field_the_document_requires(gateway):
    c, h = gateway.client, gateway.headers
    r = await c.post("/v1/sessions/s-json/messages", headers=h, json={"text": "hello"})
    assert r.status == 200
    await gateway.documented(r, "POST", MESSAGES)
    body = await r.json()
    assert set(gateway.doc["components"]["schemas"]["TurnReply"]["required"]) <= body.keys()
    assert body["handoff"] is False
