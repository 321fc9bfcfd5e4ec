"""Seed 001's guest pinned to their own stay, through the gateway and Ray: the tenant verifies its
contacts' tokens and maps the `stay` claim to the trusted scope; a backend binding
`GET /stays/{stay_id}/bill` takes `stay_id` from that scope only, so the model's own `stay_id`
never reaches the backend and two guests each see only their own bill. Tokens refused, another
contact on a bound session and a chat key on an admin route are each answered 401/403, nothing run."""

from __future__ import annotations

import json
import time

import jwt
import pytest_asyncio
from cryptography.hazmat.primitives.asymmetric import ed25519

from tests.support.api import call, post, register
from tests.support.backend import Backend
from tests.support.e2e import new_tenant

KEY = ed25519.Ed25519PrivateKey.generate()
ISSUER, AUDIENCE = "https://login.hotel.example", "hotel-bot"


def token(sub: str, stay: str, *, key=KEY, **over) -> str:
    now = int(time.time())
    claims = {"sub": sub, "stay": stay, "iss": ISSUER, "aud": AUDIENCE, "iat": now, "exp": now + 600, **over}
    return jwt.encode(claims, key, algorithm="EdDSA", headers={"kid": "k1"})


@pytest_asyncio.fixture
async def hotel(stack, client, tenant):
    _, _, headers = tenant
    gw = stack.gateway.url
    backend = await Backend().start()
    public = {**json.loads(jwt.algorithms.OKPAlgorithm.to_jwk(KEY.public_key())), "kid": "k1"}
    async with client.put(f"{gw}/v1/bot-config", headers=headers, json={
        "backend": {"base_url": backend.url},
        "contact_verification": {"algorithms": ["EdDSA"], "keys": [public], "issuer": ISSUER, "audience": AUDIENCE,
                                 "scope_claims": {"stay_id": "stay"}},
    }) as r:
        assert r.status == 200, await r.text()
        view = (await r.json())["contact_verification"]
        assert view["hs256_secret"] is None and view["scope_claims"] == {"stay_id": "stay"}
    await register(client, gw, headers, {
        "name": "get_bill", "type": "backend_binding", "description": "The guest's bill for their stay.",
        "method": "GET", "path": "/stays/{stay_id}/bill", "scope": ["stay_id"],
        "parameters": {"note": {"type": "string"}},
    })
    try:
        yield gw, headers, backend
    finally:
        await backend.stop()


async def say(client, gw, headers, session, text, contact_token=None):
    h = {**headers, **({"Contact-Token": contact_token} if contact_token else {})}
    return await post(client, f"{gw}/v1/sessions/{session}/messages", h, {"text": text})


async def test_each_guest_sees_only_their_own_bill_whatever_the_model_sends(hotel, client):
    gw, headers, backend = hotel
    sneaky = call("get_bill", {"stay_id": "S-999", "note": "the big one"})
    status, reply = await say(client, gw, headers, "guest-ann", sneaky, token("ann", "S-100"))
    assert status == 200 and reply["tool_calls"][0]["success"], reply
    status, reply = await say(client, gw, headers, "guest-bob", sneaky, token("bob", "S-200"))
    assert status == 200 and reply["tool_calls"][0]["success"], reply
    paths = [r["path"] for r in backend.requests]
    assert [p.split("?")[0] for p in paths] == ["/stays/S-100/bill", "/stays/S-200/bill"]
    assert not any("S-999" in p for p in paths)
    async with client.get(f"{gw}/v1/sessions/guest-ann", headers=headers) as r:
        assert (await r.json())["contact"] == {"sub": "ann", "verified": True}


async def test_without_a_verified_stay_the_tool_fails_in_band_asking_the_guest_to_sign_in(hotel, client):
    gw, headers, backend = hotel
    status, reply = await say(client, gw, headers, "guest-anon", call("get_bill", {"stay_id": "S-100"}))
    assert status == 200 and not reply["tool_calls"][0]["success"]
    assert "sign in" in reply["tool_calls"][0]["error"] or "sign in" in reply["reply"], reply
    assert backend.requests == []


async def test_bad_tokens_another_guest_and_a_chat_key_on_an_admin_route_are_refused_running_nothing(
        hotel, client, stack, tenant):
    gw, headers, backend = hotel
    tenant_id = tenant[0]
    refused = {
        "another key": token("ann", "S-100", key=ed25519.Ed25519PrivateKey.generate()),
        "alg none": jwt.encode({"sub": "ann", "iss": ISSUER, "aud": AUDIENCE}, None, algorithm="none"),
        "expired": token("ann", "S-100", iat=int(time.time()) - 900, exp=int(time.time()) - 300),
        "not yet valid": token("ann", "S-100", nbf=int(time.time()) + 300),
        "audience": token("ann", "S-100", aud="other-bot"),
        "issuer": token("ann", "S-100", iss="https://evil.example"),
    }
    for why, bad in refused.items():
        status, problem = await say(client, gw, headers, f"guest-{why.replace(' ', '-')}", "hi", bad)
        assert status == 401, (why, problem)
        assert "Contact-Token was refused" in problem["detail"] and bad not in problem["detail"], (why, problem)
    await say(client, gw, headers, "guest-cara", "hello", token("cara", "S-300"))
    status, problem = await say(client, gw, headers, "guest-cara", "hello", token("dan", "S-400"))
    assert status == 403 and "belongs to another contact" in problem["detail"]
    assert backend.requests == []
    chat = await stack.gateway.deps.tenants.issue_key(tenant_id, "chat")
    chat_headers = {"Authorization": f"Bearer {chat.api_key}"}
    async with client.get(f"{gw}/v1/tools", headers=chat_headers) as r:
        assert r.status == 403 and "this is a chat key" in (await r.json())["detail"]
    status, _ = await say(client, gw, chat_headers, "guest-eve", "hello", token("eve", "S-500"))
    assert status == 200
    other_id, _ = await new_tenant(stack, "other-hotel")
    other_chat = await stack.gateway.deps.tenants.issue_key(other_id, "chat")
    status, problem = await say(client, gw, {"Authorization": f"Bearer {other_chat.api_key}"}, "guest-eve",
                                "hello", token("eve", "S-500"))
    assert status == 401  # tenant A's token with tenant B's key: B verifies no contact
