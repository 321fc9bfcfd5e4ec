"""The HTTP API of docs/api.md through the real stack (gateway + Ray hosts + Postgres + local
model + demo store), as a tenant's admin and its contacts would use it.

Every test works in its own tenant (the `tenant` fixture) and its own session ids, so they share
the one stack without seeing each other's tools, calls or analytics.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

import asyncpg
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from app.demo_store import order
from tests.support.api import Api

SECRET = "sk-test-SECRET"
PROBLEM_JSON = "application/problem+json"
REPLY_FIELDS = {"session_id", "message_id", "reply", "tool_calls", "rounds", "usage", "handoff"}


def seed_000_check_order(store_url: str) -> dict[str, Any]:
    """Seed 000's example body, verbatim but for the store's address."""
    return {
        "name": "check_order",
        "description": "Look up a customer order by order number. Use when customer asks about their order status.",
        "parameters": {"order_id": {"type": "string", "description": "The order number"}},
        "webhook_url": f"{store_url}/api/orders/{{order_id}}",
        "auth_header": f"Bearer {SECRET}",
        "timeout_ms": 5000,
    }


def assert_problem(status: int, content_type: str, body: Any) -> None:
    """docs/api.md: every error is problem+json {type, title, status, detail} with a detail."""
    assert content_type == PROBLEM_JSON, (status, content_type, body)
    assert isinstance(body, dict) and {"type", "title", "status", "detail"} <= body.keys(), body
    assert body["status"] == status
    assert isinstance(body["detail"], str) and body["detail"].strip()


@pytest_asyncio.fixture
async def api(stack, client, tenant) -> Api:
    return Api(client, stack.gateway.url, tenant[2], on_error=assert_problem)


async def tool_call_rows(db, tenant_id: str) -> list[asyncpg.Record]:
    return await db.fetch(
        "SELECT tool_name, success, message_id, parameters::text AS parameters, result::text AS result, "
        "error, t::text AS row_text FROM ce_tool_calls t WHERE tenant_id = $1 ORDER BY created_at",
        tenant_id,
    )


async def scrape(client, url: str) -> dict[tuple[str, tuple], float]:
    async with client.get(f"{url}/metrics") as r:
        assert r.status == 200
        text = await r.text()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def tool_calls_total(samples, tool: str, outcome: str) -> float:
    return samples.get(("ce_tool_calls_total", (("outcome", outcome), ("tool", tool))), 0.0)


def sid(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(4)}"


# -- 1 + 2: seed 000's tool end to end, and its secret nowhere ------------------------------------

async def test_seed_000_check_order_registered_and_called_through_the_gateway(stack, client, tenant, api, db):
    tenant_id = tenant[0]
    before = await scrape(client, stack.gateway.url)

    status, created, _ = await api.post("/v1/tools", seed_000_check_order(stack.demo_store.url))
    assert status == 201, created
    assert created["name"] == "check_order" and created["version"] == 1
    assert created["auth_header_set"] is True
    assert "auth_header" not in created and "auth_header_enc" not in created

    session = sid("order")
    reply = await api.chat(session, "where is my order 12345?")
    assert REPLY_FIELDS <= reply.keys(), reply
    assert [(c["name"], c["success"]) for c in reply["tool_calls"]] == [("check_order", True)]
    expected = order("12345")
    assert "12345" in reply["reply"] and expected["status"] in reply["reply"], reply["reply"]
    assert reply["rounds"] == 2 and reply["session_id"] == session and reply["handoff"] is False

    rows = await tool_call_rows(db, tenant_id)
    assert [(r["tool_name"], r["success"]) for r in rows] == [("check_order", True)]
    assert json.loads(rows[0]["parameters"]) == {"order_id": "12345"}
    assert expected["status"] in rows[0]["result"]

    status, analytics, _ = await api.get("/v1/analytics/tools?since=1h")
    assert status == 200
    [stats] = [t for t in analytics["tools"] if t["name"] == "check_order"]
    assert stats["calls"] == 1 and stats["success_rate"] == 1.0
    assert {"name", "calls", "success_rate", "p50_ms", "p95_ms"} <= stats.keys()

    after = await scrape(client, stack.gateway.url)
    assert tool_calls_total(after, "check_order", "success") == tool_calls_total(before, "check_order", "success") + 1
    up = {dict(labels)["host"]: value for (name, labels), value in after.items() if name == "ce_host_up"}
    assert up and set(up) == set(stack.placement.host_names()) and set(up.values()) == {1.0}, up
    # every turn written: nothing held unwritten, and each host's cap as its settings make it
    unwritten = {dict(labels)["host"]: v for (name, labels), v in after.items() if name == "ce_host_unwritten_turns"}
    caps = {dict(labels)["host"]: v for (name, labels), v in after.items() if name == "ce_host_unwritten_turns_cap"}
    assert unwritten == dict.fromkeys(up, 0.0), unwritten
    assert caps == dict.fromkeys(up, float(2 * stack.settings.host_max_inflight)), caps
    # each host measures its garbage collector's pauses (services.heap.CollectorPauses)
    paused = {dict(labels)["host"]: v for (name, labels), v in after.items() if name == "ce_host_gc_pause_seconds_total"}
    assert set(paused) == set(up) and all(v >= 0 for v in paused.values()), paused


async def test_auth_header_secret_is_in_no_response_and_only_encrypted_at_rest(stack, client, tenant, api, db):
    tenant_id = tenant[0]
    status, _created, _ = await api.post("/v1/tools", seed_000_check_order(stack.demo_store.url))
    assert status == 201
    reply = await api.chat(sid("secret"), "where is my order 4242?")
    assert reply["tool_calls"][0]["success"] is True, reply

    status, one, _ = await api.get("/v1/tools/check_order")
    assert status == 200 and one["auth_header_set"] is True
    status, listed, _ = await api.get("/v1/tools")
    assert status == 200 and [t["auth_header_set"] for t in listed["tools"]] == [True]
    status, patched, _ = await api.patch("/v1/tools/check_order", {"description": "Look up an order by its number."})
    assert status == 200 and patched["version"] == 2
    assert patched["auth_header_set"] is True, "a patch that does not touch auth_header keeps it"
    status, versions, _ = await api.get("/v1/tools/check_order/versions")
    assert status == 200 and [v["auth_header_set"] for v in versions["versions"]] == [True, True]
    status, published, _ = await api.post("/v1/tools/check_order/versions/1/publish")
    assert status == 200 and published["auth_header_set"] is True
    status, _analytics, _ = await api.get("/v1/analytics/tools")
    assert status == 200
    async with client.get(f"{stack.gateway.url}/metrics") as r:
        api.seen.append(await r.text())

    for text in api.seen:
        assert SECRET not in text and "auth_header_enc" not in text, text

    for r in await tool_call_rows(db, tenant_id):
        assert SECRET not in r["row_text"]
    live = await db.fetch("SELECT t::text AS row_text, auth_header FROM ce_custom_tools t WHERE tenant_id = $1", tenant_id)
    versions_rows = await db.fetch(
        "SELECT t::text AS row_text, definition->>'auth_header_enc' AS enc FROM ce_tool_versions t WHERE tenant_id = $1",
        tenant_id,
    )
    assert len(live) == 1 and len(versions_rows) == 2
    for row in live:
        assert SECRET not in row["row_text"] and row["auth_header"]
    for row in versions_rows:
        assert SECRET not in row["row_text"] and row["enc"]
    from services.tools.crypto import SecretBox

    assert SecretBox(stack.settings.secret_keys).decrypt(live[0]["auth_header"]) == f"Bearer {SECRET}"


# -- 3: CRUD, versions, errors ------------------------------------------------------------------

async def test_tool_crud_versions_publish_rollback_and_delete(stack, api):
    body = seed_000_check_order(stack.demo_store.url)
    assert (await api.post("/v1/tools", body))[0] == 201

    status, listed, _ = await api.get("/v1/tools")
    assert status == 200 and [t["name"] for t in listed["tools"]] == ["check_order"]
    status, got, _ = await api.get("/v1/tools/check_order")
    assert status == 200
    assert got["version"] == 1 and got["description"] == body["description"] and got["enabled"] is True
    assert got["parameters"]["properties"]["order_id"]["type"] == "string"
    assert got["webhook_url"] == body["webhook_url"] and got["timeout_ms"] == 5000

    status, patched, _ = await api.patch("/v1/tools/check_order", {"description": "Version two.", "timeout_ms": 3000})
    assert status == 200 and patched["version"] == 2 and patched["published"] is True
    status, got, _ = await api.get("/v1/tools/check_order")
    assert got["version"] == 2 and got["description"] == "Version two." and got["timeout_ms"] == 3000

    status, versions, _ = await api.get("/v1/tools/check_order/versions")
    assert status == 200
    assert [(v["version"], v["published"]) for v in versions["versions"]] == [(1, False), (2, True)]

    status, rolled, _ = await api.post("/v1/tools/check_order/versions/1/publish")
    assert status == 200 and rolled["version"] == 1
    status, got, _ = await api.get("/v1/tools/check_order")
    assert got["version"] == 1 and got["description"] == body["description"] and got["timeout_ms"] == 5000
    status, versions, _ = await api.get("/v1/tools/check_order/versions")
    assert [(v["version"], v["published"]) for v in versions["versions"]] == [(1, True), (2, False)]

    status, draft, _ = await api.patch("/v1/tools/check_order", {"description": "A draft.", "publish": False})
    assert status == 200 and draft["version"] == 3 and draft["published"] is False
    assert (await api.get("/v1/tools/check_order"))[1]["description"] == body["description"]

    status, problem, _ = await api.post("/v1/tools/check_order/versions/9/publish")
    assert status == 404 and "version 9" in problem["detail"]

    status, _, text = await api.delete("/v1/tools/check_order")
    assert status == 204 and text == ""
    for path in ("/v1/tools/check_order", "/v1/tools/nope"):
        status, problem, _ = await api.get(path)
        assert status == 404 and "does not exist" in problem["detail"]
    assert (await api.delete("/v1/tools/check_order"))[0] == 404
    assert (await api.patch("/v1/tools/check_order", {"description": "x"}))[0] == 404
    assert (await api.get("/v1/tools"))[1]["tools"] == []


async def test_tool_errors_are_problem_json_naming_the_field(stack, api):
    good = seed_000_check_order(stack.demo_store.url)
    assert (await api.post("/v1/tools", good))[0] == 201

    status, problem, _ = await api.post("/v1/tools", good)
    assert status == 409 and "check_order" in problem["detail"] and "already exists" in problem["detail"]

    status, problem, _ = await api.post("/v1/tools", {**good, "name": "other", "colour": "red"})
    assert status == 422 and "colour" in problem["detail"]
    status, problem, _ = await api.patch("/v1/tools/check_order", {"colour": "red"})
    assert status == 422 and "colour" in problem["detail"]
    status, problem, _ = await api.patch("/v1/tools/check_order", {"name": "renamed"})
    assert status == 422 and "name" in problem["detail"]

    status, problem, _ = await api.post("/v1/tools", {**good, "name": "other", "timeout_ms": "fast"})
    assert status == 422 and "$.timeout_ms" in problem["detail"] and "int" in problem["detail"]
    status, problem, _ = await api.patch("/v1/tools/check_order", {"enabled": "no"})
    assert status == 422 and "$.enabled" in problem["detail"]
    status, problem, _ = await api.post("/v1/tools", {**good, "name": "other", "timeout_ms": 5})
    assert status == 422 and "$.timeout_ms" in problem["detail"]

    for url in ("not a url", "ftp://example.com/orders/{order_id}", "http://user:pw@example.com/{order_id}",
                "https://{order_id}.example.com/x"):
        status, problem, _ = await api.post("/v1/tools", {**good, "name": "other", "webhook_url": url})
        assert status == 422 and "webhook_url" in problem["detail"], (url, problem)
    status, problem, _ = await api.post(
        "/v1/tools", {**good, "name": "other", "webhook_url": f"{stack.demo_store.url}/api/orders/{{order_no}}"})
    assert status == 422 and "order_no" in problem["detail"] and "$.parameters" in problem["detail"]
    status, problem, _ = await api.post("/v1/tools", {**good, "name": "1bad name"})
    assert status == 422 and "$.name" in problem["detail"]
    status, problem, _ = await api.post("/v1/tools", {k: v for k, v in good.items() if k != "description"} | {"name": "x"})
    assert status == 422 and "description" in problem["detail"]

    status, problem, _ = await api.post("/v1/tools", raw=b"{not json")
    assert status == 400 and "JSON" in problem["detail"]
    status, problem, _ = await api.post("/v1/tools", raw=b"")
    assert status == 422 and "empty" in problem["detail"]
    status, problem, _ = await api.post("/v1/tools/check_order/versions/one/publish")
    assert status == 422 and "whole number" in problem["detail"]
    status, problem, _ = await api.get("/v1/analytics/tools?since=yesterday")
    assert status == 422 and "since" in problem["detail"]
    status, problem, _ = await api.get("/v1/no-such-route")
    assert status == 404 and "/v1/no-such-route" in problem["detail"] and "openapi" in problem["detail"]
    status, problem, _ = await api.post("/v1/tools", {**good, "name": "contract"})
    assert status == 422 and "reserved" in problem["detail"], "GET /v1/tools/contract could never read it"
    status, problem, _ = await api.post("/v1/tools", {**good, "name": "submit_form"})
    assert status == 422 and "is a built-in tool of the engine" in problem["detail"], problem  # it would never run

    assert [t["name"] for t in (await api.get("/v1/tools"))[1]["tools"]] == ["check_order"]


async def test_chat_body_errors_are_problem_json(api):
    session = sid("bad-body")
    for body, where in (({"text": "hi", "mood": "happy"}, "mood"), ({"text": 5}, "$.text"),
                        ({"text": "   "}, "$.text"), ({}, "text")):
        status, problem, _ = await api.post(f"/v1/sessions/{session}/messages", body)
        assert status == 422 and where in problem["detail"], (body, problem)
    status, problem, _ = await api.post("/v1/sessions/-bad id-/messages", {"text": "hi"})
    assert status == 422 and "session id" in problem["detail"]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer ce_wrong"}, {"Authorization": "Basic abc"},
                                     {"Authorization": "Bearer "}])
async def test_missing_or_bad_key_is_401_problem_json(stack, client, headers):
    for method, path in (("GET", "/v1/tools"), ("POST", "/v1/sessions/s1/messages"), ("GET", "/v1/bot-config")):
        async with client.request(method, stack.gateway.url + path, headers=headers, json={"text": "hi"}) as r:
            body = await r.json(content_type=None)
            assert r.status == 401
            assert_problem(401, r.content_type, body)
            assert r.headers.get("WWW-Authenticate") == "Bearer"


# -- 4: a catalog change reaches a live session on its next message ------------------------------

async def test_disabling_a_tool_reaches_the_live_session_on_its_next_message(stack, api):
    assert (await api.post("/v1/tools", seed_000_check_order(stack.demo_store.url)))[0] == 201
    session = sid("live")
    call = '/call check_order {"order_id": "12345"}'

    first = await api.chat(session, call)
    assert [(c["name"], c["success"]) for c in first["tool_calls"]] == [("check_order", True)]

    status, patched, _ = await api.patch("/v1/tools/check_order", {"enabled": False})
    assert status == 200 and patched["enabled"] is False
    refused = await api.chat(session, call)
    [c] = refused["tool_calls"]
    assert c["name"] == "check_order" and c["success"] is False and "disabled" in c["error"], c
    not_offered = await api.chat(session, "where is my order 777?")
    assert not_offered["tool_calls"] == [] and not_offered["rounds"] == 1, not_offered

    assert (await api.patch("/v1/tools/check_order", {"enabled": True}))[0] == 200
    again = await api.chat(session, "where is my order 777?")
    assert [(c["name"], c["success"]) for c in again["tool_calls"]] == [("check_order", True)], again
    assert order("777")["status"] in again["reply"]

    # so does a bot-config change: an allowlist without the tool
    assert (await api.put("/v1/bot-config", {"allowlist": []}))[0] == 200
    denied = await api.chat(session, call)
    # nothing is offered: the history's tools are defined with their use forbidden (tool_choice
    # none), so not even a forced call reaches the tool
    assert denied["tool_calls"] == [] and denied["reply"], denied
    assert (await api.put("/v1/bot-config", {"allowlist": ["check_order"]}))[0] == 200
    assert (await api.chat(session, call))["tool_calls"][0]["success"] is True

    # a rollback reaches it too: version 1 is enabled again after the patches
    assert (await api.post("/v1/tools/check_order/versions/2/publish"))[0] == 200
    assert (await api.get("/v1/tools/check_order"))[1]["enabled"] is True, "publish keeps the live switch"
    assert (await api.delete("/v1/tools/check_order"))[0] == 204
    gone = await api.chat(session, call)
    assert gone["tool_calls"] == [] and gone["reply"], gone  # deleted: not offered, not callable


# -- 6: SSE --------------------------------------------------------------------------------------

async def read_sse(response) -> list[tuple[str, Any]]:
    events: list[tuple[str, Any]] = []
    name, data = None, []
    async for raw in response.content:
        line = raw.decode().rstrip("\r\n")
        if not line:
            if name is not None:
                events.append((name, json.loads("\n".join(data))))
            name, data = None, []
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())
    return events


async def sse_turn(client, stack, tenant, session: str, text: str, message_id: str) -> list:
    """One turn asked for as SSE: its (event, data) pairs, after checking it streamed."""
    async with client.post(f"{stack.gateway.url}/v1/sessions/{session}/messages",
                           headers={**tenant[2], "Accept": "text/event-stream"},
                           json={"text": text, "message_id": message_id}) as r:
        assert r.status == 200 and r.content_type == "text/event-stream"
        return await read_sse(r)


async def test_sse_streams_tool_call_and_result_before_text_then_done_with_the_reply(stack, client, api, tenant):
    assert (await api.post("/v1/tools", seed_000_check_order(stack.demo_store.url)))[0] == 201
    session = sid("sse")
    events = await sse_turn(client, stack, tenant, session, "where is my order 12345?", "m-sse")
    names = [n for n, _ in events]
    assert "tool_call" in names and "tool_result" in names and "text" in names, names
    assert names.index("tool_call") < names.index("tool_result") < names.index("text"), names
    assert names[-1] == "done" and names.count("done") == 1
    done = events[-1][1]
    assert REPLY_FIELDS <= done.keys(), done
    assert done["message_id"] == "m-sse" and done["session_id"] == session
    assert [c["name"] for c in done["tool_calls"]] == ["check_order"] and done["tool_calls"][0]["success"]
    text = "".join(d if isinstance(d, str) else d.get("text", d.get("delta", "")) for n, d in events if n == "text")
    assert text == done["reply"] and order("12345")["status"] in text
    call_event = next(d for n, d in events if n == "tool_call")
    assert "check_order" in json.dumps(call_event)

    # the streamed turn was stored: the same message_id as JSON returns it
    assert await api.chat(session, "where is my order 12345?", message_id="m-sse") == done


async def test_a_broken_model_stream_in_a_streamed_turn_ends_in_the_apology(stack, client, api, tenant):
    # A watched turn streams from the model (a JSON turn asks for whole answers): the stream's
    # own faults must still end in an in-band apology, and the session goes on.
    session = sid("sse-fault")
    events = await sse_turn(client, stack, tenant, session, "/fault malformed-stream\nhello", "m-sse-fault")
    assert events[-1][0] == "done" and "technical problem" in events[-1][1]["reply"], events
    # the JSON turn after it asks for whole answers, and gets one; its own fault is the body's
    assert "technical problem" not in (await api.chat(session, "hello there"))["reply"]
    assert "technical problem" in (await api.chat(session, "/fault truncated-stream\nhello"))["reply"]


# -- 7: idempotent message_id ---------------------------------------------------------------------

async def test_repeated_message_id_returns_the_first_answer_and_runs_nothing(stack, api, tenant, db):
    assert (await api.post("/v1/tools", seed_000_check_order(stack.demo_store.url)))[0] == 201
    session = sid("idem")
    first = await api.chat(session, "where is my order 12345?", message_id="m-1")
    assert first["tool_calls"][0]["success"] is True
    count = len(await tool_call_rows(db, tenant[0]))
    assert count == 1
    status, view_before, _ = await api.get(f"/v1/sessions/{session}")
    assert status == 200 and view_before["messages"] > 0

    again = await api.chat(session, "where is my order 12345?", message_id="m-1")
    different_text = await api.chat(session, "where is my order 999?", message_id="m-1")
    assert again == first and different_text == first
    assert len(await tool_call_rows(db, tenant[0])) == count
    status, view, _ = await api.get(f"/v1/sessions/{session}")
    assert view == view_before, "a replayed message_id adds nothing to the history"

    other = await api.chat(session, "where is my order 999?", message_id="m-2")
    assert other["message_id"] == "m-2" and order("999")["status"] in other["reply"]
    assert len(await tool_call_rows(db, tenant[0])) == count + 1


async def test_a_reply_says_in_server_timing_where_its_time_went(stack, client, tenant):
    session = sid("timing")
    url = f"{stack.gateway.url}/v1/sessions/{session}/messages"
    before = await scrape(client, stack.gateway.url)
    async with client.post(url, headers=tenant[2], json={"text": "hello", "message_id": "m-1"}) as r:
        body = await r.json()
        header = r.headers["Server-Timing"]
    assert r.status == 200 and "timing" not in body
    seen = {name: float(dur) for name, _, dur in (p.strip().partition(";dur=") for p in header.split(","))}
    assert seen.keys() == {"gateway", "host", "gate", "share", "model", "upstream"}, header
    # the host's turn includes its wait at the output gate and on the model; the gateway's time
    # includes the host's
    assert 0 < seen["gate"] <= seen["host"] <= seen["gateway"], header
    assert 0 < seen["model"] <= seen["host"] and seen["share"] >= 0 and seen["upstream"] == 0, header

    async with client.post(url, headers=tenant[2], json={"text": "hello", "message_id": "m-1"}) as r:
        assert r.headers["X-Replayed"] == "true" and await r.json() == body, "a replay is the first answer"

    # /metrics has the same split, for the turn that ran (the replay ran nothing)
    after = await scrape(client, stack.gateway.url)
    for name, ms in (("ce_turn_host_seconds", seen["host"]), ("ce_turn_gate_seconds", seen["gate"])):
        assert after[(f"{name}_count", ())] - before.get((f"{name}_count", ()), 0) == 1, name
        assert after[(f"{name}_sum", ())] - before.get((f"{name}_sum", ()), 0) == pytest.approx(ms / 1000, abs=1e-4)


async def test_replayed_message_id_is_not_counted_again_in_metrics(stack, client, api):
    assert (await api.post("/v1/tools", seed_000_check_order(stack.demo_store.url)))[0] == 201
    session = sid("idem-metrics")
    first = await api.chat(session, "where is my order 12345?", message_id="m-1")
    before = await scrape(client, stack.gateway.url)
    assert await api.chat(session, "where is my order 12345?", message_id="m-1") == first
    after = await scrape(client, stack.gateway.url)
    assert tool_calls_total(after, "check_order", "success") == tool_calls_total(before, "check_order", "success"), \
        "a replayed answer ran no tool, so /metrics must not count one"


# -- 8: operations, OpenAPI, bot config -----------------------------------------------------------

async def test_health_ready_and_openapi(stack, client):
    async with client.get(f"{stack.gateway.url}/healthz") as r:
        assert r.status == 200 and (await r.json())["status"] == "ok"
    async with client.get(f"{stack.gateway.url}/readyz") as r:
        assert r.status == 200 and (await r.json())["status"] == "ready"
    async with client.get(f"{stack.gateway.url}/openapi.json") as r:
        assert r.status == 200 and r.content_type == "application/json"
        doc = json.loads(await r.text())
    assert doc["openapi"].startswith("3.")
    paths = doc["paths"]
    for path in ("/v1/sessions/{session_id}/messages", "/v1/sessions/{session_id}",
                 "/v1/sessions/{session_id}/approvals/{approval_id}", "/v1/tools", "/v1/tools/{name}",
                 "/v1/tools/{name}/versions", "/v1/tools/{name}/versions/{version}/publish",
                 "/v1/tools/contract", "/v1/analytics/tools", "/v1/bot-config"):
        assert path in paths, path
    assert {"post", "get"} <= paths["/v1/tools"].keys()
    assert {"get", "patch", "delete"} <= paths["/v1/tools/{name}"].keys()
    assert {"get", "put"} <= paths["/v1/bot-config"].keys()
    reply = doc["components"]["schemas"]["TurnReply"]["properties"]
    assert {"reply", "tool_calls", "handoff"} <= reply.keys() and not {"replay", "timing"} & reply.keys(), \
        "fields the gateway strips from the body are not in its schema"
    assert "Server-Timing" in paths["/v1/sessions/{session_id}/messages"]["post"]["responses"]["200"]["headers"]
    create = doc["components"]["schemas"]["ToolCreate"]
    assert {"name", "description", "webhook_url", "auth_header", "timeout_ms"} <= create["properties"].keys()
    # every $ref resolves
    refs = {m for m in _refs(doc)}
    assert refs and all(r.split("/")[-1] in doc["components"]["schemas"] for r in refs), refs


def _refs(node: Any):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "$ref":
                yield v
            else:
                yield from _refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _refs(v)


async def test_bot_config_round_trip_and_unknown_field(stack, api):
    status, empty, _ = await api.get("/v1/bot-config")
    assert status == 200 and empty["intents"] == {}
    config = {
        "persona": "You are Ada of the Test Shop.",
        "intents": {"orders": {"phrases": ["order", "parcel"], "tools": ["check_order"]}},
        "backend": {"base_url": stack.demo_store.url, "auth_header": f"Bearer {SECRET}"},
    }
    status, saved, text = await api.put("/v1/bot-config", config)
    assert status == 200, saved
    assert SECRET not in text and saved["backend"]["auth_header_set"] is True
    status, got, text = await api.get("/v1/bot-config")
    assert status == 200 and SECRET not in text
    assert got["persona"] == config["persona"]
    assert got["intents"]["orders"]["phrases"] == ["order", "parcel"]
    assert got["intents"]["orders"]["tools"] == ["check_order"]
    assert got["backend"]["base_url"] == stack.demo_store.url and got["backend"]["auth_header_set"] is True

    # a PUT without the backend's auth header keeps the stored one
    status, kept, _ = await api.put("/v1/bot-config", {**config, "backend": {"base_url": stack.demo_store.url}})
    assert status == 200 and kept["backend"]["auth_header_set"] is True

    status, problem, _ = await api.put("/v1/bot-config", {**config, "mood": "cheerful"})
    assert status == 422 and "mood" in problem["detail"]
    status, problem, _ = await api.put("/v1/bot-config", {"intents": {"orders": {"phrases": "order"}}})
    assert status == 422 and "$.intents" in problem["detail"], problem
    assert (await api.get("/v1/bot-config"))[1]["persona"] == config["persona"]

    # the persona reaches the live model
    reply = await api.chat(sid("persona"), "hello there")
    assert "Ada" in reply["reply"], reply


# -- more edges of the contract --------------------------------------------------------------------

async def test_parameters_as_a_full_json_schema_and_auth_header_replaced_or_cleared(stack, api, db, tenant):
    body = {**seed_000_check_order(stack.demo_store.url), "parameters": {
        "type": "object", "properties": {"order_id": {"type": "string", "pattern": "^[0-9]+$"}},
        "required": ["order_id"]}}
    status, created, _ = await api.post("/v1/tools", body)
    assert status == 201, created
    assert created["parameters"]["required"] == ["order_id"]
    bad = await api.chat(sid("schema"), '/call check_order {"order_id": "abc"}')
    assert bad["tool_calls"][0]["success"] is False and "order_id" in bad["tool_calls"][0]["error"], bad

    status, replaced, text = await api.patch("/v1/tools/check_order", {"auth_header": "Bearer sk-test-OTHER"})
    assert status == 200 and replaced["auth_header_set"] is True and "sk-test-OTHER" not in text
    enc = await db.fetchval("SELECT auth_header FROM ce_custom_tools WHERE tenant_id = $1", tenant[0])
    from services.tools.crypto import SecretBox

    assert SecretBox(stack.settings.secret_keys).decrypt(enc) == "Bearer sk-test-OTHER"
    status, cleared, _ = await api.patch("/v1/tools/check_order", {"auth_header": None})
    assert status == 200 and cleared["auth_header_set"] is False
    assert (await api.get("/v1/tools/check_order"))[1]["auth_header_set"] is False
    assert await db.fetchval("SELECT auth_header FROM ce_custom_tools WHERE tenant_id = $1", tenant[0]) is None


async def test_other_body_errors_name_the_field(api):
    status, problem, _ = await api.post("/v1/tools", raw=b"[1, 2]")
    assert status == 422 and "object" in problem["detail"]
    status, problem, _ = await api.post("/v1/sessions/s-x/approvals/ap-1", {"approve": True, "because": "yes"})
    assert status == 422 and "because" in problem["detail"]
    status, problem, _ = await api.post("/v1/sessions/s-x/approvals/ap-1", {"approve": "yes"})
    assert status == 422 and "$.approve" in problem["detail"]
    status, problem, _ = await api.put("/v1/bot-config", {"backend": {"base_url": "http://x", "token": "t"}})
    assert status == 422 and "token" in problem["detail"]
    status, problem, _ = await api.put("/v1/bot-config", {"intents": {"orders": {"phrases": [], "tols": []}}})
    assert status == 422 and "tols" in problem["detail"]
    status, problem, _ = await api.get(f"/v1/sessions/{sid('never')}")
    assert status == 404 and "does not exist" in problem["detail"]
    status, problem, _ = await api.request("PUT", "/v1/tools")
    assert status == 405 and "GET" in problem["detail"] and "POST" in problem["detail"]


async def test_sse_streams_approval_required_then_done_with_the_pending_approval(stack, client, api, tenant):
    body = {**seed_000_check_order(stack.demo_store.url), "name": "cancel_order", "mutability": "write",
            "description": "Cancel an order."}
    assert (await api.post("/v1/tools", body))[0] == 201
    session = sid("sse-approval")
    async with client.post(f"{stack.gateway.url}/v1/sessions/{session}/messages",
                           headers={**tenant[2], "Accept": "text/event-stream"},
                           json={"text": '/call cancel_order {"order_id": "12345"}'}) as r:
        assert r.status == 200
        events = await read_sse(r)
    names = [n for n, _ in events]
    assert "approval_required" in names and names[-1] == "done", names
    done = events[-1][1]
    assert REPLY_FIELDS <= done.keys() and done["pending_approval"]["tools"] == ["cancel_order"], done
    approval = next(d for n, d in events if n == "approval_required")
    assert done["pending_approval"]["approval_id"] in json.dumps(approval)

    async with client.post(f"{stack.gateway.url}/v1/sessions/{session}/approvals/{done['pending_approval']['approval_id']}",
                           headers={**tenant[2], "Accept": "text/event-stream"}, json={"approve": False}) as r:
        assert r.status == 200
        events = await read_sse(r)
    assert events[-1][0] == "done" and "pending_approval" not in events[-1][1]
    assert events[-1][1]["tool_calls"][0]["success"] is False

    decided = events[-1][1]

    # decided already: the stored answer, its one event `done`, said to be a replay
    async with client.post(f"{stack.gateway.url}/v1/sessions/{session}/approvals/{done['pending_approval']['approval_id']}",
                           headers={**tenant[2], "Accept": "text/event-stream"}, json={"approve": True}) as r:
        assert r.status == 200 and r.headers["X-Replayed"] == "true"
        events = await read_sse(r)
    assert events == [("done", decided)], events

    # an id never issued: refused before any event, so with the 404 problem a JSON call gets
    forged = done["pending_approval"]["approval_id"].split(".")[0] + ".AAAAAAAAAAAAAAAAAAAAAAAA"
    async with client.post(f"{stack.gateway.url}/v1/sessions/{session}/approvals/{forged}",
                           headers={**tenant[2], "Accept": "text/event-stream"}, json={"approve": True}) as r:
        problem = await r.json(content_type="application/problem+json")
    assert r.status == 404 and problem["title"] == "Not found", problem
    assert "not valid for this session" in problem["detail"], problem
