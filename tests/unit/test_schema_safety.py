"""Tenant-written JSON schemas (tool parameters, outputs, forms) are data from a stranger: they
never make a host fetch a URL, never freeze its event loop, and a broken one is a 422 for the
tenant admin, never a 500 in a contact's session. Pure: no socket is opened (a retrieval attempt
fails the test through `no_network`)."""

from __future__ import annotations

import re
import socket
import time

import pytest

from kernel.errors import InvalidInput
from services.tools.validation import (
    MAX_CHECK_STEPS,
    ArgumentValidator,
    check_any_schema,
    check_schema,
)


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Any connection attempt is a failure: a schema must never reach out."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"a schema tried to open a connection: {args!r}")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)


def obj(**properties) -> dict:
    return {"type": "object", "properties": properties}


REMOTE = "http://169.254.169.254/latest/meta-data.json"


@pytest.mark.parametrize("ref", [REMOTE, "https://tenant.example/schema.json#/a", "file:///etc/passwd", "other.json"])
def test_a_ref_outside_the_schema_is_refused_when_saved(ref):
    with pytest.raises(InvalidInput, match=r"\$ref .* only refer to this schema"):
        check_schema(obj(a={"$ref": ref}))
    with pytest.raises(InvalidInput, match=r"\$ref"):
        check_any_schema({"type": "string", "allOf": [{"$ref": ref}]}, where="$.output_schema")


def test_a_ref_to_nothing_is_refused_when_saved():
    with pytest.raises(InvalidInput, match=r"\$ref '#/definitions/nope' does not resolve.* at `\$.parameters.properties.a`"):
        check_schema(obj(a={"$ref": "#/definitions/nope"}))


def test_local_refs_that_resolve_are_accepted_and_applied():
    schema = {"type": "object", "$defs": {"qty": {"type": "integer", "minimum": 1}},
              "properties": {"n": {"$ref": "#/$defs/qty"}, "m": {"$ref": "#/properties/n"}}}
    check_schema(schema)
    validator = ArgumentValidator(schema)
    assert validator.errors({"n": 2, "m": 3}) == []
    assert validator.errors({"n": 0}) == ["'n': 0 is less than the minimum of 1"]


def test_a_stored_schema_with_a_remote_ref_fails_in_band_and_fetches_nothing():
    # saved before refs were checked: applied, it answers a problem and opens no connection
    problems = ArgumentValidator(obj(a={"$ref": REMOTE})).errors({"a": "x"})
    assert len(problems) == 1 and "$ref" in problems[0] and "cannot be checked" in problems[0]


def test_a_stored_schema_with_a_dangling_ref_fails_in_band():
    problems = ArgumentValidator(obj(a={"$ref": "#/definitions/nope"})).errors({"a": "x"})
    assert len(problems) == 1 and "cannot be checked" in problems[0]


def test_a_self_referencing_schema_is_a_problem_not_a_crash():
    problems = ArgumentValidator(obj(a={"$ref": "#/properties/a"})).errors({"a": "x"})
    assert problems and "cannot be checked" in problems[0]


def test_a_pattern_is_matched_in_linear_time():
    # ^(a+)+$ backtracks exponentially in Python's re: 30 characters took seconds, on the loop
    # every session of the host shares
    validator = ArgumentValidator(obj(a={"type": "string", "pattern": "^(a+)+$"}))
    started = time.perf_counter()
    [problem] = validator.errors({"a": "a" * 5000 + "!"})
    assert problem.startswith("'a': 'aaaa") and problem.endswith("…' does not match '^(a+)+$'") and len(problem) < 200
    assert validator.errors({"a": "aaa"}) == []
    assert time.perf_counter() - started < 1.0  # seconds even on a slow machine with Python's re


@pytest.mark.parametrize("pattern", ["(?=a)b", "(a)\\1", "(?<!x)y"])
def test_a_pattern_the_linear_engine_cannot_run_is_refused_when_saved(pattern):
    with pytest.raises(InvalidInput, match="pattern .* lookaround or backreference.* at `\\$.parameters.properties.a.pattern`"):
        check_schema(obj(a={"type": "string", "pattern": pattern}))


def test_pattern_properties_are_refused_when_saved():
    with pytest.raises(InvalidInput, match="patternProperties .* not supported"):
        check_schema({"type": "object", "patternProperties": {"^x-": {"type": "string"}}})


def test_pattern_properties_of_a_stored_schema_are_matched_in_linear_time():
    validator = ArgumentValidator({"type": "object", "patternProperties": {"^(a+)+$": {"type": "integer"}}})
    assert validator.errors({"a" * 40 + "!": "x", "aa": "y"}) == ["'aa': 'y' is not of type 'integer'"]


def test_a_schema_nested_too_deeply_is_a_422_not_a_crash():
    schema: dict = {"type": "string"}
    for _ in range(400):
        schema = {"type": "array", "items": schema}
    with pytest.raises(InvalidInput, match="nests too deeply"):
        check_schema(obj(a=schema))
    with pytest.raises(InvalidInput, match="nests too deeply"):
        check_any_schema(schema, where="$.output_schema")


def test_sensitive_arguments_are_not_repeated_in_validation_errors():
    schema = obj(card={"type": "string", "pattern": "^[0-9]{16}$"}, note={"type": "string", "maxLength": 3})
    problems = ArgumentValidator(schema, sensitive=frozenset({"card"})).errors(
        {"card": "4111-1111-1111-1111 cvv 123", "note": "long"})
    assert not any("4111" in p or "cvv" in p for p in problems), problems
    assert "'card': the value does not match its pattern '^[0-9]{16}$'" in problems
    assert "'note': 'long' is too long" in problems  # not sensitive: said as before


CARD = "4111111111111111"


@pytest.mark.parametrize(("rule", "said"), [
    ({"anyOf": [{"required": ["amount"]}, {"required": ["token_ref"]}]},
     "the arguments do not satisfy the schema's 'anyOf' rule: 'amount' is required; or 'token_ref' is required"),
    ({"oneOf": [{"required": ["card"]}, {"required": ["note"]}]},
     "the arguments do not satisfy the schema's 'oneOf' rule"),  # matches both: no alternative to name
    ({"not": {"required": ["card"]}}, "the arguments do not satisfy the schema's 'not' rule"),
    ({"maxProperties": 1}, "the arguments have more than 1 properties"),
    ({"const": {"card": "0000"}}, "the arguments do not satisfy the schema's 'const' rule"),
    ({"dependentRequired": {"card": ["amount"]}}, "'amount' is a dependency of 'card'"),
])
def test_a_rule_on_the_whole_arguments_never_quotes_them_while_a_sensitive_one_is_present(rule, said):
    # the path is empty, and jsonschema's message quotes the whole arguments object: before,
    # "{'card': '4111…', 'note': 'x'} is not valid under any of the given schemas"
    schema = {**obj(card={"type": "string"}, note={"type": "string"}, amount={"type": "integer"}), **rule}
    problems = ArgumentValidator(schema, sensitive=frozenset({"card"})).errors({"card": CARD, "note": "x"})
    assert problems == [said]


def test_a_rule_on_the_whole_arguments_is_said_as_before_without_sensitive_ones():
    schema = {**obj(note={"type": "string"}), "maxProperties": 1}
    assert ArgumentValidator(schema, sensitive=frozenset({"card"})).errors({"note": "x", "b": 1}) == [
        "{'note': 'x', 'b': 1} has too many properties"]


@pytest.mark.parametrize(("prop", "value", "said"), [
    ({"type": "integer", "minimum": 1}, 0, "'f': the value is less than the minimum of 1"),
    ({"type": "integer"}, "three", "'f': the value is not of type 'integer'"),
    ({"type": "string", "format": "email"}, "jane-at-x", "'f': the value is not a valid 'email'"),
    ({"enum": ["a", "b"]}, "zz-secret", "'f': the value is not one of ['a', 'b']"),
    ({"type": "string", "maxLength": 3}, "long-secret", "'f': the value is longer than 3 characters"),
    ({"type": "string", "pattern": "^[0-9]{5}$"}, "ABC-secret", "'f': the value does not match its pattern '^[0-9]{5}$'"),
    ({"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]$"}}}, {"zip": "Z-secret"},
     "'f.zip': the value does not match its pattern '^[0-9]$'"),
])
def test_with_every_value_sensitive_a_problem_names_the_field_and_rule_never_the_value(prop, value, said):
    # a form's answers are all the contact's (submit_form's `data`)
    problems = ArgumentValidator(obj(f=prop), all_sensitive=True).errors({"f": value})
    assert problems == [said]


async def test_a_root_rule_error_keeps_a_sensitive_value_out_of_the_model_and_the_record():
    from services.botconfig import BotConfig
    from services.tools.context import TrustedContext
    from services.tools.executor import Executor, ToolCall
    from services.tools.toolset import SessionToolState
    from tests.support.fakes import make_catalog, python_tool

    schema = {**obj(card={"type": "string"}, amount={"type": "integer"}), "anyOf": [{"required": ["amount"]}]}
    catalog = make_catalog(python_tool("pay", parameters=schema, sensitive=("card",)))
    executor = Executor()
    plan = await executor.prepare([ToolCall(id="c1", name="pay", arguments={"card": CARD})],
                                  catalog=catalog, config=BotConfig(), session=SessionToolState(), scope={})
    [outcome] = await executor.execute(plan, TrustedContext(tenant_id="t", session_id="s", message_id="m"))
    assert "'anyOf' rule: 'amount' is required" in outcome.content
    assert CARD not in outcome.content and CARD not in (outcome.record.error or "")


async def test_a_tools_sensitive_arguments_stay_out_of_its_in_band_error_and_record():
    # through the executor: the error is what the model reads and what ce_tool_calls keeps
    from services.botconfig import BotConfig
    from services.tools.context import TrustedContext
    from services.tools.executor import Executor, ToolCall
    from services.tools.toolset import SessionToolState
    from tests.support.fakes import make_catalog, python_tool

    schema = obj(card={"type": "string", "pattern": "^[0-9]{16}$"})
    catalog = make_catalog(python_tool("pay", parameters=schema, sensitive=("card",)))
    executor = Executor()
    plan = await executor.prepare([ToolCall(id="c1", name="pay", arguments={"card": "4111-1111-1111-1111 cvv 123"})],
                                  catalog=catalog, config=BotConfig(), session=SessionToolState(), scope={})
    [outcome] = await executor.execute(plan, TrustedContext(tenant_id="t", session_id="s", message_id="m"))
    assert not outcome.success and "does not match its pattern" in outcome.content
    assert "4111" not in outcome.content and "4111" not in (outcome.record.error or "")


def _fanning(levels: int) -> dict:
    """~70 bytes a level: each $def is allOf of the one before, twice (2^levels subschemas unfolded)."""
    defs = {"d0": {"type": "object"}}
    for i in range(1, levels + 1):
        defs[f"d{i}"] = {"allOf": [{"$ref": f"#/$defs/d{i - 1}"}, {"$ref": f"#/$defs/d{i - 1}"}]}
    return {"type": "object", "properties": {"q": {"type": "string"}}, "$defs": defs,
            "allOf": [{"$ref": f"#/$defs/d{levels}"}]}


def test_a_schema_whose_refs_unfold_past_the_budget_is_refused_when_saved():
    # before: a 2 KB schema was saved (201), then checking one call took 2^30 steps on the host's
    # event loop, stalling every session of every tenant on it
    with pytest.raises(InvalidInput, match=r"unfold to more than 10,000 subschemas.*- at `\$.parameters`"):
        check_schema(_fanning(30))
    with pytest.raises(InvalidInput, match="unfold"):
        check_any_schema(_fanning(30), where="$.output_schema")


@pytest.mark.parametrize("name", ["default", "enum", "const", "examples", "$defs", "definitions"])
def test_a_property_named_like_a_keyword_is_still_counted_and_checked(name):
    # before: the names under `properties` were read as keywords, so a property called `default`
    # hid the 2^30 unfolding (and any pattern or $ref) beneath it from the checks on save
    schema = _fanning(30)
    schema["properties"] = {name: schema.pop("allOf")[0]}
    with pytest.raises(InvalidInput, match="unfold"):
        check_schema(schema)
    with pytest.raises(InvalidInput, match=rf"RE2 syntax\) - at `\$.parameters.properties.{re.escape(name)}.pattern`"):
        check_schema({"type": "object", "properties": {name: {"type": "string", "pattern": "(a)\\1"}}})
    with pytest.raises(InvalidInput, match="does not resolve"):
        check_schema({"type": "object", "properties": {name: {"$ref": "#/$defs/none"}}})


def test_properties_named_after_keywords_are_accepted():
    # a name is data under `properties`: `patternProperties` or `$ref` there is a property
    schema = {"type": "object", "properties": {"patternProperties": {"type": "string"}, "$ref": {"type": "integer"}}}
    check_schema(schema)
    assert ArgumentValidator(schema).errors({"patternProperties": "x", "$ref": "y"}) == ["'$ref': 'y' is not of type 'integer'"]


def _deep(levels: int) -> dict:
    value: dict = {}
    for _ in range(levels):
        value = {"a": value}
    return value


def test_a_schema_that_refers_to_itself_twice_per_level_is_stopped_in_band():
    # each level of the value doubles the work (2^64 steps at the 64 levels arguments may nest):
    # no count of the schema sees it, so the check itself stops past its step budget
    schema = {"type": "object", "allOf": [{"properties": {"a": {"$ref": "#"}}}, {"properties": {"a": {"$ref": "#"}}}]}
    check_schema(schema)
    validator = ArgumentValidator(schema)
    assert validator.errors(_deep(6)) == []  # 2^6: cheap, checked
    [problem] = validator.errors(_deep(40))
    assert problem.startswith("checking the arguments took more than 100,000 steps") and "refers to itself" in problem
    [problem] = ArgumentValidator(schema, subject="result").errors(_deep(40))
    assert problem.startswith("checking the result took")


def test_a_long_value_is_checked_whole_within_an_absolute_budget_and_stopped_past_it():
    # an upstream's long result is checked whole up to MAX_CHECK_STEPS in all, whatever its size:
    # a longer one is stopped in-band (it once got steps in proportion to its size: a wide anyOf
    # over a 40 KB array then held a host's loop for 10 s)
    schema = {"type": "object", "properties": {"rows": {"type": "array", "items": {
        "type": "object", "properties": {f"f{i}": {"type": "string", "minLength": 1} for i in range(10)}}}}}
    rows = [{f"f{i}": "x" for i in range(10)} for _ in range(1_000)]  # ~54,000 keyword checks
    assert ArgumentValidator(schema, subject="result").errors({"rows": rows}) == []
    rows[-1]["f9"] = ""
    assert ArgumentValidator(schema).errors({"rows": rows}) == ["'rows.999.f9': '' should be non-empty"]
    longer = [{f"f{i}": "x" for i in range(10)} for _ in range(5_000)]  # ~270,000
    [problem] = ArgumentValidator(schema, subject="result").errors({"rows": longer})
    assert problem.startswith(f"checking the result took more than {MAX_CHECK_STEPS:,} steps")


def test_refs_used_a_few_times_and_recursive_schemas_are_accepted():
    check_schema(_fanning(8))  # 2^8 subschemas: cheap to check
    tree = {"type": "object", "properties": {"node": {"$ref": "#/$defs/node"}},
            "$defs": {"node": {"type": "object", "properties": {"children": {"type": "array",
                                                                          "items": {"$ref": "#/$defs/node"}}}}}}
    check_schema(tree)  # recursion follows the value's depth, not the schema's
    assert ArgumentValidator(tree).errors({"node": {"children": [{"children": []}]}}) == []


def test_a_chain_of_refs_longer_than_can_be_followed_is_refused_not_a_crash():
    defs = {"d0": {"type": "string"}} | {f"d{i}": {"$ref": f"#/$defs/d{i - 1}"} for i in range(1, 3000)}
    # refused by the size budgets before anything follows it (a chain of a thousand, by its count)
    with pytest.raises(InvalidInput, match=r"chain too deeply|nests too deeply|allowed|subschemas"):
        check_schema({"type": "object", "properties": {"q": {"$ref": "#/$defs/d2999"}}, "$defs": defs})
