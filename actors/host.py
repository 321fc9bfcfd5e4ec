"""The session host: many sessions in one process, one turn at a time each, flushed by group commit.

Plain asyncio with ports (SessionStore, TenantSource); the Ray actor in `actors.ray_host` and the
in-process mode both wrap this class, so both placements run the same session code.

Durable Object semantics, enforced here:
- one activation per session per host (concurrent first touches share one activation), and one
  across hosts through the store's lease epoch: a refused flush evicts the stale copy;
- turns of a session run one after another under its lock; a bounded mailbox beyond that;
- the flusher writes the dirty state of all sessions in one transaction every few milliseconds;
  with the output gate on, a reply is released only once the flush holding it committed. It waits
  the group-commit window only while another turn is running (Postgres's commit_delay with
  commit_siblings = 1): a turn alone on its host is flushed at once;
- Postgres away: deltas go back into their sessions, the flusher retries with backoff and replies
  wait (bounded by `gate_timeout_s`), so nothing acknowledged is ever lost; past `max_unwritten`
  turns held unwritten on the host (`max_unwritten_per_session` in one session), a new turn is
  refused having run nothing (Overloaded 'storage_unavailable'), while a retry of an answer held is
  still answered, until the flusher gets through (`_admit_new_turn`);
- Postgres refusing a session's data for good: its turns are written one by one, those before the
  refused one kept and answered, the rest not acknowledged, and the copy dropped; the other
  sessions of the batch are written as usual;
- the session view, like a reply, shows only durable state while the gate is on (`view`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, runtime_checkable

import msgspec
import structlog

from actors import session as core
from actors.session import SealedTurns, SessionState, TurnEnv
from kernel.errors import ChatEngineError, Overloaded
from kernel.records import ActivatedSession, FlushResult, JobRecord, SessionDelta, SessionEvent
from services import heap
from services.fairshare import FairShare, fair_batch, turn_slot, waiting
from services.wire import (
    AgentMessage,
    ApprovalDecision,
    CheckContact,
    JobFinished,
    SessionCommand,
    SessionView,
    StreamEvent,
    Turn,
    TurnCommand,
    TurnReply,
    TurnTiming,
    UsageOut,
)

log = structlog.get_logger(__name__)

Key = tuple[str, str]


@runtime_checkable
class SessionStore(Protocol):
    async def activate(self, tenant_id: str, session_id: str, owner: str) -> ActivatedSession: ...
    async def flush(self, deltas: list[SessionDelta]) -> FlushResult: ...
    async def get_turn(self, tenant_id: str, session_id: str, message_id: str) -> dict | None: ...
    async def recent_turns(self, tenant_id: str, session_id: str, limit: int) -> dict[str, dict]: ...
    async def events_after(self, tenant_id: str, session_id: str, after: int) -> list[SessionEvent]: ...


@runtime_checkable
class JobSource(Protocol):
    async def finished(self, tenant_id: str, session_id: str, job_ids: list[str]) -> list[JobRecord]: ...


@runtime_checkable
class TenantSource(Protocol):
    async def env_for(self, tenant_id: str) -> TurnEnv:
        """The catalog, config and ports for a tenant's turns (cached; reloaded on change)."""
        ...


class LeaseLost(ChatEngineError):
    """Another activation of this session took over; this copy's writes were refused."""


class SessionMoved(Overloaded):
    """This host does not own the session under its shard view (a rescale moved it, or the
    caller routed by an older count); nothing ran. The caller routes again and retries."""

    def __init__(self, session_id: str) -> None:
        super().__init__(
            f"session {session_id!r} is moving to another session host; retry in a moment",
            retry_after=0.05, reason="moved",
        )


#: how long stop() waits for admitted turns beyond the gate timeout before it stops anyway
STOP_GRACE_S = 5.0

#: unwritten turns (run, their state not yet in Postgres) a host holds, per turn it may admit at
#: once (HostSettings.max_inflight), before it refuses new turns ('storage_unavailable', a 503). A
#: host whose flushes succeed holds only the turns waiting at its gate, at most max_inflight, so it
#: never gets there; one whose flushes keep failing would otherwise go on running every new message
#: (model calls, tools with side effects) and keep what each did in memory for as long as Postgres
#: stays away
UNWRITTEN_PER_INFLIGHT = 2
#: unwritten turns one session may hold before its new messages are refused likewise: one client
#: sending on through an outage must not take its host's whole allowance, and the session's turn
#: cache, which keeps every unwritten answer beyond its latest TURN_CACHE (SessionState.cache_turn),
#: stays at most twice that size
MAX_UNWRITTEN_PER_SESSION = core.TURN_CACHE
#: when a turn refused for unwritten turns is worth sending again: about the flusher's longest backoff
STORAGE_RETRY_AFTER_S = 2.0


class HostSettings(msgspec.Struct, frozen=True, kw_only=True):
    idle_seconds: float = 300.0
    output_gate: bool = True
    flush_interval_s: float = 0.005
    gate_timeout_s: float = 30.0
    mailbox: int = 16  # turns queued per session beyond the running one
    max_inflight: int = 5000  # turns admitted at once per host; beyond: 503 (admission control)
    max_backoff_s: float = 2.0
    #: live sessions a host keeps; beyond, the least recently used idle ones are passivated early
    max_sessions: int = 10_000
    #: unwritten turns a host holds before it refuses new ones; 0: UNWRITTEN_PER_INFLIGHT x max_inflight
    max_unwritten: int = 0
    max_unwritten_per_session: int = MAX_UNWRITTEN_PER_SESSION  # likewise, of one session
    #: turns computing at once, the next slot to the tenant with the fewest (services.fairshare); 0: no bound
    cpu_slots: int = 8
    #: sessions written per transaction, every tenant in turn (services.fairshare.fair_batch); 0: all
    flush_batch: int = 64

    @classmethod
    def from_settings(cls, settings: Any) -> HostSettings:
        """From the engine's Settings (services.settings): what a host process runs with."""
        return cls(
            idle_seconds=settings.idle_seconds, output_gate=settings.output_gate,
            flush_interval_s=settings.flush_interval_ms / 1000,
            max_inflight=settings.host_max_inflight, max_sessions=settings.host_max_sessions,
            max_unwritten=settings.host_max_unwritten,
            max_unwritten_per_session=settings.host_max_unwritten_per_session,
            cpu_slots=settings.host_cpu_slots, flush_batch=settings.host_flush_batch,
        )


#: the newest written events a host keeps in memory per watched session, so that a push costs its
#: watchers no read of Postgres (one far behind reads the log from Postgres instead)
FEED_KEPT = 256
#: how long a host keeps what it knows of a session nobody watches any more: a watcher asks again
#: right after each wait, and must not cost a read of Postgres each time
FEED_IDLE_S = 60.0


class _Feed:
    """A watched session's newest written events on this host, and the bell its watchers wait on.

    `recent` holds events with consecutive numbers (a gap, as after the session moved away and
    back, empties it first), so any watcher whose last event is at or after the first one's
    predecessor is served from memory. `latest` is the newest number known written (pushed, or
    the store had nothing after it), so a watcher that has it waits without a read. Both are
    forgotten when the session is activated again: another host may have written meanwhile. The
    bell is a future resolved (and replaced) at each push. `recent` is made at the first push: most
    watched sessions are quiet, and an empty deque of this size is 760 bytes.
    """

    __slots__ = ("bell", "idle_since", "latest", "recent", "watchers")

    def __init__(self) -> None:
        self.recent: collections.deque[SessionEvent] | None = None
        self.latest: int | None = None
        self.bell: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.watchers = 0
        self.idle_since = time.monotonic()

    def after(self, seq: int) -> list[SessionEvent] | None:
        """The kept events after `seq`, or None when memory cannot say (ask the store)."""
        if self.recent and seq >= self.recent[0].seq - 1:
            return [] if seq >= self.recent[-1].seq else [e for e in self.recent if e.seq > seq]
        if not self.recent and self.latest is not None and seq >= self.latest:
            return []
        return None

    def push(self, events: list[SessionEvent]) -> None:
        if self.recent is None:
            self.recent = collections.deque(maxlen=FEED_KEPT)
        elif self.recent and events[0].seq != self.recent[-1].seq + 1:
            self.recent.clear()
        self.recent.extend(events)
        self.latest = events[-1].seq
        self.ring()

    def forget(self) -> None:
        self.recent = None
        self.latest = None
        self.ring()

    def ring(self) -> None:
        bell, self.bell = self.bell, asyncio.get_running_loop().create_future()
        bell.set_result(None)


async def _rung_within(bell: asyncio.Future[None], timeout: float) -> bool:
    """Whether the bell rings within `timeout` seconds. The bell is shared by every watcher of the
    session, so it is waited on, never cancelled; a waiter costs a future, a callback and a timer
    (asyncio.wait_for over asyncio.shield cost twice that, and an idle watcher waits all the time)."""
    if bell.done():
        return True
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()
    wake = functools.partial(_wake, waiter)
    bell.add_done_callback(wake)
    timer = loop.call_later(timeout, _wake, waiter, None)
    try:
        await waiter
    finally:
        timer.cancel()
        bell.remove_done_callback(wake)
    return bell.done()


def _wake(waiter: asyncio.Future[None], _bell: object) -> None:
    if not waiter.done():
        waiter.set_result(None)


class _Entry:
    __slots__ = ("counted", "durable_through", "last_used", "lock", "new_turn", "queued", "stale", "state")

    def __init__(self, state: SessionState) -> None:
        self.state = state
        self.lock = asyncio.Lock()
        self.last_used = time.monotonic()
        self.queued = 0
        #: a flush of this copy was refused (a newer activation owns the session, or Postgres
        #: refused its data for good): it is dropped, and what it holds beyond
        #: `durable_through` will never be written
        self.stale = False
        self.durable_through = 0  # the number of its newest turn known written (state.sealed_turns)
        self.counted = 0  # its unwritten turns as the host's total counts them (`_count_unwritten`)
        #: the turn running now is a new one let in past the unwritten-turn caps (`_admit_new_turn`)
        self.new_turn = False


class SessionHost:
    def __init__(
        self, *, name: str, store: SessionStore, tenants: TenantSource, settings: HostSettings | None = None,
        on_flush: Callable[[int, float], None] | None = None, jobs: JobSource | None = None,
    ) -> None:
        self.name = name
        self._jobs = jobs
        self.owner = f"{name}:{os.getpid()}"
        self._store = store
        self._tenants = tenants
        self._settings = settings or HostSettings()
        self._sessions: dict[Key, _Entry] = {}
        self._activating: dict[Key, asyncio.Future[_Entry]] = {}
        self._dirty: dict[Key, None] = {}  # sessions to write, in the order they asked
        self._inflight: set[Key] = set()  # sessions whose delta is in the flush now running
        #: per session, who waits for its turns to be durable: (the number of the newest turn
        #: waited for, state.sealed_turns when it began waiting; the future resolved then)
        self._waiters: dict[Key, list[tuple[int, asyncio.Future[None]]]] = {}
        self._wake = asyncio.Event()
        self._flush_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task] = []
        self._closing = False
        self._on_flush = on_flush
        self._running = 0
        #: turns admitted per tenant; one tenant may hold at most half the host's admission
        self._tenant_running: dict[str, int] = {}
        self._share = FairShare(self._settings.cpu_slots)
        self._tenant_share = max(1, self._settings.max_inflight // 2)
        self._busy = 0  # turns running their session's code now (not queued, not at the gate)
        self._none_busy = asyncio.Event()  # set while _busy is 0: the group-commit window may end
        self._none_busy.set()
        self._drained = asyncio.Event()  # set while no admitted turn is out (stop() waits for it)
        self._drained.set()
        #: the task running each session's turn now (its session code, not its gate), so that a
        #: stop() that waited long enough can cancel the turns stuck in a model or tool call
        self._turn_tasks: dict[Key, asyncio.Task] = {}
        self._cancelled_by_stop: set[asyncio.Task] = set()
        #: which sessions this host may hold (sharded hosts: its shard under the current view);
        #: None: every session (dedicated actors, the in-process router)
        self._owns: Callable[[str, str], bool] | None = None
        #: turns run and not known written, over the live sessions (their `counted`), and the new
        #: turns let in past the caps and running now (each about to add one): see `_admit_new_turn`
        self._unwritten = 0
        self._starting = 0
        self._unwritten_cap = (self._settings.max_unwritten
                               or UNWRITTEN_PER_INFLIGHT * self._settings.max_inflight)
        self._refusing = False  # turned new turns away at the host's cap since it last had room (logs)
        self.flushes = 0
        self.flushed_sessions = 0
        self.last_flush_ms = 0.0
        self.activations = 0
        #: reads of a stored answer for a message id the session's turn cache did not hold
        #: (a client's id in a session of more than TURN_CACHE turns; gateway-made ids need none)
        self.stored_turn_reads = 0
        #: the sessions someone watches (GET .../events), by key: see `watch`
        self._feeds: dict[Key, _Feed] = {}
        #: how long recent activations of sessions with a past took (Postgres lease + state
        #: load): the cost of coming back after passivation, reported by the benchmark
        self.reactivation_ms: collections.deque[float] = collections.deque(maxlen=4096)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._flusher(), name=f"{self.name}-flusher"),
            asyncio.create_task(self._sweeper(), name=f"{self.name}-sweeper"),
        ]

    async def stop(self) -> None:
        """Wait for running turns, flush everything, stop background work.

        From the moment this is called no turn starts: one admitted before but not yet running
        (waiting for its session's lock, its activation or its tenant) is turned away having run
        nothing. Every admitted turn is out before the flusher stops, so none runs its tools on
        state that could no longer be saved (a retry on the next host would run them again).

        Bounded: admitted turns get `gate_timeout_s` + STOP_GRACE_S to leave (one leaves within
        the gate timeout, replied or told its reply could not be saved yet). Past that something
        is stuck (a model or tool call that never answers) and stopping matters more: the turns
        still running their session code are cancelled, which keeps and writes what each did, as
        for any turn that fails half way, and answers each with Overloaded ('shutting_down');
        no answer is stored for its message id, so sent again it runs anew. A session still
        locked STOP_GRACE_S after that (a turn that ignores its cancellation) is left as it is:
        nothing of its running turn was acknowledged. Then everything else is flushed.
        """
        self._closing = True
        for feed in self._feeds.values():  # watchers come back at once, to ask the next host
            feed.ring()
        # Bounded: an admitted turn leaves within the gate timeout (replied, or told its reply
        # could not be saved yet); past that something is stuck, and stopping matters more.
        deadline = time.monotonic() + self._settings.gate_timeout_s + STOP_GRACE_S
        pause = 0.05
        while not self._drained.is_set():
            if time.monotonic() > deadline:
                log.error("stop_gave_up_waiting", turns=self._running, cancelled=len(self._turn_tasks))
                for task in self._turn_tasks.values():
                    self._cancelled_by_stop.add(task)
                    task.cancel()
                break
            try:  # now, not after the group-commit window: admitted turns wait on their gate
                await self.flush_all()
                pause = 0.05
            except Exception as exc:  # noqa: BLE001 - the gate times such turns out; try again
                log.warning("flush_failed", error=type(exc).__name__, during="stop", retry_in_s=pause)
                pause = min(pause * 2, 1.0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained.wait(), pause)
        # A session's lock is also held while it is passivated or handed over (flushing it), and
        # by a cancelled turn until it has closed what it did: wait for those, bounded too.
        grace = time.monotonic() + STOP_GRACE_S
        for key, entry in list(self._sessions.items()):
            try:
                async with asyncio.timeout(max(0.0, grace - time.monotonic())):
                    await entry.lock.acquire()
            except TimeoutError:
                log.error("stop_left_session_locked", session_id=key[1])
                continue
            entry.lock.release()
        try:
            await self.flush_all()
        finally:
            for task in self._tasks:
                task.cancel()
            for task in self._tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    @property
    def live_sessions(self) -> int:
        return len(self._sessions)

    # -- ownership (sharded hosts across a change of shard count) ------------------------------

    def set_ownership(self, owns: Callable[[str, str], bool] | None) -> None:
        """From now on hold and serve only sessions for which `owns(tenant_id, session_id)`;
        call `release_unowned()` next to drop the ones already cached."""
        self._owns = owns

    def owns(self, tenant_id: str, session_id: str) -> bool:
        return self._owns is None or self._owns(tenant_id, session_id)

    async def release_unowned(self) -> int:
        """Flush and drop every cached session this host no longer owns; returns how many.

        Waits for a session's running turn (it finishes here and is flushed with the rest);
        turns queued behind it find the session gone and are refused with SessionMoved. Once
        this returns, no state of a moved session is left in this host's memory, so its new
        host may activate it, and if it ever moves back it is activated again from Postgres.
        """
        released = 0
        for key in [k for k in self._feeds if not self.owns(*k)]:
            self._feeds.pop(key).ring()  # its watchers are told it moved, and ask its new host
        for key, entry in list(self._sessions.items()):
            if self.owns(*key):
                continue
            async with entry.lock:
                await self._release(key, entry)
            released += 1
        return released

    async def _release(self, key: Key, entry: _Entry) -> None:
        # Called with entry.lock held. In flight counts as unsaved, as in passivate().
        if entry.state.dirty or key in self._inflight:
            with contextlib.suppress(LeaseLost):  # refused: a newer activation owns it; already evicted
                await self._mark_dirty(key)
        if self._sessions.get(key) is entry:
            del self._sessions[key]
        self._count_unwritten(key, entry)

    def stats(self) -> dict[str, Any]:
        paused, longest = heap.PAUSES.read()
        return {
            "host": self.name, "live_sessions": len(self._sessions), "flushes": self.flushes,
            "flushed_sessions": self.flushed_sessions, "last_flush_ms": self.last_flush_ms,
            "dirty": len(self._dirty), "activations": self.activations,
            "watched_sessions": len(self._feeds), "watchers": self.watchers,
            "stored_turn_reads": self.stored_turn_reads,
            # run, not yet written (Postgres away): at the cap, new turns are refused
            "unwritten_turns": self._unwritten, "unwritten_turns_cap": self._unwritten_cap,
            "reactivation_p50_ms": _percentile(self.reactivation_ms, 50),
            "reactivation_p99_ms": _percentile(self.reactivation_ms, 99),
            "gc_collections": heap.collections(),  # the process's, every generation
            # the process's collector pauses (measured once tune_collector ran: server processes)
            "gc_pause_s_total": paused, "gc_pause_longest_s": longest,
            # turns waiting now for a compute slot, and those that waited MAX_WAIT_S and ran over the bound
            "share_waiting": self._share.waiting(), "share_overruns": self._share.overruns,
        }

    # -- turns ------------------------------------------------------------------------------

    async def send(self, turn: Turn, emit: core.Emit | None = None, *, new_id: bool = False) -> TurnReply:
        """Run one message; returns once its state is durable (output gate on). `emit` gets the
        turn's events as they come (None: nobody watches it stream).

        `new_id`: the caller made `turn.message_id` up for this very call (the gateway does when
        the client sent none), so no stored answer can have it and none is looked up. A retry of
        the call may repeat it: a retry passes False.
        """
        message_id = turn.message_id

        async def run(entry: _Entry, env: TurnEnv) -> TurnReply:
            state = entry.state
            state.identify(env.contacts, turn.contact_token)  # before even a stored answer is given
            if message_id and not new_id:
                await self._load_turn(state, message_id)
            if state.answered(message_id):  # a retry answered from what is held: nothing runs
                return await core.handle_message(state, turn.text, message_id, env, emit)
            self._admit_new_turn(entry)
            finished: list[JobRecord] = []
            waiting = state.waiting_jobs()
            if waiting and self._jobs is not None:
                finished = await self._jobs.finished(turn.tenant_id, turn.session_id, waiting)
            return await core.handle_message(state, turn.text, message_id, env, emit, finished_jobs=finished)

        return await self._turn(turn.tenant_id, turn.session_id, run)

    async def decide(self, decision: ApprovalDecision, emit: core.Emit | None = None) -> TurnReply:
        """Resume the turn held for `decision.approval_id` (or replay the answer of one decided
        before); returns once its state is durable, as `send` does."""

        async def run(entry: _Entry, env: TurnEnv) -> TurnReply:
            state = entry.state
            state.identify(env.contacts, decision.contact_token)
            decided = state.decided_turn(decision.approval_id)
            if decided is not None:  # asked again: its answer is replayed, from Postgres if need be
                await self._load_turn(state, decided)
            elif state.holds_approval:  # resumed, it runs tools or the model
                self._admit_new_turn(entry)
            return await core.handle_approval(state, decision.approval_id, decision.approve, env, emit,
                                              edited_arguments=decision.edited)

        return await self._turn(decision.tenant_id, decision.session_id, run)

    async def act(self, command: SessionCommand) -> TurnReply:
        """Run a command that is not a contact's turn (an agent's message, a handoff's change) in
        the session, in turn with its messages; returns once its state is durable, as `send`."""

        async def run(entry: _Entry, env: TurnEnv) -> TurnReply:
            if isinstance(command, CheckContact):
                entry.state.identify(env.contacts, command.contact_token, bind=False)
                return TurnReply(session_id=command.session_id, message_id="", reply="", tool_calls=[], rounds=0,
                                 usage=UsageOut())
            if isinstance(command, JobFinished):
                state = entry.state
                finished: list[JobRecord] = []
                if command.job_id in state.waiting_jobs() and self._jobs is not None:
                    finished = await self._jobs.finished(command.tenant_id, command.session_id, [command.job_id])
                if finished:
                    self._admit_new_turn(entry)  # it may run the model
                return await core.handle_job_finished(state, command, env, finished)
            if isinstance(command, AgentMessage):
                if command.message_id:
                    await self._load_turn(entry.state, command.message_id)
                return core.handle_agent_message(entry.state, command)
            # the store first (it refuses what the handoff's state does not allow, and notifies the
            # tenant), then the session follows; the same change again is a no-op on both
            if env.handoffs is None:
                raise core.SessionError("this engine process cannot change handoffs", kind="internal")
            if command.state == "assigned":
                await env.handoffs.claim(command.tenant_id, command.handoff_id, command.agent or "")
            else:
                await env.handoffs.resolve(command.tenant_id, command.handoff_id, bool(command.return_to_bot))
            return core.handle_handoff_change(entry.state, command)

        return await self._turn(command.tenant_id, command.session_id, run)

    async def watch(self, tenant_id: str, session_id: str, after: int, wait_s: float) -> list[SessionEvent]:
        """The session's written events after number `after`, oldest first; when there are none
        yet, waits up to `wait_s` for the next ones (then an empty list: ask again).

        Pushed, not polled: the flusher rings the session's bell once a flush holding its events
        committed (`_publish`), so an event reaches its watchers only once it is durable. Served
        from memory when this host has pushed the events asked for, from Postgres otherwise (a
        watcher coming back after a host restart, a rescale or passivation): no event is skipped
        or given twice, since the watcher names the last one it has. Only the session's owner can
        push its events: a host that does not own it says SessionMoved, as for a turn."""
        self._refuse_if_closing()
        if not self.owns(tenant_id, session_id):
            raise SessionMoved(session_id)
        key = (tenant_id, session_id)
        feed = self._feeds.get(key)
        if feed is None:
            feed = self._feeds[key] = _Feed()
        feed.watchers += 1
        deadline = time.monotonic() + wait_s
        try:
            while True:
                if not self.owns(tenant_id, session_id):
                    raise SessionMoved(session_id)
                bell = feed.bell  # taken before reading: a push after the read rings it
                events = feed.after(after)
                if events is None:
                    events = await self._store.events_after(tenant_id, session_id, after)
                    if not events and self._feeds.get(key) is feed and (feed.latest or 0) < after:
                        feed.latest = after  # nothing after it is written: the next ask needs no read
                if events:
                    return events
                left = deadline - time.monotonic()
                if left <= 0 or self._closing:
                    return []
                if not await _rung_within(bell, left):
                    return []
        finally:
            feed.watchers -= 1
            if not feed.watchers:
                feed.idle_since = time.monotonic()  # kept FEED_IDLE_S for the watcher's next ask

    def wake(self, tenant_id: str, session_id: str, job_id: str) -> None:
        """A job of the session finished in this process (a workflow run by the engine): run
        its result in the session now (`act`), in the background; a failure leaves the result
        waiting for the contact's next message."""
        task = asyncio.create_task(self._wake(JobFinished(tenant_id=tenant_id, session_id=session_id, job_id=job_id)))
        self._tasks.append(task)
        task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)

    async def _wake(self, command: JobFinished) -> None:
        try:
            await self.act(command)
        except Exception as exc:  # noqa: BLE001 - the result still reaches the next turn
            log.info("job_wake_failed", session_id=command.session_id, error=type(exc).__name__)

    def _publish(self, key: Key, events: list[SessionEvent]) -> None:
        """Events of `key` just written: to its watchers on this host, if any."""
        feed = self._feeds.get(key)
        if feed is not None and events:
            feed.push(events)

    @property
    def watched_sessions(self) -> int:
        """Sessions someone watches now, or did within FEED_IDLE_S."""
        return len(self._feeds)

    @property
    def watchers(self) -> int:
        """Watchers waiting on this host now."""
        return sum(f.watchers for f in self._feeds.values())

    def drop_idle_feeds(self, cutoff: float) -> int:
        """Forget the sessions nobody has watched since `cutoff` (monotonic); returns how many."""
        idle = [k for k, f in self._feeds.items() if not f.watchers and f.idle_since < cutoff]
        for key in idle:
            del self._feeds[key]
        return len(idle)

    async def _load_turn(self, state: SessionState, message_id: str) -> None:
        """Put turn `message_id`'s stored answer in the session's cache if it may be missing there
        (only when the cache may have dropped it: most turns cost no read here)."""
        if not state.may_have_dropped(message_id):
            return
        self.stored_turn_reads += 1
        stored = await self._store.get_turn(state.tenant_id, state.session_id, message_id)
        if stored is not None:
            state.cache_turn(message_id, stored)

    async def stream(self, command: TurnCommand, *, new_id: bool = False) -> AsyncIterator[StreamEvent]:
        """The same turn as events: text deltas, tool calls and results, then `done`; a turn that
        fails raises its error once the events before it are out, as `send` would.

        The turn runs to completion and is stored even when the consumer goes away.
        """
        queue: asyncio.Queue[StreamEvent | None] = asyncio.Queue()
        failed: list[Exception] = []

        async def emit(event: StreamEvent) -> None:
            queue.put_nowait(event)

        async def run() -> None:
            try:
                if isinstance(command, ApprovalDecision):
                    reply = await self.decide(command, emit)
                else:
                    reply = await self.send(command, emit, new_id=new_id)
                queue.put_nowait(StreamEvent(event="done", data=msgspec.to_builtins(reply)))
            except Exception as exc:
                if not isinstance(exc, ChatEngineError):
                    log.exception("turn_failed", session_id=command.session_id)
                failed.append(exc)  # raised to the consumer, if one is still there
            finally:
                queue.put_nowait(None)

        task = asyncio.create_task(run())
        self._tasks.append(task)
        task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)
        while (event := await queue.get()) is not None:
            yield event
        if failed:
            raise failed[0]

    async def view(self, tenant_id: str, session_id: str) -> SessionView | None:
        """The session as this host holds it (GET /v1/sessions/{id}), or None when it holds none
        that may be shown: the caller then reads the stored session.

        With the output gate on only durable state is shown, as only a durable reply is released:
        whole turns not written yet are waited for as a reply waits for them, at most
        `gate_timeout_s` (then Overloaded 'unsaved', a 503 with Retry-After saying to retry).
        While a turn is half way, the cached state holds half a turn, which may never be written
        (the host may die): None, and what Postgres holds is every turn acknowledged so far.
        Without the gate (lossy, for benchmarks) the cached state is shown as it is.
        """
        key = (tenant_id, session_id)
        entry = self._sessions.get(key)
        if entry is None or entry.stale:
            return None
        if not self._settings.output_gate or self._saved(key, entry):
            return entry.state.view()
        if entry.state.turn_half_done:
            return None
        durable = self._mark_dirty(key)
        try:
            await self._until_durable(key, durable)
        except TimeoutError:
            raise Overloaded(
                f"session {session_id!r} has changes that could not be saved yet (database "
                "unavailable); retry in a moment", retry_after=2.0, reason="unsaved",
            ) from None
        except ChatEngineError:  # refused for good or taken over: this copy was dropped
            return None
        # A newer turn may have changed it while this waited: then the stored session.
        if self._sessions.get(key) is not entry or not self._saved(key, entry):
            return None
        return entry.state.view()

    def _saved(self, key: Key, entry: _Entry) -> bool:
        """Everything this copy of the session holds is written (nothing unsaved or in flight)."""
        return not entry.stale and not entry.state.dirty and key not in self._inflight

    def _refuse_if_closing(self) -> None:
        if self._closing:
            raise Overloaded("this session host is shutting down; retry in a moment", retry_after=1.0,
                             reason="shutting_down")

    def _admit_new_turn(self, entry: _Entry) -> None:
        """Let a new turn of `entry`'s session run (called with its lock held, once no answer held
        for its message id, written or not, is there to replay), or refuse it, Overloaded
        'storage_unavailable' (a 503 with Retry-After), having run nothing: when the session holds
        `max_unwritten_per_session` turns not yet written, or the host `max_unwritten` counting
        the new turns running now. Postgres is away then (or was long enough for that many to pile
        up): a turn run now calls the model and runs tools whose results cannot be stored, and
        holds them in memory for as long as the outage lasts. What is held is kept and written
        once the flusher gets through; the count falls and new turns are let in again."""
        held = entry.state.sealed_turns - entry.durable_through
        if held >= self._settings.max_unwritten_per_session:
            raise Overloaded(
                f"session {entry.state.session_id!r} has {held} turns whose state could not be saved yet "
                "(database unavailable), the most one session may have; this message was not run (nothing "
                "of it happened): send it again in a moment", retry_after=STORAGE_RETRY_AFTER_S,
                reason="storage_unavailable",
            )
        pending = self._unwritten + self._starting
        if pending >= self._unwritten_cap:
            if not self._refusing:
                self._refusing = True
                log.warning("unwritten_turns_at_cap", unwritten=self._unwritten, running=self._starting,
                            cap=self._unwritten_cap)
            raise Overloaded(
                f"this session host holds {pending} turns whose state could not be saved yet (database "
                "unavailable), the most it may hold; this message was not run (nothing of it happened): "
                "send it again in a moment", retry_after=STORAGE_RETRY_AFTER_S,
                reason="storage_unavailable",
            )
        entry.new_turn = True
        self._starting += 1

    def _count_unwritten(self, key: Key, entry: _Entry) -> None:
        """Bring the host's count of unwritten turns up to date with this copy of a session: its
        turns run and not known written, or none once it is not held here any more (written and
        passivated, or stale: it never will be). After each turn and each flush."""
        held = 0
        if self._sessions.get(key) is entry and not entry.stale:
            held = max(0, entry.state.sealed_turns - entry.durable_through)
        self._unwritten += held - entry.counted
        entry.counted = held
        if self._refusing and self._unwritten + self._starting < self._unwritten_cap:
            self._refusing = False
            log.info("unwritten_turns_below_cap", unwritten=self._unwritten, cap=self._unwritten_cap)

    async def _turn(
        self, tenant_id: str, session_id: str, run: Callable[[_Entry, TurnEnv], Awaitable[TurnReply]]
    ) -> TurnReply:
        self._refuse_if_closing()
        if self._running >= self._settings.max_inflight:
            # Admission control, as a Durable Object answers "overloaded": shed before queueing.
            raise Overloaded(
                f"this session host is at capacity ({self._running} turns in progress); retry shortly",
                retry_after=1.0, reason="host_busy",
            )
        mine = self._tenant_running.get(tenant_id, 0)
        if mine >= self._tenant_share:
            # No tenant takes more than its share of a host: session ids are the tenant's to pick,
            # so one tenant could aim every turn at one host and have every other tenant on it
            # refused; past its share it is told to slow down (429), the others still get in.
            raise Overloaded(
                f"this tenant has {mine} turns in progress on this session host, the most one tenant "
                "may have there; wait for replies, then retry", retry_after=1.0, reason="tenant_concurrency",
            )
        started = time.perf_counter()
        self._running += 1
        self._tenant_running[tenant_id] = mine + 1
        self._drained.clear()
        try:
            # a fair share of the loop from here: activation, the turn, its reply (services.fairshare)
            async with turn_slot(self._share, tenant_id) as hold:
                reply, gate_s = await self._admitted_turn(tenant_id, session_id, run)
        finally:
            self._running -= 1
            left = self._tenant_running[tenant_id] - 1
            if left:
                self._tenant_running[tenant_id] = left
            else:
                del self._tenant_running[tenant_id]
            if not self._running:
                self._drained.set()
        # A copy: the answer stored for a repeated message id stays as the session code made it.
        return msgspec.structs.replace(reply, timing=TurnTiming(
            host_ms=round((time.perf_counter() - started) * 1000, 2), gate_ms=round(gate_s * 1000, 2),
            share_ms=round(hold.waited_s * 1000, 2), model_ms=round(hold.away_s.get("model", 0.0) * 1000, 2),
            upstream_ms=round(hold.away_s.get("upstream", 0.0) * 1000, 2)))

    async def _admitted_turn(
        self, tenant_id: str, session_id: str, run: Callable[[_Entry, TurnEnv], Awaitable[TurnReply]]
    ) -> tuple[TurnReply, float]:
        """The turn's reply, and the seconds it waited at the output gate."""
        key = (tenant_id, session_id)
        self._refuse_if_closing()
        if not self.owns(tenant_id, session_id):
            raise SessionMoved(session_id)
        entry = await self._entry(key)
        env = await self._tenants.env_for(tenant_id)
        # Checked and counted with no await in between, or a flood passes the check all at once.
        if entry.queued >= self._settings.mailbox:
            raise Overloaded(
                f"too many messages waiting for session {session_id!r}; wait for the replies, then retry",
                retry_after=1.0, reason="mailbox",
            )
        entry.queued += 1
        try:
            async with waiting():  # behind the session's running turn, which needs a slot to finish
                await entry.lock.acquire()
        finally:
            entry.queued -= 1
        try:
            self._refuse_if_closing()  # stop() began while this turn waited: run nothing
            evicted = self._sessions.get(key) is not entry
            if not evicted and not self.owns(tenant_id, session_id):
                # The shard view changed while this turn waited (or while the session was being
                # activated): run nothing here; hand the session over flushed.
                await self._release(key, entry)
                raise SessionMoved(session_id)
            if not evicted:
                structlog.contextvars.bind_contextvars(tenant_id=tenant_id, session_id=session_id)
                self._busy += 1
                self._none_busy.clear()
                task = asyncio.current_task()
                if task is not None:
                    self._turn_tasks[key] = task
                try:
                    reply = await run(entry, env)
                except BaseException as exc:
                    try:  # what ran is kept, made whole, and written without waiting for a next turn
                        entry.state.close_failed_turn()
                    except Exception:  # the turn's own error is the one to raise
                        log.exception("failed_turn_not_closed", session_id=session_id)
                    if entry.state.dirty:
                        self._queue_flush(key)
                    if isinstance(exc, asyncio.CancelledError) and task in self._cancelled_by_stop:
                        # stop() gave up waiting for it: the caller is told, not cancelled
                        task.uncancel()
                        raise Overloaded(
                            "this session host stopped while the turn was still running (a model "
                            "or tool call did not answer in time); what it did is kept; send the "
                            "message again in a moment", retry_after=1.0, reason="shutting_down",
                        ) from None
                    raise
                finally:
                    self._turn_tasks.pop(key, None)
                    self._cancelled_by_stop.discard(task)  # type: ignore[arg-type]
                    self._busy -= 1
                    if not self._busy:
                        self._none_busy.set()
                    if entry.new_turn:  # what it sealed (or, failed, what close_failed_turn did) counts now
                        entry.new_turn = False
                        self._starting -= 1
                    self._count_unwritten(key, entry)
                entry.last_used = time.monotonic()
                if entry.stale:  # taken over while it ran: this copy's state will never be written
                    raise _lease_lost(session_id)
                # Also when clean but in flight: a replayed answer is released only once durable.
                unsaved = entry.state.dirty or key in self._inflight
                durable = None
                if unsaved and self._settings.output_gate:
                    durable = self._mark_dirty(key)
                elif unsaved:  # no gate: nobody waits, so no future is left for the flush to resolve
                    self._queue_flush(key)
                upto = entry.state.sealed_turns  # the newest turn this reply reports
        finally:
            entry.lock.release()
        if evicted:  # passivated or taken over while we waited: activate again
            return await self._admitted_turn(tenant_id, session_id, run)
        gate_s = 0.0
        if durable is not None:
            gated = time.perf_counter()
            try:
                async with waiting():  # the flush's work, not this turn's
                    await self._until_durable(key, durable)
            except TimeoutError:
                raise Overloaded(
                    "the reply is ready but could not be saved yet (database unavailable); "
                    "retry with the same message_id to get it (sent without one: the X-Message-Id "
                    "header of this answer)",
                    retry_after=2.0, reason="unsaved",
                ) from None
            if entry.stale and entry.durable_through < upto:
                # evicted before its turn was taken: the flush that resolved us did not write it
                raise _lease_lost(session_id)
            gate_s = time.perf_counter() - gated
        return reply, gate_s

    # -- activation and passivation ---------------------------------------------------------

    async def _entry(self, key: Key) -> _Entry:
        entry = self._sessions.get(key)
        if entry is not None:
            return entry
        pending = self._activating.get(key)
        if pending is not None:
            async with waiting():
                return await asyncio.shield(pending)
        future: asyncio.Future[_Entry] = asyncio.get_running_loop().create_future()
        self._activating[key] = future
        started = time.perf_counter()
        try:
            async with waiting():  # Postgres's work: other turns compute meanwhile
                activated = await self._store.activate(key[0], key[1], self.owner)
            state = SessionState(activated)
            if activated.history:
                recent = activated.recent_turns  # read with the state: no round trip of its own
                if recent is None:
                    async with waiting():
                        recent = await self._store.recent_turns(key[0], key[1], core.TURN_CACHE + 1)
                state.load_turns(recent, complete=len(recent) <= core.TURN_CACHE)
            entry = _Entry(state)
            self._sessions[key] = entry
            self.activations += 1
            feed = self._feeds.get(key)
            if feed is not None:  # another host may have written its events meanwhile
                feed.forget()
            if activated.history:
                self.reactivation_ms.append((time.perf_counter() - started) * 1000)
            future.set_result(entry)
            log.debug("session_activated", session_id=key[1], epoch=activated.epoch)
            return entry
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: waiters re-raise it
            raise
        finally:
            del self._activating[key]

    async def passivate(self, tenant_id: str, session_id: str) -> bool:
        """Flush a session and drop it from memory; False when it is busy."""
        key = (tenant_id, session_id)
        entry = self._sessions.get(key)
        if entry is None:
            return True
        if entry.lock.locked() or entry.queued:
            return False
        async with entry.lock:
            # In flight counts as unsaved: if that flush fails its delta comes back to this entry.
            if entry.state.dirty or key in self._inflight:
                await self._mark_dirty(key)
            if self._sessions.get(key) is entry:
                del self._sessions[key]
            self._count_unwritten(key, entry)
        return True

    async def passivate_all(self) -> int:
        n = 0
        for key in list(self._sessions):
            n += await self.passivate(*key)
        return n

    async def _sweeper(self) -> None:
        idle = self._settings.idle_seconds
        while True:
            await asyncio.sleep(max(0.05, min(idle / 4, 5.0)))
            await self.sweep(time.monotonic() - idle)
            self.drop_idle_feeds(time.monotonic() - FEED_IDLE_S)

    async def sweep(self, cutoff: float) -> int:
        """Passivate the sessions unused since `cutoff` (monotonic), and, while the host holds
        more than `max_sessions`, the least recently used idle ones beyond that: sessions are
        named by clients, and a host must not keep every one it was sent in memory until the idle
        time runs out. A session whose changes are not written yet is queued for the flusher and
        passivated by a later sweep. Returns how many were passivated."""
        excess = len(self._sessions) - self._settings.max_sessions
        if excess > 0:
            # a tenth more than the excess, so that the next few activations do not sweep again
            oldest = sorted(self._sessions.items(), key=lambda item: item[1].last_used)
            cutoff = max(cutoff, oldest[min(len(oldest) - 1, excess + self._settings.max_sessions // 10)][1].last_used)
            log.warning("live_sessions_over_cap", live=len(self._sessions), cap=self._settings.max_sessions)
        passivated = 0
        for key, entry in list(self._sessions.items()):
            if entry.last_used < cutoff and not entry.lock.locked() and not entry.queued:
                if entry.state.dirty or key in self._inflight:
                    # Not written yet (the database may be away): queue it for the flusher and
                    # passivate on a later sweep, rather than hold its lock until Postgres answers.
                    self._queue_flush(key)
                    continue
                try:
                    passivated += await self.passivate(*key)
                except Exception:  # noqa: BLE001 - a failed flush keeps the session cached
                    log.warning("passivation_failed", session_id=key[1])
        return passivated

    # -- the flusher (group commit + output gate) ---------------------------------------------

    def _mark_dirty(self, key: Key) -> asyncio.Future[None]:
        """Have the flusher write the session's sealed turns; the future is resolved once every
        turn it holds now is durable (failed if Postgres refuses one of them)."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = self._sessions.get(key)
        waiting = [w for w in self._waiters.get(key, ()) if not w[1].done()]  # given up: dropped
        waiting.append((entry.state.sealed_turns if entry else 0, future))
        self._waiters[key] = waiting
        self._queue_flush(key)
        return future

    async def _until_durable(self, key: Key, durable: asyncio.Future[None]) -> None:
        """Wait for a `_mark_dirty` future at most `gate_timeout_s`; raises TimeoutError then, or
        what the future raises. A caller that gives up (timed out, or cancelled) cancels its own
        future and takes it out of the session's waiters: while Postgres is away no flush
        succeeds to clear them, and a client polling the session every second would otherwise
        add one for good each time."""
        try:
            await asyncio.wait_for(asyncio.shield(durable), self._settings.gate_timeout_s)
        except BaseException:
            self._forget_waiter(key, durable)
            raise

    def _forget_waiter(self, key: Key, durable: asyncio.Future[None]) -> None:
        """Drop one waiter nobody awaits any more. A flush running now holds its own list of the
        waiters it took: a cancelled future is skipped there (resolved ones are `done`), and not
        put back should that flush fail."""
        durable.cancel()
        waiting = [w for w in self._waiters.get(key, ()) if w[1] is not durable]
        if waiting:
            self._waiters[key] = waiting
        else:
            self._waiters.pop(key, None)

    def _queue_flush(self, key: Key) -> None:
        """Have the flusher write this session's sealed changes (no one waits for them)."""
        self._dirty.setdefault(key, None)
        self._wake.set()

    async def flush_all(self) -> None:
        """Flush every dirty session now and wait for it (shutdown, tests)."""
        for key, entry in list(self._sessions.items()):
            if entry.state.dirty:
                self._mark_dirty(key)
        await self._flush_once()  # also waits for a flush already under way (its lock)
        while self._dirty:  # a flush takes at most flush_batch sessions
            await self._flush_once()

    async def _flusher(self) -> None:
        backoff = 0.05
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._settings.flush_interval_s and self._busy:
                # The group-commit window, only while a running turn may join this flush: until
                # every turn running reaches the gate (it marks its session dirty in the same step
                # that ends its run), at most flush_interval. A turn alone on its host would wait
                # for nothing (light load: every turn); a busy host waits the whole window.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._none_busy.wait(), self._settings.flush_interval_s)
            try:
                await self._flush_once()
                backoff = 0.05
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - retried; nothing is dropped
                log.warning("flush_failed", error=type(exc).__name__, retry_in_s=backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self._settings.max_backoff_s)
                self._wake.set()

    async def _flush_once(self) -> None:
        # One flush at a time: two in flight could commit one session's deltas out of order.
        async with self._flush_lock:
            await self._flush_locked()

    async def _flush_isolating(
        self, deltas: dict[Key, tuple[_Entry, SealedTurns]]
    ) -> tuple[list, list, dict[Key, int]]:
        """One transaction for all (group commit). When Postgres refuses the batch for good (a
        data error, not a lost connection), flush session by session so one session's bad data
        cannot hold every other session's replies, and a session it refuses turn by turn (see
        `_flush_alone`). Returns (written, refused, poisoned: for each session whose data Postgres
        refused, the number of its newest turn written). A retryable error propagates: the
        caller puts every delta back and retries (what this wrote meanwhile is written again
        then, as after a lost acknowledgement, which the store absorbs)."""
        try:
            result = await self._store.flush([taken.joined() for _, taken in deltas.values()])
            return list(result.written), list(result.refused), {}
        except Exception as exc:
            if _transient(exc):
                raise
            batch_error = exc
        written: list = []
        refused: list = []
        poisoned: dict[Key, int] = {}
        for key, (_, taken) in deltas.items():
            stale, newest = await self._flush_alone(taken)
            if stale:
                refused.append(key)
            elif newest == taken.last:
                written.append(key)
            else:
                poisoned[key] = newest
        log.warning("flush_isolated_bad_session", sessions=len(deltas), poisoned=len(poisoned),
                    error=type(batch_error).__name__)
        return written, refused, poisoned

    async def _flush_alone(self, taken: SealedTurns) -> tuple[bool, int]:
        """One session's turns in a transaction of their own: returns (refused for a stale epoch,
        the number of the newest turn written). When Postgres refuses them for good, turn by
        turn up to the first it refuses: each turn before it is kept, its reply released (a
        later turn builds on the earlier ones, never the reverse), and only the turns from there
        on are lost. A retryable error propagates."""
        before = taken.last - len(taken.turns)  # the number of the turn before the first
        try:
            one = await self._store.flush([taken.joined()])
            return bool(one.refused), taken.last if one.written else before
        except Exception as exc:
            if _transient(exc):
                raise
            if len(taken.turns) == 1:
                return False, before
        newest = before
        for turn in taken.turns:
            try:
                one = await self._store.flush([turn])
            except Exception as exc:
                if _transient(exc):
                    raise
                break
            if one.refused:
                return True, newest
            newest += 1
        return False, newest

    async def _flush_locked(self) -> None:
        # At most flush_batch sessions, every tenant in turn: one tenant's thousand new sessions
        # make several short transactions, and another tenant's reply waits for one of them.
        keys = fair_batch(self._dirty, self._settings.flush_batch)
        for key in keys:
            del self._dirty[key]
        if self._dirty:
            self._wake.set()  # the rest in the next flush, at once
        waiters = {k: self._waiters.pop(k, []) for k in keys}
        # Each session's turns with the entry they came from: the session may be evicted or
        # re-activated while the flush runs, and a result must reach that copy, not the current.
        deltas: dict[Key, tuple[_Entry, SealedTurns]] = {}
        for key in keys:
            entry = self._sessions.get(key)
            taken = entry.state.take_turns() if entry else None
            if entry is not None and taken is not None:
                deltas[key] = (entry, taken)
        if not deltas:
            _resolve(waiters)
            return
        started = time.perf_counter()
        self._inflight = set(deltas)
        try:
            written, refused, poisoned = await self._flush_isolating(deltas)
        except BaseException:
            for entry, taken in deltas.values():
                entry.state.restore_turns(taken)
            for key, fs in waiters.items():
                # not the ones given up on while this flush ran (`_forget_waiter`)
                kept = [w for w in fs if not w[1].done()]
                if kept:
                    self._waiters.setdefault(key, [])[:0] = kept
            self._dirty = {**dict.fromkeys(keys), **self._dirty}  # first again
            raise
        finally:
            self._inflight = set()
        self.last_flush_ms = (time.perf_counter() - started) * 1000
        self.flushes += 1
        self.flushed_sessions += len(written)
        if self._on_flush is not None:
            self._on_flush(len(written), self.last_flush_ms)
        for key in map(tuple, written):
            source = deltas.get(key)  # type: ignore[call-overload]
            if source is not None:
                source[0].durable_through = source[1].last
                if self._feeds:
                    self._publish(key, [e for d in source[1].turns for e in d.events])  # type: ignore[arg-type]
        for key, kept in poisoned.items():
            # Postgres refuses this session's data for good (not a lost connection): the turns
            # from the one it refused on are not acknowledged and the copy, which holds them, is
            # dropped, so the session goes on from what is stored (the turns before are).
            entry = deltas[key][0]
            entry.stale = True
            entry.durable_through = kept
            if self._sessions.get(key) is entry:
                del self._sessions[key]
            for upto, f in waiters.pop(key, []):
                if f.done():
                    continue
                if upto <= kept:
                    f.set_result(None)
                else:
                    f.set_exception(TurnNotSaved(
                        f"the last turn of session {key[1]!r} could not be saved and was not acknowledged; "
                        "send the message again (the session continues from its saved state)"
                    ))
            feed = self._feeds.get(key)
            if feed is not None:  # some of its events may be written: its watchers read the store
                feed.recent = None
                feed.ring()
            log.error("flush_refused_session_data", session_id=key[1],
                      turns_kept=kept - (deltas[key][1].last - len(deltas[key][1].turns)))
        for key in map(tuple, refused):
            # A newer activation owns this session: this copy is stale. Evict it so the next
            # message re-activates from Postgres, and fail the replies that were waiting.
            source = deltas.get(key)  # type: ignore[call-overload]
            if source is not None:
                source[0].stale = True
                if self._sessions.get(key) is source[0]:  # type: ignore[call-overload]
                    del self._sessions[key]  # type: ignore[arg-type]
            for _, f in waiters.pop(key, []):  # type: ignore[arg-type]
                if not f.done():
                    f.set_exception(_lease_lost(key[1]))
            log.warning("flush_refused_stale_epoch", session_id=key[1])
        for key, (entry, taken) in deltas.items():  # written, or dropped: new turns may be let in again
            entry.state.settle_turns(taken)
            self._count_unwritten(key, entry)
        _resolve(waiters)


def _transient(exc: BaseException) -> bool:
    """Worth retrying: a lost connection (the store says retryable) or anything unrecognised.
    Only an engine error that says it is final (a data error) isolates a session."""
    return not isinstance(exc, ChatEngineError) or bool(getattr(exc, "retryable", False))


class TurnNotSaved(ChatEngineError):
    """Postgres refused a session's data for good; its unsaved turn was dropped, not acknowledged."""


def _percentile(values: collections.deque[float], p: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, int(len(ordered) * p / 100))]


def _resolve(waiters: dict[Key, list[tuple[int, asyncio.Future[None]]]]) -> None:
    for fs in waiters.values():
        for _, f in fs:
            if not f.done():
                f.set_result(None)


def _lease_lost(session_id: str) -> LeaseLost:
    return LeaseLost(f"session {session_id!r} was taken over by another activation; retry the message")
