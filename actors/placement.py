"""Placement: which Ray actor hosts a session, and the gateway's one door to the session actors.

`sharded` (default): CE_SHARDS named session-host actors, a session goes to a host by rendezvous
hashing of `tenant_id:session_id` (changing the shard count moves only the sessions whose winner
changed; their new host re-activates them under a newer lease epoch). `dedicated`: one named actor
per session (`get_if_exists`), one process each. Both run the same SessionHost code.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import ray
import structlog
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from actors.ray_host import HostError, HostResult, SessionHostActor, event_decoder, result_decoder
from services.errors import ChatEngineError, Overloaded
from services.settings import Settings
from services.wire import SessionView, StreamEvent, TurnReply
from storage.records import session_uid

log = structlog.get_logger(__name__)

NAMESPACE = "chat-engine"
HOST_PREFIX = "ce-host-"
SESSION_PREFIX = "ce-session-"

RemoteHost = ray.remote(SessionHostActor)


class HostFailure(ChatEngineError):
    """The session host answered with an error; `error.kind` says which."""

    def __init__(self, error: HostError) -> None:
        super().__init__(error.message)
        self.error = error


def rendezvous_index(key: str, shards: int) -> int:
    """The shard that wins `key` by highest-random-weight hashing (stable across processes)."""
    best, best_score = 0, b""
    for i in range(shards):
        score = hashlib.blake2b(f"{i}\x00{key}".encode(), digest_size=8).digest()
        if score > best_score:
            best, best_score = i, score
    return best


def host_name(index: int) -> str:
    return f"{HOST_PREFIX}{index}"


class Placement:
    """Routes turns to session actors; handles are cached, a dead one is looked up again once."""

    def __init__(self, settings: Settings, *, shards: int | None = None, prefix: str = "") -> None:
        """`prefix` goes in front of every actor name: hosts of another configuration (the
        benchmark's gate-off hosts, say) live beside the default ones under their own names."""
        self._settings = settings
        self._prefix = prefix
        self._encoded = msgspec.json.encode(settings)
        self._mode = settings.placement
        self._shards = shards or settings.shards
        self._handles: dict[str, Any] = {}

    @property
    def mode(self) -> str:
        return self._mode

    @property
    def shards(self) -> int:
        return self._shards

    def set_shards(self, shards: int) -> None:
        """Route by a new shard count from now on (moved sessions re-activate on their new host)."""
        self._shards = shards

    def actor_name(self, tenant_id: str, session_id: str) -> str:
        if self._mode == "dedicated":
            return self._prefix + SESSION_PREFIX + session_uid(tenant_id, session_id)
        return self._prefix + host_name(rendezvous_index(f"{tenant_id}:{session_id}", self._shards))

    def _handle(self, name: str) -> Any:
        handle = self._handles.get(name)
        if handle is None:
            handle = RemoteHost.options(
                name=name, namespace=NAMESPACE, get_if_exists=True, lifetime="detached",
                num_cpus=0, max_restarts=-1, max_task_retries=0, max_concurrency=10_000,
                scheduling_strategy="SPREAD" if self._mode == "sharded" else "DEFAULT",
            ).remote(name, self._encoded, self._mode == "dedicated")
            self._handles[name] = handle
        return handle

    def _forget(self, name: str) -> None:
        self._handles.pop(name, None)

    async def start_hosts(self) -> list[str]:
        """Create (or find) the shard hosts and wait until each is ready."""
        if self._mode != "sharded":
            return []
        names = [self._prefix + host_name(i) for i in range(self._shards)]
        return list(await asyncio.gather(*(self._handle(n).ready.remote() for n in names)))

    async def _call(self, tenant_id: str, session_id: str, method: str, *args: Any) -> Any:
        name = self.actor_name(tenant_id, session_id)
        for attempt in (0, 1):
            handle = self._handle(name)
            try:
                return await getattr(handle, method).remote(*args)
            except (ActorDiedError, ActorUnavailableError, RayActorError) as exc:
                self._forget(name)
                if attempt:
                    raise Overloaded(
                        "the session host is restarting; retry with the same message_id", retry_after=1.0,
                        reason="restarting",
                    ) from exc
                log.warning("session_host_unavailable", host=name, error=type(exc).__name__)
                await asyncio.sleep(0.2)
        raise AssertionError("unreachable")

    async def send(self, tenant_id: str, session_id: str, text: str, message_id: str | None) -> TurnReply:
        raw = await self._call(tenant_id, session_id, "send", tenant_id, session_id, text, message_id)
        return _unwrap(result_decoder.decode(raw))

    async def decide(
        self, tenant_id: str, session_id: str, approval_id: str, approve: bool, edited: dict | None = None
    ) -> TurnReply:
        raw = await self._call(tenant_id, session_id, "decide", tenant_id, session_id, approval_id, approve, edited)
        return _unwrap(result_decoder.decode(raw))

    async def stream(
        self, tenant_id: str, session_id: str, text: str | None, message_id: str | None,
        approval: tuple[str, bool, dict | None] | None = None,
    ) -> AsyncIterator[StreamEvent]:
        name = self.actor_name(tenant_id, session_id)
        handle = self._handle(name)
        try:
            gen = handle.stream.options(num_returns="streaming").remote(
                tenant_id, session_id, text, message_id, approval
            )
            async for ref in gen:
                yield event_decoder.decode(await ref)
        except (ActorDiedError, ActorUnavailableError, RayActorError):
            self._forget(name)
            yield StreamEvent(event="error", data={
                "kind": "overloaded", "message": "the session host is restarting; retry with the same message_id",
                "retry_after": 1.0,
            })

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
        index = rendezvous_index(tenant_id, self._shards)
        return await self._handle(self._prefix + host_name(index)).contract.remote(tenant_id)

    async def passivate(self, tenant_id: str, session_id: str) -> bool:
        if self._absent(tenant_id, session_id):
            return True  # nothing live to passivate
        return await self._call(tenant_id, session_id, "passivate", tenant_id, session_id)

    def host_handles(self, shards: int | None = None) -> list[Any]:
        """Handles of the shard hosts that exist (named lookups; missing ones skipped)."""
        handles = []
        for i in range(shards or self._shards):
            try:
                handles.append(ray.get_actor(self._prefix + host_name(i), namespace=NAMESPACE))
            except ValueError:
                continue
        return handles

    async def stats(self) -> list[dict[str, Any]]:
        handles = self.host_handles() if self._mode == "sharded" else []
        results = await asyncio.gather(*(h.stats.remote() for h in handles), return_exceptions=True)
        return [r for r in results if isinstance(r, dict)]

    async def actor_stats(self) -> list[dict[str, Any]]:
        """Stats of every actor this placement has a handle to (dedicated ones included)."""
        handles = list(self._handles.values())
        results = await asyncio.gather(*(h.stats.remote() for h in handles), return_exceptions=True)
        return [r for r in results if isinstance(r, dict)]

    async def shutdown_hosts(self, shards: int | None = None) -> None:
        """Flush and stop every host this placement knows of, then kill the actors."""
        handles = self.host_handles(shards) if self._mode == "sharded" else []
        handles += [h for n, h in self._handles.items() if n.startswith(self._prefix + SESSION_PREFIX)]
        await asyncio.gather(*(h.shutdown.remote() for h in handles), return_exceptions=True)
        for h in handles:
            try:
                ray.kill(h, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self._handles.clear()


def _unwrap(result: HostResult) -> TurnReply:
    if result.error is not None:
        if result.error.kind in ("overloaded", "lease_lost", "unavailable"):
            raise Overloaded(result.error.message, retry_after=result.error.retry_after or 1.0,
                             reason=result.error.reason or ("restarting" if result.error.kind == "lease_lost" else "host_busy"))
        raise HostFailure(result.error)
    assert result.reply is not None
    return result.reply
