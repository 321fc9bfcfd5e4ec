"""When a stored credential may stay with a changed URL: only on the origin it was written for.

`same_origin` compares scheme, host and port (case-insensitively, a scheme's default port spelled
out or not, {param} holes and path and query left aside); `check_credential_stays` refuses a move
to another origin with InvalidInput naming the credential's field and both ways forward.
"""

from __future__ import annotations

import pytest
from msgspec import UNSET

from kernel.errors import InvalidInput
from services.gateway.bodies import ToolPatch, check_credential_stays, patched_body, same_origin

BASE = "https://api.shop.example/orders/{order_id}"


@pytest.mark.parametrize(("url", "same"), [
    ("https://api.shop.example/orders/{order_id}", True),
    ("https://api.shop.example/v2/{order_id}?expand={what}", True),
    ("HTTPS://API.SHOP.EXAMPLE/orders/{order_id}", True),
    ("https://api.shop.example:443/orders/{order_id}", True),
    ("https://api.shop.example:8443/orders/{order_id}", False),
    ("http://api.shop.example/orders/{order_id}", False),
    ("https://evil.api.shop.example/orders/{order_id}", False),
    ("https://api.shop.example.evil.example/orders/{order_id}", False),
    ("https://api.shop.example./orders/{order_id}", False),  # another name for DNS; kept apart
    ("https://collector.attacker.example/orders/{order_id}", False),
    ("not a url", False),
])
def test_same_origin_compares_scheme_host_and_port_only(url, same):
    assert same_origin(BASE, url) is same
    assert same_origin(url, BASE) is same


def test_http_default_port_and_ip_literals_normalise():
    assert same_origin("http://shop.example:80/a", "http://shop.example/b")
    assert same_origin("https://[::1]:8443/a", "https://[0:0::1]:8443/b")
    assert not same_origin("https://[::1]:8443/a", "https://[::2]:8443/a")


def test_a_move_to_another_origin_is_refused_naming_the_field_and_what_to_send():
    with pytest.raises(InvalidInput, match=r"send auth_header again for the new host, or auth_header: null .* - at `\$\.auth_header`") as info:
        check_credential_stays(BASE, "https://collector.attacker.example/x", url_field="webhook_url",
                               credential_field="auth_header", without="auth_header: null")
    assert info.value.path == "$.auth_header"
    assert "https://collector.attacker.example" in str(info.value) and "https://api.shop.example" in str(info.value)
    check_credential_stays(BASE, "https://api.shop.example/other", url_field="webhook_url",
                           credential_field="auth_header", without="auth_header: null")


CURRENT = {"type": "webhook", "name": "order_status", "description": "Look up an order.", "webhook_url": BASE,
           "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]},
           "auth_header_enc": "v1:ciphertext"}


def test_patched_body_refuses_to_keep_the_header_for_another_origin():
    with pytest.raises(InvalidInput, match=r"at `\$\.auth_header`"):
        patched_body(CURRENT, ToolPatch(webhook_url="https://collector.attacker.example/{order_id}"))


@pytest.mark.parametrize(("patch", "kept"), [
    (ToolPatch(webhook_url="https://api.shop.example/v2/{order_id}"), "v1:ciphertext"),
    (ToolPatch(description="Find an order."), "v1:ciphertext"),
    (ToolPatch(webhook_url="https://collector.example/{order_id}", auth_header="Bearer new"), None),
    (ToolPatch(webhook_url="https://collector.example/{order_id}", auth_header=None), None),
])
def test_patched_body_keeps_the_header_on_its_origin_and_drops_it_when_replaced(patch, kept):
    merged, kept_auth = patched_body(CURRENT, patch)
    assert kept_auth == kept
    assert merged.webhook_url == (BASE if patch.webhook_url is UNSET else patch.webhook_url)
