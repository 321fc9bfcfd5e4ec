"""The tool-contract report: each finding from a deliberately broken fixture, clean when correct."""

from __future__ import annotations

import msgspec
import pytest

from services.botconfig import Backend, BotConfig, Intent
from services.contacts import ContactVerification
from services.contract import build_report
from services.contract_text import format_report
from services.tools.model import PythonTool
from services.tools.registry import HandlerRegistry, build_catalog
from tests.support.contract import ACCOUNT_CLAIMS, NullBackend, binding

OPENAPI = {"paths": {"/example/catalog": {"get": {"parameters": [
    {"name": "q", "in": "query", "required": True},
    {"name": "per_page", "in": "query"},
    {"name": "account_id", "in": "query", "required": True},
]}}}}


ACCOUNTS = ACCOUNT_CLAIMS


def report_for(tools, *, config=None, builtins=(), registry=None):
    registry = registry or HandlerRegistry()
    # the tenant's verified contacts carry the account the seed's binding sends
    config = config or BotConfig(backend=Backend(base_url="http://127.0.0.2:1", openapi=OPENAPI),
                                 contact_verification=ACCOUNTS)
    published = [(t, 1) for t in tools]
    catalog = build_catalog(builtins, published, registry=registry, backend=NullBackend())
    return build_report("t1", published, catalog, config)


def kinds(report, name):
    return [f.kind for t in report.tools if t.name == name for f in t.findings]


def test_seed_001_catalog_binding_is_clean_and_shows_both_names_and_trusted_fields():
    report = report_for([binding()])
    assert report.ok and report.findings == 0
    tool = report.tools[0]
    pairs = {(f.model_name, f.backend_name, f.source) for f in tool.fields}
    assert ("search", "q", "model") in pairs and ("limit", "per_page", "model") in pairs
    assert (None, "account_id", "trusted_scope") in pairs
    assert tool.runs == "binding GET /example/catalog" and tool.offered


def test_binding_that_would_send_search_instead_of_q_is_flagged_as_ignored_and_missing():
    report = report_for([binding(parameter_map={"limit": "per_page"})])
    found = kinds(report, "example_catalog_search")
    assert "ignored_argument" in found and "missing_required_parameter" in found
    messages = " ".join(f.message for f in report.tools[0].findings)
    assert "'search'" in messages and "'q'" in messages
    assert not report.ok


def test_dead_route():
    report = report_for([binding(path="/example/catalogue")])
    assert kinds(report, "example_catalog_search") == ["dead_route"]
    assert "/example/catalog" in report.tools[0].findings[0].message  # lists what exists


def test_missing_required_parameter_from_scope():
    report = report_for([binding(scope=())])
    finding = next(f for f in report.tools[0].findings if f.kind == "missing_required_parameter")
    assert "'account_id'" in finding.message and "scope" in finding.fix


def test_handler_override_when_a_tenant_tool_shadows_a_builtin():
    registry = HandlerRegistry()

    @registry.register("builtin.recall")
    async def recall(args, ctx):
        return {}

    builtin = PythonTool(name="recall_memory", description="b", parameters={"type": "object"}, handler="builtin.recall")
    tenant = binding(name="recall_memory")
    report = report_for([tenant], builtins=[builtin], registry=registry)
    assert "handler_override" in kinds(report, "recall_memory")


def test_python_row_bound_to_an_unregistered_handler_is_not_loaded():
    report = report_for([PythonTool(name="x", description="d", parameters={"type": "object"}, handler="os.system")])
    assert kinds(report, "x") == ["handler_not_loaded"]
    assert report.tools[0].runs is None and not report.tools[0].offered


@pytest.mark.parametrize("allowlist", [(), ("other",)])
def test_tool_absent_from_the_allowlist(allowlist):
    config = BotConfig(contact_verification=ACCOUNT_CLAIMS, allowlist=allowlist, backend=Backend(base_url="http://127.0.0.2:1", openapi=OPENAPI))
    report = report_for([binding()], config=config)
    assert kinds(report, "example_catalog_search") == ["absent_from_allowlist"]
    assert not report.tools[0].offered


def test_intent_naming_an_unknown_tool():
    config = BotConfig(intents={"orders": Intent(phrases=("order",), tools=("check_ordr",))},
                       backend=Backend(base_url="http://127.0.0.2:1", openapi=OPENAPI))
    report = report_for([binding()], config=config)
    assert kinds(report, "check_ordr") == ["unknown_tool_in_intent"]


def test_recent_results_breaking_the_output_schema_are_reported():
    from services.contract import OUTPUT_CONTRACT_FRAGMENT

    tool = binding(output_schema={"type": "object", "required": ["results"]})
    catalog = build_catalog([], [(tool, 1)], registry=HandlerRegistry(), backend=NullBackend())
    config = BotConfig(contact_verification=ACCOUNT_CLAIMS, backend=Backend(base_url="http://127.0.0.2:1", openapi=OPENAPI))
    report = build_report("t1", [(tool, 1)], catalog, config, {"example_catalog_search": 3})
    finding = report.tools[0].findings[0]
    assert finding.kind == "output_contract_broken" and "3 recent result(s)" in finding.message
    assert "output schema" in OUTPUT_CONTRACT_FRAGMENT


def test_each_tool_lists_the_scope_keys_it_needs_and_what_fills_them():
    # the seed binding's account_id: a verified contact's `sub`, as the tenant maps it
    tool = report_for([binding()]).tools[0]
    assert [(s.key, s.provided_by, s.claim) for s in tool.scope] == [("account_id", "claim", "sub")]
    tenant = report_for([binding(scope=("tenant_id",), path="/t/{tenant_id}")]).tools[0]
    assert [(s.key, s.provided_by) for s in tenant.scope] == [("tenant_id", "tenant")]

    bill = binding(name="get_bill", path="/stays/{stay_id}/bill", parameter_map={}, parameters={"type": "object"},
                   scope=("stay_id", "account_id"))
    verification = ContactVerification(algorithms=("HS256",), scope_claims={"stay_id": "stay", "account_id": "sub"})
    mapped = report_for([bill], config=BotConfig(contact_verification=verification)).tools[0]
    assert [(s.key, s.provided_by, s.claim) for s in mapped.scope] == [
        ("stay_id", "claim", "stay"), ("account_id", "claim", "sub")]
    assert "missing_required_parameter" not in [f.kind for f in mapped.findings]

    # no mapping: nothing fills either (an anonymous session has no account), every call fails
    # in-band, and the report says how to fix it
    unmapped = report_for([bill], config=BotConfig()).tools[0]
    assert [(s.key, s.provided_by) for s in unmapped.scope] == [("stay_id", "none"), ("account_id", "none")]
    found = [f for f in unmapped.findings if f.kind == "missing_required_parameter"]
    assert ["'stay_id'" in found[0].message, "'account_id'" in found[1].message] == [True, True]
    assert all("scope_claims" in f.fix for f in found)
    text = format_report(msgspec.to_builtins(report_for([bill], config=BotConfig(contact_verification=verification))))
    assert "scope stay_id: the token's 'stay' claim, for a verified contact only" in text, text
