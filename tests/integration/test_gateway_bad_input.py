"""Inputs the gateway once accepted and then failed on (a 500, or a 4xx that named the wrong
thing), sent over HTTP to a real aiohttp server with the real Postgres repositories; only the
SessionRouter port is a fake.

Each is refused where it comes in, as problem+json naming the field and what to send instead:
an approval TTL or a notification secret no turn or notification could use, a `limit` or a
version that is not a plain whole number (or is one out of range), a timeseries reaching back
before any chart could show, a body whose Content-Encoding does not decode, a tool whose
`completes_variable` Postgres could not store.
"""

from __future__ import annotations

import base64
import gzip
import zlib
from datetime import UTC, datetime, timedelta

import pytest

from actors.host import TurnNotSaved
from actors.placement import _host_exception
from actors.ray_host import to_host_error
from services.gateway.bodies import MAX_VARIABLE_NAME
from services.nesting import MAX_JSON_DEPTH
from tests.support import gateways
from tests.support.gateways import problem_of

gateway = gateways.gateway  # the fixture

TTL_MAX = 30 * 86400


# -- bot config -------------------------------------------------------------------------------

@pytest.mark.parametrize("ttl", [1e308, 1e12, TTL_MAX + 1, -100, 0, 0.5])
async def test_an_approval_ttl_outside_one_second_to_30_days_is_refused_at_put(gateway, ttl):
    client, _, headers = gateway
    r = await client.put("/v1/bot-config", headers=headers, json={"approval_ttl_s": ttl})
    detail = await problem_of(r, 422)
    assert "approval_ttl_s must be a number of seconds from 1 to 2592000 (30 days)" in detail
    assert "`$.approval_ttl_s`" in detail
    stored = await (await client.get("/v1/bot-config", headers=headers)).json()
    assert stored["approval_ttl_s"] is None  # nothing was stored


@pytest.mark.parametrize("ttl", [1, 900, 2.5, TTL_MAX])
async def test_an_approval_ttl_in_range_is_stored(gateway, ttl):
    client, _, headers = gateway
    r = await client.put("/v1/bot-config", headers=headers, json={"approval_ttl_s": ttl})
    assert r.status == 200 and (await r.json())["approval_ttl_s"] == ttl


@pytest.mark.parametrize("secret", ["not base64!!", "whsec_", "whsec_!!!!", "whsec_abc"])
async def test_a_notification_secret_that_is_not_a_standard_webhooks_secret_is_refused_at_put(gateway, secret):
    client, _, headers = gateway
    r = await client.put("/v1/bot-config", headers=headers, json={"notification_secret": secret})
    detail = await problem_of(r, 422)
    assert "notification_secret must be whsec_ followed by base64" in detail and "`$.notification_secret`" in detail
    assert secret == "whsec_" or secret not in detail  # a secret, even a bad one, is never echoed


async def test_a_standard_webhooks_secret_is_stored_and_never_shown(gateway, pool):
    client, _, headers = gateway
    secret = "whsec_" + base64.b64encode(b"k" * 24).decode()
    r = await client.put("/v1/bot-config", headers=headers, json={"notification_secret": secret})
    assert r.status == 200 and (await r.json())["notification_secret"] == "[set]"
    view = await (await client.get("/v1/bot-config", headers=headers)).json()
    assert view["notification_secret"] == "[set]" and "notification_secret_enc" not in view
    # encrypted at rest, like every other credential a tenant stores: a dump of the database
    # must not let anyone sign notifications the tenant would trust
    plain = await pool.fetchval("SELECT count(*) FROM ce_bot_config WHERE strpos(config::text, $1) > 0", secret[6:])
    assert plain == 0
    assert await pool.fetchval("SELECT count(*) FROM ce_bot_config WHERE config ? 'notification_secret_enc'") >= 1


# -- whole numbers in query strings and paths ---------------------------------------------------

LIMIT_ROUTES = [
    ("/v1/sessions", 500), ("/v1/sessions/s-1/calls", 500),
    ("/v1/forms/contact/submissions", 1000), ("/v1/leads", 1000), ("/v1/handoffs", 1000),
    ("/v1/notifications", 1000), ("/v1/appointments", 1000),
]


@pytest.mark.parametrize(("path", "high"), LIMIT_ROUTES, ids=[p for p, _ in LIMIT_ROUTES])
@pytest.mark.parametrize("raw", ["%C2%B2", "%D9%A3", "0", "-1", "99999999999999999999999", "1e3"])
async def test_a_limit_that_is_not_a_whole_number_in_range_is_422_naming_it(gateway, path, high, raw):
    client, _, headers = gateway
    r = await client.get(f"{path}?limit={raw}", headers=headers)
    detail = await problem_of(r, 422)
    assert f"limit must be a whole number from 1 to {high}" in detail and "`?limit`" in detail


@pytest.mark.parametrize(("path", "status"), [("/v1/sessions", 200), ("/v1/leads", 200),
                                              ("/v1/sessions/s-1/calls", 404)])
async def test_a_limit_in_range_is_taken(gateway, path, status):
    client, _, headers = gateway
    r = await client.get(f"{path}?limit=5", headers=headers)
    assert r.status == status, await r.text()


async def created_tool(client, headers) -> str:
    r = await client.post("/v1/tools", headers=headers, json={
        "name": "lookup", "description": "look something up", "type": "python", "handler": "h",
    })
    assert r.status == 201, await r.text()
    return "lookup"


@pytest.mark.parametrize("raw", ["%C2%B2", "-1", "v1", "1.0"])
async def test_a_version_that_is_not_a_whole_number_is_422(gateway, raw):
    client, _, headers = gateway
    name = await created_tool(client, headers)
    r = await client.post(f"/v1/tools/{name}/versions/{raw}/publish", headers=headers)
    detail = await problem_of(r, 422)
    assert "version must be a whole number" in detail


@pytest.mark.parametrize("raw", ["0", "2", "2147483648", "99999999999999", "9" * 400])
async def test_a_version_out_of_range_is_404_no_such_version(gateway, raw):
    client, _, headers = gateway
    name = await created_tool(client, headers)
    r = await client.post(f"/v1/tools/{name}/versions/{raw}/publish", headers=headers)
    detail = await problem_of(r, 404)
    assert f"tool {name!r} has no version" in detail and f"GET /v1/tools/{name}/versions" in detail


async def test_an_existing_version_is_published(gateway):
    client, _, headers = gateway
    name = await created_tool(client, headers)
    r = await client.post(f"/v1/tools/{name}/versions/1/publish", headers=headers)
    assert r.status == 200 and (await r.json())["version"] == 1


# -- the timeseries' reach ------------------------------------------------------------------------

@pytest.mark.parametrize("since", ["0001-01-01T00:00:00Z", "1900-01-01", "99999d"])
async def test_a_timeseries_since_before_any_chart_is_clamped_to_the_longest_chart(gateway, since):
    client, _, headers = gateway
    r = await client.get(f"/v1/analytics/tools/timeseries?since={since}&bucket=auto", headers=headers)
    body = await r.json()
    assert r.status == 200, body
    floor = datetime.now(UTC) - timedelta(weeks=1000)
    assert abs(datetime.fromisoformat(body["since"]) - floor) < timedelta(minutes=1)
    assert body["bucket_seconds"] == 7 * 86400 and len(body["buckets"]) <= 1001


async def test_a_timeseries_since_within_reach_is_kept(gateway):
    client, _, headers = gateway
    r = await client.get("/v1/analytics/tools/timeseries?since=2020-01-01T00:00:00Z", headers=headers)
    body = await r.json()
    assert r.status == 200 and body["since"] == "2020-01-01T00:00:00+00:00"


@pytest.mark.parametrize(("bucket", "says"), [
    ("1d", "makes more than 1000 buckets"),
    ("99999999999999999999d", "bucket must be a width"),
    ("9" * 5000 + "m", "bucket must be a width"),
    ("367d", "bucket must be a width"),
])
async def test_a_timeseries_bucket_that_cannot_chart_the_range_is_422(gateway, bucket, says):
    client, _, headers = gateway
    r = await client.get(f"/v1/analytics/tools/timeseries?since=0001-01-01T00:00:00Z&bucket={bucket}",
                         headers=headers)
    assert says in await problem_of(r, 422)


# -- bodies whose Content-Encoding does not decode -----------------------------------------------

@pytest.mark.parametrize(("encoding", "data"), [
    ("deflate", b"not deflate at all"),
    ("gzip", b"\x1f\x8b\x08\x00garbage"),
    ("gzip", b"not gzip at all"),
])
async def test_a_body_whose_content_encoding_does_not_decode_is_400(gateway, encoding, data):
    client, router, headers = gateway
    r = await client.post("/v1/sessions/s1/messages", data=data,
                          headers={**headers, "Content-Type": "application/json", "Content-Encoding": encoding})
    detail = await problem_of(r, 400)
    assert f"the body could not be decoded (Content-Encoding: {encoding})" in detail
    assert router.texts == []


async def test_a_deflate_body_cut_short_is_refused_by_the_http_parser_with_400(gateway):
    # aiohttp's parser finds it as the body ends, before any handler (as with oversized headers):
    # its own plain-text 400, which the gateway's middleware never sees
    client, router, headers = gateway
    r = await client.post("/v1/sessions/s1/messages", data=zlib.compress(b'{"text": "hi"}')[:-6],
                          headers={**headers, "Content-Type": "application/json", "Content-Encoding": "deflate"})
    assert r.status == 400 and router.texts == []


@pytest.mark.parametrize(("encoding", "compress"), [("gzip", gzip.compress), ("deflate", zlib.compress)])
async def test_a_body_whose_content_encoding_decodes_is_read(gateway, encoding, compress):
    client, router, headers = gateway
    r = await client.post("/v1/sessions/s1/messages", data=compress(b'{"text": "hi"}'),
                          headers={**headers, "Content-Type": "application/json", "Content-Encoding": encoding})
    assert r.status == 200 and router.texts == ["hi"]


async def test_an_empty_body_is_still_called_empty(gateway):
    client, _, headers = gateway
    r = await client.post("/v1/sessions/s1/messages", data=b"", headers={**headers, "Content-Type": "application/json"})
    assert "the body is empty" in await problem_of(r, 422)


# -- a tool's session variable, and a turn that could not be saved -------------------------------

async def test_a_tool_whose_completes_variable_could_not_be_stored_is_refused_at_registration(gateway):
    client, _, headers = gateway
    body = {"name": "big", "description": "d", "type": "python", "handler": "h", "completes_variable": "x" * 8192}
    detail = await problem_of(await client.post("/v1/tools", headers=headers, json=body), 422)
    assert f"completes_variable must be 1-{MAX_VARIABLE_NAME} characters, got 8192" in detail
    name = await created_tool(client, headers)
    r = await client.patch(f"/v1/tools/{name}", headers=headers, json={"completes_variable": "x" * 8192})
    assert "completes_variable must be" in await problem_of(r, 422)


async def test_a_turn_not_saved_through_ray_is_400_like_in_process(gateway):
    client, router, headers = gateway
    exc = TurnNotSaved("the last turn of session 's1' could not be saved and was not acknowledged; "
                       "send the message again (the session continues from its saved state)")
    answers = []
    for raised in (exc, _host_exception(to_host_error(exc))):
        router.raises = raised
        r = await client.post("/v1/sessions/s1/messages", headers=headers, json={"text": "hi"})
        answers.append(await problem_of(r, 400))
    assert answers == [str(exc), str(exc)]


# -- a body nested too deeply ---------------------------------------------------------------------

def tool_with_parameters_nested(levels: int) -> bytes:
    deep = b'{"a":' * levels + b"1" + b"}" * levels
    return (b'{"name": "deep", "description": "d", "webhook_url": "https://example.test/x", "parameters": {"x": '
            + deep + b"}}")


@pytest.mark.parametrize("levels", [MAX_JSON_DEPTH, 5000])
async def test_a_body_nested_past_the_limit_is_422_saying_so_on_every_python(gateway, levels):
    # counted before decoding: Python 3.11's decoder gave up near 1,000 levels (RecursionError),
    # 3.13's does not, so a depth between them was refused on one and accepted on the other
    client, _, headers = gateway
    r = await client.post("/v1/tools", data=tool_with_parameters_nested(levels),
                          headers={**headers, "Content-Type": "application/json"})
    detail = await problem_of(r, 422)
    assert f"the body nests arrays or objects too deeply (more than {MAX_JSON_DEPTH} levels)" in detail


async def test_a_body_within_the_limit_is_decoded_and_its_schema_judged(gateway):
    client, _, headers = gateway
    r = await client.post("/v1/tools", data=tool_with_parameters_nested(MAX_JSON_DEPTH - 3),
                          headers={**headers, "Content-Type": "application/json"})
    detail = await problem_of(r, 422)
    assert "the schema nests too deeply" in detail and "arrays or objects" not in detail
