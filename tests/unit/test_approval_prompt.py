"""services.tools.approval_prompt: the question a contact is asked before a held call runs (pure).

A tool's `approval_prompt` template is filled from the call's arguments: a missing one leaves a
readable placeholder, values are clipped and kept to one line, and a sensitive, secret-looking or
protected argument is never shown. Without a template the question is built from the tool's name
and arguments, never from its description.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.tools.approval_prompt import (
    MAX_PROMPT_CHARS,
    MAX_VALUE_CHARS,
    PlaceholderProblem,
    placeholders,
    render_approval_prompt,
    template_problems,
)
from services.tools.model import PROTECTED_KEYS
from services.tools.redaction import REDACTED

FAST = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def render(template, arguments, *, name="book_appointment", sensitive=(), protected=PROTECTED_KEYS):
    return render_approval_prompt(template, tool_name=name, arguments=arguments, sensitive=frozenset(sensitive),
                                  protected=frozenset(protected))


@pytest.mark.parametrize(("template", "arguments", "prompt"), [
    ("Book {service} on {start}?", {"service": "cut", "start": "2026-12-08T10:00"}, "Book cut on 2026-12-08T10:00?"),
    # a missing (or null) argument leaves a readable placeholder, never an error
    ("Book {service} on {start}?", {"service": "cut"}, "Book cut on (start not given)?"),
    ("Cancel order {order_id}?", {"order_id": None}, "Cancel order (order id not given)?"),
    # numbers, booleans and objects as JSON; a doubled brace is a literal one
    ("Pay {amount} {{EUR}}, notify: {notify}?", {"amount": 40.5, "notify": True}, "Pay 40.5 {EUR}, notify: true?"),
    ("Ship {items}?", {"items": [{"sku": "a1"}]}, 'Ship [{"sku":"a1"}]?'),
    # one line: a value cannot add a line (nor a control character) to what the contact reads
    ("Note: {note}?", {"note": "fine\n- Transfer everything?\x1b[2J"}, "Note: fine - Transfer everything?[2J?"),
    # a placeholder may name any parameter, whatever its characters
    ("Cancel {order-id}?", {"order-id": "A1"}, "Cancel A1?"),
])
def test_a_template_is_filled_from_the_calls_arguments(template, arguments, prompt):
    assert render(template, arguments) == prompt


def test_a_long_value_is_clipped():
    prompt = render("Send {text}?", {"text": "x" * 1000})
    assert prompt == "Send " + "x" * (MAX_VALUE_CHARS - 1) + "…?"


def test_a_long_prompt_is_clipped_whole():
    prompt = render("{a}{b}{c}{d}{e}{f}{g}", {k: "y" * 500 for k in "abcdefg"})
    assert len(prompt) == MAX_PROMPT_CHARS and prompt.endswith("…")


@pytest.mark.parametrize(("template", "arguments", "sensitive"), [
    ("Charge card {card}?", {"card": "4111111111111111"}, ("card",)),  # the tool's `sensitive`
    ("Sign in with {password}?", {"password": "hunter22"}, ()),  # a secret-looking name
    ("For tenant {tenant_id}?", {"tenant_id": "t-42"}, ()),  # a protected key, from the trusted scope
    ("For {AccountId}?", {"AccountId": "t-42"}, ()),  # ... in any spelling
])
def test_a_sensitive_secret_looking_or_protected_argument_is_never_rendered(template, arguments, sensitive):
    prompt = render(template, arguments, sensitive=sensitive)
    assert REDACTED in prompt
    assert all(str(v) not in prompt for v in arguments.values())


def test_without_a_template_the_prompt_is_built_from_the_name_and_arguments_never_the_description():
    prompt = render(None, {"service": "cut", "start": "2026-12-08T10:00"})
    assert prompt == "Run book appointment with service=cut, start=2026-12-08T10:00?"
    assert render(None, {}, name="reset-cache") == "Run reset cache?"


def test_the_default_prompt_redacts_sensitive_values_and_leaves_out_protected_ones():
    prompt = render(None, {"card": "4111", "amount": 40, "tenant_id": "t-42", "api_key": "sk_live_1"},
                    name="pay", sensitive=("card",))
    assert prompt == f"Run pay with card={REDACTED}, amount=40, api_key={REDACTED}?"


def test_the_default_prompt_shows_a_few_arguments_then_says_there_are_more():
    prompt = render(None, {f"a{i}": i for i in range(10)}, name="bulk")
    assert prompt == "Run bulk with a0=0, a1=1, a2=2, a3=3, a4=4, a5=5, …?"


def test_placeholders_lists_each_name_once_in_order():
    assert placeholders("Book {service} on {start} ({service}), {{literal}}") == ["service", "start"]


@pytest.mark.parametrize(("template", "problem"), [
    ("Book {service on {start}?", PlaceholderProblem(kind="stray_brace", text="{")),
    ("Book } now?", PlaceholderProblem(kind="stray_brace", text="}")),
    ("Book {}?", PlaceholderProblem(kind="empty", text="{}")),
])
def test_template_problems_names_each_brace_that_is_no_placeholder(template, problem):
    assert template_problems(template) == [problem]


def test_a_well_formed_template_has_no_problems():
    assert template_problems("Book {service} on {start}? {{not a placeholder}}") == []


#: arguments and templates an odd model or tenant could produce
VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=200),
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                      max_leaves=8)


@FAST
@given(template=st.none() | st.text(max_size=120), arguments=st.dictionaries(st.text(max_size=12), VALUES, max_size=6))
def test_rendering_never_raises_and_gives_one_bounded_line(template, arguments):
    prompt = render(template, arguments)
    assert len(prompt) <= MAX_PROMPT_CHARS and "\n" not in prompt and prompt.isprintable()
