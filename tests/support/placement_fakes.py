"""Stand-ins for what actors/placement.py and actors/ray_host.py reach outside the process.

`FakeRay` is the part of Ray's actor API that Placement calls (named actors: create with
`get_if_exists`, look up, list, kill; `handle.method.remote(...)`), installed over the `ray` and
`RemoteHost` names of `actors.placement`; a handle is bound to one actor, as Ray's is, so a call
through the handle of an actor killed since fails with RayActorError. `FakeShardStore` implements
`placement.ShardStore` and `ray_host.ShardSource` the way `storage.repos.cluster.ClusterRepo` does
on Postgres (tests/integration/test_storage_cluster.py): each change a new generation, NOTIFY to
the listeners, a compare-and-set commit, the rescale lock, `settle_abandoned`. Switches simulate
Postgres refusing a commit, or taking one and losing its answer.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import msgspec
from ray.exceptions import RayActorError

from actors import placement as placement_module
from kernel.errors import Conflict
from storage.repos.cluster import ShardState
from tests.support.host_fakes import StoreUnavailable


class FakeRay:
    """Named actors in this process; `make(name)` builds the actor a `get_if_exists` creates."""

    def __init__(self, make: Callable[[str], Awaitable[Any]]) -> None:
        self._make = make
        self.actors: dict[str, asyncio.Future[Any]] = {}
        self.created: list[str] = []
        self.killed: list[str] = []
        self.calls: list[tuple[str, str]] = []  # (actor name, method), through any handle
        # awaited before each call reaches its actor: may raise (the actor is unreachable) or hang
        self.intercept: Callable[[str, str, tuple], Awaitable[None]] | None = None
        self.util = SimpleNamespace(list_named_actors=self.list_named_actors)

    def install(self, monkeypatch: Any) -> FakeRay:
        monkeypatch.setattr(placement_module, "ray", self)
        monkeypatch.setattr(placement_module, "RemoteHost", _RemoteHost(self))
        return self

    def add(self, name: str, actor: Any) -> None:
        """An actor that exists already (created by another gateway, say)."""
        done = asyncio.get_running_loop().create_future()
        done.set_result(actor)
        self.actors[name] = done

    def create(self, name: str) -> FakeHandle:
        if name not in self.actors:
            self.created.append(name)
            self.actors[name] = asyncio.ensure_future(self._make(name))
        return FakeHandle(self, name, self.actors[name])

    def get_actor(self, name: str, namespace: str | None = None) -> FakeHandle:
        if name not in self.actors:
            raise ValueError(f"Failed to look up actor with name '{name}'")
        return FakeHandle(self, name, self.actors[name])

    def kill(self, handle: FakeHandle, no_restart: bool = True) -> None:
        if self.actors.get(handle.name) is handle.actor:
            del self.actors[handle.name]
            self.killed.append(handle.name)

    def list_named_actors(self, all_namespaces: bool = False) -> list[Any]:
        if all_namespaces:
            return [{"name": n, "namespace": placement_module.NAMESPACE} for n in self.actors]
        return list(self.actors)

    async def actor(self, name: str) -> Any:
        return await self.actors[name]


class _RemoteHost:
    def __init__(self, ray: FakeRay) -> None:
        self._ray = ray

    def options(self, *, name: str, **_options: Any) -> Any:
        return SimpleNamespace(remote=lambda *_args: self._ray.create(name))


class FakeHandle:
    def __init__(self, ray: FakeRay, name: str, actor: asyncio.Future[Any]) -> None:
        self.ray, self.name, self.actor = ray, name, actor

    def __getattr__(self, method: str) -> Any:
        if method.startswith("_"):
            raise AttributeError(method)
        return SimpleNamespace(remote=lambda *args: self._call(method, args))

    async def _call(self, method: str, args: tuple) -> Any:
        self.ray.calls.append((self.name, method))
        if self.ray.actors.get(self.name) is not self.actor:
            raise RayActorError()  # killed (or exited) since this handle was taken
        if self.ray.intercept is not None:
            await self.ray.intercept(self.name, method, args)
        return await getattr(await self.actor, method)(*args)


class FakeShardStore:
    """The shard state of one host group, as ClusterRepo keeps it in ce_cluster."""

    def __init__(self, shards: int = 2, host_group: str = "") -> None:
        self.state = ShardState(shards=shards, generation=1, host_group=host_group)
        self.locked = False  # the rescale advisory lock
        self.listeners: list[Callable[[ShardState], Any]] = []  # NOTIFY ce_cluster
        self.refuse_commits = 0  # the next n commits raise, nothing written (Postgres away)
        self.lose_commit_answers = 0  # the next n commits are written, then raise (the answer lost)
        self.before_commit: Callable[[], Awaitable[None]] | None = None  # runs once, before the next commit
        self.commits: list[tuple[int, int | None]] = []  # (target, generation) of every commit tried

    async def ensure(self, host_group: str, shards: int) -> ShardState:
        return self.state

    async def get(self, host_group: str) -> ShardState | None:
        return self.state

    async def begin(self, host_group: str, target: int) -> ShardState:
        self._write(msgspec.structs.replace(self.state, pending=target, generation=self.state.generation + 1))
        return self.state

    async def commit(self, host_group: str, target: int, *, generation: int | None = None) -> ShardState:
        self.commits.append((target, generation))
        hook, self.before_commit = self.before_commit, None
        if hook is not None:
            await hook()
        if self.refuse_commits:
            self.refuse_commits -= 1
            raise StoreUnavailable("connection reset by peer")
        if generation is None or generation == self.state.generation:
            self._write(ShardState(shards=target, generation=self.state.generation + 1,
                                   host_group=self.state.host_group))
        if self.lose_commit_answers:
            self.lose_commit_answers -= 1
            raise StoreUnavailable("connection reset by peer")
        return self.state

    @contextlib.asynccontextmanager
    async def exclusive(self, host_group: str) -> AsyncIterator[None]:
        if self.locked:
            raise Conflict("another rescale of the session hosts is running; wait for it to finish, then retry")
        self.locked = True
        try:
            yield
        finally:
            self.locked = False

    async def settle_abandoned(self, host_group: str) -> ShardState | None:
        state = self.state
        if state.pending is None:
            return state
        try:
            async with self.exclusive(host_group):
                if self.state.pending is not None:
                    return await self.commit(host_group, self.state.shards, generation=self.state.generation)
                return self.state
        except Conflict:
            return state

    def _write(self, state: ShardState) -> None:
        self.state = state
        for listener in self.listeners:
            listener(state)
