"""Live sessions over the real Postgres and the real gateway app on loopback (no Ray): the event
log written with the turn and read back after any number, the SSE stream and the WebSocket
resuming without a gap or a repeat, a person's message refused unless the session is handed off.

The session host runs in process (LocalRouter) over the real SessionRepo, so every event a
watcher gets came out of ce_session_events or was pushed after its flush committed."""

from __future__ import annotations

import asyncio
import json
import secrets
import time

import aiohttp
import jwt
import msgspec
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer
from cryptography.hazmat.primitives.asymmetric import ed25519

from actors.host import HostSettings, SessionHost
from actors.local import LocalRouter
from kernel.records import SessionDelta, SessionEvent, SessionSnapshot
from services.contacts import ContactVerification, ContactVerifier
from services.gateway.app import build_app
from services.gateway.common import GatewayDeps
from services.gateway.feed import AgentFeed
from services.gateway.server import DRAIN_TIMEOUT_S, open_gateway
from services.settings import Settings
from services.tools.crypto import SecretBox, generate_key
from services.wire import HandoffChange
from storage.pool import create_pool
from storage.repos import BotConfigRepo, SessionRepo, TenantRepo, ToolCallRepo, ToolRepo
from storage.repos.jobs import JobRepo
from tests.support.api import read_sse
from tests.support.host_fakes import FakeTenants

T = 10.0


def sid() -> str:
    return "s-" + secrets.token_hex(4)


def event(seq: int, text: str) -> SessionEvent:
    return SessionEvent(seq=seq, type="message", data={"author": "contact", "text": text})


# -- the log in Postgres ---------------------------------------------------------------------------

@pytest.mark.parametrize("batch", ["one statement", "statement by statement"])
async def test_events_are_written_with_the_flush_once_and_read_back_after_any_number(pool, make_tenant, batch):
    sessions = SessionRepo(pool)
    tenant, _ = await make_tenant("events")
    s = sid()
    activated = await sessions.activate(tenant.id, s, "h1")

    def delta(*events: SessionEvent) -> SessionDelta:
        return SessionDelta(tenant_id=tenant.id, session_id=s, epoch=activated.epoch,
                            snapshot=SessionSnapshot(event_seq=events[-1].seq), events=list(events))

    first, second = delta(event(1, "a"), event(2, "b")), delta(event(3, "c"))
    deltas = [first, second] if batch == "statement by statement" else [first]  # one session twice: no single statement
    await sessions.flush(deltas)
    await sessions.flush(deltas)  # a retry after a lost acknowledgement writes nothing twice
    if batch == "one statement":
        await sessions.flush([second])
    got = await sessions.events_after(tenant.id, s, 0)
    assert [(e.seq, e.data["text"]) for e in got] == [(1, "a"), (2, "b"), (3, "c")]
    assert [e.seq for e in await sessions.events_after(tenant.id, s, 2)] == [3]
    assert await sessions.events_after(tenant.id, s, 3) == []
    other, _ = await make_tenant("events-other")
    assert await sessions.events_after(other.id, s, 0) == []  # another tenant's session of the same id


async def test_a_stale_owners_events_are_not_written(pool, make_tenant):
    sessions = SessionRepo(pool)
    tenant, _ = await make_tenant("events-stale")
    s = sid()
    old = await sessions.activate(tenant.id, s, "h1")
    await sessions.activate(tenant.id, s, "h2")
    result = await sessions.flush([SessionDelta(tenant_id=tenant.id, session_id=s, epoch=old.epoch,
                                                snapshot=SessionSnapshot(event_seq=1), events=[event(1, "x")])])
    assert result.refused == [(tenant.id, s)]
    assert await sessions.events_after(tenant.id, s, 0) == []


# -- the routes --------------------------------------------------------------------------------------

@pytest_asyncio.fixture
async def live(pool, make_tenant):
    host = SessionHost(name="h1", store=SessionRepo(pool), tenants=FakeTenants(), settings=HostSettings())
    await host.start()
    deps = GatewayDeps(router=LocalRouter(host), tenants=TenantRepo(pool), tools=ToolRepo(pool),
                       calls=ToolCallRepo(pool), sessions=SessionRepo(pool), configs=BotConfigRepo(pool),
                       secret_box=SecretBox([generate_key()]), jobs=JobRepo(pool),
                       feed=AgentFeed(pool, SessionRepo(pool)))
    tenant, key = await make_tenant("live")
    try:
        async with TestClient(TestServer(build_app(deps), host="127.0.0.1")) as client:
            client.tenant_id = tenant.id
            yield client, host, {"Authorization": f"Bearer {key.api_key}"}
    finally:
        await deps.feed.close()
        await asyncio.wait_for(host.stop(), T)


async def test_the_stream_gives_the_log_then_pushes_and_resumes_after_the_last_event_id(live):
    client, _host, headers = live
    s = sid()
    r = await client.post(f"/v1/sessions/{s}/messages", json={"text": "hello", "message_id": "m1"}, headers=headers)
    assert r.status == 200
    async with client.get(f"/v1/sessions/{s}/events", headers=headers) as stream:
        assert stream.status == 200 and stream.headers["Content-Type"].startswith("text/event-stream")
        got = await read_sse(stream, 2)
        assert got == [
            (1, "message", {"seq": 1, "type": "message", "author": "contact", "text": "hello", "message_id": "m1"}),
            (2, "message", {"seq": 2, "type": "message", "author": "bot", "text": "echo: hello", "message_id": "m1"}),
        ]
        # pushed as the next turn is written, without asking again
        r = await client.post(f"/v1/sessions/{s}/messages", json={"text": "again"}, headers=headers)
        assert r.status == 200
        assert [(i, d["author"], d["text"]) for i, _, d in await read_sse(stream, 2)] == [
            (3, "contact", "again"), (4, "bot", "echo: again")]
    # a reconnect names the last event it has: exactly what follows
    async with client.get(f"/v1/sessions/{s}/events", headers={**headers, "Last-Event-ID": "3"}) as stream:
        assert [i for i, _, _ in await read_sse(stream, 1)] == [4]
    async with client.get(f"/v1/sessions/{s}/events?after=2", headers=headers) as stream:
        assert [i for i, _, _ in await read_sse(stream, 2)] == [3, 4]


async def test_a_resume_point_that_is_not_a_number_is_refused_saying_so(live):
    client, _host, headers = live
    r = await client.get(f"/v1/sessions/{sid()}/events?after=soon", headers=headers)
    assert r.status == 422 and "after must be a whole number" in (await r.json())["detail"]
    r = await client.get(f"/v1/sessions/{sid()}/events", headers={**headers, "Last-Event-ID": "-1"})
    assert r.status == 422 and "Last-Event-ID" in (await r.json())["detail"]


async def test_another_tenants_key_sees_nothing_of_the_session(live, make_tenant):
    client, _host, headers = live
    s = sid()
    await client.post(f"/v1/sessions/{s}/messages", json={"text": "private"}, headers=headers)
    _other, key = await make_tenant("live-other")
    async with client.get(f"/v1/sessions/{s}/events", headers={"Authorization": f"Bearer {key.api_key}"}) as stream:
        line = await asyncio.wait_for(stream.content.readline(), T)
        assert line.startswith(b"retry:")
        await asyncio.wait_for(stream.content.readline(), T)
        with pytest.raises(TimeoutError):  # the other tenant's session of that id has no events
            await asyncio.wait_for(stream.content.readline(), 0.5)


async def test_the_socket_carries_the_events_and_takes_the_contacts_messages(live):
    client, _host, headers = live
    s = sid()
    async with client.ws_connect(f"/v1/sessions/{s}/ws", headers=headers) as ws:
        await ws.send_str(json.dumps({"text": "hello", "message_id": "w1"}))
        frames = [json.loads((await asyncio.wait_for(ws.receive(), T)).data) for _ in range(3)]
        reply = next(f for f in frames if f["type"] == "reply")
        assert reply["reply"] == "echo: hello" and reply["message_id"] == "w1" and reply["handoff"] is False
        assert [(f["seq"], f["author"]) for f in frames if f["type"] == "message"] == [(1, "contact"), (2, "bot")]
        await ws.send_str(json.dumps({"text": ""}))
        problem = json.loads((await asyncio.wait_for(ws.receive(), T)).data)
        assert problem["type"] == "error" and problem["status"] == 422 and "text is empty" in problem["detail"]
        await ws.send_str("{not json")
        problem = json.loads((await asyncio.wait_for(ws.receive(), T)).data)
        assert problem["type"] == "error" and problem["status"] == 400


async def test_an_agent_message_to_a_session_not_handed_off_is_409_saying_why(live):
    client, _host, headers = live
    s = sid()
    await client.post(f"/v1/sessions/{s}/messages", json={"text": "hello"}, headers=headers)
    r = await client.post(f"/v1/sessions/{s}/agent-messages", json={"text": "hi", "agent": "Ana"}, headers=headers)
    assert r.status == 409 and "not handed off to a person" in (await r.json())["detail"]
    r = await client.post(f"/v1/sessions/{s}/agent-messages", json={"text": "hi", "agent": " "}, headers=headers)
    assert r.status == 422 and "agent must be" in (await r.json())["detail"]


async def test_the_agents_feed_carries_what_happens_in_sessions_a_person_has_and_nothing_else(live, make_tenant):
    client, host, headers = live
    tenant_id = client.tenant_id
    bot_only, taken = sid(), sid()
    async with client.get("/v1/handoffs/events", headers=headers) as feed:
        assert feed.status == 200
        assert (await asyncio.wait_for(feed.content.readline(), T)).startswith(b"retry:")
        await client.post(f"/v1/sessions/{bot_only}/messages", json={"text": "just the bot"}, headers=headers)
        await client.post(f"/v1/sessions/{taken}/messages", json={"text": "hello"}, headers=headers)
        await asyncio.wait_for(host.act(HandoffChange(tenant_id=tenant_id, session_id=taken, handoff_id="h1",
                                                      state="assigned", agent="Ana")), T)
        r = await client.post(f"/v1/sessions/{taken}/messages", json={"text": "are you there?"}, headers=headers)
        assert (await r.json())["reply"] == ""  # a person has it: the bot says nothing
        r = await client.post(f"/v1/sessions/{taken}/agent-messages", json={"text": "I am", "agent": "Ana"},
                              headers=headers)
        assert r.status == 200
        got = [(event, data) for _, event, data in await read_sse(feed, 3)]
    assert [(e, d["session_id"], d.get("author"), d.get("state")) for e, d in got] == [
        ("handoff", taken, None, "assigned"), ("message", taken, "contact", None), ("message", taken, "agent", None)]
    assert got[2][1]["text"] == "I am" and got[2][1]["agent"] == "Ana"



async def test_a_stopping_gateway_ends_its_watchers_streams_instead_of_waiting_for_them(fresh_db):
    url = await fresh_db()
    pool = await create_pool(url, min_size=1, max_size=4)
    host = SessionHost(name="h1", store=SessionRepo(pool), tenants=FakeTenants(), settings=HostSettings())
    await host.start()
    gateway = await open_gateway(Settings(database_url=url, host="127.0.0.1", port=0), LocalRouter(host), port=0)
    assert DRAIN_TIMEOUT_S > 2 * T  # a drain that waited for the streams would fail the bound below
    try:
        _, key = await gateway.deps.tenants.create_tenant("closing")
        headers = {"Authorization": f"Bearer {key.api_key}"}
        async with aiohttp.ClientSession() as client:
            streams = [await client.get(f"{gateway.url}/v1/sessions/{sid()}/events", headers=headers) for _ in range(3)]
            feed = await client.get(f"{gateway.url}/v1/handoffs/events", headers=headers)
            for stream in [*streams, feed]:
                assert (await asyncio.wait_for(stream.content.readline(), T)).startswith(b"retry:")
            await asyncio.wait_for(gateway.close(), T)
            for stream in [*streams, feed]:
                await asyncio.wait_for(stream.content.read(), T)  # ended: the client reconnects elsewhere
                stream.release()
        assert gateway.deps.streams == set()
    finally:
        await asyncio.wait_for(host.stop(), T)
        await pool.close()


async def test_a_chat_key_reads_and_watches_a_bound_session_only_with_its_contacts_token(live, pool):
    client, host, headers = live
    key = ed25519.Ed25519PrivateKey.generate()
    settings = ContactVerification(
        algorithms=("EdDSA",), keys=({**json.loads(jwt.algorithms.OKPAlgorithm.to_jwk(key.public_key())), "kid": "k"},),
        issuer="https://login.example", audience="shop")
    host._tenants.env = msgspec.structs.replace(host._tenants.env, contacts=ContactVerifier(settings, hs256_secret=None))
    now = int(time.time())

    def token(sub: str) -> str:
        return jwt.encode({"sub": sub, "iss": settings.issuer, "aud": settings.audience, "iat": now, "exp": now + 300},
                          key, algorithm="EdDSA", headers={"kid": "k"})

    chat = await TenantRepo(pool).issue_key(client.tenant_id, "chat")
    as_chat = {"Authorization": f"Bearer {chat.api_key}"}
    s = sid()
    r = await client.post(f"/v1/sessions/{s}/messages", json={"text": "hi"}, headers={**as_chat, "Contact-Token": token("ann")})
    assert r.status == 200
    r = await client.get(f"/v1/sessions/{s}", headers={**as_chat, "Contact-Token": token("ann")})
    assert r.status == 200 and (await r.json())["contact"] == {"sub": "ann", "verified": True}
    r = await client.get(f"/v1/sessions/{s}", headers={**as_chat, "Contact-Token": token("bob")})
    assert r.status == 403
    r = await client.get(f"/v1/sessions/{s}/events", headers=as_chat)
    assert r.status == 401 and "Contact-Token" in (await r.json())["detail"]
    r = await client.get(f"/v1/sessions/{s}", headers=headers)  # an admin key reads any session
    assert r.status == 200


async def test_an_admin_lists_a_verified_contacts_sessions(pool, make_tenant):
    sessions = SessionRepo(pool)
    tenant, _ = await make_tenant("by-contact")
    for s, sub in (("a1", "ann"), ("a2", "ann"), ("b1", "bob"), ("x1", None)):
        activated = await sessions.activate(tenant.id, s, "h1")
        await sessions.flush([SessionDelta(tenant_id=tenant.id, session_id=s, epoch=activated.epoch,
                                           snapshot=SessionSnapshot(contact_sub=sub))])
    assert sorted(x.session_id for x in await sessions.list_sessions(tenant.id, contact="ann")) == ["a1", "a2"]
    assert [x.session_id for x in await sessions.list_sessions(tenant.id, contact="bob")] == ["b1"]
    assert len(await sessions.list_sessions(tenant.id)) == 4
    other, _ = await make_tenant("by-contact-other")
    assert await sessions.list_sessions(other.id, contact="ann") == []
