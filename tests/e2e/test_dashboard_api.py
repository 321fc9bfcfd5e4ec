"""The dashboard's own routes through the real stack, without a browser: the page and its static
files (headers, no way out of the static folder), and the read-only JSON it adds: recent sessions,
a session's turns with redacted tool calls, calls over time. Tenant-scoped like every /v1 route."""

from __future__ import annotations

import json
import secrets
from typing import Any

import pytest

from tests.support.e2e import new_tenant

pytestmark = pytest.mark.e2e


async def call(client, url: str, headers: dict, method: str = "GET", body: Any = None) -> tuple[int, Any]:
    async with client.request(method, url, headers=headers, json=body) as r:
        return r.status, await r.json(content_type=None)


async def test_the_page_and_its_files_are_served_with_a_strict_policy_and_nothing_else(stack, client):
    gw = stack.gateway.url
    async with client.get(gw + "/") as r:
        html = await r.text()
        assert r.status == 200 and r.content_type == "text/html"
        csp = r.headers["Content-Security-Policy"]
        assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "script-src 'self'" in csp
        assert r.headers["X-Frame-Options"] == "DENY"
    assert '<script src="/static/app.js"' in html and "/static/app.css" in html
    for name, kind in (("app.js", "text/javascript"), ("app.css", "text/css")):
        async with client.get(f"{gw}/static/{name}") as r:
            assert r.status == 200 and r.content_type == kind, name
            assert len(await r.read()) > 1000
    for bad in ("/static/nope.js", "/static/..%2Fapp.py", "/static/app.py", "/static/.env"):
        async with client.get(gw + bad) as r:
            body = await r.json(content_type=None)
            assert r.status == 404 and r.content_type == "application/problem+json", bad
            assert body["detail"], bad


async def test_session_routes_need_the_key_and_see_only_the_tenants_own_sessions(stack, client, tenant, make_other):
    gw = stack.gateway.url
    _, _, headers = tenant
    other = await make_other()
    for path in ("/v1/sessions", "/v1/sessions/x/calls", "/v1/analytics/tools/timeseries"):
        status, problem = await call(client, gw + path, {})
        assert status == 401 and "Bearer" in problem["detail"], path

    session = f"mine-{secrets.token_hex(3)}"
    status, reply = await call(client, f"{gw}/v1/sessions/{session}/messages", headers, "POST", {"text": "hello"})
    assert status == 200, reply
    status, listed = await call(client, gw + "/v1/sessions", headers)
    assert status == 200 and [s["session_id"] for s in listed["sessions"]] == [session]
    assert listed["sessions"][0]["messages"] == 2 and listed["sessions"][0]["handoff"] is False

    status, theirs = await call(client, gw + "/v1/sessions", other)
    assert status == 200 and session not in [s["session_id"] for s in theirs["sessions"]]
    status, problem = await call(client, f"{gw}/v1/sessions/{session}/calls", other)
    assert status == 404 and session in problem["detail"]

    status, problem = await call(client, gw + "/v1/sessions?limit=0", headers)
    assert status == 422 and "limit must be a whole number from 1 to 500" in problem["detail"]


async def test_a_sessions_calls_come_grouped_by_turn_with_sensitive_and_secret_looking_values_redacted(
        stack, client, tenant):
    gw = stack.gateway.url
    _, _, headers = tenant
    tool = {
        "name": "lookup_order", "description": "Look up an order by its number.",
        "parameters": {"order_id": {"type": "string"}, "email": {"type": "string"}, "api_token": {"type": "string"}},
        "webhook_url": f"{stack.demo_store.url}/api/orders/{{order_id}}", "sensitive": ["email"],
    }
    assert (await call(client, gw + "/v1/tools", headers, "POST", tool))[0] == 201
    session = f"calls-{secrets.token_hex(3)}"
    args = {"order_id": "12345", "email": "ann@example.com", "api_token": "tok-123"}
    first = f"/call lookup_order {json.dumps(args)}"
    status, reply = await call(client, f"{gw}/v1/sessions/{session}/messages", headers, "POST",
                               {"text": first, "message_id": "turn-1"})
    assert status == 200 and reply["tool_calls"][0]["success"] is True, reply
    status, _ = await call(client, f"{gw}/v1/sessions/{session}/messages", headers, "POST",
                           {"text": "thanks", "message_id": "turn-2"})
    assert status == 200

    status, body = await call(client, f"{gw}/v1/sessions/{session}/calls", headers)
    assert status == 200 and body["session_id"] == session
    turns = body["turns"]
    assert [t["message_id"] for t in turns] == ["turn-2", "turn-1"], "newest first"
    assert turns[0]["calls"] == [] and turns[0]["text"] == "thanks"
    assert turns[1]["text"] == first and "12345" in turns[1]["reply"]
    (c,) = turns[1]["calls"]
    assert c["name"] == "lookup_order" and c["success"] is True and c["latency_ms"] >= 0
    assert c["parameters"] == {"order_id": "12345", "email": "[redacted]", "api_token": "[redacted]"}
    # (the user's own text is shown as written: here it spells the values out)
    assert "ann@example.com" not in json.dumps(turns[1]["calls"]) and "tok-123" not in json.dumps(turns[1]["calls"])


async def test_calls_over_time_are_zero_filled_per_tool_and_add_up_to_the_analytics(stack, client, tenant):
    gw = stack.gateway.url
    _, _, headers = tenant
    tool = {"name": "track_order", "description": "Track an order by its number.",
            "parameters": {"order_id": {"type": "string"}},
            "webhook_url": f"{stack.demo_store.url}/api/orders/{{order_id}}"}
    assert (await call(client, gw + "/v1/tools", headers, "POST", tool))[0] == 201
    session = f"ts-{secrets.token_hex(3)}"
    lines = "\n".join(f'/call track_order {{"order_id": "{n}"}}' for n in ("1", "2", "x"))  # x: the store says 404
    status, reply = await call(client, f"{gw}/v1/sessions/{session}/messages", headers, "POST", {"text": lines})
    assert status == 200 and [c["success"] for c in reply["tool_calls"]] == [True, True, False], reply

    status, ts = await call(client, gw + "/v1/analytics/tools/timeseries?since=2h", headers)
    assert status == 200
    assert ts["bucket_seconds"] == 300, "2 hours in at most 48 buckets: 5 minutes"
    n = len(ts["buckets"])
    assert 24 <= n <= 25
    (series,) = ts["tools"]
    assert series["name"] == "track_order" and series["total"] == 3
    assert len(series["calls"]) == len(series["successes"]) == n
    assert sum(series["calls"]) == 3 and sum(series["successes"]) == 2
    assert ts["total"] == {"calls": series["calls"], "successes": series["successes"]}
    status, stats = await call(client, gw + "/v1/analytics/tools?since=2h", headers)
    assert [(t["name"], t["calls"]) for t in stats["tools"]] == [("track_order", 3)]

    status, hourly = await call(client, gw + "/v1/analytics/tools/timeseries?since=1d&bucket=1h", headers)
    assert status == 200 and hourly["bucket_seconds"] == 3600 and sum(hourly["total"]["calls"]) == 3


@pytest.mark.parametrize(("query", "message"), [
    ("since=30d&bucket=1m", "more than 1000 buckets"),
    ("bucket=fortnight", "bucket must be a width like 5m, 1h or 1d"),
    ("bucket=0h", "bucket must be a width like 5m, 1h or 1d"),
    ("since=yesterday", "since must be an ISO-8601 time"),
    ("since=2999-01-01T00:00:00Z", "since must be in the past"),
])
async def test_calls_over_time_refuses_a_bad_range_saying_what_to_send(stack, client, tenant, query, message):
    status, problem = await call(client, f"{stack.gateway.url}/v1/analytics/tools/timeseries?{query}", tenant[2])
    assert status == 422 and message in problem["detail"], problem


@pytest.fixture
def make_other(stack, client):
    """Headers of another new tenant on the same stack."""
    async def make() -> dict[str, str]:
        _, key = await new_tenant(stack, "e2e-other")
        return {"Authorization": f"Bearer {key}"}
    return make
