"""Faults under load, on a stack of its own (a `chat-engine run` subprocess with its own Postgres
and Ray), so restarting its database or killing its hosts disturbs no other test.

After each fault: every acknowledged reply's state is in Postgres, no message ran its tools twice,
sessions keep answering, breakers trip as specified. Loopback only; bounded in count and time.
"""

from __future__ import annotations

import asyncio
import os
import signal

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from bench.soak import Contacts, StackProcess, lost_records, order_call
from storage.pool import create_pool

SESSIONS = 100


@pytest_asyncio.fixture(scope="module")
async def faulty():
    stack = StackProcess()
    await stack.start()
    try:
        yield stack
    finally:
        stack.stop()


def Load(stack, client) -> Contacts:
    return Contacts(stack, client)


async def db_facts(stack, message_ids):
    acked = {m: {"tool_calls": []} for m in message_ids}
    missing, _ = await lost_records(stack, acked)
    from storage.pool import create_pool

    pool = await create_pool(stack.pg.url, max_size=1)
    try:
        calls = {r["message_id"]: r["n"] for r in await pool.fetch(
            "SELECT message_id, count(*) AS n FROM ce_tool_calls WHERE message_id = ANY($1) GROUP BY message_id",
            message_ids)}
    finally:
        await pool.close()
    return set(message_ids) - set(missing), calls


async def test_postgres_down_for_10_s_under_load_loses_nothing_acknowledged(faulty):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as client:
        load = Load(faulty, client)
        await asyncio.gather(*(load.send(f"pg-{i}", order_call(i), f"pg-{i}-0") for i in range(SESSIONS)))

        async def traffic(i: int) -> None:
            for k in range(1, 4):
                await load.send(f"pg-{i}", order_call(1000 + i * 10 + k), f"pg-{i}-{k}")

        running = asyncio.gather(*(traffic(i) for i in range(SESSIONS)))
        await asyncio.sleep(0.5)
        await faulty.stop_postgres()  # Postgres refuses every connection from now on
        with pytest.raises(Exception):  # noqa: B017 - the fault is real: nothing can connect
            await create_pool(faulty.pg.url, max_size=1, timeout=2)
        await asyncio.sleep(10)
        await faulty.start_postgres()
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
        mine = faulty.host_pids()
        assert mine, "no session host process of this stack found"
        os.kill(mine[0], signal.SIGKILL)
        await asyncio.wait_for(running, 180)
    ids = list(load.acked)
    assert len(ids) == SESSIONS * 3
    turns, calls = await db_facts(faulty, ids)
    assert turns == set(ids)
    assert all(calls.get(m, 0) == len(r["tool_calls"]) for m, r in load.acked.items())
