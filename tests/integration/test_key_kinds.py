"""Key kinds at the gateway, over the real Postgres: a `chat` key (safe to embed in a contact's
web page) may send messages and approvals to a session, read the session and watch its events,
and nothing else (403 naming its kind); keys made before kinds existed, and `admin` keys, may
do everything. The router is a stand-in (tests/support/gateways.py)."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.gateway.app import build_app
from services.gateway.common import CHAT_ROUTES, GatewayDeps
from services.tools.crypto import SecretBox, generate_key
from storage.repos import BotConfigRepo, SessionRepo, TenantRepo, ToolCallRepo, ToolRepo
from tests.support.gateways import FakeRouter, problem_of

#: a request on every kind of route a chat key may not use (admin data, tools, a person's part)
ADMIN_ONLY = [
    ("GET", "/v1/tools", None), ("POST", "/v1/tools", {"name": "x"}), ("GET", "/v1/bot-config", None),
    ("GET", "/v1/leads", None), ("GET", "/v1/handoffs", None), ("GET", "/v1/sessions", None),
    ("POST", "/v1/sessions/s1/agent-messages", {"text": "hi", "agent": "Ana"}),
    ("POST", "/v1/jobs/j1/result", {"status": "succeeded"}), ("GET", "/v1/analytics/tools", None),
]


@pytest.fixture
async def keys(pool, make_tenant):
    tenants = TenantRepo(pool)
    tenant, admin = await make_tenant("kinds")
    chat = await tenants.issue_key(tenant.id, "chat")
    deps = GatewayDeps(router=FakeRouter(), tenants=tenants, tools=ToolRepo(pool), calls=ToolCallRepo(pool),
                       sessions=SessionRepo(pool), configs=BotConfigRepo(pool), secret_box=SecretBox([generate_key()]))
    async with TestClient(TestServer(build_app(deps), host="127.0.0.1")) as client:
        yield client, {"Authorization": f"Bearer {admin.api_key}"}, {"Authorization": f"Bearer {chat.api_key}"}


async def test_a_chat_key_may_talk_to_a_session_read_it_and_watch_it(keys):
    client, _admin, chat = keys
    r = await client.post("/v1/sessions/s1/messages", json={"text": "hello"}, headers=chat)
    assert r.status == 200 and (await r.json())["reply"] == "hello"
    r = await client.get("/v1/sessions/s1", headers=chat)
    assert r.status in (200, 404)  # the stand-in router holds no view: the stored one, if any; never 403
    async with client.get("/v1/sessions/s1/events", headers=chat) as stream:
        assert stream.status != 403


@pytest.mark.parametrize(("method", "path", "body"), ADMIN_ONLY)
async def test_a_chat_key_on_any_other_route_is_403_naming_its_kind_and_what_to_use(keys, method, path, body):
    client, admin, chat = keys
    r = await client.request(method, path, json=body, headers=chat)
    detail = await problem_of(r, 403)
    assert "this is a chat key" in detail and "needs an admin key" in detail and f"{method} {path}" in detail
    r = await client.request(method, path, json=body, headers=admin)
    assert r.status != 403  # an admin key (as every key made before kinds) may


async def test_the_chat_routes_are_exactly_what_a_contacts_page_needs():
    assert {path for _, path in CHAT_ROUTES} == {
        "/v1/sessions/{session_id}/messages", "/v1/sessions/{session_id}/approvals/{approval_id}",
        "/v1/sessions/{session_id}", "/v1/sessions/{session_id}/events", "/v1/sessions/{session_id}/ws"}


async def test_a_key_made_before_kinds_existed_is_an_admin_key(pool, make_tenant):
    tenant, key = await make_tenant("older")
    async with pool.acquire() as conn:
        kind = await conn.fetchval("SELECT kind FROM ce_api_keys WHERE tenant_id = $1", tenant.id)
    assert kind == "admin"
    assert (await TenantRepo(pool).key_holder(key.api_key)).kind == "admin"
    with pytest.raises(Exception, match="admin or chat"):
        await asyncio.wait_for(TenantRepo(pool).issue_key(tenant.id, "owner"), 5)  # type: ignore[arg-type]


async def test_the_keys_route_lists_kinds_without_a_key_and_is_an_admin_route(keys, pool):
    client, admin, chat = keys
    r = await client.get("/v1/keys", headers=admin)
    listed = (await r.json())["keys"]
    assert sorted(k["kind"] for k in listed) == ["admin", "chat"]
    assert all(set(k) == {"key_id", "kind", "created_at", "revoked_at"} for k in listed)
    assert (await client.get("/v1/keys", headers=chat)).status == 403
