"""What crosses the host boundary (Turn, ApprovalDecision) and what the host asks of a session.

The commands travel from the gateway to a session host encoded once (actors.ray_host); the host
reads a session only through SessionState's named methods, never its snapshot.
"""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest

from actors.host import HostSettings, SessionHost
from actors.local import LocalRouter
from actors.ray_host import command_decoder, decision_decoder, encode_command, turn_decoder
from actors.session import JOBS_KEY, handle_approval, handle_message, new_state
from kernel.errors import NotFound
from services.tools.registry import build_catalog
from services.wire import ApprovalDecision, SessionView, Turn
from tests.support.host_fakes import LOOKUP, FakeSessionStore, FakeTenants

TURN = Turn(tenant_id="t1", session_id="s1", text="hello", message_id="m1")
DECISION = ApprovalDecision(tenant_id="t1", session_id="s1", approval_id="ap_1", approve=True,
                            edited={"toolu_1": {"q": "edited"}})


@pytest.mark.parametrize("command", [TURN, DECISION, Turn(tenant_id="t1", session_id="s1", text="x")])
def test_a_command_crosses_to_the_host_encoded_once_and_comes_back_equal(command) -> None:
    raw = encode_command(command)
    assert command_decoder.decode(raw) == command
    own = turn_decoder if isinstance(command, Turn) else decision_decoder
    assert own.decode(raw) == command


def test_a_decision_is_not_taken_for_a_turn_nor_a_turn_for_a_decision() -> None:
    with pytest.raises(msgspec.ValidationError, match=r"Invalid value 'approval' - at `\$.type`"):
        turn_decoder.decode(encode_command(DECISION))
    with pytest.raises(msgspec.ValidationError, match=r"Invalid value 'turn' - at `\$.type`"):
        decision_decoder.decode(encode_command(TURN))


def test_commands_are_frozen_and_named_field_by_field() -> None:
    with pytest.raises(TypeError):
        Turn("t1", "s1", "hello", "m1")  # type: ignore[misc]
    with pytest.raises(AttributeError):
        TURN.text = "changed"  # type: ignore[misc]
    with pytest.raises(TypeError):
        ApprovalDecision("t1", "s1", "ap_1", True)  # type: ignore[misc]


async def test_a_fresh_session_answers_the_hosts_questions_from_its_own_state() -> None:
    state = new_state("t1", "s1")
    assert not state.answered("m1") and not state.answered(None)
    assert not state.may_have_dropped("m1")  # a session with no past: no stored answer to read
    assert state.waiting_jobs() == [] and not state.holds_approval and state.decided_turn("ap_x") is None
    assert state.view() == SessionView(session_id="s1", variables={}, open_breakers=[], handoff=False, messages=0)

    reply = await handle_message(state, "hello", "m1", FakeTenants().env)
    assert reply.reply == "echo: hello"
    assert state.answered("m1") and not state.may_have_dropped("m1")
    assert state.view().messages == 2


def test_a_session_whose_turn_cache_is_partial_says_an_answer_may_be_stored_elsewhere() -> None:
    state = new_state("t1", "s1")
    state.load_turns({"m9": {"reply": "old"}}, complete=False)
    assert state.answered("m9") and not state.may_have_dropped("m9")
    assert state.may_have_dropped("m1") and not state.answered("m1")


def test_the_jobs_a_session_waits_for_are_a_copy_the_host_cannot_change() -> None:
    state = new_state("t1", "s1")
    state.snapshot.extra[JOBS_KEY] = ["job-1"]
    waiting = state.waiting_jobs()
    waiting.append("job-2")
    assert state.waiting_jobs() == ["job-1"]


async def test_a_held_turn_is_held_until_decided_then_its_decision_is_remembered() -> None:
    tenants = FakeTenants()
    book = msgspec.structs.replace(LOOKUP, name="book", mutability="write")
    env = msgspec.structs.replace(
        tenants.env, catalog=build_catalog([], [(book, 1)], registry=tenants.registry, backend=None))
    state = new_state("t1", "s1")
    held = await handle_message(state, "use book q", "m1", env)
    assert held.pending_approval is not None and state.holds_approval
    approval_id = held.pending_approval.approval_id
    assert state.decided_turn(approval_id) is None

    await handle_approval(state, approval_id, True, env)
    assert not state.holds_approval and state.decided_turn(approval_id) == "m1"


async def test_a_streamed_decision_of_an_unknown_approval_is_not_found_with_its_id() -> None:
    host = SessionHost(name="h1", store=FakeSessionStore(), tenants=FakeTenants(), settings=HostSettings())
    await host.start()
    router = LocalRouter(host)
    try:
        with pytest.raises(NotFound) as missing:
            async for _ in router.stream(ApprovalDecision(tenant_id="t1", session_id="s1", approval_id="ap_nope",
                                                          approve=True)):
                pass
        assert missing.value.key == "ap_nope"
        assert (await router.send(TURN)).reply == "echo: hello"
    finally:
        await host.stop()


def test_url_templating_imports_no_http_client_nor_resolver() -> None:
    probe = ("import sys, services.tools.templating; "
             "print(sorted(m for m in ('aiohttp', 'aiodns', 'services.tools.webhook', 'services.tools.ssrf') "
             "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"
