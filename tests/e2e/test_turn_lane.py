"""The turn lane end to end (actors/lane.py): the real gateway and shard hosts on a local Ray.

Turns the gateway routes reach the hosts over their lanes, not Ray's task path; the lane listens
on the node's loopback address and runs nothing for a connection without the host's token; with
CE_HOST_LANE=off the same turns go through Ray; a host restarted by Ray gets a new lane the
gateway finds by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import msgspec
import pytest
import ray
from structlog.testing import capture_logs

from actors.lane import LaneAddress, LaneBroken, LaneClient
from actors.placement import NAMESPACE, Placement
from services.wire import Turn
from tests.support.e2e import call_lines, post, register_order_tools, send

pytestmark = pytest.mark.e2e


async def host_counts(placement) -> dict[str, tuple[int, int]]:
    """host -> (turn calls by any path, turn calls over the lane)."""
    return {s["host"]: (s["turn_calls"], s["lane_calls"]) for s in await placement.stats()}


def sessions_on_every_host(placement, tenant_id: str, per_host: int) -> list[str]:
    """`per_host` session ids routed to each shard host. The tenant id is random, so ids picked
    blindly can all land on one host (a fresh clone's CI run once put 12 of 12 on one)."""
    by_host: dict[str, list[str]] = {}
    for i in range(10_000):
        s = f"lane-{i}"
        picked = by_host.setdefault(placement.actor_name(tenant_id, s), [])
        if len(picked) < per_host:
            picked.append(s)
        if len(by_host) == placement.shards and all(len(v) == per_host for v in by_host.values()):
            return [s for v in by_host.values() for s in v]
    raise AssertionError(f"no {per_host} sessions on each of {placement.shards} hosts: {by_host}")


async def refusals(client, url: str, reason: str) -> float:
    """The gateway's `ce_refused_total{reason}` on /metrics (0 before the first)."""
    async with client.get(f"{url}/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith(f'ce_refused_total{{reason="{reason}"}} '):
                return float(line.split(" ")[1])
    return 0.0


def delta(after: dict, before: dict) -> tuple[int, int]:
    return (sum(a[0] for a in after.values()) - sum(b[0] for b in before.values()),
            sum(a[1] for a in after.values()) - sum(b[1] for b in before.values()))


async def test_gateway_turns_go_over_the_hosts_lanes_and_through_ray_when_switched_off(stack, client, tenant):
    tenant_id, _key, headers = tenant
    url = stack.gateway.url
    await register_order_tools(client, url, headers, stack.demo_store.url)
    text = call_lines(("check_order", {"order_id": "1001"}))
    sessions = sessions_on_every_host(stack.placement, tenant_id, per_host=6)
    assert stack.placement.shards == 2 and len(sessions) == 12

    before = await host_counts(stack.placement)
    sent = await asyncio.gather(*(send(client, url, headers, s, text, f"{s}-m0") for s in sessions))
    assert all(s.reply is not None and s.reply["tool_calls"][0]["success"] for s in sent), [s.failures for s in sent]
    assert delta(await host_counts(stack.placement), before) == (12, 12)  # every turn, over the lane
    async with client.get(f"{url}/metrics") as r:  # what an operator sees
        scraped = {line.split(" ")[0]: float(line.split(" ")[1]) for line in (await r.text()).splitlines()
                   if line.startswith(("ce_host_turns{", "ce_host_lane_turns{"))}
    for host in {stack.placement.actor_name(tenant_id, s) for s in sessions}:
        lane_turns = scraped[f'ce_host_lane_turns{{host="{host}"}}']
        assert 0 < lane_turns <= scraped[f'ce_host_turns{{host="{host}"}}']

    # a streamed turn (an SSE client's) goes over the lane too, each event a frame
    before = await host_counts(stack.placement)
    async with client.post(f"{url}/v1/sessions/{sessions[2]}/messages", json={"text": text, "message_id": "sse-m1"},
                           headers={**headers, "Accept": "text/event-stream"}) as r:
        streamed = await r.text()
    assert r.status == 200 and "event: tool_call" in streamed and "event: done" in streamed, streamed
    assert delta(await host_counts(stack.placement), before) == (1, 1)

    # the same hosts, a gateway-side placement with the lane switched off: Ray's task path
    off = Placement(msgspec.structs.replace(stack.settings, host_lane=False))
    before = await host_counts(stack.placement)
    reply = await off.send(Turn(tenant_id=tenant_id, session_id=sessions[0], text=text, message_id="lane-off-m1"))
    assert reply.tool_calls[0].success and reply.message_id == "lane-off-m1"
    assert delta(await host_counts(stack.placement), before) == (1, 0)
    events = [e.event async for e in off.stream(Turn(tenant_id=tenant_id, session_id=sessions[3], text=text, message_id="lane-off-sse"))]
    assert events[-1] == "done" and delta(await host_counts(stack.placement), before) == (2, 0)
    # a message id answered over the lane is answered again through Ray: the stored reply
    again = await off.send(Turn(tenant_id=tenant_id, session_id=sessions[1], text="ignored", message_id=f"{sessions[1]}-m0"))
    assert again.replay and again.reply == sent[1].reply["reply"]


async def test_a_hosts_lane_is_on_loopback_and_refuses_a_connection_without_its_token(stack):
    name = stack.placement.actor_name("t", "s")
    raw = await ray.get_actor(name, namespace=NAMESPACE).lane.remote()
    address = msgspec.json.decode(raw, type=LaneAddress)
    assert address.host == "127.0.0.1" and address.port > 0 and len(address.token) >= 40

    before = await host_counts(stack.placement)
    forged = LaneClient(msgspec.structs.replace(address, token="x" * len(address.token)))
    with pytest.raises(LaneBroken):
        await forged.call("send", "t", "s", "run me", None)
    reader, writer = await asyncio.open_connection(address.host, address.port)
    writer.write(b"\x00\x00\x00\x05hello")  # not the token either
    assert await asyncio.wait_for(reader.read(), 10) == b""
    writer.close()
    assert delta(await host_counts(stack.placement), before) == (0, 0)


async def test_a_host_restarted_by_ray_gets_a_new_lane_and_the_gateway_finds_it(stack, client, tenant):
    tenant_id, _key, headers = tenant
    url = stack.gateway.url
    await register_order_tools(client, url, headers, stack.demo_store.url)
    text = call_lines(("check_order", {"order_id": "1002"}))
    session = "lane-restart"
    name = stack.placement.actor_name(tenant_id, session)
    handle = ray.get_actor(name, namespace=NAMESPACE)
    first = await send(client, url, headers, session, text, "lr-m0")
    assert first.reply is not None, first.failures
    old = msgspec.json.decode(await handle.lane.remote(), type=LaneAddress)
    pid = {s["host"]: s["pid"] for s in await stack.placement.stats()}[name]

    os.kill(pid, signal.SIGKILL)
    later = await send(client, url, headers, session, text, "lr-m1", retries=60)
    assert later.reply is not None and later.reply["tool_calls"][0]["success"], later.failures
    assert all(status == 503 for status, _ra, _b in later.failures), later.failures
    new = msgspec.json.decode(await handle.lane.remote(), type=LaneAddress)
    assert (new.port, new.token) != (old.port, old.token)
    stats = {s["host"]: s for s in await stack.placement.stats()}[name]
    assert stats["pid"] != pid and stats["lane_calls"] >= 1  # the gateway's turn came over the new lane


async def test_a_long_session_looks_for_a_stored_answer_only_under_a_clients_message_id(stack, client, tenant):
    from actors.session import TURN_CACHE

    tenant_id, _key, headers = tenant
    url = stack.gateway.url
    session = "lane-long"
    name = stack.placement.actor_name(tenant_id, session)

    async def reads() -> int:
        return {s["host"]: s.get("stored_turn_reads") for s in await stack.placement.stats()}[name]

    first = await send(client, url, headers, session, "hello", "ll-m0")  # a client's id
    assert first.reply is not None, first.failures
    before = await reads()
    for i in range(TURN_CACHE + 3):  # past the host's turn cache, with ids the gateway makes up
        async with client.post(f"{url}/v1/sessions/{session}/messages", headers=headers,
                               json={"text": f"hello {i}"}) as r:
            assert r.status == 200, await r.text()
    async with client.post(f"{url}/v1/sessions/{session}/messages", json={"text": "and streamed"},
                           headers={**headers, "Accept": "text/event-stream"}) as r:
        assert r.status == 200 and "event: done" in await r.text()  # over the lane
    assert await reads() == before  # a made-up id has no stored answer to look for

    again = await send(client, url, headers, session, "not run", "ll-m0")  # older than the cache
    assert again.reply is not None and again.reply["reply"] == first.reply["reply"]
    fresh = await send(client, url, headers, session, "hello", "ll-m1")  # a client's new id
    assert fresh.reply is not None and fresh.reply["message_id"] == "ll-m1", fresh.failures
    assert await reads() == before + 2
    async with client.get(f"{url}/metrics") as r:  # what an operator sees
        assert f'ce_host_stored_turn_reads{{host="{name}"}} {before + 2}.0' in await r.text()


async def test_a_hung_host_is_answered_503_host_unresponsive_and_its_turns_run_once_when_it_wakes(
    stack, client, tenant, db, monkeypatch,
):
    """A host process stopped (SIGSTOP: alive to TCP and to Ray, running nothing) is found by the
    lane's ping; its sessions' turns get 503 host_unresponsive instead of waiting for ever, the
    other host's sessions are served, and once it runs again a retry gets the turn's one answer."""
    monkeypatch.setattr("actors.lane.PROBE_QUIET_S", 0.5)
    monkeypatch.setattr("actors.lane.PING_TIMEOUT_S", 1.5)
    monkeypatch.setattr("actors.lane.WATCH_INTERVAL_S", 0.2)
    tenant_id, _key, headers = tenant
    url = stack.gateway.url
    await register_order_tools(client, url, headers, stack.demo_store.url)
    text = call_lines(("check_order", {"order_id": "1003"}))
    hung_session, other_session = sessions_on_every_host(stack.placement, tenant_id, per_host=1)
    hung_host = stack.placement.actor_name(tenant_id, hung_session)
    for s in (hung_session, other_session):  # both sessions live, both lanes open
        warm = await send(client, url, headers, s, text, f"{s}-warm")
        assert warm.reply is not None, warm.failures
    pid = {s["host"]: s["pid"] for s in await stack.placement.stats()}[hung_host]
    lane_calls = {s["host"]: s["lane_calls"] for s in await stack.placement.stats()}[hung_host]
    refused = await refusals(client, url, "host_unresponsive")

    os.kill(pid, signal.SIGSTOP)
    try:
        status, retry_after, body = await post(client, url, headers, hung_session, text, "hung-m1")
        assert (status, retry_after) == (503, "5") and "has not answered" in body["detail"], body
        other = await send(client, url, headers, other_session, text, "other-m1")
        assert other.reply is not None and other.reply["tool_calls"][0]["success"], other.failures
        status, _ra, body = await post(client, url, headers, hung_session, text, "hung-m2")  # at once, not sent
        assert status == 503 and "has not answered" in body["detail"], body
        async with client.post(f"{url}/v1/sessions/{hung_session}/messages", json={"text": text, "message_id": "hung-m3"},
                               headers={**headers, "Accept": "text/event-stream"}) as r:  # an SSE turn alike
            assert (r.status, r.headers.get("Retry-After")) == (503, "5"), await r.text()
    finally:
        os.kill(pid, signal.SIGCONT)
    assert await refusals(client, url, "host_unresponsive") == refused + 3  # what an operator sees

    again = await send(client, url, headers, hung_session, text, "hung-m1", retries=20, max_wait_s=0.2)
    assert again.reply is not None and again.reply["tool_calls"][0]["success"], again.failures
    runs = dict(await db.fetch("SELECT message_id, count(*) FROM ce_tool_calls WHERE tenant_id = $1 "
                               "AND message_id LIKE 'hung-%' GROUP BY message_id", tenant_id))
    assert runs == {"hung-m1": 1}  # the turn that reached the stopped host ran once; the refused one never
    stats = {s["host"]: s for s in await stack.placement.stats()}[hung_host]
    assert stats["pid"] == pid and stats["lane_calls"] >= lane_calls + 2  # the same process, woken


async def test_restart_hosts_replaces_a_hung_host_without_waiting_for_its_flush(stack, client, tenant, monkeypatch):
    """The operator's remedy for a host stuck for good: `restart-hosts` kills one that does not
    answer (RETIRE_PROBE_S) instead of waiting for the flush it cannot do; its sessions come back
    from Postgres on the new process with everything acknowledged. (Last in this file: it
    replaces both of the stack's hosts.)"""
    monkeypatch.setattr("actors.placement.RETIRE_PROBE_S", 1.0)
    monkeypatch.setattr("actors.placement.RETIRE_SHUTDOWN_S", 600.0)  # waited for, the restart would time out
    tenant_id, _key, headers = tenant
    url = stack.gateway.url
    session = sessions_on_every_host(stack.placement, tenant_id, per_host=1)[0]
    name = stack.placement.actor_name(tenant_id, session)
    first = await send(client, url, headers, session, "hello", "rh-m0")
    assert first.reply is not None, first.failures
    before = {s["host"]: s["pid"] for s in await stack.placement.stats()}

    os.kill(before[name], signal.SIGSTOP)
    try:
        with capture_logs() as logs:
            restarted = await asyncio.wait_for(stack.placement.restart_hosts(), 90)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(before[name], signal.SIGCONT)
    assert restarted == sorted(before)
    assert [e["host"] for e in logs if e["event"] == "retired_host_unresponsive"] == [name]
    after = {s["host"]: s["pid"] for s in await stack.placement.stats()}
    assert set(after) == set(before) and all(after[h] != before[h] for h in before), (before, after)
    again = await send(client, url, headers, session, "not run", "rh-m0", retries=20, max_wait_s=0.5)
    assert again.reply is not None and again.reply["reply"] == first.reply["reply"], again.failures  # from Postgres
    later = await send(client, url, headers, session, "hello again", "rh-m1", retries=20, max_wait_s=0.5)
    assert later.reply is not None, later.failures
