"""MCP as a tool source, end to end: a real MCP server (the official SDK's MCPServer over
streamable HTTP, on 127.0.0.2, which the stack's SSRF allowlist admits) registered by a tenant
through the gateway; its tools listed in the catalog, gated, called with `/call`, broken (the
breaker trips), and its destructive tool held for approval, all through the real stack (gateway +
Ray session hosts + Postgres + the local model)."""

from __future__ import annotations

import json

import pytest

from tests.support.api import Api, call
from tests.support.mcp_server import ShopMcpServer, serving

TOKEN = "Bearer mcp-test-token"


@pytest.fixture(scope="module")
def shop():
    with serving(ShopMcpServer(token=TOKEN)) as server:
        yield server


async def register_shop(api: Api, shop: ShopMcpServer, **extra) -> dict:
    body = {"name": "shop", "url": shop.url, "auth_header": TOKEN,
            "read_only_tools": ["lookup_order", "check_stock"], **extra}
    status, created = await api.call("POST", "/v1/mcp-servers", body)
    assert status == 201, created
    return created


@pytest.fixture
def api(stack, client, tenant):
    return Api(client, stack.gateway.url, tenant[2])


def calls(reply: dict) -> list[tuple[str, bool]]:
    return [(c["name"], c["success"]) for c in reply["tool_calls"]]


async def test_its_tools_are_listed_called_and_gated_like_any_other_tool(api, shop):
    created = await register_shop(api, shop)
    assert created["auth_header_set"] is True and "auth_header" not in created
    assert TOKEN not in json.dumps(created)

    status, view = await api.call("GET", "/v1/mcp-servers/shop")
    assert status == 200 and TOKEN not in json.dumps(view)
    tools = {t["name"]: t for t in view["tools"]}
    assert set(tools) == {"shop__lookup_order", "shop__check_stock", "shop__delete_customer",
                          "shop__archive_order"}, view
    assert all(t["origin"] == "mcp" and t["type"] == "mcp" and t["offered"] for t in tools.values())
    assert "(read)" in tools["shop__lookup_order"]["runs"]
    assert "held for approval" in tools["shop__delete_customer"]["runs"]
    assert "held for approval" in tools["shop__archive_order"]["runs"]  # its read-only hint is not trusted
    _, report = await api.call("GET", "/v1/tools/contract")
    assert {"shop__lookup_order", "shop__delete_customer"} <= {t["name"] for t in report["tools"]}

    # called through the gateway, with the tenant's credentials, structured content as the result
    reply = await api.chat("mcp-1", call("shop__lookup_order", {"order_id": "A-100"}))
    assert calls(reply) == [("shop__lookup_order", True)], reply
    assert "shipped" in reply["reply"]
    assert shop.called("lookup_order") == [{"order_id": "A-100"}]
    assert {r["authorization"] for r in shop.requests} == {TOKEN}
    # the model picks it from the contact's words while it is offered ...
    reply = await api.chat("mcp-1", "please lookup order 4411")
    assert calls(reply) == [("shop__lookup_order", True)], reply
    assert {"order_id": "4411"} in shop.called("lookup_order")

    # ... a disabled server is not contacted and offers nothing; a call to its tool is unknown
    status, patched = await api.call("PATCH", "/v1/mcp-servers/shop", {"enabled": False})
    assert status == 200 and patched["enabled"] is False and patched["auth_header_set"] is True
    before = len(shop.calls)
    reply = await api.chat("mcp-1", "please lookup order 4411")
    assert reply["tool_calls"] == [], reply
    reply = await api.chat("mcp-1", call("shop__lookup_order", {"order_id": "A-100"}))
    [refused] = reply["tool_calls"]
    assert not refused["success"] and "there is no tool named 'shop__lookup_order'" in refused["error"]
    assert len(shop.calls) == before
    _, view = await api.call("GET", "/v1/mcp-servers/shop")
    assert view["tools"] == []

    # analytics count MCP calls like any other
    _, analytics = await api.call("GET", "/v1/analytics/tools?since=1h")
    used = {t["name"]: t for t in analytics["tools"]}
    assert used["shop__lookup_order"]["calls"] >= 2, analytics


async def test_a_failing_tool_trips_the_breaker_after_three_failures(api, shop):
    await register_shop(api, shop)
    session = "mcp-breaker"
    first = await api.chat(session, "check stock please, sku: 12345")
    assert calls(first) == [("shop__check_stock", False)], first
    assert "the tool reported an error" in first["tool_calls"][0]["error"]
    for _ in range(2):
        reply = await api.chat(session, call("shop__check_stock", {"sku": "12345"}))
        assert calls(reply) == [("shop__check_stock", False)], reply
    ran = len(shop.called("check_stock"))
    assert ran >= 3

    fourth = await api.chat(session, call("shop__check_stock", {"sku": "12345"}))
    [refused] = fourth["tool_calls"]
    assert not refused["success"] and "failed too often" in refused["error"], fourth
    assert len(shop.called("check_stock")) == ran  # refused in-band: nothing reached the server
    status, state = await api.call("GET", f"/v1/sessions/{session}")
    assert status == 200 and "shop__check_stock" in state["open_breakers"]
    not_offered = await api.chat(session, "check stock please, sku: 12345")
    assert not_offered["tool_calls"] == [], not_offered
    # the rest of the server's tools still work in that session
    reply = await api.chat(session, call("shop__lookup_order", {"order_id": "B-2"}))
    assert calls(reply) == [("shop__lookup_order", True)]


async def test_destructive_and_unvouched_tools_are_held_for_approval(api, shop):
    # the tenant even lists delete_customer as read-only: the server's destructive hint still wins
    await register_shop(api, shop, read_only_tools=["lookup_order", "delete_customer"])
    held = await api.chat("mcp-approve", call("shop__delete_customer", {"ref": "C-9"}))
    pending = held.get("pending_approval")
    assert pending and pending["tools"] == ["shop__delete_customer"], held
    assert shop.called("delete_customer") == []  # nothing irreversible before approval
    status, done = await api.call(
        "POST", f"/v1/sessions/mcp-approve/approvals/{pending['approval_id']}", {"approve": True})
    assert status == 200 and calls(done) == [("shop__delete_customer", True)], done
    assert shop.called("delete_customer") == [{"ref": "C-9"}]
    keys = [r["idempotency_key"] for r in shop.requests if r["idempotency_key"]]
    assert keys, "a write to an mcp server carries an Idempotency-Key"

    # a read-only hint alone never skips the approval
    held = await api.chat("mcp-approve", call("shop__archive_order", {"order_id": "A-1"}))
    pending = held.get("pending_approval")
    assert pending and pending["tools"] == ["shop__archive_order"], held
    status, denied = await api.call(
        "POST", f"/v1/sessions/mcp-approve/approvals/{pending['approval_id']}", {"approve": False})
    assert status == 200 and calls(denied) == [("shop__archive_order", False)]
    assert shop.called("archive_order") == []


async def test_a_server_at_the_metadata_address_is_refused_at_registration(api, shop):
    status, problem = await api.call("POST", "/v1/mcp-servers", {"name": "meta", "url": "http://169.254.169.254/mcp"})
    assert status == 422 and "points at 169.254.169.254" in problem["detail"] and "`$.url`" in problem["detail"]
    await register_shop(api, shop)
    status, problem = await api.call("PATCH", "/v1/mcp-servers/shop", {"url": "http://10.0.0.1/mcp"})
    assert status == 422 and "points at 10.0.0.1" in problem["detail"], problem
    assert (await api.call("GET", "/v1/mcp-servers/meta"))[0] == 404


async def test_a_server_whose_name_resolves_to_a_refused_address_is_reported_not_called(api, shop):
    # A host name passes registration (it may resolve differently later); the guard refuses it at
    # connect time: localhost is loopback, which this stack admits only at 127.0.0.2.
    status, _ = await api.call("POST", "/v1/mcp-servers", {"name": "near", "url": "http://localhost:9/mcp"})
    assert status == 201
    status, view = await api.call("GET", "/v1/mcp-servers/near")
    [entry] = view["tools"]
    assert entry["name"] == "near__*" and not entry["offered"]
    assert "destination not allowed" in entry["findings"][0]["message"], entry
    status, listed = await api.call("GET", "/v1/mcp-servers")
    assert [s["name"] for s in listed["mcp_servers"]] == ["near"]
    assert (await api.call("DELETE", "/v1/mcp-servers/near"))[0] == 204
    assert (await api.call("GET", "/v1/mcp-servers/near"))[0] == 404


async def test_registrations_are_validated(api, shop):
    bad = [
        {"name": "a__b", "url": shop.url},
        {"name": "shop", "url": "ftp://example.com/mcp"},
        {"name": "shop", "url": "http://user:pw@example.com/mcp"},
        {"name": "shop", "url": shop.url, "timeout_ms": 5},
        {"name": "shop", "url": shop.url, "surprise": 1},
    ]
    for body in bad:
        status, problem = await api.call("POST", "/v1/mcp-servers", body)
        assert status == 422, (body, problem)
    status, problem = await api.call("POST", "/v1/mcp-servers", {"name": "shop", "url": "ftp://example.com/mcp"})
    assert "such as https://mcp.example.com/mcp - at `$.url`" in problem["detail"], problem
    await register_shop(api, shop)
    status, _ = await api.call("POST", "/v1/mcp-servers", {"name": "shop", "url": shop.url})
    assert status == 409
