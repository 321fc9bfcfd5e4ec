"""The tool pipeline's edges, pure (fakes, no network): results nested too deeply to record, an
outcome that cannot be built, protected keys in any spelling, and the Idempotency-Key header of
a message id that is not ASCII."""

from __future__ import annotations

from typing import Any

import pytest

from kernel.records import McpServerRecord
from services.botconfig import BotConfig
from services.tools.context import TrustedContext
from services.tools.errors import UpstreamMalformed
from services.tools.executor import Executor, ToolCall, scoped_args
from services.tools.mcp import McpCallResult, McpToolInfo, compile_server_tools, result_value
from services.tools.model import (
    MAX_VALUE_DEPTH,
    PROTECTED_KEYS,
    BackendBindingTool,
    model_facing_parameters,
)
from services.tools.registry import Catalog, SetVariables
from services.tools.templating import binding_arguments, unfillable_holes
from services.tools.toolset import SessionToolState
from services.tools.webhook import idempotency_header
from tests.support.fakes import FakeHandler, make_catalog, python_tool

CTX = TrustedContext(tenant_id="tn_A", session_id="s1", message_id="m1")
SCOPE = {"tenant_id": "tn_A", "tenantId": "tn_A", "account_id": "tn_A", "accountId": "tn_A"}
#: spellings a case-insensitive backend (Go's encoding/json, ASP.NET Core) reads as a protected key
VARIANTS = ["Account_ID", "ACCOUNTID", "AccountId", "account-id", "TENANT_ID", "Tenant-Id", "tenantid",
            "ACCOUNT_ID", "_account_id_",
            # any other separator a backend or a form binder may ignore (before, these passed)
            "account.id", "account id", "account_id[]", "ACCOUNT:ID", "tenant/id", "account\u00a0id"]


def nested(levels: int, leaf: Any = 1) -> Any:
    """`leaf` inside `levels` objects and arrays, alternately."""
    value = leaf
    for i in range(levels):
        value = [value] if i % 2 else {"a": value}
    return value


async def run_one(catalog, name: str, arguments: dict[str, Any], scope: dict[str, Any] | None = None):
    executor = Executor()
    plan = await executor.prepare([ToolCall(id="c1", name=name, arguments=arguments)], catalog=catalog,
                                  config=BotConfig(), session=SessionToolState(), scope=scope or {})
    [outcome] = await executor.execute(plan, CTX, approved=True)
    return outcome


# -- results nested too deeply -------------------------------------------------------------------


async def test_a_handler_result_nested_hundreds_of_levels_is_an_in_band_failure_not_a_crash() -> None:
    # before: the record's redaction recursed past the stack and RecursionError left execute (the
    # whole turn failed, recorded as interrupted, and every retry met the same result)
    handler = FakeHandler("lookup", result=nested(600))
    outcome = await run_one(make_catalog(python_tool("lookup"), handlers=(handler,)), "lookup", {})
    assert not outcome.success and outcome.error_kind == "tool_crashed"
    assert "the result nests too deeply to be read" in outcome.content
    assert outcome.record.success is False and outcome.record.result is None


class _Unprintable:
    def __str__(self) -> str:
        raise ValueError("no text for this")


async def test_any_error_building_a_successful_outcome_is_an_in_band_failure() -> None:
    # a handler's SetVariables holding a value that cannot be made text: before, ValueError left
    # execute (only TypeError and EncodeError were caught there)
    handler = FakeHandler("remember", result=SetVariables(variables={"colour": _Unprintable()}, result={"ok": 1}))
    outcome = await run_one(make_catalog(python_tool("remember"), handlers=(handler,)), "remember", {})
    assert not outcome.success and outcome.error_kind == "tool_crashed"
    assert outcome.content.startswith("Tool 'remember' failed: internal error in the tool.")
    assert outcome.variables == {}


def test_mcp_structured_content_deeper_than_the_bound_is_upstream_malformed() -> None:
    with pytest.raises(UpstreamMalformed, match=f"nests more than {MAX_VALUE_DEPTH} levels deep"):
        result_value(McpCallResult(structured={"order": nested(MAX_VALUE_DEPTH)}))
    at_bound = {"order": nested(MAX_VALUE_DEPTH - 1)}
    assert result_value(McpCallResult(structured=at_bound)) == at_bound


class DeepConnector:
    """services.tools.mcp.McpConnector answering every call with structured content `levels` deep."""

    def __init__(self, levels: int) -> None:
        self.levels = levels

    async def list_tools(self, url: str, *, auth_header: str | None, timeout_s: float) -> list:
        return []

    async def call_tool(self, url: str, name: str, arguments: dict[str, Any], *, auth_header: str | None,
                        timeout_s: float, idempotency_key: str | None = None) -> McpCallResult:
        return McpCallResult(structured={"order": nested(self.levels)})


async def test_an_mcp_tool_answering_deeply_nested_content_fails_in_band_with_advice() -> None:
    record = McpServerRecord(tenant_id="tn_A", name="shop", url="https://mcp.example.com/mcp",
                             read_only_tools=["get_order"])
    tools, problems = compile_server_tools(record, [McpToolInfo(name="get_order", description="an order")],
                                           DeepConnector(600), open_auth=lambda: None)
    assert problems == {}
    outcome = await run_one(Catalog({t.name: t for t in tools}, {}), "shop__get_order", {})
    assert not outcome.success and outcome.error_kind == "upstream_malformed"
    assert f"nests more than {MAX_VALUE_DEPTH} levels deep" in outcome.content
    assert "calling it again will not help" in outcome.content
    assert outcome.counts_for_breaker


# -- protected keys in any spelling ---------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_scoped_args_strip_every_spelling_of_a_protected_key_at_any_depth(variant: str) -> None:
    # names that only resemble a protected key are the tool's own arguments: kept
    near = {"account": 1, "account_ids": 2, "tenant": 3, "account_id_hint": 4}
    model = {"note": "hi", variant: "victim", **near,
             "filter": {variant: "victim", "items": [{variant: "victim", "q": 1}]}}
    args = scoped_args(model, {"account_id": "tn_A"}, protected=PROTECTED_KEYS)
    assert args == {"note": "hi", **near, "filter": {"items": [{"q": 1}]}, "account_id": "tn_A"}


def test_a_tools_own_protected_name_is_stripped_in_any_spelling_too() -> None:
    args = scoped_args({"Store-ID": "s9", "q": "x"}, {}, protected=PROTECTED_KEYS | {"store_id"})
    assert args == {"q": "x"}


async def test_the_handler_gets_the_trusted_account_whatever_spelling_the_model_sends() -> None:
    handler = FakeHandler("lookup")
    schema = {"type": "object", "properties": {"q": {}, "filter": {}, "account_id": {"type": "string"}}}
    catalog = make_catalog(python_tool("lookup", parameters=schema), handlers=(handler,))
    outcome = await run_one(catalog, "lookup", {"q": "x", "Account_ID": "victim", "filter": {"TENANT_ID": "victim"}},
                            scope=SCOPE)
    assert outcome.success, outcome.content
    [(received, _ctx)] = handler.calls
    assert received == {"q": "x", "filter": {}, "account_id": "tn_A"}


def test_the_model_is_not_offered_a_property_named_by_a_protected_key_in_another_spelling() -> None:
    schema = {
        "type": "object",
        "properties": {"note": {"type": "string"}, "Account_ID": {"type": "string"},
                       "filter": {"type": "object", "properties": {"TENANT-ID": {}, "q": {}},
                                  "required": ["TENANT-ID", "q"]}},
        "required": ["note", "Account_ID"],
        "dependentRequired": {"note": ["accountId", "ACCOUNTID"]},
    }
    shown = model_facing_parameters(schema, PROTECTED_KEYS)
    assert shown == {
        "type": "object",
        "properties": {"note": {"type": "string"},
                       "filter": {"type": "object", "properties": {"q": {}}, "required": ["q"]}},
        "required": ["note"],
    }


def test_a_binding_drops_every_spelling_of_a_protected_key_and_keeps_its_scope() -> None:
    tool = BackendBindingTool(name="search", description="d", parameters={"type": "object", "properties": {}},
                              path="/search", parameter_map={"acct": "AccountID"}, scope=("account_id",))
    sent = binding_arguments(tool, {"Account_Id": "victim", "acct": "victim", "q": "x"},
                             {"account_id": "tn_A"})
    assert sent == {"q": "x", "account_id": "tn_A"}


def test_a_url_hole_named_by_another_spelling_of_a_protected_key_is_unfillable() -> None:
    # the model's value is stripped and the trusted scope holds only the exact spellings
    assert unfillable_holes(["AccountId", "account_id", "order_id"], frozenset()) == ["AccountId"]


# -- the Idempotency-Key header ------------------------------------------------------------------


#: printable ASCII keys (tabs too): sent byte for byte as before, so upstream dedup keeps working
ASCII_KEYS = ["m1:0123456789abcdef01234567", "m_1a2b:abc", "100% sure:ab", "a b\tc:de",
              "!\"#$&'()*+,/;<=>?@[\\]^`{|}~:x"]


@pytest.mark.parametrize(("key", "header"), [
    ("commande-é-1:0123456789abcdef01234567", "commande-%C3%A9-1:0123456789abcdef01234567"),
    ("注文 7:ab", "%E6%B3%A8%E6%96%87%207:ab"),
    ("é 100%:ab", "%C3%A9%20100%25:ab"),  # `%` escaped too: two such keys never meet
    ("line\nbreak-é:ab", "line%0Abreak-%C3%A9:ab"),
    ("lone-\ud800:ab", "lone-%ED%A0%80:ab"),
])
def test_only_a_key_that_is_not_printable_ascii_is_percent_encoded(key: str, header: str) -> None:
    assert idempotency_header(key) == header
    assert header.isascii() and header.isprintable()
    assert [idempotency_header(k) for k in ASCII_KEYS] == ASCII_KEYS
