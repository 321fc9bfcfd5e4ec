"""SessionRepo: leases fenced by epochs, group-committed flushes, idempotent turns, session views.

The fencing tests are the core: an owner whose lease was taken over must not write anything.
"""

from __future__ import annotations

import asyncio
import secrets
from datetime import UTC, datetime

import pytest

from kernel.errors import NotFound
from kernel.records import (
    MessageRecord,
    SessionDelta,
    SessionSnapshot,
    ToolCallRecord,
    TurnRecord,
    UsageDelta,
    session_uid,
)
from storage.repos import SessionRepo


@pytest.fixture
def sessions(pool) -> SessionRepo:
    return SessionRepo(pool)


def sid() -> str:
    return "s-" + secrets.token_hex(4)


def message(seq: int, text: str, *, role: str = "user", message_id: str | None = None) -> MessageRecord:
    return MessageRecord(seq=seq, role=role, content=[{"type": "text", "text": text}], message_id=message_id)


def call(tenant_id: str, session_id: str, name: str = "check_order", *, ok: bool = True) -> ToolCallRecord:
    return ToolCallRecord(
        id="call_" + secrets.token_hex(6), tenant_id=tenant_id, session_id=session_id,
        message_id="m1", tool_name=name, parameters={"order_id": "42"}, result={"status": "shipped"},
        success=ok, latency_ms=12, queue_ms=3, error=None if ok else "upstream timeout",
    )


def delta(tenant_id: str, session_id: str, epoch: int, **changes) -> SessionDelta:
    snapshot = changes.pop("snapshot", SessionSnapshot(message_count=len(changes.get("messages", []))))
    return SessionDelta(tenant_id=tenant_id, session_id=session_id, epoch=epoch, snapshot=snapshot, **changes)


async def count(pool, table: str, tenant_id: str, session_id: str) -> int:
    return await pool.fetchval(
        f"SELECT count(*) FROM {table} WHERE tenant_id = $1 AND session_id = $2",
        tenant_id, session_uid(tenant_id, session_id),
    )


async def test_first_activation_creates_the_session_and_each_one_bumps_the_epoch(sessions, make_tenant):
    tenant, _ = await make_tenant()
    s = sid()
    first = await sessions.activate(tenant.id, s, owner="host-1")
    assert (first.epoch, first.snapshot, first.variables, first.history) == (1, SessionSnapshot(), {}, [])
    second = await sessions.activate(tenant.id, s, owner="host-2")
    assert second.epoch == 2
    assert await sessions.current_epoch(tenant.id, s) == 2
    assert await sessions.current_epoch(tenant.id, "never-seen") is None


async def test_flush_writes_every_kind_of_state_and_activation_loads_it(sessions, pool, make_tenant):
    tenant, _ = await make_tenant()
    s = sid()
    lease = await sessions.activate(tenant.id, s, owner="host-1")
    snap = SessionSnapshot(breakers={"check_order": 3, "other": 1}, completed=["collect_lead"],
                           handoff=True, handoff_reason="asked for a human", message_count=4)
    result = await sessions.flush([delta(
        tenant.id, s, lease.epoch, snapshot=snap,
        messages=[message(i, f"m{i}", role="user" if i % 2 == 0 else "assistant") for i in range(4)],
        variables={"lead_collected": "true", "order_id_checked": "12345"},
        tool_calls=[call(tenant.id, s), call(tenant.id, s, ok=False)],
        usage=[UsageDelta(model="claude-haiku-4-5", input_tokens=100, output_tokens=20)],
        turns=[TurnRecord(message_id="m1", response={"reply": "hello", "rounds": 1})],
    )])
    assert result.written == [(tenant.id, s)] and result.refused == []

    row = await pool.fetchrow(
        "SELECT message_count, handoff, snapshot FROM ce_sessions WHERE id = $1", session_uid(tenant.id, s)
    )
    assert (row["message_count"], row["handoff"]) == (4, True)
    assert await count(pool, "ce_tool_calls", tenant.id, s) == 2
    assert await sessions.get_turn(tenant.id, s, "m1") == {"reply": "hello", "rounds": 1}

    again = await sessions.activate(tenant.id, s, owner="host-2", history_limit=3)
    assert again.epoch == lease.epoch + 1
    assert again.snapshot == snap
    assert again.variables == {"lead_collected": "true", "order_id_checked": "12345"}
    assert [m.seq for m in again.history] == [1, 2, 3]  # the last 3, in seq order
    assert again.history[0] == message(1, "m1", role="assistant")

    view = await sessions.get_session_view(tenant.id, s)
    assert view.session_id == s
    assert view.variables == {"lead_collected": "true", "order_id_checked": "12345"}
    assert (view.open_breakers, view.handoff, view.messages) == (["check_order"], True, 4)


async def test_a_stale_owner_is_refused_and_writes_nothing(sessions, pool, make_tenant):
    tenant, _ = await make_tenant()
    s = sid()
    a = await sessions.activate(tenant.id, s, owner="host-a")
    await sessions.flush([delta(tenant.id, s, a.epoch, messages=[message(0, "from a")],
                                variables={"k": "a"})])
    b = await sessions.activate(tenant.id, s, owner="host-b")  # takes the lease over

    stale = delta(
        tenant.id, s, a.epoch,
        snapshot=SessionSnapshot(message_count=99, handoff=True, breakers={"x": 5}),
        messages=[message(1, "late from a")],
        variables={"k": "stale", "new": "stale"},
        tool_calls=[call(tenant.id, s)],
        usage=[UsageDelta(model="m", input_tokens=1, output_tokens=1)],
        turns=[TurnRecord(message_id="late", response={"reply": "stale"})],
    )
    result = await sessions.flush([stale])
    assert result.written == [] and result.refused == [(tenant.id, s)]

    view = await sessions.get_session_view(tenant.id, s)
    assert (view.messages, view.handoff, view.open_breakers, view.variables) == (1, False, [], {"k": "a"})
    assert await count(pool, "ce_messages", tenant.id, s) == 1
    assert await count(pool, "ce_tool_calls", tenant.id, s) == 0
    assert await count(pool, "ce_usage", tenant.id, s) == 0
    assert await sessions.get_turn(tenant.id, s, "late") is None

    # the new owner continues from what a had flushed
    assert [m.content[0]["text"] for m in b.history] == ["from a"]
    ok = await sessions.flush([delta(tenant.id, s, b.epoch, messages=[message(1, "from b")],
                                     snapshot=SessionSnapshot(message_count=2))])
    assert ok.written == [(tenant.id, s)]


async def test_a_never_activated_session_is_refused(sessions, make_tenant):
    tenant, _ = await make_tenant()
    result = await sessions.flush([delta(tenant.id, sid(), 1, messages=[message(0, "x")])])
    assert result.written == [] and len(result.refused) == 1


async def test_racing_activations_get_distinct_epochs_and_only_the_last_can_write(sessions, pool, make_tenant):
    tenant, _ = await make_tenant()
    for _ in range(25):  # first activations racing: the session row is created by one of them
        fresh = sid()
        raced = await asyncio.gather(*(sessions.activate(tenant.id, fresh, owner=f"h{i}") for i in range(8)))
        assert sorted(lease.epoch for lease in raced) == list(range(1, 9))
    s = sid()
    leases = await asyncio.gather(*(sessions.activate(tenant.id, s, owner=f"h{i}") for i in range(8)))
    epochs = sorted(lease.epoch for lease in leases)
    assert epochs == list(range(1, 9))
    results = await asyncio.gather(*(
        sessions.flush([delta(tenant.id, s, lease.epoch, variables={"owner": str(lease.epoch)})])
        for lease in leases
    ))
    winners = [lease.epoch for lease, r in zip(leases, results, strict=True) if r.written]
    assert winners == [8]
    assert (await sessions.get_session_view(tenant.id, s)).variables == {"owner": "8"}


async def test_flush_racing_a_takeover_is_all_or_nothing(sessions, pool, make_tenant):
    """Either the old owner's flush commits before the takeover (and the new owner loads it), or
    it is refused and nothing of it exists. Never a half, never a write after the takeover."""
    tenant, _ = await make_tenant()
    outcomes = set()
    for i in range(25):
        s = f"race-{i}"
        a = await sessions.activate(tenant.id, s, owner="a")
        d = delta(tenant.id, s, a.epoch, messages=[message(0, "a")], variables={"by": "a"},
                  tool_calls=[call(tenant.id, s)])
        result, b = await asyncio.gather(sessions.flush([d]), sessions.activate(tenant.id, s, owner="b"))
        written = bool(result.written)
        outcomes.add(written)
        assert bool(b.history) is written and (b.variables == {"by": "a"}) is written
        assert await count(pool, "ce_messages", tenant.id, s) == int(written)
        assert await count(pool, "ce_tool_calls", tenant.id, s) == int(written)
        refused_later = await sessions.flush([delta(tenant.id, s, a.epoch, messages=[message(1, "late")])])
        assert refused_later.refused == [(tenant.id, s)]
    assert outcomes  # at least one interleaving observed; both are valid


async def test_a_flush_waiting_on_a_takeover_that_commits_is_refused_and_writes_nothing(sessions, pool, make_tenant):
    """The race, made certain: the new activation holds the bumped epoch uncommitted, the flush
    blocks on the session's row, then the activation commits. The flush must see the new epoch."""
    tenant, _ = await make_tenant()
    s = sid()
    lease = await sessions.activate(tenant.id, s, owner="a")
    uid = session_uid(tenant.id, s)
    async with pool.acquire() as takeover:
        bump = takeover.transaction()
        await bump.start()
        await takeover.execute("UPDATE ce_sessions SET epoch = epoch + 1, owner = 'b' WHERE id = $1", uid)
        flush = asyncio.create_task(sessions.flush([delta(
            tenant.id, s, lease.epoch, messages=[message(0, "a")], variables={"by": "a"},
            tool_calls=[call(tenant.id, s)], usage=[UsageDelta(model="m", input_tokens=1, output_tokens=1)],
            turns=[TurnRecord(message_id="m1", response={"reply": "a"})],
            snapshot=SessionSnapshot(message_count=1))]))
        async with asyncio.timeout(10):
            while not await pool.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                    "AND pg_blocking_pids(pid) @> ARRAY[$1::int]", takeover.get_server_pid()):
                await asyncio.sleep(0.01)
        await bump.commit()
        result = await asyncio.wait_for(flush, 10)
    assert result.written == [] and result.refused == [(tenant.id, s)]
    for table in ("ce_messages", "ce_session_variables", "ce_tool_calls", "ce_usage", "ce_turns"):
        assert await count(pool, table, tenant.id, s) == 0, table
    assert await pool.fetchval("SELECT message_count FROM ce_sessions WHERE id = $1", uid) == 0


async def test_group_commit_writes_many_sessions_in_one_transaction(sessions, pool, make_tenant):
    tenant, _ = await make_tenant()
    ids = [f"bulk-{i}" for i in range(200)]
    leases = await asyncio.gather(*(sessions.activate(tenant.id, s, owner="host") for s in ids))
    for s in ids[:20]:  # 20 of them were taken over elsewhere since
        await sessions.activate(tenant.id, s, owner="elsewhere")
    deltas = [
        delta(tenant.id, lease.session_id, lease.epoch,
              messages=[message(0, "hi"), message(1, "hello", role="assistant")],
              variables={"n": lease.session_id}, tool_calls=[call(tenant.id, lease.session_id)],
              usage=[UsageDelta(model="m", input_tokens=10, output_tokens=5)])
        for lease in leases
    ]
    result = await sessions.flush(deltas)
    assert sorted(s for _, s in result.refused) == sorted(ids[:20])
    assert sorted(s for _, s in result.written) == sorted(ids[20:])

    uids = [session_uid(tenant.id, s) for s in ids[20:]]
    # one transaction: every written row carries the same creating/updating transaction id
    xids = await pool.fetch(
        "SELECT DISTINCT xmin::text FROM ce_sessions WHERE id = ANY($1) "
        "UNION SELECT DISTINCT xmin::text FROM ce_messages WHERE session_id = ANY($1) "
        "UNION SELECT DISTINCT xmin::text FROM ce_tool_calls WHERE session_id = ANY($1)",
        uids,
    )
    assert len(xids) == 1
    assert await pool.fetchval("SELECT count(*) FROM ce_messages WHERE session_id = ANY($1)", uids) == 360
    totals = await sessions.usage_totals(tenant.id)
    assert [(u.model, u.input_tokens, u.output_tokens, u.sessions) for u in totals] == [("m", 1800, 900, 180)]


async def test_retried_flush_does_not_duplicate_rows_or_tokens_and_turns_keep_the_first_answer(sessions, pool, make_tenant):
    tenant, _ = await make_tenant()
    s = sid()
    lease = await sessions.activate(tenant.id, s, owner="h")
    d = delta(tenant.id, s, lease.epoch, messages=[message(0, "hi", message_id="m1")],
              tool_calls=[call(tenant.id, s)], turns=[TurnRecord(message_id="m1", response={"reply": "first"})],
              usage=[UsageDelta(model="main", input_tokens=100, output_tokens=10)])
    await sessions.flush([d])
    await sessions.flush([d])  # e.g. the ack of the first commit was lost
    later = delta(tenant.id, s, lease.epoch, messages=[message(1, "more", message_id="m2")],
                  usage=[UsageDelta(model="main", input_tokens=5, output_tokens=1)])
    await sessions.flush([later])
    await sessions.flush([later])
    await sessions.flush([delta(tenant.id, s, lease.epoch,
                                turns=[TurnRecord(message_id="m1", response={"reply": "second"})])])
    assert await count(pool, "ce_messages", tenant.id, s) == 2
    assert await count(pool, "ce_tool_calls", tenant.id, s) == 1
    totals = {u.model: (u.input_tokens, u.output_tokens) for u in await sessions.usage_totals(tenant.id)}
    assert totals == {"main": (105, 11)}  # each delta's tokens once
    assert await sessions.get_turn(tenant.id, s, "m1") == {"reply": "first"}
    assert await sessions.get_turn(tenant.id, s, "m2") is None


async def test_a_held_answer_gives_way_to_the_answer_its_approval_led_to_and_nothing_else_does(
    sessions, pool, make_tenant
):
    # A turn held for approval is stored (the client must see it durable before deciding); once
    # decided, the same message id's answer is the resumed turn's: held again, then finished.
    tenant, _ = await make_tenant()
    held_1 = {"reply": "confirm?", "pending_approval": {"approval_id": "apr_1"}}
    held_2 = {"reply": "and this?", "pending_approval": {"approval_id": "apr_2"}}
    for batch in ("one by one", "in one batch"):  # the second goes statement by statement
        s = sid()
        lease = await sessions.activate(tenant.id, s, owner="h")

        def turn(response, s=s, lease=lease):
            return delta(tenant.id, s, lease.epoch, turns=[TurnRecord(message_id="m1", response=response)])

        if batch == "one by one":
            await sessions.flush([turn(held_1)])
            await sessions.flush([turn(held_2)])
            assert await sessions.get_turn(tenant.id, s, "m1") == held_2
            await sessions.flush([turn({"reply": "done"})])
        else:
            await sessions.flush([turn(held_1), turn(held_2), turn({"reply": "done"})])
        await sessions.flush([turn(held_1)])  # a stale retry of the held answer changes nothing
        await sessions.flush([turn({"reply": "other"})])  # nor does a second finished answer
        assert await sessions.get_turn(tenant.id, s, "m1") == {"reply": "done"}, batch


async def test_a_retry_that_carries_newer_tokens_too_adds_only_the_newer(sessions, pool, make_tenant):
    # The first flush committed but its acknowledgement was lost; before the retry, a turn added
    # messages and tokens: the retry carries both deltas' tokens, each tagged with its own seq.
    tenant, _ = await make_tenant()
    s = sid()
    lease = await sessions.activate(tenant.id, s, owner="h")
    first = delta(tenant.id, s, lease.epoch, messages=[message(0, "a"), message(1, "b", role="assistant")],
                  usage=[UsageDelta(model="main", input_tokens=100, output_tokens=10, through_seq=1)])
    await sessions.flush([first])
    retry = delta(tenant.id, s, lease.epoch, messages=[*first.messages, message(2, "c"), message(3, "d", role="assistant")],
                  usage=[UsageDelta(model="main", input_tokens=100, output_tokens=10, through_seq=1),
                         UsageDelta(model="main", input_tokens=7, output_tokens=1, through_seq=3)])
    await sessions.flush([retry])
    totals = {u.model: (u.input_tokens, u.output_tokens) for u in await sessions.usage_totals(tenant.id)}
    assert totals == {"main": (107, 11)}
    assert await count(pool, "ce_messages", tenant.id, s) == 4


async def test_usage_accumulates_across_flushes(sessions, make_tenant):
    tenant, _ = await make_tenant()
    s = sid()
    lease = await sessions.activate(tenant.id, s, owner="h")
    for _ in range(3):
        await sessions.flush([delta(tenant.id, s, lease.epoch, usage=[
            UsageDelta(model="main", input_tokens=100, output_tokens=10),
            UsageDelta(model="cheap", input_tokens=7, output_tokens=1),
        ])])
    totals = {u.model: (u.input_tokens, u.output_tokens) for u in await sessions.usage_totals(tenant.id)}
    assert totals == {"main": (300, 30), "cheap": (21, 3)}


async def test_session_view_and_list(sessions, make_tenant):
    tenant, _ = await make_tenant()
    with pytest.raises(NotFound, match="session 'nope' does not exist for this tenant"):
        await sessions.get_session_view(tenant.id, "nope")
    first, second = sid(), sid()
    await sessions.activate(tenant.id, first, owner="h")
    lease = await sessions.activate(tenant.id, second, owner="h")
    await sessions.flush([delta(tenant.id, second, lease.epoch, messages=[message(0, "x")])])
    listed = await sessions.list_sessions(tenant.id)
    assert [x.session_id for x in listed] == [second, first]
    assert (listed[0].message_count, listed[0].epoch) == (1, 1)
    assert len(await sessions.list_sessions(tenant.id, limit=1)) == 1
    view = await sessions.get_session_view(tenant.id, first)
    assert (view.variables, view.open_breakers, view.handoff, view.messages) == ({}, [], False, 0)


async def test_release_clears_the_owner_only_for_the_current_epoch(sessions, pool, make_tenant):
    tenant, _ = await make_tenant()
    s = sid()
    a = await sessions.activate(tenant.id, s, owner="a")
    b = await sessions.activate(tenant.id, s, owner="b")
    assert await sessions.release(tenant.id, s, a.epoch) is False
    assert await sessions.release(tenant.id, s, b.epoch) is True
    assert await pool.fetchval("SELECT owner FROM ce_sessions WHERE id = $1", session_uid(tenant.id, s)) is None
    assert (await sessions.activate(tenant.id, s, owner="c")).epoch == b.epoch + 1


async def test_tool_calls_get_their_timestamp_from_the_database_when_not_given(sessions, pool, make_tenant):
    tenant, _ = await make_tenant()
    s = sid()
    lease = await sessions.activate(tenant.id, s, owner="h")
    before = datetime.now(UTC)
    await sessions.flush([delta(tenant.id, s, lease.epoch, tool_calls=[call(tenant.id, s)])])
    created = await pool.fetchval(
        "SELECT created_at FROM ce_tool_calls WHERE tenant_id = $1", tenant.id
    )
    assert abs((created - before).total_seconds()) < 60


class _CountingPool:
    """The real pool, counting what a connection is asked to do (statements and transactions)."""

    def __init__(self, pool) -> None:
        self._pool = pool
        self.calls: list[str] = []

    def acquire(self):
        pool, calls = self._pool, self.calls

        class _Acquire:
            async def __aenter__(self):
                self._cm = pool.acquire()
                conn = await self._cm.__aenter__()

                class _Conn:
                    def __getattr__(self, name):
                        calls.append(name)
                        return getattr(conn, name)

                return _Conn()

            async def __aexit__(self, *exc):
                return await self._cm.__aexit__(*exc)

        return _Acquire()


async def test_a_group_commit_of_distinct_sessions_is_one_statement(pool, make_tenant):
    """One round trip, no BEGIN/COMMIT: the flush is a single statement (its own transaction)."""
    tenant, _ = await make_tenant()
    counting = _CountingPool(pool)
    sessions = SessionRepo(counting)
    leases = [await SessionRepo(pool).activate(tenant.id, s, owner="h") for s in (sid(), sid(), sid())]
    await SessionRepo(pool).activate(tenant.id, leases[2].session_id, owner="elsewhere")
    deltas = [
        delta(tenant.id, lease.session_id, lease.epoch,
              messages=[message(0, "hi", message_id="m1"), message(1, "hello", role="assistant")],
              variables={"k": "v"}, tool_calls=[call(tenant.id, lease.session_id)],
              usage=[UsageDelta(model="main", input_tokens=10, output_tokens=2)],
              turns=[TurnRecord(message_id="m1", response={"reply": "hello"})])
        for lease in leases
    ]
    result = await sessions.flush(deltas)
    assert counting.calls == ["fetch"]
    assert result.refused == [(tenant.id, leases[2].session_id)]
    assert sorted(result.written) == sorted((tenant.id, lease.session_id) for lease in leases[:2])
    for table in ("ce_messages", "ce_session_variables", "ce_tool_calls", "ce_usage", "ce_turns"):
        assert [await count(pool, table, tenant.id, lease.session_id) for lease in leases] == [
            2 if table == "ce_messages" else 1, 2 if table == "ce_messages" else 1, 0], table


async def test_two_deltas_of_one_session_in_a_batch_apply_in_order_and_are_fenced_each(sessions, pool, make_tenant):
    """A batch the single statement cannot take (one session twice) goes statement by statement:
    both deltas' rows, the later snapshot, and a delta of an older epoch refused on its own."""
    tenant, _ = await make_tenant()
    s = sid()
    old = await sessions.activate(tenant.id, s, owner="h")
    lease = await sessions.activate(tenant.id, s, owner="h")
    first = delta(tenant.id, s, lease.epoch, messages=[message(0, "a")], variables={"step": "1"},
                  snapshot=SessionSnapshot(message_count=1))
    second = delta(tenant.id, s, lease.epoch, messages=[message(1, "b", role="assistant")], variables={"step": "2"},
                   snapshot=SessionSnapshot(message_count=2))
    stale = delta(tenant.id, s, old.epoch, messages=[message(2, "stale")])
    result = await sessions.flush([first, stale, second])
    assert result.written == [(tenant.id, s), (tenant.id, s)] and result.refused == [(tenant.id, s)]
    assert await count(pool, "ce_messages", tenant.id, s) == 2
    view = await sessions.get_session_view(tenant.id, s)
    assert view.messages == 2 and view.variables == {"step": "2"}
