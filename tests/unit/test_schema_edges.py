"""Edges of tenant schemas and of the caches around them, with fakes only (no Postgres, no Ray).

- A schema whose `$schema`, `$id` (or `$anchor`, `$ref`...) is not a string, at any depth, is an
  InvalidInput naming the path (a 422), never an AttributeError from jsonschema or referencing
  (a 500); no JSON value at all makes the schema check raise anything else, and a schema stored
  before it was checked as now is an in-band problem when a value is checked against it.
- `format` is checked for every format JSON Schema 2020-12 defines, in every dialect; a standard
  format this host cannot check is refused when the schema is saved, naming the formats it checks.
- Invalidating one tenant's catalog keeps no other tenant's load out of the cache.
- A caller that gives up waiting for a session's state to be saved leaves no waiter behind.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from actors.catalogs import TenantCatalogs
from actors.host import HostSettings, SessionHost
from kernel.errors import InvalidInput, Overloaded
from services.tools.registry import HandlerRegistry
from services.tools.validation import (
    STANDARD_FORMATS,
    ArgumentValidator,
    check_any_schema,
    check_schema,
    checked_formats,
)
from services.wire import Turn
from tests.support.catalog_fakes import FakeTools
from tests.support.host_fakes import FakeSessionStore, FakeTenants

ROOT = Path(__file__).resolve().parents[2]  # the project, where `services` imports from
OBJECT = {"type": "object", "properties": {"a": {"type": "string"}}}
DRAFT3 = "http://json-schema.org/draft-03/schema#"
DRAFT4 = "http://json-schema.org/draft-04/schema#"
DRAFT6 = "http://json-schema.org/draft-06/schema#"
DRAFT7 = "http://json-schema.org/draft-07/schema#"
DRAFT2019 = "https://json-schema.org/draft/2019-09/schema"
DRAFT2020 = "https://json-schema.org/draft/2020-12/schema"


# --------------------------------------------------------------------------- resource keywords


@pytest.mark.parametrize("schema,path", [
    ({**OBJECT, "$schema": 5}, "$.parameters.$schema"),
    ({**OBJECT, "$schema": ["x"]}, "$.parameters.$schema"),
    ({**OBJECT, "$schema": {"$id": 5}}, "$.parameters.$schema"),
    ({**OBJECT, "$schema": None}, "$.parameters.$schema"),
    ({**OBJECT, "$schema": True}, "$.parameters.$schema"),
    ({**OBJECT, "$id": 5}, "$.parameters.$id"),
    ({**OBJECT, "$id": {"x": 1}}, "$.parameters.$id"),
    ({**OBJECT, "$schema": DRAFT7, "$id": 5}, "$.parameters.$id"),
    ({**OBJECT, "$schema": DRAFT4, "id": 5}, "$.parameters.id"),
    ({**OBJECT, "$schema": DRAFT4, "id": {"a": 1}}, "$.parameters.id"),
    ({**OBJECT, "properties": {"a": {"$schema": 5}}}, "$.parameters.properties.a.$schema"),
    ({**OBJECT, "properties": {"a": {"$id": 5}}, "$ref": "#/properties/a"}, "$.parameters.properties.a.$id"),
    ({**OBJECT, "$defs": {"d": {"$id": 3}}}, "$.parameters.$defs.d.$id"),
    ({**OBJECT, "allOf": [{"$id": 5}]}, "$.parameters.allOf[0].$id"),
    ({**OBJECT, "not": {"$anchor": 7}}, "$.parameters.not.$anchor"),
    ({**OBJECT, "$dynamicAnchor": []}, "$.parameters.$dynamicAnchor"),
    ({**OBJECT, "$schema": DRAFT2019, "$recursiveRef": 5}, "$.parameters.$recursiveRef"),
])
def test_a_resource_keyword_that_is_not_a_string_is_refused_naming_its_path(schema, path):
    with pytest.raises(InvalidInput, match="must be a string") as info:
        check_schema(schema)
    assert info.value.path == path and f"at `{path}`" in str(info.value)


@pytest.mark.parametrize("extra", [{"$schema": 5}, {"$id": 5}, {"$id": {"x": 1}}])
def test_an_output_schema_with_a_non_string_schema_or_id_is_refused(extra):
    with pytest.raises(InvalidInput, match="must be a string"):
        check_any_schema({"type": "array", **extra}, where="$.output_schema")


@pytest.mark.parametrize("schema", [
    {**OBJECT, "properties": {"$id": {"type": "string"}, "$schema": {"type": "integer"}}},  # property names
    {**OBJECT, "enum": [{"$id": 5}, {"a": "x"}], "default": {"$schema": 5}, "examples": [{"$id": []}]},  # data
    {**OBJECT, "id": 5},  # `id` is no keyword of 2020-12
    {**OBJECT, "$schema": "https://schemas.example/unknown-dialect"},  # an unknown dialect: checked as 2020-12
    {**OBJECT, "$schema": DRAFT7, "$id": "https://shop.example/schemas/order"},
])
def test_values_that_only_look_like_resource_keywords_are_accepted(schema):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # jsonschema's word on an unknown dialect
        check_schema(schema)
        assert ArgumentValidator(schema).errors({"a": "x"}) == []


#: odd and hostile schemas: each is refused (InvalidInput) or accepted, none raises anything else
HOSTILE = [
    {"type": "object", "$schema": 5}, {"type": "object", "$schema": ["x"]}, {"type": "object", "$id": 5},
    {"type": "object", "$id": {"x": 1}}, {"type": "object", "$schema": None}, {"type": "object", "$id": True},
    {"type": "object", "$schema": ""}, {"type": "object", "$id": ""}, {"type": "object", "$id": "#foo"},
    {"type": "object", "$id": "\x00"}, {"type": "object", "$id": "http://[::1"},
    {"type": "object", "$schema": DRAFT3, "properties": {"a": {"type": "string", "format": "date-time"}}},
    {"type": "object", "$schema": DRAFT4, "id": 5}, {"type": "object", "$schema": DRAFT4, "id": "#x", "$ref": "#x"},
    {"type": "object", "properties": {"a": {"$schema": DRAFT4, "id": 5}}, "$ref": "#/properties/a"},
    {"type": "object", "properties": {"a": {"$id": 5}}, "$ref": "#/properties/a"},
    {"type": "object", "$defs": {"a": {"$id": "http://other.example/x"}}, "$ref": "http://other.example/x"},
    {"type": "object", "$ref": 5}, {"type": "object", "$ref": "#/%ZZ"}, {"type": "object", "$ref": "#/$defs/a~2"},
    {"type": "object", "$ref": "#\x00"}, {"type": "object", "$ref": "#/" + "a/" * 200},
    {"type": "object", "$dynamicRef": 5}, {"type": "object", "$dynamicRef": "#meta"},
    {"type": "object", "$anchor": 5}, {"type": "object", "$anchor": "bad anchor", "$ref": "#bad anchor"},
    {"type": "object", "$vocabulary": 5}, {"type": "object", "$vocabulary": {"x": True}},
    {"type": "object", "$schema": DRAFT2019, "$recursiveAnchor": 5},
    {"type": "object", "$schema": DRAFT2019, "$recursiveRef": "#"},
    {"type": "object", "format": 5}, {"type": "object", "format": "date-time"}, {"type": "object", "pattern": 5},
    {"type": "object", "required": 5}, {"type": 5}, {"type": "object", "properties": 5},
    {"type": "object", "items": 5}, {"type": "object", "$defs": 5}, {"type": "object", "enum": 5},
    {"type": "object", "multipleOf": 0}, {"type": "object", "minimum": "x"},
    {"type": "object", "dependentSchemas": {"a": 5}}, {"type": "object", "propertyNames": {"$id": []}},
    {"type": "object", "unevaluatedProperties": {"$id": 5}}, {"type": "object", "if": {"$id": 1}},
    {"type": "object", "x-vendor": {"$id": 5}}, {"type": "object", "": {}}, {"type": "object", "$comment": 5},
    {"type": "object", "$schema": DRAFT7, "dependencies": {"a": 5}},
    {"type": "object", "properties": {"a": {"pattern": "(?=a)"}}},
    {"type": "object", "properties": {"a": {"pattern": "("}}},
    {"type": "object", "$schema": {"$schema": {"$schema": 5}}},
    {"type": "object", "allOf": [{"$ref": "#"}] * 3},
    {"type": "object", "$ref": "#/a", "a": None}, {"type": "object", "$ref": "#/a/0", "a": 5},
    {"type": "object", "$ref": "#/required/0", "required": ["x"]}, {"definitions": [{"$ref": "#/definitions/a"}]},
]


@pytest.mark.parametrize("schema", HOSTILE, ids=lambda s: json.dumps(s)[:60])
def test_no_odd_schema_makes_the_check_raise_anything_but_invalid_input(schema):
    _refused_or_usable(schema)


_keywords = st.sampled_from([
    "$schema", "$id", "$ref", "$anchor", "$dynamicAnchor", "$dynamicRef", "$defs", "definitions", "id",
    "type", "properties", "items", "prefixItems", "allOf", "anyOf", "oneOf", "not", "if", "then", "format",
    "pattern", "enum", "const", "required", "additionalProperties", "dependentSchemas", "$recursiveRef",
    "$recursiveAnchor", "$vocabulary", "dependencies", "propertyNames", "a",
])
_strings = st.sampled_from([
    "", "#", "#/$defs/a", "#/definitions/a", "#a", "a", DRAFT3, DRAFT4, DRAFT7, DRAFT2019, DRAFT2020, "urn:x",
    "string", "object", "date-time", "uuid", "phone", "^a+$", "#/properties/a", "#/%ZZ", "http://x.example/y#z",
    "#/a", "#/a/0", "#/required/0",
])
_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), _strings)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(_keywords, inner, max_size=4)),
    max_leaves=12,
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(_keywords, _values, max_size=5))
def test_no_generated_schema_makes_the_check_raise_anything_but_invalid_input(schema):
    _refused_or_usable(schema)


def _refused_or_usable(schema: Any) -> None:
    """check_any_schema refuses `schema` with InvalidInput, or accepts it and a validator built
    from it checks values returning problems only; nothing is logged as unforeseen."""
    with capture_logs() as logs, warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            check_any_schema(schema, where="$.output_schema")
        except InvalidInput as exc:
            assert str(exc) and exc.path.startswith("$.output_schema")
        else:
            validator = ArgumentValidator(schema)
            for value in ({}, {"a": "x"}, [1, "a"], "2026-07-01", 5, None):
                assert all(isinstance(p, str) for p in validator.errors(value))
    assert [e for e in logs if e["event"] == "schema_unreadable"] == []


@pytest.mark.parametrize("schema", [
    {"type": "object", "$id": 5},
    {"type": "object", "$ref": "#/properties/a", "properties": {"a": {"$id": 5}}},
])
def test_a_schema_stored_before_it_was_checked_is_an_in_band_problem_not_an_exception(schema):
    with capture_logs() as logs:
        problems = ArgumentValidator(schema).errors({"a": "x"})
    assert problems and "the schema cannot be read" in problems[0]
    assert [e["event"] for e in logs] == ["schema_unreadable"]


# --------------------------------------------------------------------------- formats

#: for every standard format: an answer that is one, and one that is not
FORMAT_CASES = {
    "date-time": ("2026-07-01T09:30:00Z", "next tuesday, after lunch"),
    "date": ("2026-07-01", "2026-02-30"),
    "time": ("09:30:00Z", "25:61"),
    "duration": ("P3DT4H", "three days"),
    "email": ("ann@example.com", "ann at example"),
    "idn-email": ("ann@bücher.example", "ann at example"),
    "hostname": ("shop.example.com", "-not a host-"),
    "idn-hostname": ("bücher.example", "-not a host-"),
    "ipv4": ("192.0.2.1", "999.1.1.1"),
    "ipv6": ("2001:db8::1", "2001:::1"),
    "uri": ("https://shop.example/x", "not a url at all"),
    "uri-reference": ("/orders/1?x=1", "http://[bad"),
    "iri": ("https://bücher.example/", "not an iri"),
    "iri-reference": ("/bücher", "http://[bad"),
    "uuid": ("123e4567-e89b-12d3-a456-426614174000", "not-a-uuid"),
    "uri-template": ("https://x.example/{id}", "https://x.example/{id"),
    "json-pointer": ("/a/b", "a/b"),
    "relative-json-pointer": ("0/a", "/a"),
    "regex": ("^a+$", "(unclosed"),
}


def test_the_cases_cover_every_standard_format():
    assert set(FORMAT_CASES) == STANDARD_FORMATS


@pytest.mark.parametrize("dialect", [None, DRAFT3, DRAFT4, DRAFT6, DRAFT7, DRAFT2019, DRAFT2020])
def test_the_checker_the_engine_uses_checks_every_standard_format_in_every_dialect(dialect):
    schema = {"$schema": dialect} if dialect else {}
    missing = STANDARD_FORMATS - checked_formats(schema)
    assert not missing, f"formats accepted in a schema but not checked: {sorted(missing)}"


@pytest.mark.parametrize("dialect", [None, DRAFT4, DRAFT6, DRAFT7, DRAFT2019, DRAFT2020])
@pytest.mark.parametrize("fmt", sorted(FORMAT_CASES))
def test_an_answer_that_breaks_its_declared_format_is_refused_and_one_that_keeps_it_passes(fmt, dialect):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "format": fmt}}}
    if dialect:
        schema["$schema"] = dialect
    check_schema(schema, where="$")  # the form saves
    good, bad = FORMAT_CASES[fmt]
    validator = ArgumentValidator(schema, all_sensitive=True)
    assert validator.errors({"answer": good}) == []
    assert validator.errors({"answer": bad}) == [f"'answer': the value is not a valid {fmt!r}"]


def test_next_tuesday_is_not_a_date_time_answer():
    form = {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string"}, "callback_at": {"type": "string", "format": "date-time"}}}
    problems = ArgumentValidator(form, all_sensitive=True).errors({"name": "Ann", "callback_at": "next tuesday"})
    assert problems == ["'callback_at': the value is not a valid 'date-time'"]  # the answer is not repeated


def test_a_standard_format_this_host_cannot_check_is_refused_when_saved_naming_the_formats_it_checks():
    """On a host where jsonschema's format libraries are missing (the project without its
    `jsonschema[format-nongpl]` dependency), a date-time field is refused at save instead of
    letting "next tuesday" through; a format those libraries do not decide (email) still saves."""
    code = """
import sys
for name in ("rfc3339_validator", "rfc3986_validator", "rfc3987_syntax", "fqdn", "idna", "isoduration",
             "jsonpointer", "uri_template", "webcolors"):
    sys.modules[name] = None  # as if not installed: importing it raises ImportError
from kernel.errors import InvalidInput
from services.tools.validation import check_schema
check_schema({"type": "object", "properties": {"e": {"type": "string", "format": "email"}}}, where="$")
try:
    check_schema({"type": "object", "properties": {"at": {"type": "string", "format": "date-time"}}}, where="$")
except InvalidInput as exc:
    print(exc.path)
    print(exc)
"""
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr
    path, message = done.stdout.splitlines()
    assert path == "$.properties.at.format"
    assert "format 'date-time' is a standard format, but this host cannot check it" in message
    assert "the formats checked are date, email," in message


def test_a_format_the_engine_does_not_know_is_an_annotation_unless_only_checked_ones_are_asked_for():
    schema = {"type": "object", "properties": {"phone": {"type": "string", "format": "phone"}}}
    check_schema(schema)  # JSON Schema: an unknown format is not checked (an MCP server's `binary`...)
    assert ArgumentValidator(schema).errors({"phone": "anything"}) == []
    with pytest.raises(InvalidInput, match=r"format 'phone' is not a format this engine checks; use a `pattern`"
                                           r" for it; the formats checked are date, date-time, ") as info:
        check_schema(schema, where="$", checked_formats_only=True)
    assert info.value.path == "$.properties.phone.format"
    check_schema({"type": "object", "properties": {"at": {"type": "string", "format": "date-time"}}},
                 checked_formats_only=True)


# --------------------------------------------------------------------------- catalog invalidation


class GatedConfigs:
    """Bot configs whose read for a tenant in `held` waits until `gate` is set."""

    def __init__(self, *held: str) -> None:
        self.held = set(held)
        self.gate = asyncio.Event()
        self.reading = asyncio.Event()

    async def get(self, tenant_id: str) -> dict:
        if tenant_id in self.held:
            self.reading.set()
            await self.gate.wait()
        return {}


async def _no_builtins(tenant_id: str) -> tuple:
    return ()


def _catalogs(configs: Any) -> TenantCatalogs:
    return TenantCatalogs(tools=FakeTools(), configs=configs, registry=HandlerRegistry(),
                          backend_for=lambda config: None, builtins=_no_builtins, llm=None, executor=None,
                          main_model="main", cheap_model="cheap")


async def _load_held(catalogs: TenantCatalogs, configs: GatedConfigs, tenant: str) -> asyncio.Task:
    loading = asyncio.create_task(catalogs.env_for(tenant))
    await asyncio.wait_for(configs.reading.wait(), 5)
    return loading


async def test_invalidating_one_tenant_keeps_no_other_tenants_load_out_of_the_cache():
    configs = GatedConfigs("slow")
    catalogs = _catalogs(configs)
    loading = await _load_held(catalogs, configs, "slow")
    catalogs.invalidate("other")  # its tools changed, or its MCP retry timer fired
    configs.gate.set()
    first = await asyncio.wait_for(loading, 5)
    assert await catalogs.env_for("slow") is first and catalogs.reloads == 1
    # the tenant's own invalidation (or everyone's) still keeps a load running then out of the cache
    for invalidated in ("slow", None):
        configs.gate.clear()
        configs.reading.clear()
        catalogs.invalidate("slow")
        reloads = catalogs.reloads
        loading = await _load_held(catalogs, configs, "slow")
        catalogs.invalidate(invalidated)  # the rows it read may be from before the change
        configs.gate.set()
        read_before = await asyncio.wait_for(loading, 5)
        assert await catalogs.env_for("slow") is not read_before and catalogs.reloads == reloads + 2


async def test_nothing_is_kept_per_tenant_once_its_loads_are_over():
    configs = GatedConfigs("slow")
    catalogs = _catalogs(configs)
    for tenant in (f"t{i}" for i in range(50)):
        await catalogs.env_for(tenant)
        catalogs.invalidate(tenant)
    loading = await _load_held(catalogs, configs, "slow")
    assert list(catalogs._running) == ["slow"]
    loading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await loading
    assert catalogs._running == {}


# --------------------------------------------------------------------------- session host waiters


@pytest.mark.parametrize("gives_up", ["timeout", "cancel"])
async def test_views_that_give_up_while_the_database_is_away_leave_no_waiter_behind(gives_up):
    store, tenants = FakeSessionStore(), FakeTenants()
    host = SessionHost(name="h1", store=store, tenants=tenants,
                       settings=HostSettings(gate_timeout_s=0.001 if gives_up == "timeout" else 30.0,
                                             max_backoff_s=0.05))
    await host.start()
    try:
        store.down = True
        send = asyncio.create_task(host.send(Turn(tenant_id="t1", session_id="s1", text="hello", message_id="m1")))
        if gives_up == "timeout":
            with pytest.raises(Overloaded):
                await asyncio.wait_for(send, 5)
        else:  # the reply waits at the gate
            async with asyncio.timeout(5):
                while not host._waiters.get(("t1", "s1")):
                    await asyncio.sleep(0.005)
        for _ in range(300):  # a client polling GET /v1/sessions/s1 during the outage
            if gives_up == "timeout":
                with pytest.raises(Overloaded, match="could not be saved yet"):
                    await host.view("t1", "s1")
            else:
                view = asyncio.create_task(host.view("t1", "s1"))
                await asyncio.sleep(0)
                view.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await view
        kept = len(host._waiters.get(("t1", "s1"), []))
        assert kept <= 1, f"{kept} abandoned waiters kept for one session"  # at most the reply's own
        store.down = False
        if gives_up == "cancel":
            reply = await asyncio.wait_for(send, 5)  # the reply still waits, and is released once saved
            assert reply.reply
        await asyncio.wait_for(host.flush_all(), 5)
        assert (await asyncio.wait_for(host.view("t1", "s1"), 5)).messages >= 2
        assert host._waiters == {}
    finally:
        store.down = False
        await asyncio.wait_for(host.stop(), 10)
