"""The turn lane (actors/lane.py): a real server and client on 127.0.0.1, no Ray."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from actors.lane import (
    MAX_FRAME,
    LaneAddress,
    LaneBroken,
    LaneClient,
    LaneError,
    LaneServer,
    LaneUnreachable,
    frame,
)


class Host:
    """A dispatcher whose calls finish when the test says so."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list]] = []
        self.gates: dict[str, asyncio.Event] = {}

    async def dispatch(self, method: str, args: list) -> bytes:
        self.calls.append((method, args))
        gate = self.gates.get(args[0]) if args else None
        if gate is not None:
            await gate.wait()
        if method == "boom":
            raise RuntimeError("a bug in the dispatcher")
        if args == ["big"]:
            return b"y" * 1000
        return msgspec.json.encode({"method": method, "args": args})


@pytest.fixture
async def lane():
    host = Host()
    server = LaneServer(host.dispatch, frozenset({"send", "decide", "boom"}))
    address = await server.start("127.0.0.1")
    client = LaneClient(address)
    yield host, server, client
    client.close()
    await server.close()


async def test_a_call_runs_on_the_host_and_returns_its_reply(lane):
    host, _, client = lane
    body = await client.call("send", "t1", "s1", "hello", None)
    assert msgspec.json.decode(body) == {"method": "send", "args": ["t1", "s1", "hello", None]}
    edited = {"slot": "2026-12-03T10:00", "nested": [1, {"a": None}]}
    body = await client.call("decide", "t1", "s1", "ap_1", True, edited)
    assert msgspec.json.decode(body)["args"][-1] == edited
    assert [m for m, _ in host.calls] == ["send", "decide"]


async def test_calls_are_multiplexed_and_replies_come_back_out_of_order(lane):
    host, _, client = lane
    host.gates["slow"] = asyncio.Event()
    slow = asyncio.create_task(client.call("send", "slow"))
    fast = [await client.call("send", f"fast{i}") for i in range(5)]  # not stuck behind "slow"
    assert [msgspec.json.decode(b)["args"][0] for b in fast] == [f"fast{i}" for i in range(5)]
    assert not slow.done()
    host.gates["slow"].set()
    assert msgspec.json.decode(await slow)["args"] == ["slow"]
    many = await asyncio.gather(*(client.call("send", f"c{i}") for i in range(200)))
    assert [msgspec.json.decode(b)["args"][0] for b in many] == [f"c{i}" for i in range(200)]


async def test_a_method_the_lane_does_not_carry_is_refused_without_running(lane):
    host, _, client = lane
    with pytest.raises(LaneError, match="does not carry 'shutdown'"):
        await client.call("shutdown")
    assert host.calls == []
    with pytest.raises(LaneError, match="failed to run"):  # a dispatcher bug: an error, no secrets
        await client.call("boom", "x")
    assert msgspec.json.decode(await client.call("send", "after")) is not None  # the connection lives on


async def test_a_connection_without_the_token_is_closed_before_any_call_runs(lane):
    host, _, client = lane
    forged = LaneClient(LaneAddress(host=client.address.host, port=client.address.port, token="guess"))
    with pytest.raises(LaneBroken):
        await forged.call("send", "t1", "s1", "steal", None)
    # raw bytes that are not a hello: closed as well
    reader, writer = await asyncio.open_connection(client.address.host, client.address.port)
    writer.write(b"GET / HTTP/1.1\r\n\r\n")
    assert await reader.read() == b""
    writer.close()
    assert host.calls == []
    assert forged.broken


async def test_a_reply_too_large_for_a_frame_is_an_error_and_the_connection_lives_on(lane, monkeypatch):
    host, _, client = lane
    monkeypatch.setattr("actors.lane.MAX_FRAME", 200)
    with pytest.raises(LaneError, match="exceeds the lane's frame limit"):
        await client.call("send", "big")
    assert msgspec.json.decode(await client.call("send", "small"))["args"] == ["small"]
    assert len(host.calls) == 2


async def test_an_oversized_frame_closes_the_connection(lane):
    host, _, client = lane
    reader, writer = await asyncio.open_connection(client.address.host, client.address.port)
    writer.write(frame(msgspec.msgpack.encode(client.address.token)))
    writer.write((MAX_FRAME + 1).to_bytes(4, "big"))
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()
    assert host.calls == []


async def test_closing_the_server_lets_running_calls_reply_first(lane):
    host, server, client = lane
    host.gates["stuck"] = asyncio.Event()
    stuck = asyncio.create_task(client.call("send", "stuck"))
    await asyncio.sleep(0.05)
    assert host.calls  # it reached the host
    closing = asyncio.create_task(server.close())  # waits for the running call...
    await asyncio.sleep(0.05)
    assert not closing.done() and not stuck.done()
    host.gates["stuck"].set()  # ...which finishes and writes its reply before the connection closes
    assert msgspec.json.decode(await stuck)["args"] == ["stuck"]
    await closing
    await asyncio.sleep(0.05)
    assert client.broken
    with pytest.raises(LaneBroken):
        await client.call("send", "after close")


async def test_waiting_calls_raise_lane_broken_when_the_connection_goes(lane, monkeypatch):
    host, server, client = lane
    monkeypatch.setattr("actors.lane.CLOSE_GRACE_S", 0.05)
    host.gates["stuck"] = asyncio.Event()
    stuck = [asyncio.create_task(client.call("send", "stuck")) for _ in range(3)]
    await asyncio.sleep(0.05)
    await server.close()  # the calls outlive the grace: their connection is closed under them
    for call in stuck:
        with pytest.raises(LaneBroken):
            await asyncio.wait_for(call, 5)
    host.gates["stuck"].set()


async def test_a_host_that_is_not_listening_is_lane_broken_at_once():
    server = LaneServer(Host().dispatch, frozenset({"send"}))
    address = await server.start("127.0.0.1")
    await server.close()
    client = LaneClient(address)
    with pytest.raises(LaneUnreachable, match="cannot connect"):  # nothing was sent
        await client.call("send", "x")
    with pytest.raises(LaneBroken):
        await client.call("send", "x")  # spent: the owner must fetch the address again


# -- the gateway's side: Placement._call with stand-ins for Ray's actor handles ----------------------

class _Method:
    def __init__(self, fn) -> None:
        self._fn = fn

    def remote(self, *args):
        return self._fn(*args)


class FakeHostHandle:
    """Answers `lane.remote()` with `address` and counts turns that came through "Ray"."""

    def __init__(self, address: LaneAddress) -> None:
        self.address = address
        self.lookups = 0
        self.ray_turns: list[tuple] = []
        self.lane = _Method(self._lane)
        self.send = _Method(self._send)

    async def _lane(self) -> bytes:
        self.lookups += 1
        return msgspec.json.encode(self.address)

    async def _send(self, *args) -> bytes:
        self.ray_turns.append(args)
        return b"via ray"


async def test_an_unreachable_lane_sends_turns_through_ray_until_the_host_listens_elsewhere(monkeypatch):
    from actors import placement as placement_module
    from actors.placement import Placement
    from services.settings import Settings

    closed = LaneServer(Host().dispatch, frozenset({"send"}))
    dead_address = await closed.start("127.0.0.1")
    await closed.close()  # nothing listens there: a firewall, say, or a host that died
    p = Placement(Settings(shards=1))
    name = p.actor_name("t", "s")
    fake = FakeHostHandle(dead_address)
    p._routed_handle = lambda _name: fake  # no Ray here

    assert await p._call("t", "s", "send", "t", "s", "one", "m1") == b"via ray"  # nothing lost, no error
    assert await p._call("t", "s", "send", "t", "s", "two", "m2") == b"via ray"
    assert await p._call("t", "s", "send", "t", "s", "three", "m3") == b"via ray"
    assert [t[2] for t in fake.ray_turns] == ["one", "two", "three"]
    assert fake.lookups == 2  # asked once more, got the same address: not tried again for a while

    # the host comes back listening elsewhere (a restart): its lane is used at once
    host = Host()
    server = LaneServer(host.dispatch, frozenset({"send"}))
    fake.address = await server.start("127.0.0.1")
    monkeypatch.setattr(placement_module, "LANE_RETRY_S", 0.0)
    p._unreachable[name] = (dead_address, 0.0)  # the window has passed
    body = await p._call("t", "s", "send", "t", "s", "four", "m4")
    assert msgspec.json.decode(body)["args"][2] == "four" and len(fake.ray_turns) == 3
    assert [m for m, _ in host.calls] == ["send"]
    p.close_lanes()
    await server.close()


async def test_a_lane_that_breaks_mid_call_is_retried_once_then_503(monkeypatch):
    from actors.placement import Placement
    from services.errors import Overloaded
    from services.settings import Settings

    host = Host()
    host.gates["t"] = asyncio.Event()  # every call hangs on the host...
    server = LaneServer(host.dispatch, frozenset({"send"}))
    address = await server.start("127.0.0.1")
    monkeypatch.setattr("actors.lane.CLOSE_GRACE_S", 0.01)
    p = Placement(Settings(shards=1))
    fake = FakeHostHandle(address)
    p._routed_handle = lambda _name: fake  # no Ray here
    call = asyncio.create_task(p._call("t", "s", "send", "t", "s", "hello", "m1"))
    await asyncio.sleep(0.1)
    await server.close()  # ...and the host goes away under it (its calls outlive the grace)
    server2 = LaneServer(host.dispatch, frozenset({"send"}))  # back, and it dies again
    fake.address = await server2.start("127.0.0.1")
    await asyncio.sleep(0.4)  # the retry reached it
    assert len(host.calls) == 2
    await server2.close()
    with pytest.raises(Overloaded, match="retry with the same message_id"):
        await asyncio.wait_for(call, 5)
    assert fake.ray_turns == [] and fake.lookups == 2
    host.gates["t"].set()


def _ray_failures() -> list[BaseException]:
    from ray import exceptions as rx

    return [rx.NodeDiedError("node gone"), rx.WorkerCrashedError(), rx.OwnerDiedError("ab", None, ""),
            rx.ObjectLostError("ab", None, ""), rx.ActorUnschedulableError("no node fits"),
            rx.RaySystemError("raylet connection lost"), rx.LocalRayletDiedError(), rx.RpcError("gcs away")]


@pytest.mark.parametrize("failure", _ray_failures(), ids=lambda e: type(e).__name__)
async def test_a_host_call_lost_to_any_ray_failure_is_retried_with_its_id_then_answered_503(failure):
    # Not only an actor's death: a node, a worker, a lost reply or Ray's own services failing
    # mid-turn is the host being unreachable, never an internal error (500) of the gateway.
    from actors.placement import Placement
    from services.errors import Overloaded
    from services.settings import Settings

    class Flaky:
        def __init__(self, failures: int) -> None:
            self.failures, self.turns = failures, []
            self.lane = _Method(self._no_lane)
            self.send = _Method(self._send)

        async def _no_lane(self) -> None:
            return None  # turns through Ray

        async def _send(self, *args) -> bytes:
            self.turns.append(args)
            if len(self.turns) <= self.failures:
                raise failure
            return b"answered"

    p = Placement(Settings(shards=1))
    once = Flaky(1)
    p._routed_handle = lambda _name: once  # no Ray here
    assert await p._call("t", "s", "send", "t", "s", "hi", "m1") == b"answered"
    assert [t[3] for t in once.turns] == ["m1", "m1"]
    twice = Flaky(2)
    p._routed_handle = lambda _name: twice
    with pytest.raises(Overloaded, match="restarting; retry with the same message_id") as info:
        await p._call("t", "s", "send", "t", "s", "hi", "m2")
    assert info.value.status == 503 and info.value.retry_after == 1.0


async def test_a_connect_that_hangs_is_unreachable_after_the_connect_timeout(monkeypatch):
    async def dropped(*_args, **_kwargs):  # a network that drops the SYNs: no answer at all
        await asyncio.sleep(3600)

    monkeypatch.setattr("actors.lane.CONNECT_TIMEOUT_S", 0.2)
    monkeypatch.setattr("actors.lane.asyncio.open_connection", dropped)
    client = LaneClient(LaneAddress(host="127.0.0.1", port=9, token="t"))
    started = asyncio.get_running_loop().time()
    with pytest.raises(LaneUnreachable, match="TimeoutError"):
        await asyncio.wait_for(client.call("send", "x"), 5)
    assert asyncio.get_running_loop().time() - started < 2


async def test_a_new_message_id_is_said_only_to_a_host_that_takes_it_and_never_on_a_retry(monkeypatch):
    from actors.placement import Placement
    from actors.ray_host import LANE_FEATURES
    from services.errors import Overloaded
    from services.settings import Settings

    monkeypatch.setattr("actors.lane.CLOSE_GRACE_S", 0.01)
    host = Host()
    server = LaneServer(host.dispatch, frozenset({"send"}))
    fake = FakeHostHandle(await server.start("127.0.0.1", LANE_FEATURES))
    p = Placement(Settings(shards=1))
    p._routed_handle = lambda _name: fake  # no Ray here
    await p._call("t", "s", "send", "t", "s", "one", "m1", new_id=True)
    await p._call("t", "s", "send", "t", "s", "two", "c-2")  # a client's id
    assert [args for _, args in host.calls] == [["t", "s", "one", "m1", True], ["t", "s", "two", "c-2"]]

    # the lane breaks under a turn: the retry may repeat a turn that ran, so its id is not new
    host.gates["t"] = asyncio.Event()
    call = asyncio.create_task(p._call("t", "s", "send", "t", "s", "three", "m3", new_id=True))
    await asyncio.sleep(0.1)
    await server.close()
    server = LaneServer(host.dispatch, frozenset({"send"}))
    fake.address = await server.start("127.0.0.1", LANE_FEATURES)
    await asyncio.sleep(0.4)
    assert [args for _, args in host.calls[2:]] == [["t", "s", "three", "m3", True], ["t", "s", "three", "m3"]]
    await server.close()
    with pytest.raises(Overloaded):
        await asyncio.wait_for(call, 5)
    host.gates.pop("t").set()

    # a host of an earlier version lists no features: it gets the arguments it knows
    older = Host()
    server = LaneServer(older.dispatch, frozenset({"send"}))
    fake.address = await server.start("127.0.0.1")
    p.close_lanes()
    await p._call("t", "s", "send", "t", "s", "four", "m4", new_id=True)
    assert [args for _, args in older.calls] == [["t", "s", "four", "m4"]]
    await server.close()

    # what a host said counts only while its lane is open: a lane that broke may mean a host
    # restarted on an earlier version (a rollback), and a host reached through Ray gets no new_id
    newer = Host()
    server = LaneServer(newer.dispatch, frozenset({"send"}))
    fake.address = await server.start("127.0.0.1", LANE_FEATURES)
    p.close_lanes()
    await p._call("t", "s", "send", "t", "s", "five", "m5", new_id=True)
    assert p._new_id_arg(p.actor_name("t", "s"), True) == (True,)
    await server.close()
    await asyncio.sleep(0.05)  # the lane sees the host's end
    assert p._new_id_arg(p.actor_name("t", "s"), True) == ()
    p.close_lanes()
    await p._call("t", "s", "send", "t", "s", "six", "m6", new_id=True)  # unreachable now: through Ray
    assert [args for _, args in newer.calls] == [["t", "s", "five", "m5", True]]
    assert fake.ray_turns == [("t", "s", "six", "m6")]
