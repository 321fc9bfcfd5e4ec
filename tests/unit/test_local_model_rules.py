"""The local model's rules (app.local_model_rules): markers, tool choice, argument extraction,
replies to tool results. Pure: no server, no SDK."""

from __future__ import annotations

from datetime import date
from typing import Any

import pytest

from app.local_model_rules import (
    HANDOFF_MARKER,
    RuleReply,
    estimate_tokens,
    extract_arguments,
    parse_call_lines,
    relay_error,
    respond,
    summarise_result,
)
from services.llm.port import (
    ChatMessage,
    LLMRequest,
    TextBlock,
    ToolResultBlock,
    ToolSpec,
    ToolUseBlock,
)

TODAY = date(2026, 12, 2)  # a Wednesday
PERSONA = "You are Mia, the assistant of Acme Store. Be brief and friendly."


def tool(
    name: str, description: str, properties: dict[str, Any], required: list[str] | None = None
) -> ToolSpec:
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    return ToolSpec(name=name, description=description, input_schema=schema)


CHECK_ORDER = tool(
    "check_order",
    "Look up a customer order by order number. Use when customer asks about their order status.",
    {"order_id": {"type": "string", "description": "The order number"}},
    ["order_id"],
)
BOOK = tool(
    "book_appointment",
    "Book an appointment for the customer.",
    {
        "name": {"type": "string"},
        "email": {"type": "string"},
        "start_time": {"type": "string", "description": "Date and time, ISO 8601"},
    },
    ["name", "start_time"],
)
LEAD = tool(
    "collect_lead",
    "Capture a sales lead with name, email and phone.",
    {"name": {"type": "string"}, "email": {"type": "string"}, "phone": {"type": "string"}},
    ["name"],
)
ESCALATE = tool(
    "escalate_to_human",
    "Hand the conversation to a human.",
    {"reason": {"type": "string"}},
    ["reason"],
)
MEMORY = tool(
    "recall_memory",
    "Search what the customer told us in earlier conversations.",
    {"query": {"type": "string"}},
    ["query"],
)
ALL_TOOLS = [CHECK_ORDER, BOOK, LEAD, ESCALATE, MEMORY]


def user(text: str) -> ChatMessage:
    return ChatMessage(role="user", content=[TextBlock(text=text)])


def ask(text: str, tools: list[ToolSpec] = ALL_TOOLS, **kw: Any) -> RuleReply:
    request = LLMRequest(model="local", system=PERSONA, messages=[user(text)], tools=tools, **kw)
    return respond(request, today=TODAY)


def only_text(reply: RuleReply) -> str:
    assert reply.stop_reason == "end_turn"
    assert len(reply.content) == 1 and isinstance(reply.content[0], TextBlock), reply.content
    return reply.content[0].text


def tool_uses(reply: RuleReply) -> list[ToolUseBlock]:
    assert reply.stop_reason == "tool_use"
    assert all(isinstance(b, ToolUseBlock) for b in reply.content), reply.content
    return reply.content  # type: ignore[return-value]


# -- /call lines ------------------------------------------------------------------------------


def test_one_call_line_emits_exactly_that_tool_call():
    [call] = tool_uses(ask('/call check_order {"order_id": "A-1"}'))
    assert call.name == "check_order"
    assert call.input == {"order_id": "A-1"}
    assert call.id.startswith("toolu_") and len(call.id) > 10


def test_several_call_lines_emit_several_calls_in_one_response_in_order():
    reply = ask(
        'please run these\n/call check_order {"order_id": "1"}\n'
        '/call collect_lead {"name": "Ada", "tags": ["vip"], "n": 2}\n  /call check_order {"order_id": "2"}'
    )
    calls = tool_uses(reply)
    assert [(c.name, c.input) for c in calls] == [
        ("check_order", {"order_id": "1"}),
        ("collect_lead", {"name": "Ada", "tags": ["vip"], "n": 2}),
        ("check_order", {"order_id": "2"}),
    ]
    assert len({c.id for c in calls}) == 3


def test_call_ids_are_deterministic_for_the_same_conversation():
    first = tool_uses(
        ask('/call check_order {"order_id": "1"}\n/call check_order {"order_id": "1"}')
    )
    again = tool_uses(
        ask('/call check_order {"order_id": "1"}\n/call check_order {"order_id": "1"}')
    )
    assert [c.id for c in first] == [c.id for c in again]
    assert first[0].id != first[1].id


def test_call_line_may_name_a_tool_that_is_not_offered():
    [call] = tool_uses(ask('/call no_such_tool {"x": 1}', tools=[]))
    assert call.name == "no_such_tool" and call.input == {"x": 1}


def test_call_line_without_json_calls_with_empty_input():
    [call] = tool_uses(ask("/call check_order"))
    assert call.input == {}


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ('/call check_order {"order_id": ', "not valid JSON"),
        ("/call check_order [1, 2]", "must be a JSON object"),
        ("/call", "names no tool"),
    ],
)
def test_malformed_call_line_gets_a_text_reply_naming_the_line(line: str, problem: str):
    text = only_text(ask(f'/call check_order {{"order_id": "1"}}\n{line}'))
    assert "could not parse" in text
    assert line.strip() in text
    assert problem in text


def test_parse_call_lines_ignores_other_lines():
    assert parse_call_lines("hello\n/callme maybe\nnot /call x {}") == []


def test_tool_choice_none_never_emits_a_tool_call():
    reply = ask('/call check_order {"order_id": "1"}', tool_choice="none")
    assert reply.stop_reason == "end_turn"
    assert not any(isinstance(b, ToolUseBlock) for b in reply.content)
    reply = ask("where is my order 12345?", tool_choice="none")
    assert not any(isinstance(b, ToolUseBlock) for b in reply.content)


# -- handoff ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text", ["please [[HANDOFF]] now", "/handoff", "I need help\n/handoff billing"]
)
def test_handoff_marker_or_command_gets_a_reply_with_the_marker(text: str):
    assert HANDOFF_MARKER in only_text(ask(text))


def test_asking_for_a_human_calls_escalate_to_human_with_the_text_as_reason():
    [call] = tool_uses(ask("I want to talk to a real person about my order"))
    assert call.name == "escalate_to_human"
    assert call.input == {"reason": "I want to talk to a real person about my order"}


def test_asking_for_a_human_without_the_escalation_tool_calls_nothing():
    reply = ask("can I speak to an agent?", tools=[CHECK_ORDER])
    assert reply.stop_reason == "end_turn"
    assert HANDOFF_MARKER not in only_text(reply)


# -- choosing a tool from text ----------------------------------------------------------------


def test_keyword_match_picks_the_tool_and_extracts_the_order_id():
    [call] = tool_uses(ask("Hi, where is my order 12345?"))
    assert call.name == "check_order"
    assert call.input == {"order_id": "12345"}


def test_integer_parameter_is_extracted_as_an_integer():
    order = tool("check_order", "Look up an order", {"order_id": {"type": "integer"}}, ["order_id"])
    [call] = tool_uses(ask("status of order #778899 please", tools=[order]))
    assert call.input == {"order_id": 778899}


def test_missing_required_parameter_is_asked_for_instead_of_calling():
    text = only_text(ask("where is my order?"))
    assert "the order number" in text and text.endswith("?")


def test_several_missing_parameters_are_all_asked_for():
    text = only_text(ask("I'd like to book an appointment", tools=[BOOK]))
    assert text == "I can help with that. Could you tell me your name and your start time?"


def test_booking_fills_name_email_and_relative_date_time():
    [call] = tool_uses(
        ask(
            "Book an appointment tomorrow at 10 please, my name is Ada Lovelace, ada@example.com",
            tools=[BOOK],
        )
    )
    assert call.name == "book_appointment"
    assert call.input == {
        "name": "Ada Lovelace",
        "email": "ada@example.com",
        "start_time": "2026-12-03T10:00:00",
    }


def test_lead_with_phone_number():
    [call] = tool_uses(
        ask(
            "I'm interested! This is Grace Hopper, phone +1 (555) 010-9999, email grace@navy.mil",
            tools=[LEAD],
        )
    )
    assert call.name == "collect_lead"
    assert call.input == {
        "name": "Grace Hopper",
        "email": "grace@navy.mil",
        "phone": "+1 (555) 010-9999",
    }


def test_equal_scores_break_ties_by_tool_name():
    a = tool("zeta_order", "order things", {})
    b = tool("alpha_order", "order things", {})
    [call] = tool_uses(ask("an order please", tools=[a, b]))
    assert call.name == "alpha_order"


def test_name_words_weigh_more_than_description_words():
    by_name = tool("refund_payment", "Give money back", {})
    by_description = tool("adjust", "Refund or credit a payment", {})
    [call] = tool_uses(ask("I want a refund", tools=[by_description, by_name]))
    assert call.name == "refund_payment"


def test_nothing_matching_gets_a_friendly_reply_in_the_persona():
    text = only_text(ask("what's the weather like on mars"))
    assert text.startswith("Hi, I'm Mia, the assistant of Acme Store.")


def test_greeting_without_persona():
    reply = respond(LLMRequest(model="m", system="", messages=[user("hello")]), today=TODAY)
    assert only_text(reply) == "Hi! How can I help you today?"


# -- argument extraction ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prop_name", "prop", "text", "expected"),
    [
        ("order_id", {"type": "string"}, "my order number is 555-A1", "555-A1"),
        ("order_id", {"type": "string"}, "order: X9Y8Z7", "X9Y8Z7"),
        ("booking_ref", {"type": "string"}, "I booked, ref 4567", "4567"),
        (
            "email",
            {"type": "string"},
            "reach me at ada.l+shop@example.co.uk thanks",
            "ada.l+shop@example.co.uk",
        ),
        ("contact", {"type": "string", "format": "email"}, "it's bob@x.io", "bob@x.io"),
        ("phone", {"type": "string"}, "my number is 020 7946 0958", "020 7946 0958"),
        ("name", {"type": "string"}, "Hello, my name is Ada Lovelace.", "Ada Lovelace"),
        ("first_name", {"type": "string"}, "I'm Ada Lovelace", "Ada"),
        ("last_name", {"type": "string"}, "I'm Ada Lovelace", "Lovelace"),
        (
            "start_time",
            {"type": "string", "format": "date-time"},
            "on 2026-12-03 10:00",
            "2026-12-03T10:00:00",
        ),
        ("datetime", {"type": "string"}, "2026-12-24T09:30 please", "2026-12-24T09:30:00"),
        ("date", {"type": "string"}, "tomorrow works", "2026-12-03"),
        ("date", {"type": "string"}, "the day after tomorrow", "2026-12-04"),
        ("date", {"type": "string"}, "on friday", "2026-12-04"),
        ("date", {"type": "string"}, "next wednesday", "2026-12-09"),
        ("time", {"type": "string"}, "at 3pm", "15:00"),
        ("time", {"type": "string"}, "at 3", "15:00"),
        ("time", {"type": "string"}, "10:45 would be great", "10:45"),
        ("when", {"type": "string"}, "tomorrow at 9am", "2026-12-03T09:00:00"),
        (
            "query",
            {"type": "string"},
            "  what did I say about my dog?  ",
            "what did I say about my dog?",
        ),
        ("reason", {"type": "string"}, "the bot is useless", "the bot is useless"),
        ("size", {"type": "string", "enum": ["small", "large"]}, "a LARGE one", "large"),
        ("city", {"type": "string"}, "my city is Paris, thanks", "Paris"),
        ("quantity", {"type": "integer"}, "I need 300 of them", 300),
    ],
)
def test_argument_extraction(prop_name: str, prop: dict, text: str, expected: Any):
    args, missing = extract_arguments(
        {"type": "object", "properties": {prop_name: prop}, "required": [prop_name]},
        text,
        today=TODAY,
    )
    assert args == {prop_name: expected}
    assert missing == []


@pytest.mark.parametrize(
    ("prop_name", "prop", "text"),
    [
        ("order_id", {"type": "string"}, "where is my order?"),
        ("email", {"type": "string"}, "my email is ada at example dot com"),
        ("phone", {"type": "string"}, "call me at 12345"),
        ("name", {"type": "string"}, "i am hungry"),
        ("date", {"type": "string"}, "sometime soon"),
        ("size", {"type": "string", "enum": ["small", "large"]}, "medium"),
        ("subscribed", {"type": "boolean"}, "yes subscribe me"),
    ],
)
def test_argument_extraction_reports_what_is_missing(prop_name: str, prop: dict, text: str):
    args, missing = extract_arguments(
        {"type": "object", "properties": {prop_name: prop}, "required": [prop_name]},
        text,
        today=TODAY,
    )
    assert args == {} and missing == [prop_name]


def test_relative_dates_need_today():
    args, missing = extract_arguments(
        {"type": "object", "properties": {"date": {"type": "string"}}, "required": ["date"]},
        "tomorrow",
        today=None,
    )
    assert args == {} and missing == ["date"]


# -- replies to tool results ------------------------------------------------------------------


def after_results(
    calls: list[ToolUseBlock], results: list[ToolResultBlock], opening: str = "hi", **kw: Any
) -> RuleReply:
    messages = [
        user(opening),
        ChatMessage(role="assistant", content=list(calls)),
        ChatMessage(role="user", content=list(results)),
    ]
    return respond(
        LLMRequest(model="m", system=PERSONA, messages=messages, tools=ALL_TOOLS, **kw), today=TODAY
    )


def call(id_: str, name: str, **args: Any) -> ToolUseBlock:
    return ToolUseBlock(id=id_, name=name, input=args)


def test_success_result_is_summarised_with_the_called_id_and_flat_fields():
    reply = after_results(
        [call("t1", "check_order", order_id="12345")],
        [
            ToolResultBlock(
                tool_use_id="t1",
                content='{"order_id": "12345", "status": "shipped", "eta": "2026-12-05", "lines": [1, 2], "x": {"y": 1}}',
            )
        ],
    )
    assert only_text(reply) == "Order 12345: status: shipped, eta: 2026-12-05, lines: 2 items."


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ('{"lead_id": "L1", "saved": true}', "Collect lead: lead_id: L1, saved: yes."),
        ("{}", "Collect lead: done."),
        ("saved it", "Collect lead: saved it."),
        (
            '[{"text": "has a dog"}, {"text": "likes tea"}]',
            "Collect lead: 2 results - text: has a dog | text: likes tea.",
        ),
        ("[]", "Collect lead: no results."),
        ('"ok"', "Collect lead: ok."),
    ],
)
def test_summaries_of_result_shapes(content: str, expected: str):
    assert summarise_result("collect_lead", {"name": "Ada"}, content) == expected


def test_error_result_is_relayed_the_way_its_advice_asks():
    reply = after_results(
        [call("t1", "check_order", order_id="12345")],
        [
            ToolResultBlock(
                tool_use_id="t1",
                content="Tool 'check_order' failed: upstream timeout. "
                "Inform the customer you cannot retrieve their order right now.",
                is_error=True,
            )
        ],
    )
    text = only_text(reply)
    assert text.startswith("I'm sorry, I can't retrieve your order right now.")
    assert "try again in a few minutes" in text


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (
            (
                "Tool 'x' failed: upstream status 500. Tell the customer you cannot complete this right now "
                "and offer another way to help."
            ),
            "I'm sorry, I can't complete this right now. Is there anything else I can help you with?",
        ),
        (
            (
                "Tool 'x' failed: invalid arguments: $.order_id is required. Ask the customer for the missing "
                "or corrected details, then call the tool again."
            ),
            (
                "I'm sorry, I couldn't complete that (invalid arguments: $.order_id is required). "
                "Could you give me the missing or corrected details?"
            ),
        ),
        (
            "Tool 'x' failed: declined. Tell the customer it was not done and ask how they would like to proceed.",
            "I'm sorry, it was not done. Could you tell me how you would like to proceed?",
        ),
        (
            "Tool 'x' failed: not found. Ask the customer for their order number.",
            "I'm sorry, I couldn't complete that (not found). Could you give me your order number?",
        ),
        (
            "something broke",
            "I'm sorry, I couldn't complete that (something broke). Is there anything else I can help you with?",
        ),
    ],
)
def test_error_relay_phrasing(content: str, expected: str):
    assert relay_error("x", content) == expected


def test_several_results_are_all_used_in_one_reply():
    reply = after_results(
        [call("a", "check_order", order_id="1"), call("b", "nope")],
        [
            ToolResultBlock(tool_use_id="a", content='{"status": "delivered"}'),
            ToolResultBlock(
                tool_use_id="b",
                content="Tool 'nope' failed: there is no tool named 'nope'. Do not call it again.",
                is_error=True,
            ),
        ],
    )
    text = only_text(reply)
    assert text.startswith("Order 1: status: delivered.")
    assert "no tool named 'nope'" in text


def test_escalation_result_tells_the_customer_someone_will_take_over():
    reply = after_results(
        [call("e", "escalate_to_human", reason="x")],
        [ToolResultBlock(tool_use_id="e", content="{}")],
    )
    assert "member of our team" in only_text(reply)


def test_a_tool_result_never_leads_to_another_call_without_loop():
    opening = '/call check_order {"order_id": "1"}'
    reply = after_results(
        [call("a", "check_order", order_id="1")],
        [ToolResultBlock(tool_use_id="a", content="{}")],
        opening,
    )
    assert reply.stop_reason == "end_turn"


def test_loop_marker_repeats_the_calls_after_every_result():
    opening = '/loop\n/call check_order {"order_id": "1"}\n/call collect_lead {"name": "Ada"}'
    first = tool_uses(ask(opening))
    reply = after_results(
        first, [ToolResultBlock(tool_use_id=c.id, content="{}") for c in first], opening
    )
    again = tool_uses(reply)
    assert [(c.name, c.input) for c in again] == [(c.name, c.input) for c in first]
    assert {c.id for c in again}.isdisjoint({c.id for c in first})


def test_loop_marker_yields_to_tool_choice_none():
    opening = '/loop\n/call check_order {"order_id": "1"}'
    reply = after_results(
        [call("a", "check_order", order_id="1")],
        [ToolResultBlock(tool_use_id="a", content="{}")],
        opening,
        tool_choice="none",
    )
    assert only_text(reply) == "Order 1: done."


# -- usage ------------------------------------------------------------------------------------


def test_usage_is_a_deterministic_quarter_of_the_characters():
    assert (
        estimate_tokens("") == 0 and estimate_tokens("abcd") == 1 and estimate_tokens("abcde") == 2
    )
    request = LLMRequest(model="m", system="s" * 40, messages=[user("u" * 40)])
    reply = respond(request, today=TODAY)
    assert reply.usage.input_tokens == 20
    assert reply.usage.output_tokens == estimate_tokens(only_text(reply))
    assert respond(request, today=TODAY) == reply


def test_usage_counts_tools_and_grows_with_the_conversation():
    short = ask("hello", tools=[])
    with_tools = ask("hello")
    assert 0 < short.usage.input_tokens < with_tools.usage.input_tokens
    longer = respond(
        LLMRequest(
            model="m",
            system=PERSONA,
            messages=[
                user("hello"),
                ChatMessage(role="assistant", content=[TextBlock(text="hi")]),
                user("hello"),
            ],
            tools=[],
        ),
        today=TODAY,
    )
    assert longer.usage.input_tokens > short.usage.input_tokens
