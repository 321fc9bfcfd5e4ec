"""The session host's cap on unwritten turns, against the test Postgres made unreachable, over HTTP.

A session host (in process, LocalRouter) writes to the test Postgres through a loopback proxy that
the test cuts: open connections dropped, new ones refused, so every flush fails as it does when
Postgres is away. The gateway in front of it (its own pool, not cut: it only authenticates) answers
as a client sees it: a turn refused at the cap is a 503 problem with Retry-After whose detail says
what to do, its tools never ran; a retry of an answer held is not refused; once Postgres is back
everything that ran is written once and new turns run again.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from pathlib import Path
from urllib.parse import parse_qs, urlencode, urlsplit

import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer

from actors.host import HostSettings, SessionHost
from actors.local import LocalRouter
from kernel.records import session_uid
from services.gateway.app import build_app
from services.gateway.common import GatewayDeps
from services.tools.crypto import SecretBox, generate_key
from storage.pool import create_pool
from storage.repos import BotConfigRepo, SessionRepo, TenantRepo, ToolCallRepo, ToolRepo
from storage.repos.jobs import JobRepo
from tests.support.host_fakes import FakeTenants
from tests.support.postgres import database_url

T = 10.0
PROBLEM = "application/problem+json"


class PostgresProxy:
    """A loopback proxy in front of a Postgres URL (a unix socket, as the embedded server's, or
    TCP); `cut()` makes Postgres unreachable through it (connections dropped, new ones refused),
    `mend()` reachable again. `url` is the same database through the proxy."""

    def __init__(self, target: str) -> None:
        parts = urlsplit(target)
        query = parse_qs(parts.query)
        port = parts.port or 5432
        self._socket_dir = query.get("host", [None])[0] if not parts.hostname else None
        self._port = port
        self._tcp = (parts.hostname, port)
        self._dir = tempfile.mkdtemp(prefix="ce-pg-proxy-")
        self._target = target
        self._server: asyncio.AbstractServer | None = None
        self._pipes: set[asyncio.StreamWriter] = set()
        self.url = ""

    async def mend(self) -> None:
        if self._socket_dir is not None:
            path = Path(self._dir) / f".s.PGSQL.{self._port}"
            self._server = await asyncio.start_unix_server(self._pipe, path=str(path))
            parts = urlsplit(self._target)
            query = parse_qs(parts.query)
            query["host"] = [self._dir]
            self.url = parts._replace(query=urlencode(query, doseq=True)).geturl()
        else:
            bound = int(urlsplit(self.url).port or 0) if self.url else 0
            self._server = await asyncio.start_server(self._pipe, "127.0.0.1", bound)
            port = self._server.sockets[0].getsockname()[1]
            parts = urlsplit(self._target)
            netloc = parts.netloc.rsplit("@", 1)
            self.url = parts._replace(netloc=(netloc[0] + "@" if len(netloc) == 2 else "")
                                      + f"127.0.0.1:{port}").geturl()

    async def cut(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._pipes):
            writer.transport.abort()
        self._pipes.clear()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._socket_dir is not None:
            up_reader, up_writer = await asyncio.open_unix_connection(
                str(Path(self._socket_dir) / f".s.PGSQL.{self._port}"))
        else:
            up_reader, up_writer = await asyncio.open_connection(*self._tcp)
        self._pipes |= {writer, up_writer}

        async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError, OSError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.transport.abort()

        await asyncio.gather(copy(reader, up_writer), copy(up_reader, writer))
        self._pipes -= {writer, up_writer}


@pytest_asyncio.fixture
async def stack(pool, pg_url, make_tenant):
    tenant, key = await make_tenant("unwritten")
    proxy = PostgresProxy(database_url(pg_url, await pool.fetchval("SELECT current_database()")))
    await proxy.mend()
    host_pool = await create_pool(proxy.url, min_size=1, max_size=2, timeout=2)
    tenants = FakeTenants()
    host = SessionHost(name="h1", store=SessionRepo(host_pool), tenants=tenants,
                       settings=HostSettings(max_unwritten=2, gate_timeout_s=0.3, max_backoff_s=0.05))
    await host.start()
    deps = GatewayDeps(router=LocalRouter(host), tenants=TenantRepo(pool), tools=ToolRepo(pool),
                       calls=ToolCallRepo(pool), sessions=SessionRepo(pool), configs=BotConfigRepo(pool),
                       secret_box=SecretBox([generate_key()]), jobs=JobRepo(pool))
    try:
        async with TestClient(TestServer(build_app(deps), host="127.0.0.1")) as client:
            yield client, {"Authorization": f"Bearer {key.api_key}"}, tenant.id, host, tenants, proxy
    finally:
        if proxy._server is not None and not proxy._server.is_serving():
            await proxy.mend()
        await asyncio.wait_for(host.stop(), T)
        await host_pool.close()
        await proxy.cut()
        shutil.rmtree(proxy._dir, ignore_errors=True)


async def test_postgres_unreachable_past_the_cap_new_turns_are_503_having_run_nothing_and_run_once_it_is_back(
    stack, pool,
):
    client, h, tenant_id, host, tenants, proxy = stack

    async def post(session_id: str, text: str, message_id: str):
        return await client.post(f"/v1/sessions/{session_id}/messages", headers=h,
                                 json={"text": text, "message_id": message_id})

    for sid in ("s1", "s2", "s3"):  # live on the host, their leases taken while Postgres is there
        assert (await post(sid, "hello", "m0")).status == 200
    await proxy.cut()
    for sid in ("s1", "s2"):  # they run; their replies cannot be saved in time
        r = await post(sid, f"use lookup {sid}", "m1")
        assert r.status == 503 and "retry with the same message_id" in (await r.json())["detail"]
    assert host.stats()["unwritten_turns"] == 2

    r = await post("s3", "use lookup s3", "m1")
    assert r.status == 503 and r.headers["Retry-After"] == "2" and r.content_type == PROBLEM
    assert r.headers["X-Message-Id"] == "m1"
    detail = (await r.json())["detail"]
    assert "this session host holds 2 turns whose state could not be saved yet" in detail
    assert "this message was not run" in detail and "send it again in a moment" in detail
    assert [sid for sid, _, _ in tenants.handler_calls] == ["s1", "s2"]  # s3's tool never ran

    # a retry of an answer held (not written) is not refused: it waits for it to be saved
    r = await post("s1", "use lookup s1", "m1")
    assert r.status == 503 and "retry with the same message_id" in (await r.json())["detail"]

    await proxy.mend()
    async with asyncio.timeout(T):
        while host.stats()["unwritten_turns"]:
            await asyncio.sleep(0.02)
    r = await post("s3", "use lookup s3", "m1")
    assert r.status == 200 and (await r.json())["reply"] == 'done: {"found":"s3"}'
    r = await post("s1", "use lookup s1", "m1")
    assert r.status == 200 and r.headers.get("X-Replayed") == "true"
    assert (await r.json())["reply"] == 'done: {"found":"s1"}'

    sessions = SessionRepo(pool)
    for sid in ("s1", "s2", "s3"):  # nothing that ran was dropped, and nothing ran twice
        assert (await sessions.get_turn(tenant_id, sid, "m1"))["reply"] == f'done: {{"found":"{sid}"}}'
        assert await pool.fetchval("SELECT count(*) FROM ce_tool_calls WHERE tenant_id = $1 AND session_id = $2",
                                   tenant_id, session_uid(tenant_id, sid)) == 1
    assert sorted(sid for sid, _, _ in tenants.handler_calls) == ["s1", "s2", "s3"]
