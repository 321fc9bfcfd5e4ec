"""SessionRepo.activate reads everything a host needs in one statement after the lease:
variables, the recent history in order, and the latest stored answers (the turn cache)."""

from __future__ import annotations

import secrets

from kernel.records import MessageRecord, SessionDelta, SessionSnapshot, TurnRecord
from storage.repos import SessionRepo
from storage.repos.sessions import ACTIVATION_TURNS


def _text(seq: int, role: str = "user") -> MessageRecord:
    return MessageRecord(seq=seq, role=role, content=[{"type": "text", "text": f"m{seq}"}], message_id=f"id{seq // 2}")


async def test_activation_returns_variables_history_and_recent_answers_oldest_first(pool, make_tenant):
    repo = SessionRepo(pool)
    tenant, _ = await make_tenant("act")
    session = "s-" + secrets.token_hex(4)
    first = await repo.activate(tenant.id, session, "host-a")
    assert (first.epoch, first.variables, first.history, first.recent_turns) == (1, {}, [], {})
    turns = [TurnRecord(message_id=f"id{i}", response={"reply": f"answer {i}"}) for i in range(3)]
    written = await repo.flush([SessionDelta(
        tenant_id=tenant.id, session_id=session, epoch=first.epoch, snapshot=SessionSnapshot(message_count=6),
        messages=[_text(i, "user" if i % 2 == 0 else "assistant") for i in range(6)],
        variables={"order_id": "12345", "name": "Ada"}, turns=turns,
    )])
    assert written.written == [(tenant.id, session)]

    later = TurnRecord(message_id="id3", response={"reply": "answer 3"})
    await repo.flush([SessionDelta(tenant_id=tenant.id, session_id=session, epoch=first.epoch,
                                   snapshot=SessionSnapshot(message_count=6), turns=[later])])

    again = await repo.activate(tenant.id, session, "host-b", history_limit=4)

    assert again.epoch == 2
    assert again.variables == {"order_id": "12345", "name": "Ada"}
    assert [m.seq for m in again.history] == [2, 3, 4, 5]  # the last four, in order
    assert again.history[0].content == [{"type": "text", "text": "m2"}] and again.history[0].message_id == "id1"
    # answers of one flush share a commit time; a later flush's come after them
    assert set(list(again.recent_turns)[:3]) == {"id0", "id1", "id2"} and list(again.recent_turns)[3] == "id3"
    assert again.recent_turns["id2"] == {"reply": "answer 2"}


async def test_activation_reads_at_most_the_configured_number_of_answers(pool, make_tenant):
    repo = SessionRepo(pool)
    tenant, _ = await make_tenant("act")
    session = "s-" + secrets.token_hex(4)
    first = await repo.activate(tenant.id, session, "host-a")
    many = ACTIVATION_TURNS + 5
    await repo.flush([SessionDelta(
        tenant_id=tenant.id, session_id=session, epoch=first.epoch, snapshot=SessionSnapshot(message_count=1),
        messages=[_text(0)], turns=[TurnRecord(message_id=f"t{i}", response={"i": i}) for i in range(many)],
    )])

    again = await repo.activate(tenant.id, session, "host-b")

    assert len(again.recent_turns) == ACTIVATION_TURNS
