"""The Ray shell around SessionHost: a named async actor per shard (or per session, dedicated).

Every Ray API call of the engine lives in `actors/` (this module, `placement`, `cluster`). The
actor builds its own runtime (pool, LLM client, webhook client) from the Settings it is given, on
first use, inside its event loop. A turn's command (services.wire.Turn or ApprovalDecision) comes in
as msgspec-encoded bytes (`encode_command`), over the host's lane or through Ray alike, and its reply
goes back the same way: cheaper than pickling structs, and errors travel as data (`HostError`)
rather than as pickled exceptions.

A shard host reads the shard state in force from Postgres when it starts, adopts each one a
rescale pushes, and reads it again when it refuses a turn as "moved": a rescale that stopped
between its steps is settled there (see `SessionHostActor._moved`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, Protocol, runtime_checkable

import msgspec
import ray
import structlog

from actors.host import HostSettings, LeaseLost, SessionHost, SessionMoved, TurnNotSaved
from actors.lane import STREAM, LaneAddress, LaneServer
from actors.runtime import Runtime
from actors.session import SessionError
from actors.sharding import owns, parse_host_name
from kernel.errors import ChatEngineError, Conflict, Forbidden, NotFound, Overloaded, Unauthorized
from kernel.records import SessionEvent
from services import heap
from services.heap import tune_collector
from services.logging import configure_logging
from services.settings import Settings
from services.tracing import configure_tracing
from services.wire import (
    ApprovalDecision,
    SessionCommand,
    StreamEvent,
    Turn,
    TurnCommand,
    TurnReply,
)
from storage.repos.cluster import ClusterRepo, ShardState

log = structlog.get_logger(__name__)


class HostError(msgspec.Struct, frozen=True, kw_only=True):
    kind: str  # "overloaded" | "lease_lost" | "not_found" | "unavailable" | "internal"
    message: str
    retry_after: float | None = None
    reason: str | None = None  # Overloaded.reason
    shard_state: ShardState | None = None  # reason "moved": the host's view, for the caller to route by


class HostResult(msgspec.Struct, frozen=True, kw_only=True):
    reply: TurnReply | None = None
    error: HostError | None = None


class WatchResult(msgspec.Struct, frozen=True, kw_only=True):
    """What `watch` answers: the session's events after the one asked for, or why not."""

    events: list[SessionEvent] = []
    error: HostError | None = None


SHARD_POOL_SIZE = 10  # Postgres connections of a shard host (thousands of sessions)
DEDICATED_POOL_SIZE = 2  # of a dedicated actor (one session: the listener and one working)

#: the calls a gateway may send over a shard host's lane (actors/lane.py): the turns, and the
#: streamed turn (an SSE client's), each of its events a frame
TURN_METHODS = frozenset({"send", "decide"})
#: and, to a host whose address lists EVENTS, an agent's message or a handoff change (`act`) and a
#: watcher's wait for a session's events (`watch`, held open up to its wait: one frame back)
LANE_METHODS = TURN_METHODS | {"act", "watch"}
LANE_STREAMS = frozenset({"stream"})
#: a host lists in its lane address that `send` and `stream` take `new_id` (SessionHost.send): a
#: gateway passes it only to a host that lists it, so gateways may be rolled before hosts; and
#: that its lane carries `stream` (STREAM): to a host that does not, streamed turns go through Ray
NEW_ID = "new_id"
#: and that its lane carries `act` and `watch` (EVENTS): to a host that does not, they go through Ray
EVENTS = "events"
LANE_FEATURES = (NEW_ID, STREAM, EVENTS)

#: a shard host that refuses a turn as "moved" reads the stored shard state again, at most this often
SHARD_REFRESH_S = 1.0


@runtime_checkable
class ShardSource(Protocol):
    """Where a shard host reads the shard state in force (storage.repos.cluster.ClusterRepo)."""

    async def get(self, host_group: str) -> ShardState | None: ...
    async def settle_abandoned(self, host_group: str) -> ShardState | None: ...


result_encoder = msgspec.json.Encoder()
result_decoder = msgspec.json.Decoder(HostResult)
event_decoder = msgspec.json.Decoder(StreamEvent)
#: a turn's command crosses to the host (over its lane or through Ray) encoded once, as JSON: the
#: gateway's Placement encodes it, the host's shell decodes it; both run the same version
turn_decoder = msgspec.json.Decoder(Turn)
decision_decoder = msgspec.json.Decoder(ApprovalDecision)
command_decoder = msgspec.json.Decoder(TurnCommand)
session_command_decoder = msgspec.json.Decoder(SessionCommand)
watch_decoder = msgspec.json.Decoder(WatchResult)


def encode_command(command: TurnCommand | SessionCommand) -> bytes:
    """A Turn or an ApprovalDecision as the host's `send`, `decide` and `stream` take it; an
    AgentMessage or a HandoffChange as its `act` takes it."""
    return result_encoder.encode(command)


def to_host_error(exc: BaseException) -> HostError:
    if isinstance(exc, Overloaded):
        return HostError(kind="overloaded", message=str(exc), retry_after=exc.retry_after, reason=exc.reason)
    if isinstance(exc, LeaseLost):
        return HostError(kind="lease_lost", message=str(exc), retry_after=0.1)
    if isinstance(exc, TurnNotSaved):
        # Postgres refused the session's data for good (a data error, not an outage): the turn
        # was dropped unacknowledged and its message says so and what to do. Answered as the
        # in-process router answers it (LocalRouter lets it reach the gateway as itself: 400),
        # not as a host that failed (500).
        return HostError(kind="invalid", message=str(exc))
    if isinstance(exc, SessionError):
        return HostError(kind=exc.kind, message=str(exc))
    if isinstance(exc, NotFound):
        return HostError(kind="not_found", message=str(exc))
    if isinstance(exc, Unauthorized):
        return HostError(kind="unauthorized", message=str(exc))
    if isinstance(exc, Forbidden):
        return HostError(kind="forbidden", message=str(exc))
    if isinstance(exc, Conflict):
        return HostError(kind="conflict", message=str(exc))
    if isinstance(exc, ChatEngineError) and getattr(exc, "retryable", False):
        return HostError(kind="unavailable", message=str(exc), retry_after=1.0)
    if isinstance(exc, ChatEngineError):
        return HostError(kind="invalid", message=str(exc))
    return HostError(kind="internal", message="the session host failed to run this turn; retry shortly")


def normal_priority() -> int:
    """Run this process's threads at niceness 0 if Ray started it niced (its worker_niceness is
    15 unless RAY_worker_niceness says otherwise); returns the niceness the host runs at. Lowering
    niceness needs root or CAP_SYS_NICE: without them the host says so and runs as it is."""
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if current <= 0:
        return current
    try:
        for tid in os.listdir("/proc/self/task"):  # Linux: niceness is per thread
            os.setpriority(os.PRIO_PROCESS, int(tid), 0)
    except (PermissionError, FileNotFoundError, ProcessLookupError) as exc:
        log.warning("session_host_niced", niceness=current, error=type(exc).__name__,
                    fix="set RAY_worker_niceness=0 in the environment of every Ray node (the image does)")
    return os.getpriority(os.PRIO_PROCESS, 0)


class SessionHostActor:
    """Wrapped by `ray.remote` in `actors.placement`; one per shard or per dedicated session."""

    def __init__(self, name: str, settings: bytes, dedicated: bool = False) -> None:
        self._name = name
        self._settings = msgspec.json.decode(settings, type=Settings)
        self._dedicated = dedicated
        self._host: SessionHost | None = None
        self._runtime: Any = None
        self._init_lock: asyncio.Lock | None = None
        self._watchdog: asyncio.Task | None = None
        self._turns = 0  # turns (send/decide/stream) running in this actor now
        self._turn_calls = 0  # turns this actor was asked to run, by any path
        # A shard host owns the sessions its index wins under the shard state in force (read from
        # Postgres when it starts, then pushed by every rescale); a dedicated actor owns its one.
        parsed = None if dedicated else parse_host_name(name)
        self._group, self._index = parsed if parsed is not None else ("", -1)
        self._shard_state: ShardState | None = None
        self._cluster: ShardSource | None = None  # a shard host's, once started
        self._refresh: asyncio.Task | None = None  # the re-read of the stored state a refusal began
        self._refreshed_at = float("-inf")
        self._stopping = False  # shutdown() began: never build a new SessionHost in this process again
        self._last_call = time.monotonic()  # of a turn (send, decide, stream): how long it has been idle
        self._lane: LaneServer | None = None
        self._lane_address: LaneAddress | None = None
        self._niceness: int | None = None  # the process's niceness once started (normal_priority)

    async def _ensure(self) -> SessionHost:
        if self._host is not None:
            return self._host
        if self._stopping:  # between shutdown() and the caller's kill: a turn here would be lost
            raise Overloaded("this session host is shutting down; retry in a moment", retry_after=1.0,
                             reason="shutting_down")
        if self._init_lock is None:
            self._init_lock = asyncio.Lock()
        async with self._init_lock:
            if self._host is None:
                configure_logging(fmt=self._settings.log_format, level=self._settings.log_level)
                self._niceness = normal_priority()
                self._tracing = configure_tracing(self._settings.otlp_endpoint, service_name=f"chat-engine.{self._name}")
                # A dedicated actor runs one session, one turn at a time: the catalog listener and
                # one working connection. Ten each, as a shard host has, and a few dozen live
                # dedicated sessions use up Postgres's max_connections (TooManyConnectionsError).
                pool_size = DEDICATED_POOL_SIZE if self._dedicated else SHARD_POOL_SIZE
                self._runtime = await Runtime.open(self._settings, pool_size=pool_size, light=self._dedicated)
                host = SessionHost(
                    name=self._name, store=self._runtime.sessions, tenants=self._runtime.tenants,
                    jobs=self._runtime.jobs,
                    settings=HostSettings.from_settings(self._settings),
                )
                await host.start()
                self._runtime.workflows.on_finished = host.wake  # a job run here wakes its session
                # Everything imported and built so far (Ray's and the runtime's modules: a large
                # heap in a Ray worker) lives as long as the process: move it out of the cyclic
                # collector's reach, so its full collections walk only what turns allocate.
                # Measured: -0.9 ms host CPU per message (make bench, sharded; README § Performance).
                heap.settle()
                tune_collector()  # a turn's short-lived objects die by refcount: far fewer collections (services.heap)
                if not self._dedicated and self._index >= 0:
                    self._cluster = ClusterRepo(self._runtime.pool)
                    self._shard_state = await self._stored_shard_state()
                    host.set_ownership(self._owns)
                self._host = host
                if not self._dedicated and self._settings.host_lane:
                    self._lane = LaneServer(self._lane_dispatch, LANE_METHODS, stream=self._lane_stream,
                                            streams=LANE_STREAMS, counted=TURN_METHODS | LANE_STREAMS)
                    self._lane_address = await self._lane.start(ray.util.get_node_ip_address(), LANE_FEATURES)
                if self._dedicated:
                    self._watchdog = asyncio.create_task(self._exit_when_idle())
        return self._host

    async def ready(self) -> str:
        await self._ensure()
        return self._name

    async def lane(self) -> bytes | None:
        """The address (with its token) of this host's turn lane (encoded LaneAddress), or None
        when it has none (a dedicated actor, or CE_HOST_LANE=off): turns then come through Ray."""
        await self._ensure()
        return None if self._lane_address is None else msgspec.json.encode(self._lane_address)

    def _lane_dispatch(self, method: str, args: list[Any]) -> Awaitable[bytes]:
        # the method's own coroutine, awaited by the lane: no frame of its own (an idle watcher's
        # call waits through every frame of its chain)
        return getattr(self, method)(*args)

    def _lane_stream(self, method: str, args: list[Any]) -> AsyncIterator[bytes]:
        return getattr(self, method)(*args)

    # -- shard ownership ------------------------------------------------------------------------

    async def _stored_shard_state(self) -> ShardState:
        assert self._cluster is not None
        stored = await self._cluster.get(self._group)
        # None: no gateway stored a count yet; the count this host was created for is in force.
        return stored or ShardState(shards=self._settings.shards, generation=0, host_group=self._group)

    def _owns(self, tenant_id: str, session_id: str) -> bool:
        assert self._shard_state is not None
        return owns(self._shard_state, self._index, tenant_id, session_id)

    async def set_shard_state(self, raw: bytes) -> int:
        """Adopt a newer shard state (an older one is ignored), then flush and drop every session
        this host no longer owns. Returns how many it dropped. Idempotent: a rescale may retry."""
        return await self._adopt(msgspec.json.decode(raw, type=ShardState))

    async def _adopt(self, state: ShardState) -> int:
        host = await self._ensure()
        current = self._shard_state
        if current is not None and state.generation >= current.generation:
            self._shard_state = state
        released = await host.release_unowned()
        if released:
            log.info("sessions_released_on_rescale", host=self._name, released=released,
                     shards=state.shards, pending=state.pending)
        return released

    def _moved(self) -> None:
        """A turn was refused: not this host's session under its shard state. Most often a rescale
        is between its steps, or the gateway is behind. But if that rescale stopped there (its
        process killed, Postgres away through all its commit retries), a moving session has no
        host until a count is committed, and if it died after its commit, this host may have
        missed the commit: so re-read the stored state (at most every SHARD_REFRESH_S), rolling
        back a pending state that no rescale holds the lock for (ClusterRepo.settle_abandoned:
        race-free against a live rescale), and adopt it if it is newer."""
        if self._cluster is None or (self._refresh is not None and not self._refresh.done()):
            return
        now = time.monotonic()
        if now - self._refreshed_at < SHARD_REFRESH_S:
            return
        self._refreshed_at = now
        self._refresh = asyncio.ensure_future(self._refresh_shard_state())

    async def _refresh_shard_state(self) -> None:
        assert self._cluster is not None
        try:
            stored = await self._cluster.settle_abandoned(self._group)
            current = self._shard_state
            if stored is None or current is None or stored.generation <= current.generation:
                return
            log.warning("shard_state_caught_up", host=self._name, shards=stored.shards, pending=stored.pending,
                        generation=stored.generation, was_shards=current.shards, was_pending=current.pending)
            await self._adopt(stored)
        except Exception as exc:  # noqa: BLE001 - Postgres away: the next refused turn tries again
            log.warning("shard_state_refresh_failed", host=self._name, error=type(exc).__name__)

    async def shard_state(self) -> bytes:
        """The shard state this host routes by (encoded ShardState), after starting if needed."""
        await self._ensure()
        return msgspec.json.encode(self._shard_state)

    async def encoded_settings(self) -> bytes:
        """The Settings this host was created with: a rescale creates new hosts from them, so they
        run with the same database, model and secrets whatever the operator's shell holds."""
        return msgspec.json.encode(self._settings)

    @contextlib.contextmanager
    def _turn(self, *, counted: bool = True) -> Iterator[None]:
        """Count a turn (send, decide, stream; an `act`, not `counted` in the turn calls) while it
        runs: the idle watchdog and stats read it."""
        self._turns += 1
        self._turn_calls += counted
        self._last_call = time.monotonic()
        try:
            yield
        finally:
            self._turns -= 1

    async def _reply(self, turn: Callable[[SessionHost], Awaitable[TurnReply]], *, counted: bool = True) -> bytes:
        """Run one turn (send or decide) on this host; its reply, or its error, as bytes."""
        with self._turn(counted=counted):
            try:
                reply = await turn(await self._ensure())
                return result_encoder.encode(HostResult(reply=reply))
            except Exception as exc:  # noqa: BLE001 - errors travel as data
                return self._error(exc)

    async def send(self, turn: bytes, new_id: bool = False) -> bytes:
        """Run an encoded Turn (`encode_command`); its encoded HostResult."""
        return await self._reply(lambda host: host.send(turn_decoder.decode(turn), new_id=new_id))

    async def decide(self, decision: bytes) -> bytes:
        """Run an encoded ApprovalDecision (`encode_command`); its encoded HostResult."""
        return await self._reply(lambda host: host.decide(decision_decoder.decode(decision)))

    async def act(self, command: bytes) -> bytes:
        """Run an encoded AgentMessage or HandoffChange (`encode_command`); its encoded HostResult."""
        return await self._reply(lambda host: host.act(session_command_decoder.decode(command)), counted=False)

    async def watch(self, tenant_id: str, session_id: str, after: int, wait_s: float) -> bytes:
        """The session's written events after `after` (SessionHost.watch), as an encoded WatchResult."""
        try:
            host = await self._ensure()
            events = await host.watch(tenant_id, session_id, after, wait_s)
            return result_encoder.encode(WatchResult(events=events))
        except Exception as exc:  # noqa: BLE001 - errors travel as data
            return result_encoder.encode(WatchResult(error=self._failure(exc)))

    async def stream(self, command: bytes, new_id: bool = False):
        """An async generator of encoded StreamEvents (called with num_returns="streaming") of an
        encoded Turn or ApprovalDecision (`encode_command`)."""
        with self._turn():
            try:
                host = await self._ensure()
            except Exception as exc:  # noqa: BLE001
                err = to_host_error(exc)
                yield result_encoder.encode(StreamEvent(event="error", data=msgspec.to_builtins(err)))
                return
            try:
                async for event in host.stream(command_decoder.decode(command), new_id=new_id):
                    yield result_encoder.encode(event)
            except Exception as exc:  # noqa: BLE001 - errors travel as data: the last event
                err = to_host_error(exc)
                if isinstance(exc, SessionMoved):
                    # nothing ran: the gateway routes again by this host's shard state and retries
                    err = msgspec.structs.replace(err, shard_state=self._shard_state)
                    self._moved()
                yield result_encoder.encode(StreamEvent(event="error", data=msgspec.to_builtins(err)))

    async def view(self, tenant_id: str, session_id: str) -> bytes | None:
        if self._stopping and self._host is None:
            return None  # stopped, every session flushed: the gateway reads the stored session
        host = await self._ensure()
        v = await host.view(tenant_id, session_id)
        return None if v is None else result_encoder.encode(v)

    async def contract(self, tenant_id: str) -> dict[str, Any]:
        """The tool-contract report against the catalog this host really runs."""
        await self._ensure()
        return await self._runtime.contract_report(tenant_id)

    async def passivate(self, tenant_id: str, session_id: str) -> bool:
        host = await self._ensure()
        return await host.passivate(tenant_id, session_id)

    async def passivate_all(self) -> int:
        host = await self._ensure()
        return await host.passivate_all()

    async def stats(self) -> dict[str, Any]:
        if self._host is None:
            return {"host": self._name, "live_sessions": 0, "flushes": 0, "flushed_sessions": 0,
                    "last_flush_ms": 0.0, "dirty": 0, "pid": os.getpid(),
                    "node_id": ray.get_runtime_context().get_node_id()}
        state = self._shard_state
        return {**self._host.stats(), "pid": os.getpid(), "niceness": self._niceness, "gc_threshold": gc.get_threshold()[0],
                "tasks": len(asyncio.all_tasks()), "node_id": ray.get_runtime_context().get_node_id(),
                "idle_s": round(time.monotonic() - self._last_call, 3), "turn_calls": self._turn_calls,
                "lane_calls": 0 if self._lane is None else self._lane.calls,
                **({"shards": state.shards, "shard_generation": state.generation} if state is not None else {})}

    async def shutdown(self) -> bool:
        """Drain and flush; the caller kills the actor afterwards."""
        self._stopping = True
        if self._refresh is not None:
            self._refresh.cancel()
        if self._host is not None:
            await self._host.stop()
            if self._lane is not None:  # after stop(): every admitted turn has its reply written
                await self._lane.close()
                self._lane = self._lane_address = None
            await self._runtime.close()
            self._host = None
        if getattr(self, "_tracing", None) is not None:
            self._tracing.shutdown()  # flush the last spans
        return True

    def _error(self, exc: BaseException) -> bytes:
        return result_encoder.encode(HostResult(error=self._failure(exc)))

    def _failure(self, exc: BaseException) -> HostError:
        err = to_host_error(exc)
        if isinstance(exc, SessionMoved):
            err = msgspec.structs.replace(err, shard_state=self._shard_state)
            self._moved()
        if err.kind == "internal":
            log.error("host_call_failed", host=self._name, error=type(exc).__name__, exc_info=exc)
        return err

    async def _exit_when_idle(self) -> None:
        # A dedicated actor is one process per live session: once its session passivates, the
        # process goes too. The next message creates it again (get_if_exists). Checked as "no
        # session and no turn right now", not "had a session at an earlier check": a session
        # passivated before the first check must not leave its process behind for good.
        host = self._host
        assert host is not None
        while True:
            await asyncio.sleep(max(0.5, self._settings.idle_seconds / 4))
            if not host.live_sessions and not self._turns and not host.watched_sessions:
                await self.shutdown()
                ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
                return
