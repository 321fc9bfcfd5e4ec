"""Typed records that cross the storage boundary (msgspec Structs in and out of repositories).

This module imports no driver: the session core and the gateway use these shapes without asyncpg.
Sessions are addressed by the tenant's own `session_id`; rows keyed by seed 000's global
`session_id` columns use `session_uid(tenant_id, session_id)` so two tenants may reuse an id.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, Literal

import msgspec

_SESSION_NS = uuid.UUID("6b1f0a8e-6a53-4c1e-9a2b-1c0de5e55105")


def session_uid(tenant_id: str, session_id: str) -> str:
    """The global row key of a tenant's session (deterministic, never reused across tenants)."""
    return str(uuid.uuid5(_SESSION_NS, f"{tenant_id}\x00{session_id}"))


class Tenant(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    name: str
    created_at: datetime


#: what an API key may do: `admin` every route, `chat` only what a contact's page needs
KeyKind = Literal["admin", "chat"]
KEY_KINDS: tuple[str, ...] = ("admin", "chat")


class IssuedKey(msgspec.Struct, frozen=True, kw_only=True):
    """A freshly created API key: the only time its plaintext exists outside the caller."""

    tenant_id: str
    key_id: str
    api_key: str
    kind: KeyKind = "admin"


class KeyHolder(msgspec.Struct, frozen=True, kw_only=True):
    """Who a presented API key speaks for: its tenant, and what the key may do."""

    tenant: Tenant
    kind: KeyKind


class EgressAllowance(msgspec.Struct, frozen=True, kw_only=True):
    """A destination an operator allowed one tenant's tools to reach despite the SSRF guard: a
    CIDR or a host name, on `port` (0: any port)."""

    entry: str
    port: int = 0


class ToolVersion(msgspec.Struct, frozen=True, kw_only=True):
    tenant_id: str
    name: str
    version: int
    definition: dict[str, Any]  # services.tools.model.ToolDefinition as stored (auth header encrypted)
    created_at: datetime
    published: bool = False


class PublishedTool(msgspec.Struct, frozen=True, kw_only=True):
    """A row of ce_custom_tools: the live definition of one tenant tool."""

    id: str
    tenant_id: str
    name: str
    type: str
    version: int
    enabled: bool
    definition: dict[str, Any]
    created_at: datetime
    updated_at: datetime


class ToolCallRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One ce_tool_calls row; `parameters` already redacted by the executor."""

    id: str
    tenant_id: str
    session_id: str
    message_id: str | None
    tool_name: str
    parameters: dict[str, Any] | None
    result: Any
    success: bool
    latency_ms: int
    queue_ms: int = 0
    error: str | None = None
    created_at: datetime | None = None
    trace_id: str | None = None  # the OpenTelemetry trace of the turn (hex), when tracing is on


class MessageRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One entry of a session's conversation history (LLM message content blocks as JSON)."""

    seq: int
    role: Literal["user", "assistant"]
    content: list[dict[str, Any]]
    message_id: str | None = None


class UsageDelta(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    input_tokens: int
    output_tokens: int
    #: the newest message seq these tokens were spent on (None: their delta has no messages); a
    #: flush adds them only past the seq the stored usage already holds (a retry adds nothing)
    through_seq: int | None = None


class TurnRecord(msgspec.Struct, frozen=True, kw_only=True):
    """The stored answer to a client message_id: a retry returns it and runs nothing."""

    message_id: str
    response: dict[str, Any]


class SessionSnapshot(msgspec.Struct, kw_only=True):
    """Session state that is not rows of its own: breakers, completed tools, handoff, approvals."""

    breakers: dict[str, int] = msgspec.field(default_factory=dict)
    completed: list[str] = msgspec.field(default_factory=list)
    handoff: bool = False
    handoff_reason: str | None = None
    message_count: int = 0
    pending: dict[str, Any] | None = None  # a held turn awaiting approval
    extra: dict[str, Any] = msgspec.field(default_factory=dict)
    #: the sequence number of the session's newest event (SessionEvent.seq); 0: none yet
    event_seq: int = 0
    #: where a handoff stands: "requested" (no one has claimed it), "assigned" (an agent has),
    #: "resolved" (closed: the bot does not come back); None: not handed off, or given back
    handoff_state: str | None = None
    handoff_agent: str | None = None
    #: the verified contact (a Contact-Token's `sub`) the session belongs to, once one wrote
    contact_sub: str | None = None
    #: the trusted scope the newest verified token gave (the tenant's scope_claims mapped)
    contact_scope: dict[str, str] = msgspec.field(default_factory=dict)


class SessionEvent(msgspec.Struct, frozen=True, kw_only=True):
    """One entry of a session's event log: what a watcher of the session sees (messages of the
    contact, the bot and agents, tool activity without arguments or results, approvals, client
    actions, job results, handoff changes), numbered 1, 2, ... per session (`seq`), written in
    the same transaction as the turn that made it, and pushed only once written."""

    seq: int
    type: str
    data: dict[str, Any]


class SessionDelta(msgspec.Struct, frozen=True, kw_only=True):
    """What one session changed since its last flush, fenced by the epoch of its lease."""

    tenant_id: str
    session_id: str
    epoch: int
    snapshot: SessionSnapshot
    messages: list[MessageRecord] = []
    variables: dict[str, str] = {}
    tool_calls: list[ToolCallRecord] = []
    usage: list[UsageDelta] = []
    turns: list[TurnRecord] = []
    events: list[SessionEvent] = []
    #: its events go to the tenant's agents' feed too (the session is with a person, or changes hands)
    feed: bool = False


class ActivatedSession(msgspec.Struct, frozen=True, kw_only=True):
    """A session loaded from Postgres under a fresh lease (`epoch` fences its flushes)."""

    tenant_id: str
    session_id: str
    epoch: int
    snapshot: SessionSnapshot
    variables: dict[str, str]
    history: list[MessageRecord]
    #: the latest stored answers by message_id, oldest first, when the store read them with the
    #: state (None: ask `recent_turns`)
    recent_turns: dict[str, dict[str, Any]] | None = None


class FlushResult(msgspec.Struct, frozen=True, kw_only=True):
    """Which deltas were written and which were refused because a newer lease exists."""

    written: list[tuple[str, str]]
    refused: list[tuple[str, str]]


class ToolStats(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    calls: int
    success_rate: float
    p50_ms: float
    p95_ms: float


class SessionView(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What GET /v1/sessions/{id} shows of a stored session (same fields as services.wire)."""

    session_id: str
    variables: dict[str, str]
    open_breakers: list[str]
    handoff: bool
    messages: int
    contact: dict[str, Any] | None = None


class SessionSummary(msgspec.Struct, frozen=True, kw_only=True):
    """One line of a tenant's session list, most recently updated first."""

    session_id: str
    message_count: int
    handoff: bool
    epoch: int
    created_at: datetime
    updated_at: datetime


class UsageTotal(msgspec.Struct, frozen=True, kw_only=True):
    """A tenant's token usage for one model, summed over its sessions."""

    model: str
    input_tokens: int
    output_tokens: int
    sessions: int


class JobRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A workflow job: `status` is running | succeeded | failed; `runner` who reports its outcome
    (engine | tenant | client, storage.repos.jobs.RUNNERS)."""

    id: str
    tenant_id: str
    session_id: str | None
    tool_name: str
    status: str
    result: Any = None
    error: str | None = None
    created_at: datetime | None = None
    updated_at: datetime | None = None
    runner: str = "tenant"


class McpServerRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A row of ce_mcp_servers: a remote MCP server a tenant registered as a tool source."""

    tenant_id: str
    name: str  # prefixes its tools' catalog names: <name>__<tool>
    url: str  # the streamable-HTTP endpoint
    auth_header_enc: str | None = None  # ciphertext (services.tools.crypto); never leaves the server
    enabled: bool = True
    read_only_tools: tuple[str, ...] = ()  # remote tool names the TENANT declares read-only
    include_tools: tuple[str, ...] | None = None  # None: every listed tool
    intents: tuple[str, ...] = ()  # intents every tool of this server belongs to
    timeout_ms: int = 10_000
    created_at: datetime | None = None
    updated_at: datetime | None = None
