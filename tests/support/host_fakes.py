"""Fakes for the session host: a SessionStore with real lease semantics, a TenantSource, a model.

`FakeSessionStore` implements `actors.host.SessionStore` the way the Postgres adapter must behave:
`activate` takes a lease (bumps the session's epoch) and returns what is stored; `flush` is one
transaction that refuses deltas of a stale epoch and applies the rest. Test switches simulate a
slow or unavailable database. `FakeTenants` implements `actors.host.TenantSource` with a
`RuleModel` (answers from the request alone, so many sessions can share it) and two python tools.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any

import msgspec

from actors.session import TurnEnv
from kernel.records import (
    ActivatedSession,
    FlushResult,
    MessageRecord,
    SessionDelta,
    SessionEvent,
    SessionSnapshot,
    ToolCallRecord,
)
from services.botconfig import BotConfig
from services.llm.port import (
    LLMRequest,
    LLMResponse,
    TextBlock,
    TextDelta,
    ToolResultBlock,
    ToolUseBlock,
    Usage,
)
from services.tools.context import TrustedContext
from services.tools.executor import Executor
from services.tools.model import PythonTool
from services.tools.registry import HandlerRegistry, build_catalog
from tests.support.fakes import StreamScriptedLLM

Key = tuple[str, str]


class StoreUnavailable(Exception):
    """What the fake raises while the database is 'down' (the adapter's connection error)."""

    retryable = True


def _copy_snapshot(snapshot: SessionSnapshot) -> SessionSnapshot:
    # Through JSON, as a JSONB column would: the store never shares objects with a live session.
    return msgspec.json.decode(msgspec.json.encode(snapshot), type=SessionSnapshot)


class FakeSessionStore:
    """In-memory SessionStore with leases (epoch per session) and transactional, fenced flushes.

    Switches: `down` (every flush raises), `fail_next` (the next n flushes raise), `lose_ack_next`
    (the next n flushes commit, then raise: the acknowledgement lost), `hold` (an Event every
    flush waits on before it commits), `activate_hold` (likewise for activate).
    Exactly-once is checked, not assumed: a message seq, turn or tool call written twice is
    recorded in `duplicates` (a unique-constraint violation in Postgres), unless it is the retry
    of a flush whose acknowledgement was lost (which Postgres's ON CONFLICT clauses absorb).
    """

    def __init__(self) -> None:
        self.epochs: dict[Key, int] = {}
        self.owners: dict[Key, str] = {}
        self.snapshots: dict[Key, SessionSnapshot] = {}
        self.variables: dict[Key, dict[str, str]] = defaultdict(dict)
        self.messages: dict[Key, list[MessageRecord]] = defaultdict(list)
        self.turns: dict[Key, dict[str, dict[str, Any]]] = defaultdict(dict)
        self.tool_calls: dict[Key, list[ToolCallRecord]] = defaultdict(list)
        self.events: dict[Key, list[SessionEvent]] = defaultdict(list)
        self.events_reads = 0
        self.usage: dict[Key, dict[str, list[int]]] = defaultdict(dict)
        #: per model, the newest message seq whose tokens are counted (Postgres's ce_usage.applied_seq)
        self.applied_seq: dict[Key, dict[str, int]] = defaultdict(dict)
        #: usage rows skipped as already counted, as Postgres skips them: (key, model, seq)
        self.skipped_usage: list[tuple[Key, str, int]] = []
        self.duplicates: list[str] = []
        # switches
        self.down = False
        self.fail_next = 0
        self.lose_ack_next = 0
        self._unacked: set[tuple[Key, str]] = set()  # rows an ack-lost flush wrote: ("seq 3", "call x", ...)
        self.hold: asyncio.Event | None = None
        self.activate_hold: asyncio.Event | None = None
        # counters
        self.activations: list[tuple[Key, str, int]] = []  # (key, owner, epoch)
        self.flush_calls = 0  # every attempt, failed ones included
        self.failed_flushes = 0
        self.deltas_per_flush: list[int] = []  # committed flushes only
        self.keys_per_flush: list[list[Key]] = []  # likewise, the sessions each one wrote, in order
        self.refused: list[tuple[Key, int]] = []  # (key, stale epoch)
        self.get_turn_calls = 0
        self.flush_entered = asyncio.Event()
        self.activate_entered = asyncio.Event()

    # -- the SessionStore port -----------------------------------------------------------------

    async def activate(self, tenant_id: str, session_id: str, owner: str) -> ActivatedSession:
        key = (tenant_id, session_id)
        self.activate_entered.set()
        if self.activate_hold is not None:
            await self.activate_hold.wait()
        else:
            await asyncio.sleep(0)  # a round trip
        epoch = self.epochs.get(key, 0) + 1
        self.epochs[key] = epoch
        self.owners[key] = owner
        self.activations.append((key, owner, epoch))
        snapshot = self.snapshots.get(key)
        return ActivatedSession(
            tenant_id=tenant_id, session_id=session_id, epoch=epoch,
            snapshot=_copy_snapshot(snapshot) if snapshot is not None else SessionSnapshot(),
            variables=dict(self.variables[key]), history=list(self.messages[key]),
        )

    async def flush(self, deltas: list[SessionDelta]) -> FlushResult:
        self.flush_calls += 1
        self.flush_entered.set()
        if self.hold is not None:
            await self.hold.wait()
        else:
            await asyncio.sleep(0)  # a round trip
        if self.down or self.fail_next > 0:
            self.fail_next = max(0, self.fail_next - 1)
            self.failed_flushes += 1
            raise StoreUnavailable("connection refused")
        written: list[tuple[str, str]] = []
        refused: list[tuple[str, str]] = []
        for delta in deltas:
            key = (delta.tenant_id, delta.session_id)
            if self.epochs.get(key) != delta.epoch:
                refused.append(key)
                self.refused.append((key, delta.epoch))
                continue
            self._apply(key, delta, acked=self.lose_ack_next == 0)
            written.append(key)
        self.deltas_per_flush.append(len(deltas))
        self.keys_per_flush.append([(d.tenant_id, d.session_id) for d in deltas])
        if self.lose_ack_next > 0:
            self.lose_ack_next -= 1
            self.failed_flushes += 1
            raise StoreUnavailable("connection reset after the commit")
        return FlushResult(written=written, refused=refused)

    async def recent_turns(self, tenant_id: str, session_id: str, limit: int) -> dict[str, dict]:
        await asyncio.sleep(0)
        return dict(list(self.turns[(tenant_id, session_id)].items())[-limit:])

    async def events_after(self, tenant_id: str, session_id: str, after: int) -> list[SessionEvent]:
        self.events_reads += 1
        await asyncio.sleep(0)
        return [e for e in self.events[(tenant_id, session_id)] if e.seq > after]

    async def get_turn(self, tenant_id: str, session_id: str, message_id: str) -> dict | None:
        self.get_turn_calls += 1
        await asyncio.sleep(0)
        return self.turns[(tenant_id, session_id)].get(message_id)

    # -- helpers for assertions ----------------------------------------------------------------

    def _apply(self, key: Key, delta: SessionDelta, *, acked: bool = True) -> None:
        seqs = {m.seq for m in self.messages[key]}
        for m in delta.messages:
            if self._retried(key, f"message seq {m.seq}", m.seq in seqs, acked):
                continue  # ON CONFLICT DO NOTHING
            self.messages[key].append(m)
            seqs.add(m.seq)
        self.variables[key].update(delta.variables)
        for t in delta.turns:  # as Postgres keeps them (storage.repos.sessions): the first answer,
            stored = self.turns[key].get(t.message_id)  # unless it was held for approval
            first = stored is not None and "pending_approval" not in stored
            self._retried(key, f"turn {t.message_id}", first, acked)
            if first:
                continue  # the first answer stays
            self.turns[key][t.message_id] = t.response
        ids = {c.id for c in self.tool_calls[key]}
        for c in delta.tool_calls:
            if self._retried(key, f"tool call {c.id}", c.id in ids, acked):
                continue  # ON CONFLICT DO NOTHING
            self.tool_calls[key].append(c)
        known = {e.seq for e in self.events[key]}
        for e in delta.events:
            if self._retried(key, f"event {e.seq}", e.seq in known, acked):
                continue  # ON CONFLICT DO NOTHING
            self.events[key].append(e)
        newest = max((m.seq for m in delta.messages), default=None)
        for u in delta.usage:
            # As storage.repos.sessions does: a row whose seq is not past the model's applied seq
            # is a retry of tokens counted already, and is skipped.
            seq = u.through_seq if u.through_seq is not None else newest
            applied = self.applied_seq[key].get(u.model)
            if seq is not None and applied is not None and applied >= seq:
                self.skipped_usage.append((key, u.model, seq))
                continue
            if seq is not None:
                self.applied_seq[key][u.model] = seq
            acc = self.usage[key].setdefault(u.model, [0, 0])
            acc[0] += u.input_tokens
            acc[1] += u.output_tokens
        self.snapshots[key] = _copy_snapshot(delta.snapshot)

    def _retried(self, key: Key, row: str, stored: bool, acked: bool) -> bool:
        """Whether a row is the retry of one an ack-lost flush wrote (skipped, as Postgres skips
        it). A row stored already otherwise is a duplicate: recorded, and written again so that
        assertions on what is stored see it too."""
        if stored and (key, row) in self._unacked:
            return True
        if stored:
            self.duplicates.append(f"{key} {row}")
        elif not acked:
            self._unacked.add((key, row))
        return False

    def seqs(self, key: Key) -> list[int]:
        return [m.seq for m in self.messages[key]]

    def texts(self, key: Key) -> list[str]:
        """The plain texts stored for a session, in seq order (tool blocks left out)."""
        out = []
        for m in sorted(self.messages[key], key=lambda r: r.seq):
            out += [b["text"] for b in m.content if b.get("type") == "text"]
        return out

    @property
    def commits(self) -> int:
        return len(self.deltas_per_flush)


class RuleModel(StreamScriptedLLM):
    """An LLMClient that answers from the request alone, so concurrent sessions can share it.

    - the last message holds tool results -> text "done: <first result>";
    - the last message is a user text "use <tool> <q>" and <tool> is offered -> one call of it;
    - otherwise -> text "echo: <text>".
    `hold(text)` makes requests for that user text wait until released; `entered(text)` is set
    when one starts. `log` records ("enter"|"exit", text) so overlap is visible.
    """

    def __init__(self) -> None:
        self.requests: list[LLMRequest] = []
        self.log: list[tuple[str, str]] = []
        self._holds: dict[str, asyncio.Event] = {}
        self._entered: dict[str, asyncio.Event] = defaultdict(asyncio.Event)

    def hold(self, text: str) -> asyncio.Event:
        self._holds[text] = asyncio.Event()
        return self._holds[text]

    def entered(self, text: str) -> asyncio.Event:
        return self._entered[text]

    def release_all(self) -> None:
        for hold in self._holds.values():
            hold.set()

    async def stream(self, request: LLMRequest):
        self.requests.append(request)
        last = request.messages[-1]
        results = [b for b in last.content if isinstance(b, ToolResultBlock)]
        texts = [b.text for b in last.content if isinstance(b, TextBlock)]
        text = texts[-1] if texts and not results else ""
        label = text or "<tool results>"
        self.log.append(("enter", label))
        self._entered[label].set()
        try:
            hold = self._holds.get(text)
            if hold is not None:
                await hold.wait()
            else:
                await asyncio.sleep(0)
        finally:
            self.log.append(("exit", label))
        words = text.split()
        offered = {t.name for t in request.tools} if request.tool_choice == "auto" else set()
        if results:
            content: list = [TextBlock(text=f"done: {results[0].content}")]
        elif len(words) >= 2 and words[0] == "use" and words[1] in offered:
            n = len(self.requests)
            q = " ".join(words[2:])
            content = [ToolUseBlock(id=f"toolu_{n}", name=words[1], input={"q": q})]
        else:
            content = [TextBlock(text=f"echo: {text}")]
        for block in content:
            if isinstance(block, TextBlock):
                yield TextDelta(text=block.text)
        yield LLMResponse(
            content=content, usage=Usage(input_tokens=10, output_tokens=3), model=request.model,
            stop_reason="tool_use" if isinstance(content[0], ToolUseBlock) else "end_turn",
        )


OPEN_SCHEMA: dict[str, Any] = {"type": "object", "properties": {"q": {"type": "string"}}}
LOOKUP = PythonTool(name="lookup", description="look things up", parameters=OPEN_SCHEMA, handler="lookup")
#: a one-shot write: once it succeeded the session variable is set and it is not offered again
COLLECT_LEAD = PythonTool(
    name="collect_lead", description="save the contact as a lead", parameters=OPEN_SCHEMA,
    handler="collect_lead", mutability="write", requires_approval=False,
    completes_variable="lead_collected",
)


class FakeHandoffDesk:
    """A HandoffDesk that records each change (the store's rules are the integration tests')."""

    def __init__(self) -> None:
        self.changes: list[tuple[str, str, Any]] = []

    async def claim(self, tenant_id: str, handoff_id: str, agent: str) -> Any:
        self.changes.append(("claim", handoff_id, agent))

    async def resolve(self, tenant_id: str, handoff_id: str, return_to_bot: bool) -> Any:
        self.changes.append(("resolve", handoff_id, return_to_bot))


class FakeTenants:
    """A TenantSource: every tenant gets the same env (RuleModel, lookup + collect_lead).

    `handler_calls` records (session_id, tool, q) for every tool that really ran.
    """

    def __init__(self, model: RuleModel | None = None) -> None:
        self.model = model or RuleModel()
        self.handler_calls: list[tuple[str, str, str]] = []
        registry = self.registry = HandlerRegistry()

        @registry.register("lookup")
        async def lookup(args: dict[str, Any], ctx: TrustedContext) -> Any:
            self.handler_calls.append((ctx.session_id, "lookup", args.get("q", "")))
            return {"found": args.get("q", "")}

        @registry.register("collect_lead")
        async def collect_lead(args: dict[str, Any], ctx: TrustedContext) -> Any:
            self.handler_calls.append((ctx.session_id, "collect_lead", args.get("q", "")))
            return {"lead": "saved"}

        catalog = build_catalog([], [(LOOKUP, 1), (COLLECT_LEAD, 1)], registry=registry, backend=None)
        self.handoffs = FakeHandoffDesk()
        self.env = TurnEnv(
            llm=self.model, executor=Executor(), catalog=catalog, config=BotConfig(),
            main_model="main", cheap_model="cheap", handoffs=self.handoffs,
        )
        self.env_calls = 0
        self.env_hold: asyncio.Event | None = None  # set: env_for waits for it (a slow reload)
        self.env_entered = asyncio.Event()

    async def env_for(self, tenant_id: str) -> TurnEnv:
        self.env_calls += 1
        self.env_entered.set()
        await asyncio.sleep(0)  # a cache lookup may yield (a reload on change reads the database)
        if self.env_hold is not None:
            await self.env_hold.wait()
        return self.env
