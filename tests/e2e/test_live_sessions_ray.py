"""Live sessions on the real stack (gateway, local Ray, sharded hosts with their lanes, Postgres,
the local model): a watcher on another gateway gets the session's events pushed by its host; a
host killed with -9 while a stream is open and events are pushed costs the watcher no event and
gives it none twice, whether it stays connected or reconnects with Last-Event-ID."""

from __future__ import annotations

import asyncio
import os
import signal

import msgspec
import pytest_asyncio

from actors.placement import Placement, rendezvous_index
from services.gateway.server import open_gateway
from tests.support.api import call, post, read_sse, register
from tests.support.backend import Backend

T = 30.0


@pytest_asyncio.fixture
async def second_gateway(stack):
    """Another gateway process's worth of routing over the same hosts (its own Placement, lanes)."""
    settings = msgspec.structs.replace(stack.settings)
    placement = Placement(settings)
    gateway = await open_gateway(settings, placement, port=0)
    try:
        yield gateway
    finally:
        placement.close_lanes()
        await gateway.close()


async def say(client, url: str, headers: dict, session_id: str, text: str, message_id: str) -> None:
    """A contact's message, sent again with the same id while its host restarts (503)."""
    for _ in range(60):
        async with client.post(f"{url}/v1/sessions/{session_id}/messages", headers=headers,
                               json={"text": text, "message_id": message_id}) as r:
            if r.status == 200:
                return
            assert r.status == 503, await r.text()
        await asyncio.sleep(0.5)
    raise AssertionError(f"{message_id} was never answered")


async def test_a_watcher_on_another_gateway_gets_the_events_as_they_are_written(stack, second_gateway, client, tenant):
    _, _, headers = tenant
    async with client.get(f"{second_gateway.url}/v1/sessions/live-1/events", headers=headers) as stream:
        assert stream.status == 200
        await say(client, stack.gateway.url, headers, "live-1", "hello there", "l1")
        got = await read_sse(stream, 2, T)
    assert [(i, d["author"]) for i, _, d in got] == [(1, "contact"), (2, "bot")]
    assert got[0][2]["text"] == "hello there" and got[1][2]["message_id"] == "l1"


async def test_a_host_killed_while_its_session_is_watched_costs_the_watcher_no_event_and_none_twice(
        stack, client, tenant, db):
    tenant_id, _, headers = tenant
    gw = stack.gateway.url
    session = "live-kill"
    host = f"ce-host-{rendezvous_index(f'{tenant_id}:{session}', stack.placement.shards)}"
    seen: list[int] = []

    async with client.get(f"{gw}/v1/sessions/{session}/events", headers=headers) as stream:
        await say(client, gw, headers, session, "first", "k1")
        seen += [i for i, _, _ in await read_sse(stream, 2, T)]
        pid = {s["host"]: s["pid"] for s in await stack.placement.stats()}[host]
        sending = asyncio.create_task(say(client, gw, headers, session, "second", "k2"))
        os.kill(pid, signal.SIGKILL)  # while the stream waits on the host for what follows
        await sending
        seen += [i for i, _, _ in await read_sse(stream, 2, T)]  # the same connection carries on
    # a watcher that went away comes back naming the last event it has
    await say(client, gw, headers, session, "third", "k3")
    async with client.get(f"{gw}/v1/sessions/{session}/events",
                          headers={**headers, "Last-Event-ID": str(seen[-1])}) as stream:
        seen += [i for i, _, _ in await read_sse(stream, 2, T)]
    stored = await db.fetchval(
        "SELECT max(seq) FROM ce_session_events e JOIN ce_sessions s ON s.id = e.session_id "
        "WHERE s.tenant_id = $1 AND s.session_key = $2", tenant_id, session)
    assert seen == list(range(1, stored + 1)) == [1, 2, 3, 4, 5, 6]


async def test_a_workflow_result_posted_later_reaches_the_contacts_stream_without_a_new_message(stack, client, tenant):
    _, _, headers = tenant
    gw = stack.gateway.url
    backend = await Backend().start()
    try:
        await register(client, gw, headers, {
            "name": "build_quote", "type": "workflow", "description": "Prepare a price quote (takes a while).",
            "parameters": {"item": {"type": "string"}}, "start_url": f"{backend.url}/jobs", "timeout_ms": 5000,
        })  # notify_on_result: true, a workflow's default
        async with client.get(f"{gw}/v1/sessions/live-wf/events", headers=headers) as stream:
            status, started = await post(client, f"{gw}/v1/sessions/live-wf/messages", headers,
                                         {"text": call("build_quote", {"item": "100 mugs"})})
            assert status == 200 and started["tool_calls"][0]["success"], started
            job_id = msgspec.json.decode(backend.requests[0]["body"])["job_id"]
            first = await read_sse(stream, 4, T)  # contact, tool_call, tool_result, bot
            assert [e for _, e, _ in first] == ["message", "tool_call", "tool_result", "message"]
            await asyncio.sleep(2)  # the tenant's system takes its time
            status, _ = await post(client, f"{gw}/v1/jobs/{job_id}/result", headers,
                                   {"status": "succeeded", "result": {"total": 1250}})
            assert status == 200
            later = await read_sse(stream, 1, T)
            while later[-1][1] != "message":  # the model may call a tool before it answers
                later += await read_sse(stream, 1, T)
        # the result, what the model did with it, and its reply: nobody wrote meanwhile
        assert later[-1][2]["author"] == "bot" and all(d.get("author") != "contact" for _, _, d in later)
        assert later[0][2] == {"seq": 5, "type": "job_result", "job_id": job_id, "tool": "build_quote",
                               "status": "succeeded"}
        status, reply = await post(client, f"{gw}/v1/sessions/live-wf/messages", headers, {"text": "thanks"})
        assert status == 200 and not reply.get("deliveries")  # delivered once, by the wake
    finally:
        await backend.stop()


async def test_a_person_takes_over_and_gives_the_session_back_as_the_readme_shows(stack, client, tenant, db):
    tenant_id, _, headers = tenant
    gw = stack.gateway.url
    async with client.get(f"{gw}/v1/sessions/live-hand/events", headers=headers) as stream:
        status, reply = await post(client, f"{gw}/v1/sessions/live-hand/messages", headers,
                                   {"text": "can I talk to a person?"})
        assert status == 200 and reply["handoff"] is True, reply
        async with client.get(f"{gw}/v1/handoffs?state=requested", headers=headers) as r:
            handoffs = (await r.json())["handoffs"]
        handoff = next(h for h in handoffs if h["session_id"] == "live-hand")
        assert handoff["messages"][0] == {"role": "user", "text": "can I talk to a person?", "seq": 0}
        status, claimed = await post(client, f"{gw}/v1/handoffs/{handoff['id']}/claim", headers, {"agent": "Ana"})
        assert status == 200 and claimed["state"] == "assigned" and claimed["agent"] == "Ana"
        status, other = await post(client, f"{gw}/v1/handoffs/{handoff['id']}/claim", headers, {"agent": "Bo"})
        assert status == 409 and "already assigned to 'Ana'" in other["detail"]
        status, sent = await post(client, f"{gw}/v1/sessions/live-hand/agent-messages", headers,
                                  {"agent": "Ana", "text": "Hi, Ana here.", "message_id": "ana-1"})
        assert status == 200 and sent == {"session_id": "live-hand", "message_id": "ana-1", "agent": "Ana",
                                          "text": "Hi, Ana here."}
        status, quiet = await post(client, f"{gw}/v1/sessions/live-hand/messages", headers, {"text": "thank you Ana"})
        assert status == 200 and quiet["reply"] == "" and quiet["handoff"] is True
        status, resolved = await post(client, f"{gw}/v1/handoffs/{handoff['id']}/resolve", headers,
                                      {"return_to_bot": True})
        assert status == 200 and resolved["state"] == "resolved" and resolved["return_to_bot"] is True
        status, back = await post(client, f"{gw}/v1/sessions/live-hand/messages", headers, {"text": "hello again"})
        assert status == 200 and back["handoff"] is False and back["reply"]
        seen = await read_sse(stream, 9, T)
    assert [(e, d.get("author") or d.get("state")) for _, e, d in seen] == [
        ("message", "contact"), ("tool_call", None), ("tool_result", None), ("handoff", "requested"),
        ("message", "bot"), ("handoff", "assigned"), ("message", "agent"), ("message", "contact"),
        ("handoff", "resolved"),
    ]
    status, _ = await post(client, f"{gw}/v1/sessions/live-hand/agent-messages", headers,
                           {"agent": "Ana", "text": "one more thing"})
    assert status == 409  # back with the bot: no person writes there
    # the model's answer came after Ana's words, which it read in the history
    rows = await db.fetch(
        "SELECT m.role, m.content::text AS content FROM ce_messages m JOIN ce_sessions s ON s.id = m.session_id "
        "WHERE s.tenant_id = $1 AND s.session_key = 'live-hand' ORDER BY m.seq", tenant_id)
    texts = [r["content"] for r in rows]
    ana = next(i for i, t in enumerate(texts) if "[Ana, a member of the team] Hi, Ana here." in t)
    assert ana < len(texts) - 2 and rows[-1]["role"] == "assistant"
