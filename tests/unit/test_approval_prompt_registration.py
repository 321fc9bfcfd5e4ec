"""A tool's `approval_prompt` as registration takes it (services.gateway.bodies, pure): kept on
the definition, shown in its view, and refused with a 422-style InvalidInput at
`$.approval_prompt` when no call could fill it as written or it names a value never shown."""

from __future__ import annotations

import msgspec
import pytest

from kernel.errors import InvalidInput
from services.gateway.bodies import (
    ToolCreate,
    ToolPatch,
    definition_from_body,
    patched_body,
    tool_view,
)

PARAMETERS = {"service": {"type": "string"}, "start": {"type": "string"}, "card": {"type": "string"},
              "password": {"type": "string"}, "tenant_id": {"type": "string"}, "ref": {"type": "string"}}


def body(**fields) -> ToolCreate:
    fields.setdefault("approval_prompt", "Book {service} on {start}?")
    return ToolCreate(name="book", description="Book a slot.", webhook_url="https://example.com/book",
                      mutability="write", parameters=PARAMETERS, sensitive=["card"], protected=["ref"], **fields)


def test_a_template_is_kept_on_the_definition_and_shown_in_its_view():
    definition = definition_from_body(body(), encrypt=str)
    assert definition.approval_prompt == "Book {service} on {start}?"
    assert tool_view(msgspec.to_builtins(definition))["approval_prompt"] == "Book {service} on {start}?"


def test_without_a_template_the_view_shows_null_even_for_a_definition_stored_before_the_field():
    stored = msgspec.to_builtins(definition_from_body(body(approval_prompt=None), encrypt=str))
    assert tool_view(stored)["approval_prompt"] is None
    del stored["approval_prompt"]  # as a definition stored before the field was
    view = tool_view(stored, version=1)
    assert view["approval_prompt"] is None
    merged, _ = patched_body(stored, ToolPatch(approval_prompt="Book {service}?"))  # a PATCH takes it
    assert definition_from_body(merged, encrypt=str).approval_prompt == "Book {service}?"


@pytest.mark.parametrize(("template", "message"), [
    ("Book {servce} on {start}?", (r"uses \{servce\}, but parameters has no 'servce' \(it has: card, password, ref, "
                                  r"service, start, tenant_id\); name one of the parameters, or take \{servce\} out")),
    ("Charge {card}?", (r"uses \{card\}, whose value is never shown to the contact \(`sensitive` lists it\); take "
                       r"\{card\} out of approval_prompt")),
    ("Sign in as {password}?", r"\(its name looks like a credential\)"),
    ("For {tenant_id}?", r"\{tenant_id\}, whose value is never shown .*\(only the trusted context fills it\)"),
    ("Order {ref}?", r"\(only the trusted context fills it\)"),  # the tool's own `protected`
    ("Book {service on {start}?", r"has a '\{' that is part of no placeholder; .* a literal brace as '\{\{' or '\}\}'"),
    ("Book {}?", r"has an empty placeholder '\{\}'"),
    ("Book {service}?\nReply yes", r"holds a line break or another control character; write it as one line"),
    ("   ", r"approval_prompt is blank; .* leave it out \(null\)"),
    ("x" * 301, r"approval_prompt is 301 characters, at most 300"),
])
def test_a_template_no_call_could_fill_as_written_is_refused_naming_the_field_and_the_fix(template, message):
    with pytest.raises(InvalidInput, match=message) as caught:
        definition_from_body(body(approval_prompt=template), encrypt=str)
    assert caught.value.path == "$.approval_prompt"
    assert str(caught.value).endswith("- at `$.approval_prompt`")


def test_a_patch_dropping_a_parameter_the_template_names_is_refused():
    stored = msgspec.to_builtins(definition_from_body(body(), encrypt=str))
    merged, _ = patched_body(stored, ToolPatch(parameters={"service": {"type": "string"}}, sensitive=[], protected=[]))
    with pytest.raises(InvalidInput, match=r"uses \{start\}, but parameters has no 'start' \(it has: service\)"):
        definition_from_body(merged, encrypt=str)


def test_a_patch_making_a_named_parameter_sensitive_is_refused():
    stored = msgspec.to_builtins(definition_from_body(body(), encrypt=str))
    merged, _ = patched_body(stored, ToolPatch(sensitive=["card", "start"]))
    with pytest.raises(InvalidInput, match=r"uses \{start\}, whose value is never shown .*`sensitive` lists it"):
        definition_from_body(merged, encrypt=str)


def test_a_patch_to_null_goes_back_to_the_default_question():
    stored = msgspec.to_builtins(definition_from_body(body(), encrypt=str))
    merged, _ = patched_body(stored, ToolPatch(approval_prompt=None))
    assert definition_from_body(merged, encrypt=str).approval_prompt is None
