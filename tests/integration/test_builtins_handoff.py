"""escalate_to_human on the real Postgres, and the built-ins inside the engine's tool loop: the
handoff row and its notification, the session handed off (the bot stops answering and says so),
collect_lead leaving the tool set once done, the contact variable linking later sessions, and
book_appointment held for approval."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import msgspec

from actors.session import HANDED_OFF_REPLY, TurnEnv, handle_approval, handle_message, new_state
from services.botconfig import BotConfig
from services.builtins import DEFINITIONS
from services.builtins.appointments import service_from_body
from services.llm.port import (
    LLMRequest,
    LLMResponse,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
    Usage,
)
from services.tools.executor import Executor
from services.tools.registry import HandlerRegistry, build_catalog
from tests.support.builtin_services import SECRET, ctx, receiver, services
from tests.support.fakes import StreamScriptedLLM


class ScriptedLLM(StreamScriptedLLM):
    """Each step is a text or a list of (tool, args) calls; records every request."""

    def __init__(self, steps: list[Any]) -> None:
        self.steps = list(steps)
        self.requests: list[LLMRequest] = []

    async def stream(self, request: LLMRequest):
        self.requests.append(request)
        step = self.steps.pop(0) if self.steps else "ok"
        if isinstance(step, str):
            content, stop = [TextBlock(text=step)], "end_turn"
        else:
            n = len(self.requests)
            content = [ToolUseBlock(id=f"toolu_{n}_{i}", name=t, input=a) for i, (t, a) in enumerate(step)]
            stop = "tool_use"
        yield LLMResponse(content=content, stop_reason=stop, usage=Usage(input_tokens=1, output_tokens=1),
                          model=request.model)


def engine(svc, llm, config: BotConfig) -> TurnEnv:
    registry = HandlerRegistry()
    svc.register(registry)
    catalog = build_catalog(DEFINITIONS, [], registry=registry, backend=None)
    return TurnEnv(llm=llm, executor=Executor(), catalog=catalog, config=config, main_model="m", cheap_model="c")


def offered(request: LLMRequest) -> list[str]:
    return [t.name for t in request.tools]


def last_results(llm: ScriptedLLM) -> list[ToolResultBlock]:
    return [b for b in llm.requests[-1].messages[-1].content if isinstance(b, ToolResultBlock)]


async def test_escalation_records_the_handoff_notifies_and_hands_the_session_over(pool, make_tenant):
    tenant, _ = await make_tenant("handoff")
    async with receiver() as rec, services(pool) as (svc, configs):
        config = configs.set(tenant.id, notification_webhook=rec.url, notification_secret=SECRET)
        llm = ScriptedLLM([[("escalate_to_human", {"reason": "wants to talk about a refund"})],
                           "A colleague will take over."])
        state = new_state(tenant.id, "s-handoff")
        reply = await handle_message(state, "I want a person", "m1", engine(svc, llm, config))
        assert reply.handoff and reply.tool_calls[0].success
        assert state.snapshot.handoff_reason == "wants to talk about a refund"

        after = await handle_message(state, "hello?", "m2", engine(svc, llm, config))
        assert after.reply == HANDED_OFF_REPLY and after.tool_calls == [] and len(llm.requests) == 2

        rows = await svc.repos.handoffs.list(tenant.id)
        assert [(r.session_id, r.reason) for r in rows] == [("s-handoff", "wants to talk about a refund")]
        await rec.wait(1)
    event = msgspec.json.decode(rec.requests[0][1])
    assert event["type"] == "handoff.requested"
    assert event["data"]["reason"] == "wants to talk about a refund" and event["data"]["session_id"] == "s-handoff"


async def test_a_replayed_escalation_records_one_handoff(pool, make_tenant):
    tenant, _ = await make_tenant("handoff")
    async with services(pool) as (svc, _configs):
        c = ctx(tenant.id, key="m1:toolu_1")
        first = await svc.handoff.escalate({"reason": "angry"}, c)
        assert await svc.handoff.escalate({"reason": "angry"}, c) == first
        assert len(await svc.repos.handoffs.list(tenant.id)) == 1


async def test_a_turn_re_run_after_a_crash_records_one_handoff_though_the_model_rewords_its_reason(
        pool, make_tenant):
    tenant, _ = await make_tenant("handoff")
    async with receiver() as rec, services(pool) as (svc, configs):
        config = configs.set(tenant.id, notification_webhook=rec.url, notification_secret=SECRET)
        for reason in ("customer wants a refund", "the customer is asking for a refund"):
            # the host died before the session was stored: the client's retry of message m1 runs the
            # turn again from the stored state, and the model words its reason differently
            state = new_state(tenant.id, "s-rerun")
            llm = ScriptedLLM([[("escalate_to_human", {"reason": reason})], "A colleague will take over."])
            reply = await handle_message(state, "I want a person", "m1", engine(svc, llm, config))
            assert reply.handoff and reply.tool_calls[0].success
        rows = await svc.repos.handoffs.list(tenant.id)
        assert [(r.session_id, r.reason) for r in rows] == [("s-rerun", "customer wants a refund")]
        await svc.notifier.drain(5)
    assert [msgspec.json.decode(body)["type"] for _h, body in rec.requests] == ["handoff.requested"]


async def test_a_reason_postgres_cannot_store_is_recorded_as_it_can_not_a_crash(pool, make_tenant):
    tenant, _ = await make_tenant("handoff")
    async with services(pool) as (svc, _configs):
        # the reason is the model's; the key holds the client's message id, which may be any text
        c = ctx(tenant.id, "s-nul", key="m\x00\ud800:0123abcd")
        first = await svc.handoff.escalate({"reason": "refund\x00 now \udc80"}, c)
        assert await svc.handoff.escalate({"reason": "refund\x00 now \udc80"}, c) == first
        assert [r.reason for r in await svc.repos.handoffs.list(tenant.id)] == ["refund\ufffd now ?"]


async def test_collect_lead_leaves_the_tool_set_and_links_later_sessions_to_the_contact(pool, make_tenant):
    tenant, _ = await make_tenant("loop")
    async with services(pool) as (svc, configs):
        config = configs.set(tenant.id)
        lead = {"name": "Ann Lee", "email": "ann@example.com", "notes": "kitchen renovation"}
        llm = ScriptedLLM([[("collect_lead", lead)], "Thanks Ann!",
                           [("collect_lead", {"name": "Ann Lee", "email": "ann@example.com"})], "Already have it."])
        state = new_state(tenant.id, "s-one")
        env = engine(svc, llm, config)
        await handle_message(state, "I'm Ann, ann@example.com", "m1", env)
        assert "collect_lead" in offered(llm.requests[0])
        assert state.variables["lead_collected"] == "true" and state.variables["contact_id"] == "ann@example.com"

        reply = await handle_message(state, "my email is ann@example.com", "m2", env)
        assert "collect_lead" not in offered(llm.requests[2])  # the model is not offered it again
        assert not reply.tool_calls[0].success
        assert "this was already done in this conversation" in reply.tool_calls[0].error
        assert len(await svc.repos.leads.list(tenant.id)) == 1

        # where the tenant recalls across sessions, a later session of the same verified contact
        # recalls the first one's fact; one that only types the same email does not
        configs.set(tenant.id, recall_across_sessions=True)
        verified = new_state(tenant.id, "s-three")
        verified.snapshot.contact_sub = "ann-sub"
        llm.steps.extend([[("collect_lead", {"name": "Ann Lee", "email": "ann@example.com",
                                              "notes": "bathroom renovation"})], "Thanks!"])
        await handle_message(verified, "Ann again, ann@example.com", "m1", env)
        later = await svc.memory.recall({"query": "renovation"}, ctx(tenant.id, "s-two", contact_sub="ann-sub"))
        assert later["found"] == 1 and "bathroom renovation" in later["summary"]
        typed = await svc.memory.recall({"query": "renovation"},
                                        ctx(tenant.id, "s-two", variables={"contact_id": "ann@example.com"}))
        assert typed["found"] == 0


async def test_booking_waits_for_approval_and_listing_does_not(pool, make_tenant):
    tenant, _ = await make_tenant("loop")
    now = datetime(2026, 7, 1, 8, 0, tzinfo=UTC)
    async with services(pool, now=now) as (svc, configs):
        config = configs.set(tenant.id)
        await svc.repos.appointments.put_service(tenant.id, service_from_body("consult", {
            "duration_minutes": 60, "timezone": "UTC", "opening_hours": {"thu": ["09:00", "12:00"]}}))
        llm = ScriptedLLM([[("list_appointment_slots", {"service": "consult"})], "Thursday 9, 10 or 11.",
                           [("book_appointment", {"service": "consult", "start": "2026-07-02T10:00"})],
                           "Booked for 10:00."])
        state = new_state(tenant.id, "s-book")
        env = engine(svc, llm, config)
        listed = await handle_message(state, "when can I come?", "m1", env)
        assert listed.pending_approval is None and listed.tool_calls[0].success
        held = await handle_message(state, "10 please", "m2", env)
        assert held.pending_approval is not None and held.pending_approval.tools == ["book_appointment"]
        assert await svc.repos.appointments.list(tenant.id) == []  # nothing booked before approval
        done = await handle_approval(state, held.pending_approval.approval_id, True, env)
        assert done.tool_calls[-1].name == "book_appointment" and done.tool_calls[-1].success
        rows = await svc.repos.appointments.list(tenant.id)
        assert [r.starts_at for r in rows] == [datetime(2026, 7, 2, 10, 0, tzinfo=UTC)]
        booked = msgspec.json.decode(last_results(llm)[0].content)
        assert booked["status"] == "booked" and booked["start"] == "2026-07-02T10:00+00:00"
