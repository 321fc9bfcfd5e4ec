"""A session belongs to its contact (on the host, with fakes): the first verified `sub` binds it;
another contact's token, an anonymous message to a bound session, or no token where the tenant
requires one is refused before anything runs, a stored answer included."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import jwt
import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519

from actors.session import _scope
from kernel.errors import Forbidden, Unauthorized
from kernel.records import SessionSnapshot
from services.contacts import ContactVerification, ContactVerifier
from services.wire import CheckContact, Turn
from tests.support import host_world
from tests.support.host_world import KEY, T

world = host_world.world  # the fixture

KEY_ED = ed25519.Ed25519PrivateKey.generate()
SETTINGS = ContactVerification(
    algorithms=("EdDSA",), keys=({**json.loads(jwt.algorithms.OKPAlgorithm.to_jwk(KEY_ED.public_key())), "kid": "k"},),
    issuer="https://login.example", audience="shop", scope_claims={"account_id": "sub"},
)


def token(sub: str) -> str:
    now = int(time.time())
    return jwt.encode({"sub": sub, "iss": SETTINGS.issuer, "aud": SETTINGS.audience, "iat": now, "exp": now + 300},
                      KEY_ED, algorithm="EdDSA", headers={"kid": "k"})


def verify_with(world, settings: ContactVerification | None) -> None:
    verifier = None if settings is None else ContactVerifier(settings, hs256_secret=None)
    world.tenants.env = msgspec.structs.replace(world.tenants.env, contacts=verifier)


def turn(text: str, message_id: str, sub: str | None = None) -> Turn:
    return Turn(tenant_id="t1", session_id="s1", text=text, message_id=message_id,
                contact_token=None if sub is None else token(sub))


async def test_the_first_verified_contact_binds_the_session_and_another_is_refused_before_anything_runs(world):
    verify_with(world, SETTINGS)
    host = await world.host()
    await asyncio.wait_for(host.send(turn("hello", "m1", "ann")), T)
    await asyncio.wait_for(host.send(turn("again", "m2", "ann")), T)
    assert world.store.snapshots[KEY].contact_sub == "ann"
    assert (await host.view("t1", "s1")).contact == {"sub": "ann", "verified": True}
    asked, logged = len(world.model.requests), len(world.store.events[KEY])
    with pytest.raises(Forbidden, match="belongs to another contact"):
        await asyncio.wait_for(host.send(turn("let me in", "m3", "bob")), T)
    with pytest.raises(Forbidden):  # not even the stored answer of ann's message
        await asyncio.wait_for(host.send(turn("hello", "m1", "bob")), T)
    with pytest.raises(Unauthorized, match="send their Contact-Token"):
        await asyncio.wait_for(host.send(turn("anonymous", "m4")), T)
    assert len(world.model.requests) == asked and len(world.store.events[KEY]) == logged


async def test_an_anonymous_session_may_be_identified_once(world):
    verify_with(world, SETTINGS)
    host = await world.host()
    await asyncio.wait_for(host.send(turn("hello", "m1")), T)
    assert world.store.snapshots[KEY].contact_sub is None
    await asyncio.wait_for(host.send(turn("it's me", "m2", "ann")), T)
    assert world.store.snapshots[KEY].contact_sub == "ann"


async def test_where_the_tenant_requires_verification_an_anonymous_message_is_refused(world):
    verify_with(world, msgspec.structs.replace(SETTINGS, required=True))
    host = await world.host()
    with pytest.raises(Unauthorized, match="requires verified contacts"):
        await asyncio.wait_for(host.send(turn("hello", "m1")), T)
    assert world.model.requests == []


async def test_a_token_for_a_tenant_that_verifies_no_contact_is_refused_saying_so(world):
    verify_with(world, None)
    host = await world.host()
    with pytest.raises(Unauthorized, match="does not verify contacts"):
        await asyncio.wait_for(host.send(turn("hello", "m1", "ann")), T)


async def test_a_refused_token_runs_nothing(world):
    verify_with(world, SETTINGS)
    host = await world.host()
    forged = jwt.encode({"sub": "ann"}, ed25519.Ed25519PrivateKey.generate(), algorithm="EdDSA", headers={"kid": "k"})
    with pytest.raises(Unauthorized, match="signature"):
        await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id="s1", text="hi", message_id="m1",
                                              contact_token=forged)), T)
    assert world.model.requests == [] and world.store.events[KEY] == []


async def test_a_reader_is_checked_as_a_writer_is_but_binds_nothing(world):
    verify_with(world, SETTINGS)
    host = await world.host()
    await asyncio.wait_for(host.act(CheckContact(tenant_id="t1", session_id="s1", contact_token=token("ann"))), T)
    assert world.store.snapshots.get(KEY) is None or world.store.snapshots[KEY].contact_sub is None
    await asyncio.wait_for(host.send(turn("hello", "m1", "ann")), T)
    await asyncio.wait_for(host.act(CheckContact(tenant_id="t1", session_id="s1", contact_token=token("ann"))), T)
    with pytest.raises(Forbidden):
        await asyncio.wait_for(host.act(CheckContact(tenant_id="t1", session_id="s1", contact_token=token("bob"))), T)
    with pytest.raises(Unauthorized):
        await asyncio.wait_for(host.act(CheckContact(tenant_id="t1", session_id="s1")), T)


def test_the_trusted_scope_holds_the_tenant_always_and_an_account_only_for_a_verified_contact():
    snapshot = SessionSnapshot()
    state, env = SimpleNamespace(tenant_id="t1", snapshot=snapshot), SimpleNamespace(scope={})
    assert _scope(state, env) == {"tenant_id": "t1", "tenantId": "t1"}  # anonymous: no account
    snapshot.contact_sub = "ann"
    # a scope stored before the mapping was checked cannot name the tenant either
    snapshot.contact_scope = {"account_id": "acct-ann", "accountId": "acct-ann", "tenant_id": "t2"}
    assert _scope(state, env) == {"tenant_id": "t1", "tenantId": "t1", "account_id": "acct-ann", "accountId": "acct-ann"}
