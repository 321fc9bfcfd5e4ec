"""Seed 001's guest pinned to their own stay, through the gateway and Ray: the tenant verifies its
contacts' tokens and maps the `stay` claim to the trusted scope; a backend binding
`GET /stays/{stay_id}/bill` takes `stay_id` from that scope only, so the model's own `stay_id`
never reaches the backend and two guests each see only their own bill. Tokens refused, another
contact on a bound session and a chat key on an admin route are each answered 401/403, nothing run."""

from __future__ import annotations

import base64
import hashlib
import hmac
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


def hs256_with_the_public_key(sub: str, stay: str) -> str:
    """The HS/RS confusion: an HS256 token whose secret is the tenant's public key, by hand (PyJWT
    refuses to make one)."""
    now = int(time.time())
    claims = {"sub": sub, "stay": stay, "iss": ISSUER, "aud": AUDIENCE, "iat": now, "exp": now + 600}
    secret = jwt.algorithms.OKPAlgorithm.to_jwk(KEY.public_key()).encode()

    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()
    signing_input = b64(json.dumps({"alg": "HS256", "typ": "JWT", "kid": "k1"}).encode()) + "." + b64(
        json.dumps(claims).encode())
    return signing_input + "." + b64(hmac.new(secret, signing_input.encode(), hashlib.sha256).digest())


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
        "hs256 with the public key": hs256_with_the_public_key("ann", "S-100"),
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


async def test_recall_across_sessions_follows_the_verified_contact_never_a_typed_email(hotel, client):
    gw, headers, _backend = hotel
    async with client.get(f"{gw}/v1/bot-config", headers=headers) as r:
        config = await r.json()
    config["recall_across_sessions"] = True
    async with client.put(f"{gw}/v1/bot-config", headers=headers, json=config) as r:
        assert r.status == 200, await r.text()
    lead = {"name": "Ann Lee", "email": "ann@hotel.example", "notes": "sea view room, late checkout"}
    ann = token("ann", "S-100")
    status, saved = await say(client, gw, headers, "mem-ann-1", call("collect_lead", lead), ann)
    assert status == 200 and saved["tool_calls"][0]["success"], saved

    async def recall(session: str, contact_token: str | None) -> str:
        status, reply = await say(client, gw, headers, session, call("recall_memory", {"query": "checkout"}),
                                  contact_token)
        assert status == 200 and reply["tool_calls"][0]["success"], reply
        return reply["reply"]

    # Ann's later session, signed in again: her first session's fact and message (the turn's own
    # line is not written yet while it runs)
    mine = await recall("mem-ann-2", ann)
    assert "found: 2" in mine and "2 match(es)" in mine and "late checkout" in mine, mine
    # Bob, signed in, and an anonymous contact each type Ann's email first: nothing of hers matches,
    # they are shown their own session's latest fact instead
    for session, who in (("mem-bob", token("bob", "S-200")), ("mem-anon", None)):
        status, reply = await say(client, gw, headers, session,
                                  call("collect_lead", {"name": "Ann Lee", "email": "ann@hotel.example"}), who)
        assert status == 200 and reply["tool_calls"][0]["success"], reply
        theirs = await recall(session, who)
        assert "found: 1" in theirs and "nothing matched" in theirs, theirs
        assert "late checkout" not in theirs and "sea view" not in theirs, theirs


async def test_an_admin_mints_a_test_contact_that_the_tenant_verifies_and_a_chat_key_cannot(hotel, client, stack,
                                                                                            tenant):
    gw, headers, backend = hotel
    async with client.post(f"{gw}/v1/contact-tokens", headers=headers,
                           json={"sub": "tess", "claims": {"stay": "S-777"}}) as r:
        assert r.status == 200, await r.text()
        minted = await r.json()
    assert minted["sub"] == "test:tess" and minted["expires_at"]
    status, reply = await say(client, gw, headers, "guest-tess", call("get_bill", {"stay_id": "S-1"}), minted["token"])
    assert status == 200 and reply["tool_calls"][0]["success"], reply
    assert [r["path"].split("?")[0] for r in backend.requests] == ["/stays/S-777/bill"]
    async with client.get(f"{gw}/v1/sessions/guest-tess", headers=headers) as r:
        assert (await r.json())["contact"] == {"sub": "test:tess", "verified": True}
    # a chat key may not mint one; another tenant's verification does not take it (nor its sessions)
    chat = await stack.gateway.deps.tenants.issue_key(tenant[0], "chat")
    async with client.post(f"{gw}/v1/contact-tokens", headers={"Authorization": f"Bearer {chat.api_key}"},
                           json={"sub": "tess"}) as r:
        assert r.status == 403 and "chat key" in (await r.json())["detail"]
    _, other_key = await new_tenant(stack, "plain")
    other = {"Authorization": f"Bearer {other_key}"}
    async with client.post(f"{gw}/v1/contact-tokens", headers=other, json={"sub": "tess"}) as r:
        assert r.status == 409 and "contact_verification" in (await r.json())["detail"]
    async with client.put(f"{gw}/v1/bot-config", headers=other, json={"contact_verification": {
            "algorithms": ["HS256"], "hs256_secret": "x" * 32, "issuer": ISSUER, "audience": AUDIENCE}}) as r:
        assert r.status == 200, await r.text()
    status, problem = await say(client, gw, other, "guest-tess", "hello", minted["token"])
    assert status == 401 and "(signature)" in problem["detail"], problem  # the hotel's test key, not theirs
