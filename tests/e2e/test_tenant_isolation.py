"""Tenant isolation on every /v1 route, through the real stack.

Tenant A owns tools, a session with history and variables, call analytics and a held approval.
Tenant B, with its own valid key, tries every route on A's names and ids: each answers 404
exactly as for a thing that does not exist (never 403, which would confirm it exists), and
nothing of A's changes. Without a valid key every route is 401.
"""

from __future__ import annotations

import secrets
from typing import Any

import pytest
import pytest_asyncio

from kernel.records import session_uid
from tests.support.api import Api
from tests.support.e2e import new_tenant

PROBLEM_JSON = "application/problem+json"


def assert_problem(status: int, content_type: str, body: Any) -> None:
    assert content_type == PROBLEM_JSON, (status, content_type, body)
    assert {"type", "title", "status", "detail"} <= body.keys() and body["status"] == status, body
    assert body["detail"].strip()


@pytest_asyncio.fixture(scope="module")
async def world(stack, client) -> dict[str, Any]:
    """A with two tools, a session that used one (variable set, call logged); B with nothing."""
    a_id, a_key = await new_tenant(stack, "iso-a")
    b_id, b_key = await new_tenant(stack, "iso-b")
    a = Api(client, stack.gateway.url, a_key, on_error=assert_problem)
    b = Api(client, stack.gateway.url, b_key, on_error=assert_problem)
    store = stack.demo_store.url
    for body in (
        {"name": "check_order", "description": "Look up a customer order by order number.",
         "parameters": {"order_id": {"type": "string", "description": "The order number"}},
         "webhook_url": f"{store}/api/orders/{{order_id}}", "auth_header": "Bearer sk-test-SECRET",
         "completes_variable": "order_checked"},
        {"name": "cancel_order", "description": "Cancel a customer order.", "mutability": "write",
         "parameters": {"order_id": {"type": "string", "description": "The order number"}},
         "webhook_url": f"{store}/api/orders/{{order_id}}"},
    ):
        status, created = await a.call("POST", "/v1/tools", body)
        assert status == 201, created
    session = f"shared-{secrets.token_hex(4)}"
    reply = await a.chat(session, '/call check_order {"order_id": "12345"}')
    assert reply["tool_calls"][0]["success"] is True, reply
    return {"a": a, "b": b, "a_id": a_id, "b_id": b_id, "session": session}


TOOL_ROUTES = [
    ("GET", "/v1/tools/check_order", None),
    ("PATCH", "/v1/tools/check_order", {"description": "taken over"}),
    ("PATCH", "/v1/tools/check_order", {"enabled": False}),
    ("DELETE", "/v1/tools/check_order", None),
    ("GET", "/v1/tools/check_order/versions", None),
    ("POST", "/v1/tools/check_order/versions/1/publish", None),
]


@pytest.mark.parametrize(("method", "path", "body"), TOOL_ROUTES, ids=[f"{m} {p}" for m, p, _ in TOOL_ROUTES])
async def test_another_tenant_gets_404_for_every_route_on_a_tool(world, method, path, body):
    status, problem = await world["b"].call(method, path, body)
    assert status == 404, problem
    assert "check_order" in problem["detail"] and "does not exist" in problem["detail"]
    # ... and it is the very answer A gets for a tool it does not have
    status, own = await world["a"].call(method, path.replace("check_order", "no_such_tool"), body)
    assert status == 404 and own["title"] == problem["title"]

    status, tool = await world["a"].call("GET", "/v1/tools/check_order")
    assert status == 200 and tool["version"] == 1 and tool["enabled"] is True
    assert tool["description"] == "Look up a customer order by order number."
    status, versions = await world["a"].call("GET", "/v1/tools/check_order/versions")
    assert [v["version"] for v in versions["versions"]] == [1]


async def test_another_tenant_lists_analytics_and_contract_without_a_tools(world):
    a, b = world["a"], world["b"]
    status, listed = await b.call("GET", "/v1/tools")
    assert status == 200 and listed["tools"] == []
    status, analytics = await b.call("GET", "/v1/analytics/tools?since=1h")
    assert status == 200 and analytics["tools"] == [] and analytics["never_used"] == []
    status, report = await b.call("GET", "/v1/tools/contract")
    assert status == 200, report
    assert report["tenant_id"] == world["b_id"]
    assert not {"check_order", "cancel_order"} & {t["name"] for t in report["tools"]}
    status, config = await b.call("GET", "/v1/bot-config")
    assert status == 200 and config["intents"] == {}

    status, listed = await a.call("GET", "/v1/tools")
    assert [t["name"] for t in listed["tools"]] == ["cancel_order", "check_order"]
    status, analytics = await a.call("GET", "/v1/analytics/tools?since=1h")
    assert [(t["name"], t["calls"]) for t in analytics["tools"]] == [("check_order", 1)]
    status, report = await a.call("GET", "/v1/tools/contract")
    assert status == 200 and report["tenant_id"] == world["a_id"]
    assert {"check_order", "cancel_order"} <= {t["name"] for t in report["tools"]}


async def test_same_tool_name_in_two_tenants_is_two_independent_tools(stack, client, world, tenant):
    c = Api(client, stack.gateway.url, tenant[1], on_error=assert_problem)
    body = {"name": "check_order", "description": "C's own lookup.",
            "parameters": {"order_id": {"type": "string"}},
            "webhook_url": f"{stack.demo_store.url}/api/orders/{{order_id}}"}
    status, created = await c.call("POST", "/v1/tools", body)
    assert status == 201 and created["version"] == 1 and created["auth_header_set"] is False
    assert (await c.call("PATCH", "/v1/tools/check_order", {"description": "C v2"}))[0] == 200
    assert (await c.call("DELETE", "/v1/tools/check_order"))[0] == 204

    status, tool = await world["a"].call("GET", "/v1/tools/check_order")
    assert status == 200 and tool["version"] == 1 and tool["auth_header_set"] is True
    assert tool["description"] == "Look up a customer order by order number."


async def test_another_tenant_cannot_inspect_or_join_a_session(stack, world):
    from storage.pool import connect

    a, b, session = world["a"], world["b"], world["session"]
    status, a_view = await a.call("GET", f"/v1/sessions/{session}")
    assert status == 200 and a_view["variables"] == {"order_checked": "true"} and a_view["messages"] >= 4

    status, problem = await b.call("GET", f"/v1/sessions/{session}")
    assert status == 404 and session in problem["detail"]

    # B writing to the same id gets its own, new session: no A history, variables or tools
    used = await b.chat(session, '/call check_order {"order_id": "12345"}')
    [call] = used["tool_calls"]
    assert call["success"] is False and "no tool named 'check_order'" in call["error"], call
    status, b_view = await b.call("GET", f"/v1/sessions/{session}")
    assert status == 200 and b_view["variables"] == {} and b_view["open_breakers"] == [], b_view
    assert b_view["session_id"] == session

    status, a_after = await a.call("GET", f"/v1/sessions/{session}")
    assert a_after == a_view, "B's messages must not land in A's session"

    conn = await connect(stack.settings.database_url)
    try:
        b_rows = await conn.fetch(
            "SELECT content::text AS c FROM ce_messages WHERE tenant_id = $1 AND session_id = $2",
            world["b_id"], session_uid(world["b_id"], session))
        a_calls = await conn.fetchval("SELECT count(*) FROM ce_tool_calls WHERE tenant_id = $1", world["a_id"])
    finally:
        await conn.close()
    # exactly B's one turn (its message, the refused call, its result, the reply): nothing of A's
    assert len(b_rows) == b_view["messages"] == 4, (b_rows, b_view)
    assert not any('"status"' in r["c"] for r in b_rows), "B's history holds none of A's tool results"
    assert a_calls == 1

    # A's session goes on with its own state
    again = await a.chat(session, "hello again")
    assert again["session_id"] == session
    status, a_view2 = await a.call("GET", f"/v1/sessions/{session}")
    assert a_view2["variables"] == {"order_checked": "true"} and a_view2["messages"] > a_view["messages"]


async def test_another_tenant_cannot_decide_a_held_approval(world):
    a, b = world["a"], world["b"]
    session = f"approve-{secrets.token_hex(4)}"
    held = await a.chat(session, '/call cancel_order {"order_id": "12345"}')
    pending = held.get("pending_approval")
    assert pending and pending["tools"] == ["cancel_order"], held
    path = f"/v1/sessions/{session}/approvals/{pending['approval_id']}"

    for decision in (True, False):
        status, problem = await b.call("POST", path, {"approve": decision})
        assert status == 404, problem
        assert "approval" in problem["detail"]

    status, decided = await a.call("POST", path, {"approve": False})
    assert status == 200, decided
    assert "pending_approval" not in decided
    [call] = decided["tool_calls"]
    assert call["name"] == "cancel_order" and call["success"] is False
    status, again = await a.call("POST", path, {"approve": True})
    assert status == 200 and again == decided, "a decided approval answers as it did, and runs nothing"
    status, problem = await b.call("POST", path, {"approve": True})
    assert status == 404 and "approval" in problem["detail"], "nor does another tenant get its answer"


ALL_ROUTES = [
    ("POST", "/v1/sessions/s-1/messages", {"text": "hi"}),
    ("GET", "/v1/sessions/s-1", None),
    ("POST", "/v1/sessions/s-1/approvals/ap-1", {"approve": True}),
    ("POST", "/v1/tools", {"name": "x"}),
    ("GET", "/v1/tools", None),
    ("GET", "/v1/tools/contract", None),
    ("GET", "/v1/tools/check_order", None),
    ("PATCH", "/v1/tools/check_order", {"enabled": False}),
    ("DELETE", "/v1/tools/check_order", None),
    ("GET", "/v1/tools/check_order/versions", None),
    ("POST", "/v1/tools/check_order/versions/1/publish", None),
    ("GET", "/v1/analytics/tools", None),
    ("GET", "/v1/bot-config", None),
    ("PUT", "/v1/bot-config", {"persona": "You are Mallory."}),
]


@pytest.mark.parametrize("auth", [None, "Bearer ce_not-a-key", "Token abc", "Bearer"])
async def test_every_route_needs_a_valid_key(stack, client, world, auth):
    headers = {} if auth is None else {"Authorization": auth}
    for method, path, body in ALL_ROUTES:
        async with client.request(method, stack.gateway.url + path, headers=headers, json=body) as r:
            data = await r.json(content_type=None)
            assert r.status == 401, (method, path, data)
            assert_problem(401, r.content_type, data)
    status, tool = await world["a"].call("GET", "/v1/tools/check_order")
    assert status == 200 and tool["enabled"] is True
