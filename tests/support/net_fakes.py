"""Network fakes for tests of the SSRF guard and the clients behind it: nothing here reaches a
real resolver, and no socket leaves loopback, even when the guard under test is broken."""

from __future__ import annotations

import errno
import ipaddress
import socket
from typing import Any

import pytest
from aiohttp import web


class MapResolver:
    """The guard's resolver port answering from a table: test host name -> addresses, or a
    sequence of answers given in turn (DNS rebinding). Unknown names fail as DNS would. `calls`
    records (host, port) of every lookup."""

    def __init__(self, answers: dict[str, list[list[str]] | list[str]] | None = None) -> None:
        self.answers = answers or {}
        self.calls: list[tuple[str, int]] = []

    @property
    def asked(self) -> list[str]:
        return [host for host, _ in self.calls]

    async def resolve(self, host: str, port: int) -> list[str]:
        self.calls.append((host, port))
        answer = self.answers.get(host)
        if answer is None:
            raise socket.gaierror(socket.EAI_NONAME, "unknown test host")
        if answer and isinstance(answer[0], list):
            turn = sum(1 for h, _ in self.calls if h == host) - 1
            return list(answer[min(turn, len(answer) - 1)])  # type: ignore[arg-type]
        return list(answer)  # type: ignore[arg-type]


class LoopbackOnlySockets:
    """Socket factory for aiohttp's connector: loopback connects only; anything else is refused
    before a packet is sent, and recorded."""

    def __init__(self) -> None:
        self.connects: list[str] = []
        self.refused: list[str] = []

    def __call__(self, addr_info: tuple[Any, ...]) -> socket.socket:
        family, type_, proto, _canon, sockaddr = addr_info
        host = str(sockaddr[0])
        if not ipaddress.ip_address(host.split("%", 1)[0]).is_loopback:
            self.refused.append(host)
            raise PermissionError(errno.EACCES, "test refuses a non-loopback connect")
        self.connects.append(host)
        return socket.socket(family, type_, proto)


class LoopbackApp:
    """An aiohttp app served on 127.0.0.1 at a free port (`port`): a test's upstream."""

    def __init__(self) -> None:
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def serve(self, app: web.Application) -> None:
        self._runner = web.AppRunner(app, shutdown_timeout=0.5, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@pytest.fixture
def sockets():
    factory = LoopbackOnlySockets()
    yield factory
    assert factory.refused == [], "a client tried to connect off loopback"
