"""A burst of clients is answered, never reset (issue 39, item 5): the real gateway
(open_gateway) on loopback with the real Postgres; the SessionRouter is the unit tests' fake.

- The listen backlog is the kernel's cap (net.core.somaxconn), not aiohttp's 128, read back from
  the kernel's own view of the listening socket (TCP_INFO).
- Past its connection limit a gateway answers 503 with Retry-After and closes, at once.
- 1,000 clients sending a message at once all get an HTTP answer (200, or 503 past the limit).
"""

from __future__ import annotations

import asyncio
import resource
import socket
import struct
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest

from services.gateway.server import (
    DEFAULT_BACKLOG,
    FD_RESERVE,
    connection_limit,
    listen_backlog,
    open_gateway,
)
from services.settings import Settings
from tests.support.gateways import FakeRouter

BURST = 1_000


async def until(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Wait for the state asserted next (polling, bounded by a generous timeout)."""
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)
    assert condition(), what


def kernel_backlog(sock: socket.socket) -> int:
    """The backlog the kernel holds for a listening socket: TCP_INFO's tcpi_sacked (Linux sets it
    to sk_max_ack_backlog for a socket in LISTEN)."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    return struct.unpack_from("I", info, 28)[0]


@pytest.mark.parametrize("text,backlog", [("4096\n", 4096), ("65535", 65535), ("64", 128), ("x", DEFAULT_BACKLOG)])
def test_the_backlog_is_the_kernels_cap(tmp_path: Path, text: str, backlog: int):
    path = tmp_path / "somaxconn"
    path.write_text(text)
    assert listen_backlog(path) == backlog
    assert listen_backlog(tmp_path / "absent") == DEFAULT_BACKLOG


def test_the_connection_limit_is_the_setting_or_the_file_limit_less_a_reserve():
    assert connection_limit(7) == 7
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert connection_limit(0) == (1_000_000 if soft == resource.RLIM_INFINITY else max(64, soft - FD_RESERVE))
    assert Settings.from_env({"CE_GATEWAY_MAX_CONNECTIONS": "5000"}).gateway_max_connections == 5000


async def test_the_gateway_listens_with_the_kernels_backlog_not_128(fresh_db):
    gateway = await open_gateway(Settings(database_url=await fresh_db(), host="127.0.0.1", port=0),
                                 FakeRouter(), port=0)
    try:
        [sock] = gateway.listening_sockets()
        assert kernel_backlog(sock) == listen_backlog() > 128
    finally:
        await gateway.close()


async def test_past_its_connection_limit_a_gateway_answers_503_with_retry_after_and_closes(fresh_db):
    settings = Settings(database_url=await fresh_db(), host="127.0.0.1", port=0, gateway_max_connections=4)
    gateway = await open_gateway(settings, FakeRouter(), port=0)
    host, port = gateway.url.removeprefix("http://").rsplit(":", 1)
    idle = [await asyncio.open_connection(host, int(port)) for _ in range(4)]
    try:
        await until(lambda: gateway.connections == 4, "the four idle connections are open")
        async with aiohttp.ClientSession() as http, http.get(f"{gateway.url}/healthz") as r:
            problem = await r.json(content_type=None)
            assert r.status == 503 and r.headers["Retry-After"] == "1", problem
            assert "limit of 4 connections" in problem["detail"]
            assert r.headers.get("Connection", "").lower() == "close"
        for _, writer in idle:
            writer.close()
        await until(lambda: gateway.connections == 0, "the idle connections closed")
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{gateway.url}/healthz") as r:
                assert r.status == 200
            async with http.get(f"{gateway.url}/metrics") as r:
                assert 'ce_refused_total{reason="gateway_connections"} 1.0' in await r.text()
    finally:
        for _, writer in idle:
            writer.close()
        await gateway.close()


async def test_a_burst_of_a_thousand_clients_is_answered_every_one(fresh_db):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = 2 * BURST + 512  # both ends of every connection, in this one process
    if soft != resource.RLIM_INFINITY and soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed if hard == resource.RLIM_INFINITY else min(needed, hard), hard))
    limit = BURST * 3 // 5  # past it, the rest are answered 503
    settings = Settings(database_url=await fresh_db(), host="127.0.0.1", port=0, gateway_max_connections=limit,
                        tenant_rate=0, tenant_concurrency=0)
    gateway = await open_gateway(settings, FakeRouter(), port=0)
    _, key = await gateway.deps.tenants.create_tenant("burst")
    headers = {"Authorization": f"Bearer {key.api_key}"}
    statuses: list[int] = []
    failures: list[str] = []
    go = asyncio.Event()

    async def client(i: int, http: aiohttp.ClientSession) -> None:
        await go.wait()
        try:
            async with http.post(f"{gateway.url}/v1/sessions/burst-{i}/messages", headers=headers,
                                 json={"text": "hello"}) as r:
                await r.read()
                statuses.append(r.status)
        except aiohttp.ClientError as exc:
            failures.append(f"{type(exc).__name__}: {exc}")

    try:
        # one connection per client, none shared: the burst is 1,000 connections at once
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as http:
            tasks = [asyncio.create_task(client(i, http)) for i in range(BURST)]
            await asyncio.sleep(0)
            go.set()
            await asyncio.gather(*tasks)
    finally:
        await gateway.close()
    assert failures == [], f"{len(failures)} of {BURST} got no answer, e.g. {failures[:3]}"
    assert len(statuses) == BURST and set(statuses) <= {200, 503}, sorted(set(statuses))
    assert statuses.count(200) >= limit // 2  # most of those within the limit got their answer
