"""What one tenant may store and read at once is bounded (issue 39, item 2), through the
gateway's real routes on loopback with the real Postgres; the SessionRouter is a fake.

- Forms and appointment services are capped per tenant like tools (409 naming the limit;
  replacing one at the cap is never refused).
- A tool keeps its live version and its newest MAX_VERSIONS_KEPT: older ones are pruned as new
  ones are stored (they were kept for ever, and one listing returned them all).
- List routes answer pages: `limit` and `cursor` in, `next_cursor` out; the lists that grow
  with conversations by time (ties broken by id), so no page skips or repeats a row.
- Configuration writes have a per-tenant rate at each gateway (429 admin_rate, Retry-After).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer

import storage.repos.builtins as builtins_repo
import storage.repos.tools as tools_repo
from services.gateway.app import build_app
from services.gateway.limits import TenantRate
from storage.repos.builtins import HandoffRepo
from tests.support.gateways import problem_of, repo_deps

FORM = {"type": "object", "properties": {"email": {"type": "string"}}}
SERVICE = {"duration_minutes": 30, "timezone": "UTC", "opening_hours": {"mon": [["09:00", "17:00"]]}}


@pytest_asyncio.fixture
async def client(pool) -> AsyncIterator[TestClient]:
    async with TestClient(TestServer(build_app(repo_deps(pool)), host="127.0.0.1")) as c:
        yield c


@pytest_asyncio.fixture
async def headers(make_tenant) -> dict[str, str]:
    _, key = await make_tenant("bounds")
    return {"Authorization": f"Bearer {key.api_key}"}


def tool(name: str) -> dict:
    return {"name": name, "description": "Look up an order.", "parameters": {},
            "webhook_url": "https://shop.example.com/api/orders"}


@pytest.mark.parametrize("path,body,cap,many", [
    ("/v1/forms", FORM, "MAX_FORMS_PER_TENANT", "forms"),
    ("/v1/appointment-services", SERVICE, "MAX_SERVICES_PER_TENANT", "appointment services"),
])
async def test_forms_and_services_are_capped_per_tenant(client, headers, monkeypatch, path, body, cap, many):
    monkeypatch.setattr(builtins_repo, cap, 2)
    for name in ("first", "second"):
        assert (await client.put(f"{path}/{name}", headers=headers, json=body)).status == 200
    r = await client.put(f"{path}/third", headers=headers, json=body)
    detail = await problem_of(r, 409)
    assert f"a tenant may register at most 2 {many} and this one has 2" in detail and f"DELETE {path}/" in detail
    assert (await client.put(f"{path}/second", headers=headers, json=body)).status == 200  # replacing is fine
    assert (await client.delete(f"{path}/first", headers=headers)).status == 204
    assert (await client.put(f"{path}/third", headers=headers, json=body)).status == 200  # room made


async def test_a_tool_keeps_its_live_version_and_its_newest_ones_the_rest_are_pruned(client, headers, monkeypatch):
    monkeypatch.setattr(tools_repo, "MAX_VERSIONS_KEPT", 3)
    assert (await client.post("/v1/tools", headers=headers, json=tool("pruned"))).status == 201
    for i in range(2, 8):  # versions 2..7, stored without publishing: version 1 stays live
        r = await client.patch("/v1/tools/pruned", headers=headers,
                               json={"description": f"Look up an order, take {i}.", "publish": False})
        assert r.status == 200, await r.text()
    listed = await (await client.get("/v1/tools/pruned/versions", headers=headers)).json()
    assert [(v["version"], v["published"]) for v in listed["versions"]] == [
        (1, True), (5, False), (6, False), (7, False)]
    assert listed["next_cursor"] is None
    r = await client.post("/v1/tools/pruned/versions/3/publish", headers=headers)
    await problem_of(r, 404)  # pruned: gone
    assert (await client.post("/v1/tools/pruned/versions/6/publish", headers=headers)).status == 200
    r = await client.patch("/v1/tools/pruned", headers=headers, json={"description": "Look up an order, take 8."})
    assert r.status == 200  # 8 is live now; 6 was, and 1 is no longer kept
    listed = await (await client.get("/v1/tools/pruned/versions", headers=headers)).json()
    assert [v["version"] for v in listed["versions"]] == [6, 7, 8]


async def test_versions_come_in_pages(client, headers):
    assert (await client.post("/v1/tools", headers=headers, json=tool("paged"))).status == 201
    for i in range(2, 6):
        r = await client.patch("/v1/tools/paged", headers=headers, json={"description": f"take {i}", "publish": False})
        assert r.status == 200
    seen, cursor = [], ""
    for _ in range(5):
        query = {"limit": "2"} | ({"cursor": cursor} if cursor else {})
        page = await (await client.get("/v1/tools/paged/versions", headers=headers, params=query)).json()
        seen.append([v["version"] for v in page["versions"]])
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == [[1, 2], [3, 4], [5]]
    r = await client.get("/v1/tools/paged/versions", headers=headers, params={"cursor": "later"})
    assert "cursor must be a whole number" in await problem_of(r, 422)
    r = await client.get("/v1/tools/paged/versions", headers=headers, params={"limit": "0"})
    assert "limit must be a whole number from 1 to 1000" in await problem_of(r, 422)


@pytest.mark.parametrize("path,listed,make", [
    ("/v1/tools", "tools", "tool"),
    ("/v1/forms", "forms", "form"),
    ("/v1/appointment-services", "services", "service"),
])
async def test_lists_come_in_pages_by_name_and_whole_by_default(client, headers, path, listed, make):
    names = ["alpha", "bravo", "charlie", "delta", "echo"]
    for name in reversed(names):
        if make == "tool":
            r = await client.post(path, headers=headers, json=tool(name))
        else:
            r = await client.put(f"{path}/{name}", headers=headers, json=FORM if make == "form" else SERVICE)
        assert r.status in (200, 201), await r.text()
    whole = await (await client.get(path, headers=headers)).json()
    assert [item["name"] for item in whole[listed]] == names and whole["next_cursor"] is None
    pages, cursor = [], None
    while True:
        query = {"limit": "2"} | ({"cursor": cursor} if cursor else {})
        page = await (await client.get(path, headers=headers, params=query)).json()
        pages.append([item["name"] for item in page[listed]])
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert pages == [["alpha", "bravo"], ["charlie", "delta"], ["echo"]]


async def test_configuration_writes_past_the_tenants_rate_are_429_with_retry_after(pool, make_tenant):
    class Frozen:  # the bucket does not refill while the test runs
        now = 100.0

        def __call__(self) -> float:
            return self.now

    clock = Frozen()
    deps = repo_deps(pool, admin_writes=TenantRate(rate=1, burst=3, reason="admin_rate",
                                                      what="rate of configuration writes", clock=clock))
    _, key = await make_tenant("writes")
    _, other = await make_tenant("writes-other")
    headers = {"Authorization": f"Bearer {key.api_key}"}
    async with TestClient(TestServer(build_app(deps), host="127.0.0.1")) as client:
        for i in range(3):
            assert (await client.put(f"/v1/forms/f{i}", headers=headers, json=FORM)).status == 200
        r = await client.put("/v1/forms/f3", headers=headers, json=FORM)
        detail = await problem_of(r, 429)
        assert "over its rate of configuration writes (1/s)" in detail and r.headers["Retry-After"] == "1"
        assert (await client.get("/v1/forms", headers=headers)).status == 200  # reads are not writes
        r = await client.put("/v1/forms/theirs", headers={"Authorization": f"Bearer {other.api_key}"}, json=FORM)
        assert r.status == 200  # another tenant's writes have their own bucket
        clock.now += 1.0
        assert (await client.put("/v1/forms/f3", headers=headers, json=FORM)).status == 200
        metrics = await (await client.get("/metrics")).text()
        assert 'ce_refused_total{reason="admin_rate"} 1.0' in metrics


# -- lists that grow with conversations: pages by time, newest first (appointments: by start) -------------------

T0 = datetime(2026, 12, 1, tzinfo=UTC)
#: five rows' times, two of them tied: the id orders those, and no page skips or repeats one
TIMES = [T0, T0 + timedelta(hours=1), T0 + timedelta(hours=1), T0 + timedelta(hours=2), T0 + timedelta(hours=3)]


async def _seed(pool, tenant_id: str, table: str) -> list[str]:
    """Five rows of `table` for the tenant at TIMES, by SQL (their times chosen); returns their ids
    in the order the route lists them."""
    ids = [f"row-{i}" for i in range(5)]
    sql = {
        "leads": "INSERT INTO ce_leads (id, tenant_id, session_id, created_at) VALUES ($1, $2, $1, $3)",
        "submissions": "INSERT INTO ce_form_submissions (id, tenant_id, form_name, data, created_at) "
                       "VALUES ($1, $2, 'signup', '{}', $3)",
        "notifications": "INSERT INTO ce_notifications (id, tenant_id, event_type, payload, created_at) "
                         "VALUES ($1, $2, 'lead.created', '{}', $3)",
        "handoffs": "INSERT INTO ce_handoffs (id, tenant_id, session_id, created_at) VALUES ($1, $2, $1, $3)",
        "appointments": "INSERT INTO ce_appointments (id, tenant_id, service, starts_at, ends_at) "
                        "VALUES ($1, $2, $1, $3::timestamptz, $3::timestamptz + interval '30 minutes')",
    }[table]
    async with pool.acquire() as conn:
        for row_id, at in zip(ids, TIMES, strict=True):
            await conn.execute(sql, row_id, tenant_id, at)
    by_time = sorted(zip(TIMES, ids, strict=True), key=lambda p: (p[0], p[1]))
    if table == "appointments":  # by start time, earliest first
        return [i for _, i in by_time]
    return [i for _, i in sorted(by_time, key=lambda p: (-p[0].timestamp(), p[1]))]


@pytest.mark.parametrize("table,path,listed", [
    ("leads", "/v1/leads", "leads"),
    ("submissions", "/v1/forms/signup/submissions", "submissions"),
    ("notifications", "/v1/notifications", "notifications"),
    ("handoffs", "/v1/handoffs", "handoffs"),
    ("appointments", "/v1/appointments", "appointments"),
])
async def test_growing_lists_come_in_pages_that_neither_skip_nor_repeat_a_row(pool, make_tenant, table, path, listed):
    tenant, key = await make_tenant(f"pages-{table}")
    headers = {"Authorization": f"Bearer {key.api_key}"}
    expected = await _seed(pool, tenant.id, table)
    async with TestClient(TestServer(build_app(repo_deps(pool, handoffs=HandoffRepo(pool))), host="127.0.0.1")) as c:
        whole = await (await c.get(path, headers=headers)).json()
        assert [row["id"] for row in whole[listed]] == expected and whole["next_cursor"] is None
        pages, cursor = [], None
        while True:
            page = await (await c.get(path, headers=headers, params={"limit": "2"} | (
                {"cursor": cursor} if cursor else {}))).json()
            pages.append([row["id"] for row in page[listed]])
            cursor = page["next_cursor"]
            if cursor is None:
                break
        assert pages == [expected[0:2], expected[2:4], expected[4:]]
        r = await c.get(path, headers=headers, params={"cursor": "not-a-cursor"})
        assert "cursor must be the next_cursor of the page before" in await problem_of(r, 422)


async def test_mcp_servers_come_in_pages_by_name(pool, make_tenant):
    tenant, key = await make_tenant("pages-mcp")
    async with pool.acquire() as conn:
        for name in ("echo", "alpha", "delta", "bravo", "charlie"):
            await conn.execute("INSERT INTO ce_mcp_servers (tenant_id, name, url) VALUES ($1, $2, $3)",
                               tenant.id, name, f"https://{name}.example.com/mcp")
    async with TestClient(TestServer(build_app(repo_deps(pool)), host="127.0.0.1")) as c:
        headers = {"Authorization": f"Bearer {key.api_key}"}
        first = await (await c.get("/v1/mcp-servers", headers=headers, params={"limit": "3"})).json()
        rest = await (await c.get("/v1/mcp-servers", headers=headers,
                                  params={"limit": "3", "cursor": first["next_cursor"]})).json()
    assert [s["name"] for s in first["mcp_servers"]] == ["alpha", "bravo", "charlie"]
    assert [s["name"] for s in rest["mcp_servers"]] == ["delta", "echo"] and rest["next_cursor"] is None
