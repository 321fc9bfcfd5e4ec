"""The built-in tools through the real stack (gateway + Ray session hosts + Postgres + local model):
a conversation that collects a lead, books an appointment (approved through the API) and submits a
form; the rows exist; collect_lead is not offered again in that session; the tenant's webhook
receives every event with a Standard Webhooks signature it can verify; a later session of the same
contact recalls the first (where the tenant turned that on); escalate_to_human hands the session over."""

from __future__ import annotations

import asyncio
import secrets
from datetime import UTC, datetime, timedelta

import msgspec
import pytest

from services.builtins.notify import verify
from tests.support.api import Api
from tests.support.builtin_services import SECRET, receiver
from tests.support.e2e import new_tenant

pytestmark = pytest.mark.e2e

NOTIFY_HOST = "127.0.0.2"  # the stack's webhook allowlist admits this loopback address only
QUOTE_FORM = {
    "type": "object",
    "properties": {"rooms": {"type": "integer", "minimum": 1}, "service": {"type": "string", "enum": ["painting", "cleaning"]}},
    "required": ["rooms", "service"],
    "additionalProperties": False,
}
LEAD_TEXT = "Please save my details as a lead: my name is Jane Doe, email {email}"


@pytest.fixture
def api(stack, client, tenant) -> Api:
    return Api(client, stack.gateway.url, tenant[2])


async def test_lead_booking_and_form_in_one_conversation_with_signed_notifications(api):
    email = f"jane-{secrets.token_hex(3)}@example.com"
    slot = (datetime.now(UTC) + timedelta(days=1)).replace(hour=10, minute=0, second=0, microsecond=0)
    async with receiver(NOTIFY_HOST) as rec:
        await api.expect("PUT", "/v1/bot-config", {"notification_webhook": rec.url, "notification_secret": SECRET})
        await api.expect("PUT", "/v1/forms/quote", QUOTE_FORM)
        await api.expect("PUT", "/v1/appointment-services/consult", {
            "duration_minutes": 60, "timezone": "UTC",
            "opening_hours": {d: ["00:00", "24:00"] for d in ("mon", "tue", "wed", "thu", "fri", "sat", "sun")}})
        session = f"e2e-builtins-{secrets.token_hex(4)}"

        # 1. the model picks collect_lead from the contact's words while it is offered
        first = await api.chat(session, LEAD_TEXT.format(email=email))
        assert [(c["name"], c["success"]) for c in first["tool_calls"]] == [("collect_lead", True)], first

        # 2. booking is a write: held for approval, then approved through the API
        held = await api.chat(session, "/call book_appointment " + msgspec.json.encode(
            {"service": "consult", "start": slot.isoformat()}).decode())
        pending = held["pending_approval"]
        assert pending["tools"] == ["book_appointment"] and held["tool_calls"] == []
        booked = await api.expect("POST", f"/v1/sessions/{session}/approvals/{pending['approval_id']}", {"approve": True})
        assert [(c["name"], c["success"]) for c in booked["tool_calls"]] == [("book_appointment", True)], booked

        # 3. a form: a wrong answer names the field and the rule, never the answer; a right one is stored
        wrong = await api.chat(session, '/call submit_form {"form": "quote", "data": {"rooms": 0, "service": "painting"}}')
        assert "'rooms': the value is less than the minimum of 1" in wrong["tool_calls"][0]["error"]
        submitted = await api.chat(session, '/call submit_form {"form": "quote", "data": {"rooms": 3, "service": "painting"}}')
        assert submitted["tool_calls"][0]["success"], submitted

        # 4. collect_lead is no longer offered: the same words no longer call it ...
        again = await api.chat(session, LEAD_TEXT.format(email=email))
        assert "collect_lead" not in [c["name"] for c in again["tool_calls"]], again
        # ... and a forced call is refused by the engine's policy, in-band
        forced = await api.chat(session, "/call collect_lead " + msgspec.json.encode(
            {"name": "Jane Doe", "email": email}).decode())
        assert forced["tool_calls"][0]["success"] is False
        assert "this was already done in this conversation" in forced["tool_calls"][0]["error"]

        view = await api.expect("GET", f"/v1/sessions/{session}")
        assert view["variables"]["lead_collected"] == "true" and view["variables"]["contact_id"] == email

        # the rows exist
        leads = (await api.expect("GET", "/v1/leads"))["leads"]
        assert [(lead["session_id"], lead["email"], lead["name"]) for lead in leads] == [(session, email, "Jane Doe")]
        appointments = (await api.expect("GET", "/v1/appointments?service=consult"))["appointments"]
        assert [(a["session_id"], datetime.fromisoformat(a["starts_at"]), a["contact_email"]) for a in appointments] == [
            (session, slot, email)]
        submissions = (await api.expect("GET", "/v1/forms/quote/submissions"))["submissions"]
        assert [(s["session_id"], s["data"]) for s in submissions] == [(session, {"rooms": 3, "service": "painting"})]
        # the lead row keeps the contact's details; the call record does not repeat them
        calls = (await api.expect("GET", f"/v1/sessions/{session}/calls"))["turns"]
        lead_calls = [c for t in calls for c in t["calls"] if c["name"] == "collect_lead"]
        assert sorted((c["success"], c["parameters"]["email"]) for c in lead_calls) == [
            (False, "[redacted]"), (True, "[redacted]")], lead_calls  # saved, then refused as done
        assert all(c["parameters"]["name"] == "Jane Doe" for c in lead_calls)
        assert email not in msgspec.json.encode(lead_calls).decode()

        await rec.wait(3, timeout=20)
    events = {}
    for headers, body in rec.requests:
        assert verify(SECRET, headers, body), headers  # what the tenant's receiver does
        event = msgspec.json.decode(body)
        events[event["type"]] = event["data"]
    assert set(events) == {"lead.created", "appointment.booked", "form.submitted"}
    assert events["lead.created"]["email"] == email and events["lead.created"]["session_id"] == session
    assert datetime.fromisoformat(events["appointment.booked"]["starts_at"]) == slot
    assert events["form.submitted"]["data"] == {"rooms": 3, "service": "painting"}


async def test_a_session_that_types_an_earlier_contacts_email_recalls_nothing_of_theirs(api):
    # recall across sessions follows only a verified contact (tests/e2e/test_verified_contacts.py):
    # a tenant that verifies none cannot turn it on, and the email collect_lead took, as typed,
    # links nothing
    email = f"sam-{secrets.token_hex(3)}@example.com"
    assert (await api.expect("GET", "/v1/bot-config"))["recall_across_sessions"] is False
    refused = await api.expect("PUT", "/v1/bot-config", {"recall_across_sessions": True}, expect=422)
    assert "contact_verification" in refused["detail"] and "recall_across_sessions" in refused["detail"], refused
    assert (await api.expect("GET", "/v1/bot-config"))["recall_across_sessions"] is False  # nothing stored
    first, later = f"e2e-mem-a-{secrets.token_hex(3)}", f"e2e-mem-b-{secrets.token_hex(3)}"
    lead = {"name": "Sam Roe", "email": email, "notes": "loft conversion with skylights"}
    saved = await api.chat(first, "/call collect_lead " + msgspec.json.encode(lead).decode())
    assert saved["tool_calls"][0]["success"], saved
    await api.chat(first, "Also, the skylights should face south")

    await api.chat(later, "/call collect_lead " + msgspec.json.encode({"name": "Sam Roe", "email": email}).decode())
    recalled = await api.chat(later, '/call recall_memory {"query": "skylights"}')
    assert recalled["tool_calls"][0]["success"], recalled
    # only this session's own line (the /call text is searched whatever it says)
    assert "found: 1" in recalled["reply"], recalled["reply"]
    assert "south" not in recalled["reply"] and "loft" not in recalled["reply"], recalled["reply"]


async def test_escalation_hands_the_session_over_and_notifies_the_tenant(api):
    session = f"e2e-handoff-{secrets.token_hex(3)}"
    async with receiver(NOTIFY_HOST) as rec:
        await api.expect("PUT", "/v1/bot-config", {"notification_webhook": rec.url, "notification_secret": SECRET})
        reply = await api.chat(session, "I want to talk to a human about my invoice")
        assert [(c["name"], c["success"]) for c in reply["tool_calls"]] == [("escalate_to_human", True)], reply
        assert reply["handoff"] is True
        after = await api.chat(session, "hello, anyone?")
        assert after["tool_calls"] == [] and "member of our team" in after["reply"]
        handoffs = (await api.expect("GET", "/v1/handoffs"))["handoffs"]
        assert [(h["session_id"], h["reason"]) for h in handoffs] == [
            (session, "I want to talk to a human about my invoice")]
        await rec.wait(1, timeout=20)
    headers, body = rec.requests[0]
    assert verify(SECRET, headers, body)
    assert msgspec.json.decode(body)["type"] == "handoff.requested"


async def test_a_handoff_the_model_asks_for_in_text_is_recorded_and_notified_like_the_tool(api):
    session = f"e2e-marker-{secrets.token_hex(3)}"
    async with receiver(NOTIFY_HOST) as rec:
        await api.expect("PUT", "/v1/bot-config", {"notification_webhook": rec.url, "notification_secret": SECRET})
        reply = await api.chat(session, "/handoff")  # the local model answers with [[HANDOFF]]
        assert reply["tool_calls"] == [] and reply["handoff"] is True and "[[HANDOFF]]" not in reply["reply"]
        again = await api.expect("POST", f"/v1/sessions/{session}/messages",
                               {"text": "/handoff", "message_id": reply["message_id"]})
        assert again == reply  # a retried message adds no second handoff
        handoffs = (await api.expect("GET", "/v1/handoffs"))["handoffs"]
        assert [(h["session_id"], h["reason"]) for h in handoffs if h["session_id"] == session] == [
            (session, "the assistant asked for a human")]
        await rec.wait(1, timeout=20)
    headers, body = rec.requests[0]
    assert verify(SECRET, headers, body)
    event = msgspec.json.decode(body)
    assert event["type"] == "handoff.requested" and event["data"]["session_id"] == session


async def test_form_and_booking_tools_are_offered_once_the_tenant_has_a_form_or_a_service(make_tenant_api):
    api = await make_tenant_api()

    async def builtins() -> set[str]:
        report = await api.expect("GET", "/v1/tools/contract")
        return {t["name"] for t in report["tools"] if t["origin"] == "builtin" and t["offered"]}

    booking = {"book_appointment", "list_appointment_slots"}
    first = await builtins()
    assert "collect_lead" in first and "escalate_to_human" in first
    assert "submit_form" not in first and not booking & first  # they could only say "not set up"
    await api.expect("PUT", "/v1/forms/quote", QUOTE_FORM)
    assert "submit_form" in await builtins()  # the very next read: no restart, no wait
    await api.expect("PUT", "/v1/appointment-services/consult", {
        "duration_minutes": 30, "timezone": "UTC", "opening_hours": {"mon": ["09:00", "17:00"]}})
    assert booking <= await builtins()
    await api.expect("DELETE", "/v1/forms/quote", expect=204)
    assert "submit_form" not in await builtins()
    reply = await api.chat("offer-1", '/call submit_form {"form": "quote", "data": {}}')
    assert reply["tool_calls"][0]["success"] is False  # asked for anyway: refused in-band, nothing runs


async def test_notifications_are_listed_and_a_given_up_one_can_be_sent_again(make_tenant_api):
    api, other = await make_tenant_api(), await make_tenant_api()
    async with receiver(NOTIFY_HOST) as rec:
        # localhost passes as a name but resolves to a loopback address the guard refuses: final
        await api.expect("PUT", "/v1/bot-config", {"notification_webhook": "http://localhost:9/hooks/x",
                                                 "notification_secret": SECRET})
        await api.chat("notify-1", "/call collect_lead " + msgspec.json.encode(
            {"name": "Ann Lee", "email": "ann@example.com"}).decode())
        failed: list = []
        for _ in range(100):
            failed = (await api.expect("GET", "/v1/notifications?status=failed"))["notifications"]
            if failed:
                break
            await asyncio.sleep(0.1)
        [event] = failed
        assert event["event_type"] == "lead.created" and event["data"]["email"] == "ann@example.com"
        assert event["last_error"].startswith("destination_blocked") and event["attempts"] == 1
        # another tenant sees none of it and cannot touch it
        assert (await other.expect("GET", "/v1/notifications"))["notifications"] == []
        await other.expect("POST", f"/v1/notifications/{event['id']}/retry", expect=404)
        await api.expect("GET", "/v1/notifications?status=lost", expect=422)

        await api.expect("PUT", "/v1/bot-config", {"notification_webhook": rec.url, "notification_secret": SECRET})
        again = await api.expect("POST", f"/v1/notifications/{event['id']}/retry")
        assert again["status"] == "pending" and again["attempts"] == 0
        await rec.wait(1, timeout=20)  # a session host's delivery loop picks it up
        problem = await api.expect("POST", f"/v1/notifications/{event['id']}/retry", expect=422)
        assert "only a failed notification can be retried" in problem["detail"]
    headers, body = rec.requests[0]
    assert headers["webhook-id"] == event["id"] and verify(SECRET, headers, body)
    for _ in range(50):
        [row] = (await api.expect("GET", "/v1/notifications"))["notifications"]
        if row["status"] == "delivered":
            break
        await asyncio.sleep(0.1)
    assert row["status"] == "delivered" and row["delivered_at"] is not None


async def test_admin_routes_validate_and_stay_within_the_tenant(api, stack, client, make_tenant_api):
    problem = await api.expect("PUT", "/v1/appointment-services/cut", {
        "duration_minutes": 30, "opening_hours": {"mon": ["17:00", "09:00"]}}, expect=422)
    assert "closing time 09:00 is not after opening time 17:00 - at `$.opening_hours.mon`" in problem["detail"]
    problem = await api.expect("PUT", "/v1/appointment-services/cut", {
        "duration_minutes": 30, "timezone": "Mars/Olympus", "opening_hours": {}}, expect=422)
    assert "timezone 'Mars/Olympus' is not an IANA time zone" in problem["detail"]
    problem = await api.expect("PUT", "/v1/forms/bad", {"type": "object", "properties": {"a": {"type": "nope"}}},
                             expect=422)
    assert "at `$.properties.a.type`" in problem["detail"]

    saved = await api.expect("PUT", "/v1/appointment-services/cut", {
        "duration_minutes": 30, "timezone": "Europe/Paris", "opening_hours": {"Monday": ["09:00", "12:00"]}})
    assert saved["opening_hours"] == {"mon": [["09:00", "12:00"]]}
    assert (await api.expect("GET", "/v1/appointment-services/cut"))["timezone"] == "Europe/Paris"
    await api.expect("PUT", "/v1/forms/contact", {"type": "object", "properties": {"msg": {"type": "string"}}})
    assert [f["name"] for f in (await api.expect("GET", "/v1/forms"))["forms"]] == ["contact"]

    other = await make_tenant_api()
    await other.expect("GET", "/v1/forms/contact", expect=404)
    await other.expect("GET", "/v1/appointment-services/cut", expect=404)
    assert (await other.expect("GET", "/v1/forms"))["forms"] == []
    await api.expect("DELETE", "/v1/forms/contact", expect=204)
    await api.expect("GET", "/v1/forms/contact", expect=404)


@pytest.fixture
def make_tenant_api(stack, client):
    async def make() -> Api:
        _, key = await new_tenant(stack, "e2e-other")
        return Api(client, stack.gateway.url, {"Authorization": f"Bearer {key}"})
    return make
