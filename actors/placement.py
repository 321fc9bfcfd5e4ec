"""Placement: which Ray actor hosts a session, and the gateway's one door to the session actors.

`sharded` (default): CE_SHARDS named session-host actors, a session goes to a host by rendezvous
hashing of `tenant_id:session_id` (changing the shard count moves only the sessions whose winner
changed; their new host re-activates them under a newer lease epoch). `dedicated`: one named actor
per session (`get_if_exists`), one process each. Both run the same SessionHost code.

The shard count in force is a `ShardState` kept in Postgres (ce_cluster): gateways read it at
start and follow it on NOTIFY, hosts read it when they start. `rescale(n)` changes it while
traffic flows, in two steps every host acknowledges: pending (a moving session has no owner; its
old host flushes and drops it) then commit (its new host may activate it, under a new lease
epoch). A host refuses a turn for a session it does not own (SessionMoved, nothing run) with its
state attached, so a gateway that routed by an older count routes again and retries. A rescale
that fails or is cancelled after the pending step still commits a count (the old one unless every
host let go of what moves), retried with backoff; one whose process died between the steps is
settled by the hosts (actors/ray_host.py) or by the next `rescale`.

Dedicated actors exit once their session has been idle for `idle_seconds`: the gateway keeps the
handles of the DEDICATED_HANDLES sessions it routed most recently within that time, and finds the
live actors by name (`actor_stats`, `shutdown_hosts`) rather than by what it ever routed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol, runtime_checkable

import msgspec
import ray
import structlog
from ray.exceptions import (
    ActorUnschedulableError,
    LocalRayletDiedError,
    NodeDiedError,
    ObjectLostError,
    RayActorError,
    RaySystemError,
    RayTaskError,
    RpcError,
    WorkerCrashedError,
)

from actors.actor_quota import ActorQuota
from actors.lane import (
    PING_TIMEOUT_S,
    STREAM,
    LaneAddress,
    LaneBroken,
    LaneClient,
    LaneError,
    LaneStalled,
    LaneUnreachable,
)
from actors.ray_host import (
    EVENTS,
    LANE_METHODS,
    NEW_ID,
    TURN_METHODS,
    HostError,
    HostResult,
    SessionHostActor,
    encode_command,
    event_decoder,
    result_decoder,
    watch_decoder,
)
from actors.sharding import HOST_PREFIX, host_name, parse_host_name, rendezvous_index, route
from kernel.errors import ChatEngineError, ConfigError, Overloaded
from kernel.records import SessionEvent, session_uid
from services.settings import Settings
from services.wire import (
    ApprovalDecision,
    SessionCommand,
    SessionView,
    StreamEvent,
    Turn,
    TurnCommand,
    TurnReply,
)
from storage.repos.cluster import ShardState

log = structlog.get_logger(__name__)

NAMESPACE = "chat-engine"
SESSION_PREFIX = "ce-session-"
__all__ = ["HOST_PREFIX", "NAMESPACE", "SESSION_PREFIX", "Placement", "host_name", "rendezvous_index"]

#: CPU reserved by a shard host. Not for the CPU (a host is I/O bound): Ray's SPREAD strategy
#: spreads only actors that demand a resource. With num_cpus=0 all four hosts of a two-node test
#: cluster landed on one node (measured, Ray 2.60); with 0.001 they alternated between the nodes.
HOST_CPUS = 0.001
#: how long a gateway keeps re-routing a turn for a session that is moving between hosts
MOVED_RETRY_S = 15.0
#: how Ray says a call to a host did not come back because the host, its worker, its node or the
#: cluster's own services failed (not because the host's code raised): the call may have run, so
#: it is retried once with the same message id, then answered 503 "restarting" (never a 500)
#: (RayActorError covers ActorDiedError and ActorUnavailableError)
HOST_LOST = (RayActorError, NodeDiedError, WorkerCrashedError, ObjectLostError, LocalRayletDiedError,
             ActorUnschedulableError, RaySystemError, RpcError)
#: a host beyond the new count stays up after the commit, answering "moved" with the new state to
#: gateways whose notification is late, until no turn reached it for RETIRE_QUIET_S (at most
#: RETIRE_DRAIN_S); killed at once, such a gateway's retry would create it again (get_if_exists)
RETIRE_QUIET_S = 1.0
RETIRE_DRAIN_S = 15.0
#: a shard host a turn finds missing is created by the gateway only after this long (see _routed_handle)
MISSING_HOST_GRACE_S = 10.0
#: a host whose lane could not be connected to gets its turns through Ray for this long (a
#: network that lets Ray's ports through but not the lane's: turns still flow, a little slower)
LANE_RETRY_S = 30.0
#: a host that could not say its lane's address (it raised: Postgres away while it starts, or it
#: is shutting down) gets its turns through Ray, which answer cleanly, for this long, then is asked again
LANE_LOOKUP_RETRY_S = 1.0
#: how long a host has to say its lane's address (a host that does not is hung: its turn is
#: answered 503 "host_unresponsive"; a host still starting answers once its runtime is open)
LANE_LOOKUP_TIMEOUT_S = 15.0
#: Retry-After of a turn refused because its host is unresponsive (a hung host that wakes answers
#: at once; one that does not is for the operator to restart: `chat-engine restart-hosts`)
UNRESPONSIVE_RETRY_S = 5.0
#: how long a stats read (a /metrics scrape) waits for a host before leaving it out
STATS_TIMEOUT_S = 2.0
#: a host being retired (restart-hosts, a scale-down) that does not answer a stats read within
#: RETIRE_PROBE_S is hung: it is killed without its flush; one that answers may take
#: RETIRE_SHUTDOWN_S to flush and stop before it is killed anyway
RETIRE_PROBE_S = 10.0
RETIRE_SHUTDOWN_S = 30.0
#: a rescale that stopped after its pending step commits a count this many times at most, waiting
#: COMMIT_BACKOFF_S, then twice that, ... between attempts (0.5 + 1 + 2 + 4 s: a Postgres restart)
COMMIT_ATTEMPTS = 5
COMMIT_BACKOFF_S = 0.5
#: dedicated placement: the session actors' handles a gateway keeps, most recently used first. A
#: handle unused for `idle_seconds` is dropped anyway (its actor has exited, or is about to).
DEDICATED_HANDLES = 4096

RemoteHost = ray.remote(SessionHostActor)


class HostFailure(ChatEngineError):
    """The session host answered with an error; `error.kind` says which."""

    def __init__(self, error: HostError) -> None:
        super().__init__(error.message)
        self.error = error


@runtime_checkable
class ShardStore(Protocol):
    """Where the shard state is kept and changed (storage.repos.cluster.ClusterRepo)."""

    async def ensure(self, host_group: str, shards: int) -> ShardState: ...
    async def begin(self, host_group: str, target: int) -> ShardState: ...
    async def commit(self, host_group: str, target: int, *, generation: int | None = None) -> ShardState: ...
    def exclusive(self, host_group: str) -> AbstractAsyncContextManager[None]: ...


class RescaleFailed(ChatEngineError):
    """A rescale did not complete: session host `host` did not acknowledge the pending state (the
    old count was put back in force), or the commit could not be written (the message says what
    is stored then)."""

    def __init__(self, message: str, *, host: str | None = None) -> None:
        super().__init__(message)
        self.host = host


class RescaleReport(msgspec.Struct, frozen=True, kw_only=True):
    before: int
    after: int
    generation: int
    released: int  # sessions flushed and dropped by hosts that no longer own them
    started: list[str]  # hosts created for the new count
    retired: list[str]  # hosts beyond the new count, flushed and stopped
    seconds: float


class Placement:
    """Routes turns to session actors; handles are cached, a dead one is looked up again once."""

    def __init__(self, settings: Settings, *, shards: int | None = None, prefix: str = "") -> None:
        """`prefix` goes in front of every actor name: hosts of another configuration (the
        benchmark's gate-off hosts, say) live beside the default ones under their own names."""
        self._settings = settings
        self._prefix = prefix
        self._mode = settings.placement
        self._state = ShardState(shards=shards or settings.shards, host_group=prefix)
        # the count goes with the settings: a host with no stored state falls back to it
        self._encoded = msgspec.json.encode(msgspec.structs.replace(settings, shards=self._state.shards))
        self._handles: dict[str, Any] = {}  # shard host name -> handle
        # dedicated: session actor name -> (handle, when last routed to), least recently first
        self._sessions: OrderedDict[str, tuple[Any, float]] = OrderedDict()
        # dedicated: the sessions whose actors this gateway keeps alive, bounded (actors/actor_quota.py)
        self._quota = ActorQuota(total=settings.dedicated_max_actors,
                                 per_tenant=settings.dedicated_max_actors_per_tenant, ttl=settings.idle_seconds)
        self._missing: dict[str, float] = {}  # shard host name -> when a turn first found it missing
        # Turns go to a shard host over its lane (actors/lane.py) when it has one: name -> client,
        # None for a host without a lane; the lookups under way, so that a burst asks once.
        self._use_lanes = settings.host_lane and self._mode == "sharded"
        self._lanes: dict[str, LaneClient | None] = {}
        self._lane_lookups: dict[str, asyncio.Future[LaneClient | None]] = {}
        # name -> (address, retry after): a lane that could not be connected to, or (None, ...) a
        # host that could not say its address; its turns go through Ray until then
        self._unreachable: dict[str, tuple[LaneAddress | None, float]] = {}
        #: host -> until when its turns are refused as unresponsive, having not said its lane's address in time
        self._unresponsive_until: dict[str, float] = {}

    @property
    def mode(self) -> str:
        return self._mode

    @property
    def shards(self) -> int:
        return self._state.shards

    @property
    def host_group(self) -> str:
        return self._prefix

    @property
    def shard_state(self) -> ShardState:
        return self._state

    def set_shards(self, shards: int) -> None:
        """Route by a new shard count from now on (moved sessions re-activate on their new host)."""
        self._state = msgspec.structs.replace(self._state, shards=shards, pending=None)

    def apply_shard_state(self, state: ShardState) -> bool:
        """Route by `state` if it is newer than the one held; True when it changed anything."""
        if state.generation < self._state.generation or state == self._state:
            return False
        if state.shards != self._state.shards:
            log.info("shard_count_changed", shards=state.shards, before=self._state.shards,
                     generation=state.generation)
        self._state = state
        return True

    def actor_name(self, tenant_id: str, session_id: str) -> str:
        if self._mode == "dedicated":
            return self._prefix + SESSION_PREFIX + session_uid(tenant_id, session_id)
        return self._prefix + host_name(route(self._state, tenant_id, session_id))

    def _handle(self, name: str, settings: bytes | None = None) -> Any:
        if self._mode == "dedicated":
            return self._session_handle(name)
        handle = self._handles.get(name)
        if handle is None:
            handle = self._handles[name] = self._create(name, settings or self._encoded)
        return handle

    def _create(self, name: str, settings: bytes) -> Any:
        """The handle of actor `name`, created if it does not exist (get_if_exists)."""
        sharded = self._mode == "sharded"
        return RemoteHost.options(
            name=name, namespace=NAMESPACE, get_if_exists=True, lifetime="detached",
            num_cpus=HOST_CPUS if sharded else 0, max_restarts=-1, max_task_retries=0,
            max_concurrency=10_000, scheduling_strategy="SPREAD" if sharded else "DEFAULT",
        ).remote(name, settings, not sharded)

    def _session_handle(self, name: str) -> Any:
        """A dedicated session actor's handle. Kept while it is used: its actor exits only once
        the session has been idle for `idle_seconds`, so a handle unused that long is looked up
        again (get_if_exists: the live actor, or a new one) instead of being tried and failing
        (a failed call and 0.2 s). At most DEDICATED_HANDLES are kept: a gateway routes for
        sessions without end, and their actors come and go."""
        now = time.monotonic()
        ttl = self._settings.idle_seconds
        cached = self._sessions.pop(name, None)
        handle = cached[0] if cached is not None and now - cached[1] < ttl else self._create(name, self._encoded)
        self._sessions[name] = (handle, now)
        while True:  # least recently used first: drop what is too old, or one too many
            oldest, (_, used) = next(iter(self._sessions.items()))
            if len(self._sessions) <= DEDICATED_HANDLES and now - used < ttl:
                return handle
            del self._sessions[oldest]

    def _forget(self, name: str, lane: LaneClient | None = None) -> None:
        """Drop the handle of actor `name` (it is looked up again on its next call), and `lane`,
        the lane that failed, if it is still this host's: never a lane opened since (a healthy
        host's, whose turns would be cut and run again). Any other lane stays: a Ray call that
        failed says nothing of a lane that works (a stale handle's error, say)."""
        self._handles.pop(name, None)
        self._sessions.pop(name, None)
        self._unresponsive_until.pop(name, None)  # a host lost, or retired: its successor is asked anew
        if lane is not None:
            self._drop_lane(name, lane)

    def _drop_lane(self, name: str, lane: LaneClient | None = None) -> None:
        """Close host `name`'s lane; only if it is `lane`, when given."""
        if lane is not None and self._lanes.get(name) is not lane:
            return
        current = self._lanes.pop(name, None)
        if current is not None:
            current.close()

    def close_lanes(self) -> None:
        """Close every lane connection (turns still waiting on one raise LaneBroken)."""
        for name in list(self._lanes):
            self._drop_lane(name)

    async def _lane(self, name: str, handle: Any) -> LaneClient | None:
        """The lane client of host `name`: its address is asked of the host (a Ray call) once,
        and again after the connection failed (a restarted host listens on another port)."""
        lane = self._lanes.get(name)
        if lane is not None and not lane.broken:
            return lane
        if lane is None and name in self._lanes:
            unreachable = self._unreachable.get(name)
            if unreachable is None or time.monotonic() < unreachable[1]:
                return None  # the host has no lane, or it could not be reached a moment ago
        lookup = self._lane_lookups.get(name)
        if lookup is None:
            lookup = self._lane_lookups[name] = asyncio.ensure_future(self._lookup_lane(name, handle))
            lookup.add_done_callback(lambda _: self._lane_lookups.pop(name, None))
        return await asyncio.shield(lookup)

    async def _lookup_lane(self, name: str, handle: Any) -> LaneClient | None:
        """Ask host `name` for its lane's address. Raises what HOST_LOST names (the host is gone:
        the caller's host-lost handling); any other failure means no lane for now (None)."""
        self._drop_lane(name)
        try:
            lane_method = handle.lane
        except AttributeError:  # a host of an earlier version, without a lane: Ray's path only
            raw = None
        else:
            try:
                raw = await asyncio.wait_for(_plain(lane_method.remote()), LANE_LOOKUP_TIMEOUT_S)
            except HOST_LOST:
                raise
            except TimeoutError:
                log.warning("session_host_unresponsive", host=name, waited_s=LANE_LOOKUP_TIMEOUT_S,
                            asked="lane address")
                # the next turns are refused at once for a while, not each held for another lookup
                self._unresponsive_until[name] = time.monotonic() + UNRESPONSIVE_RETRY_S
                raise _unresponsive() from None
            except Exception as exc:  # noqa: BLE001 - the host raised (restarting, shutting down)
                # The turn goes through Ray, whose answer says what is wrong in the host's words;
                # this error's text is not passed on (a RayTaskError's holds the host's traceback).
                log.warning("session_host_lane_lookup_failed", host=name, error=type(exc).__name__,
                            retry_in_s=LANE_LOOKUP_RETRY_S)
                self._lanes[name] = None
                self._unreachable[name] = (None, time.monotonic() + LANE_LOOKUP_RETRY_S)
                return None
        address = None if raw is None else msgspec.json.decode(raw, type=LaneAddress)
        unreachable = self._unreachable.pop(name, None)
        if address is not None and unreachable is not None and unreachable[0] == address \
                and time.monotonic() < unreachable[1]:
            self._unreachable[name] = unreachable  # the same process, still unreachable: Ray's path
            address = None
        lane = None if address is None else LaneClient(address)
        self._lanes[name] = lane
        return lane

    def _lane_unreachable(self, name: str, lane: LaneClient, exc: LaneUnreachable) -> None:
        """Nothing was sent: this turn and the host's next ones for LANE_RETRY_S go through Ray
        (a host that died and came back listens elsewhere: its new address is used at once)."""
        if self._lanes.get(name) is lane:  # not a lane looked up since
            del self._lanes[name]
        self._unreachable[name] = (lane.address, time.monotonic() + LANE_RETRY_S)
        log.warning("session_host_lane_unreachable", host=name, error=str(exc), retry_in_s=LANE_RETRY_S)

    def _routed_handle(self, name: str) -> Any:
        """The handle a turn goes to. A shard host that does not exist is not created here at
        once: hosts are created by `start_hosts` and by the operator's `rescale`/`restart_hosts`,
        and one that is missing is being replaced (restart-hosts) or was retired while this
        gateway's shard state was behind. Until it has been missing for MISSING_HOST_GRACE_S the
        turn is refused as "restarting" (503 + Retry-After, nothing ran); after that the host is
        created, so a host killed by hand comes back."""
        if self._mode != "sharded" or name in self._handles:
            return self._handle(name)
        try:
            handle = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            first = self._missing.setdefault(name, time.monotonic())
            if time.monotonic() - first < MISSING_HOST_GRACE_S:
                raise _restarting() from None
            log.warning("session_host_recreated", host=name)
            return self._handle(name)
        self._missing.pop(name, None)
        self._handles[name] = handle
        return handle

    async def start_hosts(self) -> list[str]:
        """Create (or find) the shard hosts and wait until each is ready."""
        if self._mode != "sharded":
            return []
        names = [self._prefix + host_name(i) for i in range(self._state.shards)]
        return list(await asyncio.gather(*(self._handle(n).ready.remote() for n in names)))

    def _takes_new_id(self, name: str) -> bool:
        """Whether host `name` takes `new_id`: its lane address says so, and that lane is still
        open. A host that died or restarted (perhaps on an earlier version) broke the lane when
        its process ended, so the features of a broken or unreachable lane count for nothing."""
        lane = self._lanes.get(name)
        return lane is not None and not lane.broken and NEW_ID in lane.address.features

    async def _call(self, tenant_id: str, session_id: str, method: str, *args: Any, new_id: bool = False) -> Any:
        """`new_id`: the turn's message id was made up for it (SessionHost.send); said to the
        host on the first attempt only, since a retry may repeat a turn that ran."""
        turn = method in LANE_METHODS
        for attempt in (0, 1):
            # routed again on the retry: the host may have died because a rescale retired it
            name = self.actor_name(tenant_id, session_id)
            if self._mode == "dedicated":
                self._quota.admit(tenant_id, name)  # before any call could create its actor
            self._refuse_if_unresponsive(name)  # Ray's path to a hung host would hang as well
            handle = self._routed_handle(name)
            seen = self._lanes.get(name) if turn else None  # the host's lane as this call found it
            failed: LaneClient | None = None  # the lane this call failed on
            try:
                if self._use_lanes and turn:
                    lane = await self._lane(name, handle)
                    if lane is not None and (method in TURN_METHODS or EVENTS in lane.address.features):
                        try:
                            return await lane.call(method, *args, *self._new_id_arg(name, new_id and not attempt))
                        except LaneUnreachable as exc:
                            self._lane_unreachable(name, lane, exc)
                        except (LaneStalled, LaneError) as exc:
                            raise _lane_failure(name, exc) from exc
                        except LaneBroken:
                            failed = lane
                            raise
                # A turn that Ray says was lost to its host's failure takes the lane this call
                # found with it (the same host's, which failed too); a view's or a passivation's
                # takes none (a stale handle's error, say, while the lane serves turns).
                failed = seen
                return await _plain(getattr(handle, method).remote(*args))  # no open lane: no new_id either
            except (*HOST_LOST, LaneBroken) as exc:
                # A broken lane is a host that died, is restarting or was retired, as Ray's errors
                # are. The turn may have run: the retry carries its message id (or approval id),
                # and the host answers one it has answered (or decided) with the stored reply.
                self._forget(name, failed)
                if attempt:
                    raise _restarting() from exc
                log.warning("session_host_unavailable", host=name, error=type(exc).__name__)
                await asyncio.sleep(0.2)
        raise AssertionError("unreachable")

    def _refuse_if_unresponsive(self, name: str) -> None:
        """503 "host_unresponsive" at once, having sent nothing, while host `name`'s lane finds it
        hung (LaneClient.stalled): a turn, a streamed one, a view or a passivation would wait on it."""
        lane = self._lanes.get(name)
        if lane is not None and lane.stalled and not lane.broken:
            raise _unresponsive()
        until = self._unresponsive_until.get(name)
        if until is not None:
            if time.monotonic() < until:
                raise _unresponsive()
            del self._unresponsive_until[name]

    def _new_id_arg(self, name: str, new_id: bool) -> tuple[bool, ...]:
        """`new_id` as the last argument of a turn, for a host that takes it; nothing otherwise."""
        return (True,) if new_id and self._takes_new_id(name) else ()

    async def _turn_call(
        self, tenant_id: str, session_id: str, method: str, *args: Any, new_id: bool = False
    ) -> TurnReply:
        """A turn on the session's host; while the session moves between hosts (the host answers
        "moved", having run nothing) route again by the newest shard state and retry, and while
        its dedicated actor exits (refused, having run nothing) retry on the one that follows."""
        deadline = time.monotonic() + MOVED_RETRY_S
        delay = 0.02
        while True:
            raw = await self._call(tenant_id, session_id, method, *args, new_id=new_id)
            new_id = False  # that call may have retried a turn that ran before it came back "moved"
            result = result_decoder.decode(raw)
            error = result.error
            if error is None or not self._ran_nothing(error.reason) or time.monotonic() > deadline:
                return _unwrap(result)
            if error.reason == "moved":
                if error.shard_state is not None and self.apply_shard_state(error.shard_state):
                    continue  # a newer count: the session's host is known now
            else:
                self._forget(self.actor_name(tenant_id, session_id))
            await asyncio.sleep(delay)  # a rescale between its two steps, or an exit: either ends soon
            delay = min(delay * 2, 0.25)

    def _ran_nothing(self, reason: str | None) -> bool:
        """A turn refused for `reason` ran nothing and is retried by the gateway: "moved" (a shard
        host hands its sessions on), or "shutting_down" from a dedicated actor, whose session has
        passivated and whose process is about to be killed by its idle watchdog; the next call
        creates a new actor (get_if_exists), which re-activates the session from Postgres. A shard
        host shutting down is a restart or a stop the operator asked for: the client retries."""
        return reason == "moved" or (reason == "shutting_down" and self._mode == "dedicated")

    async def send(self, turn: Turn, *, new_id: bool = False) -> TurnReply:
        return await self._turn_call(turn.tenant_id, turn.session_id, "send", encode_command(turn),
                                     new_id=new_id)

    async def decide(self, decision: ApprovalDecision) -> TurnReply:
        return await self._turn_call(decision.tenant_id, decision.session_id, "decide",
                                     encode_command(decision))

    async def act(self, command: SessionCommand) -> TurnReply:
        """An agent's message or a handoff's change, run by the session's host (SessionHost.act)."""
        return await self._turn_call(command.tenant_id, command.session_id, "act", encode_command(command))

    async def watch(self, tenant_id: str, session_id: str, after: int, wait_s: float) -> list[SessionEvent]:
        """The session's written events after `after`, from its host (SessionHost.watch): waits
        up to `wait_s` for new ones. While the session moves between hosts, routes again."""
        deadline = time.monotonic() + MOVED_RETRY_S
        delay = 0.02
        while True:
            raw = await self._call(tenant_id, session_id, "watch", tenant_id, session_id, after, wait_s)
            result = watch_decoder.decode(raw)
            error = result.error
            if error is None:
                return result.events
            if not self._ran_nothing(error.reason) or time.monotonic() > deadline:
                raise _host_exception(error)
            if error.reason == "moved":
                if error.shard_state is not None and self.apply_shard_state(error.shard_state):
                    continue
            else:
                self._forget(self.actor_name(tenant_id, session_id))
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.25)

    async def stream(self, command: TurnCommand, *, new_id: bool = False) -> AsyncIterator[StreamEvent]:
        """The turn's events; a turn that fails raises its error (as `send` does) once the events
        before it are out."""
        tenant_id, session_id = command.tenant_id, command.session_id
        encoded = encode_command(command)
        deadline = time.monotonic() + MOVED_RETRY_S
        delay = 0.02
        exiting = False  # an earlier attempt was refused by a dedicated actor about to be killed
        while True:  # a refusal ran nothing: a message id new before is new still
            name = self.actor_name(tenant_id, session_id)
            self._refuse_if_unresponsive(name)
            seen = self._lanes.get(name)  # a turn lost to its host's failure takes this lane with it (_call)
            refused: ShardState | bool | None = None  # None: no event yet; truthy: retry
            try:
                async for raw in self._stream_events(name, encoded, new_id=new_id):
                    event = event_decoder.decode(raw)
                    reason = _refusal(event)
                    if refused is None and self._ran_nothing(reason) and time.monotonic() < deadline:
                        raw = event.data.get("shard_state")  # the first event: nothing ran
                        refused = msgspec.convert(raw, ShardState) if raw else True
                        if reason == "shutting_down":
                            exiting = True
                            self._forget(name)
                        continue
                    refused = False
                    if event.event == "error":
                        raise _host_exception(_host_error(event.data))
                    yield event
            except (*HOST_LOST, LaneBroken) as exc:  # the host died (or its lane broke) mid-stream
                self._forget(name, seen)
                if not (exiting and refused is None and time.monotonic() < deadline):
                    raise _restarting() from exc
                # the exiting actor was killed as this call reached it: the next call creates a
                # new one. Said as not new: had a new actor begun the turn and died, the retry is
                # answered as any retried message id is (the stored reply, if it was stored).
                new_id = False
                refused = True
            if not refused:
                return
            if not (isinstance(refused, ShardState) and self.apply_shard_state(refused)):
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.25)

    async def _stream_events(self, name: str, *args: Any, new_id: bool) -> AsyncIterator[bytes]:
        """A streamed turn's encoded events from host `name`: over its lane when the lane carries
        streams, else (or when the lane cannot be connected to: nothing was sent) through Ray's
        streaming generator. Raises what either path raises for a host lost, and 503
        "host_unresponsive" for a hung one."""
        handle = self._routed_handle(name)
        lane = await self._lane(name, handle) if self._use_lanes else None
        if lane is not None and STREAM in lane.address.features:
            try:
                # new_id after the lookup: the lane says whether the host takes it
                async for raw in lane.stream("stream", *args, *self._new_id_arg(name, new_id)):
                    yield raw
                return
            except LaneUnreachable as exc:  # raised before any event: nothing was sent
                self._lane_unreachable(name, lane, exc)
            except (LaneStalled, LaneError) as exc:
                raise _lane_failure(name, exc) from exc
        # through Ray: new_id only to a host whose open lane says it takes it (none once unreachable)
        async for ref in handle.stream.options(num_returns="streaming").remote(*args, *self._new_id_arg(name, new_id)):
            yield await ref

    def _absent(self, tenant_id: str, session_id: str) -> bool:
        """Dedicated and no actor runs the session: it is not live, and reading it (or passivating
        it) must not start a process that no turn would ever stop."""
        if self._mode != "dedicated":
            return False
        try:
            ray.get_actor(self.actor_name(tenant_id, session_id), namespace=NAMESPACE)
        except ValueError:
            return True
        return False

    async def view(self, tenant_id: str, session_id: str) -> SessionView | None:
        if self._absent(tenant_id, session_id):
            return None  # not live: the gateway reads the stored session instead
        raw = await self._call(tenant_id, session_id, "view", tenant_id, session_id)
        return None if raw is None else msgspec.json.decode(raw, type=SessionView)

    async def contract(self, tenant_id: str) -> dict[str, Any]:
        """The tool-contract report, computed by a session host (its registry is what runs)."""
        index = rendezvous_index(tenant_id, self._state.shards)
        return await _plain(self._handle(self._prefix + host_name(index)).contract.remote(tenant_id))

    async def passivate(self, tenant_id: str, session_id: str) -> bool:
        if self._absent(tenant_id, session_id):
            return True  # nothing live to passivate
        done = await self._call(tenant_id, session_id, "passivate", tenant_id, session_id)
        if done and self._mode == "dedicated":
            self._forget(self.actor_name(tenant_id, session_id))  # its actor exits at its next idle check
        return done

    def host_handles(self, shards: int | None = None) -> list[Any]:
        """Handles of the shard hosts that exist (named lookups; missing ones skipped)."""
        handles = []
        for i in range(shards or self._state.shards):
            try:
                handles.append(ray.get_actor(self._prefix + host_name(i), namespace=NAMESPACE))
            except ValueError:
                continue
        return handles

    def host_names(self) -> list[str]:
        """The shard hosts this placement's count says exist ([] for dedicated): the hosts a
        scrape expects an answer from, whether or not one comes."""
        return [self._prefix + host_name(i) for i in range(self._state.shards)] if self._mode == "sharded" else []

    async def stats(self, timeout_s: float = STATS_TIMEOUT_S) -> list[dict[str, Any]]:
        """The stats of the shard hosts that answer within `timeout_s` (a hung host must not hang
        a /metrics scrape)."""
        handles = self.host_handles() if self._mode == "sharded" else []

        results = await asyncio.gather(*(_stats(h, timeout_s) for h in handles), return_exceptions=True)
        return [r for r in results if isinstance(r, dict)]

    def session_handles(self) -> list[Any]:
        """Handles of the dedicated session actors of this placement's group alive in Ray now,
        found by name (one GCS listing): not only the ones this gateway routed to lately."""
        handles = []
        for name in self._named_actors():
            if name.startswith(self._prefix + SESSION_PREFIX):
                with contextlib.suppress(ValueError):  # exited since it was listed
                    handles.append(ray.get_actor(name, namespace=NAMESPACE))
        return handles

    def _group_handles(self, shards: int | None = None) -> list[Any]:
        return self.host_handles(shards) if self._mode == "sharded" else self.session_handles()

    async def actor_stats(self) -> list[dict[str, Any]]:
        """Stats of every actor of this placement's group alive now: its shard hosts, or its
        dedicated session actors (what the benchmark measures; one call per actor)."""
        handles = self._group_handles()
        results = await asyncio.gather(*(h.stats.remote() for h in handles), return_exceptions=True)
        return [r for r in results if isinstance(r, dict)]

    async def shutdown_hosts(self, shards: int | None = None) -> None:
        """Flush and stop every actor of this placement's group (its shard hosts, or its
        dedicated session actors), then kill them."""
        handles = self._group_handles(shards)
        await asyncio.gather(*(h.shutdown.remote() for h in handles), return_exceptions=True)
        for h in handles:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(h, no_restart=True)
        self._handles.clear()
        self._sessions.clear()
        self.close_lanes()


    # -- rescaling (the operator's path: `chat-engine scale N`) ---------------------------------

    @staticmethod
    def _named_actors() -> list[str]:
        """Names of the engine's named actors alive in Ray now (whatever this driver's namespace)."""
        return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE]

    def existing_hosts(self) -> dict[int, str]:
        """Index -> actor name of every shard host of this placement's group alive in Ray now."""
        found: dict[int, str] = {}
        for name in self._named_actors():
            parsed = parse_host_name(name)
            if parsed is not None and parsed[0] == self._prefix:
                found[parsed[1]] = name
        return found

    async def rescale(self, target: int, store: ShardStore, *, ack_timeout_s: float = 60.0) -> RescaleReport:
        """Change the number of shard hosts to `target` while traffic flows.

        1. the hosts 0..target-1 exist and are ready (new ones run the settings of the running
           hosts, not this process's); 2. pending: every host adopts (shards=old, pending=target)
           and flushes and drops the sessions it no longer owns; a moving session is owned by no
           host now, its turns are answered "moved" and the gateways retry; 3. commit: every host
           adopts (shards=target): the new owners activate moved sessions from Postgres under a
           new lease epoch; 4. hosts beyond `target` flush, stop and are killed.
        Between 2 and 3 a moving session has no owner, so whatever stops this rescale there (a
        host that does not acknowledge step 2 within `ack_timeout_s`, the commit write failing,
        this process cancelled) still commits a count, retried with backoff: the old one (nothing
        moved yet) unless every host acknowledged step 2, the target then (a retry that gets
        through completes the rescale). RescaleFailed is raised for a failure, and also when
        Postgres took no commit at all: the state stays pending, and a host that refuses a turn
        rolls it back once Postgres answers (ClusterRepo.settle_abandoned), as it does for a
        rescale whose process died; the next rescale takes over such a state too.
        Raises Conflict when another rescale of this group is running.
        """
        if self._mode != "sharded":
            raise ConfigError("CE_PLACEMENT=dedicated has no shard count to scale", variable="CE_PLACEMENT")
        if target < 1:
            raise ConfigError(f"the shard count must be >= 1, got {target}", variable="CE_SHARDS")
        started_at = time.monotonic()
        group = self._prefix
        async with store.exclusive(group):
            before = await store.ensure(group, self._state.shards)
            if before.pending is not None:
                # left by a rescale that stopped between its steps (we hold the lock: it is not
                # running); this one's pending step, over the same count in force, replaces it
                log.warning("abandoned_rescale_found", shards=before.shards, pending=before.pending,
                            generation=before.generation)
            self.apply_shard_state(before)
            existing = self.existing_hosts()
            blob = await self._running_settings(existing)
            wanted = {i: self._prefix + host_name(i) for i in range(target)}
            started = [n for i, n in wanted.items() if i not in existing]
            await asyncio.gather(*(self._handle(n, blob).ready.remote() for n in wanted.values()))
            everyone = sorted({*existing.values(), *wanted.values()})

            pending = await store.begin(group, target)
            settle_at = pending.shards  # what to commit should this stop: nothing has moved yet
            released = 0
            try:
                released = sum(await self._announce(everyone, pending, ack_timeout_s))
                settle_at = target  # every host let go of what moves: the target may be committed
                committed = await store.commit(group, target, generation=pending.generation)
            except BaseException as exc:
                committed = await self._settle(store, pending, settle_at, everyone)
                if not _stands(committed, settle_at):
                    if not isinstance(exc, Exception):
                        raise  # cancelled; the state is settled as far as it could be
                    raise RescaleFailed(_unsettled(exc, committed, pending, settle_at)) from exc
                if settle_at != target or not isinstance(exc, Exception):
                    raise  # the old count is back in force (RescaleFailed says which host), or cancelled
                log.warning("rescale_commit_retried", shards=target, error=type(exc).__name__)
            else:
                if not _stands(committed, target):
                    # our lock went with a dropped connection and a host settled the state first
                    if committed.pending is None:
                        await self._announce(everyone, committed, 5.0, best_effort=True)
                        self.apply_shard_state(committed)
                    raise RescaleFailed(_unsettled(None, committed, pending, target))
                await self._announce(everyone, committed, ack_timeout_s, best_effort=True)
                self.apply_shard_state(committed)

            retired = [n for i, n in sorted(existing.items()) if i >= target]
            await self._drain(retired)
            await self._retire(retired)
        report = RescaleReport(
            before=before.shards, after=target, generation=committed.generation, released=released,
            started=started, retired=retired, seconds=round(time.monotonic() - started_at, 3),
        )
        log.info("rescaled", **msgspec.to_builtins(report))
        return report

    async def _settle(self, store: ShardStore, pending: ShardState, count: int, names: list[str]) -> ShardState | None:
        """Commit `count` over this rescale's `pending` state, retried with backoff (a commit whose
        answer was lost is found written), then push the stored state to the hosts if it is
        committed (best effort: a host that missed it catches up on the first turn it refuses).
        Returns the stored state, or None when Postgres took no commit."""
        delay = COMMIT_BACKOFF_S
        for attempt in range(1, COMMIT_ATTEMPTS + 1):
            try:
                state = await store.commit(self._prefix, count, generation=pending.generation)
            except Exception as exc:  # noqa: BLE001 - Postgres away for a moment: try again
                log.warning("rescale_commit_failed", shards=count, attempt=attempt, error=type(exc).__name__)
                if attempt == COMMIT_ATTEMPTS:
                    return None
                await asyncio.sleep(delay)
                delay *= 2
                continue
            if state.pending is None:  # committed: by this rescale, or settled by a host first
                await self._announce(names, state, 5.0, best_effort=True)
                self.apply_shard_state(state)
            return state
        raise AssertionError("unreachable")

    async def restart_hosts(self, *, timeout_s: float = 60.0) -> list[str]:
        """Re-create every shard host, one at a time, from this placement's settings.

        A host keeps the settings it was created with for its whole life (Ray restarts it with
        the same arguments), so a setting the hosts use (a rotated CE_SECRET_KEY or
        ANTHROPIC_API_KEY, another model) reaches them only through this. Each host flushes and
        stops first; its sessions answer 503 + Retry-After until the new process is ready
        (about a second), then re-activate from Postgres. Returns the names restarted.
        """
        if self._mode != "sharded":
            raise ConfigError("CE_PLACEMENT=dedicated has no shard hosts to restart", variable="CE_PLACEMENT")
        restarted = []
        for _, name in sorted(self.existing_hosts().items()):
            await self._retire([name])
            deadline = time.monotonic() + timeout_s
            while True:  # the name is free once Ray has the old actor dead
                try:
                    ray.get_actor(name, namespace=NAMESPACE)
                except ValueError:
                    break
                if time.monotonic() > deadline:
                    raise RescaleFailed(f"session host {name} did not stop within {timeout_s:.0f} s; run it again",
                                        host=name)
                await asyncio.sleep(0.1)
            await asyncio.wait_for(self._handle(name).ready.remote(), timeout_s)
            restarted.append(name)
            log.info("session_host_restarted", host=name)
        return restarted

    async def _running_settings(self, existing: dict[int, str]) -> bytes:
        for index in sorted(existing):
            try:
                return await ray.get_actor(existing[index], namespace=NAMESPACE).encoded_settings.remote()
            except Exception as exc:  # noqa: BLE001 - try the next host; none answers: our own settings
                log.warning("host_settings_unavailable", host=existing[index], error=type(exc).__name__)
        return self._encoded

    async def _announce(self, names: list[str], state: ShardState, timeout_s: float,
                        *, best_effort: bool = False) -> list[int]:
        """Push `state` to every host and wait for each to release what it no longer owns.

        A host that Ray is restarting reads the state from Postgres when it comes back; it is
        asked again until it answers or `timeout_s` passes. Returns what each host released.
        """
        raw = msgspec.json.encode(state)

        async def one(name: str) -> int:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    handle = ray.get_actor(name, namespace=NAMESPACE)
                    return await asyncio.wait_for(handle.set_shard_state.remote(raw), timeout_s)
                except Exception as exc:  # restarting, or looked up during a restart
                    if time.monotonic() > deadline:
                        if best_effort:
                            log.warning("shard_state_not_acknowledged", host=name, error=type(exc).__name__)
                            return 0
                        raise RescaleFailed(
                            f"session host {name} did not acknowledge shard state generation "
                            f"{state.generation} within {timeout_s:.0f} s ({type(exc).__name__}); the previous "
                            "count stays in force: check the host (ray list actors), then run the scale again",
                            host=name,
                        ) from exc
                    await asyncio.sleep(0.5)

        return list(await asyncio.gather(*(one(n) for n in names)))

    async def _drain(self, names: list[str]) -> None:
        deadline = time.monotonic() + RETIRE_DRAIN_S
        pending = list(names)
        while pending and time.monotonic() < deadline:
            await asyncio.sleep(RETIRE_QUIET_S)
            # a hung host's read times out, a host gone meanwhile raises: neither takes turns any more
            stats = await asyncio.gather(*(_stats_of(n) for n in pending), return_exceptions=True)
            pending = [n for n, st in zip(pending, stats, strict=True)
                       if isinstance(st, dict) and st.get("idle_s", RETIRE_QUIET_S) < RETIRE_QUIET_S]

    async def _retire(self, names: list[str]) -> None:
        """Stop hosts `names`, all at once (they own nothing any more, so no order is needed, and
        one after another N slow or hung hosts would hold the command N times as long)."""
        await asyncio.gather(*(self._retire_one(name) for name in names))

    async def _retire_one(self, name: str) -> None:
        """Stop host `name`: it flushes and stops (up to RETIRE_SHUTDOWN_S), then is killed. A host
        that does not answer a stats read within RETIRE_PROBE_S (hung, or stopped) is killed at
        once: it could not flush, and with the output gate on every turn it acknowledged is in
        Postgres already."""
        try:
            handle = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return
        if await _answers(handle):
            try:
                await asyncio.wait_for(handle.shutdown.remote(), RETIRE_SHUTDOWN_S)
            except Exception:  # noqa: BLE001 - it owns nothing any more; stop it anyway
                log.warning("retired_host_shutdown_failed", host=name)
        else:
            log.warning("retired_host_unresponsive", host=name, waited_s=RETIRE_PROBE_S,
                        detail="killed without its flush")
        ray.kill(handle, no_restart=True)
        self._forget(name)
        self._drop_lane(name)


async def _stats(handle: Any, timeout_s: float) -> dict[str, Any]:
    """A host's stats, waited for `timeout_s` at most (TimeoutError: a hung host)."""
    return await asyncio.wait_for(_plain(handle.stats.remote()), timeout_s)


async def _stats_of(name: str) -> dict[str, Any]:
    """Host `name`'s stats within STATS_TIMEOUT_S; raises ValueError for a host that no longer exists."""
    return await _stats(ray.get_actor(name, namespace=NAMESPACE), STATS_TIMEOUT_S)


async def _answers(handle: Any) -> bool:
    """Whether a host answers a stats read within RETIRE_PROBE_S (an error is an answer: the
    host's loop ran; only silence means hung)."""
    try:
        await _stats(handle, RETIRE_PROBE_S)
    except TimeoutError:
        return False
    except Exception:  # noqa: BLE001
        return True
    return True


async def _plain(ref: Any) -> Any:
    """The result of a host call; an error of ours the host raised is raised as itself. Ray raises
    it as a RayTaskError that is also of its class, whose text is the host's whole traceback (file
    paths, pid, actor id): the gateway answers with an error's text, so that must not reach it."""
    try:
        return await ref
    except RayTaskError as exc:
        if isinstance(exc.cause, ChatEngineError):
            raise exc.cause from exc
        raise


def _stands(state: ShardState | None, count: int) -> bool:
    """Whether `state` has `count` shards committed (no rescale pending)."""
    return state is not None and state.pending is None and state.shards == count


def _unsettled(exc: BaseException | None, stored: ShardState | None, pending: ShardState, count: int) -> str:
    """What a rescale that could not commit `count` over `pending` says happened, and what to do."""
    if exc is None:
        cause = ""
    elif isinstance(exc, RescaleFailed) and exc.host is not None:
        cause = f" after session host {exc.host} did not acknowledge the pending state"
    else:
        cause = f" after {type(exc).__name__}: {exc}"
    if stored is None:
        return (f"the shard count could not be committed{cause}: Postgres refused {COMMIT_ATTEMPTS} attempts, so "
                f"the state is left pending ({pending.shards} -> {pending.pending}) and the sessions that move "
                "have no host; once Postgres answers, a host rolls it back on the first turn it refuses, or run "
                "the scale again")
    return (f"the shard state changed under this rescale{cause} (now {stored.shards} shards"
            f"{'' if stored.pending is None else f', {stored.pending} pending'}, generation {stored.generation}): "
            "its lock went with a dropped Postgres connection and the state was settled elsewhere; run the "
            "scale again")


def _refusal(event: StreamEvent) -> str | None:
    """The reason of an `error` event (a refusal when it is a stream's first), else None."""
    if event.event == "error" and isinstance(event.data, dict):
        return event.data.get("reason")
    return None


def _host_error(data: Any) -> HostError:
    """A stream's `error` event as the HostError it carries. A host of an older version sent
    `title`, `detail` and, when a retry helps, `retry_after` and `reason`: those are kept."""
    try:
        return msgspec.convert(data, HostError)
    except msgspec.ValidationError:
        old = data if isinstance(data, dict) else {}
        message = str(old.get("detail") or "the session host failed to run this turn; retry shortly")
        retry_after = old.get("retry_after")
        if isinstance(retry_after, int | float):
            return HostError(kind="overloaded", message=message, retry_after=float(retry_after),
                             reason=str(old.get("reason") or "host_busy"))
        return HostError(kind="internal", message=message)


def _restarting() -> Overloaded:
    return Overloaded("the session host is restarting; retry with the same message_id", retry_after=1.0,
                      reason="restarting")


def _lane_failure(name: str, exc: LaneStalled | LaneError) -> ChatEngineError:
    """What a turn raises when host `name`'s lane found it hung (503 "host_unresponsive"), or
    answered it with an error (its dispatcher failed, a reply over the frame limit): the host
    logged why, and the client gets a 500 that says so, not an unhandled error."""
    if isinstance(exc, LaneStalled):
        return _unresponsive()
    log.error("session_host_lane_error", host=name, error=str(exc)[:200])
    return HostFailure(HostError(kind="internal", message="the session host failed to run this turn; it logged "
                                 "why (lane_dispatch_failed or lane_reply_too_large)"))


def _unresponsive() -> Overloaded:
    return Overloaded(f"the session host has not answered for {PING_TIMEOUT_S:.0f} s or more (hung, or stopped); "
                      "retry with the same message_id after Retry-After, a turn that reached it runs once at most",
                      retry_after=UNRESPONSIVE_RETRY_S, reason="host_unresponsive")


def _host_exception(error: HostError) -> ChatEngineError:
    """What a turn that the host answered with `error` raises, JSON or streamed."""
    if error.kind in ("overloaded", "lease_lost", "unavailable"):
        return Overloaded(error.message, retry_after=error.retry_after or 1.0,
                          reason=error.reason or ("restarting" if error.kind == "lease_lost" else "host_busy"))
    return HostFailure(error)


def _unwrap(result: HostResult) -> TurnReply:
    if result.error is not None:
        raise _host_exception(result.error)
    assert result.reply is not None
    return result.reply
