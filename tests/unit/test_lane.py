"""The turn lane (actors/lane.py): a real server and client on 127.0.0.1, no Ray."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import socket
import struct
import sys
import threading
from collections.abc import Iterator

import msgspec
import pytest
from structlog.testing import capture_logs

from actors.lane import (
    _ACK,
    HELLO_ACK,
    MAX_FRAME,
    MAX_HELLO,
    MAX_PENDING_HELLOS_PER_PEER,
    STREAM,
    LaneAddress,
    LaneBroken,
    LaneClient,
    LaneError,
    LaneServer,
    LaneStalled,
    LaneUnreachable,
    _Call,
    frame,
    read_frame,
)
from services.wire import Turn


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
    assert await asyncio.wait_for(reader.read(), 5) == frame(_ACK)  # the hello taken, then closed
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


async def test_an_oversized_hello_is_refused_from_its_length_without_its_body_being_read(lane, monkeypatch):
    # a peer without the token declares a 16 MiB "hello": before, the host read (and held) it all
    host, server, client = lane
    monkeypatch.setattr("actors.lane.HELLO_TIMEOUT_S", 30.0)  # what closes it is the length, not the clock
    reader, writer = await asyncio.open_connection(client.address.host, client.address.port)
    writer.write(MAX_FRAME.to_bytes(4, "big") + b"\0" * 1000)
    try:
        rest = await asyncio.wait_for(reader.read(), 1.0)  # closed at once...
    except ConnectionResetError:
        rest = b""  # ...with our bytes unread, which the host's kernel answers with a reset
    assert rest == b""
    writer.close()

    # what the host read of such a connection: the length prefix, nothing of the body
    class Writer:
        closed = False

        def get_extra_info(self, _name):
            return None

        def close(self):
            self.closed = True

    fed = asyncio.StreamReader()
    fed.feed_data((MAX_HELLO + 1).to_bytes(4, "big") + b"x" * 1000)
    stranger = Writer()
    await asyncio.wait_for(server._serve(fed, stranger), 1.0)  # no wait for the rest of the body
    fed.feed_eof()
    assert stranger.closed and len(await fed.read()) == 1000  # the body is still unread
    assert host.calls == []
    assert len(frame(msgspec.msgpack.encode(client.address.token))) - 4 <= MAX_HELLO  # a gateway's fits
    assert msgspec.json.decode(await client.call("send", "after")) is not None


async def test_past_the_pending_hello_cap_a_new_connection_is_closed_at_once(lane, monkeypatch):
    host, _, client = lane
    monkeypatch.setattr("actors.lane.MAX_PENDING_HELLOS", 3)
    monkeypatch.setattr("actors.lane.HELLO_TIMEOUT_S", 30.0)
    silent = [await asyncio.open_connection(client.address.host, client.address.port) for _ in range(3)]
    await asyncio.sleep(0.1)  # each waits for its hello
    reader, writer = await asyncio.open_connection(client.address.host, client.address.port)
    assert await asyncio.wait_for(reader.read(), 1.0) == b""  # one too many: closed, nothing read
    writer.close()
    for r, _ in silent:  # the ones within the cap are held, until their hello times out
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(r.read(1), 0.1)
    for _, w in silent:  # they go: a gateway gets in again
        w.close()
    await asyncio.sleep(0.1)
    assert msgspec.json.decode(await client.call("send", "in"))["args"] == ["in"]
    assert [args for _, args in host.calls] == [["in"]]


async def test_one_address_cannot_hold_every_pending_hello_slot(lane, monkeypatch):
    # a stranger on a worker node held the 64 pre-hello slots, and every gateway was turned away
    host, _, client = lane
    monkeypatch.setattr("actors.lane.HELLO_TIMEOUT_S", 30.0)
    host_, port = client.address.host, client.address.port
    silent = [await asyncio.open_connection(host_, port, local_addr=("127.0.0.9", 0))
              for _ in range(MAX_PENDING_HELLOS_PER_PEER)]
    try:
        reader, writer = await asyncio.open_connection(host_, port, local_addr=("127.0.0.9", 0))
        assert await asyncio.wait_for(reader.read(), 5) == b""  # one too many from that address: closed unread
        writer.close()
        # a gateway from another address gets in while they are held
        reader, writer = await asyncio.open_connection(host_, port, local_addr=("127.0.0.10", 0))
        writer.write(frame(msgspec.msgpack.encode(client.address.token)))
        assert await asyncio.wait_for(read_frame(reader), 5) == _ACK
        writer.close()
        assert msgspec.json.decode(await client.call("send", "in"))["args"] == ["in"]
        assert [args for _, args in host.calls] == [["in"]]
    finally:
        for _, w in silent:
            w.close()


async def test_a_host_that_closes_before_taking_the_hello_is_unreachable_not_broken(lane, monkeypatch):
    # before, the gateway sent its call with the hello, and the close read as a broken lane: the
    # turn was retried through Ray once, then answered 503. Nothing was sent: Ray's path it is.
    host, _, client = lane
    monkeypatch.setattr("actors.lane.MAX_PENDING_HELLOS", 0)  # the host turns every connection away
    with pytest.raises(LaneUnreachable, match="did not take this gateway's hello"):
        await client.call("send", "x")
    assert client.broken and host.calls == []
    with pytest.raises(LaneUnreachable):  # and says so to every later caller, having sent nothing
        await client.call("send", "y")


async def test_a_gateway_of_an_earlier_version_reads_past_the_hello_answer(lane):
    host, _, client = lane
    earlier = LaneClient(msgspec.structs.replace(client.address, features=()))  # knows no HELLO_ACK
    assert msgspec.json.decode(await earlier.call("send", "old"))["args"] == ["old"]  # the ack is dropped
    assert host.calls == [("send", ["old"])]
    earlier.close()


def _tcp_options() -> list[tuple[int, int, int]]:
    """(level, option, value) of what a lane's sockets must carry, where the platform has it."""
    wanted = [(socket.SOL_SOCKET, "SO_KEEPALIVE", 1), (socket.IPPROTO_TCP, "TCP_KEEPIDLE", 5),
              (socket.IPPROTO_TCP, "TCP_KEEPINTVL", 2), (socket.IPPROTO_TCP, "TCP_KEEPCNT", 3),
              (socket.IPPROTO_TCP, "TCP_USER_TIMEOUT", 15_000)]
    return [(level, getattr(socket, name), value) for level, name, value in wanted if hasattr(socket, name)]


async def test_both_ends_of_a_lane_carry_tcp_keepalive_and_a_user_timeout(lane):
    # so a peer whose node vanished (no FIN, no RST) breaks the lane in ~15 s, not ~15 min or never
    _, server, client = lane
    await client.call("send", "x")
    gateway_end = client._writer.get_extra_info("socket")
    (host_end,) = [w.get_extra_info("socket") for w in server._writers]
    assert gateway_end.getsockname() == host_end.getpeername()  # the two ends of one connection
    if sys.platform == "linux":
        assert len(_tcp_options()) == 5
    for level, option, value in _tcp_options():
        assert gateway_end.getsockopt(level, option) == value, option
        assert host_end.getsockopt(level, option) == value, option


def _drop_everything(sock) -> None:
    """Make `sock` drop every packet that reaches it before TCP sees it (a socket filter: BPF_RET
    0), so it neither acknowledges data nor answers a probe: to its peer, a node that vanished.
    Nothing outside the test's own socket changes (no firewall rule, no privilege needed)."""
    program = ctypes.create_string_buffer(struct.pack("HBBI", 0x06, 0, 0, 0))  # the kernel copies it
    sock.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_ATTACH_FILTER", 26),
                    struct.pack("HL", 1, ctypes.addressof(program)))


@pytest.mark.skipif(sys.platform != "linux", reason="socket filters and TCP_USER_TIMEOUT are Linux's")
async def test_a_host_whose_node_vanished_breaks_the_lane_and_the_turn_is_retried_where_it_restarted(monkeypatch):
    # Before, nothing noticed: the turn waited for ever and the gateway handed the dead lane to
    # every later turn of the host, though Ray had restarted it elsewhere.
    from actors.placement import Placement
    from services.settings import Settings

    for name, value in (("KEEPALIVE_IDLE_S", 1), ("KEEPALIVE_INTERVAL_S", 1), ("KEEPALIVE_PROBES", 2),
                        ("USER_TIMEOUT_S", 2)):
        monkeypatch.setattr(f"actors.lane.{name}", value)
    lost = Host()
    lost.gates["t"] = asyncio.Event()  # the turn is running on the host when its node goes
    lost_server = LaneServer(lost.dispatch, frozenset({"send"}))
    fake = FakeHostHandle(await lost_server.start("127.0.0.1"))
    p = Placement(Settings(shards=1))
    p._routed_handle = lambda _name: fake  # no Ray here
    turn = asyncio.create_task(p._call("t", "s", "send", "t", "s", "hello", "m1"))
    await asyncio.sleep(0.2)
    assert len(lost.calls) == 1
    (host_end,) = [w.get_extra_info("socket") for w in lost_server._writers]
    _drop_everything(host_end)  # the node is gone: not a packet in or out of it answers
    restarted = Host()  # Ray restarts the host on another node: it listens at another address
    server = LaneServer(restarted.dispatch, frozenset({"send"}))
    fake.address = await server.start("127.0.0.1")

    body = await asyncio.wait_for(turn, 10)  # the lane broke (~2 s here): retried with its message id
    assert msgspec.json.decode(body)["args"] == ["t", "s", "hello", "m1"]
    assert [args for _, args in restarted.calls] == [["t", "s", "hello", "m1"]]
    assert fake.lookups == 2 and fake.ray_turns == []
    await asyncio.sleep(0.5)
    assert not lost_server._writers  # the host's end let go of the vanished gateway too
    await p._call("t", "s", "send", "t", "s", "next", "m2")  # later turns: the new lane
    assert len(restarted.calls) == 2 and len(lost.calls) == 1
    lost.gates["t"].set()
    p.close_lanes()
    await server.close()
    await lost_server.close()


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
    from kernel.errors import Overloaded
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
    from kernel.errors import Overloaded
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
    from kernel.errors import Overloaded
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


def _ray_task_error(cause: Exception, method: str = "lane") -> Exception:
    """What Ray raises for a host call whose code raised `cause`: an error of both classes, whose
    text is the host's traceback, pid and node address."""
    from ray.exceptions import RayTaskError

    traceback = (f'Traceback (most recent call last):\n  File "/app/actors/ray_host.py", line 196, in {method}\n'
                 f"{type(cause).__name__}: {cause}")
    return RayTaskError(f"SessionHostActor.{method}", traceback, cause, proctitle=f"ray::SessionHostActor.{method}()",
                        pid=4242, ip="10.0.3.7", actor_repr="SessionHostActor(ce-host-0)",
                        actor_id="a1b2c3").as_instanceof_cause()


@pytest.mark.parametrize("raised", ["storage_unavailable", "shutting_down", "a_bug"])
async def test_a_host_that_cannot_say_its_lane_address_gets_the_turn_through_ray_and_no_traceback_leaks(
        raised, monkeypatch):
    # Before, the lookup's error went to the client as the 503's detail: the host's traceback,
    # pid and node IP. Ray's path answers such a host's turn cleanly (HostResult's error).
    from actors import placement as placement_module
    from actors.placement import Placement
    from kernel.errors import Overloaded
    from services.settings import Settings
    from storage.errors import StorageUnavailable

    cause = {"storage_unavailable": StorageUnavailable("cannot connect to Postgres at db:5432/ce (refused)"),
             "shutting_down": Overloaded("this session host is shutting down", reason="shutting_down"),
             "a_bug": RuntimeError("a bug in lane()")}[raised]
    host = Host()
    server = LaneServer(host.dispatch, frozenset({"send"}))

    class Restarting(FakeHostHandle):  # Ray restarted it while Postgres is away: lane() raises
        failing = True

        async def _lane(self) -> bytes:
            if self.failing:
                self.lookups += 1
                raise _ray_task_error(cause)
            return await super()._lane()

    fake = Restarting(await server.start("127.0.0.1"))
    p = Placement(Settings(shards=1))
    p._routed_handle = lambda _name: fake  # no Ray here
    with capture_logs() as logs:
        assert await p._call("t", "s", "send", "t", "s", "one", "m1") == b"via ray"
    (warning,) = [e for e in logs if e["log_level"] == "warning"]
    assert warning["event"] == "session_host_lane_lookup_failed" and type(cause).__name__ in warning["error"]
    assert "4242" not in str(logs) and "10.0.3.7" not in str(logs)
    assert await p._call("t", "s", "send", "t", "s", "two", "m2") == b"via ray"  # not asked again at once
    assert [t[3] for t in fake.ray_turns] == ["m1", "m2"] and fake.lookups == 1

    fake.failing = False  # up again: after LANE_LOOKUP_RETRY_S the host is asked again, its lane used
    monkeypatch.setattr(placement_module, "LANE_LOOKUP_RETRY_S", 0.0)
    p._unreachable[p.actor_name("t", "s")] = (None, 0.0)  # the window has passed
    body = await p._call("t", "s", "send", "t", "s", "three", "m3")
    assert msgspec.json.decode(body)["args"][3] == "m3" and fake.lookups == 2 and len(fake.ray_turns) == 2
    p.close_lanes()
    await server.close()


async def test_a_lane_lookup_lost_to_the_hosts_failure_is_the_host_lost():
    from ray.exceptions import ActorDiedError

    from actors.placement import Placement
    from kernel.errors import Overloaded
    from services.settings import Settings

    class Gone(FakeHostHandle):
        async def _lane(self) -> bytes:
            self.lookups += 1
            raise ActorDiedError()

    fake = Gone(LaneAddress(host="127.0.0.1", port=9, token="t"))
    p = Placement(Settings(shards=1))
    p._routed_handle = lambda _name: fake
    with pytest.raises(Overloaded, match="restarting; retry with the same message_id"):
        await p._call("t", "s", "send", "t", "s", "hi", "m1")
    assert fake.lookups == 2 and fake.ray_turns == []  # retried once, as any host lost


async def _healthy_lane_and_a_view_that_fails(view_failures: int):
    """A turn held on a healthy host's lane, and a view of another session on the same host whose
    Ray calls fail `view_failures` times with ActorDiedError (a stale handle's, say)."""
    from ray.exceptions import ActorDiedError

    from actors.placement import Placement
    from services.settings import Settings

    host = Host()
    host.gates["t"] = asyncio.Event()
    server = LaneServer(host.dispatch, frozenset({"send"}))
    fake = FakeHostHandle(await server.start("127.0.0.1"))
    failures = [view_failures]

    async def view(*_args):
        await asyncio.sleep(0.1)  # Ray takes a moment to say the (old) actor died
        if failures[0]:
            failures[0] -= 1
            raise ActorDiedError()

    fake.view = _Method(view)
    p = Placement(Settings(shards=1))
    p._routed_handle = lambda _name: fake  # no Ray here
    turn = asyncio.create_task(p._call("t", "s", "send", "t", "s", "hello", "m1"))
    await asyncio.sleep(0.1)
    return host, server, fake, p, turn


async def test_a_ray_failure_of_a_view_leaves_the_hosts_lane_and_its_running_turn_alone():
    # Before, the view's error closed the lane: the running turn broke and was sent again (one
    # error), or came back 503 "restarting" though it ran on a healthy host (two).
    from kernel.errors import Overloaded

    host, server, fake, p, turn = await _healthy_lane_and_a_view_that_fails(1)
    lane = p._lanes[p.actor_name("t", "s")]
    assert await p._call("t", "other", "view", "t", "other") is None  # retried once, answered
    await asyncio.sleep(0.2)
    assert p._lanes[p.actor_name("t", "s")] is lane and not lane.broken
    host.gates["t"].set()
    assert msgspec.json.decode(await asyncio.wait_for(turn, 5))["args"][3] == "m1"
    assert [args[3] for _, args in host.calls] == ["m1"]  # sent once
    p.close_lanes()
    await server.close()

    host, server, fake, p, turn = await _healthy_lane_and_a_view_that_fails(2)
    with pytest.raises(Overloaded, match="restarting"):  # the view's own answer
        await p._call("t", "other", "view", "t", "other")
    await asyncio.sleep(0.2)
    assert not turn.done()  # still running on the host: not a 503
    host.gates["t"].set()
    assert msgspec.json.decode(await asyncio.wait_for(turn, 5))["args"][3] == "m1"
    assert [args[3] for _, args in host.calls] == ["m1"] and fake.lookups == 1
    p.close_lanes()
    await server.close()


class _FailingStream:
    """A host's `stream` through Ray that fails with ActorDiedError once `gate` is set."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()

    def options(self, **_kwargs) -> _FailingStream:
        return self

    def remote(self, *_args):
        return self._events()

    async def _events(self):
        from ray.exceptions import ActorDiedError

        await self.gate.wait()
        raise ActorDiedError()
        yield  # an async generator, as Ray's streaming call is


async def test_a_turn_lost_to_its_hosts_failure_takes_that_lane_but_never_a_newer_one(monkeypatch):
    from actors.placement import Placement
    from kernel.errors import Overloaded
    from services.settings import Settings

    monkeypatch.setattr("actors.lane.CLOSE_GRACE_S", 0.01)
    host = Host()
    server = LaneServer(host.dispatch, frozenset({"send"}))
    fake = FakeHostHandle(await server.start("127.0.0.1"))
    fake.stream = _FailingStream()
    p = Placement(Settings(shards=1))
    p._routed_handle = lambda _name: fake  # no Ray here
    name = p.actor_name("t", "s")

    async def stream() -> None:
        async for _ in p.stream(Turn(tenant_id="t", session_id="s", text="hi", message_id="m-stream")):
            pass

    await p._call("t", "s", "send", "t", "s", "one", "m1")
    first = p._lanes[name]
    fake.stream.gate.set()  # an SSE turn to the same host, lost to the host's failure
    with pytest.raises(Overloaded, match="restarting"):
        await stream()
    assert first.broken and name not in p._lanes  # the host failed: so did its lane

    await p._call("t", "s", "send", "t", "s", "two", "m2")
    second = p._lanes[name]
    fake.stream = _FailingStream()
    running = asyncio.create_task(stream())  # found `second`...
    await asyncio.sleep(0.05)
    await server.close()  # ...which breaks: the host restarted, and listens elsewhere
    server = LaneServer(host.dispatch, frozenset({"send"}))
    fake.address = await server.start("127.0.0.1")
    await asyncio.sleep(0.05)
    await p._call("t", "s", "send", "t", "s", "three", "m3")
    third = p._lanes[name]
    assert third is not second and second.broken
    fake.stream.gate.set()  # Ray reports the old process's death late
    with pytest.raises(Overloaded, match="restarting"):
        await asyncio.wait_for(running, 5)
    assert p._lanes[name] is third and not third.broken  # the newer lane is not closed
    await p._call("t", "s", "send", "t", "s", "four", "m4")
    assert [args[3] for _, args in host.calls] == ["m1", "m2", "m3", "m4"] and fake.lookups == 3
    p.close_lanes()
    await server.close()


# -- a host alive to TCP but hung: pings, LaneStalled, 503 host_unresponsive ------------------------

class HangingHost:
    """A lane server on an event loop of its own thread, so that it can hang while the test's loop
    goes on: a call whose first argument is "hang" blocks that loop (as a stopped process or a
    stuck loop would) until `wake()`."""

    def __init__(self) -> None:
        self.calls: list[list] = []
        self._woken = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.server = LaneServer(self._dispatch, frozenset({"send", "view"}), stream=self._stream,
                                 streams=frozenset({"stream"}))
        self.address = self._run(self.server.start("127.0.0.1", (STREAM,)))

    async def _stream(self, method: str, args: list):
        from actors.ray_host import command_decoder  # the host's `stream` takes one encoded command

        yield msgspec.json.encode({"event": "delta", "data": {"text": "first"}})
        yield await self._dispatch(method, [command_decoder.decode(args[0]).text])

    async def _dispatch(self, method: str, args: list) -> bytes:
        self.calls.append(args)
        if args and args[0] == "hang":
            self._woken.wait()  # blocks the host's whole loop: nothing on it runs, pings included
        elif args and args[0] == "slow":
            await asyncio.sleep(1.5)  # a long tool call: the loop stays free
        return msgspec.json.encode(args)

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    def wake(self) -> None:
        self._woken.set()

    def close(self) -> None:
        self.wake()
        self._run(self.server.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.fixture
def fast_watch(monkeypatch) -> None:
    monkeypatch.setattr("actors.lane.PROBE_QUIET_S", 0.2)
    monkeypatch.setattr("actors.lane.PING_TIMEOUT_S", 0.5)
    monkeypatch.setattr("actors.lane.WATCH_INTERVAL_S", 0.05)


@pytest.fixture
def hanging_host(fast_watch) -> Iterator[HangingHost]:
    host = HangingHost()
    yield host
    host.close()


async def _until(condition, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the condition never held")


async def test_a_hung_host_is_found_unresponsive_its_calls_fail_and_new_ones_are_not_sent_until_it_wakes(
    hanging_host,
):
    client = LaneClient(hanging_host.address)
    assert msgspec.json.decode(await client.call("send", "first")) == ["first"]
    with capture_logs() as logs:
        waiting = [asyncio.create_task(client.call("send", "hang")), asyncio.create_task(client.call("send", "queued"))]
        for call in waiting:  # found within PROBE_QUIET_S + PING_TIMEOUT_S and a watch interval or two
            with pytest.raises(LaneStalled, match="may have run"):
                await asyncio.wait_for(call, 5)
        assert client.stalled and not client.broken
        with pytest.raises(LaneStalled, match="nothing was sent"):
            await client.call("send", "while hung")
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["session_host_unresponsive"]

    hanging_host.wake()  # the host's loop runs again: it answers the ping, then the calls it held
    await _until(lambda: not client.stalled)
    assert msgspec.json.decode(await client.call("send", "after")) == ["after"]
    assert hanging_host.calls == [["first"], ["hang"], ["queued"], ["after"]]  # "while hung" never went
    assert not client.broken
    client.close()


async def test_a_host_busy_with_a_long_call_answers_its_pings_and_is_never_found_unresponsive(hanging_host):
    client = LaneClient(hanging_host.address)
    # 1.5 s of quiet is past PROBE_QUIET_S + PING_TIMEOUT_S: without the host's answers it would stall
    assert msgspec.json.decode(await client.call("send", "slow")) == ["slow"]
    assert not client.stalled and client._ping is None
    client.close()


async def test_a_host_of_an_earlier_version_answers_a_ping_with_an_error_which_is_as_good(fast_watch):
    class EarlierServer(LaneServer):  # reads every frame as a call to dispatch, pings included
        async def _serve(self, reader, writer):
            await self._admit(reader, writer)
            while True:
                call = msgspec.msgpack.decode(await read_frame(reader), type=_Call)
                asyncio.create_task(self._run(call, writer))

    host = Host()
    host.gates["long"] = asyncio.Event()
    server = EarlierServer(host.dispatch, frozenset({"send"}))
    # nor did it answer the hello (HELLO_ACK), nor say it would
    client = LaneClient(msgspec.structs.replace(await server.start("127.0.0.1"), features=()))
    call = asyncio.create_task(client.call("send", "long"))
    await asyncio.sleep(1.2)  # past PROBE_QUIET_S + PING_TIMEOUT_S
    assert not call.done() and not client.stalled
    host.gates["long"].set()
    assert msgspec.json.decode(await call)["args"] == ["long"]
    client.close()
    await server.close()


async def test_a_turn_on_a_hung_host_is_503_host_unresponsive_and_not_retried_through_ray(hanging_host):
    from actors.placement import Placement
    from kernel.errors import Overloaded
    from services.settings import Settings

    p = Placement(Settings(shards=1))
    fake = FakeHostHandle(hanging_host.address)
    fake.view = _Method(lambda *a: pytest.fail("a view went to a host known to be hung"))
    p._routed_handle = lambda _name: fake  # no Ray here
    assert msgspec.json.decode(await p._call("t", "s", "send", "ok")) == ["ok"]
    with pytest.raises(Overloaded, match="has not answered") as hung:
        await asyncio.wait_for(p._call("t", "s", "send", "hang"), 5)
    assert (hung.value.status, hung.value.reason, hung.value.retry_after) == (503, "host_unresponsive", 5.0)
    for method in ("send", "view"):  # refused at once, nothing sent: not the lane, not Ray
        with pytest.raises(Overloaded, match="has not answered"):
            await p._call("t", "s", method, "next")
    assert fake.ray_turns == [] and fake.lookups == 1  # the lane is kept: the host may wake

    hanging_host.wake()
    await _until(lambda: not p._lanes[p.actor_name("t", "s")].stalled)
    assert msgspec.json.decode(await p._call("t", "s", "send", "hang")) == ["hang"]  # its retry
    assert hanging_host.calls == [["ok"], ["hang"], ["hang"]] and fake.lookups == 1
    p.close_lanes()


async def test_a_host_that_does_not_say_its_lane_address_in_time_is_503_host_unresponsive(monkeypatch):
    from actors.placement import Placement
    from kernel.errors import Overloaded
    from services.settings import Settings

    monkeypatch.setattr("actors.placement.LANE_LOOKUP_TIMEOUT_S", 0.2)
    never = asyncio.Event()

    class HungHandle(FakeHostHandle):
        async def _lane(self) -> bytes:
            self.lookups += 1
            await never.wait()
            raise AssertionError("unreachable")

    p = Placement(Settings(shards=1))
    fake = HungHandle(LaneAddress(host="127.0.0.1", port=1, token="t"))
    p._routed_handle = lambda _name: fake
    with pytest.raises(Overloaded, match="has not answered") as hung, capture_logs():
        await p._call("t", "s", "send", "hello")
    assert hung.value.reason == "host_unresponsive" and fake.ray_turns == []  # not sent through Ray either
    for method in ("send", "view"):  # the next ones for UNRESPONSIVE_RETRY_S: at once, no new lookup held
        with pytest.raises(Overloaded, match="has not answered"):
            await asyncio.wait_for(p._call("t", "s", method, "again"), 0.1)
    assert fake.lookups == 1


# -- streamed calls: each event a frame ------------------------------------------------------------

class StreamingHost(Host):
    """`stream` yields an event per word of its first argument; "fail" raises after the first."""

    def __init__(self) -> None:
        super().__init__()
        self.streamed: list[list] = []
        self.gate = asyncio.Event()

    async def stream(self, method: str, args: list):
        self.streamed.append(args)
        for i, word in enumerate(args[0].split()):
            if word == "fail":
                raise RuntimeError("a bug in the host's stream")
            if word == "wait":
                await self.gate.wait()
            yield msgspec.json.encode({"i": i, "word": word})


@pytest.fixture
async def streaming_lane():
    host = StreamingHost()
    server = LaneServer(host.dispatch, frozenset({"send"}), stream=host.stream, streams=frozenset({"stream"}))
    client = LaneClient(await server.start("127.0.0.1", (STREAM,)))
    yield host, server, client
    client.close()
    await server.close()


async def _events(client: LaneClient, text: str) -> list[str]:
    return [msgspec.json.decode(raw)["word"] async for raw in client.stream("stream", text)]


async def test_a_streamed_call_yields_each_event_as_the_host_does_beside_plain_calls(streaming_lane):
    host, _, client = streaming_lane
    assert client.address.features == (STREAM, HELLO_ACK)
    events = client.stream("stream", "one wait two three")
    assert msgspec.json.decode(await anext(events))["word"] == "one"  # before the host has the rest
    assert msgspec.json.decode(await client.call("send", "between")) == {"method": "send", "args": ["between"]}
    host.gate.set()
    assert [msgspec.json.decode(raw)["word"] async for raw in events] == ["wait", "two", "three"]
    many = await asyncio.gather(*(_events(client, f"a{i} b{i}") for i in range(50)))
    assert many == [[f"a{i}", f"b{i}"] for i in range(50)]
    assert await _events(client, "") == [] and not client._streams


async def test_a_stream_that_fails_on_the_host_ends_in_lane_error_and_the_lane_lives_on(streaming_lane):
    _, _, client = streaming_lane
    got = []
    with pytest.raises(LaneError, match="failed to run"), capture_logs():
        async for raw in client.stream("stream", "first fail never"):
            got.append(msgspec.json.decode(raw)["word"])
    assert got == ["first"]
    assert await _events(client, "still here") == ["still", "here"]


async def test_a_stream_cut_by_its_connection_raises_lane_broken(streaming_lane, monkeypatch):
    host, server, client = streaming_lane
    monkeypatch.setattr("actors.lane.CLOSE_GRACE_S", 0.01)
    events = client.stream("stream", "one wait two")
    assert msgspec.json.decode(await anext(events))["word"] == "one"
    await server.close()
    with pytest.raises(LaneBroken):
        await asyncio.wait_for(anext(events), 5)
    host.gate.set()


async def test_a_consumer_that_stops_early_leaves_the_call_running_and_its_frames_dropped(streaming_lane):
    host, _, client = streaming_lane
    events = client.stream("stream", "one wait two three")
    await anext(events)
    await events.aclose()  # an SSE client hung up
    assert not client._streams
    host.gate.set()
    assert await _events(client, "next") == ["next"]  # the late frames of the first were dropped


async def test_a_plain_reply_is_what_a_gateway_of_an_earlier_version_decodes():
    class EarlierReply(msgspec.Struct, array_like=True):  # the reply as it was before `more`
        id: int
        body: bytes = b""
        error: str | None = None

    earlier = msgspec.msgpack.Decoder(EarlierReply)
    from actors.lane import _Reply

    assert earlier.decode(msgspec.msgpack.encode(_Reply(id=3, body=b"x"))) == EarlierReply(id=3, body=b"x")
    assert earlier.decode(msgspec.msgpack.encode(_Reply(id=4, error="no"))) == EarlierReply(id=4, error="no")


async def test_a_stream_on_a_hung_host_raises_lane_stalled(hanging_host):
    client = LaneClient(hanging_host.address)
    await client.call("send", "first")  # connected

    async def hang_then_stream():
        hang = asyncio.create_task(client.call("send", "hang"))
        await asyncio.sleep(0.05)
        try:
            return [raw async for raw in client.stream("view", "x")]  # not a stream method here: waits
        finally:
            with contextlib.suppress(LaneStalled):
                await hang

    with pytest.raises(LaneStalled), capture_logs():
        await asyncio.wait_for(hang_then_stream(), 5)
    assert not client._streams
    client.close()


async def test_an_sse_turn_goes_over_a_lane_that_carries_streams_and_through_ray_otherwise():
    from actors.placement import Placement
    from actors.ray_host import encode_command
    from services.settings import Settings

    host = StreamingHost()
    server = LaneServer(host.dispatch, frozenset({"send"}), stream=host.stream, streams=frozenset({"stream"}))
    address = await server.start("127.0.0.1", (STREAM,))
    p = Placement(Settings(shards=1))
    fake = FakeHostHandle(address)
    fake.stream = _FailingStream()  # Ray's path: never reached while the lane carries streams
    p._routed_handle = lambda _name: fake

    def as_events(words: list[str]) -> list[bytes]:
        return [msgspec.json.encode({"event": "delta", "data": {"text": w}}) for w in words]

    async def stream_dispatch(method: str, args: list):
        host.streamed.append(args)
        for raw in as_events(["hi", "there"]):
            yield raw
        yield msgspec.json.encode({"event": "done", "data": {}})

    server._stream = stream_dispatch
    got = [(e.event, e.data) async for e in p.stream(Turn(tenant_id="t", session_id="s", text="hello", message_id="m1"))]
    assert got == [("delta", {"text": "hi"}), ("delta", {"text": "there"}), ("done", {})]
    # the command crosses encoded once (actors.ray_host.encode_command), as the host's `stream` takes it
    sent = encode_command(Turn(tenant_id="t", session_id="s", text="hello", message_id="m1"))
    assert host.streamed == [[sent]] and fake.lookups == 1

    # a host whose lane does not list STREAM (an earlier version): the same turn through Ray
    p.close_lanes()
    fake.address = msgspec.structs.replace(address, features=())
    fake.stream.gate.set()
    with pytest.raises(Exception, match="restarting"):  # _FailingStream: Ray's path was taken
        async for _ in p.stream(Turn(tenant_id="t", session_id="s", text="hello", message_id="m2")):
            pass
    assert len(host.streamed) == 1
    await server.close()


async def test_an_sse_turn_on_a_host_that_hangs_mid_stream_is_503_host_unresponsive(hanging_host):
    from actors.placement import Placement
    from kernel.errors import Overloaded
    from services.settings import Settings

    p = Placement(Settings(shards=1))
    fake = FakeHostHandle(hanging_host.address)
    fake.stream = _FailingStream()  # never reached: the lane carries streams
    p._routed_handle = lambda _name: fake
    got = []
    with pytest.raises(Overloaded, match="has not answered") as hung, capture_logs():
        async for event in p.stream(Turn(tenant_id="t", session_id="s", text="hang", message_id="m1")):
            got.append(event.data)
    assert got == [{"text": "first"}] and hung.value.reason == "host_unresponsive"
    hanging_host.wake()
    p.close_lanes()


class PingDeafHost:
    """A raw lane peer that answers calls but no ping until `hear_pings`; a call whose first
    argument is "held" is answered only once `release` is set."""

    def __init__(self) -> None:
        self.hear_pings = False
        self.release = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def start(self) -> LaneAddress:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return LaneAddress(host="127.0.0.1", port=self.server.sockets[0].getsockname()[1], token="t")

    async def _serve(self, reader, writer) -> None:
        await read_frame(reader)  # the hello
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                call = msgspec.msgpack.decode(await read_frame(reader), type=_Call)
                if call.method == "ping" and not self.hear_pings:
                    continue
                asyncio.create_task(self._answer(call, writer))

    async def _answer(self, call, writer) -> None:
        if call.args[:1] == ["held"]:
            await self.release.wait()
        writer.write(frame(msgspec.msgpack.encode([call.id, msgspec.json.encode(call.args)])))

    async def close(self) -> None:
        self.server.close()


async def test_a_lane_that_hears_its_host_again_before_the_pings_answer_is_not_found_hung_again(fast_watch):
    host = PingDeafHost()
    client = LaneClient(await host.start())
    with capture_logs() as logs:
        with pytest.raises(LaneStalled):
            await asyncio.wait_for(client.call("send", "held"), 5)  # the ping goes unanswered: stalled
        host.release.set()  # the host wakes: the held call's late reply comes back, the ping's answer not yet
        await _until(lambda: not client.stalled)
        await asyncio.sleep(0.3)  # past PING_TIMEOUT_S since that ping went out
        assert not client.stalled
        assert msgspec.json.decode(await client.call("send", "after")) == ["after"]
    assert [e["event"] for e in logs] == ["session_host_unresponsive", "session_host_responsive"]
    client.close()
    await host.close()


async def test_calls_that_waited_for_a_connect_that_failed_are_all_told_it_was_unreachable():
    server = LaneServer(Host().dispatch, frozenset({"send"}))
    address = await server.start("127.0.0.1")
    await server.close()  # nothing listens there
    client = LaneClient(address)
    results = await asyncio.gather(client.call("send", "a"), client.call("send", "b"),
                                   anext(client.stream("stream", "c")), return_exceptions=True)
    assert [type(r) for r in results] == [LaneUnreachable] * 3  # nothing was sent: Ray's path may take them


async def test_a_turn_the_hosts_lane_failed_to_run_is_a_500_that_says_so_not_an_unhandled_error():
    from actors.placement import HostFailure, Placement
    from services.gateway.common import failure
    from services.settings import Settings

    host = StreamingHost()

    async def failing_dispatch(method: str, args: list) -> bytes:
        raise RuntimeError("a bug in the host")

    server = LaneServer(failing_dispatch, frozenset({"send"}), stream=host.stream, streams=frozenset({"stream"}))
    p = Placement(Settings(shards=1))
    fake = FakeHostHandle(await server.start("127.0.0.1", (STREAM,)))
    p._routed_handle = lambda _name: fake
    with capture_logs() as logs:
        with pytest.raises(HostFailure) as sent:
            await p._call("t", "s", "send", "t", "s", "hi", "m1")
        with pytest.raises(HostFailure) as streamed:
            async for _ in p._stream_events(p.actor_name("t", "s"), "first fail", new_id=False):
                pass
        for exc in (sent.value, streamed.value):
            status, _title, detail, retry_after = failure(exc, "r1", "/v1/sessions/s/messages")
            assert (status, retry_after) == (500, None) and "failed to run this turn" in detail
    events = [e["event"] for e in logs]
    assert events.count("session_host_lane_error") == 2 and "unhandled_error" not in events
    assert fake.ray_turns == []  # not run again through Ray: it may have run
    p.close_lanes()
    await server.close()


async def test_the_hosts_count_of_lane_calls_counts_only_the_methods_it_is_told_to():
    # the host reports turns over its lane; a watcher's long wait (`watch`) is not one
    host = Host()
    server = LaneServer(host.dispatch, frozenset({"send", "watch"}), counted=frozenset({"send"}))
    client = LaneClient(await server.start("127.0.0.1"))
    try:
        await client.call("watch", "t1", "s1", 0, 0.0)
        await client.call("send", "t1", "s1", "hello", None)
        await client.call("watch", "t1", "s1", 2, 0.0)
        assert server.calls == 1 and [m for m, _ in host.calls] == ["watch", "send", "watch"]
    finally:
        client.close()
        await server.close()
