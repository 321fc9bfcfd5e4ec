"""Approvals and tool runs that cannot get stuck or run twice, through the gateway (issue 12)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest_asyncio
from aiohttp import web

from actors.placement import rendezvous_index
from tests.support.api import call, post, register


class SlowBackend:
    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.arrived = asyncio.Event()
        self.delay = 0.0
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        self.requests.append({"path": request.path, "json": await request.json() if request.can_read_body else None,
                              "key": request.headers.get("Idempotency-Key")})
        self.arrived.set()
        await asyncio.sleep(self.delay)
        return web.json_response({"ok": True, "status": "done"})


@pytest_asyncio.fixture
async def backend():
    b = SlowBackend()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", b.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.2", 0).start()
    b.url = f"http://127.0.0.2:{runner.addresses[0][1]}"
    try:
        yield b
    finally:
        await runner.cleanup()


def write_tool(backend, name, **extra):
    return {"name": name, "description": f"{name} a record", "webhook_url": f"{backend.url}/{name}",
            "parameters": {"ref": {"type": "string"}, "amount": {"type": "integer", "minimum": 1}},
            "mutability": "write", "method": "POST", "timeout_ms": 10000, **extra}


async def held(client, gw, headers, session, text):
    status, body = await post(client, f"{gw}/v1/sessions/{session}/messages", headers, {"text": text})
    assert status == 200 and body.get("pending_approval"), body
    return body["pending_approval"]


async def test_forged_replayed_and_foreign_approval_ids_are_refused(stack, client, tenant, backend):
    _, _, headers = tenant
    gw = stack.gateway.url
    await register(client, gw, headers, write_tool(backend, "refund"))
    pending = await held(client, gw, headers, "rob-1", call("refund", {"ref": "r", "amount": 5}))
    approval = pending["approval_id"]
    forged = approval.split(".")[0] + ".AAAAAAAAAAAAAAAAAAAAAAAA"
    status, body = await post(client, f"{gw}/v1/sessions/rob-1/approvals/{forged}", headers, {"approve": True})
    assert status == 404 and "not valid for this session" in body["detail"]
    status, body = await post(client, f"{gw}/v1/sessions/rob-other/approvals/{approval}", headers, {"approve": True})
    assert status == 404  # an id signed for another session
    assert backend.requests == []
    status, first = await post(client, f"{gw}/v1/sessions/rob-1/approvals/{approval}", headers, {"approve": True})
    assert status == 200 and first["tool_calls"][0]["success"]
    # asked again (a client that lost the answer), even declining: the first answer, nothing runs
    async with client.post(f"{gw}/v1/sessions/rob-1/approvals/{approval}", headers=headers,
                           json={"approve": False}) as r:
        assert r.status == 200 and r.headers["X-Replayed"] == "true"
        assert await r.json() == first
    assert len(backend.requests) == 1


async def test_an_approver_edits_arguments_and_they_are_validated_before_anything_runs(stack, client, tenant, backend):
    _, _, headers = tenant
    gw = stack.gateway.url
    await register(client, gw, headers, write_tool(backend, "charge"))
    pending = await held(client, gw, headers, "rob-2", call("charge", {"ref": "c", "amount": 50}))
    call_id = pending["calls"][0]["id"]
    assert pending["calls"][0]["arguments"] == {"ref": "c", "amount": 50}
    status, body = await post(client, f"{gw}/v1/sessions/rob-2/approvals/{pending['approval_id']}", headers,
                              {"approve": True, "arguments": {call_id: {"amount": 0}}})
    assert status == 200 and not body["tool_calls"][0]["success"] and "amount" in body["tool_calls"][0]["error"]
    assert backend.requests == []
    pending = await held(client, gw, headers, "rob-2", call("charge", {"ref": "c", "amount": 50}))
    status, body = await post(client, f"{gw}/v1/sessions/rob-2/approvals/{pending['approval_id']}", headers,
                              {"approve": True, "arguments": {pending["calls"][0]["id"]: {"amount": 20}}})
    assert body["tool_calls"][0]["success"] and backend.requests[0]["json"]["amount"] == 20


async def test_an_expired_approval_ends_in_band_and_runs_nothing(stack, client, tenant, backend):
    _, _, headers = tenant
    gw = stack.gateway.url
    async with client.put(f"{gw}/v1/bot-config", headers=headers, json={"approval_ttl_s": 1}) as r:
        assert r.status == 200, await r.text()
    await register(client, gw, headers, write_tool(backend, "wire_money"))
    pending = await held(client, gw, headers, "rob-3", call("wire_money", {"ref": "w", "amount": 9}))
    await asyncio.sleep(1.5)
    status, body = await post(client, f"{gw}/v1/sessions/rob-3/approvals/{pending['approval_id']}", headers, {"approve": True})
    assert status == 200 and "expired" in body["tool_calls"][0]["error"] and backend.requests == []


async def test_a_slow_tool_streams_tool_progress_before_its_result(stack, client, tenant, backend):
    _, _, headers = tenant
    gw = stack.gateway.url
    backend.delay = 0.8
    await register(client, gw, headers, {
        "name": "check_stock", "description": "Check stock levels.", "webhook_url": f"{backend.url}/stock",
        "parameters": {"sku": {"type": "string"}}, "progress_after_ms": 200,
        "progress_message": "Still checking the stock…",
    })
    _, events = await post(client, f"{gw}/v1/sessions/rob-4/messages", headers,
                                {"text": call("check_stock", {"sku": "MUG-01"})}, sse=True)
    kinds = [e for e, _ in events]
    assert "tool_progress" in kinds and kinds.index("tool_progress") < kinds.index("tool_result")
    assert dict(events)["tool_progress"]["message"] == "Still checking the stock…"


async def test_a_write_tools_idempotency_key_is_identical_across_a_retried_message(stack, client, tenant, backend):
    tenant_id, _, headers = tenant
    gw = stack.gateway.url
    backend.delay = 3.0
    await register(client, gw, headers, write_tool(backend, "place_order", requires_approval=False))
    body = {"text": call("place_order", {"ref": "o", "amount": 1}), "message_id": "retry-me-1"}
    first = asyncio.create_task(post(client, f"{gw}/v1/sessions/rob-5/messages", headers, body))
    await asyncio.wait_for(backend.arrived.wait(), 30)
    host = f"ce-host-{rendezvous_index(f'{tenant_id}:rob-5', stack.placement.shards)}"
    pid = {s["host"]: s["pid"] for s in await stack.placement.stats()}[host]
    backend.delay = 0.0
    os.kill(pid, signal.SIGKILL)  # the host dies while the write is in flight: nothing was acknowledged
    status, reply = await first  # the gateway may retry the hop once itself (same message id), else 503
    for _ in range(60):
        if status == 200:
            break
        await asyncio.sleep(0.5)
        status, reply = await post(client, f"{gw}/v1/sessions/rob-5/messages", headers, body)
    assert status == 200, reply
    keys = [r["key"] for r in backend.requests]
    assert len(keys) == 2 and keys[0] == keys[1] and keys[0].startswith("retry-me-1:")
    status, again = await post(client, f"{gw}/v1/sessions/rob-5/messages", headers, body)
    assert again == reply and len(backend.requests) == 2  # acknowledged now: a retry runs nothing


async def test_a_tool_patched_while_its_approval_is_pending_does_not_run_on_approve(stack, client, tenant, backend):
    _, _, headers = tenant
    gw = stack.gateway.url
    await register(client, gw, headers, write_tool(backend, "payout"))
    pending = await held(client, gw, headers, "rob-6", call("payout", {"ref": "p", "amount": 7}))
    # the admin points the tool elsewhere (version 2) before the approver, shown version 1, says yes
    async with client.patch(f"{gw}/v1/tools/payout", headers=headers,
                            json={"webhook_url": f"{backend.url}/elsewhere"}) as r:
        assert r.status == 200 and (await r.json())["version"] == 2, await r.text()
    status, body = await post(client, f"{gw}/v1/sessions/rob-6/approvals/{pending['approval_id']}", headers,
                              {"approve": True})
    assert status == 200 and backend.requests == []
    [summary] = body["tool_calls"]
    assert not summary["success"] and "changed while the approval was pending" in summary["error"]
