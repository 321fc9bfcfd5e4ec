"""Bad input at every edge of the gateway, through the real stack.

Every route that takes a body answers an oversized, empty, non-object, non-UTF-8, malformed,
too-deeply-nested or NUL-carrying body with a problem+json naming what is wrong (413, 400 or
422), never a 5xx; unknown fields and wrong types name the field and its path; oversized headers
are refused at the HTTP layer without the rejected line reaching the logs; and an SSE client
that hangs up mid-turn leaves a turn that completes, is stored and leaks no task.

Field-level errors the API tests already cover (tools, messages, approvals, bot config) are not
repeated here; this file adds the routes and edges they leave out.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote, urlsplit

import pytest
import pytest_asyncio

from kernel.records import session_uid
from services.gateway.common import MAX_BODY, MAX_TEXT
from tests.support.backend import Backend

PROBLEM_JSON = "application/problem+json"

#: every route that decodes a JSON body (the approval and job ids need not exist: the body is
#: decoded and refused before anything is looked up)
BODY_ROUTES = [
    ("POST", "/v1/sessions/bad-input/messages"),
    ("POST", "/v1/sessions/bad-input/approvals/ap-1"),
    ("POST", "/v1/tools"),
    ("PATCH", "/v1/tools/check_order"),
    ("PUT", "/v1/bot-config"),
    ("POST", "/v1/jobs/job-1/result"),
]
ROUTE_IDS = [f"{m} {p}" for m, p in BODY_ROUTES]


async def call(client, stack, headers: dict[str, str], method: str, path: str, *, data: Any = None,
               json_body: Any = None, extra: dict[str, str] | None = None) -> tuple[int, dict[str, Any], str]:
    kwargs: dict[str, Any] = {"headers": {**headers, **(extra or {})}}
    if json_body is not None:
        kwargs["json"] = json_body
    elif data is not None:
        kwargs["data"] = data
        kwargs["headers"].setdefault("Content-Type", "application/json")
    async with client.request(method, stack.gateway.url + path, **kwargs) as r:
        text = await r.text()
        body = json.loads(text) if r.content_type in ("application/json", PROBLEM_JSON) and text else {}
        if r.status >= 400:
            assert r.content_type == PROBLEM_JSON, (r.status, r.content_type, text)
            assert {"type", "title", "status", "detail"} <= body.keys() and body["status"] == r.status, body
            assert body["detail"].strip() and "Traceback" not in text and "postgres" not in text.lower(), body
        return r.status, body, text


# -- bodies ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("method", "path"), BODY_ROUTES, ids=ROUTE_IDS)
async def test_an_oversized_body_is_413_problem_json_with_or_without_a_content_length(stack, client, tenant,
                                                                                       method, path):
    big = b'{"text": "' + b"a" * (MAX_BODY + 10) + b'"}'
    status, problem, _ = await call(client, stack, tenant[2], method, path, data=big)
    assert status == 413 and str(MAX_BODY) in problem["detail"], problem

    async def chunks():  # chunked: no Content-Length to refuse early, the read itself must stop
        for _ in range(MAX_BODY // 8192 + 2):
            yield b" " * 8192

    status, problem, _ = await call(client, stack, tenant[2], method, path, data=chunks())
    assert status == 413 and str(MAX_BODY) in problem["detail"], problem


async def test_a_text_longer_than_the_limit_is_422_at_text(stack, client, tenant):
    status, problem, _ = await call(client, stack, tenant[2], "POST", "/v1/sessions/long/messages",
                                    json_body={"text": "a" * (MAX_TEXT + 1)})
    assert status == 422 and "$.text" in problem["detail"] and str(MAX_TEXT) in problem["detail"]


BAD_BODIES = [
    # (raw body, status, words the detail must hold)
    (b"", 422, ["empty"]),
    (b"[1, 2]", 422, ["Expected `object`", "array"]),
    (b'"hello"', 422, ["Expected `object`", "str"]),
    (b"42", 422, ["Expected `object`"]),
    (b"null", 422, ["Expected `object`", "null"]),
    (b'{"caf\xe9": 1}', 400, ["UTF-8"]),  # latin-1, not UTF-8
    (b'{"\xed\xa0\x80": 1}', 400, ["UTF-8"]),  # an encoded surrogate
    (b"\xff\xfe{\x00}", 400, ["JSON"]),
    (b'{"te', 400, ["JSON", "truncated"]),
]

#: per route, a body that is right but for one value: (a NUL in a string, an absurdly deep value)
DEEP = b"[" * 5000 + b"]" * 5000
ROUTE_BODIES = {
    "/v1/sessions/bad-input/messages": (b'{"text": "a\\u0000b"}', None),  # no field takes any JSON
    "/v1/sessions/bad-input/approvals/ap-1": (b'{"approve": true, "arguments": {"c\\u0000": {}}}',
                                              b'{"approve": true, "arguments": {"c": {"a": ' + DEEP + b"}}}"),
    "/v1/tools": (b'{"name": "t", "description": "a\\u0000b"}',
                  b'{"name": "t", "description": "d", "parameters": {"a": ' + DEEP + b"}}"),
    "/v1/tools/check_order": (b'{"description": "a\\u0000b"}', b'{"parameters": {"a": ' + DEEP + b"}}"),
    "/v1/bot-config": (b'{"persona": "a\\u0000b"}',
                       b'{"backend": {"base_url": "http://127.0.0.2", "openapi": {"a": ' + DEEP + b"}}}"),
    "/v1/jobs/job-1/result": (b'{"status": "succeeded", "result": "a\\u0000b"}',
                              b'{"status": "succeeded", "result": ' + DEEP + b"}"),
}


@pytest.mark.parametrize(("method", "path"), BODY_ROUTES, ids=ROUTE_IDS)
async def test_empty_non_object_non_utf8_malformed_deep_or_nul_bodies_are_4xx_naming_the_problem(
    stack, client, tenant, method, path
):
    for raw, want, words in BAD_BODIES:
        status, problem, _ = await call(client, stack, tenant[2], method, path, data=raw)
        assert status == want, (raw[:40], status, problem)
        assert all(w in problem["detail"] for w in words), (raw[:40], problem)
    nul, deep = ROUTE_BODIES[path]
    status, problem, _ = await call(client, stack, tenant[2], method, path, data=nul)
    assert status == 422 and "NUL" in problem["detail"], problem
    if deep is not None:
        status, problem, _ = await call(client, stack, tenant[2], method, path, data=deep)
        assert status == 422 and "deeply" in problem["detail"], problem


WRONG_SHAPES = [
    # (method, path, body, what the detail must name)
    ("POST", "/v1/jobs/job-1/result", {"status": "succeeded", "reslt": 1}, "reslt"),
    ("POST", "/v1/jobs/job-1/result", {"status": "done"}, "$.status"),
    ("POST", "/v1/jobs/job-1/result", {"status": "failed", "error": 5}, "$.error"),
    ("POST", "/v1/sessions/s-1/messages", {"text": "hi", "message_id": 5}, "$.message_id"),
    ("POST", "/v1/sessions/s-1/messages", {"text": ["hi"]}, "$.text"),
    ("POST", "/v1/sessions/s-1/approvals/ap-1", {"approve": True, "arguments": {"c1": "x"}}, "$.arguments"),
    ("POST", "/v1/sessions/s-1/approvals/ap-1", {"approve": True, "arguments": []}, "$.arguments"),
    ("PATCH", "/v1/tools/check_order", {"parameters": []}, "$.parameters"),
    ("PATCH", "/v1/tools/check_order", {"intents": "orders"}, "$.intents"),
    ("POST", "/v1/tools", {"name": "t", "description": "d", "parameter_map": {"a": 1}}, "$.parameter_map"),
    ("POST", "/v1/tools", {"name": "t", "description": "d", "scope": "account_id"}, "$.scope"),
    ("POST", "/v1/tools", {"name": "t", "description": "d", "timeout_ms": 2**70}, "$.timeout_ms"),
    ("PUT", "/v1/bot-config", {"allowlist": "check_order"}, "$.allowlist"),
    ("PUT", "/v1/bot-config", {"backend": {"base_url": 5}}, "$.backend.base_url"),
    ("PUT", "/v1/bot-config", {"approval_ttl_s": "soon"}, "$.approval_ttl_s"),
    ("PUT", "/v1/bot-config", {"backend": {"base_url": "ftp://x.example"}}, "backend.base_url"),
    ("PUT", "/v1/bot-config", {"notification_webhook": "not a url"}, "notification_webhook"),
]


@pytest.mark.parametrize(("method", "path", "body", "where"), WRONG_SHAPES,
                         ids=[f"{m} {p} {w}" for m, p, _, w in WRONG_SHAPES])
async def test_unknown_fields_and_wrong_types_are_422_naming_the_field(stack, client, tenant, method, path, body, where):
    status, problem, _ = await call(client, stack, tenant[2], method, path, json_body=body)
    assert status == 422 and where in problem["detail"], problem


@pytest.mark.parametrize("path", [
    "/v1/tools/a%00b", "/v1/tools/a%00b/versions", "/v1/jobs/j%00", "/v1/sessions/s-1/approvals/a%00",
    "/v1/analytics/tools?since=1%00h",
])
async def test_a_nul_in_the_url_is_422_not_a_storage_error(stack, client, tenant, path):
    method = "POST" if "approvals" in path else "GET"
    status, problem, _ = await call(client, stack, tenant[2], method, path, json_body={"approve": True}
                                    if method == "POST" else None)
    assert status == 422 and "NUL" in problem["detail"], problem


@pytest.mark.parametrize("since", ["99999999999999999999d", "0001-01-01T00:00:00+14:00",
                                   "9999-12-31T23:59:59-14:00", "2026-13-01", "-1d"])
async def test_an_impossible_since_is_422(stack, client, tenant, since):
    status, problem, _ = await call(client, stack, tenant[2], "GET", f"/v1/analytics/tools?since={quote(since)}")
    assert status == 422 and "since" in problem["detail"], problem


# -- NUL from the model: stored, and the host goes on saving ---------------------------------------

async def test_a_nul_the_model_passes_is_stored_and_every_session_keeps_saving(stack, client, tenant, db):
    tenant_id, _, headers = tenant
    body = {"name": "check_order", "description": "Look up an order.",
            "parameters": {"order_id": {"type": "string"}},
            "webhook_url": f"{stack.demo_store.url}/api/orders/{{order_id}}"}
    assert (await call(client, stack, headers, "POST", "/v1/tools", json_body=body))[0] == 201
    session = f"nul-{secrets.token_hex(4)}"
    # the text carries the six characters \u0000; the model's JSON decoder turns them into a NUL
    status, reply, _ = await call(client, stack, headers, "POST", f"/v1/sessions/{session}/messages",
                                  json_body={"text": '/call check_order {"order_id": "12\\u00003"}', "message_id": "m-nul"})
    assert status == 200, reply
    stored = await db.fetchval("SELECT parameters::text FROM ce_tool_calls WHERE tenant_id = $1 AND message_id = $2",
                               tenant_id, "m-nul")
    assert stored is not None and "12\ufffd3" in json.loads(stored)["order_id"], stored
    assert await db.fetchval("SELECT count(*) FROM ce_turns WHERE tenant_id = $1 AND session_id = $2",
                             tenant_id, session_uid(tenant_id, session)) == 1
    # a group commit that could not store that row would hold every reply of its host: all answer
    for i in range(6):
        status, _, _ = await call(client, stack, headers, "POST", f"/v1/sessions/after-nul-{i}/messages",
                                  json_body={"text": "hello"})
        assert status == 200


# -- headers ------------------------------------------------------------------------------------------

async def raw_http(url: str, request: bytes) -> tuple[int, bytes]:
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        writer.write(request)
        await writer.drain()
        response = await asyncio.wait_for(reader.read(), 10)  # the server closes after an error
    finally:
        writer.close()
    return int(response.split(b" ", 2)[1]), response


async def test_oversized_headers_are_refused_and_the_refused_line_is_not_logged(stack, client, tenant, caplog):
    key = tenant[1]
    cases = [
        b"X-Pad: " + b"a" * 9000,
        b"Authorization: Bearer " + key.encode() + b"a" * 9000,  # the key must not reach the log
        b"\r\n".join(b"X-H%d: %s" % (i, b"b" * 100) for i in range(200)),  # too many headers
    ]
    with caplog.at_level(logging.DEBUG):
        for header in cases:
            status, response = await raw_http(stack.gateway.url,
                                              b"GET /v1/tools HTTP/1.1\r\nHost: x\r\n" + header + b"\r\n\r\n")
            assert status in (400, 431), response[:200]
    logged = "\n".join(f"{r.getMessage()} {r.exc_text or ''}" for r in caplog.records)
    assert key not in logged, "the API key from an over-long Authorization line reached the log"
    assert any("LineTooLong" in r.getMessage() for r in caplog.records), logged[:2000]
    # the gateway goes on serving
    status, listed, _ = await call(client, stack, tenant[2], "GET", "/v1/tools")
    assert status == 200 and listed["tools"] == []


async def test_a_key_that_is_not_ascii_or_not_utf8_is_401(stack, tenant):
    for auth in (b"Bearer \xff\xfe", "Bearer ключ".encode(), b"Bearer " + tenant[1].encode() + b"\x01",
                 b"Bearer " + tenant[1][:-1].encode() + b"\xe9"):
        status, response = await raw_http(
            stack.gateway.url, b"GET /v1/tools HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: " + auth + b"\r\n\r\n")
        assert status in (400, 401), response[:300]
        assert b"postgres" not in response.lower() and b"Traceback" not in response, response


# -- an SSE client that hangs up mid-turn ---------------------------------------------------------------

@pytest_asyncio.fixture(scope="module")
async def slow_backend() -> AsyncIterator[Backend]:
    backend = await Backend("127.0.0.2").start()
    try:
        yield backend
    finally:
        await backend.stop()


async def _host_tasks(stack) -> int:
    return sum(s.get("tasks", 0) for s in await stack.placement.stats())


async def _sse_then_hang_up(client, stack, headers, session: str, message_id: str, backend: Backend, *, after: str | None):
    """Start a streamed turn whose tool is held by the backend; hang up after the `after` event
    (None: as soon as the response starts); then let the tool answer."""
    backend.release = asyncio.Event()
    seen: list[bytes] = []
    response = await client.post(
        f"{stack.gateway.url}/v1/sessions/{session}/messages",
        headers={**headers, "Accept": "text/event-stream"},
        json={"text": f'/call slow_lookup {{"order_id": "{message_id}"}}', "message_id": message_id},
    )
    assert response.status == 200
    if after is not None:
        while (line := await asyncio.wait_for(response.content.readline(), 10)) != f"event: {after}\n".encode():
            seen.append(line)
    response.close()  # drop the connection with the turn still running (its tool is held)
    await asyncio.sleep(0.2)
    backend.release.set()
    return seen


async def _stored(db, tenant_id: str, session: str, message_id: str, timeout_s: float = 15.0) -> tuple[Any, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        turn = await db.fetchval("SELECT response::text FROM ce_turns WHERE tenant_id = $1 AND session_id = $2 "
                                 "AND message_id = $3", tenant_id, session_uid(tenant_id, session), message_id)
        call_ok = await db.fetchval("SELECT success FROM ce_tool_calls WHERE tenant_id = $1 AND message_id = $2",
                                    tenant_id, message_id)
        if turn is not None and call_ok is not None or time.monotonic() > deadline:
            return turn, call_ok
        await asyncio.sleep(0.1)


async def test_an_sse_client_that_hangs_up_mid_turn_leaves_the_turn_completed_stored_and_no_leak(
    stack, client, tenant, db, slow_backend
):
    tenant_id, _, headers = tenant
    body = {"name": "slow_lookup", "description": "Look up an order slowly.",
            "parameters": {"order_id": {"type": "string"}},
            "webhook_url": f"{slow_backend.url}/slow/{{order_id}}", "timeout_ms": 10_000}
    assert (await call(client, stack, headers, "POST", "/v1/tools", json_body=body))[0] == 201

    async def one(i: int, after: str | None) -> None:
        session, message_id = f"sse-drop-{secrets.token_hex(3)}", f"m-drop-{i}-{secrets.token_hex(3)}"
        before = len(slow_backend.requests)
        await _sse_then_hang_up(client, stack, headers, session, message_id, slow_backend, after=after)
        turn, call_ok = await _stored(db, tenant_id, session, message_id)
        assert turn is not None and call_ok is True, (i, after, turn, call_ok)
        stored = json.loads(turn)
        assert stored["tool_calls"][0]["name"] == "slow_lookup" and stored["tool_calls"][0]["success"]
        status, view, _ = await call(client, stack, headers, "GET", f"/v1/sessions/{session}")
        assert status == 200 and view["messages"] == 4, view
        # the client retries the same message: the stored answer, and the tool does not run again
        status, again, _ = await call(client, stack, headers, "POST", f"/v1/sessions/{session}/messages",
                                      json_body={"text": "/call slow_lookup {}", "message_id": message_id})
        assert status == 200 and again["reply"] == stored["reply"], (again, stored)
        assert len(slow_backend.requests) == before + 1

    await one(0, "tool_call")  # warm up: the first stream of a host creates what it keeps
    await asyncio.sleep(0.5)
    host_before, gateway_before = await _host_tasks(stack), len(asyncio.all_tasks())
    for i in range(1, 7):
        await one(i, "tool_call" if i % 2 else None)
    await asyncio.sleep(0.5)
    host_after, gateway_after = await _host_tasks(stack), len(asyncio.all_tasks())
    assert host_after <= host_before + 2, f"session hosts hold {host_after - host_before} more tasks after 6 hang-ups"
    assert gateway_after <= gateway_before + 2, f"the gateway holds {gateway_after - gateway_before} more tasks"
