"""Which batches the single-statement flush takes (storage.repos.sessions._one_statement)."""

from __future__ import annotations

from kernel.records import SessionDelta, SessionSnapshot, UsageDelta, session_uid
from storage.repos.sessions import _one_statement


def delta(session_id: str, *usage: UsageDelta) -> SessionDelta:
    return SessionDelta(tenant_id="t", session_id=session_id, epoch=1, snapshot=SessionSnapshot(), usage=list(usage))


def uids(deltas: list[SessionDelta]) -> list[str]:
    return [session_uid(d.tenant_id, d.session_id) for d in deltas]


def test_distinct_sessions_with_one_usage_row_per_model_take_one_statement():
    batch = [delta("a", UsageDelta(model="m", input_tokens=1, output_tokens=1),
                   UsageDelta(model="n", input_tokens=1, output_tokens=1)),
             delta("b", UsageDelta(model="m", input_tokens=1, output_tokens=1)), delta("c")]
    assert _one_statement(batch, uids(batch))


def test_one_session_twice_goes_statement_by_statement():
    batch = [delta("a"), delta("b"), delta("a")]
    assert not _one_statement(batch, uids(batch))


def test_two_usage_rows_of_one_model_go_statement_by_statement():
    # tokens restored from a failed flush beside newer ones: each applies against its own seq
    batch = [delta("a", UsageDelta(model="m", input_tokens=1, output_tokens=1, through_seq=1),
                   UsageDelta(model="m", input_tokens=2, output_tokens=1, through_seq=3))]
    assert not _one_statement(batch, uids(batch))
