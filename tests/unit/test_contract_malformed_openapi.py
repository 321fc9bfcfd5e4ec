"""The tool-contract report on a malformed backend OpenAPI document: every unreadable part is a
finding that names where it is and what to fix, never an exception (before: TypeError/AttributeError,
so GET /v1/tools/contract answered 500)."""

from __future__ import annotations

import pytest

from services.botconfig import Backend, BotConfig
from services.contract import build_report
from services.tools.model import BackendBindingTool
from services.tools.registry import HandlerRegistry, build_catalog
from tests.support.contract import ACCOUNT_CLAIMS, NullBackend, binding


def report_with(openapi: dict):
    tool = binding()
    config = BotConfig(contact_verification=ACCOUNT_CLAIMS, backend=Backend(base_url="http://127.0.0.2:1", openapi=openapi))
    catalog = build_catalog([], [(tool, 1)], registry=HandlerRegistry(), backend=NullBackend())
    return build_report("t1", [(tool, 1)], catalog, config)


def get_op(op: object) -> dict:
    return {"paths": {"/example/catalog": {"get": op}}}


@pytest.mark.parametrize(("openapi", "where", "got"), [
    ({"paths": "x"}, "$.backend.openapi.paths", "a string"),
    ({"paths": None}, "$.backend.openapi.paths", "null"),
    ({"paths": ["/example/catalog"]}, "$.backend.openapi.paths", "an array"),
    ({"paths": {"/example/catalog": 5}}, "$.backend.openapi.paths['/example/catalog']", "a number"),
    ({"paths": {"/example/catalog": {"get": "q"}}}, "$.backend.openapi.paths['/example/catalog'].get", "a string"),
    (get_op({"parameters": 5}), "$.backend.openapi.paths['/example/catalog'].get.parameters", "a number"),
    (get_op({"parameters": None}), "$.backend.openapi.paths['/example/catalog'].get.parameters", "null"),
    ({"paths": {"/example/catalog": {"parameters": {"name": "q"}, "get": {}}}},
     "$.backend.openapi.paths['/example/catalog'].parameters", "an object"),
    (get_op({"parameters": ["q"]}), "$.backend.openapi.paths['/example/catalog'].get.parameters[0]", "a string"),
    (get_op({"parameters": [{"name": ["a"]}]}),
     "$.backend.openapi.paths['/example/catalog'].get.parameters[0].name", "an array"),
    (get_op({"requestBody": []}), "$.backend.openapi.paths['/example/catalog'].get.requestBody", "an array"),
    (get_op({"requestBody": {"content": "json"}}),
     "$.backend.openapi.paths['/example/catalog'].get.requestBody.content", "a string"),
    (get_op({"requestBody": {"content": {"application/json": {"schema": True}}}}),
     "$.backend.openapi.paths['/example/catalog'].get.requestBody.content['application/json'].schema", "a boolean"),
    (get_op({"requestBody": {"content": {"application/json": {"schema": {"required": "q"}}}}}),
     "$.backend.openapi.paths['/example/catalog'].get.requestBody.content['application/json'].schema.required",
     "a string"),
    (get_op({"requestBody": {"content": {"application/json": {"schema": {"required": [["q"]]}}}}}),
     "$.backend.openapi.paths['/example/catalog'].get.requestBody.content['application/json'].schema.required[0]",
     "an array"),
    (get_op({"requestBody": {"content": {"application/json": {"schema": {"properties": []}}}}}),
     "$.backend.openapi.paths['/example/catalog'].get.requestBody.content['application/json'].schema.properties",
     "an array"),
])
def test_a_malformed_part_of_the_openapi_document_is_a_finding_naming_where_it_is(openapi, where, got):
    report = report_with(openapi)
    assert not report.ok
    [finding] = report.tools[0].findings
    assert finding.kind == "malformed_openapi" and finding.severity == "error"
    assert f"got {got} - at `{where}`" in finding.message
    assert "GET /example/catalog" in finding.message
    assert "PUT /v1/bot-config" in finding.fix


def test_every_malformed_part_is_reported_and_no_argument_is_guessed_ignored():
    report = report_with({"paths": {"/example/catalog": {"parameters": 5, "get": {
        "parameters": [{"name": ["a"]}, {"name": "q", "in": "query", "required": True}], "requestBody": []}}}})
    found = report.tools[0].findings
    # the document could not be read: "q is ignored" / "account_id is missing" would be guesses
    assert [f.kind for f in found] == ["malformed_openapi"] * 3
    assert [f.message.rsplit("at ", 1)[1] for f in found] == [
        "`$.backend.openapi.paths['/example/catalog'].parameters`",
        "`$.backend.openapi.paths['/example/catalog'].get.parameters[0].name`",
        "`$.backend.openapi.paths['/example/catalog'].get.requestBody`",
    ]


def test_a_document_without_paths_is_still_a_dead_route_and_other_tools_are_reported_as_before():
    assert [f.kind for f in report_with({}).tools[0].findings] == ["dead_route"]
    assert "lists: none" in report_with({}).tools[0].findings[0].message
    # a malformed part of another path does not concern this tool
    other = {"paths": {"/other": {"get": {"parameters": 5}}, "/example/catalog": {"get": {"parameters": [
        {"name": "q", "in": "query", "required": True}, {"name": "per_page", "in": "query"},
        {"name": "account_id", "in": "query", "required": True}]}}}}
    assert report_with(other).ok


def test_a_json_body_schema_is_read_when_well_formed():
    tool = BackendBindingTool(
        name="create_order", description="d", method="POST", path="/orders",
        parameters={"type": "object", "properties": {"sku": {"type": "string"}}, "required": ["sku"]},
    )
    openapi = {"paths": {"/orders": {"post": {"requestBody": {"content": {"application/json": {"schema": {
        "properties": {"sku": {}, "qty": {}}, "required": ["sku", "qty"]}}}}}}}}
    config = BotConfig(contact_verification=ACCOUNT_CLAIMS, backend=Backend(base_url="http://127.0.0.2:1", openapi=openapi))
    catalog = build_catalog([], [(tool, 1)], registry=HandlerRegistry(), backend=NullBackend())
    [finding] = build_report("t1", [(tool, 1)], catalog, config).tools[0].findings
    assert finding.kind == "missing_required_parameter" and "'qty'" in finding.message
