"""submit_form on the real Postgres: tenant forms as JSON schemas, validated submission rows, and
in-band errors that name the field and what is wrong with it."""

from __future__ import annotations

import msgspec
import pytest

from services.builtins.forms import check_form
from services.errors import InvalidInput
from services.tools.errors import InvalidArguments, PolicyDenied
from tests.integration.builtins_support import SECRET, ctx, receiver, services

QUOTE = {
    "type": "object",
    "properties": {
        "email": {"type": "string", "format": "email", "description": "where to send the quote"},
        "rooms": {"type": "integer", "minimum": 1, "maximum": 20},
        "service": {"type": "string", "enum": ["cleaning", "painting"]},
        "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["zip"]},
    },
    "required": ["email", "rooms"],
    "additionalProperties": False,
}


async def test_a_valid_submission_is_stored_and_announced(pool, make_tenant):
    tenant, _ = await make_tenant("form")
    async with receiver() as rec, services(pool) as (svc, configs):
        configs.set(tenant.id, notification_webhook=rec.url, notification_secret=SECRET)
        await svc.repos.forms.put(tenant.id, "quote", check_form("quote", QUOTE))
        c = ctx(tenant.id)
        data = {"email": "jane@example.com", "rooms": 3, "service": "painting", "address": {"zip": "10115"}}
        out = await svc.forms.submit({"form": "quote", "data": data}, c)
        assert out["status"] == "submitted" and out["form"] == "quote"
        rows = await svc.repos.forms.submissions(tenant.id, "quote")
        assert [(r.id, r.session_id, r.data) for r in rows] == [(out["submission_id"], c.session_id, data)]
        # a replayed call (same idempotency key) returns the first row
        assert await svc.forms.submit({"form": "quote", "data": data}, c) == out
        assert len(await svc.repos.forms.submissions(tenant.id, "quote")) == 1
        # the contact's memory has it
        recalled = await svc.memory.recall({"query": "painting quote"}, c)
        assert recalled["found"] == 1 and "painting" in recalled["summary"]
        await rec.wait(1)
    event = msgspec.json.decode(rec.requests[0][1])
    assert event["type"] == "form.submitted" and event["data"]["data"] == data


@pytest.mark.parametrize(("data", "message"), [
    ({"rooms": 3}, r"form 'quote' is not valid: 'email' is required"),
    ({"email": "jane@example.com", "rooms": 0}, r"'rooms': 0 is less than the minimum of 1"),
    ({"email": "jane@example.com", "rooms": "three"}, r"'rooms': 'three' is not of type 'integer'"),
    ({"email": "not-an-email", "rooms": 2}, r"'email': 'not-an-email' is not a 'email'"),
    ({"email": "jane@example.com", "rooms": 2, "service": "gardening"}, r"'service': 'gardening' is not one of \['cleaning', 'painting'\]"),
    ({"email": "jane@example.com", "rooms": 2, "address": {"zip": "ABC"}}, r"'address.zip': 'ABC' does not match"),
    ({"email": "jane@example.com", "rooms": 2, "colour": "red"}, r"unknown argument \('colour' was unexpected\)"),
])
async def test_an_invalid_submission_names_the_field_and_stores_nothing(pool, make_tenant, data, message):
    tenant, _ = await make_tenant("form")
    async with services(pool) as (svc, _configs):
        await svc.repos.forms.put(tenant.id, "quote", check_form("quote", QUOTE))
        with pytest.raises(InvalidArguments, match=message) as caught:
            await svc.forms.submit({"form": "quote", "data": data}, ctx(tenant.id))
        assert "Ask the customer" in caught.value.advice
        assert await svc.repos.forms.submissions(tenant.id, "quote") == []


async def test_without_data_the_tool_describes_the_form(pool, make_tenant):
    tenant, _ = await make_tenant("form")
    async with services(pool) as (svc, _configs):
        await svc.repos.forms.put(tenant.id, "quote", check_form("quote", QUOTE))
        out = await svc.forms.submit({"form": "quote"}, ctx(tenant.id))
    assert out["status"].startswith("not submitted")
    assert out["required"] == ["email", "rooms"]
    assert out["fields"]["rooms"] == {"type": "integer", "minimum": 1, "maximum": 20}
    assert out["fields"]["email"]["description"] == "where to send the quote"


async def test_unknown_forms_are_named_and_a_tenant_without_forms_is_told_so(pool, make_tenant):
    bare, _ = await make_tenant("form")
    tenant, _ = await make_tenant("form")
    async with services(pool) as (svc, _configs):
        with pytest.raises(PolicyDenied, match="this business has no forms set up"):
            await svc.forms.submit({"form": "quote", "data": {}}, ctx(bare.id))
        await svc.repos.forms.put(tenant.id, "quote", check_form("quote", QUOTE))
        await svc.repos.forms.put(tenant.id, "feedback", check_form("feedback", {"type": "object"}))
        with pytest.raises(InvalidArguments, match="there is no form named 'qoute'; the forms are: feedback, quote"):
            await svc.forms.submit({"form": "qoute", "data": {}}, ctx(tenant.id))
        # another tenant's form is not visible
        with pytest.raises(PolicyDenied):
            await svc.forms.submit({"form": "quote", "data": {"email": "a@b.co", "rooms": 1}}, ctx(bare.id))


async def test_an_edited_form_validates_with_its_new_schema(pool, make_tenant):
    tenant, _ = await make_tenant("form")
    async with services(pool) as (svc, _configs):
        await svc.repos.forms.put(tenant.id, "quote", check_form("quote", QUOTE))
        with pytest.raises(InvalidArguments):
            await svc.forms.submit({"form": "quote", "data": {"rooms": 2}}, ctx(tenant.id))
        relaxed = {**QUOTE, "required": ["rooms"]}
        await svc.repos.forms.put(tenant.id, "quote", check_form("quote", relaxed))
        out = await svc.forms.submit({"form": "quote", "data": {"rooms": 2}}, ctx(tenant.id))
        assert out["status"] == "submitted"


@pytest.mark.parametrize(("name", "schema", "message"), [
    ("quote", {"type": "array"}, r"must be a JSON-schema object"),
    ("quote", {"type": "object", "properties": {"a": {"type": "nonsense"}}}, r"invalid JSON schema: .* - at `\$.properties.a.type`"),
    ("1bad", {"type": "object"}, r"form name '1bad' must be"),
])
def test_a_broken_form_definition_is_refused_for_the_admin(name, schema, message):
    with pytest.raises(InvalidInput, match=message):
        check_form(name, schema)
