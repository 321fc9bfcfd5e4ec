"""Session hosts over the fakes of host_fakes, no Postgres, no Ray: `World` (one fake database
and tenant source shared by any number of hosts; the `world` fixture closes it) and the waits
the host tests use."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec
import pytest

from actors.host import HostSettings, SessionHost
from services.tools.registry import build_catalog
from services.wire import Turn
from tests.support.host_fakes import LOOKUP, FakeSessionStore, FakeTenants

T = 5.0  # generous bound for anything that should happen "now" on a loaded CI machine
KEY = ("t1", "s1")


async def eventually(predicate: Callable[[], bool], timeout: float = T) -> None:
    """Wait until `predicate()` holds (for state that has no Event of its own)."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.005)


def answer(reply):
    """A reply without the host's timing (which differs between two releases of one answer)."""
    return msgspec.structs.replace(reply, timing=None)


async def spin(n: int = 20) -> None:
    """Let every ready task run a few steps."""
    for _ in range(n):
        await asyncio.sleep(0)


class World:
    """One fake database and tenant source shared by any number of hosts."""

    def __init__(self) -> None:
        self.store = FakeSessionStore()
        self.tenants = FakeTenants()
        self.model = self.tenants.model
        self.hosts: list[SessionHost] = []

    async def host(self, name: str = "h1", **settings) -> SessionHost:
        host = SessionHost(name=name, store=self.store, tenants=self.tenants, settings=HostSettings(**settings))
        await host.start()
        self.hosts.append(host)
        return host

    async def turn_at_the_gate(self, text: str = "hello") -> tuple[SessionHost, asyncio.Task]:
        """A gated host and a turn of session s1 (message m1) whose flush is in flight and held
        until `store.hold` is set."""
        self.store.hold = asyncio.Event()
        host = await self.host(output_gate=True)
        turn = asyncio.create_task(host.send(Turn(tenant_id="t1", session_id="s1", text=text, message_id="m1")))
        await asyncio.wait_for(self.store.flush_entered.wait(), T)
        return host, turn

    def calls(self, session_id: str = "s1") -> list[tuple[str, str]]:
        return [(tool, q) for sid, tool, q in self.tenants.handler_calls if sid == session_id]

    async def close(self) -> None:
        self.store.down, self.store.fail_next = False, 0
        if self.store.hold is not None:
            self.store.hold.set()
        if self.store.activate_hold is not None:
            self.store.activate_hold.set()
        self.model.release_all()
        for host in self.hosts:  # stop() twice is harmless: a test may have stopped it already
            await asyncio.wait_for(host.stop(), T)


@pytest.fixture
async def world():
    w = World()
    yield w
    await w.close()


def offer_only_book(tenants) -> None:
    """Tenants are offered one tool, `book`: a write, so its calls are held for approval."""
    book = msgspec.structs.replace(LOOKUP, name="book", mutability="write")
    tenants.env = msgspec.structs.replace(
        tenants.env, catalog=build_catalog([], [(book, 1)], registry=tenants.registry, backend=None))
