"""PUT /v1/bot-config takes back what GET /v1/bot-config shows: the natural edit is GET, change a
field, PUT. The credentials in it are write-only: the view shows that they are set
(`backend.auth_header_set`, `notification_secret: "[set]"`), and a PUT that leaves them out or
sends the view's placeholders back keeps them; they go only when the PUT says so.
"""

from __future__ import annotations

import base64

from tests.support.gateways import gateway  # noqa: F401  (the fixture)

SECRET = "whsec_" + base64.b64encode(b"k" * 24).decode()
FULL = {
    "persona": "You help with orders.",
    "notification_webhook": "https://hooks.example.com/ce",
    "notification_secret": SECRET,
    "backend": {"base_url": "https://api.example.com/v1", "auth_header": "Bearer sk_live_abc123"},
}


async def view_of(client, headers) -> dict:
    r = await client.get("/v1/bot-config", headers=headers)
    assert r.status == 200
    return await r.json()


async def test_the_view_put_back_with_one_change_is_taken_and_keeps_the_credentials(gateway):  # noqa: F811
    client, _, headers = gateway
    assert (await client.put("/v1/bot-config", headers=headers, json=FULL)).status == 200
    view = await view_of(client, headers)
    assert view["backend"]["auth_header_set"] is True and view["notification_secret"] == "[set]"
    view["persona"] = "You help with orders and returns."
    r = await client.put("/v1/bot-config", headers=headers, json=view)
    assert r.status == 200, await r.text()
    again = await view_of(client, headers)
    assert again["persona"] == "You help with orders and returns."
    assert again["backend"]["auth_header_set"] is True and again["notification_secret"] == "[set]"


async def test_a_put_that_leaves_the_credentials_out_keeps_them(gateway, pool):  # noqa: F811
    client, _, headers = gateway
    assert (await client.put("/v1/bot-config", headers=headers, json=FULL)).status == 200
    r = await client.put("/v1/bot-config", headers=headers, json={
        "persona": "Short.", "notification_webhook": FULL["notification_webhook"],
        "backend": {"base_url": FULL["backend"]["base_url"]},
    })
    assert r.status == 200
    view = await r.json()
    assert view["notification_secret"] == "[set]" and view["backend"]["auth_header_set"] is True
    stored = await pool.fetchval("SELECT count(*) FROM ce_bot_config WHERE config->>'persona' = 'Short.' "
                                 "AND config ? 'notification_secret_enc'")
    assert stored == 1


async def test_a_put_removes_a_credential_only_when_it_says_so(gateway):  # noqa: F811
    client, _, headers = gateway
    assert (await client.put("/v1/bot-config", headers=headers, json=FULL)).status == 200
    view = await view_of(client, headers)
    view["notification_secret"] = None
    view["backend"]["auth_header_set"] = False
    r = await client.put("/v1/bot-config", headers=headers, json=view)
    assert r.status == 200, await r.text()
    again = await view_of(client, headers)
    assert again["notification_secret"] is None and again["backend"]["auth_header_set"] is False


async def test_the_contact_variable_a_view_shows_can_be_set(gateway):  # noqa: F811
    client, _, headers = gateway
    r = await client.put("/v1/bot-config", headers=headers, json={"contact_id_variable": "customer_email"})
    assert r.status == 200 and (await view_of(client, headers))["contact_id_variable"] == "customer_email"
    r = await client.put("/v1/bot-config", headers=headers, json={"contact_id_variable": ""})
    assert r.status == 422 and "`$.contact_id_variable`" in (await r.json())["detail"]


async def test_a_placeholder_with_nothing_stored_behind_it_is_refused(gateway):  # noqa: F811
    client, _, headers = gateway
    r = await client.put("/v1/bot-config", headers=headers, json={"notification_secret": "[set]"})
    assert r.status == 422
    detail = (await r.json())["detail"]
    assert "no notification_secret is stored" in detail and "`$.notification_secret`" in detail
