"""SessionRepo: the session actors' durable store — leases with fencing epochs, group commit.

`activate` takes the lease: it bumps the session's epoch atomically and loads its state. `flush`
writes many sessions' deltas in ONE transaction (one statement) after locking their rows, and refuses every
delta whose epoch is not the current one: an owner that lost its lease (a newer activation
happened elsewhere) writes nothing at all. This is what keeps "one activation at a time" true
across host crashes and reshards; it is enforced here, not assumed by the actor layer.

Rows are keyed by session_uid(tenant_id, session id); every query also filters by tenant_id.
"""

from __future__ import annotations

from typing import Any

import asyncpg
import msgspec

from kernel.errors import NotFound
from kernel.records import (
    ActivatedSession,
    FlushResult,
    MessageRecord,
    SessionDelta,
    SessionEvent,
    SessionSnapshot,
    SessionSummary,
    SessionView,
    UsageTotal,
    session_uid,
)
from storage.errors import StorageError, translate
from storage.pool import encode_json, storable_text
from storage.repos.calls import INSERT_CALL_SQL, call_row

#: seed 000: the third failure of a tool in a session opens its breaker
DEFAULT_BREAKER_THRESHOLD = 3

_ACTIVATE = (
    "INSERT INTO ce_sessions AS s (id, tenant_id, session_key, epoch, owner) "
    "VALUES ($1, $2, $3, 1, $4) "
    "ON CONFLICT (id) DO UPDATE SET epoch = s.epoch + 1, owner = EXCLUDED.owner, updated_at = now() "
    "RETURNING epoch, snapshot"
)
# A session's variables, its last $3 messages (in seq order) and its last $4 stored answers
# (oldest first) in one row.
_LOAD_STATE = (
    "SELECT (SELECT coalesce(jsonb_object_agg(key, value), '{}'::jsonb) FROM ce_session_variables"
    "        WHERE tenant_id = $1 AND session_id = $2) AS variables,"
    "       (SELECT coalesce(jsonb_agg(jsonb_build_object('seq', seq, 'role', role, 'content', content,"
    "                                                     'message_id', message_id) ORDER BY seq), '[]'::jsonb)"
    "        FROM (SELECT seq, role, content, message_id FROM ce_messages"
    "              WHERE tenant_id = $1 AND session_id = $2 ORDER BY seq DESC LIMIT $3) last) AS messages,"
    "       (SELECT coalesce(jsonb_agg(jsonb_build_array(message_id, response) ORDER BY created_at), '[]'::jsonb)"
    "        FROM (SELECT message_id, response, created_at FROM ce_turns"
    "              WHERE tenant_id = $1 AND session_id = $2 ORDER BY created_at DESC LIMIT $4) t) AS turns"
)
#: stored answers read at activation: the session core caches 64 (actors.session.TURN_CACHE),
#: one more tells it whether it has them all
ACTIVATION_TURNS = 65
# ORDER BY id: concurrent flushers lock rows in one order, so they cannot deadlock each other.
_LOCK = "SELECT id, tenant_id, epoch FROM ce_sessions WHERE id = ANY($1::text[]) ORDER BY id FOR UPDATE"
_UPDATE_SESSION = (
    "UPDATE ce_sessions SET snapshot = $3, message_count = $4, handoff = $5, updated_at = now() "
    "WHERE id = $1 AND tenant_id = $2"
)
_INSERT_MESSAGE = (
    "INSERT INTO ce_messages (tenant_id, session_id, seq, role, content, message_id) "
    "VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (session_id, seq) DO NOTHING"
)
_UPSERT_VARIABLE = (
    "INSERT INTO ce_session_variables (id, session_id, tenant_id, key, value) "
    "VALUES (gen_random_uuid()::text, $1, $2, $3, $4) "
    "ON CONFLICT (session_id, key) DO UPDATE SET value = EXCLUDED.value"
)
_ADD_USAGE = (
    "INSERT INTO ce_usage AS u (tenant_id, session_id, model, input_tokens, output_tokens, applied_seq) "
    "VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (tenant_id, session_id, model) DO UPDATE SET "
    "input_tokens = u.input_tokens + EXCLUDED.input_tokens, "
    "output_tokens = u.output_tokens + EXCLUDED.output_tokens, "
    "applied_seq = COALESCE(EXCLUDED.applied_seq, u.applied_seq), updated_at = now() "
    # a retried delta (same newest seq) adds nothing: its tokens are already in
    "WHERE EXCLUDED.applied_seq IS NULL OR u.applied_seq IS NULL OR u.applied_seq < EXCLUDED.applied_seq"
)
# A message id's answer is written once: a retried flush changes nothing. One exception: an answer
# held for approval gives way to the answer of the turn its approval resumed (held again, or done).
_KEEP_TURN = (
    "ON CONFLICT (session_id, message_id) DO UPDATE SET response = EXCLUDED.response "
    "WHERE ce_turns.response ? 'pending_approval'"
)
_INSERT_TURN = (
    "INSERT INTO ce_turns (tenant_id, session_id, message_id, response) VALUES ($1, $2, $3, $4) " + _KEEP_TURN
)
_INSERT_EVENT = (
    "INSERT INTO ce_session_events (tenant_id, session_id, seq, type, data) VALUES ($1, $2, $3, $4, $5) "
    "ON CONFLICT (tenant_id, session_id, seq) DO NOTHING"
)
#: the most events one read of a session's log returns (a watcher far behind reads again)
EVENTS_PAGE = 500
#: the channel on which a flush says which sessions of the agents' feed have new events: a JSON
#: FeedNotice per session, sent on commit (so only for what is written, in commit order)
FEED_CHANNEL = "ce_session_feed"
_NOTIFY_FEED = f"SELECT pg_notify('{FEED_CHANNEL}', p) FROM unnest($1::text[]) AS p"


class FeedNotice(msgspec.Struct, frozen=True):
    """Session `s` of tenant `t` has new events numbered `a`+1 to `z`, for the agents' feed."""

    t: str
    s: str
    a: int
    z: int


_feed_encoder = msgspec.json.Encoder()

# The whole flush as ONE statement, so one round trip and no BEGIN/COMMIT (a statement is its own
# transaction): `ok` locks the rows of the sessions whose epoch is current, in id order (as
# _LOCK), and every write below takes only the rows of those sessions. Under READ COMMITTED a
# row a newer activation changed after this statement began is re-read when locked, so its new
# epoch fails the join and that session's delta is refused. JSON travels as text cast to jsonb:
# a jsonb[] parameter would read a list of content blocks as a second array dimension.
_FLUSH = f"""
WITH d AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::int[], $5::bool[], $6::bigint[])
        AS d(id, tenant_id, snapshot, message_count, handoff, epoch)
), ok AS MATERIALIZED (
    SELECT s.id FROM ce_sessions s JOIN d ON d.id = s.id AND d.tenant_id = s.tenant_id AND d.epoch = s.epoch
    ORDER BY s.id FOR UPDATE OF s
), sessions AS (
    UPDATE ce_sessions s
    SET snapshot = d.snapshot::jsonb, message_count = d.message_count, handoff = d.handoff, updated_at = now()
    FROM d JOIN ok ON ok.id = d.id WHERE s.id = d.id
), messages AS (
    INSERT INTO ce_messages (tenant_id, session_id, seq, role, content, message_id)
    SELECT m.tenant_id, m.session_id, m.seq, m.role, m.content::jsonb, m.message_id
    FROM unnest($7::text[], $8::text[], $9::int[], $10::text[], $11::text[], $12::text[])
        AS m(tenant_id, session_id, seq, role, content, message_id)
    JOIN ok ON ok.id = m.session_id
    ON CONFLICT (session_id, seq) DO NOTHING
), variables AS (
    INSERT INTO ce_session_variables (id, session_id, tenant_id, key, value)
    SELECT gen_random_uuid()::text, v.session_id, v.tenant_id, v.key, v.value
    FROM unnest($13::text[], $14::text[], $15::text[], $16::text[]) AS v(session_id, tenant_id, key, value)
    JOIN ok ON ok.id = v.session_id
    ON CONFLICT (session_id, key) DO UPDATE SET value = EXCLUDED.value
), calls AS (
    INSERT INTO ce_tool_calls (id, session_id, tenant_id, message_id, tool_name, parameters, result, success,
                               latency_ms, queue_ms, error, created_at, trace_id)
    SELECT c.id, c.session_id, c.tenant_id, c.message_id, c.tool_name, c.parameters::jsonb, c.result::jsonb,
           c.success, c.latency_ms, c.queue_ms, c.error, coalesce(c.created_at, now()), c.trace_id
    FROM unnest($17::text[], $18::text[], $19::text[], $20::text[], $21::text[], $22::text[], $23::text[],
                $24::bool[], $25::int[], $26::int[], $27::text[], $28::timestamptz[], $29::text[])
        AS c(id, session_id, tenant_id, message_id, tool_name, parameters, result, success, latency_ms, queue_ms,
             error, created_at, trace_id)
    JOIN ok ON ok.id = c.session_id
    ON CONFLICT (id) DO NOTHING
), usage AS (
    INSERT INTO ce_usage AS u (tenant_id, session_id, model, input_tokens, output_tokens, applied_seq)
    SELECT x.tenant_id, x.session_id, x.model, x.input_tokens, x.output_tokens, x.applied_seq
    FROM unnest($30::text[], $31::text[], $32::text[], $33::bigint[], $34::bigint[], $35::bigint[])
        AS x(tenant_id, session_id, model, input_tokens, output_tokens, applied_seq)
    JOIN ok ON ok.id = x.session_id
    ON CONFLICT (tenant_id, session_id, model) DO UPDATE SET
        input_tokens = u.input_tokens + EXCLUDED.input_tokens,
        output_tokens = u.output_tokens + EXCLUDED.output_tokens,
        applied_seq = COALESCE(EXCLUDED.applied_seq, u.applied_seq), updated_at = now()
    WHERE EXCLUDED.applied_seq IS NULL OR u.applied_seq IS NULL OR u.applied_seq < EXCLUDED.applied_seq
), turns AS (
    INSERT INTO ce_turns (tenant_id, session_id, message_id, response)
    SELECT t.tenant_id, t.session_id, t.message_id, t.response::jsonb
    FROM unnest($36::text[], $37::text[], $38::text[], $39::text[]) AS t(tenant_id, session_id, message_id, response)
    JOIN ok ON ok.id = t.session_id
    {_KEEP_TURN}
), events AS (
    INSERT INTO ce_session_events (tenant_id, session_id, seq, type, data)
    SELECT e.tenant_id, e.session_id, e.seq, e.type, e.data::jsonb
    FROM unnest($40::text[], $41::text[], $42::bigint[], $43::text[], $44::text[]) AS e(tenant_id, session_id, seq, type, data)
    JOIN ok ON ok.id = e.session_id
    ON CONFLICT (tenant_id, session_id, seq) DO NOTHING
), feed AS (
    SELECT pg_notify('{FEED_CHANNEL}', n.payload)
    FROM unnest($45::text[], $46::text[]) AS n(session_id, payload)
    JOIN ok ON ok.id = n.session_id
)
-- the feed's notifications go out when this commits, for the sessions written only
SELECT id FROM ok WHERE (SELECT count(*) FROM feed) >= 0
"""


def _one_statement(deltas: list[SessionDelta], uids: list[str]) -> bool:
    """Whether `_FLUSH` can write the batch: one delta per session and one usage row per session
    and model. An upsert cannot touch a row twice in one statement, and two usage deltas of one
    model (tokens restored from a failed flush beside newer ones) must apply one after another,
    each against the seq the other left; such a rare batch goes statement by statement."""
    if len(set(uids)) != len(uids):
        return False
    return all(len({u.model for u in d.usage}) == len(d.usage) for d in deltas)


class _Rows(msgspec.Struct):
    """A batch's rows, table by table, in the columns of the statements above."""

    sessions: list[tuple]
    messages: list[tuple]
    variables: list[tuple]
    calls: list[tuple]
    usage: list[tuple]
    turns: list[tuple]
    events: list[tuple]
    feed: list[tuple]


def _rows(deltas: list[SessionDelta], uids: list[str], keep: list[bool]) -> _Rows:
    """The rows of the deltas marked in `keep`. Text from contacts, the model and tools goes
    through storable_text: a NUL in one row must not fail the whole group commit."""
    rows = _Rows(sessions=[], messages=[], variables=[], calls=[], usage=[], turns=[], events=[], feed=[])
    # the last delta of a session in the batch carries its newest snapshot
    sessions: dict[str, tuple] = {}
    # by (session, stored key): two keys that storable_text makes one ("k\x00", "k\ufffd") are
    # one row, the later value winning, as one upsert after the other did
    variables: dict[tuple[str, str], tuple] = {}
    for d, uid, kept in zip(deltas, uids, keep, strict=True):
        if not kept:
            continue
        snap = d.snapshot
        sessions[uid] = (uid, d.tenant_id, snap, snap.message_count, snap.handoff)
        rows.messages += [(d.tenant_id, uid, m.seq, m.role, m.content, storable_text(m.message_id)) for m in d.messages]
        for k, v in d.variables.items():
            key = storable_text(k)
            variables[(uid, key)] = (uid, d.tenant_id, key, storable_text(v))
        rows.calls += [call_row(c, d.tenant_id, d.session_id) for c in d.tool_calls]
        newest = max((m.seq for m in d.messages), default=None)
        rows.usage += [
            (d.tenant_id, uid, u.model, u.input_tokens, u.output_tokens,
             u.through_seq if u.through_seq is not None else newest)
            for u in d.usage
        ]
        rows.turns += [(d.tenant_id, uid, storable_text(t.message_id), t.response) for t in d.turns]
        rows.events += [(d.tenant_id, uid, e.seq, e.type, e.data) for e in d.events]
        if d.feed and d.events:
            notice = FeedNotice(t=d.tenant_id, s=d.session_id, a=d.events[0].seq - 1, z=d.events[-1].seq)
            rows.feed.append((uid, _feed_encoder.encode(notice).decode()))
    rows.sessions, rows.variables = list(sessions.values()), list(variables.values())
    return rows


def _columns(rows: list[tuple], width: int, json: tuple[int, ...] = ()) -> list[list[Any]]:
    """Rows as `width` column arrays; the `json` columns as the JSON text the statement casts to
    jsonb (the pool codec's rules: NULs replaced, lone surrogates scrubbed; None stays NULL)."""
    columns = [list(c) for c in zip(*rows, strict=True)] if rows else [[] for _ in range(width)]
    for i in json:
        columns[i] = [None if v is None else encode_json(v).decode() for v in columns[i]]
    return columns


def _flush_args(deltas: list[SessionDelta], uids: list[str]) -> list[list[Any]]:
    """The 46 column arrays of `_FLUSH`: every delta's rows (the statement does the fencing).
    One delta per session (`_one_statement`), so the sessions' rows and epochs line up."""
    rows = _rows(deltas, uids, [True] * len(deltas))
    return [
        *_columns(rows.sessions, 5, json=(2,)), [d.epoch for d in deltas],
        *_columns(rows.messages, 6, json=(4,)),
        *_columns(rows.variables, 4),
        *_columns(rows.calls, 13, json=(5, 6)),
        *_columns(rows.usage, 6),
        *_columns(rows.turns, 4, json=(3,)),
        *_columns(rows.events, 5, json=(4,)),
        *_columns(rows.feed, 2),
    ]


async def _flush_in_one_statement(conn: asyncpg.Connection, deltas: list[SessionDelta], uids: list[str]) -> list[bool]:
    """The flush as `_FLUSH` (its own transaction; batches `_one_statement` accepts). Returns,
    delta by delta, whether it was written."""
    current = {r["id"] for r in await conn.fetch(_FLUSH, *_flush_args(deltas, uids))}
    return [uid in current for uid in uids]


async def _flush_statement_by_statement(
    conn: asyncpg.Connection, deltas: list[SessionDelta], uids: list[str]
) -> list[bool]:
    """The flush inside the caller's transaction, one statement per table (batches `_FLUSH`
    cannot take, see `_one_statement`). Returns, delta by delta, whether it was written."""
    current = {r["id"]: (r["tenant_id"], r["epoch"]) for r in await conn.fetch(_LOCK, sorted(set(uids)))}
    ok = [current.get(uid) == (d.tenant_id, d.epoch) for d, uid in zip(deltas, uids, strict=True)]
    rows = _rows(deltas, uids, ok)
    # executemany pipelines each statement's rows: one round trip per table, not per row
    for sql, batch in (
        (_UPDATE_SESSION, rows.sessions),
        (_INSERT_MESSAGE, rows.messages),
        (_UPSERT_VARIABLE, rows.variables),
        (INSERT_CALL_SQL, rows.calls),
        (_ADD_USAGE, rows.usage),
        (_INSERT_TURN, rows.turns),
        (_INSERT_EVENT, rows.events),
    ):
        if batch:
            await conn.executemany(sql, batch)
    if rows.feed:
        await conn.execute(_NOTIFY_FEED, [payload for _, payload in rows.feed])
    return ok

def _snapshot(raw: Any, tenant_id: str, session_id: str) -> SessionSnapshot:
    try:
        return msgspec.convert(raw or {}, SessionSnapshot)
    except msgspec.ValidationError as exc:
        raise StorageError(
            f"the stored snapshot of session {session_id!r} of tenant {tenant_id!r} is unreadable "
            f"({exc}); repair or clear ce_sessions.snapshot for that row"
        ) from None


def _not_found(session_id: str) -> NotFound:
    return NotFound(f"session {session_id!r} does not exist for this tenant", kind="session", key=session_id)


class SessionRepo:
    """Leases, loads and group-committed flushes of session state."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def activate(
        self, tenant_id: str, session_id: str, owner: str, history_limit: int = 50
    ) -> ActivatedSession:
        """Take the session's lease for `owner` and load its state.

        Creates the session on first touch (epoch 1); otherwise bumps its epoch by one, which
        fences every earlier activation's flushes. Returns the snapshot, the variables, the
        last `history_limit` messages in seq order and the last ACTIVATION_TURNS stored answers.
        """
        uid = session_uid(tenant_id, session_id)
        # Two round trips, not five (BEGIN, lease, variables, messages, COMMIT): the lease commits
        # on its own, then one statement reads the state. The read must be a statement of its own,
        # after the lease: a flush of the previous owner that held the row commits before our
        # lease does, and only a later statement's snapshot is sure to see what it wrote. Nothing
        # needs the two in one transaction (a lease taken by a process that dies before loading
        # is simply bumped by the next activation). Measured in README § Performance (growth).
        with translate("activating a session"):
            async with self._pool.acquire() as conn:
                # racing first activations: the primary key is the row's only unique key
                # (migration 013), so ON CONFLICT settles every race as an epoch bump
                row = await conn.fetchrow(_ACTIVATE, uid, tenant_id, session_id, owner)
                state = await conn.fetchrow(_LOAD_STATE, tenant_id, uid, history_limit, ACTIVATION_TURNS)
        return ActivatedSession(
            tenant_id=tenant_id,
            session_id=session_id,
            epoch=row["epoch"],
            snapshot=_snapshot(row["snapshot"], tenant_id, session_id),
            variables=state["variables"],
            history=[
                MessageRecord(seq=m["seq"], role=m["role"], content=m["content"], message_id=m["message_id"])
                for m in state["messages"]
            ],
            recent_turns={message_id: response for message_id, response in state["turns"]},
        )

    async def release(self, tenant_id: str, session_id: str, epoch: int) -> bool:
        """Drop the lease's owner after passivation, if `epoch` still holds it; True if it did.
        (The epoch stays: the next activation bumps it as always.)"""
        with translate("releasing a session lease"):
            done = await self._pool.fetchval(
                "UPDATE ce_sessions SET owner = NULL WHERE id = $1 AND tenant_id = $2 AND epoch = $3 "
                "RETURNING true",
                session_uid(tenant_id, session_id), tenant_id, epoch,
            )
        return bool(done)

    async def flush(self, deltas: list[SessionDelta]) -> FlushResult:
        """Write every delta whose epoch is current, in one transaction (group commit).

        Returns which (tenant_id, session_id) were written and which were refused: a refused
        delta belongs to an owner that lost its lease and none of it is written. Messages, tool
        calls and turns already stored are skipped, and usage is added only for messages newer
        than those it already holds, so a flush can be retried as is, even after a commit whose
        acknowledgement was lost. Raises StorageUnavailable (retryable) when Postgres is
        unreachable or the connection drops: the transaction did not commit.
        """
        if not deltas:
            return FlushResult(written=[], refused=[])
        uids = [session_uid(d.tenant_id, d.session_id) for d in deltas]
        with translate("flushing session state"):
            async with self._pool.acquire() as conn:
                if _one_statement(deltas, uids):
                    ok = await _flush_in_one_statement(conn, deltas, uids)
                else:
                    async with conn.transaction():
                        ok = await _flush_statement_by_statement(conn, deltas, uids)
        return FlushResult(
            written=[(d.tenant_id, d.session_id) for d, took in zip(deltas, ok, strict=True) if took],
            refused=[(d.tenant_id, d.session_id) for d, took in zip(deltas, ok, strict=True) if not took],
        )

    async def events_after(self, tenant_id: str, session_id: str, after: int,
                           limit: int = EVENTS_PAGE) -> list[SessionEvent]:
        """The session's written events numbered above `after`, oldest first, at most `limit`."""
        with translate("reading session events"):
            rows = await self._pool.fetch(
                "SELECT seq, type, data FROM ce_session_events WHERE tenant_id = $2 AND session_id = $1 "
                "AND seq > $3 ORDER BY seq LIMIT $4",
                session_uid(tenant_id, session_id), tenant_id, after, min(limit, EVENTS_PAGE),
            )
        return [SessionEvent(seq=r["seq"], type=r["type"], data=r["data"]) for r in rows]

    async def current_epoch(self, tenant_id: str, session_id: str) -> int | None:
        """The session's current lease epoch, or None if it was never activated."""
        with translate("reading a session epoch"):
            return await self._pool.fetchval(
                "SELECT epoch FROM ce_sessions WHERE id = $1 AND tenant_id = $2",
                session_uid(tenant_id, session_id), tenant_id,
            )

    async def recent_turns(self, tenant_id: str, session_id: str, limit: int) -> dict[str, dict[str, Any]]:
        """The last `limit` stored answers of this session by message_id, oldest first."""
        with translate("reading recent turns"):
            rows = await self._pool.fetch(
                "SELECT message_id, response FROM (SELECT message_id, response, created_at FROM ce_turns "
                "WHERE tenant_id = $1 AND session_id = $2 ORDER BY created_at DESC LIMIT $3) t ORDER BY created_at",
                tenant_id, session_uid(tenant_id, session_id), limit,
            )
        return {r["message_id"]: r["response"] for r in rows}

    async def get_turn(self, tenant_id: str, session_id: str, message_id: str) -> dict[str, Any] | None:
        """The stored answer to the client's `message_id` in this session, or None."""
        with translate("reading a stored turn"):
            return await self._pool.fetchval(
                "SELECT response FROM ce_turns WHERE tenant_id = $1 AND session_id = $2 AND message_id = $3",
                tenant_id, session_uid(tenant_id, session_id), message_id,
            )

    async def get_session_view(
        self, tenant_id: str, session_id: str, *, breaker_threshold: int = DEFAULT_BREAKER_THRESHOLD
    ) -> SessionView:
        """The session as GET /v1/sessions/{id} shows it (as last flushed). Raises NotFound."""
        uid = session_uid(tenant_id, session_id)
        with translate("reading a session"):
            async with self._pool.acquire() as conn, conn.transaction(isolation="repeatable_read", readonly=True):
                row = await conn.fetchrow(
                    "SELECT snapshot, message_count, handoff FROM ce_sessions WHERE id = $1 AND tenant_id = $2",
                    uid, tenant_id,
                )
                if row is None:
                    raise _not_found(session_id)
                variables = await conn.fetch(
                    "SELECT key, value FROM ce_session_variables WHERE tenant_id = $1 AND session_id = $2 "
                    "ORDER BY key",
                    tenant_id, uid,
                )
        snap = _snapshot(row["snapshot"], tenant_id, session_id)
        return SessionView(
            session_id=session_id,
            variables={r["key"]: r["value"] for r in variables},
            open_breakers=sorted(n for n, fails in snap.breakers.items() if fails >= breaker_threshold),
            handoff=row["handoff"],
            messages=row["message_count"],
            contact=None if snap.contact_sub is None else {"sub": snap.contact_sub, "verified": True},
        )

    async def list_sessions(self, tenant_id: str, limit: int = 50, *, contact: str | None = None) -> list[SessionSummary]:
        """The tenant's sessions (of one verified `contact` when given), most recently updated first."""
        with translate("listing sessions"):
            if contact is None:
                rows = await self._pool.fetch(
                    "SELECT session_key, message_count, handoff, epoch, created_at, updated_at "
                    "FROM ce_sessions WHERE tenant_id = $1 ORDER BY updated_at DESC, session_key LIMIT $2",
                    tenant_id, limit,
                )
            else:
                rows = await self._pool.fetch(
                    "SELECT session_key, message_count, handoff, epoch, created_at, updated_at FROM ce_sessions "
                    "WHERE tenant_id = $1 AND snapshot ? 'contact_sub' AND snapshot->>'contact_sub' = $3 "
                    "ORDER BY updated_at DESC, session_key LIMIT $2",
                    tenant_id, limit, contact,
                )
        return [
            SessionSummary(
                session_id=r["session_key"], message_count=r["message_count"], handoff=r["handoff"],
                epoch=r["epoch"], created_at=r["created_at"], updated_at=r["updated_at"],
            )
            for r in rows
        ]

    async def usage_totals(self, tenant_id: str) -> list[UsageTotal]:
        """The tenant's token usage per model, summed over its sessions, by model name."""
        with translate("summing usage"):
            rows = await self._pool.fetch(
                "SELECT model, sum(input_tokens)::bigint AS input_tokens, "
                "sum(output_tokens)::bigint AS output_tokens, count(*) AS sessions "
                "FROM ce_usage WHERE tenant_id = $1 GROUP BY model ORDER BY model",
                tenant_id,
            )
        return [
            UsageTotal(model=r["model"], input_tokens=r["input_tokens"], output_tokens=r["output_tokens"],
                       sessions=r["sessions"])
            for r in rows
        ]
