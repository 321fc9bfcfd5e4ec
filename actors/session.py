"""The session state machine: one chat session's state and its tool-call loop (seed 000).

Pure of Ray, asyncpg, aiohttp and the anthropic SDK: a turn takes the session's state, the
message and its ports (LLM, executor, catalog, config) and mutates the state, recording every
change as part of the next flush delta. The Ray shells in `actors.host` run it one turn at a time.

Loop: at most MAX_ROUNDS model calls. Tools are offered in every round but the last, which is
forced to text (`tool_choice="none"`), so the contact always gets a reply and a sixth round never
happens. A round with no tool left to offer (used up, switched off, at a limit) whose history holds
tool calls is forced to text the same way, with the history's tools defined: the Messages API
refuses tool blocks in a request that defines no tools. The main model answers the contact's
message; the cheaper model writes the mechanical rounds that follow a tool result.

HANDOFF_MARKER in the model's text, in any round, hands the session over when the turn ends; the
marker itself is taken out of everything the contact reads (each streamed text delta, through a
services.llm.marker.MarkerFilter, however the deltas split it; the reply) and everything stored
(the history the model reads back, the stored answer).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol, runtime_checkable

import msgspec
import structlog

from kernel.errors import Forbidden, Unauthorized
from kernel.records import (
    ActivatedSession,
    JobRecord,
    MessageRecord,
    SessionDelta,
    SessionEvent,
    SessionSnapshot,
    ToolCallRecord,
    TurnRecord,
    UsageDelta,
)
from services.approvals import new_approval_id, verify_approval_id
from services.botconfig import BotConfig
from services.contacts import Contact, ContactVerifier
from services.fairshare import waiting
from services.llm.marker import MarkerFilter, defused, without_marker
from services.llm.port import (
    ChatMessage,
    ContentBlock,
    LLMClient,
    LLMError,
    LLMEvent,
    LLMRequest,
    LLMResponse,
    TextBlock,
    TextDelta,
    ToolResultBlock,
    ToolSpec,
    ToolUseBlock,
    final_response,
)
from services.tools.context import TrustedContext
from services.tools.errors import (
    ApprovalDenied,
    InvalidArguments,
    PolicyDenied,
    QueueTimeout,
    UnknownTool,
)
from services.tools.executor import BatchPlan, OnProgress, ToolCall, ToolOutcome
from services.tools.registry import Catalog
from services.tools.toolset import (
    SessionToolState,
    breaker_open,
    build_tool_set,
    detect_intent,
    gate_reason,
    tool_specs,
)
from services.tracing import tracer
from services.wire import (
    AgentMessage,
    HandoffChange,
    JobFinished,
    PendingApproval,
    PendingCall,
    SessionView,
    StreamEvent,
    ToolCallSummary,
    TurnReply,
    UsageOut,
)

log = structlog.get_logger(__name__)

MAX_ROUNDS = 5
HISTORY_WINDOW = 40
TURN_CACHE = 64
HANDOFF_MARKER = "[[HANDOFF]]"
HANDOFF_TOOL = "escalate_to_human"
MARKER_HANDOFF_REASON = "the assistant asked for a human"
HANDOFF_RECORD_S = 10.0  # how long a [[HANDOFF]] waits to record its handoff
JOBS_KEY = "jobs"  # snapshot.extra: workflow jobs this session waits for
CALLS_KEY = "calls"  # snapshot.extra: calls per tool this session that ran (per-session limits)
#: how a call refused before its tool did anything ends (by the executor's checks or by the
#: handler's own: bad arguments, not allowed, declined, a name no tool has, never out of the
#: queue): it counts toward no call limit, and a made-up name is never kept in the snapshot. An
#: interrupted call may have run: it counts
NOT_RUN_KINDS = frozenset({
    UnknownTool.kind, InvalidArguments.kind, PolicyDenied.kind, ApprovalDenied.kind, QueueTimeout.kind,
})
#: the tool a request defines, with use forbidden, when its history holds tool blocks, nothing
#: may be offered and no tool that history names is in the catalog any more: the Messages API
#: refuses a request whose messages hold tool_use or tool_result blocks and which defines no tools
NO_TOOL_SPEC = ToolSpec(
    name="no_tool_available", description="No tool may be used now: answer in text.",
    input_schema={"type": "object", "properties": {}},
)
DECIDED_KEY = "decided"  # snapshot.extra: [approval id, message id] of the latest decided approvals
DECIDED_KEPT = 32
HANDED_OFF_REPLY = (
    "You have been handed over to a member of our team; they will reply here as soon as they can."
)
#: what the contact is told once a person closed the conversation without giving it back to the bot
CLOSED_REPLY = "This conversation was closed by our team. Thank you for writing to us."
LLM_DOWN_REPLY = (
    "I'm sorry, I can't answer right now because of a technical problem. Please try again in a moment."
)
ROUND_CAP_REPLY = "I'm sorry, I couldn't finish that. Could you tell me a little more about what you need?"
#: the result a tool call gets when its turn failed before recording one
INTERRUPTED_RESULT = (
    "the turn stopped (an internal error) before this call's result was recorded; it may have run: "
    "check before calling it again"
)

Emit = Callable[[StreamEvent], Awaitable[None]]


async def _no_emit(_event: StreamEvent) -> None:
    return None


class SessionError(Exception):
    """Misuse of a session (an approval that does not exist); `kind` says which."""

    def __init__(self, message: str, *, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


class PendingTurn(msgspec.Struct, kw_only=True):
    """A turn held for approval: everything needed to resume it in any activation."""

    approval_id: str
    message_id: str
    calls: list[ToolCall]
    round: int
    summary: list[str]
    tools: list[str]
    expires_at: str
    usage: dict[str, list[int]] = {}
    tool_calls: list[ToolCallSummary] = []
    client_actions: list[dict[str, Any]] = []
    deliveries: list[dict[str, Any]] = []  # finished jobs the held turn delivered (taken off the list)
    #: the intent detected for the held turn's message: the rounds after the decision are offered
    #: (and may call) only its tools. None: none detected, or a turn held before this was kept
    intent: str | None = None
    #: for each held call, in order, the version of the tool it resolved to when held (None: no
    #: tool had its name): approved, a call whose tool has another version now does not run, nor
    #: does its batch (Executor.refuse_changed). None: held before versions were kept; such a
    #: turn resumes against the catalog current at the decision, as it did
    tool_versions: list[int | None] | None = None
    #: for each held call, in order, the names its tool declared `sensitive` when held ([]: none,
    #: or no tool had its name): whatever is recorded of the call after the decision (refused as
    #: changed, declined, expired, run) is redacted with these and the current definition's
    #: (PreparedCall.sensitive), so a name dropped from `sensitive`, or a tool removed, while the
    #: approval was pending does not put the value in clear. None: held before these were kept;
    #: such a turn is redacted with the current definition's names, as it was
    tool_sensitive: list[list[str]] | None = None
    #: calls per tool that ran in the held turn's rounds so far (`_Turn.ran`): the per-turn limits
    #: after the decision count them. None: held before these were kept; every call counts then
    ran: dict[str, int] | None = None
    #: the model wrote HANDOFF_MARKER in a round before the hold: the turn hands the session over
    #: when it ends (`_Turn.handoff_asked`)
    handoff_asked: bool = False


@runtime_checkable
class ToolExecutor(Protocol):
    """What a turn needs of the tool pipeline (services.tools.executor.Executor implements it):
    check a batch, run it, and the in-band results of a batch that does not run."""

    async def prepare(
        self, calls: list[ToolCall], *, catalog: Catalog, config: BotConfig, session: SessionToolState,
        scope: dict[str, Any], intent: str | None = None, held_sensitive: list[list[str]] | None = None,
    ) -> BatchPlan: ...

    async def execute(
        self, plan: BatchPlan, ctx: TrustedContext, *, approved: bool = False,
        on_progress: OnProgress | None = None, finished: dict[str, ToolOutcome] | None = None,
    ) -> list[ToolOutcome]: ...

    def interrupted(
        self, plan: BatchPlan, ctx: TrustedContext, finished: dict[str, ToolOutcome],
    ) -> list[ToolOutcome]: ...

    def deny(self, plan: BatchPlan, ctx: TrustedContext, *, reason: str) -> list[ToolOutcome]: ...

    def refuse_changed(
        self, plan: BatchPlan, ctx: TrustedContext, *, held_versions: list[int | None],
    ) -> list[ToolOutcome] | None: ...


#: records a handoff as the escalate_to_human tool would: `await handoff(args, ctx)` (its handler)
HandoffRecorder = Callable[[dict[str, Any], TrustedContext], Awaitable[Any]]


@runtime_checkable
class HandoffDesk(Protocol):
    """Moves a tenant's handoff on in the store, notifying the tenant (services.builtins.handoff.
    HandoffService); raises NotFound for an unknown id and Conflict for a change its state refuses."""

    async def claim(self, tenant_id: str, handoff_id: str, agent: str) -> Any: ...
    async def resolve(self, tenant_id: str, handoff_id: str, return_to_bot: bool) -> Any: ...


class TurnEnv(msgspec.Struct, frozen=True, kw_only=True):
    """The ports and per-tenant data a turn runs with."""

    llm: LLMClient
    executor: ToolExecutor
    catalog: Catalog
    config: BotConfig
    main_model: str
    cheap_model: str
    approval_ttl_s: float = 900.0
    approval_keys: tuple[bytes, ...] = ()  # HMAC keys signing approval ids (services.approvals)
    scope: dict[str, Any] = {}
    #: records a handoff the model asked for in its text ([[HANDOFF]]) as the escalate_to_human
    #: tool would: `await handoff(args, ctx)` (the built-in's handler); None: the session is only marked
    handoff: HandoffRecorder | None = None
    #: claims and resolves handoffs (HandoffChange); None: this process cannot (the change is refused)
    handoffs: HandoffDesk | None = None
    #: checks Contact-Tokens with the tenant's settings; None: the tenant verifies no contact
    contacts: ContactVerifier | None = None


class SealedTurns:
    """Whole turns' changes a flush took from a session, one delta per turn, oldest first.

    Written as one delta (`joined`), the group commit's normal case; when Postgres refuses that
    for good, turn by turn, so the turns before the one it refuses are kept (a later turn builds
    on the earlier ones, never the reverse). `last` is the number of the newest turn
    (SessionState.sealed_turns when taken); the first is `last - len(turns) + 1`.
    """

    __slots__ = ("_joined", "attempted", "last", "turns")

    def __init__(self, turns: list[SessionDelta], *, attempted: int, last: int) -> None:
        self.turns = turns
        self.attempted = attempted  # leading turns a failed flush held already
        self.last = last
        self._joined: SessionDelta | None = None

    def joined(self) -> SessionDelta:
        """The turns as one delta. Usage rows of turns a failed flush held stay apart, each with
        its own seq: that flush may have committed with its acknowledgement lost, and the store
        skips a row whose seq it has applied. Untried turns' rows are summed, one per model (the
        newest seq covers them), which keeps the batch to one statement."""
        if self._joined is None:
            if len(self.turns) == 1:
                self._joined = self.turns[0]
            else:
                tried, fresh = self.turns[:self.attempted], self.turns[self.attempted:]
                self._joined = _joined(self.turns, usage=[u for d in tried for u in d.usage]
                                       + _summed([u for d in fresh for u in d.usage]))
        return self._joined


class SessionState:
    """One activation of a session: cached state plus what changed since the last flush."""

    def __init__(self, activated: ActivatedSession) -> None:
        self.tenant_id = activated.tenant_id
        self.session_id = activated.session_id
        self.epoch = activated.epoch
        self.variables: dict[str, str] = dict(activated.variables)
        self.snapshot: SessionSnapshot = msgspec.structs.replace(activated.snapshot)
        self.history: list[ChatMessage] = [_to_chat(m) for m in activated.history]
        self.next_seq = (activated.history[-1].seq + 1) if activated.history else 0
        self.turns: dict[str, dict[str, Any]] = {}
        #: every stored turn of this session is in `turns` (so a message_id not there is new)
        self.turns_complete = not activated.history
        # changes of the turn in progress; sealed into `_sealed` when its answer is remembered
        self._messages: list[MessageRecord] = []
        self._variables: dict[str, str] = {}
        self._calls: list[ToolCallRecord] = []
        self._usage: dict[str, list[int]] = {}
        self._turns: list[TurnRecord] = []
        self._events: list[SessionEvent] = []
        self._dirty = False
        self.turn_message_id: str | None = None  # the message id of the turn running (or last run)
        #: jobs the turn in progress took off the waiting list to deliver: waiting again if it fails
        self.taken_jobs: list[str] = []
        #: whole turns' changes not yet taken by a flush, one delta per turn, oldest first: kept
        #: apart so that a turn Postgres refuses for good takes none of the turns before it along
        self._sealed: list[SessionDelta] = []
        #: the turns the flush running now took, until it settles: handed back (`restore_turns`)
        #: or let go (`settle_turns`); a host runs one flush at a time
        self._taken: list[SessionDelta] = []
        self._attempted = 0  # leading turns of `_sealed` a failed flush held (their usage kept apart)
        #: turns sealed in this activation: the newest one's number (the host's gate counts by it)
        self.sealed_turns = 0

    # -- flush deltas ----------------------------------------------------------------------

    @property
    def dirty(self) -> bool:
        """Something is not written yet: whole turns', or a turn's still in progress."""
        return bool(self._sealed) or self._dirty

    @property
    def turn_half_done(self) -> bool:
        """A turn in progress has changed something: the cached state is not whole turns' now."""
        return self._dirty

    def take_turns(self) -> SealedTurns | None:
        """What whole turns changed since the last take, turn by turn, or None. Never part of a
        turn: a flush that wrote the first half of a turn whose host then died would leave it
        stored half done, and the retry of its message id would run it again on top of that."""
        if not self._sealed:
            return None
        taken = SealedTurns(self._sealed, attempted=self._attempted, last=self.sealed_turns)
        self._taken, self._sealed, self._attempted = self._sealed, [], 0
        return taken

    def settle_turns(self, taken: SealedTurns) -> None:
        """The flush that took `taken` is over without handing it back (written, or refused for
        good): let go of it. Until then its answers count as unwritten (the turn cache keeps
        them); after, an idle session holds its state and not also its last flush's delta."""
        if self._taken is taken.turns:
            self._taken = []

    def take_delta(self) -> SessionDelta | None:
        """What whole turns changed since the last take, as one delta, or None."""
        taken = self.take_turns()
        return None if taken is None else taken.joined()

    def restore_turns(self, taken: SealedTurns) -> None:
        """Put back turns whose flush failed, before anything newer, so nothing is lost. Their
        usage rows stay as they were tried from now on (see SealedTurns.joined)."""
        self._sealed = taken.turns + self._sealed
        self._attempted = len(taken.turns)
        self._taken = []  # unwritten again, in `_sealed`

    def restore_delta(self, delta: SessionDelta) -> None:
        """Put back one delta whose flush failed (as one turn), before anything newer."""
        self.restore_turns(SealedTurns([delta], attempted=0, last=self.sealed_turns))

    def _seal(self) -> None:
        """The turn in progress is whole (its answer is remembered): its changes may be written."""
        if not self._dirty:
            return
        newest = self._messages[-1].seq if self._messages else None  # appended in seq order
        self._sealed.append(SessionDelta(
            tenant_id=self.tenant_id, session_id=self.session_id, epoch=self.epoch,
            # A deep copy: the store encodes it after awaits, while later turns change the original.
            snapshot=msgspec.convert(msgspec.to_builtins(self.snapshot), SessionSnapshot),
            messages=self._messages, variables=self._variables, tool_calls=self._calls,
            usage=[UsageDelta(model=m, input_tokens=i, output_tokens=o, through_seq=newest)
                   for m, (i, o) in self._usage.items()],
            turns=self._turns,  # one turn's: its one answer (a turn ends by remembering it)
            events=self._events,
            # while a person has the conversation (or it changes hands) its events are the agents' too
            feed=bool(self._events) and (self.snapshot.handoff_state is not None
                                         or any(e.type == "handoff" for e in self._events)),
        ))
        self.sealed_turns += 1
        self._messages, self._variables, self._calls, self._usage, self._turns = [], {}, [], {}, []
        self._events = []
        self._dirty = False

    def close_failed_turn(self) -> None:
        """A turn raised half way (a bug or a cancellation; model and tool errors are answered
        in-band): what it did stays, since its tools ran and the model spent its tokens (an
        approval it resumed stays decided, so its tools never run twice), made whole so that later
        turns build on a valid conversation: each tool call it left without a result gets one
        saying so, and calls it was holding for approval are held no more. No answer is
        remembered for its message id: sent again, it runs anew (a resumed approval's message id
        keeps its held answer, and the approval says it was decided). Finished jobs it took off the
        waiting list go back on it: its answer would have delivered them, and none was given."""
        if self.taken_jobs:
            # its answer, which carried them, never reached the contact: the next turn delivers
            # them again (the model may read of them twice; the contact hears of them once)
            waiting = self.snapshot.extra.setdefault(JOBS_KEY, [])
            waiting[:0] = [j for j in self.taken_jobs if j not in waiting]
            self.taken_jobs = []
            self._touch()
        last = self.history[-1] if self.history else None
        unanswered = [b for b in last.content if isinstance(b, ToolUseBlock)] if last and last.role == "assistant" else []
        if not self._dirty and (not unanswered or self.snapshot.pending is not None):
            return  # nothing changed: calls held by an earlier turn stay held
        if unanswered:
            self.snapshot.pending = None
            self.append(ChatMessage(role="user", content=[
                ToolResultBlock(tool_use_id=b.id, content=INTERRUPTED_RESULT, is_error=True) for b in unanswered
            ]), self.turn_message_id)
        self._seal()

    def _touch(self) -> None:
        self._dirty = True

    # -- mutations (each recorded for the flush) ----------------------------------------------

    def append(self, message: ChatMessage, message_id: str | None) -> None:
        self.history.append(message)
        if len(self.history) > HISTORY_WINDOW * 2:
            del self.history[: len(self.history) - HISTORY_WINDOW]
        self._messages.append(MessageRecord(
            seq=self.next_seq, role=message.role,
            content=msgspec.to_builtins(message.content), message_id=message_id,
        ))
        self.next_seq += 1
        self.snapshot.message_count += 1
        self._touch()

    def log_event(self, type_: str, data: dict[str, Any]) -> None:
        """Add an event to the session's log (numbered next), written with the turn that made it."""
        self.snapshot.event_seq += 1
        self._events.append(SessionEvent(seq=self.snapshot.event_seq, type=type_, data=data))
        self._touch()

    def set_variable(self, key: str, value: str) -> None:
        if self.variables.get(key) != value:
            self.variables[key] = value
            self._variables[key] = value
            self._touch()

    def record_call(self, record: ToolCallRecord) -> None:
        self._calls.append(record)
        self._touch()

    def add_usage(self, model: str, input_tokens: int, output_tokens: int) -> None:
        acc = self._usage.setdefault(model, [0, 0])
        acc[0] += input_tokens
        acc[1] += output_tokens
        self._touch()

    def load_turns(self, turns: dict[str, dict[str, Any]], *, complete: bool) -> None:
        """Seed the turn cache at activation with the most recent stored answers."""
        self.turns.update(list(turns.items())[-TURN_CACHE:])
        self.turns_complete = complete

    def cache_turn(self, message_id: str, response: dict[str, Any]) -> None:
        """Keep an answer in the turn cache: its latest TURN_CACHE answers, and every answer
        whose turn is not written yet, however many. Evicted, an answer is looked up in Postgres
        when its message id comes again (`turns_complete` False); an unwritten one is not there,
        and its turn (and its tools) would run a second time.

        Past TURN_CACHE, the cache holds one entry per unwritten turn beyond it, each the very
        answer that turn's delta holds (TurnRecord.response) until a flush writes it: it grows with
        the unwritten turns, by a dict slot each, and is back to TURN_CACHE at the first eviction
        after they are written."""
        self.turns[message_id] = response
        if len(self.turns) <= TURN_CACHE:
            return
        kept = self._unwritten_turns()
        kept.add(message_id)  # the answer just cached: a stored one read for a retry is about to be used
        for cached in list(self.turns):  # oldest first
            if len(self.turns) <= TURN_CACHE:
                break
            if cached not in kept:
                del self.turns[cached]
                self.turns_complete = False

    def _unwritten_turns(self) -> set[str]:
        """The message ids of the answers not written yet: sealed, taken by a flush that has not
        settled, or of the turn in progress."""
        ids = {t.message_id for d in (*self._taken, *self._sealed) for t in d.turns}
        ids.update(t.message_id for t in self._turns)
        return ids

    def remember_turn(self, message_id: str, reply: TurnReply) -> None:
        self.taken_jobs = []  # delivered with this answer (or held with it for approval)
        response = msgspec.to_builtins(reply)
        self._turns.append(TurnRecord(message_id=message_id, response=response))
        self.cache_turn(message_id, response)
        self._touch()
        self._seal()  # the last thing a turn does (finished, or held for approval)

    def tool_state(self, turn_calls: dict[str, int] | None = None) -> SessionToolState:
        return SessionToolState(
            variables=self.variables, breakers=self.snapshot.breakers,
            calls=self.snapshot.extra.get(CALLS_KEY, {}), turn_calls=turn_calls or {},
        )

    def open_breakers(self) -> list[str]:
        return sorted(n for n in self.snapshot.breakers if breaker_open(self.snapshot.breakers, n))

    # -- what the host asks of the session (it never reads the snapshot itself) -----------------

    def view(self) -> SessionView:
        """The session as GET /v1/sessions/{id} shows it."""
        sub = self.snapshot.contact_sub
        return SessionView(
            session_id=self.session_id, variables=dict(self.variables), open_breakers=self.open_breakers(),
            handoff=self.snapshot.handoff, messages=self.snapshot.message_count,
            contact=None if sub is None else {"sub": sub, "verified": True},
        )

    def identify(self, verifier: ContactVerifier | None, token: str | None, *, bind: bool = True) -> Contact | None:
        """Who is writing, checked before anything of the turn runs or is replayed: the contact a
        Contact-Token names (verified with the tenant's settings), bound to the session the first
        time one writes (`bind`; a reader binds nothing). Raises Unauthorized (a token refused;
        none where the tenant requires one or the session belongs to a contact) or Forbidden
        (another contact's session)."""
        if token is not None:
            if verifier is None:
                raise Unauthorized("this tenant does not verify contacts, so a Contact-Token cannot be checked; "
                                   "send the message without it, or configure contact_verification")
            contact = verifier.verify(token)
            bound = self.snapshot.contact_sub
            if bound is not None and not secrets.compare_digest(bound.encode(), contact.sub.encode()):
                raise Forbidden(f"session {self.session_id!r} belongs to another contact; start a new session "
                                "for this one")
            if bind and (bound is None or self.snapshot.contact_scope != contact.scope):
                self.snapshot.contact_sub = contact.sub
                self.snapshot.contact_scope = dict(contact.scope)
                self._touch()
            return contact
        if self.snapshot.contact_sub is not None:
            raise Unauthorized(f"session {self.session_id!r} belongs to a verified contact; send their "
                               "Contact-Token with the message")
        if verifier is not None and verifier.required:
            raise Unauthorized("this tenant requires verified contacts; send the contact's JWT in the "
                               "Contact-Token header")
        return None

    def answered(self, message_id: str | None) -> bool:
        """An answer for `message_id` is in the turn cache: sent again, it is replayed, nothing runs."""
        return message_id in self.turns

    def may_have_dropped(self, message_id: str) -> bool:
        """An answer for `message_id` may be stored while the turn cache no longer holds it (the
        host then reads it from the store and `cache_turn`s it before the turn runs)."""
        return message_id not in self.turns and not self.turns_complete

    def waiting_jobs(self) -> list[str]:
        """The ids of the workflow jobs this session waits for (delivered by a later turn)."""
        return list(self.snapshot.extra.get(JOBS_KEY) or [])

    def decided_turn(self, approval_id: str) -> str | None:
        """The message id of the turn `approval_id` resumed when it was decided, or None."""
        return decided_turn(self.snapshot, approval_id)

    @property
    def holds_approval(self) -> bool:
        """A turn is held for an approval: deciding it resumes the turn (tools or the model run)."""
        return self.snapshot.pending is not None


class _Turn:
    """Accumulates what one turn reports back."""

    def __init__(self, message_id: str) -> None:
        self.message_id = message_id
        self.usage: dict[str, list[int]] = {}
        self.tool_calls: list[ToolCallSummary] = []
        self.client_actions: list[dict[str, Any]] = []
        self.rounds = 0
        self.deliveries: list[dict[str, Any]] = []
        #: calls per tool this turn that ran (NOT_RUN_KINDS do not count): per-turn limits
        self.ran: dict[str, int] = {}
        #: the model wrote HANDOFF_MARKER in one of the turn's rounds (taken out of its text): the
        #: session is handed over when the turn ends
        self.handoff_asked = False

    def reply(self, state: SessionState, text: str, pending: PendingApproval | None = None) -> TurnReply:
        return TurnReply(
            session_id=state.session_id, message_id=self.message_id, reply=text,
            tool_calls=list(self.tool_calls), rounds=self.rounds,
            usage=UsageOut(
                input_tokens=sum(u[0] for u in self.usage.values()),
                output_tokens=sum(u[1] for u in self.usage.values()),
            ),
            handoff=state.snapshot.handoff, pending_approval=pending,
            client_actions=list(self.client_actions), deliveries=list(self.deliveries),
        )


async def handle_message(
    state: SessionState, text: str, message_id: str | None, env: TurnEnv, emit: Emit | None = None,
    *, finished_jobs: list[JobRecord] = (),
) -> TurnReply:
    """Run one contact message through the tool loop; returns the reply the contact gets.
    `emit` gets the turn's events as they come (None: nobody watches it stream).

    A message_id seen before returns the first answer and runs nothing again. `finished_jobs`
    (workflow jobs this session waited for) are delivered into the conversation first. The turn
    is one trace (turn -> round -> tool call) when tracing is configured.
    """
    with tracer().start_as_current_span("turn", attributes={
        "ce.tenant_id": state.tenant_id, "ce.session_id": state.session_id, "ce.message_id": message_id or "",
    }) as span:
        # the contact's marker is text, not a request: only the model's hands over
        text = defused(text, HANDOFF_MARKER)
        reply = await _handle_message(state, text, message_id, env, emit or _no_emit, finished_jobs)
        _annotate(span, reply)
        return reply


def _annotate(span, reply: TurnReply) -> None:
    span.set_attribute("ce.rounds", reply.rounds)
    span.set_attribute("ce.tool_calls", len(reply.tool_calls))
    span.set_attribute("ce.handoff", reply.handoff)
    span.set_attribute("ce.pending_approval", reply.pending_approval is not None)


async def _handle_message(
    state: SessionState, text: str, message_id: str | None, env: TurnEnv, emit: Emit,
    finished_jobs: list[JobRecord],
) -> TurnReply:
    message_id = message_id or f"m_{secrets.token_hex(8)}"
    if message_id in state.turns:
        return msgspec.structs.replace(msgspec.convert(state.turns[message_id], TurnReply), replay=True)
    state.turn_message_id = message_id
    state.taken_jobs = []
    turn = _Turn(message_id)
    content: list[ContentBlock] = []
    if state.snapshot.pending is not None:
        # The contact moved on without deciding: the held calls end as declined, in-band, so
        # every tool_use keeps exactly one tool_result.
        pending = msgspec.convert(state.snapshot.pending, PendingTurn)
        state.snapshot.pending = None
        state._touch()
        content += _declined_results(pending, "the customer sent a new message instead of approving")
    deliveries = _deliver_jobs(state, finished_jobs)
    for delivery in deliveries:
        await emit(StreamEvent(event="job_result", data=delivery))
        state.log_event("job_result", {k: delivery[k] for k in ("job_id", "tool", "status")})
        content.append(TextBlock(text=_job_notice(delivery)))
    content.append(TextBlock(text=text))
    state.append(ChatMessage(role="user", content=content), message_id)
    state.log_event("message", {"author": "contact", "text": text, "message_id": message_id})
    turn.deliveries = deliveries
    if state.snapshot.handoff:
        if state.snapshot.handoff_state == "assigned":
            # a person has the conversation: the message is theirs to answer (their stream has it)
            return await _finish(state, turn.reply(state, ""), emit)
        said = CLOSED_REPLY if state.snapshot.handoff_state == "resolved" else HANDED_OFF_REPLY
        turn_reply = turn.reply(state, said)
        state.append(ChatMessage(role="assistant", content=[TextBlock(text=said)]), message_id)
        return await _finish(state, turn_reply, emit)
    intent = detect_intent(env.config, text)
    return await _loop(state, turn, env, emit, first_round=1, intent=intent)


async def handle_approval(
    state: SessionState, approval_id: str, approve: bool, env: TurnEnv, emit: Emit | None = None,
    *, edited_arguments: dict[str, dict[str, Any]] | None = None, now: datetime | None = None,
) -> TurnReply:
    """Resume a turn held for approval: run the batch (approve) or tell the model it was declined.
    Approved, a batch whose tools changed (another version, removed, added) while the approval was
    pending runs nothing: the model is told so in-band and asks the contact to confirm again.

    Raises SessionError(kind="not_found") when no such approval is pending.
    """
    with tracer().start_as_current_span("turn.resume", attributes={
        "ce.tenant_id": state.tenant_id, "ce.session_id": state.session_id, "ce.approved": approve,
    }) as span:
        reply = await _handle_approval(state, approval_id, approve, env, emit or _no_emit, edited_arguments,
                                       now)
        _annotate(span, reply)
        return reply


async def _handle_approval(
    state: SessionState, approval_id: str, approve: bool, env: TurnEnv, emit: Emit,
    edited_arguments: dict[str, dict[str, Any]] | None, now: datetime | None,
) -> TurnReply:
    raw = state.snapshot.pending
    pending = msgspec.convert(raw, PendingTurn) if raw is not None else None
    if not verify_approval_id(env.approval_keys, state.tenant_id, state.session_id, approval_id):
        raise SessionError("this approval id is not valid for this session; use the id from the reply",
                           kind="not_found")
    if pending is None or not secrets.compare_digest(pending.approval_id.encode(), approval_id.encode()):
        decided = decided_turn(state.snapshot, approval_id)
        stored = state.turns.get(decided) if decided is not None else None
        if stored is not None:
            if (stored.get("pending_approval") or {}).get("approval_id") == approval_id:
                # the state was saved between the decision and the turn's end, then its host stopped
                raise SessionError(f"approval {approval_id[:60]!r} was decided but the turn it resumed stopped "
                                   "before it finished (a host restart or an error; its tools may have run, "
                                   "writes with their idempotency key); send the contact's request again as a "
                                   "new message", kind="not_found")
            # Decided already (a client that lost the answer asks again): the turn's stored
            # answer, as a repeated message_id gets it; the first decision stands, nothing runs.
            return msgspec.structs.replace(msgspec.convert(stored, TurnReply), replay=True)
        raise SessionError(f"no pending approval {approval_id[:60]!r} in this session (a newer message replaced "
                           f"it, or it was decided before the session's latest {DECIDED_KEPT} decisions); send "
                           "the contact's request again as a new message to ask anew", kind="not_found")
    if pending.message_id in state.turns and state.turns[pending.message_id].get("pending_approval") is None:
        return msgspec.convert(state.turns[pending.message_id], TurnReply)
    state.turn_message_id = pending.message_id
    state.snapshot.pending = None
    remember_decided(state.snapshot, approval_id, pending.message_id)
    state._touch()
    turn = _Turn(pending.message_id)
    turn.usage = {k: list(v) for k, v in pending.usage.items()}
    turn.tool_calls = list(pending.tool_calls)
    turn.client_actions = list(pending.client_actions)
    turn.deliveries = list(pending.deliveries)  # the final answer replaces the held one, stored
    turn.rounds = pending.round
    turn.ran = dict(pending.ran) if pending.ran is not None else _per_tool(pending.tool_calls)
    turn.handoff_asked = pending.handoff_asked
    now = now or datetime.now(UTC)
    expired = datetime.fromisoformat(pending.expires_at) <= now
    # The held batch against the catalog current now: what the approver was shown runs, or nothing.
    held = await _prepare(state, env, pending.calls, message_id=pending.message_id, turn=turn,
                          intent=pending.intent, held_sensitive=pending.tool_sensitive)
    ctx = _context(state, env, pending.message_id)
    refused = None
    if approve and not expired and pending.tool_versions is not None:
        refused = env.executor.refuse_changed(held, ctx, held_versions=pending.tool_versions)
    if refused is not None:
        # a tool changed while the approval was pending: the approver's edits were for what they
        # were shown, and nothing runs; the model is told why, as for a decline
        await _absorb(state, turn, refused, emit, pending.message_id)
    else:
        plan = held
        if edited_arguments:
            plan = await _prepare(state, env, _edited(pending.calls, held, edited_arguments),
                                  message_id=pending.message_id, turn=turn, intent=pending.intent,
                                  held_sensitive=pending.tool_sensitive)
        if approve and not expired:
            await _run_batch(state, turn, env, emit, plan, ctx, approved=True)
        else:
            reason = "the approval expired before anyone decided" if expired else "the customer declined"
            await _absorb(state, turn, env.executor.deny(plan, ctx, reason=reason), emit, pending.message_id)
    return await _loop(state, turn, env, emit, first_round=pending.round + 1, intent=pending.intent)


def _edited(calls: list[ToolCall], shown: BatchPlan, edits: dict[str, dict[str, Any]]) -> list[ToolCall]:
    """The held calls with an approver's edits merged over the model's arguments (an approver
    sends only what changes, or the whole form back). An edited value equal to what the approver
    was shown of it (`PreparedCall.shown_arguments`: "[redacted]" for a sensitive or
    secret-looking value, a text that repeats one with it replaced) keeps the model's value: the
    approver did not change it. The same holds inside objects and same-length lists, key by key
    and item by item, so a nested secret sent back as shown stays whole while its siblings change.
    A value that only contains "[redacted]" in a changed text, or under a key the call did not
    have, runs as sent."""
    out = []
    for c, p in zip(calls, shown.calls, strict=True):
        edit = edits.get(c.id)
        if not edit:
            out.append(c)
            continue
        seen = p.shown_arguments() if p.tool is not None else {}
        out.append(msgspec.structs.replace(c, arguments={
            **c.arguments, **{k: _unredacted(v, seen.get(k, _ABSENT), c.arguments.get(k, _ABSENT)) for k, v in edit.items()},
        }))
    return out


_ABSENT = object()


def _unredacted(edited: Any, shown: Any, original: Any) -> Any:
    """`edited`, with each part equal to what was shown of it put back to the model's `original`."""
    if original is _ABSENT or shown is _ABSENT:
        return edited
    if edited == shown:
        return original
    if isinstance(edited, dict) and isinstance(shown, dict) and isinstance(original, dict):
        return {k: _unredacted(v, shown.get(k, _ABSENT), original.get(k, _ABSENT)) for k, v in edited.items()}
    if isinstance(edited, list) and isinstance(shown, list) and isinstance(original, list) \
            and len(edited) == len(shown) == len(original):
        return [_unredacted(e, s, o) for e, s, o in zip(edited, shown, original, strict=True)]
    return edited


def _joined(deltas: list[SessionDelta], *, usage: list[UsageDelta]) -> SessionDelta:
    """Deltas of one session, oldest first, as one (the newest snapshot; `usage` as given)."""
    newest = deltas[-1]
    variables: dict[str, str] = {}
    for d in deltas:
        variables.update(d.variables)
    return SessionDelta(
        tenant_id=newest.tenant_id, session_id=newest.session_id, epoch=newest.epoch, snapshot=newest.snapshot,
        messages=[m for d in deltas for m in d.messages], variables=variables,
        tool_calls=[c for d in deltas for c in d.tool_calls], usage=usage,
        turns=_latest_answers([t for d in deltas for t in d.turns]),
        events=[e for d in deltas for e in d.events], feed=any(d.feed for d in deltas),
    )


def _summed(usage: list[UsageDelta]) -> list[UsageDelta]:
    """Usage rows of turns no flush has tried, one per model: tokens added, the newest seq."""
    out: dict[str, UsageDelta] = {}
    for u in usage:
        was = out.get(u.model)
        out[u.model] = u if was is None else UsageDelta(
            model=u.model, input_tokens=was.input_tokens + u.input_tokens,
            output_tokens=was.output_tokens + u.output_tokens,
            through_seq=u.through_seq if u.through_seq is not None else was.through_seq,
        )
    return list(out.values())


def _latest_answers(turns: list[TurnRecord]) -> list[TurnRecord]:
    """One answer per message id, the latest (a turn held for approval, then resumed), in the
    order the message ids first came: one flush statement cannot write a stored answer twice."""
    latest = {t.message_id: t for t in turns}
    return list(latest.values()) if len(latest) < len(turns) else turns


def remember_decided(snapshot: SessionSnapshot, approval_id: str, message_id: str) -> None:
    """Note that `approval_id` was decided and resumed turn `message_id` (its answer is stored
    under it): asked again, the approval answers with it. The latest DECIDED_KEPT are kept."""
    decided = snapshot.extra.setdefault(DECIDED_KEY, [])
    decided.append([approval_id, message_id])
    del decided[:-DECIDED_KEPT]


def decided_turn(snapshot: SessionSnapshot, approval_id: str) -> str | None:
    """The message id of the turn `approval_id` resumed when it was decided, or None."""
    for decided, message_id in reversed(snapshot.extra.get(DECIDED_KEY) or []):
        if secrets.compare_digest(decided.encode(), approval_id.encode()):
            return message_id
    return None


async def _loop(
    state: SessionState, turn: _Turn, env: TurnEnv, emit: Emit, *, first_round: int, intent: str | None
) -> TurnReply:
    final_text = ""
    for round_no in range(first_round, MAX_ROUNDS + 1):
        last = round_no == MAX_ROUNDS
        offered = build_tool_set(env.config, intent, state.tool_state(turn.ran), env.catalog)
        messages = _window(state.history)
        tools, choice = tool_specs(offered), "none" if last else "auto"
        if not offered and _has_tool_blocks(messages):
            # The Messages API refuses tool_use/tool_result blocks in a request that defines no
            # tools: the history's tools stay defined and the model may call none of them (a call
            # made anyway is refused by the same gate that left them out of the offer).
            tools, choice = _history_specs(messages, env.catalog, env.config), "none"
        request = LLMRequest(
            model=env.main_model if round_no == 1 else env.cheap_model,
            system=env.config.persona,
            messages=messages,
            tools=tools,
            tool_choice=choice,
        )
        with tracer().start_as_current_span("round", attributes={
            "ce.round": round_no, "ce.model": request.model, "ce.tools_offered": len(offered),
        }) as span:
            try:
                response = await _ask(env.llm, request, emit)
            except LLMError as exc:
                span.set_attribute("ce.error", str(exc)[:200])
                final_text = LLM_DOWN_REPLY
                turn.rounds = round_no
                break
            span.set_attribute("ce.input_tokens", response.usage.input_tokens)
            span.set_attribute("ce.output_tokens", response.usage.output_tokens)
            turn.rounds = round_no
            _count(turn, state, response)
            calls = [b for b in response.content if isinstance(b, ToolUseBlock)]
            if len({c.id for c in calls}) < len(calls):
                response = msgspec.structs.replace(response, content=_unique_call_ids(response.content))
                calls = [b for b in response.content if isinstance(b, ToolUseBlock)]
            text = "".join(b.text for b in response.content if isinstance(b, TextBlock))
            if HANDOFF_MARKER in text:  # the contact never reads it, nor does the stored history hold it
                turn.handoff_asked = True
                text = without_marker(text, HANDOFF_MARKER)
                response = msgspec.structs.replace(response, content=_without_marker_blocks(response.content))
            if not calls or last:
                final_text = text.strip() or (
                    HANDED_OFF_REPLY if turn.handoff_asked else ROUND_CAP_REPLY if calls else "")
                # Only the text is kept: tool calls the last round was told not to make never run.
                state.append(ChatMessage(role="assistant", content=[TextBlock(text=final_text or "…")]), turn.message_id)
                break
            state.append(ChatMessage(role="assistant", content=response.content), turn.message_id)
            tool_calls = [ToolCall(id=b.id, name=b.name, arguments=b.input) for b in calls]
            for call in tool_calls:
                await emit(StreamEvent(event="tool_call", data={"id": call.id, "name": call.name}))
                state.log_event("tool_call", {"id": call.id, "name": call.name})
            plan = await _prepare(state, env, tool_calls, message_id=turn.message_id, turn=turn, intent=intent)
            if plan.needs_approval:
                return await _hold(state, turn, env, emit, tool_calls, plan, round_no, intent)
            await _run_batch(state, turn, env, emit, plan, _context(state, env, turn.message_id))
    if turn.handoff_asked and not state.snapshot.handoff:  # not already handed over (by the tool, with its reason)
        await _record_handoff(state, env, turn.message_id, MARKER_HANDOFF_REASON)
        _mark_handoff(state, MARKER_HANDOFF_REASON)
    return await _finish(state, turn.reply(state, final_text), emit)


async def _ask(llm: LLMClient, request: LLMRequest, emit: Emit) -> LLMResponse:
    """One model call. Streamed only when someone watches the turn (SSE): a turn answered as one
    JSON body asks for the whole answer at once, which costs the SDK and the model less."""
    async with waiting("model"):  # the model's answer is not this loop's work: other turns compute meanwhile
        if emit is _no_emit:
            return await llm.complete(request)
        return await final_response(_relay_text(llm.stream(request), emit))


async def _relay_text(events: AsyncIterator[LLMEvent], emit: Emit) -> AsyncIterator[LLMEvent]:
    """The events as they come, the text deltas emitted to the watcher on the way without
    HANDOFF_MARKER: a delta that may be the marker's start is held back until ruled out (or the
    model's answer ends), so a marker split across deltas (`[[HAND` + `OFF]]`) never shows."""
    shown = MarkerFilter(HANDOFF_MARKER)
    async for event in events:
        if isinstance(event, TextDelta) and event.text:
            await _emit_text(emit, shown.feed(event.text))
        elif isinstance(event, LLMResponse):
            await _emit_text(emit, shown.flush())
        yield event


async def _emit_text(emit: Emit, text: str) -> None:
    if text:
        await emit(StreamEvent(event="text", data={"text": text}))


def _without_marker_blocks(content: list[ContentBlock]) -> list[ContentBlock]:
    """`content` with HANDOFF_MARKER taken out of its text blocks; a block left blank is dropped
    (the Messages API refuses a blank text block sent back)."""
    out: list[ContentBlock] = []
    for block in content:
        if isinstance(block, TextBlock) and HANDOFF_MARKER in block.text:
            text = without_marker(block.text, HANDOFF_MARKER)
            if not text.strip():
                continue
            block = TextBlock(text=text)
        out.append(block)
    return out


def _unique_call_ids(content: list) -> list:
    """`content` with each tool call's id unique (a repeat gets `_2`, `_3`, ...): a model or
    provider that repeats an id would have the two calls' results (and approvals) mixed up, and
    a model API refuses a conversation that holds a tool call id twice."""
    seen: set[str] = set()
    out = []
    for block in content:
        if isinstance(block, ToolUseBlock):
            unique, n = block.id, 1
            while unique in seen:
                n += 1
                unique = f"{block.id}_{n}"
            if unique != block.id:
                block = msgspec.structs.replace(block, id=unique)
            seen.add(unique)
        out.append(block)
    return out


def _count(turn: _Turn, state: SessionState, response: LLMResponse) -> None:
    acc = turn.usage.setdefault(response.model, [0, 0])
    acc[0] += response.usage.input_tokens
    acc[1] += response.usage.output_tokens
    state.add_usage(response.model, response.usage.input_tokens, response.usage.output_tokens)


async def _prepare(
    state: SessionState, env: TurnEnv, calls: list[ToolCall], *, message_id: str, turn: _Turn | None = None,
    intent: str | None = None, held_sensitive: list[list[str]] | None = None,
) -> BatchPlan:
    """The batch checked for this session, turn and intent: a call of a tool the turn's offer
    left out (its intent's filter included) is refused in-band, never run. `held_sensitive`: a
    held batch's `PendingTurn.tool_sensitive`, kept sensitive whatever the tools declare now."""
    return await env.executor.prepare(
        calls, catalog=env.catalog, config=env.config,
        session=state.tool_state(turn.ran if turn is not None else None),
        scope=_scope(state, env), intent=intent, held_sensitive=held_sensitive,
    )


def _progress(emit: Emit):
    async def on_progress(prepared, elapsed_ms: int, message: str | None) -> None:
        data = {"id": prepared.call.id, "name": prepared.call.name, "elapsed_ms": elapsed_ms}
        if message:
            data["message"] = message
        await emit(StreamEvent(event="tool_progress", data=data))

    return on_progress


def _scope(state: SessionState, env: TurnEnv) -> dict[str, Any]:
    """The trusted scope of the session's calls, which no argument of the model can replace: the
    tenant's id; for a verified contact, what the tenant maps from its token's claims (`stay_id`
    from `stay`, `account_id` from `sub`). An anonymous session has no `account_id`: a tool that
    needs one fails in-band, asking the customer to sign in."""
    scope: dict[str, Any] = {}
    if state.snapshot.contact_sub is not None:
        scope.update(state.snapshot.contact_scope)
    scope.update(env.scope)
    scope.update(tenant_id=state.tenant_id, tenantId=state.tenant_id)  # never from a token
    return scope


def _context(state: SessionState, env: TurnEnv, message_id: str) -> TrustedContext:
    return TrustedContext(
        tenant_id=state.tenant_id, session_id=state.session_id, message_id=message_id,
        contact_id=(state.snapshot.contact_sub or state.variables.get(env.config.contact_id_variable)
                    or state.session_id),
        contact_sub=state.snapshot.contact_sub,
        scope=_scope(state, env), variables=dict(state.variables), idempotency_key=message_id,
        language=env.config.language,
    )


async def _run_batch(
    state: SessionState, turn: _Turn, env: TurnEnv, emit: Emit, plan: BatchPlan, ctx: TrustedContext,
    *, approved: bool = False,
) -> None:
    """Run a batch and fold in its outcomes. Stopped half way (a host stopping cancels a turn
    stuck in a tool), what finished is kept all the same, since its effects are real: each call
    that finished with its result and record, each other call with a result saying it may have
    run, so that the turn can be closed whole (`close_failed_turn`) and the model is not left to
    repeat a write blind."""
    finished: dict[str, ToolOutcome] = {}
    try:
        outcomes = await env.executor.execute(plan, ctx, approved=approved, on_progress=_progress(emit),
                                              finished=finished)
    except BaseException:
        _fold(state, turn, env.executor.interrupted(plan, ctx, finished), ctx.message_id)
        raise
    await _absorb(state, turn, outcomes, emit, ctx.message_id)


async def _absorb(state: SessionState, turn: _Turn, outcomes: list[ToolOutcome], emit: Emit, message_id: str) -> None:
    """Fold a batch's outcomes into the session, then tell the watcher about each."""
    for event in _fold(state, turn, outcomes, message_id):
        await emit(event)


def _fold(state: SessionState, turn: _Turn, outcomes: list[ToolOutcome], message_id: str) -> list[StreamEvent]:
    """A batch's outcomes into the session: results for the model, records, breakers, variables.
    Returns the events that tell a watcher about them, in order."""
    blocks: list[ContentBlock] = []
    events: list[StreamEvent] = []
    for o in outcomes:
        blocks.append(ToolResultBlock(tool_use_id=o.call_id, content=o.content, is_error=not o.success))
        state.record_call(o.record)
        summary = ToolCallSummary(id=o.call_id, name=o.name, success=o.success, latency_ms=o.latency_ms, error=o.error)
        turn.tool_calls.append(summary)
        # what a watcher of the session sees: no arguments, result or error text
        state.log_event("tool_result", {"id": o.call_id, "name": o.name, "success": o.success})
        if o.success or o.error_kind not in NOT_RUN_KINDS:  # it ran: it counts toward the tool's limits
            counts = state.snapshot.extra.setdefault(CALLS_KEY, {})
            counts[o.name] = counts.get(o.name, 0) + 1
            turn.ran[o.name] = turn.ran.get(o.name, 0) + 1
        if o.success:
            waiting = state.snapshot.extra.setdefault(JOBS_KEY, []) if o.job_id is not None else None
            if waiting is not None and o.job_id not in waiting:  # a turn run again finds its job
                waiting.append(o.job_id)
            for key, value in o.variables.items():
                state.set_variable(key, value)
            if o.completes_variable:
                state.set_variable(o.completes_variable, "true")
                if o.name not in state.snapshot.completed:
                    state.snapshot.completed.append(o.name)
            if o.name == HANDOFF_TOOL:
                reason = o.record.parameters.get("reason") if o.record.parameters else None
                _mark_handoff(state, str(reason or "the contact asked for a human"))
        elif o.counts_for_breaker:
            state.snapshot.breakers[o.name] = state.snapshot.breakers.get(o.name, 0) + 1
        events.append(StreamEvent(event="tool_result", data=msgspec.to_builtins(summary)))
        if o.client_action is not None:
            action = {"call_id": o.call_id, **msgspec.to_builtins(o.client_action)}
            turn.client_actions.append(action)
            events.append(StreamEvent(event="client_action", data=action))
            state.log_event("client_action", action)
    state.append(ChatMessage(role="user", content=blocks), message_id)
    return events


async def _hold(
    state: SessionState, turn: _Turn, env: TurnEnv, emit: Emit, calls: list[ToolCall], plan: BatchPlan, round_no: int,
    intent: str | None,
) -> TurnReply:
    expires = datetime.now(UTC) + timedelta(seconds=env.approval_ttl_s)
    tools = [p.tool.name for p in plan.calls if p.needs_approval and p.tool is not None]
    # what the contact is asked, one question per call (the model wrote its arguments: no marker)
    questions = [without_marker(line, HANDOFF_MARKER) for line in plan.summary()]
    pending = PendingTurn(
        approval_id=new_approval_id(env.approval_keys, state.tenant_id, state.session_id),
        message_id=turn.message_id, calls=calls,
        round=round_no, summary=questions, tools=tools, expires_at=expires.isoformat(),
        usage=turn.usage, tool_calls=turn.tool_calls, client_actions=turn.client_actions,
        deliveries=turn.deliveries, intent=intent, ran=turn.ran,
        tool_versions=[p.tool.version if p.tool is not None else None for p in plan.calls],
        tool_sensitive=[sorted(p.sensitive) for p in plan.calls],
        handoff_asked=turn.handoff_asked,
    )
    state.snapshot.pending = msgspec.to_builtins(pending)
    state._touch()
    approval = PendingApproval(
        approval_id=pending.approval_id, summary=pending.summary, tools=tools, expires_at=pending.expires_at,
        calls=[
            PendingCall(id=p.call.id, name=p.tool.name, arguments=p.shown_arguments())
            for p in plan.calls if p.tool is not None and p.error is None
        ],
    )
    await emit(StreamEvent(event="approval_required", data=msgspec.to_builtins(approval)))
    state.log_event("approval_required", {"approval_id": approval.approval_id, "summary": approval.summary,
                                          "tools": approval.tools, "expires_at": approval.expires_at})
    text = "Before I go ahead, please confirm:\n" + "\n".join(f"- {line}" for line in pending.summary)
    reply = turn.reply(state, text, pending=approval)
    _log_reply(state, reply)
    # Remembered so a retried message_id returns the same approval request, not a second run.
    state.remember_turn(turn.message_id, reply)
    return reply


def _deliver_jobs(state: SessionState, finished: list[JobRecord]) -> list[dict[str, Any]]:
    """Take finished jobs off the session's waiting list; what the contact and model get."""
    waiting = state.snapshot.extra.get(JOBS_KEY) or []
    out = []
    for job in finished:
        if job.id not in waiting:
            continue  # delivered before (a retry of this turn): never twice
        waiting.remove(job.id)
        state.taken_jobs.append(job.id)
        out.append({"job_id": job.id, "tool": job.tool_name, "status": job.status,
                    "result": job.result, "error": job.error})
    if out:
        state._touch()
    return out


def _job_notice(delivery: dict[str, Any]) -> str:
    body = msgspec.json.encode(delivery["result"]).decode() if delivery["status"] == "succeeded" else delivery["error"]
    return (f"[Update: the background task '{delivery['tool']}' (job {delivery['job_id']}) "
            f"{delivery['status']}: {body}. Tell the customer about it.]")


def _declined_results(pending: PendingTurn, reason: str) -> list[ContentBlock]:
    return [
        ToolResultBlock(
            tool_use_id=c.id, is_error=True,
            content=f"Tool '{c.name}' failed: not run, {reason}. Do not assume it happened.",
        )
        for c in pending.calls
    ]


async def _record_handoff(state: SessionState, env: TurnEnv, message_id: str, reason: str) -> None:
    """The handoff row and the tenant's `handoff.requested` notification for a [[HANDOFF]] in
    the model's text, as the tool makes them (idempotent per message: a retried turn adds no
    second row). Best effort: the session is handed over either way (its own state says so)."""
    if env.handoff is None:
        return
    try:  # bounded: the turn holds its session while it waits
        await asyncio.wait_for(env.handoff({"reason": reason}, _context(state, env, message_id)), HANDOFF_RECORD_S)
    except Exception as exc:  # noqa: BLE001 - the contact still gets the handover reply
        log.warning("handoff_not_recorded", session_id=state.session_id, error=type(exc).__name__)


def _mark_handoff(state: SessionState, reason: str) -> None:
    state.snapshot.handoff = True
    state.snapshot.handoff_reason = reason[:500]
    if state.snapshot.handoff_state != "requested":
        state.snapshot.handoff_state = "requested"
        state.snapshot.handoff_agent = None
        state.log_event("handoff", {"state": "requested"})
    state._touch()


async def _finish(state: SessionState, reply: TurnReply, emit: Emit) -> TurnReply:
    # No `done` event here: the host sends it once the reply's state is durable (output gate).
    _log_reply(state, reply)
    state.remember_turn(reply.message_id, reply)
    return reply


def _log_reply(state: SessionState, reply: TurnReply) -> None:
    if reply.reply:
        state.log_event("message", {"author": "bot", "text": reply.reply, "message_id": reply.message_id})


# -- a person in the conversation (handoffs) ------------------------------------------------------

#: how the model reads an agent's words in the history once the session is back with the bot
AGENT_WORDS = "[{agent}, a member of the team] {text}"


def handle_agent_message(state: SessionState, message: AgentMessage) -> TurnReply:
    """An agent's message to the contact: stored in the history (the model reads it once the
    conversation is given back) and logged for the contact's stream. Idempotent by message id.
    Raises SessionError(kind="conflict") when the session is not handed off to a person."""
    message_id = message.message_id or f"a_{secrets.token_hex(8)}"
    if message_id in state.turns:
        return msgspec.structs.replace(msgspec.convert(state.turns[message_id], TurnReply), replay=True)
    snap = state.snapshot
    if not snap.handoff or snap.handoff_state == "resolved":
        raise SessionError(
            f"session {state.session_id!r} is not handed off to a person (it is "
            f"{'closed' if snap.handoff else 'with the bot'}); an agent may write only between a handoff "
            "(escalate_to_human or [[HANDOFF]]) and its resolution", kind="conflict")
    state.turn_message_id = message_id
    agent, text = defused(message.agent, HANDOFF_MARKER), defused(message.text, HANDOFF_MARKER)
    words = AGENT_WORDS.format(agent=agent, text=text)
    state.append(ChatMessage(role="assistant", content=[TextBlock(text=words)]), message_id)
    state.log_event("message", {"author": "agent", "agent": agent, "text": text,
                                "message_id": message_id})
    reply = TurnReply(session_id=state.session_id, message_id=message_id, reply=text, tool_calls=[],
                      rounds=0, usage=UsageOut(), handoff=True)
    state.remember_turn(message_id, reply)
    return reply


async def handle_job_finished(
    state: SessionState, finished: JobFinished, env: TurnEnv, jobs: list[JobRecord],
) -> TurnReply:
    """A job's result arrived (`jobs`: the finished ones among it): when its tool says to notify
    (`notify_on_result`), deliver it now and run the model, whose reply goes to the contact's
    stream as any bot message does. Otherwise, or while the session is handed off or holds an
    approval, nothing happens: the result waits for the contact's next message as before."""
    message_id = f"j_{finished.job_id}"
    if message_id in state.turns:
        return msgspec.structs.replace(msgspec.convert(state.turns[message_id], TurnReply), replay=True)
    idle = TurnReply(session_id=state.session_id, message_id=message_id, reply="", tool_calls=[], rounds=0,
                     usage=UsageOut(), handoff=state.snapshot.handoff)
    if state.snapshot.handoff or state.snapshot.pending is not None:
        return idle
    notify = [j for j in jobs if _notifies(env.catalog, j.tool_name)]
    if not notify:
        return idle
    state.turn_message_id = message_id
    state.taken_jobs = []
    deliveries = _deliver_jobs(state, notify)
    if not deliveries:
        return idle
    turn = _Turn(message_id)
    turn.deliveries = deliveries
    for delivery in deliveries:
        state.log_event("job_result", {k: delivery[k] for k in ("job_id", "tool", "status")})
    state.append(ChatMessage(role="user", content=[TextBlock(text=_job_notice(d)) for d in deliveries]), message_id)
    with tracer().start_as_current_span("turn.job_result", attributes={
        "ce.tenant_id": state.tenant_id, "ce.session_id": state.session_id, "ce.message_id": message_id,
    }) as span:
        reply = await _loop(state, turn, env, _no_emit, first_round=1, intent=None)
        _annotate(span, reply)
        return reply


def _notifies(catalog: Catalog, tool_name: str) -> bool:
    tool = catalog.get(tool_name)
    return tool is not None and bool(getattr(tool.definition, "notify_on_result", False))


def handle_handoff_change(state: SessionState, change: HandoffChange) -> TurnReply:
    """A handoff claimed by an agent or resolved (the store made the change; the session follows
    it and logs it for its watchers). Applying the same change again changes nothing."""
    snap = state.snapshot
    message_id = f"h_{change.handoff_id}_{change.state}"
    if change.state == "assigned":
        changed = snap.handoff_state != "assigned" or snap.handoff_agent != change.agent
        if changed:
            snap.handoff, snap.handoff_state, snap.handoff_agent = True, "assigned", change.agent
            state.log_event("handoff", {"state": "assigned", "handoff_id": change.handoff_id, "agent": change.agent})
    else:
        back = bool(change.return_to_bot)
        changed = snap.handoff != (not back) or snap.handoff_state != (None if back else "resolved")
        if changed:
            snap.handoff, snap.handoff_state, snap.handoff_agent = not back, None if back else "resolved", None
            state.log_event("handoff", {"state": "resolved", "handoff_id": change.handoff_id, "return_to_bot": back})
    reply = TurnReply(session_id=state.session_id, message_id=message_id, reply="", tool_calls=[], rounds=0,
                      usage=UsageOut(), handoff=snap.handoff)
    if changed:
        state.turn_message_id = message_id
        state._touch()
        state._seal()
    return reply


def _window(history: list[ChatMessage]) -> list[ChatMessage]:
    """The recent history, starting at a user text message so tool blocks stay paired."""
    window = history[-HISTORY_WINDOW:]
    start = 0
    while start < len(window) and not (
        window[start].role == "user" and not any(isinstance(b, ToolResultBlock) for b in window[start].content)
    ):
        start += 1
    return window[start:] or history[-1:]


def _has_tool_blocks(messages: list[ChatMessage]) -> bool:
    return any(isinstance(b, (ToolUseBlock, ToolResultBlock)) for m in messages for b in m.content)


def _history_specs(messages: list[ChatMessage], catalog: Catalog, config: BotConfig) -> list[ToolSpec]:
    """For a request that must define tools but lets the model call none: the definitions of the
    tools the messages' calls name, in the order first called, that the agent's configuration
    offers (left out now only for what this session did: used up, switched off, at a limit), or
    NO_TOOL_SPEC when there is none (removed since, hidden by the configuration, or a name the
    model made up: a tool the model was never offered is not shown to it here either)."""
    specs: dict[str, ToolSpec] = {}
    fresh = SessionToolState()
    for m in messages:
        for b in m.content:
            if isinstance(b, ToolUseBlock) and b.name not in specs:
                tool = catalog.get(b.name)
                if tool is not None and gate_reason(tool, config, fresh) is None:
                    specs[b.name] = tool.spec
    return list(specs.values()) or [NO_TOOL_SPEC]


def _per_tool(calls: list[ToolCallSummary]) -> dict[str, int]:
    """Calls per tool name."""
    counts: dict[str, int] = {}
    for c in calls:
        counts[c.name] = counts.get(c.name, 0) + 1
    return counts


def _to_chat(record: MessageRecord) -> ChatMessage:
    return ChatMessage(role=record.role, content=msgspec.convert(record.content, list[ContentBlock]))


def new_state(tenant_id: str, session_id: str, epoch: int = 1) -> SessionState:
    """A fresh session with no history (tests and first activations)."""
    return SessionState(ActivatedSession(
        tenant_id=tenant_id, session_id=session_id, epoch=epoch,
        snapshot=SessionSnapshot(), variables={}, history=[],
    ))


