"""Repositories behind the built-in tools: memories, leads, forms, appointments, handoffs.

Tables from migrations 005/006 (a handoff's states: 017). In these tables `session_id` is the
tenant's own session id (the engine's ce_messages and ce_session_variables key sessions by
session_uid instead; the memory search and a handoff's messages join the two through
ce_sessions). Every query is scoped by tenant_id.

Postgres decides the races here, not the caller: a second lead in one session is refused by
UNIQUE (tenant_id, session_id), an overlapping booking by the exclusion constraint of
ce_appointments (`SlotTaken`), a replayed write by the idempotency-key indexes of 006, a second
open handoff of a session by the partial unique index of 017, and of two claims of one handoff
the conditional update lets one through.

Text from the model or the contact (a name, a reason, a query, a form or service name) goes
through `storable_text` on its way in, as in the session flush: Postgres refuses a NUL and UTF-8
cannot carry a lone surrogate, and a tool must not crash (and count against its breaker) on
either. JSONB values are scrubbed the same way by the pool's codec.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from datetime import datetime
from typing import Any, Literal

import asyncpg
import msgspec

from kernel.errors import ChatEngineError, Conflict, InvalidInput, NotFound
from kernel.records import session_uid
from storage.errors import translate
from storage.pool import storable_text as _text
from storage.repos.catalog_sync import NOTIFY_CHANGE, announce_change
from storage.repos.notifications import NewNotification, NotificationRepo, insert_notification
from storage.repos.quotas import TenantCap, claim_slot

# ------------------------------------------------------------------------------------ records


#: builds the event a new row announces (services.builtins.notify.Announcer), or None
Announce = Callable[[Any], NewNotification | None]


async def _announce(conn: Any, announce: Announce | None, record: Any) -> None:
    """Queue the event about a row just written, on the row's own connection and transaction:
    the row and its event commit together or not at all."""
    if announce is not None and (n := announce(record)) is not None:
        await insert_notification(conn, n)


class MemoryHit(msgspec.Struct, frozen=True, kw_only=True):
    """One recalled item: a stored fact or a text message of a conversation."""

    kind: Literal["fact", "message"]
    content: str
    session_id: str | None
    created_at: datetime
    rank: float
    role: str | None = None  # for messages: "user" (the contact) or "assistant"


#: a row's place in a list read a page at a time: its time (created_at, or starts_at) and its id
Keyset = tuple[datetime, str]
#: rows after the keyset ($at, $id) in the order "created_at DESC, id" (none given: every row)
_OLDER = "({at}::timestamptz IS NULL OR created_at < {at} OR (created_at = {at} AND id > {id}::text))"


class LeadRecord(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    tenant_id: str
    session_id: str
    name: str | None
    email: str | None
    phone: str | None
    notes: str | None
    created_at: datetime


class FormRecord(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    schema: dict[str, Any]
    created_at: datetime
    updated_at: datetime


class SubmissionRecord(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    form_name: str
    session_id: str | None
    data: dict[str, Any]
    created_at: datetime


class ServiceRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A bookable service: `opening_hours` maps weekday ("mon".."sun") to [[open, close], ...]."""

    name: str
    duration_minutes: int
    timezone: str
    opening_hours: dict[str, list[list[str]]]


class AppointmentRecord(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    service: str
    starts_at: datetime
    ends_at: datetime
    session_id: str | None
    contact_name: str | None
    contact_email: str | None
    created_at: datetime


HandoffState = Literal["requested", "assigned", "resolved"]
#: a handoff's states in the order it moves through them (requested may skip assigned)
HANDOFF_STATES: tuple[HandoffState, ...] = ("requested", "assigned", "resolved")


class HandoffMessage(msgspec.Struct, frozen=True, kw_only=True):
    """A message of the handed-off conversation as a person reads it: its text blocks, joined."""

    role: Literal["user", "assistant"]
    text: str
    seq: int


class HandoffRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A row of ce_handoffs. `session_id` is the tenant's own session id. `agent` and
    `assigned_at` are set once it is claimed, `resolved_at` and `return_to_bot` once resolved
    (`return_to_bot` is None on a duplicate that migration 017 closed). `messages` are the
    session's last messages with text, oldest first, where the read asked for them (`get`,
    `list`), else None."""

    id: str
    session_id: str
    reason: str | None
    created_at: datetime
    state: HandoffState
    agent: str | None
    assigned_at: datetime | None
    resolved_at: datetime | None
    return_to_bot: bool | None
    updated_at: datetime
    messages: list[HandoffMessage] | None = None


class HandoffConflict(Conflict):
    """A handoff cannot make the asked transition from the state it is in (`state`, claimed by
    `agent`): claimed by someone else, already resolved, or resolved the other way."""

    def __init__(self, message: str, *, handoff_id: str, state: str, agent: str | None) -> None:
        super().__init__(message)
        self.handoff_id = handoff_id
        self.state = state
        self.agent = agent


class SlotTaken(ChatEngineError):
    """Another booking of the service overlaps the requested time (the exclusion constraint)."""

    def __init__(self, message: str, *, service: str, starts_at: datetime) -> None:
        super().__init__(message)
        self.service = service
        self.starts_at = starts_at


# ------------------------------------------------------------------------------------- memory

# The contact's query as an OR of its lexemes: a fact matches when it shares any word with the
# question, and ts_rank orders by how much. The lexemes are made by the tenant's text search
# configuration, then re-quoted by 'simple' (which does not stem again), and joined as tsquery
# text that Postgres itself escaped, so no user text is ever parsed as tsquery syntax.
_QUERY_CTE = """
q AS (
  SELECT array_to_string(array_agg('(' || t::text || ')'), ' | ')::tsquery AS tsq
  FROM (
    SELECT plainto_tsquery('simple', l) AS t
    FROM unnest(tsvector_to_array(to_tsvector($2::regconfig, $3::text))) AS l
  ) terms
  WHERE t::text <> ''
)"""


def _contact_sessions(tenant: str, key: str, sub: str, uid: str) -> str:
    """CTE `contact_sessions(uid, session_key)`: this session, plus every session of the tenant
    bound to the verified contact `sub` (none when it is NULL; placeholders are the given $n)."""
    return f"""
contact_sessions AS (
  SELECT s.id AS uid, s.session_key
  FROM ce_sessions s
  WHERE s.tenant_id = {tenant} AND {sub}::text IS NOT NULL
    AND s.snapshot ? 'contact_sub' AND s.snapshot->>'contact_sub' = {sub}::text
  UNION
  SELECT {uid}::text, {key}::text
)"""


# a fact is the contact's when a session of theirs wrote it, or it is tagged with their verified
# `sub` (only ever written from a verified session: migration 020 let go of the typed emails)
_OWNED_FACT = (
    "m.tenant_id = $1 AND m.kind = 'fact' AND (m.session_id IN (SELECT session_key FROM contact_sessions) "
    "OR ({sub}::text IS NOT NULL AND m.contact_id = {sub}::text))"
)

# $1 tenant, $2 text search config, $3 query, $4 session id, $5 verified contact, $6 session uid,
# $7 limit
_SEARCH_SQL = (
    "WITH " + _QUERY_CTE + "," + _contact_sessions("$1", "$4", "$5", "$6") + """,
facts AS (
  SELECT 'fact'::text AS kind, m.content, m.session_id, m.created_at, NULL::text AS role,
         ts_rank(m.tsv, q.tsq) AS rank
  FROM ce_memories m, q
  WHERE """ + _OWNED_FACT.format(sub="$5") + """ AND m.tsv @@ q.tsq
),
texts AS (
  SELECT cs.session_key, msg.role, msg.created_at,
         (SELECT string_agg(b->>'text', ' ') FROM jsonb_array_elements(msg.content) b
          WHERE b->>'type' = 'text') AS body
  FROM ce_messages msg JOIN contact_sessions cs ON cs.uid = msg.session_id
  WHERE msg.tenant_id = $1
),
messages AS (
  SELECT 'message'::text AS kind, t.body AS content, t.session_key AS session_id, t.created_at,
         t.role, ts_rank(to_tsvector($2::regconfig, t.body), q.tsq) AS rank
  FROM texts t, q
  WHERE t.body IS NOT NULL AND to_tsvector($2::regconfig, t.body) @@ q.tsq
)
SELECT * FROM facts UNION ALL SELECT * FROM messages
ORDER BY rank DESC, created_at DESC
LIMIT $7
"""
)

# $1 tenant, $2 session id, $3 verified contact, $4 session uid, $5 limit
_RECENT_FACTS_SQL = (
    "WITH " + _contact_sessions("$1", "$2", "$3", "$4") + """
SELECT 'fact'::text AS kind, m.content, m.session_id, m.created_at, NULL::text AS role, 0::real AS rank
FROM ce_memories m
WHERE """ + _OWNED_FACT.format(sub="$3") + """
ORDER BY m.created_at DESC
LIMIT $5
"""
)


class MemoryRepo:
    """Facts written by the tools, and full-text recall over facts and conversation messages."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool
        self._configs: dict[str, str] = {}

    async def text_config(self, language: str) -> str:
        """The text search configuration named `language` if this Postgres has it, else 'simple'."""
        key = _text((language or "").strip().lower())
        cached = self._configs.get(key)
        if cached is not None:
            return cached
        with translate("looking up a text search configuration"):
            found = await self._pool.fetchval("SELECT cfgname::text FROM pg_ts_config WHERE cfgname = $1", key)
        self._configs[key] = found or "simple"
        return self._configs[key]

    async def add_fact(
        self, tenant_id: str, *, session_id: str | None, contact_id: str | None, content: str, language: str
    ) -> str:
        """Store one fact; returns its id."""
        config = await self.text_config(language)
        with translate("storing a memory"):
            return await self._pool.fetchval(
                "INSERT INTO ce_memories (tenant_id, contact_id, session_id, kind, content, language) "
                "VALUES ($1, $2, $3, 'fact', $4, $5::regconfig) RETURNING id",
                tenant_id, _text(contact_id), session_id, _text(content), config,
            )

    async def search(
        self, tenant_id: str, *, session_id: str, contact_sub: str | None, query: str, language: str,
        limit: int = 8,
    ) -> list[MemoryHit]:
        """Facts and text messages of this session and of every session bound to the verified
        contact `contact_sub` (None: this session only), matching any word of `query`, best first."""
        config = await self.text_config(language)
        args = (tenant_id, config, _text(query), session_id, _text(contact_sub), session_uid(tenant_id, session_id),
                limit)
        with translate("searching memories"):
            rows = await self._pool.fetch(_SEARCH_SQL, *args)
        return [_hit(r) for r in rows]

    async def recent_facts(
        self, tenant_id: str, *, session_id: str, contact_sub: str | None, limit: int = 5,
    ) -> list[MemoryHit]:
        """The newest facts of this session and of the verified contact's sessions (no text match)."""
        args = (tenant_id, session_id, _text(contact_sub), session_uid(tenant_id, session_id), limit)
        with translate("reading recent memories"):
            rows = await self._pool.fetch(_RECENT_FACTS_SQL, *args)
        return [_hit(r) for r in rows]


def _hit(r: asyncpg.Record) -> MemoryHit:
    return MemoryHit(kind=r["kind"], content=r["content"], session_id=r["session_id"],
                     created_at=r["created_at"], rank=float(r["rank"] or 0.0), role=r["role"])


# -------------------------------------------------------------------------------------- leads

_LEAD_COLUMNS = "id, tenant_id, session_id, name, email, phone, notes, created_at"


def _lead(r: asyncpg.Record) -> LeadRecord:
    return LeadRecord(**{k: r[k] for k in _LEAD_COLUMNS.split(", ")})


class LeadRepo:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def create(
        self, tenant_id: str, session_id: str, *, name: str, email: str, phone: str | None,
        notes: str | None, fact: str | None = None, contact_id: str | None = None, language: str = "simple",
        announce: Announce | None = None,
    ) -> tuple[LeadRecord, bool]:
        """Insert the session's lead and, in the same transaction, its memory fact and the event
        `announce(lead)` builds (see `_announce`).

        Returns (the session's lead, True) when this call wrote it, or (the lead stored earlier
        in this session, False): a session has at most one lead.
        """
        name, email, phone, notes, fact = (_text(v) for v in (name, email, phone, notes, fact))
        with translate("saving a lead"):
            async with self._pool.acquire() as conn, conn.transaction():
                row = await conn.fetchrow(
                    "INSERT INTO ce_leads (tenant_id, session_id, name, email, phone, notes) "
                    "VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (tenant_id, session_id) DO NOTHING "
                    f"RETURNING {_LEAD_COLUMNS}",
                    tenant_id, session_id, name, email, phone, notes,
                )
                if row is None:
                    row = await conn.fetchrow(
                        f"SELECT {_LEAD_COLUMNS} FROM ce_leads WHERE tenant_id = $1 AND session_id = $2",
                        tenant_id, session_id,
                    )
                    return _lead(row), False
                if fact:
                    await conn.execute(
                        "INSERT INTO ce_memories (tenant_id, contact_id, session_id, kind, content, language) "
                        "VALUES ($1, $2, $3, 'fact', $4, $5::regconfig)",
                        tenant_id, _text(contact_id), session_id, fact, language,
                    )
                await _announce(conn, announce, _lead(row))
        return _lead(row), True

    async def for_session(self, tenant_id: str, session_id: str) -> LeadRecord | None:
        with translate("reading a lead"):
            row = await self._pool.fetchrow(
                f"SELECT {_LEAD_COLUMNS} FROM ce_leads WHERE tenant_id = $1 AND session_id = $2",
                tenant_id, session_id,
            )
        return None if row is None else _lead(row)

    async def list(self, tenant_id: str, limit: int = 100, *, before: Keyset | None = None) -> list[LeadRecord]:
        """The tenant's leads, newest first; after the lead `before` names (created_at, id), if given."""
        at, key = before or (None, None)
        with translate("listing leads"):
            rows = await self._pool.fetch(
                f"SELECT {_LEAD_COLUMNS} FROM ce_leads WHERE tenant_id = $1 AND {_OLDER.format(at='$3', id='$4')} "
                "ORDER BY created_at DESC, id LIMIT $2",
                tenant_id, limit, at, key,
            )
        return [_lead(r) for r in rows]


# -------------------------------------------------------------------------------------- forms


#: the most forms a tenant may have (each is read by its sessions' hosts, and listed whole)
MAX_FORMS_PER_TENANT = 100
_FORM_CAP = TenantCap(kind="forms", one="form", many="forms", table="ce_forms", lock=0x63652D66,  # "ce-f"
                      advice="delete forms it no longer uses (DELETE /v1/forms/{name}) and save this one again")
#: the most bookable services a tenant may have
MAX_SERVICES_PER_TENANT = 100
_SERVICE_CAP = TenantCap(kind="appointment_services", one="appointment service", many="appointment services",
                         table="ce_appointment_services", lock=0x63652D73,  # "ce-s"
                         advice="delete services it no longer offers (DELETE /v1/appointment-services/{name}) "
                         "and save this one again")


class FormRepo:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def put(self, tenant_id: str, name: str, schema: dict[str, Any]) -> FormRecord:
        """Create or replace the form `name` (its JSON schema). Announced as a catalog change:
        the first form adds submit_form to the tenant's catalog. Raises LimitReached (409) when
        it would be a new form past MAX_FORMS_PER_TENANT; replacing one is never refused for it."""
        with translate("saving a form"):
            async with self._pool.acquire() as conn, conn.transaction():
                await claim_slot(conn, _FORM_CAP, tenant_id, name, MAX_FORMS_PER_TENANT)
                row = await conn.fetchrow(
                    "INSERT INTO ce_forms (tenant_id, name, schema) VALUES ($1, $2, $3) "
                    "ON CONFLICT (tenant_id, name) DO UPDATE SET schema = EXCLUDED.schema, updated_at = now() "
                    "RETURNING name, schema, created_at, updated_at",
                    tenant_id, name, schema,
                )
                await conn.execute(NOTIFY_CHANGE, tenant_id)
        await announce_change(self._pool)
        return FormRecord(**dict(row))

    async def get(self, tenant_id: str, name: str) -> FormRecord | None:
        with translate("reading a form"):
            row = await self._pool.fetchrow(
                "SELECT name, schema, created_at, updated_at FROM ce_forms WHERE tenant_id = $1 AND name = $2",
                tenant_id, _text(name),
            )
        return None if row is None else FormRecord(**dict(row))

    async def list(self, tenant_id: str, *, after: str = "", limit: int | None = None) -> list[FormRecord]:
        """The tenant's forms named after `after`, by name, at most `limit`."""
        with translate("listing forms"):
            rows = await self._pool.fetch(
                "SELECT name, schema, created_at, updated_at FROM ce_forms WHERE tenant_id = $1 AND name > $2 "
                "ORDER BY name LIMIT $3",
                tenant_id, _text(after), limit,
            )
        return [FormRecord(**dict(r)) for r in rows]

    async def delete(self, tenant_id: str, name: str) -> None:
        """Remove the form (its submissions stay). Raises NotFound."""
        with translate("deleting a form"):
            async with self._pool.acquire() as conn, conn.transaction():
                done = await conn.fetchval(
                    "DELETE FROM ce_forms WHERE tenant_id = $1 AND name = $2 RETURNING true", tenant_id, _text(name)
                )
                if done:
                    await conn.execute(NOTIFY_CHANGE, tenant_id)
        if not done:
            raise NotFound(f"form {name!r} does not exist for this tenant", kind="form", key=name)
        await announce_change(self._pool)

    async def submit(
        self, tenant_id: str, session_id: str | None, form_name: str, data: dict[str, Any],
        *, idempotency_key: str | None = None, announce: Announce | None = None,
    ) -> tuple[SubmissionRecord, bool]:
        """Store a (validated) submission, with its event in the same transaction. Returns (row,
        True), or (the row an earlier call with the same idempotency key in this session stored, False)."""
        cols = "id, form_name, session_id, data, created_at"
        form_name, idempotency_key = _text(form_name), _text(idempotency_key)  # the key holds the client's message id
        with translate("saving a form submission"):
            async with self._pool.acquire() as conn, conn.transaction():
                row = await conn.fetchrow(
                    "INSERT INTO ce_form_submissions (tenant_id, session_id, form_name, data, idempotency_key) "
                    "VALUES ($1, $2, $3, $4, $5) "
                    "ON CONFLICT (tenant_id, session_id, idempotency_key) WHERE idempotency_key IS NOT NULL "
                    f"DO NOTHING RETURNING {cols}",
                    tenant_id, session_id, form_name, data, idempotency_key,
                )
                if row is not None:
                    await _announce(conn, announce, SubmissionRecord(**dict(row)))
                    return SubmissionRecord(**dict(row)), True
                row = await conn.fetchrow(
                    f"SELECT {cols} FROM ce_form_submissions "
                    "WHERE tenant_id = $1 AND session_id = $2 AND idempotency_key = $3",
                    tenant_id, session_id, idempotency_key,
                )
        return SubmissionRecord(**dict(row)), False

    async def submissions(self, tenant_id: str, form_name: str, limit: int = 100, *,
                          before: Keyset | None = None) -> list[SubmissionRecord]:
        """The form's submissions, newest first; after the one `before` names (created_at, id), if given."""
        at, key = before or (None, None)
        with translate("listing form submissions"):
            rows = await self._pool.fetch(
                "SELECT id, form_name, session_id, data, created_at FROM ce_form_submissions "
                f"WHERE tenant_id = $1 AND form_name = $2 AND {_OLDER.format(at='$4', id='$5')} "
                "ORDER BY created_at DESC, id LIMIT $3",
                tenant_id, _text(form_name), limit, at, key,
            )
        return [SubmissionRecord(**dict(r)) for r in rows]


# ------------------------------------------------------------------------------- appointments

_APPOINTMENT_COLUMNS = "id, service, starts_at, ends_at, session_id, contact_name, contact_email, created_at"


class AppointmentRepo:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def put_service(self, tenant_id: str, service: ServiceRecord) -> ServiceRecord:
        """Create or replace a bookable service. Announced as a catalog change: the first service
        adds the booking tools to the tenant's catalog. Raises LimitReached (409) when it would be
        a new service past MAX_SERVICES_PER_TENANT; replacing one is never refused for it."""
        with translate("saving an appointment service"):
            async with self._pool.acquire() as conn, conn.transaction():
                await claim_slot(conn, _SERVICE_CAP, tenant_id, service.name, MAX_SERVICES_PER_TENANT)
                await conn.execute(
                    "INSERT INTO ce_appointment_services (tenant_id, name, duration_minutes, timezone, opening_hours) "
                    "VALUES ($1, $2, $3, $4, $5) ON CONFLICT (tenant_id, name) DO UPDATE SET "
                    "duration_minutes = EXCLUDED.duration_minutes, timezone = EXCLUDED.timezone, "
                    "opening_hours = EXCLUDED.opening_hours, updated_at = now()",
                    tenant_id, service.name, service.duration_minutes, service.timezone, service.opening_hours,
                )
                await conn.execute(NOTIFY_CHANGE, tenant_id)
        await announce_change(self._pool)
        return service

    async def get_service(self, tenant_id: str, name: str) -> ServiceRecord | None:
        with translate("reading an appointment service"):
            row = await self._pool.fetchrow(
                "SELECT name, duration_minutes, timezone, opening_hours FROM ce_appointment_services "
                "WHERE tenant_id = $1 AND name = $2",
                tenant_id, _text(name),
            )
        return None if row is None else msgspec.convert(dict(row), ServiceRecord)

    async def list_services(self, tenant_id: str, *, after: str = "", limit: int | None = None) -> list[ServiceRecord]:
        """The tenant's services named after `after`, by name, at most `limit`."""
        with translate("listing appointment services"):
            rows = await self._pool.fetch(
                "SELECT name, duration_minutes, timezone, opening_hours FROM ce_appointment_services "
                "WHERE tenant_id = $1 AND name > $2 ORDER BY name LIMIT $3",
                tenant_id, _text(after), limit,
            )
        return [msgspec.convert(dict(r), ServiceRecord) for r in rows]

    async def delete_service(self, tenant_id: str, name: str) -> None:
        """Remove a service (its bookings stay). Raises NotFound."""
        with translate("deleting an appointment service"):
            async with self._pool.acquire() as conn, conn.transaction():
                done = await conn.fetchval(
                    "DELETE FROM ce_appointment_services WHERE tenant_id = $1 AND name = $2 RETURNING true",
                    tenant_id, _text(name),
                )
                if done:
                    await conn.execute(NOTIFY_CHANGE, tenant_id)
        if not done:
            raise NotFound(f"appointment service {name!r} does not exist for this tenant",
                           kind="appointment_service", key=name)
        await announce_change(self._pool)

    async def busy(self, tenant_id: str, service: str, start: datetime, end: datetime) -> list[tuple[datetime, datetime]]:
        """(starts_at, ends_at) of the service's bookings overlapping [start, end), in order."""
        with translate("reading booked appointments"):
            rows = await self._pool.fetch(
                "SELECT starts_at, ends_at FROM ce_appointments WHERE tenant_id = $1 AND service = $2 "
                "AND starts_at < $4 AND ends_at > $3 ORDER BY starts_at",
                tenant_id, _text(service), start, end,
            )
        return [(r["starts_at"], r["ends_at"]) for r in rows]

    async def book(
        self, tenant_id: str, service: str, starts_at: datetime, ends_at: datetime, *,
        session_id: str | None, contact_name: str | None = None, contact_email: str | None = None,
        idempotency_key: str | None = None, announce: Announce | None = None,
    ) -> tuple[AppointmentRecord, bool]:
        """Book [starts_at, ends_at), with its event in the same transaction. Returns (row, True),
        or (the row an earlier call with the same idempotency key in this session booked, False).
        Raises SlotTaken when any booking of the service overlaps: of many concurrent attempts on
        one slot exactly one succeeds.

        The insert is `ON CONFLICT DO NOTHING` (every unique index and the no-overlap exclusion
        constraint are its arbiters): Postgres then checks for a conflicting booking before it
        inserts, waiting for a transaction still writing one, and never after. A plain insert is
        checked against the exclusion constraint after its own index entry is in: two concurrent
        attempts could each see the other's entry and wait for each other, a deadlock Postgres
        breaks only after its deadlock_timeout (1 s), and attempts retried after it met the next
        ones the same way (a race of 100 did not finish in 120 s on a busy machine)."""
        service, contact_name, contact_email = _text(service), _text(contact_name), _text(contact_email)
        idempotency_key = _text(idempotency_key)  # it holds the client's message id
        with translate("booking an appointment"):
            async with self._pool.acquire() as conn:
                if idempotency_key is not None and (earlier := await self._by_key(conn, tenant_id, session_id, idempotency_key)):
                    return earlier, False
                # a transaction only when an event goes with the booking
                async with conn.transaction() if announce else contextlib.nullcontext():
                    row = await conn.fetchrow(
                        "INSERT INTO ce_appointments (tenant_id, service, starts_at, ends_at, session_id, "
                        "contact_name, contact_email, idempotency_key) "
                        "VALUES ($1, $2, $3, $4, $5, $6, $7, $8) "
                        f"ON CONFLICT DO NOTHING RETURNING {_APPOINTMENT_COLUMNS}",
                        tenant_id, service, starts_at, ends_at, session_id, contact_name, contact_email,
                        idempotency_key,
                    )
                    booked = None if row is None else AppointmentRecord(**dict(row))
                    if booked is not None:
                        await _announce(conn, announce, booked)
                if booked is not None:
                    return booked, True
                # nothing inserted: this call raced itself (a replay next to the first run), or the slot is taken
                if idempotency_key is not None and (earlier := await self._by_key(conn, tenant_id, session_id, idempotency_key)):
                    return earlier, False
        raise SlotTaken(
            f"{service} at {starts_at.isoformat()} overlaps an existing booking",
            service=service, starts_at=starts_at,
        )

    @staticmethod
    async def _by_key(conn: Any, tenant_id: str, session_id: str | None, idempotency_key: str) -> AppointmentRecord | None:
        row = await conn.fetchrow(
            f"SELECT {_APPOINTMENT_COLUMNS} FROM ce_appointments "
            "WHERE tenant_id = $1 AND session_id = $2 AND idempotency_key = $3",
            tenant_id, session_id, idempotency_key,
        )
        return None if row is None else AppointmentRecord(**dict(row))

    async def booked_by(self, tenant_id: str, service: str, starts_at: datetime, session_id: str) -> AppointmentRecord | None:
        """The booking of `service` at exactly `starts_at` made by this session, or None."""
        with translate("reading a booking"):
            row = await self._pool.fetchrow(
                f"SELECT {_APPOINTMENT_COLUMNS} FROM ce_appointments "
                "WHERE tenant_id = $1 AND service = $2 AND starts_at = $3 AND session_id = $4",
                tenant_id, _text(service), starts_at, session_id,
            )
        return None if row is None else AppointmentRecord(**dict(row))

    async def list(self, tenant_id: str, *, service: str | None = None, since: datetime | None = None,
                   limit: int = 200, after: Keyset | None = None) -> list[AppointmentRecord]:
        """The tenant's appointments (optionally of one service, starting at or after `since`),
        by start time; after the one `after` names (starts_at, id), if given."""
        at, key = after or (None, None)
        with translate("listing appointments"):
            rows = await self._pool.fetch(
                f"SELECT {_APPOINTMENT_COLUMNS} FROM ce_appointments WHERE tenant_id = $1 "
                "AND ($2::text IS NULL OR service = $2) AND ($3::timestamptz IS NULL OR starts_at >= $3) "
                "AND ($5::timestamptz IS NULL OR (starts_at, id) > ($5, $6::text)) "
                "ORDER BY starts_at, id LIMIT $4",
                tenant_id, _text(service), since, limit, at, key,
            )
        return [AppointmentRecord(**dict(r)) for r in rows]


# ----------------------------------------------------------------------------------- handoffs


_HANDOFF_COLUMNS = ("id, session_id, reason, created_at, state, agent, assigned_at, resolved_at, return_to_bot, "
                    "updated_at")
_OPEN = "state IN ('requested', 'assigned')"  # the predicate of ce_handoffs_one_open_idx (017)

# The handoffs `h` picks ($1 is the tenant), each with its session's last $N messages that hold
# text, in one statement. ce_messages keys a session by session_uid, which ce_sessions maps from
# the tenant's session id (a handoff of a session never flushed has no messages).
_WITH_MESSAGES = """
SELECT h.*, coalesce(last.messages, '[]'::jsonb) AS messages
FROM ({handoffs}) h
LEFT JOIN ce_sessions s ON s.tenant_id = $1 AND s.session_key = h.session_id
LEFT JOIN LATERAL (
  SELECT jsonb_agg(jsonb_build_object('seq', m.seq, 'role', m.role, 'content', m.content) ORDER BY m.seq) AS messages
  FROM (SELECT seq, role, content FROM ce_messages
        WHERE tenant_id = $1 AND session_id = s.id
          AND jsonb_path_exists(content, '$[*] ? (@.type == "text" && @.text != "")')
        ORDER BY seq DESC LIMIT {last}) m
) last ON true
ORDER BY h.created_at DESC, h.id
"""
_GET_SQL = _WITH_MESSAGES.format(
    handoffs=f"SELECT {_HANDOFF_COLUMNS} FROM ce_handoffs WHERE tenant_id = $1 AND id = $2", last="$3")
_LIST_SQL = _WITH_MESSAGES.format(
    handoffs=f"SELECT {_HANDOFF_COLUMNS} FROM ce_handoffs WHERE tenant_id = $1 AND ($2::text IS NULL OR state = $2) "
             f"AND {_OLDER.format(at='$5', id='$6')} ORDER BY created_at DESC, id LIMIT $3",
    last="$4")

# Transitions are conditional updates: of two racing claims Postgres lets exactly one match
# `state = 'requested'` (the second waits for the first's row lock, then sees 'assigned'). Their
# times are clock_timestamp(), not now(): now() is when the transaction began, and a resolve whose
# transaction began first but waited for a claim's lock would be stamped before the claim.
_CLAIM_SQL = (
    "UPDATE ce_handoffs SET state = 'assigned', agent = $3, assigned_at = clock_timestamp(), "
    "updated_at = clock_timestamp() "
    f"WHERE tenant_id = $1 AND id = $2 AND state = 'requested' RETURNING {_HANDOFF_COLUMNS}"
)
_RESOLVE_SQL = (
    "UPDATE ce_handoffs SET state = 'resolved', return_to_bot = $3, resolved_at = clock_timestamp(), "
    "updated_at = clock_timestamp() "
    f"WHERE tenant_id = $1 AND id = $2 AND {_OPEN} RETURNING {_HANDOFF_COLUMNS}"
)
_BY_ID_SQL = f"SELECT {_HANDOFF_COLUMNS} FROM ce_handoffs WHERE tenant_id = $1 AND id = $2"


def message_text(content: Any) -> str:
    """The text a person reads of a stored message: its text blocks' texts, in order, one per
    line; tool calls and results are left out. "" when it has none (or is not a block list)."""
    if not isinstance(content, list):
        return ""
    return "\n".join(
        b["text"] for b in content
        if isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str) and b["text"]
    )


def _handoff(r: Any, *, messages: bool = False) -> HandoffRecord:
    fields = {k: r[k] for k in _HANDOFF_COLUMNS.split(", ")}
    if messages:
        fields["messages"] = [HandoffMessage(role=m["role"], text=message_text(m["content"]), seq=m["seq"])
                              for m in r["messages"]]
    return HandoffRecord(**fields)


def _handoff_not_found(handoff_id: str) -> NotFound:
    return NotFound(f"handoff {handoff_id[:64]!r} does not exist for this tenant", kind="handoff", key=handoff_id)


def _resolved_how(h: HandoffRecord) -> str:
    if h.return_to_bot is None:
        return "closed as a duplicate of an earlier handoff of its session"
    return f"resolved with return_to_bot={'true' if h.return_to_bot else 'false'}"


class HandoffRepo:
    """ce_handoffs: one open (requested or assigned) handoff per session at most, moved forward
    by `claim` and `resolve`. Every read and write is scoped by tenant: another tenant's handoff
    is NotFound, never seen."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def record(
        self, tenant_id: str, session_id: str, reason: str | None, *, idempotency_key: str | None = None,
        announce: Announce | None = None,
    ) -> tuple[HandoffRecord, bool]:
        """Store a handoff request, with its event in the same transaction. Returns (row, True), or
        (the row of an earlier call with the same idempotency key in this session, False), or
        (the session's open handoff, False): a session has at most one open handoff, and escalating
        it again while one is open neither adds one nor announces one."""
        reason, idempotency_key = _text(reason), _text(idempotency_key)  # the key holds the client's message id
        with translate("recording a handoff"):
            async with self._pool.acquire() as conn, conn.transaction():
                # Either unique index may refuse the insert (DO NOTHING has no target, so both are
                # arbiters; a conflicting insert still in flight is waited for). The row it met is
                # read next; if that was an open handoff resolved in between, insert again.
                for _ in range(3):
                    row = await conn.fetchrow(
                        "INSERT INTO ce_handoffs (tenant_id, session_id, reason, idempotency_key) "
                        f"VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING RETURNING {_HANDOFF_COLUMNS}",
                        tenant_id, session_id, reason, idempotency_key,
                    )
                    if row is not None:
                        await _announce(conn, announce, _handoff(row))
                        return _handoff(row), True
                    # the replayed call's own row first (even resolved since), else the open one
                    row = await conn.fetchrow(
                        f"SELECT {_HANDOFF_COLUMNS} FROM ce_handoffs WHERE tenant_id = $1 AND session_id = $2 "
                        f"AND (idempotency_key = $3 OR {_OPEN}) ORDER BY (idempotency_key = $3) IS TRUE DESC LIMIT 1",
                        tenant_id, session_id, idempotency_key,
                    )
                    if row is not None:
                        return _handoff(row), False
        raise Conflict(f"the open handoff of session {session_id!r} kept changing while a new one was recorded; "
                       "escalate again")

    async def get(self, tenant_id: str, handoff_id: str, *, last_messages: int = 5) -> HandoffRecord:
        """The handoff with its session's last `last_messages` messages that hold text. Raises
        NotFound when the tenant has no such handoff."""
        with translate("reading a handoff"):
            row = await self._pool.fetchrow(_GET_SQL, tenant_id, _text(handoff_id), last_messages)
        if row is None:
            raise _handoff_not_found(handoff_id)
        return _handoff(row, messages=True)

    async def open_for_session(self, tenant_id: str, session_id: str) -> HandoffRecord | None:
        """The session's open (requested or assigned) handoff, or None. `messages` is not read."""
        with translate("reading a session's open handoff"):
            row = await self._pool.fetchrow(
                f"SELECT {_HANDOFF_COLUMNS} FROM ce_handoffs WHERE tenant_id = $1 AND session_id = $2 AND {_OPEN}",
                tenant_id, _text(session_id),
            )
        return None if row is None else _handoff(row)

    async def list(
        self, tenant_id: str, state: HandoffState | None = None, limit: int = 100, *, last_messages: int = 5,
        before: Keyset | None = None,
    ) -> list[HandoffRecord]:
        """The tenant's handoffs (in `state`, or all), newest first (after the one `before` names:
        (created_at, id)), each with its session's last `last_messages` messages that hold text.
        Raises InvalidInput for an unknown state."""
        if state is not None and state not in HANDOFF_STATES:
            raise InvalidInput(f"state must be one of {', '.join(HANDOFF_STATES)}, got {str(state)[:20]!r}")
        with translate("listing handoffs"):
            at, key = before or (None, None)
            rows = await self._pool.fetch(_LIST_SQL, tenant_id, state, limit, last_messages, at, key)
        return [_handoff(r, messages=True) for r in rows]

    async def claim(
        self, tenant_id: str, handoff_id: str, agent: str, *, announce: Announce | None = None,
    ) -> tuple[HandoffRecord, bool]:
        """Assign a requested handoff to `agent`, with the event `announce(row)` builds in the same
        transaction. Returns (row, True); (row, False) when `agent` holds it already (nothing
        written). Raises NotFound for a handoff the tenant does not have, HandoffConflict when
        another agent holds it or it is resolved. Of racing claims exactly one succeeds."""
        handoff_id, agent = _text(handoff_id), _text(agent)
        with translate("claiming a handoff"):
            changed, row = await self._transition(_CLAIM_SQL, tenant_id, handoff_id, agent, announce=announce)
        if changed:
            return row, True
        if row.state == "assigned" and row.agent == agent:
            return row, False
        if row.state == "assigned":
            raise HandoffConflict(
                f"handoff {handoff_id!r} is already assigned to {row.agent!r}; it stays theirs until it is "
                "resolved", handoff_id=handoff_id, state=row.state, agent=row.agent)
        raise HandoffConflict(
            f"handoff {handoff_id!r} was {_resolved_how(row)} and cannot be claimed; the session's next "
            "escalation opens a new handoff", handoff_id=handoff_id, state=row.state, agent=row.agent)

    async def resolve(
        self, tenant_id: str, handoff_id: str, return_to_bot: bool, *, announce: Announce | None = None,
    ) -> tuple[HandoffRecord, bool]:
        """Resolve a requested or assigned handoff, with the event `announce(row)` builds in the
        same transaction. Returns (row, True); (row, False) when it is resolved already with this
        `return_to_bot` (nothing written). Raises NotFound for a handoff the tenant does not have,
        HandoffConflict when it was resolved the other way."""
        handoff_id = _text(handoff_id)
        with translate("resolving a handoff"):
            changed, row = await self._transition(_RESOLVE_SQL, tenant_id, handoff_id, return_to_bot,
                                                  announce=announce)
        if changed:
            return row, True
        if row.return_to_bot is return_to_bot:
            return row, False
        raise HandoffConflict(
            f"handoff {handoff_id!r} was {_resolved_how(row)} and cannot be resolved again with "
            f"return_to_bot={'true' if return_to_bot else 'false'}; a resolved handoff is final",
            handoff_id=handoff_id, state=row.state, agent=row.agent)

    async def _transition(
        self, sql: str, tenant_id: str, handoff_id: str, value: Any, *, announce: Announce | None,
    ) -> tuple[bool, HandoffRecord]:
        """Run the conditional update `sql` ($1 tenant, $2 id, $3 `value`) and, when it moved the
        row, queue its event in the same transaction: (True, the moved row). Otherwise (False, the
        row as it is now), read after the update (a state only moves forward, so what it shows
        is what refused the update, or later). Raises NotFound for an id the tenant does not have."""
        async with self._pool.acquire() as conn:
            # a transaction only when an event goes with the change
            async with conn.transaction() if announce else contextlib.nullcontext():
                row = await conn.fetchrow(sql, tenant_id, handoff_id, value)
                if row is not None:
                    await _announce(conn, announce, _handoff(row))
                    return True, _handoff(row)
            row = await conn.fetchrow(_BY_ID_SQL, tenant_id, handoff_id)
        if row is None:
            raise _handoff_not_found(handoff_id)
        return False, _handoff(row)


class BuiltinRepos:
    """All of the above on one pool (what services.builtins and the admin routes take)."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool
        self.memories = MemoryRepo(pool)
        self.leads = LeadRepo(pool)
        self.forms = FormRepo(pool)
        self.appointments = AppointmentRepo(pool)
        self.handoffs = HandoffRepo(pool)
        self.notifications = NotificationRepo(pool)

    async def set_up(self, tenant_id: str) -> tuple[bool, bool]:
        """Whether the tenant has (any forms, any appointment services): one read."""
        with translate("reading the tenant's forms and services"):
            row = await self.pool.fetchrow(
                "SELECT EXISTS (SELECT 1 FROM ce_forms WHERE tenant_id = $1) AS forms, "
                "EXISTS (SELECT 1 FROM ce_appointment_services WHERE tenant_id = $1) AS services", tenant_id)
        return row["forms"], row["services"]
