"""Protected names judged alike everywhere: the contract report, registration and the executor
treat `AccountId`, `account-id` or `TENANT_ID` as the executor strips them (any spelling:
services.tools.model.is_protected), and the trusted scope fills the exact spellings only
(`held_spellings`), as for URL holes and a binding's `scope`.

- the contract report: a parameter in another spelling is neither a model argument nor a trusted
  field, and is found (an error when required); a binding's rename onto one is not "sent";
- registration (services.gateway.bodies): such a parameter, path hole or `scope` key is refused
  with 422 naming it and the spellings that are filled;
- the executor: a required protected parameter nothing fills (a row stored before, an MCP tool)
  fails in-band as the business's misconfiguration, not as a detail to ask the customer for.
"""

from __future__ import annotations

from typing import Any

import pytest

from kernel.errors import InvalidInput
from services.botconfig import Backend, BotConfig
from services.contract import build_report
from services.gateway.bodies import ToolCreate, definition_from_body
from services.gateway.common import failure
from services.tools.executor import Executor, ToolCall
from services.tools.model import (
    PROTECTED_KEYS,
    BackendBindingTool,
    PythonTool,
    WebhookTool,
    held_spellings,
    unheld_spellings,
)
from services.tools.registry import HandlerRegistry, build_catalog
from services.tools.toolset import SessionToolState
from tests.support.contract import ACCOUNT_CLAIMS
from tests.support.fakes import FakeHandler, FakeToolBackend, make_catalog, python_tool

#: another spelling of a tenant/account key, and the spellings the trusted scope holds it under
SPELLINGS = [
    ("AccountId", "'account_id' or 'accountId'"),
    ("account-id", "'account_id' or 'accountId'"),
    ("Account_ID", "'account_id' or 'accountId'"),
    ("TENANT_ID", "'tenant_id' or 'tenantId'"),
]
SCOPE = {"tenant_id": "tn_A", "tenantId": "tn_A", "account_id": "tn_A", "accountId": "tn_A"}


def report_of(*tools, openapi: dict | None = None):
    published = [(t, 1) for t in tools]
    catalog = build_catalog([], published, registry=HandlerRegistry(), backend=FakeToolBackend())
    config = BotConfig(backend=Backend(base_url="http://127.0.0.2:1", openapi=openapi)) if openapi else BotConfig(contact_verification=ACCOUNT_CLAIMS)
    return build_report("t1", published, catalog, config)


def fields_of(tool) -> set[tuple[str | None, str | None, str]]:
    return {(f.model_name, f.backend_name, f.source) for f in tool.fields}


def handler_tool(name: str, schema: dict[str, Any]) -> PythonTool:
    return PythonTool(name=name, description="d", parameters=schema, handler=name)


# --------------------------------------------------------------------------- the model's rules


def test_held_spellings_name_what_the_trusted_scope_fills_and_nothing_else() -> None:
    assert held_spellings("AccountId") == held_spellings("account-id") == ("accountId", "account_id")
    assert held_spellings("TENANT_ID") == ("tenantId", "tenant_id")
    assert held_spellings("account_ids") == held_spellings("store_id") == ()
    assert unheld_spellings([*PROTECTED_KEYS, "account_ids", "accountName", "AccountId", "AccountId"]) == ["AccountId"]


# --------------------------------------------------------------------------- the contract report


@pytest.mark.parametrize(("spelling", "held"), SPELLINGS)
def test_the_report_finds_a_required_parameter_in_another_spelling_that_nothing_fills(spelling, held) -> None:
    # before: reported as an ordinary model argument (model_name=spelling, source "model") and the
    # report said ok, while the executor hid it from the model, stripped it, and no call could pass
    schema = {"type": "object", "properties": {spelling: {"type": "string"}, "q": {"type": "string"}},
              "required": [spelling, "q"]}
    report = report_of(handler_tool("lookup", schema))
    [tool] = report.tools
    assert fields_of(tool) == {("q", "q", "model")}
    [finding] = [f for f in tool.findings if f.kind != "handler_not_loaded"]
    assert (finding.kind, finding.severity) == ("missing_required_parameter", "error")
    assert f"parameters requires '{spelling}', another spelling of a protected key" in finding.message
    assert held in finding.message and "every call fails" in finding.message
    assert f"rename it to {held}" in finding.fix


def test_the_report_warns_of_an_optional_parameter_in_another_spelling_it_never_fills() -> None:
    schema = {"type": "object", "properties": {"TenantId": {"type": "string"}, "q": {"type": "string"}}}
    catalog = make_catalog(handler_tool("lookup", schema))
    report = build_report("t1", [(catalog.get("lookup").definition, 1)], catalog, BotConfig(contact_verification=ACCOUNT_CLAIMS))
    [tool] = report.tools
    assert fields_of(tool) == {("q", "q", "model")}
    [finding] = tool.findings
    assert (finding.kind, finding.severity) == ("ignored_argument", "warning")
    assert "'TenantId'" in finding.message and "never has a value" in finding.message
    assert report.ok  # a warning: calls still run


def test_the_report_still_shows_the_exact_spellings_as_filled_from_the_trusted_scope() -> None:
    schema = {"type": "object", "properties": {k: {"type": "string"} for k in PROTECTED_KEYS}, "required": ["account_id"]}
    catalog = make_catalog(handler_tool("lookup", schema))
    report = build_report("t1", [(catalog.get("lookup").definition, 1)], catalog, BotConfig(contact_verification=ACCOUNT_CLAIMS))
    [tool] = report.tools
    assert report.ok and tool.findings == []
    assert fields_of(tool) == {(None, k, "trusted_scope") for k in PROTECTED_KEYS}


def test_the_report_does_not_call_a_webhook_parameter_in_another_spelling_a_model_argument() -> None:
    # before: `Account-ID` (no hole) was listed as a model argument and nothing was found; the
    # webhook client drops it, in any spelling, and the model is not offered it
    tool = WebhookTool(name="notes", description="d", webhook_url="https://shop.example/notes",
                       parameters={"type": "object", "properties": {"Account-ID": {}, "note": {}}})
    [entry] = report_of(tool).tools
    assert fields_of(entry) == {("note", "note", "model")}
    assert [(f.kind, f.severity) for f in entry.findings] == [("ignored_argument", "warning")]
    assert "'Account-ID'" in entry.findings[0].message


def test_the_report_treats_a_tools_own_protected_name_in_another_spelling_as_protected() -> None:
    tool = WebhookTool(name="notes", description="d", webhook_url="https://shop.example/notes", protected=("store_id",),
                       parameters={"type": "object", "properties": {"StoreId": {}, "note": {}}})
    [entry] = report_of(tool).tools
    assert fields_of(entry) == {("note", "note", "model")}
    [finding] = entry.findings
    assert finding.kind == "ignored_argument" and "'StoreId', which is protected" in finding.message


def test_the_reports_fix_for_a_hole_in_another_spelling_is_to_respell_it() -> None:
    # before: "remove 'AccountId' from `protected`", which does not list it
    tool = WebhookTool(name="acct", description="d", webhook_url="https://shop.example/accounts/{AccountId}",
                       parameters={"type": "object", "properties": {"q": {}}})
    [entry] = report_of(tool).tools
    [finding] = entry.findings
    assert (finding.kind, finding.severity) == ("missing_required_parameter", "error")
    assert "{AccountId}, another spelling of a protected key" in finding.message
    assert "write the hole as {account_id} or {accountId}" in finding.fix and "`protected`" not in finding.fix


def test_a_binding_renaming_a_parameter_onto_another_spelling_is_not_reported_as_sending_it() -> None:
    # binding_arguments drops a rename onto a protected name in any spelling: before, the report
    # said `acct` was sent as `Account_ID` and the backend's required parameter was met
    openapi = {"paths": {"/orders": {"get": {"parameters": [
        {"name": "q", "in": "query"}, {"name": "Account_ID", "in": "query", "required": True}]}}}}
    tool = BackendBindingTool(name="orders", description="d", path="/orders",
                              parameters={"type": "object", "properties": {"acct": {}, "q": {}}},
                              parameter_map={"acct": "Account_ID"})
    [entry] = report_of(tool, openapi=openapi).tools
    assert fields_of(entry) == {("q", "q", "model")}
    [finding] = entry.findings
    assert finding.kind == "missing_required_parameter" and "requires 'Account_ID'" in finding.message


# --------------------------------------------------------------------------- registration


def tool_body(**fields) -> ToolCreate:
    body: dict[str, Any] = {"name": "lookup", "description": "Look something up.", "type": "client",
                            "parameters": {"q": {"type": "string"}}}
    body.update(fields)
    return ToolCreate(**body)


def refused(body: ToolCreate) -> InvalidInput:
    with pytest.raises(InvalidInput) as info:
        definition_from_body(body, encrypt=lambda s: s)
    assert failure(info.value, "r1", "/v1/tools")[0] == 422
    return info.value


@pytest.mark.parametrize(("spelling", "held"), SPELLINGS)
@pytest.mark.parametrize("family", [
    {"type": "client"},
    {"type": "python", "handler": "lookup"},
    {"type": "webhook", "webhook_url": "https://shop.example/lookup"},
    {"type": "backend_binding", "path": "/lookup"},
])
def test_a_parameter_in_another_spelling_of_a_tenant_key_is_refused_naming_it_and_the_filled_spellings(
    family, spelling, held,
) -> None:
    # before: accepted; the model was not offered it, its value was stripped and nothing filled it
    error = refused(tool_body(parameters={spelling: {"type": "string"}, "q": {"type": "string"}}, **family))
    message = str(error)
    assert error.path == "$.parameters"
    assert message.startswith(f"parameters declares '{spelling}', another spelling of a protected key")
    assert f"rename it to {held}" in message and message.endswith("- at `$.parameters`")


@pytest.mark.parametrize("name", [*sorted(PROTECTED_KEYS), "account_ids", "accountName", "tenant"])
def test_the_exact_spellings_and_names_that_only_resemble_them_are_accepted(name) -> None:
    d = definition_from_body(tool_body(parameters={name: {"type": "string"}}), encrypt=lambda s: s)
    assert name in d.parameters["properties"]


def binding_body(**fields) -> ToolCreate:
    body: dict[str, Any] = {"name": "list_orders", "type": "backend_binding", "description": "List orders.",
                            "parameters": {"status": {"type": "string"}}, "path": "/accounts/{account_id}/orders",
                            "scope": ["account_id"]}
    body.update(fields)
    return ToolCreate(**body)


def test_a_binding_path_hole_in_another_spelling_is_refused_at_the_path() -> None:
    # before: accepted (the rename "filled" it), and every call went out without it: the model's
    # `acct` is dropped as a protected name and `scope` cannot list `AccountId`
    error = refused(binding_body(path="/accounts/{AccountId}/orders", scope=[],
                                 parameters={"acct": {"type": "string"}}, parameter_map={"acct": "AccountId"}))
    assert error.path == "$.path"
    assert "the path uses {AccountId}, another spelling of a protected key" in str(error)
    assert "write the hole as {account_id} or {accountId} and list that key in `scope`" in str(error)


def test_a_binding_path_hole_spelling_the_tools_own_protected_name_is_refused() -> None:
    # before: accepted (only `store_id` itself was compared), and the model's value was dropped
    error = refused(binding_body(path="/stores/{StoreId}/orders", scope=[], protected=["store_id"],
                                 parameters={"StoreId": {"type": "string"}}))
    assert error.path == "$.protected"
    assert "the path uses {StoreId}, which `protected` lists as 'store_id'" in str(error)
    assert "remove 'store_id' from `protected`" in str(error)


def test_a_scope_key_in_another_spelling_is_refused_naming_the_spellings_held() -> None:
    error = refused(binding_body(path="/orders", scope=["AccountId"]))
    assert error.path == "$.scope"
    assert "scope lists 'AccountId', another spelling of a protected key" in str(error)
    assert "list 'account_id' or 'accountId' in `scope`" in str(error)


def test_a_webhook_hole_in_another_spelling_is_refused_at_the_url_not_blamed_on_protected() -> None:
    # before: 422 at `$.protected` telling the tenant to remove 'AccountId' from a list without it
    error = refused(tool_body(type="webhook", webhook_url="https://shop.example/accounts/{AccountId}",
                              parameters={"AccountId": {"type": "string"}}))
    assert error.path == "$.webhook_url"
    assert "the URL template uses {AccountId}, another spelling of a protected key" in str(error)
    assert "write the hole as {account_id} or {accountId}" in str(error)


def test_a_webhook_hole_in_the_exact_spelling_is_still_accepted_and_filled_from_the_scope() -> None:
    d = definition_from_body(tool_body(type="webhook", webhook_url="https://shop.example/accounts/{accountId}",
                                       parameters={"accountId": {"type": "string"}}), encrypt=lambda s: s)
    assert d.webhook_url.endswith("/{accountId}")


# --------------------------------------------------------------------------- the executor


async def run_one(catalog, arguments: dict[str, Any], scope: dict[str, Any]):
    from services.tools.context import TrustedContext

    executor = Executor()
    plan = await executor.prepare([ToolCall(id="c1", name="lookup", arguments=arguments)], catalog=catalog,
                                  config=BotConfig(), session=SessionToolState(), scope=scope)
    [outcome] = await executor.execute(plan, TrustedContext(tenant_id="tn_A", session_id="s", scope=scope),
                                       approved=True)
    return outcome


@pytest.mark.parametrize(("schema_name", "protected"), [
    ("AccountId", ()),          # another spelling: a row stored before registration refused it
    ("TENANT_ID", ()),
    ("store_id", ("store_id",)),  # a tool's own protected name: the trusted scope never holds it
])
async def test_a_required_protected_parameter_nothing_fills_fails_as_misconfigured_not_as_ask_the_customer(
    schema_name, protected,
) -> None:
    # before: "invalid arguments: 'AccountId' is required" with "Ask the customer for the missing
    # or corrected details": the model asked for an account id the engine would drop again
    handler = FakeHandler("lookup")
    schema = {"type": "object", "properties": {schema_name: {"type": "string"}, "q": {"type": "string"}},
              "required": [schema_name, "q"]}
    catalog = make_catalog(python_tool("lookup", parameters=schema, protected=protected), handlers=(handler,))
    outcome = await run_one(catalog, {"q": "lamp", schema_name: "tn_B"}, SCOPE)
    assert not outcome.success and outcome.error_kind == "policy_denied"
    assert f"the tool requires '{schema_name}', which only the business's trusted context may fill" in outcome.content
    assert "configuration problem of the business" in outcome.content and "Ask the customer" not in outcome.content
    assert not outcome.counts_for_breaker and handler.calls == []


async def test_a_required_exact_spelling_is_still_filled_from_the_trusted_scope() -> None:
    handler = FakeHandler("lookup")
    schema = {"type": "object", "properties": {"accountId": {"type": "string"}}, "required": ["accountId"]}
    catalog = make_catalog(python_tool("lookup", parameters=schema), handlers=(handler,))
    outcome = await run_one(catalog, {"accountId": "tn_B"}, SCOPE)
    assert outcome.success, outcome.content
    assert handler.calls[0][0] == {"accountId": "tn_A"}


@pytest.mark.parametrize(("rename", "held"), [("account_id", "'account_id' or 'accountId'"),
                                               ("AccountId", "'account_id' or 'accountId'"),
                                               ("TENANT_ID", "'tenant_id' or 'tenantId'")])
def test_a_binding_renaming_a_parameter_onto_a_tenant_key_is_refused_at_the_map(rename, held) -> None:
    # before: accepted, and binding_arguments dropped the model's value on every call: the model
    # must never supply the tenant's id, so only `scope` may send it
    error = refused(binding_body(path="/orders", scope=[], parameters={"acct": {"type": "string"}},
                                 parameter_map={"acct": rename}))
    assert error.path == "$.parameter_map"
    assert f"parameter_map renames 'acct' onto '{rename}', a protected key" in str(error)
    assert f"list {held} in `scope`" in str(error)


def test_a_binding_renaming_a_parameter_onto_its_own_protected_name_is_refused_at_the_map() -> None:
    error = refused(binding_body(path="/orders", scope=[], protected=["store_id"],
                                 parameters={"store": {"type": "string"}}, parameter_map={"store": "StoreId"}))
    assert error.path == "$.parameter_map"
    assert "parameter_map renames 'store' onto 'StoreId', which `protected` lists as 'store_id'" in str(error)
    assert "remove 'store_id' from `protected`" in str(error)


def test_a_binding_renaming_a_protected_parameter_is_refused_at_the_map() -> None:
    # the model is never offered a protected name, so a rename of it never applies
    error = refused(binding_body(path="/orders", scope=[], parameters={"q": {"type": "string"}},
                                 parameter_map={"account_id": "acct"}))
    assert error.path == "$.parameter_map"
    assert "parameter_map renames 'account_id', a protected key the model may not supply" in str(error)


def test_a_binding_renaming_ordinary_parameters_is_stored_as_it_was() -> None:
    d = definition_from_body(binding_body(parameters={"search": {"type": "string"}, "status": {"type": "string"}},
                                          parameter_map={"search": "q"}), encrypt=lambda s: s)
    assert d.parameter_map == {"search": "q"}


@pytest.mark.parametrize("name", ["account_id", "accountId"])
async def test_a_required_account_in_an_anonymous_session_asks_the_customer_to_sign_in(name) -> None:
    # an anonymous session's trusted scope holds the tenant's id only: the customer's account comes
    # from a verified contact's token, so the model is told to have them sign in, and nothing runs
    handler = FakeHandler("lookup")
    schema = {"type": "object", "properties": {name: {"type": "string"}, "q": {"type": "string"}},
              "required": [name, "q"]}
    catalog = make_catalog(python_tool("lookup", parameters=schema), handlers=(handler,))
    outcome = await run_one(catalog, {"q": "lamp", name: "tn_B"}, {"tenant_id": "tn_A", "tenantId": "tn_A"})
    assert not outcome.success and outcome.error_kind == "policy_denied"
    assert f"the tool requires '{name}', the customer's account" in outcome.content
    assert "Ask the customer to sign in" in outcome.content and "never ask them for it" in outcome.content
    assert handler.calls == []
