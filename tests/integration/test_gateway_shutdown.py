"""A stopping gateway (SIGTERM in a rolling update, Ctrl-C on `chat-engine run`) drains: the real
gateway (services.gateway.server.open_gateway) on loopback with the real Postgres; only the
SessionRouter is a stand-in, whose turns take as long as a slow model or tool call does.

And a gateway that cannot listen says so in one sentence naming CE_HOST/CE_PORT.
"""

from __future__ import annotations

import asyncio
import socket
import time

import aiohttp
import pytest

from kernel.errors import ConfigError
from services.gateway.server import DRAIN_TIMEOUT_S, check_listen_address, open_gateway
from services.settings import Settings
from services.wire import Turn, TurnReply, UsageOut
from tests.support.gateways import FakeRouter

#: longer than the gateway used to wait for a request in flight: 5 s, twice (aiohttp waits for the
#: handler, then again after cancelling the request body), rounded up
TURN_S = 12.5


class SlowRouter(FakeRouter):
    """Every turn takes TURN_S; `started` is set once one is running."""

    def __init__(self) -> None:
        super().__init__()
        self.started = asyncio.Event()
        self.finished = 0

    async def send(self, turn: Turn, *, new_id=False) -> TurnReply:
        self.started.set()
        await asyncio.sleep(TURN_S)
        self.finished += 1
        return TurnReply(session_id=turn.session_id, message_id=turn.message_id or "m-1",
                         reply=f"slow answer to {turn.text}",
                         rounds=1, tool_calls=[], usage=UsageOut())


def refused(url: str) -> bool:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


async def test_a_turn_in_flight_when_the_gateway_stops_gets_its_full_answer(fresh_db):
    assert TURN_S < DRAIN_TIMEOUT_S <= 45 - 5 - 5  # a long turn, within the pod's grace less its preStop and a margin
    router = SlowRouter()
    settings = Settings(database_url=await fresh_db(), host="127.0.0.1", port=0)
    gateway = await open_gateway(settings, router, port=0)
    _, key = await gateway.deps.tenants.create_tenant("drain")
    headers = {"Authorization": f"Bearer {key.api_key}"}
    async with aiohttp.ClientSession() as http:
        turn = asyncio.create_task(http.post(f"{gateway.url}/v1/sessions/s1/messages", json={"text": "hi"},
                                             headers=headers))
        await asyncio.wait_for(router.started.wait(), 10)
        started = time.monotonic()
        closing = asyncio.create_task(gateway.close())  # SIGTERM
        await asyncio.sleep(0.5)
        assert refused(gateway.url)  # draining: no new connection is taken
        resp = await turn
        assert resp.status == 200
        body = await resp.json()
        await closing
    assert body["reply"] == "slow answer to hi" and router.finished == 1
    assert time.monotonic() - started < TURN_S + 3  # it stopped once the turn was done, not at the limit


async def test_an_idle_gateway_stops_at_once_even_with_a_keep_alive_connection_open(fresh_db):
    settings = Settings(database_url=await fresh_db(), host="127.0.0.1", port=0)
    gateway = await open_gateway(settings, SlowRouter(), port=0)
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{gateway.url}/healthz") as resp:  # leaves an idle keep-alive connection
            assert resp.status == 200
        started = time.monotonic()
        await gateway.close()  # Ctrl-C on an idle `chat-engine run`
    assert time.monotonic() - started < 2


async def test_a_request_still_in_its_auth_lookup_when_the_gateway_stops_gets_its_answer(fresh_db):
    # before, the drain counted requests only once they were past auth: one waiting on Postgres
    # (a busy pool in a rolling update) was not waited for, and cut when aiohttp gave up on it
    from services.gateway.server import SHUTDOWN_WRITE_S

    lookup_s = 2 * SHUTDOWN_WRITE_S + 1  # longer than aiohttp's own wait for a handler
    settings = Settings(database_url=await fresh_db(), host="127.0.0.1", port=0)
    gateway = await open_gateway(settings, FakeRouter(), port=0)
    _, key = await gateway.deps.tenants.create_tenant("drain-auth")
    looking_up = asyncio.Event()
    real_lookup = gateway.deps.tenants.key_holder

    async def slow_lookup(api_key):
        looking_up.set()
        await asyncio.sleep(lookup_s)
        return await real_lookup(api_key)

    gateway.deps.tenants.key_holder = slow_lookup
    async with aiohttp.ClientSession() as http:
        turn = asyncio.create_task(http.post(f"{gateway.url}/v1/sessions/s1/messages", json={"text": "hi"},
                                             headers={"Authorization": f"Bearer {key.api_key}"}))
        await asyncio.wait_for(looking_up.wait(), 10)
        await gateway.close()
        resp = await turn
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["session_id"] == "s1"


def busy_port() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def test_a_taken_address_is_refused_before_start_up_naming_the_variables():
    with busy_port() as holder:
        port = holder.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"cannot listen on 127.0.0.1:{port}: the address is already in use; "
                                              r"set CE_HOST/CE_PORT to a free address") as info:
            check_listen_address("127.0.0.1", port)
    assert info.value.variable == "CE_PORT"
    check_listen_address("127.0.0.1", port)  # free again
    check_listen_address("127.0.0.1", 0)


async def test_an_address_taken_at_the_bind_itself_is_a_config_error(fresh_db):
    with busy_port() as holder:
        port = holder.getsockname()[1]
        settings = Settings(database_url=await fresh_db(), host="127.0.0.1", port=port)
        with pytest.raises(ConfigError, match=rf"cannot listen on 127.0.0.1:{port}: the address is already in use"):
            await open_gateway(settings, SlowRouter())


async def test_the_drain_is_bounded_so_a_stuck_turn_cannot_outlast_the_pods_grace_period(fresh_db):
    from services.gateway.server import SHUTDOWN_WRITE_S

    router = SlowRouter()
    settings = Settings(database_url=await fresh_db(), host="127.0.0.1", port=0)
    gateway = await open_gateway(settings, router, port=0, drain_timeout_s=0.5)
    _, key = await gateway.deps.tenants.create_tenant("drain-bounded")
    async with aiohttp.ClientSession() as http:
        turn = asyncio.create_task(http.post(f"{gateway.url}/v1/sessions/s1/messages", json={"text": "hi"},
                                             headers={"Authorization": f"Bearer {key.api_key}"}))
        await asyncio.wait_for(router.started.wait(), 10)
        started = time.monotonic()
        await gateway.close()
        took = time.monotonic() - started
        with pytest.raises(aiohttp.ClientError):  # cancelled: the connection closes without an answer
            await turn
    assert took < 0.5 + 2 * (SHUTDOWN_WRITE_S + 1) and router.finished == 0


async def test_a_second_ctrl_c_cuts_the_drain_short(fresh_db):
    # the operator who pressed Ctrl-C twice does not wait out a 12 s turn (or the 30 s drain)
    from services.gateway.server import SHUTDOWN_WRITE_S

    router = SlowRouter()
    settings = Settings(database_url=await fresh_db(), host="127.0.0.1", port=0)
    gateway = await open_gateway(settings, router, port=0)
    _, key = await gateway.deps.tenants.create_tenant("drain-hurried")
    hurry = asyncio.Event()
    async with aiohttp.ClientSession() as http:
        turn = asyncio.create_task(http.post(f"{gateway.url}/v1/sessions/s1/messages", json={"text": "hi"},
                                             headers={"Authorization": f"Bearer {key.api_key}"}))
        await asyncio.wait_for(router.started.wait(), 10)
        started = time.monotonic()
        closing = asyncio.create_task(gateway.close(hurry=hurry))
        await asyncio.sleep(0.5)
        assert not closing.done()  # draining
        hurry.set()  # the second Ctrl-C
        await closing
        took = time.monotonic() - started
        with pytest.raises(aiohttp.ClientError):
            await turn
    assert took < 0.5 + 2 * (SHUTDOWN_WRITE_S + 1) < TURN_S and router.finished == 0


async def test_the_signal_wait_returns_an_event_the_next_signal_sets():
    import os
    import signal

    from app.cli import _wait_for_signal

    loop = asyncio.get_running_loop()
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        waiting = asyncio.create_task(_wait_for_signal())
        await asyncio.sleep(0.1)
        assert not waiting.done()
        os.kill(os.getpid(), signal.SIGTERM)  # the first: stop
        hurry = await asyncio.wait_for(waiting, 5)
        assert not hurry.is_set()
        os.kill(os.getpid(), signal.SIGINT)  # the second: hurry
        await asyncio.wait_for(hurry.wait(), 5)
    finally:
        for sig, handler in before.items():
            loop.remove_signal_handler(sig)
            signal.signal(sig, handler)
