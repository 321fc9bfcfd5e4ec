"""The pure parts of the handoff lifecycle: the text a person reads of a stored message, the agent
name a claim takes, and the data of the `handoff.assigned` and `handoff.resolved` events."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from kernel.errors import InvalidInput
from services.builtins.handoff import AGENT_MAX, agent_name, transition_data
from storage.repos.builtins import HandoffRecord, message_text

TOOL_USE = {"type": "tool_use", "id": "t1", "name": "check_order", "input": {"text": "not shown"}}
TOOL_RESULT = {"type": "tool_result", "tool_use_id": "t1", "content": "not shown either"}


@pytest.mark.parametrize(("content", "text"), [
    ([{"type": "text", "text": "hello"}], "hello"),
    ([{"type": "text", "text": "Let me look."}, TOOL_USE], "Let me look."),
    ([{"type": "text", "text": "one"}, {"type": "text", "text": "two"}], "one\ntwo"),
    ([{"type": "text", "text": "one"}, TOOL_USE, {"type": "text", "text": "two"}], "one\ntwo"),
    ([TOOL_RESULT], ""),
    ([{"type": "text", "text": ""}, {"type": "text", "text": "kept"}], "kept"),
    ([{"type": "text", "text": 7}, {"type": "text"}, "text", None], ""),
    ([], ""),
    ("a plain string is no block list", ""),
    (None, ""),
], ids=["text", "text-and-tool-call", "two-texts", "texts-around-a-call", "tool-result", "empty-text-skipped",
        "malformed-blocks", "no-blocks", "string", "null"])
def test_a_messages_text_is_its_text_blocks_one_per_line(content: Any, text: str):
    assert message_text(content) == text


@pytest.mark.parametrize(("given", "name"), [("ann", "ann"), ("  Ann Lee\n", "Ann Lee"), ("a" * AGENT_MAX, "a" * AGENT_MAX)])
def test_an_agent_name_is_taken_without_the_spaces_around_it(given: str, name: str):
    assert agent_name(given) == name


@pytest.mark.parametrize(("given", "message"), [
    ("", "agent must name who takes the handoff, got an empty name"),
    (" \t ", "agent must name who takes the handoff, got an empty name"),
    ("a" * (AGENT_MAX + 1), f"agent must be at most {AGENT_MAX} characters, got {AGENT_MAX + 1}"),
    (None, "agent must be text naming who takes the handoff, got NoneType"),
    (42, "agent must be text naming who takes the handoff, got int"),
])
def test_an_agent_name_that_names_no_one_is_refused(given: Any, message: str):
    with pytest.raises(InvalidInput, match=message):
        agent_name(given)


T0 = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)


def handoff(**fields: Any) -> HandoffRecord:
    base: dict[str, Any] = {"id": "h1", "session_id": "s1", "reason": "refund", "created_at": T0,
                            "state": "requested", "agent": None, "assigned_at": None, "resolved_at": None,
                            "return_to_bot": None, "updated_at": T0}
    return HandoffRecord(**(base | fields))


def test_the_assigned_event_names_the_agent_and_when_and_says_nothing_of_resolving():
    at = T0 + timedelta(minutes=3)
    assert transition_data(handoff(state="assigned", agent="ann", assigned_at=at, updated_at=at)) == {
        "handoff_id": "h1", "session_id": "s1", "state": "assigned", "agent": "ann",
        "created_at": "2026-12-01T09:00:00+00:00", "assigned_at": "2026-12-01T09:03:00+00:00",
    }


def test_the_resolved_event_says_whether_the_bot_answers_again():
    assigned, resolved = T0 + timedelta(minutes=3), T0 + timedelta(minutes=9)
    row = handoff(state="resolved", agent="ann", assigned_at=assigned, resolved_at=resolved, return_to_bot=True,
                  updated_at=resolved)
    assert transition_data(row) == {
        "handoff_id": "h1", "session_id": "s1", "state": "resolved", "agent": "ann",
        "created_at": "2026-12-01T09:00:00+00:00", "assigned_at": "2026-12-01T09:03:00+00:00",
        "return_to_bot": True, "resolved_at": "2026-12-01T09:09:00+00:00",
    }


def test_a_handoff_resolved_unclaimed_has_no_agent_in_its_event():
    data = transition_data(handoff(state="resolved", resolved_at=T0, return_to_bot=False))
    assert (data["agent"], data["assigned_at"], data["return_to_bot"]) == (None, None, False)
