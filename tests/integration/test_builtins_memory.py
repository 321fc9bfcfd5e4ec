"""recall_memory on the real Postgres: facts and conversation messages of this session and of the
same contact's earlier sessions, ranked by full-text search, per tenant, in the tenant's language."""

from __future__ import annotations

import secrets

import pytest

from kernel.records import MessageRecord, SessionDelta, SessionSnapshot
from services.tools.errors import InvalidArguments
from services.tools.redaction import REDACTED
from storage.repos import SessionRepo
from tests.support.builtin_services import ctx, services, through_executor


async def store_conversation(pool, tenant_id: str, session_id: str, texts: list[tuple[str, str]],
                             variables: dict[str, str] | None = None, contact_sub: str | None = None) -> None:
    """Persist a conversation the way session hosts do (activate, then a flushed delta); bound to
    the verified contact `contact_sub` when given."""
    repo = SessionRepo(pool)
    active = await repo.activate(tenant_id, session_id, owner="test")
    messages = [MessageRecord(seq=i, role=role, content=[{"type": "text", "text": text}])
                for i, (role, text) in enumerate(texts)]
    result = await repo.flush([SessionDelta(
        tenant_id=tenant_id, session_id=session_id, epoch=active.epoch,
        snapshot=SessionSnapshot(message_count=len(messages), contact_sub=contact_sub), messages=messages, variables=variables or {},
    )])
    assert result.written == [(tenant_id, session_id)]


async def test_a_later_session_of_the_same_verified_contact_recalls_earlier_facts_and_messages(pool, make_tenant):
    tenant, _ = await make_tenant("mem")
    email = f"jane-{secrets.token_hex(3)}@example.com"
    jane = f"user-{secrets.token_hex(3)}"  # the `sub` of Jane's Contact-Token
    first, later, stranger, typed = "s-first", "s-later", "s-stranger", "s-typed"
    await store_conversation(pool, tenant.id, first, [
        ("user", "Hi, I'd like to know about your yoga classes for beginners"),
        ("assistant", "We run beginner yoga classes on Tuesdays."),
        ("user", "What about parking?"),
    ], variables={"contact_id": email}, contact_sub=jane)
    await store_conversation(pool, tenant.id, stranger, [("user", "yoga classes please, I am someone else")],
                             variables={"contact_id": "other@example.com"}, contact_sub="someone-else")
    # an anonymous session that typed Jane's email: not hers, whatever it says
    await store_conversation(pool, tenant.id, typed, [("user", "yoga classes, I typed Jane's address")],
                             variables={"contact_id": email})
    async with services(pool) as (svc, configs):
        configs.set(tenant.id, recall_across_sessions=True)
        await svc.leads.collect({"name": "Jane", "email": email, "notes": "beginner yoga classes"},
                                ctx(tenant.id, first, contact_sub=jane))
        await svc.memory.remember(ctx(tenant.id, typed, variables={"contact_id": email}), "Typed yoga classes fact")

        result = await svc.memory.recall({"query": "yoga classes"}, ctx(tenant.id, later, contact_sub=jane))
        # the same session as an anonymous contact with Jane's email in its variable: itself only
        anonymous = await svc.memory.recall({"query": "yoga classes"},
                                            ctx(tenant.id, later, variables={"contact_id": email}))

    contents = [m["content"] for m in result["memories"]]
    assert result["found"] == 3, result
    assert any("Interested in: beginner yoga classes" in c for c in contents)
    assert "Hi, I'd like to know about your yoga classes for beginners" in contents
    assert "We run beginner yoga classes on Tuesdays." in contents
    assert not any("someone else" in c for c in contents)  # another contact's conversation
    assert not any("typed" in c.lower() for c in contents)  # a session that only typed her email
    assert anonymous["found"] == 0 and anonymous["memories"] == [], anonymous
    assert not any("parking" in c for c in contents)  # does not match the query
    assert all(m["conversation"] == "an earlier one" for m in result["memories"])
    froms = {m["content"]: m["from"] for m in result["memories"]}
    assert froms["We run beginner yoga classes on Tuesdays."] == "you"
    assert froms["Hi, I'd like to know about your yoga classes for beginners"] == "the customer"


async def test_a_contact_who_types_another_contacts_email_recalls_nothing_of_theirs(pool, make_tenant):
    # collect_lead sets the contact variable to the email the contact typed, unverified. Anyone
    # who types Jane's address must not be read Jane's lead, bookings or conversations, even where
    # the tenant recalls across sessions.
    tenant, _ = await make_tenant("mem")
    email = f"jane-{secrets.token_hex(3)}@example.com"
    await store_conversation(pool, tenant.id, "s-jane", [("user", "My diagnosis is diabetes, about the yoga classes")],
                             variables={"contact_id": email})
    async with services(pool) as (svc, configs):
        configs.set(tenant.id, recall_across_sessions=True)
        await svc.leads.collect({"name": "Jane", "email": email, "phone": "+44 20 7946 0958",
                                 "notes": "yoga classes after her diagnosis"}, ctx(tenant.id, "s-jane"))
        claimed = ctx(tenant.id, "s-mallory", variables={"contact_id": email})
        await svc.memory.remember(claimed, "Asked about yoga classes too")
        searched = await svc.memory.recall({"query": "yoga classes diagnosis"}, claimed)
        latest = await svc.memory.recall({"query": "what do you know about me"}, claimed)
    for result in (searched, latest):
        assert [m["content"] for m in result["memories"]] == ["Asked about yoga classes too"], result
        assert all(m["conversation"] == "this one" for m in result["memories"])


async def test_results_are_ranked_by_relevance(pool, make_tenant):
    tenant, _ = await make_tenant("mem")
    c = ctx(tenant.id)
    async with services(pool) as (svc, _configs):
        await svc.memory.remember(c, "The customer mentioned a dog once")
        await svc.memory.remember(c, "Allergic to dog hair; the dog is a large dog called Rex")
        await svc.memory.remember(c, "Prefers morning appointments")
        result = await svc.memory.recall({"query": "dog hair allergy"}, c)
    assert [m["content"] for m in result["memories"]] == [
        "Allergic to dog hair; the dog is a large dog called Rex", "The customer mentioned a dog once"]
    assert result["memories"][0]["conversation"] == "this one"


async def test_the_tenant_language_stems_words_and_an_unknown_language_falls_back(pool, make_tenant):
    tenant, _ = await make_tenant("mem")
    async with services(pool) as (svc, _configs):
        german = ctx(tenant.id, language="german")
        await svc.memory.remember(german, "Der Kunde möchte zwei Häuser besichtigen")
        found = await svc.memory.recall({"query": "Haus besichtigung"}, german)
        assert found["found"] == 1, found  # german stemming: Häuser ~ Haus

        english = ctx(tenant.id, language="english")
        await svc.memory.remember(english, "She is running a marathon in October")
        assert (await svc.memory.recall({"query": "runs"}, english))["found"] == 1  # run ~ running

        odd = ctx(tenant.id, language="klingon")
        await svc.memory.remember(odd, "qapla batlh")
        assert (await svc.memory.recall({"query": "batlh"}, odd))["found"] == 1
        rows = await pool.fetch("SELECT language::text AS l FROM ce_memories WHERE tenant_id = $1 ORDER BY created_at",
                                tenant.id)
        assert [r["l"] for r in rows] == ["german", "english", "simple"]


async def test_memories_never_cross_tenants_or_unrelated_sessions(pool, make_tenant):
    acme, _ = await make_tenant("mem")
    other, _ = await make_tenant("mem")
    sub = "shared-sub"  # the same verified `sub` at two tenants: two different people
    await store_conversation(pool, other.id, "s1", [("user", "my secret recipe uses saffron")], contact_sub=sub)
    async with services(pool) as (svc, configs):
        configs.set(acme.id, recall_across_sessions=True)
        configs.set(other.id, recall_across_sessions=True)
        await svc.memory.remember(ctx(other.id, "s1", contact_sub=sub), "Loves saffron")
        await svc.memory.remember(ctx(acme.id, "unrelated"), "Saffron supplier called")
        # same contact and the same session id, but another tenant
        result = await svc.memory.recall({"query": "saffron"}, ctx(acme.id, "s1", contact_sub=sub))
    assert result["found"] == 0 and result["memories"] == []
    assert "nothing is remembered" in result["note"]


async def test_a_query_that_matches_nothing_returns_the_latest_facts(pool, make_tenant):
    tenant, _ = await make_tenant("mem")
    c = ctx(tenant.id, variables={"contact_id": "pat@example.com"})
    async with services(pool) as (svc, _configs):
        await svc.memory.remember(c, "Booked appointment: haircut on 2026-07-02T10:00+00:00 (UTC)")
        result = await svc.memory.recall({"query": "what do you know about me"}, c)
        assert result["found"] == 1
        assert result["note"].startswith("nothing matched")
        assert "haircut" in result["summary"]

        tricky = await svc.memory.recall({"query": "a & (b | !c) 'quote' \\ :*"}, c)
        assert tricky["found"] == 1  # tsquery syntax in the question is just text
        for odd in ("haircut\x00", "hair\udc80cut"):  # text Postgres cannot hold: searched as it can
            assert (await svc.memory.recall({"query": odd}, c))["found"] == 1

        with pytest.raises(InvalidArguments, match="'query' is empty"):
            await svc.memory.recall({"query": "   "}, c)


async def test_recalled_facts_reach_the_model_but_not_the_call_record(pool, make_tenant):
    # a lead's fact holds the contact's email and phone: before, ce_tool_calls.result kept a copy
    tenant, _ = await make_tenant("mem")
    c = ctx(tenant.id)
    async with services(pool) as (svc, _configs):
        await svc.leads.collect({"name": "Jane", "email": "jane.recall@example.com", "phone": "+44 20 7946 0958"}, c)
        out = await through_executor(svc, c, "recall_memory", {"query": "lead details"})
    assert out.success and "jane.recall@example.com" in out.content  # what the model reads is whole
    record = out.record.result
    assert record["found"] == 1 and record["summary"] == REDACTED
    assert [m["content"] for m in record["memories"]] == [REDACTED]
    assert record["memories"][0]["from"] == "saved fact"  # the rest of the result stays readable
    assert out.record.parameters == {"query": "lead details"}
