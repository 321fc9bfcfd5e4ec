"""The demo conversation of README through the real stack: `make run`'s code path."""

from __future__ import annotations


async def test_demo_tenant_order_lookup_through_gateway_and_ray(stack, client):
    headers = {"Authorization": f"Bearer {stack.demo_key}"}
    async with client.post(f"{stack.gateway.url}/v1/sessions/smoke-1/messages", headers=headers,
                           json={"text": "where is my order 12345?"}) as r:
        body = await r.json()
        assert r.status == 200, body
    assert body["tool_calls"][0]["name"] == "check_order" and body["tool_calls"][0]["success"]
    assert "12345" in body["reply"] and "status" in body["reply"]
    assert body["rounds"] == 2


async def test_the_demo_tenant_is_offered_every_built_in(stack, client):
    from services.builtins import DEFINITIONS

    headers = {"Authorization": f"Bearer {stack.demo_key}"}
    async with client.get(f"{stack.gateway.url}/v1/tools/contract", headers=headers) as r:
        report = await r.json()
        assert r.status == 200, report
    offered = {t["name"] for t in report["tools"] if t["origin"] == "builtin" and t["offered"]}
    assert offered == {d.name for d in DEFINITIONS}
