"""The gateway's edges that the real stack cannot be made to hit on demand: how router failures
become problem+json, the reply body's required fields, SSE framing of a failed turn.

A real aiohttp server on loopback and real Postgres repositories (the shared `pool`); only the
SessionRouter port is a fake (ScriptedRouter implements the gateway's Protocol).
"""

from __future__ import annotations

import asyncio
import json
import secrets
from datetime import UTC, datetime, timedelta
from typing import Any

import aiohttp
import msgspec
import pytest
import structlog
from aiohttp import web

from actors.placement import HostFailure
from actors.ray_host import HostError
from kernel.errors import InvalidInput, NotFound, Overloaded
from services.gateway.app import build_app
from services.gateway.common import parse_since
from services.wire import TurnTiming
from storage.repos import BotConfigRepo, TenantRepo, ToolRepo
from tests.support import gateways
from tests.support.gateways import ScriptedRouter, scripted_deps

gateway = gateways.scripted_gateway  # the fixture


async def problem_of(resp) -> dict[str, Any]:
    assert resp.content_type == "application/problem+json"
    body = json.loads(await resp.text())
    assert {"type", "title", "status", "detail"} <= body.keys() and body["status"] == resp.status
    return body


async def test_reply_always_carries_handoff_even_when_false(gateway):
    client, router, headers = gateway
    r = await client.post("/v1/sessions/s1/messages", headers=headers, json={"text": "hi"})
    body = await r.json()
    assert r.status == 200 and body["handoff"] is False and "pending_approval" not in body
    router.handoff = True
    body = await (await client.post("/v1/sessions/s1/messages", headers=headers, json={"text": "hi"})).json()
    assert body["handoff"] is True
    r = await client.post("/v1/sessions/s1/approvals/ap-1", headers=headers, json={"approve": True})
    assert (await r.json())["handoff"] is True


def timings(header: str) -> dict[str, float]:
    """`Server-Timing: a;dur=1.5, b;dur=2` as {"a": 1.5, "b": 2.0}."""
    out = {}
    for part in header.split(","):
        name, _, dur = part.strip().partition(";dur=")
        out[name] = float(dur)
    return out


async def test_the_hosts_timing_comes_as_a_server_timing_header_not_in_the_body(gateway):
    client, router, headers = gateway
    router.timing = TurnTiming(host_ms=12.5, gate_ms=3.25, share_ms=0.5, model_ms=6.0, upstream_ms=1.75)
    for path, body in (("/v1/sessions/s1/messages", {"text": "hi"}),
                       ("/v1/sessions/s1/approvals/ap-1", {"approve": True})):
        r = await client.post(path, headers=headers, json=body)
        assert r.status == 200 and "timing" not in await r.json()
        seen = timings(r.headers["Server-Timing"])
        assert seen.keys() == {"gateway", "host", "gate", "share", "model", "upstream"}
        assert (seen["host"], seen["gate"], seen["share"], seen["model"], seen["upstream"]) == (12.5, 3.25, 0.5, 6.0, 1.75)
        assert seen["gateway"] >= 0

    router.timing = None  # a reply without the host's timing: the gateway's own time only
    r = await client.post("/v1/sessions/s1/messages", headers=headers, json={"text": "hi"})
    assert timings(r.headers["Server-Timing"]).keys() == {"gateway"}

    router.timing = TurnTiming(host_ms=12.5, gate_ms=3.25)  # streamed: the done event has no timing
    r = await client.post("/v1/sessions/s1/messages", headers={**headers, "Accept": "text/event-stream"},
                          json={"text": "hi"})
    done = json.loads((await r.text()).rstrip().split("\n\n")[-1].split("data: ", 1)[1])
    assert done["reply"] == "hello" and "timing" not in done


async def test_sse_done_carries_handoff_and_a_failed_turn_ends_with_an_error_event(gateway):
    client, router, headers = gateway
    sse = {**headers, "Accept": "text/event-stream"}
    r = await client.post("/v1/sessions/s1/messages", headers=sse, json={"text": "hi"})
    text = await r.text()
    assert r.status == 200 and r.headers["Content-Type"] == "text/event-stream"
    frames = [f for f in text.split("\n\n") if f]
    assert frames[0] == 'event: text\ndata: "hel"'
    assert frames[-1].startswith("event: done\ndata: ")
    assert json.loads(frames[-1].split("data: ", 1)[1])["handoff"] is False

    router.raises = Overloaded("too many messages waiting for session 's1'", retry_after=2, reason="mailbox")
    text = await (await client.post("/v1/sessions/s1/messages", headers=sse, json={"text": "hi"})).text()
    last = text.rstrip().split("\n\n")[-1]
    assert last.startswith("event: error\n")
    assert json.loads(last.split("data: ", 1)[1]) == {
        "title": "Too many requests", "status": 429, "detail": str(router.raises), "retry_after": 2}


@pytest.mark.parametrize(("refusal", "status", "retry_after"), [
    (Overloaded("too many messages waiting for session 's1'; wait", retry_after=2.4, reason="mailbox"), 429, "3"),
    (Overloaded("this session host is at capacity; retry shortly", retry_after=1, reason="host_busy"), 503, "1"),
    (HostFailure(HostError(kind="not_found", message="no pending approval 'ap-1' in this session")), 404, None),
])
async def test_a_stream_refused_before_its_first_event_is_answered_with_the_problems_status(
        gateway, refusal, status, retry_after):
    # Nothing was sent yet: the status a JSON turn gets, with Retry-After, not 200 and an event
    client, router, headers = gateway
    router.refuses = refusal
    r = await client.post("/v1/sessions/s1/messages", json={"text": "hi"},
                          headers={**headers, "Accept": "text/event-stream"})
    body = await problem_of(r)
    assert r.status == status and body["detail"] == str(refusal), body
    assert r.headers.get("Retry-After") == retry_after


async def test_a_stream_whose_client_left_before_its_first_event_ends_quietly(pool):
    # A contact closing the app while the model thinks is routine: logged as a hang-up, no error.
    # The gateway's own server settings (TestServer cancels a handler whose client went away).
    router = ScriptedRouter()
    router.hold = asyncio.Event()
    deps, key = await scripted_deps(pool, router)
    runner = web.AppRunner(build_app(deps), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/sessions/s1/messages"
    try:
        with structlog.testing.capture_logs() as logs:
            async with aiohttp.ClientSession() as http:
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(http.post(url, json={"text": "hi"}, headers={
                        "Authorization": f"Bearer {key.api_key}", "Accept": "text/event-stream"}), 0.3)
            await asyncio.sleep(0.1)  # the server sees the connection close
            router.hold.set()
            async with asyncio.timeout(5):
                while not any(e["event"] == "sse_client_disconnected" for e in logs):
                    await asyncio.sleep(0.02)
        assert [e for e in logs if e["log_level"] in ("error", "critical")] == [], logs
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(("crash", "title", "retry_after"), [
    (Overloaded("the session host is restarting; retry with the same message_id", retry_after=1.5,
                reason="restarting"), "Overloaded", 1.5),
    (HostFailure(HostError(kind="internal", message="the session host failed to run this turn; retry shortly")),
     "Internal error", None),
    (RuntimeError("password=hunter2 in a stack trace"), "Internal error", None),
])
async def test_a_stream_that_breaks_off_ends_with_an_error_event(gateway, crash, title, retry_after):
    # Once the events began the status is sent: a failure of the router after that (the turn's
    # own, or anything unexpected) is told in band, as the last event, never as a connection cut
    # without a word.
    client, router, headers = gateway
    router.raises = crash
    r = await client.post("/v1/sessions/s1/messages", json={"text": "hi"},
                          headers={**headers, "Accept": "text/event-stream", "X-Request-Id": "req-7"})
    text = await r.text()
    frames = [f for f in text.split("\n\n") if f]
    assert r.status == 200 and frames[0] == 'event: text\ndata: "hel"'
    assert frames[-1].startswith("event: error\ndata: "), text
    error = json.loads(frames[-1].split("data: ", 1)[1])
    assert error["title"] == title and error.get("retry_after") == retry_after
    assert "hunter2" not in text
    if isinstance(crash, RuntimeError):
        assert "req-7" in error["detail"]
    else:
        assert error["detail"] == str(crash)


@pytest.mark.parametrize(("error", "status", "retry_after"), [
    (Overloaded("too many messages waiting for session 's1'; wait", retry_after=2.4, reason="mailbox"), 429, "3"),
    (Overloaded("the session host is restarting; retry with the same message_id", retry_after=1,
                reason="restarting"), 503, "1"),
    (HostFailure(HostError(kind="not_found", message="no pending approval 'ap-1' in this session")), 404, None),
    (HostFailure(HostError(kind="internal", message="the session host failed to run this turn; retry shortly")),
     500, None),
    (NotFound("tool 'x' does not exist for this tenant", kind="tool", key="x"), 404, None),
    (InvalidInput("text is empty - at `$.text`", path="$.text"), 422, None),
])
async def test_router_errors_become_problem_json(gateway, error, status, retry_after):
    client, router, headers = gateway
    router.raises = error
    r = await client.post("/v1/sessions/s1/messages", headers=headers, json={"text": "hi"})
    body = await problem_of(r)
    assert r.status == status, body
    assert body["detail"] == str(error)
    assert r.headers.get("Retry-After") == retry_after
    # the id the gateway made up for the turn, to send again (a 503 says "the same message_id")
    assert r.headers["X-Message-Id"] == router.ids[-1][0] and router.ids[-1][0].startswith("m_")


async def test_every_answer_to_a_message_names_its_message_id_and_request_id(gateway):
    client, router, headers = gateway
    router.raises = Overloaded("the reply is ready but could not be saved yet (database unavailable); "
                               "retry with the same message_id to get it", retry_after=2, reason="unsaved")
    r = await client.post("/v1/sessions/s1/messages", headers=headers, json={"text": "hi", "message_id": "c-9"})
    assert r.status == 503 and r.headers["X-Message-Id"] == "c-9"
    router.raises = None
    r = await client.post("/v1/sessions/s1/messages", headers=headers, json={"text": "hi"})
    assert r.status == 200 and r.headers["X-Message-Id"] == (await r.json())["message_id"] == router.ids[-1][0]
    r = await client.post("/v1/sessions/s1/messages", json={"text": "hi"},
                          headers={**headers, "Accept": "text/event-stream", "X-Request-Id": "req-sse"})
    await r.text()
    assert r.status == 200 and r.headers["X-Message-Id"] == router.ids[-1][0]
    assert r.headers["X-Request-Id"] == "req-sse"  # a stream too, though its headers leave before the middleware's turn
    r = await client.get("/v1/sessions/s1", headers=headers)
    assert "X-Message-Id" not in r.headers
    # a client's id with a control character is refused (it would be the Idempotency-Key of the
    # turn's tool calls), never a header injection; a printable id a header cannot carry as is
    # (non-ASCII) is taken, without the header (the client knows its own id)
    for odd in ("a\r\nSet-Cookie: x=1", "tab\tin"):
        r = await client.post("/v1/sessions/s1/messages", headers=headers, json={"text": "hi", "message_id": odd})
        assert r.status == 422 and "X-Message-Id" not in r.headers and "Set-Cookie" not in r.headers
        assert "`$.message_id`" in (await r.json())["detail"]
    r = await client.post("/v1/sessions/s1/messages", headers=headers, json={"text": "hi", "message_id": "é"})
    assert r.status == 200 and "X-Message-Id" not in r.headers and (await r.json())["message_id"] == "é"


async def test_an_unexpected_crash_is_500_with_the_request_id_and_no_internals(gateway):
    client, router, headers = gateway
    router.raises = RuntimeError("password=hunter2 in a stack trace")
    r = await client.post("/v1/sessions/s1/messages", headers={**headers, "X-Request-Id": "req-42"},
                          json={"text": "hi"})
    body = await problem_of(r)
    assert r.status == 500 and "req-42" in body["detail"] and "hunter2" not in json.dumps(body)
    assert r.headers["X-Request-Id"] == "req-42"


async def test_every_answer_carries_its_request_id_errors_too(gateway):
    client, router, headers = gateway
    router.raises = NotFound("tool 'x' does not exist for this tenant", kind="tool", key="x")
    answers = [await client.post("/v1/sessions/s1/messages", headers=headers, json={"text": "hi"}),
               await client.get("/v1/no-such-route", headers=headers),
               await client.get("/v1/sessions/s1%00", headers=headers),
               await client.get("/v1/tools")]  # no key: 401
    assert [r.status for r in answers] == [404, 404, 422, 401]
    ids = [r.headers.get("X-Request-Id") for r in answers]
    assert all(ids) and len(set(ids)) == 4, ids
    r = await client.post("/v1/sessions/s1/messages", headers={**headers, "X-Request-Id": "req-9"}, json={"text": "hi"})
    assert r.status == 404 and r.headers["X-Request-Id"] == "req-9"


async def test_metrics_render_when_the_hosts_are_down(gateway):
    client, _router, headers = gateway
    await client.post("/v1/sessions/s1/messages", headers=headers, json={"text": "hi"})
    r = await client.get("/metrics")
    text = await r.text()
    assert r.status == 200 and 'ce_tool_calls_total{outcome="success",tool="check_order"} 1.0' in text


async def test_expected_hosts_are_reported_down_when_the_stats_read_fails(gateway):
    # the shard count says ce-host-0 and ce-host-1 exist; the stats read raised, and this gateway
    # has never seen either answer: both are down, not absent (absent alerts on nothing)
    client, router, _headers = gateway
    router.host_names = lambda: ["ce-host-0", "ce-host-1"]  # type: ignore[attr-defined]
    text = await (await client.get("/metrics")).text()
    assert 'ce_host_up{host="ce-host-0"} 0.0' in text and 'ce_host_up{host="ce-host-1"} 0.0' in text


async def test_the_tenant_comes_from_the_key_alone(gateway, pool):
    client, router, headers = gateway
    await client.post("/v1/sessions/s1/messages", headers=headers, json={"text": "hi"})
    tenant = await TenantRepo(pool).tenant_for_key(headers["Authorization"].split()[1])
    assert router.calls == [(tenant.id, "s1")]


async def test_only_a_message_id_the_gateway_made_up_is_passed_on_as_new(gateway):
    # A made-up id cannot have a stored answer, so the host skips looking for one; a client's id
    # may repeat one of any age, so it is looked for (SessionHost.send).
    client, router, headers = gateway
    sse = {**headers, "Accept": "text/event-stream"}
    for h, body in ((headers, {"text": "hi"}), (headers, {"text": "hi", "message_id": "c-1"}),
                    (sse, {"text": "hi"}), (sse, {"text": "hi", "message_id": "c-2"})):
        async with client.post("/v1/sessions/s1/messages", headers=h, json=body) as r:
            assert r.status == 200
            await r.read()
    (made, new), client_ids = router.ids[0], router.ids[1::2]
    assert made.startswith("m_") and new is True
    assert router.ids[2][0].startswith("m_") and router.ids[2][0] != made and router.ids[2][1] is True
    assert client_ids == [("c-1", False), ("c-2", False)]


@pytest.mark.parametrize(("raw", "ago"), [
    (None, timedelta(hours=24)), ("", timedelta(hours=24)), ("30m", timedelta(minutes=30)),
    ("7d", timedelta(days=7)), ("2h", timedelta(hours=2)),
])
def test_since_look_backs(raw, ago):
    got = parse_since(raw)
    assert abs((datetime.now(UTC) - ago) - got) < timedelta(seconds=5)


@pytest.mark.parametrize("raw", ["2026-12-01T00:00:00Z", "2026-12-01T00:00:00+00:00", "2026-12-01T00:00:00"])
def test_since_iso_times_are_utc_aware(raw):
    assert parse_since(raw) == datetime(2026, 12, 1, tzinfo=UTC)


@pytest.mark.parametrize("raw", ["yesterday", "5w", "-1h", "2026-13-01"])
def test_since_rejects_what_it_cannot_read(raw):
    with pytest.raises(InvalidInput, match="since must be an ISO-8601 time"):
        parse_since(raw)


# -- catalog freshness: the next turn sees a committed change even before its NOTIFY ----------------


class NeverCalledBackend:
    """The catalog compiles webhook tools over a backend; these tests never run one."""

    async def call_webhook(self, *args: Any, **kw: Any) -> Any:
        raise AssertionError("not called")

    async def call_binding(self, *args: Any, **kw: Any) -> Any:
        raise AssertionError("not called")


async def no_builtins(tenant_id: str) -> tuple:
    return ()


def tenant_catalogs(pool, **kw: Any):
    from actors.catalogs import TenantCatalogs
    from services.tools.registry import HandlerRegistry

    return TenantCatalogs(
        tools=ToolRepo(pool), configs=BotConfigRepo(pool), registry=HandlerRegistry(),
        backend_for=lambda config: NeverCalledBackend(), builtins=no_builtins, llm=None, executor=None,
        main_model="main", cheap_model="cheap", **kw,
    )


async def test_a_change_reaches_the_next_turn_without_any_notification(pool):
    """No LISTEN here at all (as when a NOTIFY is still in flight): the stamp alone must do it."""
    from services.gateway.bodies import ToolCreate, definition_from_body

    tenant, _ = await TenantRepo(pool).create_tenant(f"stamp-{secrets.token_hex(3)}")
    tools = ToolRepo(pool)
    body = ToolCreate(name="check_order", description="Look up an order.",
                      parameters={"order_id": {"type": "string"}},
                      webhook_url="https://shop.example/api/orders/{order_id}")
    data = msgspec.to_builtins(definition_from_body(body, encrypt=lambda s: s))
    await tools.create(tenant.id, "check_order", "webhook", data)
    catalogs = tenant_catalogs(pool)

    env = await catalogs.env_for(tenant.id)
    assert env.catalog.get("check_order").definition.enabled is True
    assert await catalogs.env_for(tenant.id) is env, "unchanged: the cached environment is reused"
    reloads = catalogs.reloads

    await tools.new_version(tenant.id, "check_order", {**data, "enabled": False}, publish=True)
    env = await catalogs.env_for(tenant.id)
    assert env.catalog.get("check_order").definition.enabled is False
    assert catalogs.reloads == reloads + 1

    await tools.publish(tenant.id, "check_order", 1)  # keeps the live switch, changes the version
    assert (await catalogs.env_for(tenant.id)).catalog.get("check_order").version == 1
    await BotConfigRepo(pool).put(tenant.id, {"persona": "You are Stamp."})
    assert (await catalogs.env_for(tenant.id)).config.persona == "You are Stamp."
    await tools.delete(tenant.id, "check_order")
    assert (await catalogs.env_for(tenant.id)).catalog.get("check_order") is None


async def test_without_a_stamp_source_the_cache_waits_for_the_notification(pool):
    tenant, _ = await TenantRepo(pool).create_tenant(f"stamp-{secrets.token_hex(3)}")
    failing = tenant_catalogs(pool, stamp=lambda tenant_id: _raise(ConnectionError("db away")))
    env = await failing.env_for(tenant.id)
    await BotConfigRepo(pool).put(tenant.id, {"persona": "You are Later."})
    assert await failing.env_for(tenant.id) is env, "a failed stamp read serves the cached entry"
    failing.invalidate(tenant.id)  # what the NOTIFY listener does
    assert (await failing.env_for(tenant.id)).config.persona == "You are Later."


async def _raise(exc: BaseException):
    raise exc
