"""Hostile tenants through the real stack: tools aimed inside the network, a model that passes
another tenant's ids, another tenant's jobs, and secrets searched for everywhere they could leak.

- A URL aimed at the metadata address, a private or loopback range or a legacy numeric form of
  one is refused when it is registered (422 naming the field), on every field that takes one.
- A definition stored before that check (or under a wider allowlist) is refused when it runs,
  in-band, "destination not allowed"; a redirect to such an address is not followed.
- A model that passes another tenant's tenant_id/account_id (top level, nested, or through a
  binding's parameter_map) reaches the backend with none of them: only the session's own trusted values (a binding's `scope`).
- Another tenant's workflow jobs are 404 on both job routes.
- A webhook auth header, a backend auth header and the tenant's API key appear in no API response,
  error text, captured log (gateway in process, session hosts' log files) or database row.

Safety: every address a test aims at is literal, so no made-up name reaches the system resolver;
the only ones the stack could reach are on loopback: the allowlisted 127.0.0.2 backend and a
canary on 127.0.0.3, which the guard refuses and which records anything that gets through. The
metadata and private literals are only ever registered (and refused): none is stored, so none
is ever called. Names that resolve privately, and redirects to private addresses, are covered
with a test resolver and a loopback-only socket factory in tests/integration/test_hostile_tools.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import msgspec
import pytest
import pytest_asyncio
from structlog.testing import capture_logs

from tests.support.api import Api
from tests.support.backend import Backend
from tests.support.e2e import call_lines, new_tenant

PROBLEM_JSON = "application/problem+json"


def problem_with_detail(status: int, content_type: str, data) -> None:
    """Every error a hostile tenant gets is problem+json with a detail."""
    assert content_type == PROBLEM_JSON and data["detail"].strip(), (status, data)

BLOCKED_URLS = [
    "http://169.254.169.254/latest/meta-data/iam/{order_id}",
    "http://10.0.0.1/orders/{order_id}",
    "http://192.168.1.1:8080/orders/{order_id}",
    "http://[::ffff:169.254.169.254]/latest/{order_id}",
    "http://[fd00::1]/orders/{order_id}",
    "http://127.0.0.1:9/orders/{order_id}",  # loopback, outside the operator's allowlist
    "http://0.0.0.0/orders/{order_id}",
    "http://100.64.0.1/orders/{order_id}",  # shared address space (CGNAT)
    "http://2852039166/latest/{order_id}",  # 169.254.169.254 as one decimal number
    "http://0xa9.0xfe.0xa9.0xfe/latest/{order_id}",
    "http://169.254.169.254./latest/{order_id}",
]


@pytest_asyncio.fixture(scope="module")
async def backend() -> AsyncIterator[Backend]:
    b = await Backend("127.0.0.2").start()
    try:
        yield b
    finally:
        await b.stop()


@pytest_asyncio.fixture(scope="module")
async def canary() -> AsyncIterator[Backend]:
    """On 127.0.0.3: loopback, but outside the stack's allowlist. Nothing may ever reach it."""
    b = await Backend("127.0.0.3").start()
    try:
        yield b
    finally:
        await b.stop()


def webhook(name: str, url: str, **kw: Any) -> dict[str, Any]:
    return {"name": name, "description": f"{name}: look up an order.", "parameters": {"order_id": {"type": "string"}},
            "webhook_url": url, **kw}


# -- registration ------------------------------------------------------------------------------------

@pytest.mark.parametrize("url", BLOCKED_URLS)
async def test_a_url_aimed_inside_the_network_is_refused_at_registration_on_every_field(stack, client, url):
    _, key = await new_tenant(stack, "hostile")
    api = Api(client, stack.gateway.url, key, on_error=problem_with_detail)
    plain = url.replace("{order_id}", "x")
    attempts = [
        ("POST", "/v1/tools", webhook("steal", url), "webhook_url"),
        ("POST", "/v1/tools", {"name": "job", "description": "start a job", "type": "workflow", "start_url": plain},
         "start_url"),
        ("PATCH", "/v1/tools/check_order", {"webhook_url": url}, "webhook_url"),
        ("PUT", "/v1/bot-config", {"backend": {"base_url": plain}}, "backend.base_url"),
        ("PUT", "/v1/bot-config", {"notification_webhook": plain}, "notification_webhook"),
    ]
    status, _ = await api.call("POST", "/v1/tools", webhook("check_order", f"{stack.demo_store.url}/api/orders/{{order_id}}"))
    assert status == 201
    for method, path, body, field in attempts:
        status, problem = await api.call(method, path, body)
        assert status == 422 and f"`$.{field}`" in problem["detail"], (url, field, problem)
    # nothing of it was stored
    status, listed = await api.call("GET", "/v1/tools")
    assert [t["name"] for t in listed["tools"]] == ["check_order"]
    status, versions = await api.call("GET", "/v1/tools/check_order/versions")
    assert [v["version"] for v in versions["versions"]] == [1]
    status, config = await api.call("GET", "/v1/bot-config")
    assert config["backend"] is None and config["notification_webhook"] is None


# -- call time ---------------------------------------------------------------------------------------------

async def test_a_stored_tool_aimed_at_a_refused_address_is_refused_in_band_when_it_runs(stack, client, canary):
    """As if registered before the check existed, or under an allowlist since narrowed."""
    from services.gateway.bodies import ToolCreate, definition_from_body
    from storage.pool import create_pool
    from storage.repos import BotConfigRepo, ToolRepo

    tenant_id, key = await new_tenant(stack, "hostile")
    api = Api(client, stack.gateway.url, key, on_error=problem_with_detail)
    legacy = definition_from_body(ToolCreate(**webhook("legacy", f"{canary.url}/steal/{{order_id}}")), encrypt=str)
    pool = await create_pool(stack.settings.database_url, min_size=1, max_size=1)
    try:
        await ToolRepo(pool).create(tenant_id, "legacy", "webhook", msgspec.to_builtins(legacy))
        await BotConfigRepo(pool).put(tenant_id, {"backend": {"base_url": canary.url}})
    finally:
        await pool.close()
    status, _ = await api.call("POST", "/v1/tools", {
        "name": "search", "type": "backend_binding", "description": "search the catalog", "path": "/steal/search",
        "parameters": {"q": {"type": "string"}}})
    assert status == 201

    reply = await api.chat(f"legacy-{secrets.token_hex(3)}",
                           call_lines(("legacy", {"order_id": "1"}), ("search", {"q": "x"})))
    assert [(c["name"], c["success"]) for c in reply["tool_calls"]] == [("legacy", False), ("search", False)]
    for c in reply["tool_calls"]:
        assert c["error"].startswith(f"Tool '{c['name']}' failed: destination not allowed. "), c
        assert "127.0.0.3" not in c["error"] and "loopback" not in c["error"]
    assert canary.requests == []


async def test_a_redirect_to_a_refused_address_is_not_followed(stack, client, backend, canary):
    _, key = await new_tenant(stack, "hostile")
    api = Api(client, stack.gateway.url, key, on_error=problem_with_detail)
    before = len(backend.requests)
    url = f"{backend.url}/redirect/{{order_id}}?to={canary.url}/latest/meta-data/"
    assert (await api.call("POST", "/v1/tools", webhook("hop", url)))[0] == 201
    reply = await api.chat(f"hop-{secrets.token_hex(3)}", call_lines(("hop", {"order_id": "1"})))
    [call] = reply["tool_calls"]
    assert not call["success"] and "redirects are not followed" in call["error"], call
    assert len(backend.requests) == before + 1 and canary.requests == []


# -- another tenant's ids ----------------------------------------------------------------------------------

async def test_a_model_that_passes_another_tenants_ids_reaches_the_backend_with_the_trusted_ones(
    stack, client, backend
):
    a_id, a_key = await new_tenant(stack, "hostile")
    b_id, _ = await new_tenant(stack, "hostile")
    api = Api(client, stack.gateway.url, a_key, on_error=problem_with_detail)
    for body in (
        webhook("record_order", f"{backend.url}/ok/record", method="POST", mutability="read", parameters={
            "order_id": {"type": "string"}, "account_id": {"type": "string"}, "filter": {"type": "object"}}),
        webhook("lookup", f"{backend.url}/ok/lookup/{{order_id}}"),
        {"name": "search", "type": "backend_binding", "description": "search the catalog", "path": "/ok/search",
         "parameters": {"q": {"type": "string"}}, "scope": ["tenant_id"]},
    ):
        status, created = await api.call("POST", "/v1/tools", body)
        assert status == 201, created
    # a rename of a model parameter onto the account key is refused when saved (it could never apply)
    status, problem = await api.call("POST", "/v1/tools", {
        "name": "search_as", "type": "backend_binding", "description": "search the catalog", "path": "/ok/search",
        "parameters": {"q": {"type": "string"}, "customer": {"type": "string"}},
        "parameter_map": {"customer": "account_id"}, "scope": ["account_id"]})
    assert status == 422 and "`$.parameter_map`" in problem["detail"], problem
    assert (await api.call("PUT", "/v1/bot-config", {"backend": {"base_url": backend.url}}))[0] == 200

    theirs = {"tenant_id": b_id, "tenantId": b_id, "account_id": b_id, "accountId": b_id}
    before = len(backend.requests)
    reply = await api.chat(f"ids-{secrets.token_hex(3)}", call_lines(
        ("record_order", {"order_id": "1", **theirs, "filter": {"account_id": b_id, "items": [{"tenantId": b_id}]}}),
        ("lookup", {"order_id": "2", **theirs}),
        ("search", {"q": "shoes", **theirs}),
    ))
    assert [c["success"] for c in reply["tool_calls"]] == [True, True, True], reply
    sent = backend.requests[before:]
    assert len(sent) == 3
    for request in sent:
        assert b_id not in json.dumps(request), request  # path, query, headers, body
    record = next(r for r in sent if r["path"].startswith("/ok/record"))
    # a webhook sends no protected key at all, not even the trusted one its schema names (the client
    # strips them again); a binding gets the trusted tenant through its `scope`
    assert json.loads(record["body"]) == {"order_id": "1", "filter": {"items": [{}]}}
    lookup = next(r for r in sent if r["path"].startswith("/ok/lookup"))
    assert urlsplit(lookup["path"]).query == ""  # the schema names no account: none is sent
    search = next(r for r in sent if r["path"].startswith("/ok/search"))
    assert parse_qs(urlsplit(search["path"]).query) == {"q": ["shoes"], "tenant_id": [a_id]}


# -- another tenant's jobs -----------------------------------------------------------------------------------

async def test_another_tenants_workflow_job_is_404_on_both_job_routes(stack, client, backend):
    _, a_key = await new_tenant(stack, "hostile")
    _, b_key = await new_tenant(stack, "hostile")
    a = Api(client, stack.gateway.url, a_key, on_error=problem_with_detail)
    b = Api(client, stack.gateway.url, b_key, on_error=problem_with_detail)
    status, _ = await a.call("POST", "/v1/tools", {
        "name": "start_refund", "type": "workflow", "description": "start a refund", "mutability": "read",
        "start_url": f"{backend.url}/ok/jobs", "parameters": {"order_id": {"type": "string"}}})
    assert status == 201
    before = len(backend.requests)
    reply = await a.chat(f"job-{secrets.token_hex(3)}", call_lines(("start_refund", {"order_id": "7"})))
    assert reply["tool_calls"][0]["success"], reply
    [start] = backend.requests[before:]
    job_id = json.loads(start["body"])["job_id"]

    for method, path, body in (("GET", f"/v1/jobs/{job_id}", None),
                               ("POST", f"/v1/jobs/{job_id}/result", {"status": "succeeded", "result": {"hijacked": True}}),
                               ("POST", f"/v1/jobs/{job_id}/result", {"status": "failed", "error": "cancelled by B"})):
        status, problem = await b.call(method, path, body)
        assert status == 404 and job_id in problem["detail"], problem
        status, own = await b.call(method, path.replace(job_id, "job_nope"), body)
        assert status == 404 and own["title"] == problem["title"]  # same answer as for no such job
    status, job = await a.call("GET", f"/v1/jobs/{job_id}")
    assert status == 200 and job["status"] not in ("succeeded", "failed") and job["result"] is None, job
    for path in (f"/v1/jobs/{job_id}", f"/v1/jobs/{job_id}/result"):
        async with client.request("POST" if path.endswith("result") else "GET", stack.gateway.url + path,
                                  json={"status": "succeeded"}) as r:
            assert r.status == 401


# -- secrets ---------------------------------------------------------------------------------------------------

def _ray_logs(since: float) -> dict[str, str]:
    """Session hosts' stdout/stderr (Ray worker log files) written since `since`."""
    import ray

    node = ray._private.worker._global_node
    if node is None:
        return {}
    found = {}
    for path in Path(node.get_logs_dir_path()).glob("*worker*"):
        if path.is_file() and path.stat().st_mtime >= since - 1:
            found[str(path)] = path.read_text(errors="replace")
    return found


async def test_secrets_appear_in_no_response_error_log_or_row(stack, client, backend, canary, db, caplog):
    tenant_id, key = await new_tenant(stack, "hostile")
    seen: list[str] = []
    api = Api(client, stack.gateway.url, key, seen, on_error=problem_with_detail)
    webhook_secret = f"Bearer sk-SECRET-canary-{secrets.token_hex(8)}"
    backend_secret = f"Bearer sk-SECRET-backend-{secrets.token_hex(8)}"
    started = time.time()
    with capture_logs() as logs, caplog.at_level(logging.DEBUG):
        for body in (
            webhook("lookup", f"{backend.url}/ok/{{order_id}}", auth_header=webhook_secret),
            webhook("broken", f"{backend.url}/fail500/{{order_id}}", auth_header=webhook_secret),
            webhook("denied", f"{backend.url}/fail401/{{order_id}}", auth_header=webhook_secret),
            webhook("hop", f"{backend.url}/redirect/{{order_id}}?to={canary.url}/x", auth_header=webhook_secret),
            {"name": "search", "type": "backend_binding", "description": "search the catalog", "path": "/fail401/s",
             "parameters": {"q": {"type": "string"}}},
        ):
            status, created = await api.call("POST", "/v1/tools", body)
            assert status == 201 and "auth_header" not in created, created
        assert (await api.call("PUT", "/v1/bot-config", {
            "backend": {"base_url": backend.url, "auth_header": backend_secret}}))[0] == 200
        assert (await api.call("PATCH", "/v1/tools/lookup", {"description": "Look up an order, v2."}))[0] == 200
        assert (await api.call("PATCH", "/v1/tools/broken", {"auth_header": webhook_secret, "publish": False}))[0] == 200
        for path in ("/v1/tools", "/v1/tools/lookup", "/v1/tools/lookup/versions", "/v1/bot-config",
                     "/v1/tools/contract"):
            assert (await api.call("GET", path))[0] == 200
        assert (await api.call("POST", "/v1/tools/lookup/versions/1/publish"))[0] == 200

        before = len(backend.requests)
        session = f"secrets-{secrets.token_hex(3)}"
        reply = await api.chat(session, call_lines(*[(n, {"order_id": "42", "q": "x"} if n == "search" else {"order_id": "42"})
                                                for n in ("lookup", "broken", "denied", "hop", "search")]))
        assert [c["success"] for c in reply["tool_calls"]] == [True, False, False, False, False], reply
        async with client.post(f"{stack.gateway.url}/v1/sessions/{session}/messages",
                               headers={"Authorization": f"Bearer {key}", "Accept": "text/event-stream"},
                               json={"text": call_lines(("broken", {"order_id": "43"}))}) as r:
            seen.append(await r.text())
        for path in (f"/v1/sessions/{session}", "/v1/analytics/tools?since=1h"):
            assert (await api.call("GET", path))[0] == 200
        async with client.get(f"{stack.gateway.url}/metrics") as r:
            seen.append(await r.text())
        # a wrong key, and the right one in an over-long header line the HTTP parser refuses
        assert (await Api(client, stack.gateway.url, key + "x", seen, on_error=problem_with_detail).call("GET", "/v1/tools"))[0] == 401
        reader, writer = await asyncio.open_connection(urlsplit(stack.gateway.url).hostname, urlsplit(stack.gateway.url).port)
        writer.write(b"GET /v1/tools HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key.encode() + b"a" * 9000 + b"\r\n\r\n")
        await writer.drain()
        await asyncio.wait_for(reader.read(), 10)
        writer.close()
        await asyncio.sleep(0.5)  # let the hosts flush and write their logs

    # the secrets were real and were used
    sent = backend.requests[before:]
    assert {r["headers"].get("Authorization") for r in sent if not r["path"].startswith("/fail401/s")} == {webhook_secret}
    assert [r["headers"].get("Authorization") for r in sent if r["path"].startswith("/fail401/s")] == [backend_secret]
    assert canary.requests == []

    rows: dict[str, list[str]] = {}
    for table in ("ce_tool_calls", "ce_turns", "ce_messages", "ce_custom_tools", "ce_tool_versions", "ce_sessions",
                  "ce_session_variables", "ce_bot_config", "ce_jobs", "ce_tenants", "ce_api_keys"):
        rows[table] = [r["t"] for r in await db.fetch(f"SELECT t::text AS t FROM {table} t")]
    assert any(tenant_id in r for r in rows["ce_tool_calls"]) and any(tenant_id in r for r in rows["ce_messages"])
    places = {
        "API responses (with every error text)": "\n".join(seen),
        "gateway logs (structlog)": repr(logs),
        "gateway logs (stdlib, aiohttp)": "\n".join(f"{r.getMessage()} {r.exc_text or ''}" for r in caplog.records),
        **{f"session host log {p}": text for p, text in _ray_logs(started).items()},
        **{f"table {t}": "\n".join(r) for t, r in rows.items()},
    }
    for name, secret in (("webhook auth header", webhook_secret.split()[1]), ("backend auth header", backend_secret.split()[1]),
                         ("tenant API key", key)):
        for where, text in places.items():
            assert secret not in text, f"the {name} is in the {where}"
