"""The tenant dashboard in a real browser: Debian's headless chromium driven by Playwright.

Against the real stack (gateway + Ray + Postgres + local model + demo store), as a tenant admin
would use it: sign in with the API key, register a webhook tool pointing at the demo store, chat
through the try-it box (SSE) until the model calls it, and find the call in the session view and
in analytics; bad input shows the API's own message next to the field; drafts survive a reload;
versions diff and roll back; the contract report lists each tool's findings with their fixes.

Screenshots of every step land in test-artifacts/dashboard/ (gitignored); each test also leaves a
`<test>-last.png` of where it stopped, pass or fail. The browser is /usr/bin/chromium from Debian
(`make test` installs it when missing); Playwright never downloads one here.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from tests.support.api import Api
from tests.support.browser import needs_chromium, open_page

pytestmark = [pytest.mark.e2e, needs_chromium]


# -- fixtures ---------------------------------------------------------------------------------

@pytest_asyncio.fixture
async def api(stack, client, tenant) -> Api:
    return Api(client, stack.gateway.url, tenant[2])


def order_tool(store_url: str, name: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "description": "Look up an order by its order number. Use when the customer asks where their order is.",
        "parameters": {"order_id": {"type": "string", "description": "The order number"}},
        "webhook_url": f"{store_url}/api/orders/{{order_id}}", **extra,
    }


# -- the acceptance path ----------------------------------------------------------------------

async def test_sign_in_create_webhook_tool_chat_until_it_is_called_and_see_it_in_analytics(tab, stack, tenant, api):
    from playwright.async_api import expect

    page = tab.page
    key = tenant[1]
    await tab.sign_in(key)
    await expect(page.get_by_text("No tools yet")).to_be_visible()
    storage = await page.evaluate("() => [JSON.stringify(sessionStorage), JSON.stringify(localStorage), document.cookie]")
    assert key in storage[0] and key not in storage[1] and key not in storage[2], "the key lives in sessionStorage only"
    await tab.shot("signed-in")

    # create the webhook tool in the form; the default parameter schema already has order_id
    tool = f"order_lookup_{secrets.token_hex(2)}"
    await page.get_by_role("link", name="New tool").click()
    await page.locator("#f-name").fill(tool)
    await page.locator("#f-description").fill(
        "Look up an order by its order number. Use when the customer asks where their order is.")
    await page.locator("#f-webhook_url").fill(f"{stack.demo_store.url}/api/orders/{{order_id}}")
    await page.locator("#f-auth_header").fill("Bearer dash-store-secret")
    await expect(page.locator("#params-status")).to_contain_text("Valid schema · 1 parameter")
    assert "dash-store-secret" not in await page.evaluate("() => JSON.stringify(sessionStorage)"), \
        "a draft never keeps the write-only auth header"
    await tab.shot("new-tool-form")
    await page.get_by_role("button", name="Create tool").click()
    await expect(page.get_by_role("heading", name=f"Tool {tool}")).to_be_visible()
    await expect(page.locator("#auth-state")).to_have_text("set")
    assert "dash-store-secret" not in await page.content(), "the auth header is write-only"
    assert "dash-store-secret" not in await page.evaluate("() => JSON.stringify(sessionStorage)"), \
        "the saved draft (with the header) is gone"
    status, stored = await api.call("GET", f"/v1/tools/{tool}")
    assert status == 200 and stored["auth_header_set"] is True and stored["version"] == 1
    assert stored["webhook_url"] == f"{stack.demo_store.url}/api/orders/{{order_id}}"
    await tab.shot("tool-created")

    # chat in the try-it box until the model calls the tool (natural text first, then /call)
    await page.get_by_role("link", name="Sessions").click()
    session = f"dash-{secrets.token_hex(3)}"
    await page.locator("#try-session").fill(session)
    await page.locator("#try-session").press("Tab")
    called = page.locator(f'#chat-log [data-event="tool_result"][data-tool="{tool}"]')
    attempts = ["where is my order 12345?", f'/call {tool} {{"order_id": "12345"}}']
    for n, text in enumerate(attempts, start=1):
        await page.locator("#try-text").fill(text)
        await page.locator("#try-send").click()
        await expect(page.locator("#try-send")).to_be_enabled()  # the stream ended
        await page.wait_for_function("n => document.querySelectorAll('#chat-log .msg.bot').length >= n", arg=n)
        if await called.count():
            break
    await expect(called.first).to_contain_text("answered in")
    await expect(page.locator("#chat-log .msg.bot").last).to_contain_text("12345")
    await expect(page.locator(f'#chat-log [data-event="tool_call"][data-tool="{tool}"]').first).to_be_visible()
    await tab.shot("try-it-called-the-tool")

    # the session view: the turn, its call with its parameters, the handoff state
    await expect(page).to_have_url(f"{tab.url}/#/sessions/{session}")
    turn_call = page.locator(f'#session-turns tr[data-tool="{tool}"]')
    await expect(turn_call.first).to_contain_text('"order_id": "12345"')
    await expect(turn_call.first).to_contain_text("ok")
    await expect(page.locator("#handoff-state")).to_have_text("bot handling")
    await expect(page.locator(f'#sessions-table tr[data-session="{session}"]')).to_be_visible()
    await tab.shot("session-detail")

    # analytics: the call is counted, drawn and listed
    await page.get_by_role("link", name="Analytics").click()
    row = page.locator(f'#analytics-table tr[data-tool="{tool}"]')
    await expect(row).to_be_visible()
    calls = int(await row.locator('[data-field="calls"]').inner_text())
    assert calls >= 1
    assert await page.locator(f'#chart-calls rect[data-tool="{tool}"]').count() >= 1
    assert await page.locator(f'#chart-success rect[data-tool="{tool}"]').count() == 1
    assert await page.locator(f'#chart-latency rect[data-tool="{tool}"]').count() == 2  # p95 and p50
    await expect(page.locator(f'#most-used [data-tool="{tool}"]')).to_contain_text(f"{calls} call")
    status, stats = await api.call("GET", "/v1/analytics/tools?since=1h")
    assert [t["calls"] for t in stats["tools"] if t["name"] == tool] == [calls]
    await tab.shot("analytics")

    # and the tools list shows the last-24h success rate
    await page.get_by_role("link", name="Tools").click()
    await expect(page.locator(f'#tools-table tr[data-tool="{tool}"] [data-field="success"]')).to_have_text(
        f"100% of {calls}")
    assert tab.errors == []


# -- forms: the API's message next to the field, nothing lost on a reload -----------------------

async def test_bad_input_shows_the_api_message_next_to_the_field_and_a_reload_loses_nothing(tab, stack, tenant, api):
    from playwright.async_api import expect

    page = tab.page
    # a wrong key: the API's 401 detail next to the key field
    await page.goto(tab.url + "/")
    await page.get_by_label("Tenant API key").fill("ce_not-a-key")
    await page.get_by_role("button", name="Sign in").click()
    async with aiohttp.ClientSession() as anon, anon.get(
            tab.url + "/v1/tools", headers={"Authorization": "Bearer ce_not-a-key"}) as r:
        refused = (await r.json(content_type=None))["detail"]
    await expect(page.locator("#err-api-key")).to_have_text(refused)
    await tab.shot("wrong-key")
    await tab.sign_in(tenant[1])

    await tab.go("/tools/new")
    url = f"{stack.demo_store.url}/api/orders/{{order_id}}"
    await page.locator("#f-name").fill("9 lives")
    await page.locator("#f-description").fill("Look up an order by its number.")
    await page.locator("#f-webhook_url").fill(url)

    async def api_says(body: dict[str, Any]) -> str:
        status, problem = await api.call("POST", "/v1/tools", body)
        assert status == 422, problem
        return problem["detail"]

    # the name: only the server checks it
    await page.get_by_role("button", name="Create tool").click()
    expected = await api_says(order_tool(stack.demo_store.url, "9 lives", description="Look up an order by its number."))
    await expect(page.locator("#err-name")).to_have_text(expected)
    await expect(page.locator("#f-name")).to_have_attribute("aria-invalid", "true")
    await tab.shot("name-refused")

    # the URL scheme
    await page.locator("#f-name").fill("dash_draft")
    await expect(page.locator("#err-name")).to_be_hidden()  # typing clears the message
    await page.locator("#f-webhook_url").fill("ftp://127.0.0.2/api/orders/{order_id}")
    await page.get_by_role("button", name="Create tool").click()
    expected = await api_says(order_tool("ftp://127.0.0.2", "dash_draft"))
    await expect(page.locator("#err-webhook_url")).to_have_text(expected)
    await tab.shot("url-refused")

    # the parameter editor checks the schema as you type...
    params = page.locator("#f-parameters")
    live = page.locator("#params-status")
    for text, message in [
        ('{"order_id": {"type": "string"', "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"order_id": {"description": "no type"}}', "'order_id' needs a \"type\""),
        ('{"order_id": {"type": "strng"}}', 'has type "strng"'),
        ('{"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["id"]}', "names 'id'"),
        ('{"sku": {"type": "string"}}', "the URL uses {order_id} but parameters has no 'order_id'"),
    ]:
        await params.fill(text)
        await expect(live).to_contain_text(message)
        await expect(params).to_have_attribute("aria-invalid", "true")
    await tab.shot("schema-checked-while-typing")
    # ...and what only the server knows comes back next to the same field
    subtle = '{"order_id": {"type": "string", "minLength": "three"}}'
    await params.fill(subtle)
    await expect(live).to_contain_text("Valid schema")
    await page.locator("#f-webhook_url").fill(url)
    await page.get_by_role("button", name="Create tool").click()
    expected = await api_says(order_tool(stack.demo_store.url, "dash_draft", parameters=json.loads(subtle)))
    await expect(page.locator("#err-parameters")).to_have_text(expected)
    await tab.shot("schema-refused-by-api")

    # a reload keeps the draft, the sign-in and the route
    await page.locator("#f-timeout_ms").fill("2500")
    await page.reload()
    await expect(page.locator("#f-name")).to_have_value("dash_draft")
    await expect(params).to_have_value(subtle)
    await expect(page.locator("#f-webhook_url")).to_have_value(url)
    await expect(page.locator("#f-timeout_ms")).to_have_value("2500")
    await expect(page.locator("#draft-state")).to_contain_text("Draft restored")
    await tab.shot("draft-restored-after-reload")

    # fixed and saved: the draft is gone
    await params.fill('{"order_id": {"type": "string", "minLength": 3}}')
    await page.get_by_role("button", name="Create tool").click()
    await expect(page.get_by_role("heading", name="Tool dash_draft")).to_be_visible()
    status, stored = await api.call("GET", "/v1/tools/dash_draft")
    assert status == 200 and stored["timeout_ms"] == 2500
    assert stored["parameters"]["properties"]["order_id"]["minLength"] == 3
    await tab.go("/tools/new")
    await expect(page.locator("#f-name")).to_have_value("")

    # the chat box keeps its unsent text and its transcript over a reload too
    await tab.go("/sessions")
    await page.locator("#try-session").fill("dash-reload")
    await page.locator("#try-session").press("Tab")
    await page.locator("#try-text").fill("hello there")
    await page.locator("#try-send").click()
    await expect(page.locator("#chat-log .msg.bot")).to_have_count(1)
    # the turn over: the page has moved to the session and drawn it again (typing into a box that
    # is being replaced is not what this checks), then the draft is in the tab's storage
    await expect(page).to_have_url(f"{tab.url}/#/sessions/dash-reload")
    await expect(page.locator("#session-detail")).to_contain_text("dash-reload")
    await expect(page.locator("#try-send")).to_be_enabled()
    await page.locator("#try-text").fill("half-written message")
    await page.wait_for_function("() => sessionStorage.getItem('ce.tryit.text') === JSON.stringify('half-written message')")
    await page.reload()
    await expect(page.locator("#try-text")).to_have_value("half-written message")
    await expect(page.locator("#try-session")).to_have_value("dash-reload")
    await expect(page.locator("#chat-log .msg.user")).to_have_text(["hello there"])
    await tab.shot("chat-after-reload")
    assert tab.errors == []


# -- versions, diff, roll back, enable/disable ---------------------------------------------------

async def test_edit_makes_a_version_the_diff_shows_it_and_roll_back_publishes_the_old_one(tab, stack, tenant, api):
    from playwright.async_api import expect

    page = tab.page
    name = "dash_versions"
    status, _ = await api.call("POST", "/v1/tools", order_tool(stack.demo_store.url, name, auth_header="Bearer v1-secret-xyz"))
    assert status == 201
    await tab.sign_in(tenant[1])

    # disable and enable from the list
    row = page.locator(f'#tools-table tr[data-tool="{name}"]')
    await row.get_by_role("button", name="Disable").click()
    await expect(row.locator('[data-field="enabled"]')).to_have_text("disabled")
    assert (await api.call("GET", f"/v1/tools/{name}"))[1]["enabled"] is False
    await tab.shot("disabled")
    await row.get_by_role("button", name="Enable").click()
    await expect(row.locator('[data-field="enabled"]')).to_have_text("enabled")
    version = (await api.call("GET", f"/v1/tools/{name}"))[1]["version"]

    # edit the description: a new published version; the auth header stays set and unseen
    await row.get_by_role("link", name=name).click()
    await expect(page.locator("#auth-state")).to_have_text("set")
    await expect(page.locator("#f-auth_header")).to_have_value("")
    assert "v1-secret-xyz" not in await page.content()
    await page.locator("#f-description").fill("Find where an order is, by its order number.")
    await page.get_by_role("button", name="Save new version").click()
    await expect(page.locator(f'#versions tr[data-version="{version + 1}"]')).to_contain_text("published")
    diff = page.locator("#version-diff")
    await expect(diff.locator(".del")).to_contain_text("Look up an order by its order number.")
    await expect(diff.locator(".add")).to_contain_text("Find where an order is, by its order number.")
    _, tool = await api.call("GET", f"/v1/tools/{name}")
    assert tool["version"] == version + 1 and tool["auth_header_set"] is True
    await tab.shot("new-version-diff")

    # roll back to v1
    await page.get_by_role("button", name="Roll back to v1").click()
    await expect(page.locator('#versions tr[data-version="1"]')).to_contain_text("published")
    _, tool = await api.call("GET", f"/v1/tools/{name}")
    assert tool["version"] == 1 and tool["description"].startswith("Look up an order")
    await expect(page.locator("#f-description")).to_have_value(tool["description"])
    await tab.shot("rolled-back")

    # an edit that changes nothing is refused before it reaches the API
    await page.get_by_role("button", name="Save new version").click()
    await expect(page.locator("#form-error")).to_contain_text("nothing changed")
    assert tab.errors == []


# -- the contract report ------------------------------------------------------------------------

async def test_contract_report_groups_the_findings_by_tool_each_with_its_fix(tab, stack, tenant, api):
    from playwright.async_api import expect

    page = tab.page
    assert (await api.call("POST", "/v1/tools", order_tool(stack.demo_store.url, "dash_off", enabled=False)))[0] == 201
    status, _ = await api.call("PUT", "/v1/bot-config", {"intents": {
        "orders": {"phrases": ["order"], "tools": ["dash_off", "ghost_tool"]}}})
    assert status == 200
    _, report = await api.call("GET", "/v1/tools/contract")
    with_findings = [t for t in report["tools"] if t["findings"]]
    assert {"dash_off", "ghost_tool"} <= {t["name"] for t in with_findings}

    await tab.sign_in(tenant[1])
    await page.get_by_role("link", name="Contract report").click()
    await expect(page.locator("#contract-summary")).to_contain_text(f"{report['findings']} finding")
    for t in with_findings:
        card = page.locator(f'article.finding-card[data-tool="{t["name"]}"]')
        await expect(card.locator("li.finding")).to_have_count(len(t["findings"]))
        for f in t["findings"]:
            item = card.locator(f'li.finding[data-kind="{f["kind"]}"]')
            await expect(item).to_contain_text(f["message"])
            await expect(item.locator(".fix")).to_have_text(f"Fix: {f['fix']}")
    # tools with errors first, then by name
    rank = {"error": 0, "warning": 1}
    first = min(with_findings, key=lambda t: (min(rank[f["severity"]] for f in t["findings"]), t["name"]))
    assert await page.locator("article.finding-card").first.get_attribute("data-tool") == first["name"]
    await tab.shot("contract-report")
    assert tab.errors == []


# -- sessions: variables, breakers, handoff; approvals in the try-it box -------------------------

async def test_session_view_shows_variables_breakers_and_handoff_and_try_it_asks_for_approval(tab, stack, tenant, api, db):
    from playwright.async_api import expect

    page = tab.page
    store = stack.demo_store.url
    for body in (order_tool(store, "flaky_lookup"), order_tool(store, "note_it", completes_variable="noted"),
                 order_tool(store, "change_order", mutability="write", method="GET")):
        assert (await api.call("POST", "/v1/tools", body))[0] == 201
    session = f"state-{secrets.token_hex(3)}"
    failing = "\n".join(f'/call flaky_lookup {{"order_id": "{x}"}}' for x in ("x", "y", "z"))  # the store: 404
    for text in (failing, '/call note_it {"order_id": "7"}'):
        status, reply = await api.call("POST", f"/v1/sessions/{session}/messages", {"text": text})
        assert status == 200, reply
    _, view = await api.call("GET", f"/v1/sessions/{session}")
    assert view["open_breakers"] == ["flaky_lookup"] and view["variables"] == {"noted": "true"}

    await tab.sign_in(tenant[1])
    await tab.go(f"/sessions/{session}")
    await expect(page.locator("#session-variables")).to_contain_text("noted")
    await expect(page.locator("#open-breakers")).to_contain_text("flaky_lookup")
    await expect(page.locator("#handoff-state")).to_have_text("bot handling")
    failed = page.locator('#session-turns tr[data-tool="flaky_lookup"]')
    await expect(failed).to_have_count(3)
    await expect(failed.first).to_contain_text("failed")
    await expect(failed.first).to_contain_text("not found (404)")
    await tab.shot("session-state")

    # a write tool waits for approval in the chat box; approving runs it
    await expect(page.locator("#try-session")).to_have_value(session)
    await page.locator("#try-text").fill('/call change_order {"order_id": "5"}')
    await page.locator("#try-send").click()
    approval = page.locator('#chat-log [data-event="approval_required"]')
    await expect(approval).to_contain_text("Run change order with order_id=5?")
    await tab.shot("approval-asked")
    await approval.get_by_role("button", name="Approve").click()
    await expect(page.locator('#chat-log [data-event="tool_result"][data-tool="change_order"]')).to_contain_text("answered in")
    await expect(approval).to_contain_text("approved")
    await expect(page.locator("#chat-log .msg.bot").last).to_contain_text("Order 5")
    await expect(page.locator('#session-turns tr[data-tool="change_order"]')).to_contain_text('"order_id": "5"')
    # the box follows the session's stream too: once it has read every event written, each of
    # these turns' messages and events shows once
    written = await db.fetchval("SELECT max(seq) FROM ce_session_events e JOIN ce_sessions s ON s.id = e.session_id "
                                "WHERE s.tenant_id = $1 AND s.session_key = $2", tenant[0], session)
    await page.wait_for_function("([key, n]) => JSON.parse(sessionStorage.getItem(key) || '0') >= n",
                                 arg=[f"ce.tryit.seq.{session}", written])
    for said in (page.locator("#chat-log .msg.user").filter(has_text="/call change_order"),
                 page.locator("#chat-log .msg.bot").filter(has_text="Before I go ahead"),
                 page.locator("#chat-log .msg.bot").filter(has_text="Order 5"), approval,
                 page.locator('#chat-log [data-event="tool_result"][data-tool="change_order"]')):
        await expect(said).to_have_count(1)

    # asking for a person hands the session off
    await page.locator("#try-text").fill("/handoff")
    await page.locator("#try-send").click()
    await expect(page.locator('#chat-log [data-event="handoff"]')).to_be_visible()
    await expect(page.locator("#handoff-state")).to_have_text("handed off to a human")
    await page.get_by_role("button", name="Refresh").click()
    await expect(page.locator(f'#sessions-table tr[data-session="{session}"]')).to_contain_text("handed off")
    await tab.shot("handed-off")
    assert tab.errors == []


async def test_daily_buckets_are_labelled_with_their_utc_date_in_a_browser_west_of_utc(browser, stack, tenant, api):
    # a daily bucket is a UTC day; labelled from local time, every label west of UTC showed the
    # day before
    from datetime import UTC, datetime

    from playwright.async_api import expect

    async with open_page(browser, stack.gateway.url, "daily_buckets_utc", timezone_id="America/Los_Angeles") as west:
        await west.sign_in(tenant[1])
        await west.page.evaluate("() => sessionStorage.setItem('ce.analytics.since', JSON.stringify('30d'))")
        await west.go("/analytics")
        await expect(west.page.locator("#chart-calls")).to_be_visible()
        status, ts = await api.call("GET", "/v1/analytics/tools/timeseries?since=30d")
        assert status == 200 and ts["bucket_seconds"] >= 86400
        labels = await west.page.locator('#chart-calls text.axis[text-anchor="middle"]').evaluate_all(
            "els => els.map((e) => e.textContent)")
        step = max(1, -(-len(ts["buckets"]) // 6))
        days = [datetime.fromisoformat(b).astimezone(UTC) for b in ts["buckets"][::step]]
        assert labels == [f"{d.month}/{d.day}" for d in days], (labels, ts["buckets"][:2])
        await expect(west.page.locator("#chart-calls").locator("xpath=..").locator("figcaption")).to_have_text(
            "Calls per day (UTC days)")
        assert west.errors == []


# -- API keys: each with its kind ---------------------------------------------------------------

async def test_the_keys_tab_lists_each_key_with_its_kind_and_never_a_key(tab, stack, tenant, api):
    from playwright.async_api import expect

    tenant_id, admin_key, _ = tenant
    chat = await stack.gateway.deps.tenants.issue_key(tenant_id, "chat")
    page = tab.page
    await tab.sign_in(admin_key)
    await page.get_by_role("link", name="Keys").click()
    await expect(page.locator(f'#keys tr[data-key="{chat.key_id}"] td.kind')).to_have_text("chat")
    await expect(page.locator("#keys tbody tr td.kind", has_text="admin")).to_have_count(1)
    html = await page.content()
    assert chat.api_key not in html and admin_key not in html
    await tab.shot("keys")
    assert tab.errors == []


# -- try it as a verified test contact -----------------------------------------------------------

async def test_try_it_sends_as_a_verified_test_contact_whose_claim_fills_the_trusted_scope(tab, stack, tenant, api):
    from playwright.async_api import expect

    store = stack.demo_store.url
    status, _ = await api.call("PUT", "/v1/bot-config", {"backend": {"base_url": store}, "contact_verification": {
        "algorithms": ["HS256"], "hs256_secret": "s" * 40, "issuer": "https://login.shop.example", "audience": "shop",
        "scope_claims": {"order_id": "order"}}})
    assert status == 200
    # the order number comes from the signed-in customer's claim, never from the model
    status, created = await api.call("POST", "/v1/tools", {
        "name": "my_order", "type": "backend_binding", "description": "The signed-in customer's order.",
        "method": "GET", "path": "/api/orders/{order_id}", "scope": ["order_id"],
        "parameters": {"note": {"type": "string"}}})
    assert status == 201, created
    session = f"verified-{secrets.token_hex(3)}"
    page = tab.page
    await tab.sign_in(tenant[1])
    await tab.go(f"/sessions/{session}")
    await expect(page.locator("#try-contact-state")).to_have_text("anonymous")
    await page.locator(".test-contact summary").click()
    await page.locator("#try-contact").fill("ann")
    await page.locator("#try-claims").fill("not json")
    await page.locator("#try-sign-in").click()
    await expect(page.locator("#err-try-contact")).to_contain_text("not valid JSON")
    await page.locator("#try-claims").fill('{"order": "4242"}')
    await page.locator("#try-sign-in").click()
    await expect(page.locator("#try-contact-state")).to_have_text("as test:ann")
    await page.locator("#try-text").fill('/call my_order {"note": "mine", "order_id": "1"}')
    await page.locator("#try-send").click()
    await expect(page.locator("#chat-log .msg.bot").last).to_contain_text("order_id: 4242")  # what the store was asked
    _, view = await api.call("GET", f"/v1/sessions/{session}")
    assert view["contact"] == {"sub": "test:ann", "verified": True}
    await tab.shot("verified-test-contact")
    # signed out, the session (bound to test:ann) refuses an anonymous message, said next to the box
    await page.locator("#try-sign-out").click()
    await expect(page.locator("#try-contact-state")).to_have_text("anonymous")
    await page.locator("#try-text").fill("hello again")
    await page.locator("#try-send").click()
    await expect(page.locator("#err-try-text")).to_contain_text("Contact-Token")
    assert tab.errors == []
