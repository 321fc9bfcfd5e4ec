"""Public wire shapes of the chat API (docs/api.md § Chat): request bodies, replies, events.

Bodies are decoded once at the gateway with `forbid_unknown_fields`; replies are built by the
session core and encoded once. The same structs feed /openapi.json.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class SendMessage(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    text: str
    message_id: str | None = None


class SendAgentMessage(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/sessions/{id}/agent-messages: a person's message to the contact of a handed-off session."""

    text: str
    agent: str
    message_id: str | None = None


class ClaimHandoff(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    agent: str


class ResolveHandoff(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    return_to_bot: bool


class DecideApproval(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    approve: bool
    #: the approver may edit arguments (call id -> arguments); re-validated before anything runs
    arguments: dict[str, dict[str, Any]] | None = None


class ToolCallSummary(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    id: str
    name: str
    success: bool
    latency_ms: int
    error: str | None = None


class UsageOut(msgspec.Struct, frozen=True, kw_only=True):
    input_tokens: int = 0
    output_tokens: int = 0


class PendingCall(msgspec.Struct, frozen=True, kw_only=True):
    """A held call as the approver sees it; its arguments may be edited by call id."""

    id: str
    name: str
    arguments: dict[str, Any]


class PendingApproval(msgspec.Struct, frozen=True, kw_only=True):
    approval_id: str
    summary: list[str]
    tools: list[str]
    expires_at: str | None = None
    calls: list[PendingCall] = []


class TurnTiming(msgspec.Struct, frozen=True, kw_only=True):
    """Where a turn's time went in its session host, in milliseconds."""

    #: from the host taking the turn to its reply being released: activation, waiting behind
    #: the session's earlier messages, the catalog check, model rounds, tools and the gate
    host_ms: float
    #: of which: waiting for the turn's state to be durable (the output gate; 0 with it off)
    gate_ms: float = 0.0
    #: of which: waiting for a compute slot, behind other turns of the host (services.fairshare)
    share_ms: float = 0.0
    #: waiting for the model's answers, and for tools' upstreams (webhooks, backends, MCP
    #: servers; calls at once each counted)
    model_ms: float = 0.0
    upstream_ms: float = 0.0


class TurnReply(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    session_id: str
    message_id: str
    reply: str
    tool_calls: list[ToolCallSummary]
    rounds: int
    usage: UsageOut
    handoff: bool = False
    pending_approval: PendingApproval | None = None
    client_actions: list[dict[str, Any]] = []
    #: workflow results delivered into this turn (seed 001's asynchronous workflows)
    deliveries: list[dict[str, Any]] = []
    #: internal: this is the stored answer to a repeated message_id (nothing ran). The gateway
    #: strips it from the body (the client gets the first answer, byte for byte) and says so in
    #: an `X-Replayed: true` header instead.
    replay: bool = False
    #: internal: set by the session host on the reply it releases, never stored with the answer.
    #: The gateway strips it from the body and sends it as a `Server-Timing` header.
    timing: TurnTiming | None = None


class SessionView(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    session_id: str
    variables: dict[str, str]
    open_breakers: list[str]
    handoff: bool
    messages: int
    #: the verified contact the session belongs to ({"sub", "verified": true}); left out while
    #: the session is anonymous
    contact: dict[str, Any] | None = None


class StreamEvent(msgspec.Struct, frozen=True, kw_only=True):
    """One SSE event of a streamed turn: text, tool_call, tool_result, approval_required,
    client_action, done."""

    event: str
    data: Any


# -- commands to the session hosts (gateway -> placement -> host; not part of the HTTP API) -------


class Turn(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="turn"):
    """Run a contact's message in a session: what crosses the host boundary for POST .../messages.

    Encoded once by the caller (actors.placement) and decoded once by the host's shell
    (actors.ray_host), both sides of one deployment. Whether `message_id` was made up for this
    very call (SessionHost.send's `new_id`) is not part of it: that depends on the attempt (a
    retry may repeat a turn that ran) and on what the host takes, which only the caller's transport
    knows, so it travels beside the command."""

    tenant_id: str
    session_id: str
    text: str
    message_id: str | None = None
    #: the contact's JWT (the Contact-Token header), verified by the session's host
    contact_token: str | None = None


class ApprovalDecision(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="approval"):
    """Decide an approval a turn is held for (POST .../approvals/{approval_id}); resumes the turn."""

    tenant_id: str
    session_id: str
    approval_id: str
    approve: bool
    #: the approver's edits of the held calls' arguments (call id -> arguments), or None
    edited: dict[str, dict[str, Any]] | None = None
    contact_token: str | None = None


#: what a session host runs as one turn: a message, or the decision that resumes a held one
TurnCommand = Turn | ApprovalDecision


class AgentMessage(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="agent_message"):
    """A person's message in a handed-off session (POST .../agent-messages): stored in its history
    and pushed to the contact's stream; the model is not called."""

    tenant_id: str
    session_id: str
    text: str
    agent: str
    message_id: str | None = None


class HandoffChange(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="handoff_change"):
    """A handoff the store moved on (claimed: "assigned"; "resolved"), for the session to follow."""

    tenant_id: str
    session_id: str
    handoff_id: str
    state: Literal["assigned", "resolved"]
    agent: str | None = None
    return_to_bot: bool | None = None


class JobFinished(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="job_finished"):
    """A workflow job (or a client tool's call) of the session has its result: the session runs a
    turn at once and pushes the reply to the contact's stream, if the tool says so."""

    tenant_id: str
    session_id: str
    job_id: str


class CheckContact(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="check_contact"):
    """May this contact read the session (a chat key's view or watch)? Changes nothing."""

    tenant_id: str
    session_id: str
    contact_token: str | None = None


#: what a session host runs that is not a contact's turn: a person's message, a handoff's change,
#: a job's result, a reader's check
SessionCommand = AgentMessage | HandoffChange | JobFinished | CheckContact

