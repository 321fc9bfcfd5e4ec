"""Names and ids from a tenant admin or a contact that look plain but are not: a trailing line
break (`^...$` matched it), a control character in a message id, a forged approval id with a
non-ASCII character. The real gateway app over a session host
(tests/support/gateways.py's documented_gateway) and the real Postgres repositories."""

from __future__ import annotations

import msgspec
import pytest

from services.approvals import approval_keys, verify_approval_id
from tests.support import gateways

gateway = gateways.documented_gateway  # the fixture
KEYS = approval_keys(["k" * 32])


@pytest.mark.parametrize(("method", "path", "body", "field"), [
    ("POST", "/v1/tools", {"name": "lookup\n", "description": "Look things up.", "webhook_url":
                           "https://api.example.com/lookup", "parameters": {"q": {"type": "string"}}}, "$.name"),
    ("PUT", "/v1/forms/quote%0A", {"type": "object", "properties": {"rooms": {"type": "integer"}}}, None),
    ("PUT", "/v1/appointment-services/consult%0A",
     {"duration_minutes": 30, "opening_hours": {"mon": ["09:00", "17:00"]}}, None),
    ("POST", "/v1/mcp-servers", {"name": "docs\n", "url": "https://mcp.example.com/mcp"}, None),
    ("POST", "/v1/sessions/abc%0A/messages", {"text": "hi"}, None),
])
async def test_a_name_or_id_with_a_trailing_line_break_is_refused(gateway, method, path, body, field):
    # before: saved (201/200); a tool or MCP server named so went to the model on every turn, and
    # the model API refuses the whole request: every turn of the tenant answered "cannot reach"
    r = await gateway.client.request(method, path, headers=gateway.headers, json=body)
    assert r.status == 422, (r.status, await r.text())
    if field is not None:
        assert field in (await r.json())["detail"]


async def test_a_message_id_with_a_control_character_is_refused_naming_the_field(gateway):
    # it becomes the Idempotency-Key of the turn's tool calls: before, 200, and every webhook call
    # of the turn failed "idempotency key is invalid", counted against the tool's breaker
    r = await gateway.client.post("/v1/sessions/s1/messages", headers=gateway.headers,
                                  json={"text": "hi", "message_id": "order-7\n"})
    assert r.status == 422
    assert "`$.message_id`" in (await r.json())["detail"]
    await gateway.documented(r, "POST", "/v1/sessions/{session_id}/messages")


def test_a_forged_approval_id_with_a_non_ascii_character_is_simply_not_valid():
    assert verify_approval_id(KEYS, "t1", "s1", "apr_nonce.é") is False


@pytest.mark.parametrize("keys", [(), KEYS])
async def test_a_forged_non_ascii_approval_id_is_404_not_500(gateway, keys):
    tenants = gateway.host._tenants
    tenants.env = msgspec.structs.replace(tenants.env, approval_keys=keys)
    r = await gateway.client.post("/v1/sessions/s1/approvals/apr_nonce.%C3%A9", headers=gateway.headers,
                                  json={"approve": True})
    assert r.status == 404, (r.status, await r.text())
