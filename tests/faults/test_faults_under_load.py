"""Faults under load, on a stack of its own (a `chat-engine run` subprocess with its own Postgres
and Ray), so restarting its database or killing its hosts disturbs no other test.

After each fault: every acknowledged reply's state is in Postgres, no message ran its tools twice,
sessions keep answering, breakers trip as specified. Loopback only; bounded in count and time.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from storage.pool import create_pool
from storage.records import session_uid

SESSIONS = 100


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    def __init__(self, data: Path, port: int, proc: subprocess.Popen) -> None:
        self.data, self.port, self.proc = data, port, proc
        self.url = f"http://127.0.0.1:{port}"
        env = dict(line.split("=", 1) for line in (data / "demo.env").read_text().split())
        self.headers = {"Authorization": f"Bearer {env['CE_API_KEY']}"}
        from storage.embedded import start_embedded

        self.pg = start_embedded(data)  # attaches to the running cluster


@pytest_asyncio.fixture(scope="module")
async def faulty():
    data = Path(tempfile.mkdtemp(prefix="ce-faults-"))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CE_", "DATABASE_URL", "RAY_ADDRESS"))}
    env.update({"CE_DATA_DIR": str(data), "CE_PORT": str(port), "CE_SHARDS": "2", "CE_LOG_FORMAT": "json",
                "CE_LOG_LEVEL": "warning", "CE_TENANT_RATE": "0", "CE_TENANT_CONCURRENCY": "0"})
    log = open(data / "stack.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "run"], env=env, stdout=log, stderr=log,
                            start_new_session=True)
    try:
        async with aiohttp.ClientSession() as client:
            for _ in range(240):
                if proc.poll() is not None:
                    pytest.fail(f"the stack exited: {(data / 'stack.log').read_text()[-3000:]}")
                try:
                    async with client.get(f"http://127.0.0.1:{port}/readyz") as r:
                        if r.status == 200 and (data / "demo.env").exists():
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.5)
            else:
                pytest.fail("the stack did not become ready in 120 s")
        yield Stack(data, port, proc)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


class Load:
    """Contacts that retry (same message_id) until acknowledged, as a careful client does."""

    def __init__(self, stack: Stack, client: aiohttp.ClientSession) -> None:
        self.stack, self.client = stack, client
        self.acked: dict[str, dict] = {}  # message_id -> reply
        self.statuses: list[int] = []

    async def send(self, session: str, text: str, message_id: str, *, deadline_s: float = 90) -> dict:
        end = time.monotonic() + deadline_s
        while True:
            try:
                async with self.client.post(f"{self.stack.url}/v1/sessions/{session}/messages",
                                            headers=self.stack.headers,
                                            json={"text": text, "message_id": message_id}) as r:
                    self.statuses.append(r.status)
                    body = await r.json(content_type=None)
                    if r.status == 200:
                        self.acked[message_id] = body
                        return body
                    assert r.status in (429, 503), (r.status, body)
                    pause = float(r.headers.get("Retry-After", "1"))
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pause = 0.5
            if time.monotonic() > end:
                raise AssertionError(f"{message_id} was never acknowledged")
            await asyncio.sleep(min(pause, 2.0))


def order_call(n: int) -> str:
    return f'/call check_order {{"order_id": "{n}"}}'


async def db_facts(stack: Stack, message_ids: list[str]) -> tuple[set[str], dict[str, int]]:
    pool = await create_pool(stack.pg.url, max_size=2)
    try:
        turns = {r["message_id"] for r in await pool.fetch(
            "SELECT message_id FROM ce_turns WHERE message_id = ANY($1)", message_ids)}
        calls = {r["message_id"]: r["n"] for r in await pool.fetch(
            "SELECT message_id, count(*) AS n FROM ce_tool_calls WHERE message_id = ANY($1) GROUP BY message_id",
            message_ids)}
    finally:
        await pool.close()
    return turns, calls


async def test_postgres_down_for_10_s_under_load_loses_nothing_acknowledged(faulty):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as client:
        load = Load(faulty, client)
        await asyncio.gather(*(load.send(f"pg-{i}", order_call(i), f"pg-{i}-0") for i in range(SESSIONS)))

        async def traffic(i: int) -> None:
            for k in range(1, 4):
                await load.send(f"pg-{i}", order_call(1000 + i * 10 + k), f"pg-{i}-{k}")

        running = asyncio.gather(*(traffic(i) for i in range(SESSIONS)))
        await asyncio.sleep(0.5)
        await asyncio.to_thread(faulty.pg.stop)  # Postgres refuses every connection from now on
        with pytest.raises(Exception):  # noqa: B017 - the fault is real: nothing can connect
            await create_pool(faulty.pg.url, max_size=1, timeout=2)
        await asyncio.sleep(10)
        from storage.embedded import start_embedded

        faulty.pg = await asyncio.to_thread(start_embedded, faulty.data)
        await asyncio.wait_for(running, 180)
    ids = list(load.acked)
    assert len(ids) == SESSIONS * 4
    turns, calls = await db_facts(faulty, ids)
    assert turns == set(ids), "an acknowledged reply's state is missing from Postgres"
    for message_id, reply in load.acked.items():
        assert calls.get(message_id, 0) == len(reply["tool_calls"]) == 1, message_id  # never twice
    assert set(load.statuses) <= {200, 429, 503}  # held or shed, never a 500


async def test_failing_backends_under_load_trip_breakers_and_sessions_keep_answering(faulty):
    async def timeout(request):
        await asyncio.sleep(5)
        return web.json_response({})

    async def error(request):
        return web.json_response({"error": "boom"}, status=500)

    async def garbage(request):
        return web.Response(text="<html>not json{", content_type="application/json")

    async def drip(request):
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        for _ in range(50):
            await response.write(b" ")
            await asyncio.sleep(0.1)
        return response

    async def close(request):
        response = web.StreamResponse(headers={"Content-Type": "application/json", "Content-Length": "1000"})
        await response.prepare(request)
        await response.write(b'{"partial": ')
        request.transport.close()
        return response

    modes = {"timeout": timeout, "error": error, "garbage": garbage, "drip": drip, "close": close}
    app = web.Application()
    for name, handler in modes.items():
        app.router.add_get(f"/{name}", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.2", 0).start()
    base = f"http://127.0.0.2:{runner.addresses[0][1]}"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as client:
            for name in modes:
                async with client.post(f"{faulty.url}/v1/tools", headers=faulty.headers, json={
                    "name": f"flaky_{name}", "description": f"a backend that fails by {name}",
                    "parameters": {}, "webhook_url": f"{base}/{name}", "timeout_ms": 800,
                }) as r:
                    assert r.status in (201, 409), await r.text()
            load = Load(faulty, client)

            async def contact(i: int) -> list[dict]:
                name = list(modes)[i % len(modes)]
                replies = []
                for k in range(4):
                    replies.append(await load.send(f"bk-{i}", f"/call flaky_{name} {{}}", f"bk-{i}-{k}"))
                replies.append(await load.send(f"bk-{i}", order_call(i), f"bk-{i}-4"))
                return replies

            results = await asyncio.wait_for(asyncio.gather(*(contact(i) for i in range(40))), 240)
            for i, replies in enumerate(results):
                name = f"flaky_{list(modes)[i % len(modes)]}"
                errors = [r["tool_calls"][0]["error"] for r in replies[:4]]
                assert all(e.startswith(f"Tool '{name}' failed: ") for e in errors), errors
                assert "switched off" in errors[3] or "failed too often" in errors[3], errors[3]
                assert replies[4]["tool_calls"][0]["success"]  # the session keeps answering
                assert all("Traceback" not in e and "Bearer" not in e for e in errors)
                async with client.get(f"{faulty.url}/v1/sessions/bk-{i}", headers=faulty.headers) as r:
                    assert name in (await r.json())["open_breakers"]
    finally:
        await runner.cleanup()


async def test_a_malformed_model_stream_gets_an_apology_and_the_session_goes_on(faulty):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as client:
        load = Load(faulty, client)
        broken = await load.send("llm-1", "/fault malformed-stream\nhello", "llm-1-0")
        assert "technical problem" in broken["reply"]
        fine = await load.send("llm-1", order_call(42), "llm-1-1")
        assert fine["tool_calls"][0]["success"] and "42" in fine["reply"]


async def test_kill_9_a_host_under_load_loses_nothing_acknowledged(faulty):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as client:
        load = Load(faulty, client)
        async with client.get(f"{faulty.url}/metrics") as r:
            assert r.status == 200

        async def traffic(i: int) -> None:
            for k in range(3):
                await load.send(f"k9-{i}", order_call(i * 10 + k), f"k9-{i}-{k}")

        running = asyncio.gather(*(traffic(i) for i in range(SESSIONS)))
        await asyncio.sleep(1.0)
        pids = [int(p) for p in subprocess.run(["pgrep", "-f", "SessionHostActor"], capture_output=True,
                                               text=True).stdout.split()]
        mine = [p for p in pids if _descends_from(p, faulty.proc.pid)]
        assert mine, "no session host process of this stack found"
        os.kill(mine[0], signal.SIGKILL)
        await asyncio.wait_for(running, 180)
    ids = list(load.acked)
    assert len(ids) == SESSIONS * 3
    turns, calls = await db_facts(faulty, ids)
    assert turns == set(ids)
    assert all(calls.get(m, 0) == len(r["tool_calls"]) for m, r in load.acked.items())


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return False
