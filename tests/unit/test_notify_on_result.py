"""A tool's `notify_on_result` as registration takes it (services.gateway.bodies, pure): a
workflow's result wakes its session unless it says not to, a client tool's only when it says
so, and no other kind of tool takes the field (its result never arrives later)."""

from __future__ import annotations

import msgspec
import pytest

from kernel.errors import InvalidInput
from services.gateway.bodies import ToolCreate, ToolPatch, definition_from_body, patched_body


def workflow(**fields) -> ToolCreate:
    return ToolCreate(name="build_quote", description="Prepare a quote.", type="workflow",
                      start_url="https://example.com/jobs", **fields)


def test_a_workflows_result_wakes_its_session_unless_it_says_not_to():
    assert definition_from_body(workflow(), encrypt=str).notify_on_result is True
    assert definition_from_body(workflow(notify_on_result=False), encrypt=str).notify_on_result is False


def test_a_client_tools_answer_wakes_its_session_only_when_it_says_so():
    client = ToolCreate(name="pick_date", description="Let the contact pick a date.", type="client")
    assert definition_from_body(client, encrypt=str).notify_on_result is False
    woken = msgspec.structs.replace(client, notify_on_result=True)
    assert definition_from_body(woken, encrypt=str).notify_on_result is True


def test_a_tool_whose_result_comes_at_once_is_refused_the_field_saying_why():
    hook = ToolCreate(name="check", description="Check.", webhook_url="https://example.com/x", notify_on_result=True)
    with pytest.raises(InvalidInput, match="notify_on_result does not apply to a webhook tool") as refused:
        definition_from_body(hook, encrypt=str)
    assert refused.value.path == "$.notify_on_result"


def test_a_patch_turns_it_off_and_leaves_it_alone_when_not_given():
    current = msgspec.to_builtins(definition_from_body(workflow(), encrypt=str))
    off, _ = patched_body(current, ToolPatch(notify_on_result=False))
    assert definition_from_body(off, encrypt=str).notify_on_result is False
    kept, _ = patched_body(current, ToolPatch(description="Prepare a price quote."))
    assert definition_from_body(kept, encrypt=str).notify_on_result is True
