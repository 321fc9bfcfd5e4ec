"""What a session's watchers read holds no argument, result or sensitive value: tool calls and
results are logged by name and outcome only, and an approval's question redacts a sensitive
argument. Through the real session core over a scripted model (tests/support/turns.py)."""

from __future__ import annotations

import msgspec

from actors.session import handle_approval, handle_message, new_state
from services.tools.model import PythonTool
from tests.support import turns
from tests.support.turns import SCHEMA, ScriptedLLM, env_for

registry = turns.registry  # the fixture

CARD = "4111111111111111"
PAY = PythonTool(name="pay", description="take a payment", handler="lookup", mutability="write",
                 parameters={"type": "object", "properties": {"q": {"type": "string"}, "card": {"type": "string"}}},
                 sensitive=("card",))
FIND = PythonTool(name="find", description="find it", parameters=SCHEMA, handler="lookup")


def logged(state) -> str:
    delta = state.take_delta()
    assert delta is not None and delta.events
    return msgspec.json.encode(delta.events).decode()


async def test_a_tools_arguments_and_result_are_not_in_the_log(registry):
    state = new_state("t", "s")
    env = env_for(ScriptedLLM([[("find", {"q": "secret-plan"})], "done"]), registry, [FIND])
    await handle_message(state, "find it", "m1", env)
    log = logged(state)
    assert '"name":"find"' in log and '"success":true' in log
    assert "secret-plan" not in log  # neither the argument nor the result that echoes it


async def test_a_held_calls_sensitive_argument_is_in_no_event_before_or_after_the_decision(registry):
    state = new_state("t", "s")
    env = env_for(ScriptedLLM([[("pay", {"q": "order 7", "card": CARD})], "paid"]), registry, [PAY])
    held = await handle_message(state, "pay for order 7", "m1", env)
    assert held.pending_approval is not None
    before = logged(state)
    assert "approval_required" in before and CARD not in before
    await handle_approval(state, held.pending_approval.approval_id, True, env)
    assert CARD not in logged(state)
