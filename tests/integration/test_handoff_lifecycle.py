"""A handoff's lifecycle on the real Postgres: requested -> assigned -> resolved (or requested ->
resolved), the conflicts and idempotent repeats, one open handoff per session, tenant isolation,
racing claims, the events written once per transition in the outbox, the session's last messages
beside each handoff, and migration 017 on rows written before it."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import msgspec
import pytest

from kernel.errors import Conflict, InvalidInput, NotFound
from kernel.records import MessageRecord, SessionDelta, SessionSnapshot
from services.builtins.handoff import ASSIGNED_EVENT, EVENT, RESOLVED_EVENT
from storage.migrate import load_migrations, migrate
from storage.pool import connect, create_pool
from storage.repos.builtins import HandoffConflict, HandoffMessage, HandoffRepo
from storage.repos.sessions import SessionRepo
from tests.support.builtin_services import SECRET, ctx, receiver, services


async def events(pool, tenant_id: str) -> list[tuple[str, dict[str, Any]]]:
    """(event type, data) of every event queued in the outbox for the tenant, oldest first."""
    rows = await pool.fetch(
        "SELECT event_type, payload FROM ce_notifications WHERE tenant_id = $1 ORDER BY created_at, id", tenant_id)
    return [(r["event_type"], r["payload"]["data"]) for r in rows]


async def escalated(svc, tenant_id: str, session_id: str, key: str = "m1:call", reason: str = "wants a person") -> str:
    """Escalate the session as escalate_to_human does; returns the handoff id."""
    return (await svc.handoff.escalate({"reason": reason}, ctx(tenant_id, session_id, key=key)))["handoff_id"]


@pytest.fixture
async def world(pool, make_tenant):
    """The built-in services, a tenant whose events go to a receiver on loopback, and that receiver."""
    tenant, _ = await make_tenant("lifecycle")
    async with receiver() as rec, services(pool) as (svc, configs):
        configs.set(tenant.id, notification_webhook=rec.url, notification_secret=SECRET)
        yield svc, configs, tenant


# -- transitions ---------------------------------------------------------------------------------


async def test_a_claim_assigns_the_handoff_and_announces_it_once(pool, world):
    svc, _configs, tenant = world
    handoff_id = await escalated(svc, tenant.id, "s-claim")

    row = await svc.handoff.claim(tenant.id, handoff_id, "  ann  ")
    assert (row.id, row.state, row.agent, row.session_id) == (handoff_id, "assigned", "ann", "s-claim")
    assert row.assigned_at is not None and row.resolved_at is None and row.return_to_bot is None
    assert row.updated_at >= row.assigned_at >= row.created_at

    again = await svc.handoff.claim(tenant.id, handoff_id, "ann")  # the same agent: idempotent
    assert again == row
    stored = await svc.repos.handoffs.get(tenant.id, handoff_id)
    assert (stored.state, stored.agent, stored.assigned_at) == ("assigned", "ann", row.assigned_at)

    assert [t for t, _ in await events(pool, tenant.id)] == [EVENT, ASSIGNED_EVENT]
    _type, data = (await events(pool, tenant.id))[1]
    assert data == {"handoff_id": handoff_id, "session_id": "s-claim", "state": "assigned", "agent": "ann",
                    "created_at": row.created_at.isoformat(), "assigned_at": row.assigned_at.isoformat()}


async def test_resolving_an_assigned_handoff_closes_it_and_announces_it_once(pool, world):
    svc, _configs, tenant = world
    handoff_id = await escalated(svc, tenant.id, "s-resolve")
    await svc.handoff.claim(tenant.id, handoff_id, "ann")

    row = await svc.handoff.resolve(tenant.id, handoff_id, True)
    assert (row.state, row.agent, row.return_to_bot) == ("resolved", "ann", True)
    assert row.resolved_at is not None and row.resolved_at >= row.assigned_at
    assert await svc.handoff.resolve(tenant.id, handoff_id, True) == row  # the same way again: idempotent
    assert await svc.repos.handoffs.open_for_session(tenant.id, "s-resolve") is None

    queued = await events(pool, tenant.id)
    assert [t for t, _ in queued] == [EVENT, ASSIGNED_EVENT, RESOLVED_EVENT]
    assert queued[2][1] == {
        "handoff_id": handoff_id, "session_id": "s-resolve", "state": "resolved", "agent": "ann",
        "created_at": row.created_at.isoformat(), "assigned_at": row.assigned_at.isoformat(),
        "return_to_bot": True, "resolved_at": row.resolved_at.isoformat(),
    }


async def test_a_requested_handoff_can_be_resolved_without_being_claimed(pool, world):
    svc, _configs, tenant = world
    handoff_id = await escalated(svc, tenant.id, "s-direct")
    row = await svc.handoff.resolve(tenant.id, handoff_id, False)
    assert (row.state, row.agent, row.assigned_at, row.return_to_bot) == ("resolved", None, None, False)
    (_type, data), = [e for e in await events(pool, tenant.id) if e[0] == RESOLVED_EVENT]
    assert (data["agent"], data["assigned_at"], data["return_to_bot"]) == (None, None, False)


async def test_the_events_reach_the_tenant_webhook_in_order(pool, make_tenant):
    tenant, _ = await make_tenant("lifecycle")
    async with receiver() as rec, services(pool) as (svc, configs):
        configs.set(tenant.id, notification_webhook=rec.url, notification_secret=SECRET)
        handoff_id = await escalated(svc, tenant.id, "s-sent")
        await svc.handoff.claim(tenant.id, handoff_id, "ann")
        await svc.handoff.resolve(tenant.id, handoff_id, True)
        await rec.wait(3)
        await svc.notifier.drain(5)
    assert sorted(msgspec.json.decode(body)["type"] for _h, body in rec.requests) == sorted(
        [EVENT, ASSIGNED_EVENT, RESOLVED_EVENT])


async def test_a_tenant_without_a_webhook_changes_state_and_queues_nothing(pool, make_tenant):
    tenant, _ = await make_tenant("lifecycle")
    async with services(pool) as (svc, _configs):
        handoff_id = await escalated(svc, tenant.id, "s-quiet")
        assert (await svc.handoff.claim(tenant.id, handoff_id, "ann")).state == "assigned"
        assert (await svc.handoff.resolve(tenant.id, handoff_id, True)).state == "resolved"
    assert await events(pool, tenant.id) == []


# -- conflicts ------------------------------------------------------------------------------------


async def test_another_agent_cannot_claim_an_assigned_handoff(pool, world):
    svc, _configs, tenant = world
    handoff_id = await escalated(svc, tenant.id, "s-taken")
    await svc.handoff.claim(tenant.id, handoff_id, "ann")
    with pytest.raises(Conflict, match=rf"handoff '{handoff_id}' is already assigned to 'ann'; it stays theirs") as e:
        await svc.handoff.claim(tenant.id, handoff_id, "bob")
    assert isinstance(e.value, HandoffConflict)
    assert (e.value.handoff_id, e.value.state, e.value.agent) == (handoff_id, "assigned", "ann")
    assert (await svc.repos.handoffs.get(tenant.id, handoff_id)).agent == "ann"
    assert [t for t, _ in await events(pool, tenant.id)] == [EVENT, ASSIGNED_EVENT]


@pytest.mark.parametrize("agent", ["ann", "bob"])
async def test_a_resolved_handoff_cannot_be_claimed(pool, world, agent):
    svc, _configs, tenant = world
    handoff_id = await escalated(svc, tenant.id, "s-closed")
    await svc.handoff.claim(tenant.id, handoff_id, "ann")
    await svc.handoff.resolve(tenant.id, handoff_id, True)
    with pytest.raises(HandoffConflict, match=r"was resolved with return_to_bot=true and cannot be claimed; "
                                              r"the session's next escalation opens a new handoff"):
        await svc.handoff.claim(tenant.id, handoff_id, agent)
    assert (await svc.repos.handoffs.get(tenant.id, handoff_id)).state == "resolved"


async def test_a_resolved_handoff_cannot_be_resolved_the_other_way(pool, world):
    svc, _configs, tenant = world
    handoff_id = await escalated(svc, tenant.id, "s-twice")
    await svc.handoff.resolve(tenant.id, handoff_id, False)
    with pytest.raises(HandoffConflict, match=r"was resolved with return_to_bot=false and cannot be resolved again "
                                              r"with return_to_bot=true; a resolved handoff is final"):
        await svc.handoff.resolve(tenant.id, handoff_id, True)
    row = await svc.repos.handoffs.get(tenant.id, handoff_id)
    assert (row.state, row.return_to_bot) == ("resolved", False)
    assert [t for t, _ in await events(pool, tenant.id)] == [EVENT, RESOLVED_EVENT]


@pytest.mark.parametrize("call", ["get", "claim", "resolve"])
async def test_an_unknown_handoff_is_not_found(world, call):
    svc, _configs, tenant = world
    act = {"get": lambda: svc.repos.handoffs.get(tenant.id, "no-such-id"),
           "claim": lambda: svc.handoff.claim(tenant.id, "no-such-id", "ann"),
           "resolve": lambda: svc.handoff.resolve(tenant.id, "no-such-id", True)}[call]
    with pytest.raises(NotFound, match=r"handoff 'no-such-id' does not exist for this tenant") as e:
        await act()
    assert (e.value.kind, e.value.key) == ("handoff", "no-such-id")


async def test_an_id_postgres_cannot_hold_is_not_found_rather_than_a_crash(world):
    svc, _configs, tenant = world
    for attempt in (lambda: svc.repos.handoffs.get(tenant.id, "h\x00\ud800"),
                    lambda: svc.handoff.claim(tenant.id, "h\x00\ud800", "ann"),
                    lambda: svc.handoff.resolve(tenant.id, "h\x00\ud800", True)):
        with pytest.raises(NotFound, match="does not exist for this tenant"):
            await attempt()
    assert await svc.repos.handoffs.open_for_session(tenant.id, "s\x00") is None


@pytest.mark.parametrize(("agent", "message"), [
    ("", "agent must name who takes the handoff, got an empty name"),
    ("   ", "agent must name who takes the handoff, got an empty name"),
    ("a" * 201, "agent must be at most 200 characters, got 201"),
])
async def test_a_claim_needs_an_agent_name(world, agent, message):
    svc, _configs, tenant = world
    handoff_id = await escalated(svc, tenant.id, "s-noname")
    with pytest.raises(InvalidInput, match=message):
        await svc.handoff.claim(tenant.id, handoff_id, agent)
    assert (await svc.repos.handoffs.get(tenant.id, handoff_id)).state == "requested"


# -- one open handoff per session ---------------------------------------------------------------


async def test_escalating_a_session_with_an_open_handoff_answers_with_that_handoff(pool, world):
    svc, _configs, tenant = world
    first = await escalated(svc, tenant.id, "s-open", key="m1:call", reason="refund")
    # a later message escalates again (another idempotency key), before and after a claim
    assert await escalated(svc, tenant.id, "s-open", key="m2:call", reason="still waiting") == first
    await svc.handoff.claim(tenant.id, first, "ann")
    assert await escalated(svc, tenant.id, "s-open", key="m3:call", reason="hello?") == first

    rows = await svc.repos.handoffs.list(tenant.id)
    assert [(r.id, r.reason, r.state) for r in rows] == [(first, "refund", "assigned")]
    assert (await svc.repos.handoffs.open_for_session(tenant.id, "s-open")).id == first
    assert [t for t, _ in await events(pool, tenant.id)] == [EVENT, ASSIGNED_EVENT]


async def test_after_a_resolve_the_next_escalation_opens_a_new_handoff(pool, world):
    svc, _configs, tenant = world
    first = await escalated(svc, tenant.id, "s-again", key="m1:call")
    await svc.handoff.resolve(tenant.id, first, True)
    # a replay of the first escalation still finds its own (resolved) row
    assert await escalated(svc, tenant.id, "s-again", key="m1:call") == first
    second = await escalated(svc, tenant.id, "s-again", key="m7:call", reason="back again")
    assert second != first

    assert [(r.id, r.state) for r in await svc.repos.handoffs.list(tenant.id)] == [
        (second, "requested"), (first, "resolved")]
    assert (await svc.repos.handoffs.open_for_session(tenant.id, "s-again")).id == second
    assert [t for t, _ in await events(pool, tenant.id)] == [EVENT, RESOLVED_EVENT, EVENT]


async def test_racing_escalations_of_one_session_open_one_handoff(pool, world):
    svc, _configs, tenant = world
    ids = await asyncio.gather(*(escalated(svc, tenant.id, "s-race", key=f"m{i}:call") for i in range(8)))
    assert len(set(ids)) == 1
    assert len(await svc.repos.handoffs.list(tenant.id)) == 1
    assert [t for t, _ in await events(pool, tenant.id)] == [EVENT]


async def test_the_database_refuses_a_second_open_handoff_of_a_session(pool, make_tenant):
    tenant, _ = await make_tenant("lifecycle")
    insert = "INSERT INTO ce_handoffs (tenant_id, session_id, reason) VALUES ($1, 's-db', 'x') RETURNING id"
    first = await pool.fetchval(insert, tenant.id)
    with pytest.raises(asyncpg.UniqueViolationError, match="ce_handoffs_one_open_idx"):
        await pool.fetchval(insert, tenant.id)
    await pool.execute("UPDATE ce_handoffs SET state = 'resolved', resolved_at = now() WHERE id = $1", first)
    assert await pool.fetchval(insert, tenant.id) != first


# -- races ----------------------------------------------------------------------------------------


async def test_of_concurrent_claims_by_different_agents_exactly_one_wins(pool, world):
    svc, _configs, tenant = world
    handoff_id = await escalated(svc, tenant.id, "s-rush")
    agents = [f"agent-{i}" for i in range(8)]
    outcomes = await asyncio.gather(*(svc.handoff.claim(tenant.id, handoff_id, a) for a in agents),
                                    return_exceptions=True)
    won = [o for o in outcomes if not isinstance(o, BaseException)]
    lost = [o for o in outcomes if isinstance(o, BaseException)]
    assert len(won) == 1 and won[0].agent in agents
    assert len(lost) == 7 and all(isinstance(e, HandoffConflict) and e.agent == won[0].agent for e in lost)
    assert (await svc.repos.handoffs.get(tenant.id, handoff_id)).agent == won[0].agent
    assert [(t, d["agent"]) for t, d in await events(pool, tenant.id) if t == ASSIGNED_EVENT] == [
        (ASSIGNED_EVENT, won[0].agent)]


async def test_a_claim_racing_a_resolve_ends_resolved_with_one_event_each_way_it_went(pool, world):
    svc, _configs, tenant = world
    for n in range(5):
        handoff_id = await escalated(svc, tenant.id, f"s-cross-{n}")
        claim, resolve = await asyncio.gather(svc.handoff.claim(tenant.id, handoff_id, "ann"),
                                              svc.handoff.resolve(tenant.id, handoff_id, True),
                                              return_exceptions=True)
        assert not isinstance(resolve, BaseException) and resolve.state == "resolved"
        # (the outbox's created_at is when an event's transaction began, not its commit order)
        types = sorted(t for t, d in await events(pool, tenant.id) if d["handoff_id"] == handoff_id)
        if isinstance(claim, HandoffConflict):  # the resolve came first: the claim was refused
            assert (resolve.agent, types) == (None, sorted([EVENT, RESOLVED_EVENT]))
        else:  # the claim came first, and the resolve closed the assigned handoff after it
            assert (claim.state, resolve.agent, types) == (
                "assigned", "ann", sorted([EVENT, ASSIGNED_EVENT, RESOLVED_EVENT]))
            assert resolve.resolved_at >= resolve.assigned_at == claim.assigned_at


# -- tenant isolation -----------------------------------------------------------------------------


async def test_another_tenant_cannot_see_claim_or_resolve_a_handoff(pool, make_tenant, world):
    svc, configs, a = world
    b, _ = await make_tenant("lifecycle-b")
    configs.set(b.id, notification_webhook="http://127.0.0.1:9/hooks/b", notification_secret=SECRET)
    a_id = await escalated(svc, a.id, "shared-session")

    for attempt in (lambda: svc.repos.handoffs.get(b.id, a_id), lambda: svc.handoff.claim(b.id, a_id, "mallory"),
                    lambda: svc.handoff.resolve(b.id, a_id, True)):
        with pytest.raises(NotFound, match="does not exist for this tenant"):
            await attempt()
    assert await svc.repos.handoffs.list(b.id) == []
    assert await svc.repos.handoffs.open_for_session(b.id, "shared-session") is None

    # B's own session of the same id has its own handoff; A's is untouched
    b_id = await escalated(svc, b.id, "shared-session")
    assert b_id != a_id
    await svc.handoff.claim(b.id, b_id, "mallory")
    row = await svc.repos.handoffs.get(a.id, a_id)
    assert (row.state, row.agent) == ("requested", None)
    assert [r.id for r in await svc.repos.handoffs.list(a.id)] == [a_id]
    assert [t for t, _ in await events(pool, a.id)] == [EVENT]


# -- listing and the session's messages ------------------------------------------------------------


def _text(t: str) -> list[dict[str, Any]]:
    return [{"type": "text", "text": t}]


async def store_conversation(pool, tenant_id: str, session_id: str, messages: list[tuple[str, list]]) -> None:
    """Store the session's messages as the session host's flush does."""
    sessions = SessionRepo(pool)
    lease = await sessions.activate(tenant_id, session_id, owner="test")
    records = [MessageRecord(seq=i + 1, role=role, content=content) for i, (role, content) in enumerate(messages)]
    result = await sessions.flush([SessionDelta(tenant_id=tenant_id, session_id=session_id, epoch=lease.epoch,
                                                snapshot=SessionSnapshot(message_count=len(records)),
                                                messages=records)])
    assert result.written == [(tenant_id, session_id)]


async def test_a_listing_shows_each_handoff_with_its_sessions_last_messages_with_text(pool, world):
    svc, _configs, tenant = world
    await store_conversation(pool, tenant.id, "s-talk", [
        ("user", _text("hi")),
        ("assistant", _text("hello, how can I help?")),
        ("user", _text("where is order 7?")),
        ("assistant", [{"type": "text", "text": "Let me look."},
                       {"type": "tool_use", "id": "t1", "name": "check_order", "input": {"id": "7"}}]),
        ("user", [{"type": "tool_result", "tool_use_id": "t1", "content": "{\"status\": \"lost\"}"}]),
        ("assistant", [{"type": "text", "text": "It seems lost."}, {"type": "text", "text": "Sorry!"}]),
        ("user", _text("I want a person")),
    ])
    handoff_id = await escalated(svc, tenant.id, "s-talk")

    (row,) = await svc.repos.handoffs.list(tenant.id)
    assert row.id == handoff_id
    # the last 5 messages that hold text, oldest first; the tool result (seq 5) is no message a person reads
    assert row.messages == [
        HandoffMessage(role="assistant", text="hello, how can I help?", seq=2),
        HandoffMessage(role="user", text="where is order 7?", seq=3),
        HandoffMessage(role="assistant", text="Let me look.", seq=4),
        HandoffMessage(role="assistant", text="It seems lost.\nSorry!", seq=6),
        HandoffMessage(role="user", text="I want a person", seq=7),
    ]
    got = await svc.repos.handoffs.get(tenant.id, handoff_id, last_messages=2)
    assert [m.seq for m in got.messages] == [6, 7]
    assert (await svc.repos.handoffs.list(tenant.id, last_messages=0))[0].messages == []
    # writes and the open-handoff lookup do not read messages
    assert (await svc.repos.handoffs.open_for_session(tenant.id, "s-talk")).messages is None
    assert (await svc.handoff.claim(tenant.id, handoff_id, "ann")).messages is None


async def test_a_handoff_of_a_session_never_stored_lists_no_messages(world):
    svc, _configs, tenant = world
    await escalated(svc, tenant.id, "s-unflushed")
    assert [r.messages for r in await svc.repos.handoffs.list(tenant.id)] == [[]]


async def test_another_tenants_session_of_the_same_id_lends_no_messages(pool, make_tenant, world):
    svc, _configs, a = world
    b, _ = await make_tenant("lifecycle-b")
    await store_conversation(pool, b.id, "same-id", [("user", _text("tenant b's secret"))])
    await store_conversation(pool, a.id, "same-id", [("user", _text("tenant a's question"))])
    await escalated(svc, a.id, "same-id")
    assert [m.text for m in (await svc.repos.handoffs.list(a.id))[0].messages] == ["tenant a's question"]


async def test_a_listing_filters_by_state_newest_first(world):
    svc, _configs, tenant = world
    ids = [await escalated(svc, tenant.id, f"s-list-{i}") for i in range(4)]
    await svc.handoff.claim(tenant.id, ids[1], "ann")
    await svc.handoff.claim(tenant.id, ids[2], "bob")
    await svc.handoff.resolve(tenant.id, ids[3], True)
    repo = svc.repos.handoffs
    assert [r.id for r in await repo.list(tenant.id)] == ids[::-1]
    assert [r.id for r in await repo.list(tenant.id, "requested")] == [ids[0]]
    assert [r.id for r in await repo.list(tenant.id, state="assigned")] == [ids[2], ids[1]]
    assert [r.id for r in await repo.list(tenant.id, "resolved")] == [ids[3]]
    assert [r.id for r in await repo.list(tenant.id, limit=2)] == [ids[3], ids[2]]
    assert [r.id for r in await repo.list(tenant.id, "assigned", 1)] == [ids[2]]
    with pytest.raises(InvalidInput, match=r"state must be one of requested, assigned, resolved, got 'open'"):
        await repo.list(tenant.id, "open")  # type: ignore[arg-type]


# -- migration 017 on rows written before it ------------------------------------------------------


async def test_migration_017_leaves_earlier_handoffs_requested_and_closes_a_sessions_duplicates(fresh_db):
    conn = await connect(url := await fresh_db(migrated=False))
    try:
        await migrate(conn, migrations=[m for m in load_migrations() if m.version < 17])
        insert = ("INSERT INTO ce_handoffs (tenant_id, session_id, reason, created_at) "
                  "VALUES ($1, $2, $3, now() - make_interval(mins => $4)) RETURNING id")
        single = await conn.fetchval(insert, "t1", "s1", "one", 30)
        first = await conn.fetchval(insert, "t1", "s2", "first", 20)
        later = await conn.fetchval(insert, "t1", "s2", "again", 10)
        other_tenant = await conn.fetchval(insert, "t2", "s2", "theirs", 5)
        assert "017_handoff_lifecycle" in await migrate(conn)

        rows = {r["id"]: r for r in await conn.fetch("SELECT * FROM ce_handoffs")}
        for kept in (single, first, other_tenant):
            assert rows[kept]["state"] == "requested" and rows[kept]["resolved_at"] is None
            assert rows[kept]["updated_at"] == rows[kept]["created_at"]
        assert rows[later]["state"] == "resolved" and rows[later]["resolved_at"] is not None
        assert rows[later]["return_to_bot"] is None and rows[later]["agent"] is None

        handoffs = HandoffRepo(pool := await create_pool(url, min_size=1, max_size=2))
        try:
            for attempt in (lambda: handoffs.claim("t1", later, "ann"), lambda: handoffs.resolve("t1", later, True)):
                with pytest.raises(HandoffConflict, match="was closed as a duplicate of an earlier handoff of its session"):
                    await attempt()
            assert (await handoffs.claim("t1", first, "ann"))[0].state == "assigned"
        finally:
            await pool.close()
    finally:
        await conn.close()
