"""Tool definitions as data: parameter normalisation, tagged-union decoding, approval defaults."""

from __future__ import annotations

import copy

import msgspec
import pytest

from services.tools.model import (
    PROTECTED_KEYS,
    BackendBindingTool,
    ClientTool,
    PythonTool,
    WebhookTool,
    WorkflowTool,
    normalise_parameters,
    tool_decoder,
)
from services.tools.templating import template_holes

SEED_000_CHECK_ORDER = {
    "name": "check_order",
    "description": "Look up a customer order by order number. Use when customer asks about their order status.",
    "parameters": {"order_id": {"type": "string", "description": "The order number"}},
    "webhook_url": "https://mystore.com/api/orders/{order_id}",
    "auth_header": "Bearer sk-...",
    "timeout_ms": 5000,
}


# -- normalise_parameters: seed 000's map form ------------------------------------------------


def test_map_form_property_filling_a_template_hole_is_required() -> None:
    params = SEED_000_CHECK_ORDER["parameters"]
    schema = normalise_parameters(params, required_hint=template_holes(SEED_000_CHECK_ORDER["webhook_url"]))
    assert schema == {
        "type": "object",
        "properties": {"order_id": {"type": "string", "description": "The order number"}},
        "required": ["order_id"],
    }


def test_map_form_without_holes_or_required_flags_has_no_required_list() -> None:
    schema = normalise_parameters({"note": {"type": "string"}})
    assert schema == {"type": "object", "properties": {"note": {"type": "string"}}}


@pytest.mark.parametrize(
    ("flag", "required"),
    [(True, ["email"]), (False, [])],
    ids=["required-true-honoured", "required-false-not-required"],
)
def test_map_form_boolean_required_flag_is_honoured_and_stripped(flag: bool, required: list[str]) -> None:
    schema = normalise_parameters({"email": {"type": "string", "required": flag}})
    # a boolean "required" is not JSON schema: it must not survive into the property
    assert schema["properties"]["email"] == {"type": "string"}
    assert schema.get("required", []) == required


def test_map_form_required_order_follows_parameter_order() -> None:
    schema = normalise_parameters(
        {"a": {"type": "string", "required": True}, "b": {"type": "string"}, "c": {"type": "string"}},
        required_hint=["c"],
    )
    assert schema["required"] == ["a", "c"]


def test_map_form_nested_object_keeps_its_required_list() -> None:
    nested = {
        "type": "object",
        "properties": {"street": {"type": "string"}},
        "required": ["street"],
    }
    schema = normalise_parameters({"address": nested})
    assert schema["properties"]["address"]["required"] == ["street"]
    assert "required" not in schema  # the list is the nested object's rule, not "address required"


def test_map_form_plain_string_becomes_a_described_string_property() -> None:
    schema = normalise_parameters({"city": "The city to search"})
    assert schema["properties"]["city"] == {"type": "string", "description": "The city to search"}


def test_map_form_does_not_mutate_the_input() -> None:
    params = {"email": {"type": "string", "required": True}}
    before = copy.deepcopy(params)
    normalise_parameters(params)
    assert params == before


# -- normalise_parameters: full JSON schema ---------------------------------------------------


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
        {"type": "object", "properties": {}, "additionalProperties": False},
        {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}, "$defs": {}},
    ],
)
def test_full_schema_is_taken_as_is(schema: dict) -> None:
    before = copy.deepcopy(schema)
    assert normalise_parameters(schema, required_hint=["ignored"]) == before
    assert schema == before


def test_bare_object_schema_gains_empty_properties() -> None:
    assert normalise_parameters({"type": "object"}) == {"type": "object", "properties": {}}


@pytest.mark.parametrize(
    ("template", "holes"),
    [
        ("https://mystore.com/api/orders/{order_id}", ["order_id"]),
        ("/shops/{shop}/items/{item_id}?x={q}", ["shop", "item_id", "q"]),
        ("https://example.com/static", []),
        ("/bad/{1abc}/{ok}", ["ok"]),
    ],
)
def test_template_holes_lists_placeholder_names_in_order(template: str, holes: list[str]) -> None:
    assert template_holes(template) == holes


# -- tagged-union decoding --------------------------------------------------------------------

_PARAMS = {"type": "object", "properties": {"q": {"type": "string"}}}


@pytest.mark.parametrize(
    ("payload", "family", "fields"),
    [
        (
            {"type": "webhook", "name": "check_order", "description": "d", "parameters": _PARAMS,
             "webhook_url": "https://mystore.com/api/orders/{order_id}", "timeout_ms": 2500},
            WebhookTool,
            {"webhook_url": "https://mystore.com/api/orders/{order_id}", "method": "GET", "timeout_ms": 2500},
        ),
        (
            # seed 001's catalog-search binding (plus the description and parameters every row has)
            {"name": "example_catalog_search", "type": "backend_binding", "mutability": "read",
             "method": "GET", "path": "/example/catalog",
             "parameter_map": {"search": "q", "limit": "per_page"}, "scope": ["account_id"],
             "description": "d", "parameters": _PARAMS},
            BackendBindingTool,
            {"path": "/example/catalog", "parameter_map": {"search": "q", "limit": "per_page"},
             "scope": ("account_id",), "mutability": "read"},
        ),
        (
            {"type": "python", "name": "collect_lead", "description": "d", "parameters": _PARAMS,
             "handler": "leads.collect", "mutability": "write", "completes_variable": "lead_collected"},
            PythonTool,
            {"handler": "leads.collect", "mutability": "write", "completes_variable": "lead_collected"},
        ),
        (
            {"type": "workflow", "name": "book_visit", "description": "d", "parameters": _PARAMS,
             "handler": "bookings.start", "intents": ["booking"]},
            WorkflowTool,
            {"handler": "bookings.start", "intents": ("booking",)},
        ),
        (
            {"type": "client", "name": "show_map", "description": "d", "parameters": _PARAMS},
            ClientTool,
            {"name": "show_map", "enabled": True},
        ),
    ],
    ids=["webhook", "backend_binding", "python", "workflow", "client"],
)
def test_tool_decoder_decodes_each_family_by_its_type_tag(payload: dict, family: type, fields: dict) -> None:
    tool = tool_decoder.decode(msgspec.json.encode(payload))
    assert type(tool) is family
    for field, value in fields.items():
        assert getattr(tool, field) == value
    # and the tag survives a round trip, so a stored definition decodes to the same family
    assert msgspec.json.decode(msgspec.json.encode(tool))["type"] == payload["type"]


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"type": "sql", "name": "x", "description": "d", "parameters": _PARAMS},
         r"Invalid value 'sql' - at `\$.type`"),
        ({"name": "x", "description": "d", "parameters": _PARAMS},
         r"Object missing required field `type`"),
        ({"type": "python", "name": "x", "description": "d", "parameters": _PARAMS},
         r"Object missing required field `handler`"),
        ({"type": "webhook", "name": "x", "description": "d", "parameters": _PARAMS,
          "webhook_url": "https://x", "method": "TRACE"},
         r"Invalid enum value 'TRACE' - at `\$.method`"),
    ],
    ids=["unknown-type", "missing-type", "python-without-handler", "bad-method"],
)
def test_tool_decoder_rejects_invalid_definitions(payload: dict, message: str) -> None:
    with pytest.raises(msgspec.ValidationError, match=message):
        tool_decoder.decode(msgspec.json.encode(payload))


# -- approval and protected keys --------------------------------------------------------------


@pytest.mark.parametrize(
    ("mutability", "requires_approval", "needs_approval"),
    [
        ("write", None, True),
        ("read", None, False),
        ("write", False, False),
        ("read", True, True),
    ],
    ids=["write-default", "read-default", "write-override-off", "read-override-on"],
)
def test_needs_approval_defaults_to_writes_and_honours_an_explicit_override(
    mutability: str, requires_approval: bool | None, needs_approval: bool
) -> None:
    tool = PythonTool(
        name="t", description="d", parameters=_PARAMS, handler="h",
        mutability=mutability, requires_approval=requires_approval,
    )
    assert tool.needs_approval is needs_approval


def test_protected_keys_are_the_tenant_account_keys_plus_the_definitions_own() -> None:
    tool = PythonTool(name="t", description="d", parameters=_PARAMS, handler="h", protected=("store_id",))
    assert PROTECTED_KEYS == {"tenant_id", "tenantId", "account_id", "accountId"}
    assert tool.protected_keys == PROTECTED_KEYS | {"store_id"}
