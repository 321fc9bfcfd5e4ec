"""Overload through the gateway: a flooded session and an over-eager tenant get 429 + Retry-After,
the admitted messages complete, and nothing crashes."""

from __future__ import annotations

import asyncio

import msgspec

from services.gateway.server import open_gateway


async def test_a_flood_to_one_session_is_bounded_by_its_mailbox(stack, client, tenant):
    _, _, headers = tenant
    url = f"{stack.gateway.url}/v1/sessions/flood-1/messages"

    async def send(i: int):
        async with client.post(url, headers=headers, json={"text": f"hello {i}", "message_id": f"f{i}"}) as r:
            return r.status, r.headers.get("Retry-After"), await r.json()

    results = await asyncio.gather(*(send(i) for i in range(60)))
    statuses = [s for s, _, _ in results]
    assert set(statuses) <= {200, 429}, statuses
    refused = [(ra, body) for s, ra, body in results if s == 429]
    assert refused, "a flood of 60 to one session must exceed its mailbox"
    assert all(ra and int(ra) >= 1 and "too many messages" in body["detail"] for ra, body in refused)
    assert statuses.count(200) >= 17  # the running turn and a full mailbox were admitted
    async with client.get(f"{stack.gateway.url}/v1/sessions/flood-1", headers=headers) as r:
        view = await r.json()
    assert view["messages"] == 2 * statuses.count(200)  # every admitted message answered and stored


async def test_a_tenant_over_its_rate_gets_429_with_retry_after(stack, client, tenant):
    _, _, headers = tenant
    settings = msgspec.structs.replace(stack.settings, tenant_rate=1.0, tenant_burst=3.0)
    gateway = await open_gateway(settings, stack.placement, port=0)
    try:
        statuses = []
        for i in range(6):
            async with client.post(f"{gateway.url}/v1/sessions/rate-{i}/messages", headers=headers,
                                   json={"text": "hi"}) as r:
                statuses.append((r.status, r.headers.get("Retry-After")))
        assert [s for s, _ in statuses[:3]] == [200, 200, 200]
        assert any(s == 429 and ra for s, ra in statuses[3:])
        async with client.get(f"{gateway.url}/metrics") as r:  # counted by reason for the operator
            refused = sum(s == 429 for s, _ in statuses)
            assert f'ce_refused_total{{reason="tenant_rate"}} {refused}.0' in await r.text()
    finally:
        await gateway.close()
