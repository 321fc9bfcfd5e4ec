"""`url_secrets` beyond the query: a credential written into a URL's userinfo or as one of its
path segments (Slack/Discord-style webhook URLs, `/api/<40-hex token>/...`, hosted MCP servers'
`/s/<key>/mcp`) is found like a query key, in every form a body may quote it; an ordinary
segment (`orders`, `v1`, a Slack `T000` id) or a `{hole}` is not."""

from __future__ import annotations

import pytest

from services.tools.redaction import scrub_bytes, secret_forms, url_secrets

SLACK_TOKEN = "Ab3dEf6hIj9kLm2nOp5qRs8t"  # 24 letters and digits, as Slack's are
HEX_TOKEN = "0123456789abcdef0123456789abcdef01234567"
GITHUB_TOKEN = "ghp_16C7e42F292c6912E7710c838347Ae178B4a"


@pytest.mark.parametrize(("url", "secrets"), [
    # userinfo: the password always, the user when it looks like a token
    ("https://user:s3cretpass@shop.example/orders/{order_id}", {"s3cretpass"}),
    ("https://user:p%40ss-w0rd-long@shop.example/o", {"p%40ss-w0rd-long", "p@ss-w0rd-long"}),
    (f"https://{GITHUB_TOKEN}@git.example/repo", {GITHUB_TOKEN}),
    (f"https://{GITHUB_TOKEN}:x-oauth-basic@git.example/repo", {GITHUB_TOKEN, "x-oauth-basic"}),
    # path segments that look random, as written and decoded
    (f"https://hooks.example/services/T0001ABCD/B0002EFGH/{SLACK_TOKEN}", {SLACK_TOKEN}),
    (f"https://api.example/api/{HEX_TOKEN}/orders/{{order_id}}", {HEX_TOKEN}),
    ("https://mcp.example/s/sk%2Fl1v3-0123456789/mcp", {"sk%2Fl1v3-0123456789", "sk/l1v3-0123456789"}),
    # all three parts at once
    (f"https://u:pw-0123456789@hooks.example/h/{SLACK_TOKEN}?api_key=sk_live_123&q={{q}}",
     {"pw-0123456789", SLACK_TOKEN, "sk_live_123"}),
])
def test_a_urls_userinfo_and_random_looking_path_segments_are_credentials(url, secrets):
    # before, only the query was read: none of these was found but the api_key
    found = set(url_secrets(url))
    assert found >= secrets, found
    assert not found & {"user", "shop.example", "orders", "services", "T0001ABCD", "B0002EFGH", "api", "mcp", "s"}


@pytest.mark.parametrize("url", [
    "https://api.example/v1/orders/{order_id}",
    "https://api.example/api/2024-10-21/orders/{order_id}/items",
    "https://api.example/orders/prefix-{order_id}-0123456789abcdef",  # a hole makes it the call's
    "https://{user}:{password}@api.example/o",  # holes in userinfo (the guard refuses them anyway)
    "https://hooks.example/services/T000/B000/XXXXXXXXXXXXXXXXXXXXXXXX",  # no digit: not random-looking
    "https://user@api.example/o",  # a plain user, no password
    "http://[::1/oops",  # no url at all: nothing, and no error
])
def test_ordinary_segments_holes_and_plain_users_are_not_credentials(url):
    assert url_secrets(url) == []


def test_a_body_quoting_the_url_or_the_secret_alone_keeps_only_the_ordinary_parts():
    url = f"https://user:s3cretpass@hooks.example/services/T0001ABCD/B0002EFGH/{SLACK_TOKEN}"
    forms = secret_forms(url_secrets(url))
    body = (f'{{"called": "https:\\/\\/user:s3cretpass@hooks.example\\/services\\/T0001ABCD\\/B0002EFGH\\/'
            f'{SLACK_TOKEN}", "token": "{SLACK_TOKEN}", "password": "s3cretpass"}}').encode()
    scrubbed = scrub_bytes(body, forms).decode()
    assert SLACK_TOKEN not in scrubbed and "s3cretpass" not in scrubbed, scrubbed
    assert "T0001ABCD" in scrubbed and "services" in scrubbed and "user:[redacted]@" in scrubbed
    assert '"token": "[redacted]"' in scrubbed
