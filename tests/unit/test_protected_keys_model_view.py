"""Protected keys (seed 001: "Protected tenant/account arguments are removed and authenticated
context is supplied separately") as the model, the tenant admin and the contract report see them:

- the schema offered to the model leaves them out (top level and nested), computed once per
  compiled tool; the executor still validates and fills them from the trusted scope;
- registration refuses a webhook URL hole named by a protected key the trusted scope never holds;
- the contract report says which holes the trusted scope fills and finds the ones it cannot.
"""

from __future__ import annotations

import pytest

from kernel.errors import InvalidInput
from services.botconfig import BotConfig
from services.contract import build_report
from services.gateway.bodies import ToolCreate, definition_from_body
from services.gateway.common import failure
from services.tools.model import PROTECTED_KEYS, WebhookTool
from services.tools.registry import HandlerRegistry, build_catalog
from services.tools.toolset import tool_specs
from tests.support.contract import ACCOUNT_CLAIMS
from tests.support.fakes import (
    FakeHandler,
    FakeToolBackend,
    make_catalog,
    python_tool,
    webhook_tool,
)

ORDER_URL = "https://mystore.example/api/accounts/{account_id}/orders/{order_id}"


def registered(**fields) -> WebhookTool:
    body = {
        "name": "check_order",
        "description": "Look up an order.",
        "parameters": {
            "account_id": {"type": "string", "description": "the account"},
            "order_id": {"type": "string", "description": "The order number"},
        },
        "webhook_url": ORDER_URL,
    }
    body.update(fields)
    return definition_from_body(ToolCreate(**body), encrypt=lambda s: s)


def catalog_of(*tools):
    return build_catalog(
        [], [(t, 1) for t in tools], registry=HandlerRegistry(), backend=FakeToolBackend()
    )


# --------------------------------------------------------------------------- what the model sees


def test_the_model_is_not_shown_a_protected_key_as_an_argument_it_must_supply() -> None:
    # before: input_schema was the definition's parameters, account_id required in it
    d = registered()
    assert d.parameters["required"] == [
        "account_id",
        "order_id",
    ]  # the tenant's schema is unchanged
    [spec] = tool_specs(list(catalog_of(d)))
    assert spec.input_schema == {
        "type": "object",
        "properties": {"order_id": {"type": "string", "description": "The order number"}},
        "required": ["order_id"],
    }
    assert d.parameters["required"] == ["account_id", "order_id"]  # and not mutated by the view


@pytest.mark.parametrize("key", sorted(PROTECTED_KEYS | {"store_id"}))
def test_every_protected_name_is_left_out_at_any_depth(key: str) -> None:
    schema = {
        "type": "object",
        "properties": {
            key: {"type": "string"},
            "q": {"type": "string"},
            "filter": {
                "type": "object",
                "properties": {key: {"type": "string"}, "colour": {"type": "string"}},
                "required": [key, "colour"],
            },
            "lines": {
                "type": "array",
                "items": {"type": "object", "properties": {key: {}, "sku": {}}, "required": [key]},
            },
        },
        "required": [key, "q"],
    }
    tool = python_tool("lookup", parameters=schema, protected=("store_id",))
    [spec] = tool_specs(list(make_catalog(tool, handlers=(FakeHandler("lookup"),))))
    shown = spec.input_schema
    assert list(shown["properties"]) == ["q", "filter", "lines"] and shown["required"] == ["q"]
    assert shown["properties"]["filter"] == {
        "type": "object",
        "properties": {"colour": {"type": "string"}},
        "required": ["colour"],
    }
    assert shown["properties"]["lines"]["items"] == {"type": "object", "properties": {"sku": {}}}


def test_a_property_named_like_a_keyword_is_not_mistaken_for_one() -> None:
    schema = {
        "type": "object",
        "properties": {
            "properties": {"type": "string"},
            "required": {"type": "boolean"},
            "account_id": {"type": "string"},
        },
    }
    [spec] = tool_specs(
        list(make_catalog(python_tool("odd", parameters=schema), handlers=(FakeHandler("odd"),)))
    )
    assert spec.input_schema["properties"] == {
        "properties": {"type": "string"},
        "required": {"type": "boolean"},
    }


def test_the_model_facing_schema_is_computed_once_per_compiled_tool() -> None:
    # the offer is built every turn (README § Performance): the view is made once per compiled
    # tool; a schema without protected keys is offered as it is, not copied
    catalog = make_catalog(webhook_tool("check_order"), backend=FakeToolBackend())
    tool = catalog.get("check_order")
    first, again = tool_specs([tool])[0], tool_specs([tool])[0]
    assert first is again
    assert first.input_schema is tool.definition.parameters

    protected = catalog_of(registered()).get("check_order")
    assert tool_specs([protected])[0] is tool_specs([protected])[0]


async def test_a_required_protected_key_the_model_was_not_shown_is_filled_and_validated() -> None:
    # the executor strips the model's value, fills the trusted one, then validates the tenant's
    # full schema: the required account_id is met by the trusted scope
    from services.tools.context import TrustedContext
    from services.tools.executor import Executor, ToolCall
    from services.tools.toolset import SessionToolState

    schema = {
        "type": "object",
        "properties": {"account_id": {"type": "string"}, "q": {"type": "string"}},
        "required": ["account_id", "q"],
    }
    handler = FakeHandler("orders")
    catalog = make_catalog(python_tool("orders", parameters=schema), handlers=(handler,))
    [spec] = tool_specs(list(catalog))
    assert "account_id" not in spec.input_schema["properties"]
    executor = Executor()
    scope = {"account_id": "tn_A"}
    plan = await executor.prepare(
        [ToolCall(id="c1", name="orders", arguments={"q": "lamp", "account_id": "tn_B"})],
        catalog=catalog,
        config=BotConfig(),
        session=SessionToolState(),
        scope=scope,
    )
    [outcome] = await executor.execute(
        plan, TrustedContext(tenant_id="tn_A", session_id="s", scope=scope)
    )
    assert outcome.success, outcome.content
    assert handler.calls[0][0] == {"q": "lamp", "account_id": "tn_A"}


# --------------------------------------------------------------------------- registration


def test_a_url_hole_the_trusted_scope_fills_is_accepted() -> None:
    for key in sorted(PROTECTED_KEYS):
        d = registered(
            webhook_url=ORDER_URL.replace("{account_id}", "{" + key + "}"),
            parameters={key: {"type": "string"}, "order_id": {"type": "string"}},
        )
        assert d.webhook_url.endswith("/{order_id}")


def test_a_url_hole_no_one_may_fill_is_refused_with_422_naming_the_field_and_the_fix() -> None:
    # before: accepted, and then every call failed telling the model to ask the customer for it
    with pytest.raises(InvalidInput) as info:
        registered(
            webhook_url="https://mystore.example/api/stores/{store_id}/orders/{order_id}",
            parameters={"store_id": {"type": "string"}, "order_id": {"type": "string"}},
            protected=["store_id"],
        )
    message = str(info.value)
    assert info.value.path == "$.protected"
    assert message.startswith("the URL template uses {store_id}, which `protected` lists")
    assert (
        "remove 'store_id' from `protected`" in message
        and "take {store_id} out of webhook_url" in message
    )
    assert message.endswith("- at `$.protected`")
    status, _title, detail, _retry = failure(info.value, "r1", "/v1/tools")
    assert (status, detail) == (422, message)


def binding(**fields):
    body = {"name": "list_orders", "type": "backend_binding", "description": "List an account's orders.",
            "parameters": {"status": {"type": "string"}}, "path": "/accounts/{account_id}/orders",
            "scope": ["account_id"]}
    body.update(fields)
    return definition_from_body(ToolCreate(**body), encrypt=lambda s: s)


def test_a_binding_path_hole_the_scope_fills_or_a_renamed_parameter_fills_is_accepted() -> None:
    assert binding().scope == ("account_id",)
    renamed = binding(path="/search/{q}", scope=[], parameters={"search": {"type": "string"}},
                      parameter_map={"search": "q"})
    assert renamed.path == "/search/{q}"  # before: 422 "parameters has no 'q'" though `search` fills it


@pytest.mark.parametrize(("fields", "path", "says"), [
    # a scope key the trusted context never holds: every call refused with "trusted scope has no store_id"
    ({"scope": ["store_id"], "path": "/orders"}, "$.scope", "scope lists 'store_id', which the engine's trusted context"),
    # a protected hole scope does not fill: the model's value is dropped, nothing fills it
    ({"scope": []}, "$.scope", "add 'account_id' to `scope`"),
    ({"path": "/stores/{store_id}/orders", "parameters": {"store_id": {"type": "string"}}, "protected": ["store_id"]},
     "$.protected", "remove 'store_id' from `protected`"),
])
def test_a_binding_no_call_could_complete_is_refused_naming_the_field_and_the_fix(fields, path, says) -> None:
    # before: accepted, and then every call failed
    with pytest.raises(InvalidInput) as info:
        binding(**fields)
    assert info.value.path == path and says in str(info.value), str(info.value)
    assert failure(info.value, "r1", "/v1/tools")[0] == 422


# --------------------------------------------------------------------------- contract report


def test_the_report_says_the_trusted_scope_fills_a_protected_hole_and_finds_nothing() -> None:
    d = registered()
    report = build_report("t1", [(d, 1)], catalog_of(d), BotConfig(contact_verification=ACCOUNT_CLAIMS))
    [tool] = report.tools
    assert report.ok and tool.findings == []
    pairs = {(f.model_name, f.backend_name, f.source) for f in tool.fields}
    assert pairs == {(None, "account_id", "trusted_scope"), ("order_id", "order_id", "path")}


def test_the_report_finds_a_protected_hole_the_trusted_scope_cannot_fill() -> None:
    # a row stored before registration refused it: before, the report said ok
    d = WebhookTool(
        name="check_order",
        description="d",
        protected=("store_id",),
        webhook_url="https://mystore.example/api/stores/{store_id}/orders/{order_id}",
        parameters={
            "type": "object",
            "properties": {"store_id": {"type": "string"}, "order_id": {"type": "string"}},
        },
    )
    report = build_report("t1", [(d, 1)], catalog_of(d), BotConfig(contact_verification=ACCOUNT_CLAIMS))
    [tool] = report.tools
    assert not report.ok
    [finding] = tool.findings
    assert (finding.kind, finding.severity) == ("missing_required_parameter", "error")
    assert "{store_id}" in finding.message and "every call" in finding.message
    assert "remove 'store_id' from `protected`" in finding.fix
    assert (None, "store_id", "trusted_scope") not in {
        (f.model_name, f.backend_name, f.source) for f in tool.fields
    }


def test_the_report_does_not_claim_a_protected_webhook_field_is_sent_when_it_fills_no_hole() -> (
    None
):
    # the webhook client sends protected keys only into the URL holes they name: before, the
    # report listed account_id as sent from the trusted scope
    d = registered(webhook_url="https://mystore.example/api/orders/{order_id}")
    [tool] = build_report("t1", [(d, 1)], catalog_of(d), BotConfig(contact_verification=ACCOUNT_CLAIMS)).tools
    assert [(f.model_name, f.backend_name, f.source) for f in tool.fields] == [
        ("order_id", "order_id", "path")
    ]
    [finding] = tool.findings
    assert (finding.kind, finding.severity) == ("ignored_argument", "warning")
    assert "'account_id'" in finding.message and "never sent" in finding.message


def test_dependencies_on_a_protected_key_and_definitions_named_like_keywords_are_shown_right() -> None:
    from services.tools.model import model_facing_parameters

    schema = {
        "type": "object",
        "properties": {"order_id": {"type": "string"}, "account_id": {"type": "string"},
                       "note": {"$ref": "#/$defs/properties"}},
        "dependentRequired": {"order_id": ["account_id"], "note": ["order_id", "account_id"], "account_id": ["note"]},
        "dependentSchemas": {"account_id": {"required": ["note"]}, "note": {"required": ["account_id"]}},
        "$defs": {"properties": {"type": "string"}, "required": {"type": "object", "properties": {"tenant_id": {}}}},
    }
    shown = model_facing_parameters(schema, PROTECTED_KEYS)
    # before: the model was told order_id needs account_id, a name it is never shown
    assert shown["dependentRequired"] == {"note": ["order_id"]}
    assert shown["dependentSchemas"] == {"note": {}}
    assert shown["$defs"] == {"properties": {"type": "string"}, "required": {"type": "object", "properties": {}}}
    assert "account_id" in schema["dependentRequired"]["order_id"]  # the tenant's schema is unchanged
