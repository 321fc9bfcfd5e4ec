"""Seed 001 end to end through the gateway: approvals (JSON and SSE, denial, mixed batch, restart
while pending), workflow jobs delivered later, the catalog binding's search -> q mapping, and the
tool-contract report. The tenant's backend is a real aiohttp server on 127.0.0.2 (allowlisted)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import jwt
import pytest
import pytest_asyncio
from aiohttp import web

from actors.placement import rendezvous_index
from tests.support.api import call, post, register

CATALOG_OPENAPI = {"paths": {"/example/catalog": {"get": {"parameters": [
    {"name": "q", "in": "query", "required": True},
    {"name": "per_page", "in": "query"},
    {"name": "account_id", "in": "query", "required": True},
]}}}}


class Backend:
    """The tenant's system: records every request it gets."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.requests.append({
            "method": request.method, "path": request.path, "query": dict(request.query),
            "json": json.loads(body) if body else None,
            "idempotency_key": request.headers.get("Idempotency-Key"),
        })
        if request.path == "/jobs":
            return web.json_response({"accepted": True}, status=202)
        return web.json_response({"ok": True, "path": request.path, "query": dict(request.query)})

    def to(self, path: str) -> list[dict]:
        return [r for r in self.requests if r["path"] == path]


@pytest_asyncio.fixture
async def backend():
    b = Backend()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", b.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.2", 0)
    await site.start()
    b.url = f"http://127.0.0.2:{runner.addresses[0][1]}"
    try:
        yield b
    finally:
        await runner.cleanup()


def write_tool(backend: Backend, name: str) -> dict:
    return {"name": name, "description": f"{name}: changes a record", "type": "webhook",
            "parameters": {"ref": {"type": "string", "description": "record"}},
            "webhook_url": f"{backend.url}/{name}", "mutability": "write", "timeout_ms": 5000}


async def test_write_tool_waits_for_approval_then_runs_exactly_once(stack, client, tenant, backend):
    _, _, headers = tenant
    gw = stack.gateway.url
    await register(client, gw, headers, write_tool(backend, "cancel_order"))
    status, held = await post(client, f"{gw}/v1/sessions/ap-1/messages", headers,
                              {"text": call("cancel_order", {"ref": "A1"}), "message_id": "m1"})
    assert status == 200 and held["pending_approval"]["tools"] == ["cancel_order"]
    assert held["pending_approval"]["summary"] == ["Run cancel order with ref=A1?"]
    assert backend.to("/cancel_order") == []  # nothing irreversible before approval
    approval = held["pending_approval"]["approval_id"]
    status, done = await post(client, f"{gw}/v1/sessions/ap-1/approvals/{approval}", headers, {"approve": True})
    assert status == 200, done
    assert [c["name"] for c in done["tool_calls"]] == ["cancel_order"] and done["tool_calls"][0]["success"]
    assert len(backend.to("/cancel_order")) == 1
    assert backend.to("/cancel_order")[0]["idempotency_key"]  # writes carry an Idempotency-Key
    status, again = await post(client, f"{gw}/v1/sessions/ap-1/approvals/{approval}", headers, {"approve": True})
    assert status == 200 and again == done  # decided: its answer again, nothing runs twice
    assert len(backend.to("/cancel_order")) == 1


async def test_denied_approval_over_sse_goes_back_to_the_model_and_runs_nothing(stack, client, tenant, backend):
    _, _, headers = tenant
    gw = stack.gateway.url
    await register(client, gw, headers, write_tool(backend, "delete_account"))
    status, events = await post(client, f"{gw}/v1/sessions/ap-2/messages", headers,
                                {"text": call("delete_account", {"ref": "X"})}, sse=True)
    kinds = [e for e, _ in events]
    assert status == 200 and "approval_required" in kinds and kinds[-1] == "done"
    approval = dict(events)["approval_required"]["approval_id"]
    status, events = await post(client, f"{gw}/v1/sessions/ap-2/approvals/{approval}", headers,
                                {"approve": False}, sse=True)
    done = events[-1][1]
    assert events[-1][0] == "done" and not done["tool_calls"][0]["success"]
    assert "declined" in done["tool_calls"][0]["error"]
    assert backend.to("/delete_account") == []


async def test_a_mixed_batch_runs_nothing_until_the_whole_batch_is_approved(stack, client, tenant, backend):
    _, _, headers = tenant
    gw = stack.gateway.url
    gated = write_tool(backend, "refund")
    ungated = {**write_tool(backend, "add_note"), "requires_approval": False}
    await register(client, gw, headers, gated)
    await register(client, gw, headers, ungated)
    text = call("add_note", {"ref": "n1"}) + "\n" + call("refund", {"ref": "r1"})
    _, held = await post(client, f"{gw}/v1/sessions/ap-3/messages", headers, {"text": text})
    assert held["pending_approval"]["tools"] == ["refund"]
    assert backend.to("/add_note") == [] and backend.to("/refund") == []  # not even the ungated write
    approval = held["pending_approval"]["approval_id"]
    _, done = await post(client, f"{gw}/v1/sessions/ap-3/approvals/{approval}", headers, {"approve": True})
    assert [c["name"] for c in done["tool_calls"]] == ["add_note", "refund"]
    assert len(backend.to("/add_note")) == 1 and len(backend.to("/refund")) == 1


async def test_a_pending_approval_survives_a_host_restart(stack, client, tenant, backend):
    tenant_id, _, headers = tenant
    gw = stack.gateway.url
    await register(client, gw, headers, write_tool(backend, "close_ticket"))
    status, held = await post(client, f"{gw}/v1/sessions/ap-4/messages", headers, {"text": call("close_ticket", {"ref": "T"})})
    approval = held["pending_approval"]["approval_id"]
    host = f"ce-host-{rendezvous_index(f'{tenant_id}:ap-4', stack.placement.shards)}"
    before = {s["host"]: s["pid"] for s in await stack.placement.stats()}
    os.kill(before[host], signal.SIGKILL)
    for _ in range(120):  # Ray restarts the actor (max_restarts=-1)
        await asyncio.sleep(0.5)
        now = {s["host"]: s["pid"] for s in await stack.placement.stats()}
        if now.get(host) not in (None, before[host]):
            break
    else:
        pytest.fail(f"{host} did not come back")
    for _ in range(20):
        status, done = await post(client, f"{gw}/v1/sessions/ap-4/approvals/{approval}", headers, {"approve": True})
        if status != 503:
            break
        await asyncio.sleep(0.5)
    assert status == 200, done
    assert done["tool_calls"][0]["name"] == "close_ticket" and done["tool_calls"][0]["success"]
    assert len(backend.to("/close_ticket")) == 1


async def test_workflow_result_reaches_the_session_on_its_next_turn(stack, client, tenant, backend):
    _, _, headers = tenant
    gw = stack.gateway.url
    await register(client, gw, headers, {
        "name": "build_quote", "type": "workflow", "description": "Prepare a price quote (takes a while).",
        "parameters": {"item": {"type": "string", "description": "what to quote"}},
        "start_url": f"{backend.url}/jobs", "timeout_ms": 5000,
        "notify_on_result": False,  # the result waits for the next message (test_live_sessions_ray: at once)
    })
    status, started = await post(client, f"{gw}/v1/sessions/wf-1/messages", headers, {"text": call("build_quote", {"item": "100 mugs"})})
    assert status == 200 and started["tool_calls"][0]["success"], started
    job = backend.to("/jobs")[0]["json"]
    assert job["arguments"] == {"item": "100 mugs"} and job["callback_path"] == f"/v1/jobs/{job['job_id']}/result"
    status, view = await post(client, f"{gw}{job['callback_path']}", headers, {"status": "succeeded", "result": {"total": 1250}})
    assert status == 200 and view["status"] == "succeeded"
    status, events = await post(client, f"{gw}/v1/sessions/wf-1/messages", headers, {"text": "any news?"}, sse=True)
    delivered = [d for e, d in events if e == "job_result"]
    assert delivered and delivered[0]["job_id"] == job["job_id"] and delivered[0]["result"] == {"total": 1250}
    assert events[-1][1]["deliveries"][0]["job_id"] == job["job_id"]
    status, later = await post(client, f"{gw}/v1/sessions/wf-1/messages", headers, {"text": "thanks"})
    assert not later.get("deliveries")  # delivered once
    status, _ = await post(client, f"{gw}{job['callback_path']}", headers, {"status": "succeeded", "result": {}})
    assert status == 409


async def test_catalog_binding_sends_q_and_the_contract_report_flags_one_that_would_send_search(
    stack, client, tenant, backend
):
    tenant_id, _, headers = tenant
    gw = stack.gateway.url
    # the account is the signed-in customer's, from their token's `sub` (an anonymous session has none)
    secret = "s" * 40
    async with client.put(f"{gw}/v1/bot-config", headers=headers, json={
        "backend": {"base_url": backend.url, "openapi": CATALOG_OPENAPI},
        "contact_verification": {"algorithms": ["HS256"], "hs256_secret": secret, "issuer": "shop", "audience": "bot",
                                 "scope_claims": {"account_id": "sub"}}}) as r:
        assert r.status == 200, await r.text()
    now = int(time.time())
    signed_in = {**headers, "Contact-Token": jwt.encode(
        {"sub": "acct-7", "iss": "shop", "aud": "bot", "iat": now, "exp": now + 300}, secret, algorithm="HS256")}
    binding = {"name": "example_catalog_search", "type": "backend_binding", "mutability": "read",
               "description": "Search the catalog.", "method": "GET", "path": "/example/catalog",
               "parameters": {"search": {"type": "string", "required": True}, "limit": {"type": "integer"}},
               "parameter_map": {"search": "q", "limit": "per_page"}, "scope": ["account_id"]}
    await register(client, gw, headers, binding)
    await register(client, gw, headers, {**binding, "name": "broken_search", "parameter_map": {"limit": "per_page"}})
    sneaky = call("example_catalog_search", {"search": "mug", "limit": 2, "account_id": "someone-else"})
    _, body = await post(client, f"{gw}/v1/sessions/bind-anon/messages", headers, {"text": sneaky})
    assert not body["tool_calls"][0]["success"] and "sign in" in body["tool_calls"][0]["error"], body
    assert backend.to("/example/catalog") == []  # no account: no call, never the tenant's id or the model's
    _, body = await post(client, f"{gw}/v1/sessions/bind-1/messages", signed_in, {"text": sneaky})
    assert body["tool_calls"][0]["success"], body
    query = backend.to("/example/catalog")[0]["query"]
    assert query["q"] == "mug" and query["per_page"] == "2" and "search" not in query
    assert query["account_id"] == "acct-7" != tenant_id  # the trusted one, never the model's
    async with client.get(f"{gw}/v1/tools/contract", headers=headers) as r:
        report = await r.json()
    by_name = {t["name"]: t for t in report["tools"]}
    assert by_name["example_catalog_search"]["findings"] == []
    kinds = {f["kind"] for f in by_name["broken_search"]["findings"]}
    assert {"ignored_argument", "missing_required_parameter"} <= kinds and not report["ok"]


async def test_a_client_tool_becomes_a_client_action_and_the_clients_answer_comes_back(stack, client, tenant):
    _, _, headers = tenant
    gw = stack.gateway.url
    await register(client, gw, headers, {
        "name": "show_product_card", "type": "client", "description": "Show a product card in the app.",
        "parameters": {"sku": {"type": "string"}},
    })
    status, events = await post(client, f"{gw}/v1/sessions/cl-1/messages", headers,
                                {"text": call("show_product_card", {"sku": "MUG-01"})}, sse=True)
    actions = [d for e, d in events if e == "client_action"]
    assert status == 200 and actions and actions[0]["name"] == "show_product_card"
    assert actions[0]["arguments"] == {"sku": "MUG-01"} and actions[0]["job_id"]
    assert events[-1][1]["tool_calls"][0]["success"]  # nothing ran server-side; the UI shows it
    job_id = actions[0]["job_id"]
    status, _ = await post(client, f"{gw}/v1/jobs/{job_id}/result", headers,
                           {"status": "succeeded", "result": {"clicked": "add_to_cart"}})
    assert status == 200
    status, reply = await post(client, f"{gw}/v1/sessions/cl-1/messages", headers, {"text": "done"})
    assert reply["deliveries"][0]["job_id"] == job_id and reply["deliveries"][0]["result"] == {"clicked": "add_to_cart"}


async def test_a_pending_approval_survives_passivation(stack, client, tenant, backend):
    tenant_id, _, headers = tenant
    gw = stack.gateway.url
    await register(client, gw, headers, write_tool(backend, "archive_order"))
    status, held = await post(client, f"{gw}/v1/sessions/ap-5/messages", headers, {"text": call("archive_order", {"ref": "Z"})})
    approval = held["pending_approval"]["approval_id"]
    assert await stack.placement.passivate(tenant_id, "ap-5") is True  # flushed, dropped from memory
    status, done = await post(client, f"{gw}/v1/sessions/ap-5/approvals/{approval}", headers, {"approve": True})
    assert status == 200 and done["tool_calls"][0]["name"] == "archive_order" and done["tool_calls"][0]["success"]
    assert len(backend.to("/archive_order")) == 1
    # reloaded from Postgres once more, the decision and its message answer as they did, stored
    assert await stack.placement.passivate(tenant_id, "ap-5") is True
    status, again = await post(client, f"{gw}/v1/sessions/ap-5/approvals/{approval}", headers, {"approve": True})
    assert status == 200 and again == done, again
    status, resent = await post(client, f"{gw}/v1/sessions/ap-5/messages", headers,
                                {"text": call("archive_order", {"ref": "Z"}), "message_id": held["message_id"]})
    assert status == 200 and resent == done, resent  # the finished answer, not the held one
    assert len(backend.to("/archive_order")) == 1
