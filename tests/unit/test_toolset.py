"""Seed 000's buildToolSet: the model is offered only tools it may use, for the detected intent."""

from __future__ import annotations

from typing import Any

import pytest

from services.botconfig import BotConfig, Intent
from services.tools.toolset import (
    SessionToolState,
    build_tool_set,
    detect_intent,
    gate_reason,
    tool_specs,
)
from tests.support.fakes import (
    OPEN_SCHEMA,
    ORDER_SCHEMA,
    FakeToolBackend,
    client_tool,
    make_catalog,
    python_tool,
    webhook_tool,
)

NO_STATE = SessionToolState()


def offered_names(config: BotConfig, session: SessionToolState, *tools, intent: str | None = None) -> list[str]:
    return [t.name for t in build_tool_set(config, intent, session, make_catalog(*tools))]


# -- gating: every rule ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "config", "session", "reason"),
    [
        ({}, BotConfig(), NO_STATE, None),
        ({"enabled": False}, BotConfig(), NO_STATE, "this tool is disabled"),
        ({}, BotConfig(allowlist=("other",)), NO_STATE, "this tool is not in the agent's allowlist"),
        ({}, BotConfig(allowlist=()), NO_STATE, "this tool is not in the agent's allowlist"),
        ({}, BotConfig(allowlist=("t", "other")), NO_STATE, None),
        ({}, BotConfig(), SessionToolState(breakers={"t": 3}), "failed too often in this conversation"),
        ({}, BotConfig(), SessionToolState(breakers={"t": 4}), "failed too often in this conversation"),
        ({}, BotConfig(), SessionToolState(breakers={"t": 2}), None),
        ({}, BotConfig(), SessionToolState(breakers={"other": 3}), None),
        ({"mutability": "write"}, BotConfig(allow_writes=False), NO_STATE, "this assistant may not change records"),
        ({"mutability": "read"}, BotConfig(allow_writes=False), NO_STATE, None),
        ({"mutability": "write"}, BotConfig(), NO_STATE, None),
        ({"completes_variable": "lead_collected"}, BotConfig(),
         SessionToolState(variables={"lead_collected": "true"}), "this was already done in this conversation"),
        ({"completes_variable": "order_id_checked"}, BotConfig(),
         SessionToolState(variables={"order_id_checked": "12345"}), "this was already done in this conversation"),
        ({"completes_variable": "lead_collected"}, BotConfig(),
         SessionToolState(variables={"lead_collected": "false"}), None),
        ({"completes_variable": "lead_collected"}, BotConfig(),
         SessionToolState(variables={"lead_collected": ""}), None),
        ({"completes_variable": "lead_collected"}, BotConfig(), NO_STATE, None),
        ({}, BotConfig(), SessionToolState(variables={"lead_collected": "true"}), None),
    ],
    ids=[
        "plain-offered",
        "disabled",
        "not-in-allowlist",
        "empty-allowlist",
        "in-allowlist",
        "breaker-open-at-3",
        "breaker-open-above-3",
        "breaker-2-failures-still-offered",
        "other-tools-breaker",
        "write-without-allow-writes",
        "read-without-allow-writes",
        "write-with-allow-writes",
        "one-shot-completed-true",
        "one-shot-completed-any-value",
        "one-shot-false-still-offered",
        "one-shot-empty-still-offered",
        "one-shot-unset-still-offered",
        "not-one-shot-ignores-variables",
    ],
)
def test_gating_rule(fields: dict[str, Any], config: BotConfig, session: SessionToolState, reason: str | None) -> None:
    catalog = make_catalog(python_tool("t", **fields))
    tool = catalog.get("t")
    offered = [t.name for t in build_tool_set(config, None, session, catalog)]
    if reason is None:
        assert gate_reason(tool, config, session) is None
        assert offered == ["t"]
    else:
        assert reason in gate_reason(tool, config, session)
        assert offered == []


def test_gating_keeps_catalog_order_and_drops_only_the_gated_tools() -> None:
    session = SessionToolState(breakers={"flaky": 3}, variables={"lead_collected": "true"})
    names = offered_names(
        BotConfig(allowlist=("a", "flaky", "collect_lead", "b", "off")),
        session,
        python_tool("a"),
        python_tool("flaky"),
        python_tool("collect_lead", mutability="write", completes_variable="lead_collected"),
        python_tool("not_allowed"),
        python_tool("off", enabled=False),
        python_tool("b"),
    )
    assert names == ["a", "b"]


# -- intent mapping --------------------------------------------------------------------------------

INTENT_CONFIG = BotConfig(
    intents={
        "order_status": Intent(phrases=("where is my order", "order status", "tracking"), tools=("check_order",)),
        "lead": Intent(phrases=("call me", "contact me", "quote"), tools=("collect_lead",)),
    }
)
INTENT_TOOLS = (
    webhook_tool("check_order"),
    python_tool("collect_lead", mutability="write"),
    python_tool("track_parcel", intents=("order_status",)),
    python_tool("faq"),
    client_tool("show_map", intents=("lead",)),
)


def _intent_offer(intent: str | None, session: SessionToolState = NO_STATE, config: BotConfig = INTENT_CONFIG):
    catalog = make_catalog(*INTENT_TOOLS, backend=FakeToolBackend())
    return [t.name for t in build_tool_set(config, intent, session, catalog)]


@pytest.mark.parametrize(
    ("intent", "offered"),
    [
        ("order_status", ["check_order", "track_parcel"]),
        ("lead", ["collect_lead", "show_map"]),
        (None, ["check_order", "collect_lead", "track_parcel", "faq", "show_map"]),
        ("not_configured", ["check_order", "collect_lead", "track_parcel", "faq", "show_map"]),
    ],
    ids=["named-plus-tagged", "other-intent", "no-intent-all-gated", "unknown-intent-all-gated"],
)
def test_intent_offers_its_named_tools_plus_tools_tagged_with_it(intent: str | None, offered: list[str]) -> None:
    assert _intent_offer(intent) == offered


def test_intent_mapping_still_applies_gating() -> None:
    session = SessionToolState(breakers={"check_order": 3})
    assert _intent_offer("order_status", session) == ["track_parcel"]


def test_no_intent_offers_only_the_gated_tools() -> None:
    config = BotConfig(intents=INTENT_CONFIG.intents, allow_writes=False)
    assert _intent_offer(None, config=config) == ["check_order", "track_parcel", "faq", "show_map"]


@pytest.mark.parametrize(
    ("text", "intent"),
    [
        ("Where is my order?", "order_status"),
        ("WHERE IS MY ORDER!!!", "order_status"),
        ("where, is my... order", "order_status"),
        ("Can you call me about a quote?", "lead"),  # two lead phrases beat none
        # one hit each: a tie goes to the alphabetically first intent, the same in every process
        ("Order status please; also, can you call me?", "lead"),
        ("hello there", None),
        ("", None),
    ],
    ids=["plain", "upper-case", "punctuation", "two-hits", "tie", "no-hit", "empty"],
)
def test_detect_intent_is_case_and_punctuation_insensitive(text: str, intent: str | None) -> None:
    config = BotConfig(
        intents={
            "order_status": Intent(phrases=("Where is my order", "order status")),
            "lead": Intent(phrases=("call me", "quote")),
        }
    )
    assert detect_intent(config, text) == intent


def test_detect_intent_picks_the_intent_with_most_phrase_hits() -> None:
    config = BotConfig(
        intents={
            "a_booking": Intent(phrases=("book",)),
            "z_pricing": Intent(phrases=("price", "cost", "how much")),
        }
    )
    # "a_booking" sorts first, so only a higher hit count can make "z_pricing" win
    assert detect_intent(config, "How much does it cost to book? What's the price?") == "z_pricing"
    assert detect_intent(config, "I want to book") == "a_booking"


@pytest.mark.parametrize(
    ("text", "intent"),
    [
        ("this is about shipping", "shipping"),  # "hi" is inside "this" and "shipping"
        ("hi, about shipping", "greeting"),  # one hit each: the alphabetically first wins the tie
        ("hi there", "greeting"),
        ("ebooks for sale", None),  # "book" only inside a longer word
    ],
)
def test_detect_intent_matches_whole_words_not_fragments(text: str, intent: str | None) -> None:
    config = BotConfig(
        intents={
            "greeting": Intent(phrases=("hi",)),
            "shipping": Intent(phrases=("shipping",)),
            "zbooking": Intent(phrases=("book",)),
        }
    )
    assert detect_intent(config, text) == intent


@pytest.mark.parametrize("text", ["anything at all", "", "?!"])
def test_detect_intent_ignores_empty_and_punctuation_only_phrases(text: str) -> None:
    config = BotConfig(
        intents={"blank": Intent(phrases=("",)), "bang": Intent(phrases=("?!",)), "real": Intent(phrases=("refund",))}
    )
    assert detect_intent(config, text) is None
    assert detect_intent(config, text + " I want a refund") == "real"


# -- tool specs ------------------------------------------------------------------------------------


def test_tool_specs_carry_name_description_and_input_schema() -> None:
    catalog = make_catalog(webhook_tool("check_order"), python_tool("faq"), backend=FakeToolBackend())
    specs = tool_specs(list(catalog))
    assert [(s.name, s.description, s.input_schema) for s in specs] == [
        (
            "check_order",
            "Look up a customer order by order number. Use when customer asks about their order status.",
            ORDER_SCHEMA,
        ),
        ("faq", "faq for tests", OPEN_SCHEMA),
    ]
