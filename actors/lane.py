"""The turn lane: a gateway's turns to a shard host over one TCP connection, beside Ray's task path.

Ray places, names, restarts and kills the session hosts, and carries every control call (ready,
stats, rescale, shutdown). A turn is the one call made per message, and Ray's actor task path
costs it ~0.8 ms of CPU (caller and actor) and ~1.5 ms of latency on an idle 2-core machine
(measured: README § Performance). So a shard host also listens on its node's address, on a port
the OS picks, and the gateway sends `send`/`decide` there: length-prefixed msgpack frames,
many calls multiplexed on one connection, replies matched by call id (they come back out of
order). The host's reply body is the same encoded HostResult the Ray path returns. A streamed
turn (`stream`, for a host whose address lists STREAM) is answered with one frame per event
(`more` set), then a last frame without it: the same encoded StreamEvents as Ray's streaming
generator yields.

Only a gateway that got the host's address from the host itself (a Ray call) may use it: the
address carries a random token, the connection's first frame must present it, and a connection
that does not is closed before any call is read from it. A peer without the token gets little
of the host: a first frame declared longer than MAX_HELLO is refused on its length prefix (the
host never waits for its body), the hello must come within HELLO_TIMEOUT_S, and a connection
beyond MAX_PENDING_HELLOS (or MAX_PENDING_HELLOS_PER_PEER from its address) still waiting for
theirs is closed at once. The lane is no wider than Ray's own ports on the same node. A host
answers an accepted hello (HELLO_ACK) and the gateway sends no call before that answer.

When no connection can be made (LaneUnreachable) nothing was sent and the caller uses Ray's path.
When a connection fails, every call waiting on it raises LaneBroken: the caller does not know
whether the turn ran, and retries it through Ray under the same message id (the host answers a
repeated message id with its stored reply; a host that died is Ray's to report). A peer that
vanishes without closing the connection (its node lost power, a partition: no FIN, no RST ever
comes) is noticed by TCP on both ends, within about USER_TIMEOUT_S: keepalive probes while the
connection is quiet, and a limit on how long sent data may go unacknowledged (`_keep_alive`).

A host alive to TCP but hung (its process stopped, its event loop stuck) keeps the connection up,
and its kernel acknowledges every call sent to it. So while calls wait on a lane and nothing has
come back for PROBE_QUIET_S, the client sends a `ping`, which the host's loop answers as it reads
it; a host that has not answered within PING_TIMEOUT_S is unresponsive (`stalled`): the calls
waiting raise LaneStalled (they may have run, or run later), and so does every new call, at once,
until anything comes back from the host. The connection is kept: a host that wakes answers the
ping and its late replies on it (they are dropped), and a host that dies breaks it as any does.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import os
import secrets
import socket
import ssl
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NamedTuple

import msgspec
import structlog

from kernel.errors import ConfigError

log = structlog.get_logger(__name__)

_LENGTH = struct.Struct(">I")
#: largest frame either side accepts (a turn's text is at most 16 KB; a reply carries tool
#: results, bounded far below this); a larger length prefix means a broken peer: the connection closes
MAX_FRAME = 16 * 1024 * 1024
#: how long a gateway waits for a lane's TCP connection (a network that drops the packets, rather
#: than refusing them, would otherwise hold the turn for the OS's connect timeout of minutes)
CONNECT_TIMEOUT_S = 2.0
#: how long a connection may take to present its token (a gateway sends it with the connection)
HELLO_TIMEOUT_S = 2.0
#: the largest first frame (the hello) the host reads: the token is 43 characters
#: (`secrets.token_urlsafe(32)`), 45 bytes as msgpack; a longer length prefix is refused unread
MAX_HELLO = 256
#: connections a host holds that have not presented their token yet; past it a new one is closed
#: at once (gateways present it as they connect, so only a flood of strangers waits here)
MAX_PENDING_HELLOS = 64
#: of those, how many one peer address may hold: a stranger flooding a host from one address
#: cannot take every slot from the gateways
MAX_PENDING_HELLOS_PER_PEER = 8
#: TCP keepalive on both ends of a lane: after KEEPALIVE_IDLE_S without a packet from the peer,
#: a probe every KEEPALIVE_INTERVAL_S, and KEEPALIVE_PROBES unanswered ones drop the connection;
#: data sent and not acknowledged for USER_TIMEOUT_S drops it too (Linux's TCP_USER_TIMEOUT,
#: which also caps the probing). Without them a peer whose node vanished holds the connection,
#: and every call waiting on it, until the OS gives up (~15 min of retransmissions) or for ever.
#: A live peer's kernel answers the probes however long its turns run.
KEEPALIVE_IDLE_S = 5
KEEPALIVE_INTERVAL_S = 2
KEEPALIVE_PROBES = 3
USER_TIMEOUT_S = 15
#: how long `LaneServer.close` waits for the replies of calls still running
CLOSE_GRACE_S = 10.0
#: a lane with calls waiting and nothing heard from its host for this long is pinged; a host that
#: has not answered the ping within PING_TIMEOUT_S is unresponsive (the client checks every
#: WATCH_INTERVAL_S, so a hung host is found within about PROBE_QUIET_S + PING_TIMEOUT_S + 2 s).
#: A live host answers within milliseconds, however long its turns' model and tool calls take.
PROBE_QUIET_S = 2.0
PING_TIMEOUT_S = 5.0
WATCH_INTERVAL_S = 1.0
#: the lane's own method: answered by the host's lane as it reads it, never dispatched (a host
#: of an earlier version answers it with an error, which is as good a sign of life)
PING = "ping"


class LaneAddress(msgspec.Struct, frozen=True, kw_only=True):
    host: str
    port: int
    token: str
    #: what the host's calls take beyond what every version takes (a gateway sends an argument
    #: only to a host that lists it; an older gateway ignores the field): see actors.ray_host
    features: tuple[str, ...] = ()


class _Call(msgspec.Struct, array_like=True):
    id: int
    method: str
    args: list[Any]


class _Reply(msgspec.Struct, array_like=True):
    id: int
    body: bytes = b""
    error: str | None = None  # the call could not be dispatched (unknown method, dispatcher failed)
    #: one event of a streamed call; the stream's last frame has it False (a gateway of an earlier
    #: version decodes the reply's first three items and ignores this fourth: msgspec's array-like
    #: structs skip trailing items they do not declare)
    more: bool = False


class LaneBroken(ConnectionError):
    """The connection failed before the reply came: the call may or may not have run."""


class LaneUnreachable(LaneBroken):
    """No connection could be made: nothing was sent, so nothing ran."""


class LaneError(RuntimeError):
    """The host refused the call (an unknown method): it did not run."""


class LaneStalled(RuntimeError):
    """The host did not answer a ping within PING_TIMEOUT_S: alive to TCP but hung. A call that
    was waiting may have run, or may run when the host wakes; a new call was not sent."""


#: a streamed call's events, and how its stream ends: _END, or the exception it raises
_END = object()

_encode = msgspec.msgpack.Encoder().encode
_call_decoder = msgspec.msgpack.Decoder(_Call)
_reply_decoder = msgspec.msgpack.Decoder(_Reply)
#: the host's answer to an accepted hello (HELLO_ACK): a reply to no call (ids start at 1), which a
#: gateway of an earlier version reads as one whose caller went and drops
_ACK = _encode(_Reply(id=0))
_hello_decoder = msgspec.msgpack.Decoder(str)


def frame(payload: bytes) -> bytes:
    return _LENGTH.pack(len(payload)) + payload


async def read_frame(reader: asyncio.StreamReader, limit: int | None = None) -> bytes:
    """One frame's payload. Raises IncompleteReadError at end of stream, ValueError when the
    length prefix exceeds `limit` (MAX_FRAME by default), before reading the payload."""
    limit = MAX_FRAME if limit is None else limit
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if length > limit:
        raise ValueError(f"lane frame of {length} bytes exceeds {limit}")
    return await reader.readexactly(length)


def _keep_alive(sock: Any) -> None:
    """Turn on TCP keepalive with the lane's timers, and TCP_USER_TIMEOUT, on a connection's
    socket: each option where the platform has it (TCP_USER_TIMEOUT is Linux's; macOS names the
    idle time TCP_KEEPALIVE), so a peer that vanished breaks the lane within about USER_TIMEOUT_S."""
    options = [
        (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
        (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPIDLE", getattr(socket, "TCP_KEEPALIVE", None)),
         KEEPALIVE_IDLE_S),
        (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPINTVL", None), KEEPALIVE_INTERVAL_S),
        (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPCNT", None), KEEPALIVE_PROBES),
        (socket.IPPROTO_TCP, getattr(socket, "TCP_USER_TIMEOUT", None), int(USER_TIMEOUT_S * 1000)),
    ]
    for level, option, value in options:
        if sock is not None and option is not None:
            with contextlib.suppress(OSError):  # a kernel without it: the others still hold
                sock.setsockopt(level, option, value)


_FROM_ENV = object()  # LaneServer/LaneClient `tls`: from Ray's settings (`lane_tls`)
Dispatch = Callable[[str, list[Any]], Awaitable[bytes]]
StreamDispatch = Callable[[str, list[Any]], AsyncIterator[bytes]]
#: the feature a host's address lists when its lane carries streamed turns
STREAM = "stream"
#: the feature a host's address lists when it answers an accepted hello with an empty reply: a
#: gateway sends no call before it, so a host that closes the connection before (its pending
#: hellos full, its token changed) is unreachable, and the turn goes through Ray, rather than a
#: broken lane whose turn may have run
HELLO_ACK = "hello_ack"
#: the feature a host's address lists when its lane speaks TLS (`lane_tls`): a gateway connects
#: with its own TLS context, or finds the lane unreachable (Ray's path) when it has none
TLS = "tls"


class LaneTLS(NamedTuple):
    """The lane's TLS contexts: the host's (its certificate, clients' verified) and the gateway's."""

    server: ssl.SSLContext
    client: ssl.SSLContext


@functools.cache
def lane_tls() -> LaneTLS | None:
    """TLS for lanes from Ray's own TLS settings, as the operator set them for the cluster
    (`RAY_USE_TLS=1`, `RAY_TLS_SERVER_CERT`, `RAY_TLS_SERVER_KEY`, `RAY_TLS_CA_CERT`), or None
    when Ray runs without TLS. Both ends present the node's certificate and verify the other's
    against the CA (mutual TLS, as Ray's gRPC does); host names are not checked: a lane's
    address is a node's IP, and the CA is the cluster's own. Read once per process."""
    if os.environ.get("RAY_USE_TLS", "0").strip().lower() not in ("1", "true"):
        return None
    cert, key, ca = (os.environ.get(v, "").strip() for v in ("RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY",
                                                                "RAY_TLS_CA_CERT"))
    if not (cert and key and ca):
        raise ConfigError("RAY_USE_TLS is on: RAY_TLS_SERVER_CERT, RAY_TLS_SERVER_KEY and RAY_TLS_CA_CERT "
                          "must name the node's certificate, its key and the cluster's CA", variable="RAY_USE_TLS")
    return tls_contexts(cert, key, ca)


def tls_contexts(cert: str, key: str, ca: str) -> LaneTLS:
    """Mutual-TLS contexts for both ends of a lane from PEM files."""
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=ca)
    server.load_cert_chain(cert, key)
    server.verify_mode = ssl.CERT_REQUIRED
    client = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    client.load_cert_chain(cert, key)
    client.check_hostname = False  # a node's IP; the chain is still verified against the CA
    return LaneTLS(server=server, client=client)


class LaneServer:
    """Accepts gateways' connections and runs each call through `dispatch(method, args)`.

    `methods` is what a call may name; anything else is answered with an error and not run. A call
    of one of `streams` runs through `stream(method, args)` instead, each item it yields a frame.
    """

    def __init__(self, dispatch: Dispatch, methods: frozenset[str], *, stream: StreamDispatch | None = None,
                 streams: frozenset[str] = frozenset(), counted: frozenset[str] | None = None,
                 tls: LaneTLS | None | object = _FROM_ENV) -> None:
        self._dispatch = dispatch
        self._stream = stream
        self._streams = streams if stream is not None else frozenset()
        self._methods = methods | self._streams
        self._token = secrets.token_urlsafe(32)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._running: set[asyncio.Task] = set()
        self._awaiting_hello = 0  # connections that have not presented the token yet
        self._awaiting_by_peer: dict[str, int] = {}  # of those, by peer address
        self._turned_away = False  # a connection was closed for MAX_PENDING_HELLOS (logged once per flood)
        self.calls = 0  # calls run of the `counted` methods (every method when None), for the host's stats
        self._counted = counted
        self._tls = lane_tls() if tls is _FROM_ENV else tls

    async def start(self, host: str, features: tuple[str, ...] = ()) -> LaneAddress:
        tls = self._tls
        self._server = await asyncio.start_server(
            self._serve, host=host, port=0, ssl=tls.server if tls is not None else None,
            ssl_handshake_timeout=HELLO_TIMEOUT_S if tls is not None else None)
        port = self._server.sockets[0].getsockname()[1]
        features = (*features, HELLO_ACK, *((TLS,) if tls is not None else ()))
        return LaneAddress(host=host, port=port, token=self._token, features=features)

    async def close(self) -> None:
        """Stop accepting, let running calls write their replies (up to CLOSE_GRACE_S), then
        close every connection (the gateways' waiting calls, if any, raise LaneBroken)."""
        if self._server is None:
            return
        self._server.close()
        if self._running:
            await asyncio.wait(set(self._running), timeout=CLOSE_GRACE_S)
        for writer in list(self._writers):
            writer.close()
        self._writers.clear()
        self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peername = writer.get_extra_info("peername")
        peer = str(peername[0]) if isinstance(peername, tuple) and peername else str(peername)
        full = (f"{MAX_PENDING_HELLOS} connections are waiting for their hello"
                if self._awaiting_hello >= MAX_PENDING_HELLOS else
                f"{MAX_PENDING_HELLOS_PER_PEER} connections from this address are waiting for their hello"
                if self._awaiting_by_peer.get(peer, 0) >= MAX_PENDING_HELLOS_PER_PEER else None)
        if full is not None:
            if not self._turned_away:
                log.warning("lane_refused", peer=peer, reason=full)
            self._turned_away = True
            writer.close()  # nothing read
            return
        self._writers.add(writer)
        _keep_alive(writer.get_extra_info("socket"))
        try:
            self._awaiting_hello += 1
            self._awaiting_by_peer[peer] = self._awaiting_by_peer.get(peer, 0) + 1
            try:
                admitted = await self._admit(reader, writer)
            finally:
                self._awaiting_hello -= 1
                left = self._awaiting_by_peer.pop(peer) - 1
                if left:
                    self._awaiting_by_peer[peer] = left
                if self._awaiting_hello == 0:
                    self._turned_away = False
            if not admitted:
                return  # not a gateway: nothing was read beyond the hello (at most MAX_HELLO bytes)
            writer.write(frame(_ACK))  # HELLO_ACK: the gateway may send its calls
            while True:
                call = _call_decoder.decode(await read_frame(reader))
                if call.method == PING:  # the loop that reads it is alive: that is the answer
                    if not writer.is_closing():
                        writer.write(frame(_encode(_Reply(id=call.id))))
                    continue
                task = asyncio.create_task(self._run(call, writer))
                self._running.add(task)
                task.add_done_callback(self._running.discard)
        except (asyncio.IncompleteReadError, OSError):
            # the gateway went away, or vanished (keepalive: TimeoutError); calls still running
            # finish, their replies are dropped
            pass
        except (ValueError, msgspec.DecodeError) as exc:
            log.warning("lane_protocol_error", error=str(exc)[:200])
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _admit(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        try:
            hello = _hello_decoder.decode(await asyncio.wait_for(read_frame(reader, MAX_HELLO), HELLO_TIMEOUT_S))
        except (asyncio.IncompleteReadError, TimeoutError, ValueError, msgspec.DecodeError, OSError):
            return False
        if hmac.compare_digest(hello.encode(), self._token.encode()):
            return True
        log.warning("lane_refused", peer=str(writer.get_extra_info("peername")), reason="bad token")
        return False

    async def _run(self, call: _Call, writer: asyncio.StreamWriter) -> None:
        if call.method not in self._methods:
            reply = _Reply(id=call.id, error=f"the lane does not carry {call.method!r}")
        elif call.method in self._streams:
            reply = await self._run_stream(call, writer)
        else:
            if self._counted is None or call.method in self._counted:
                self.calls += 1
            try:
                reply = _Reply(id=call.id, body=await self._dispatch(call.method, call.args))
            except Exception as exc:
                log.error("lane_dispatch_failed", method=call.method, exc_info=exc)
                reply = _Reply(id=call.id, error="the session host failed to run this call")
        payload = _encode(reply)
        if len(payload) > MAX_FRAME:  # the gateway would drop the connection, and every call on it
            log.error("lane_reply_too_large", method=call.method, size=len(payload))
            payload = _encode(_Reply(id=call.id, error=f"the reply of {len(payload)} bytes exceeds the lane's frame limit"))
        if not writer.is_closing():
            writer.write(frame(payload))

    async def _run_stream(self, call: _Call, writer: asyncio.StreamWriter) -> _Reply:
        """Write each event of a streamed call as it comes; the reply that ends the stream is returned.
        A gateway that went away does not stop the call: the turn runs on and is stored."""
        assert self._stream is not None
        if self._counted is None or call.method in self._counted:
            self.calls += 1
        too_large = None  # an event past the frame limit ends the stream in an error; the turn runs on
        try:
            async for body in self._stream(call.method, call.args):
                payload = _encode(_Reply(id=call.id, body=body, more=True))
                if too_large is None and len(payload) > MAX_FRAME:
                    log.error("lane_reply_too_large", method=call.method, size=len(payload))
                    too_large = f"an event of {len(payload)} bytes exceeds the lane's frame limit"
                if too_large is None and not writer.is_closing():
                    writer.write(frame(payload))
        except Exception as exc:
            log.error("lane_dispatch_failed", method=call.method, exc_info=exc)
            return _Reply(id=call.id, error="the session host failed to run this call")
        return _Reply(id=call.id, error=too_large)


class LaneClient:
    """One connection to one host's lane, opened on first use; calls are multiplexed on it.

    After the connection fails the client is spent (`broken` is True): its owner drops it and
    asks the host for its address again (a restarted host listens on another port). While the
    host is unresponsive (`stalled`, see the module's notes) calls raise LaneStalled."""

    def __init__(self, address: LaneAddress, *, tls: LaneTLS | None | object = _FROM_ENV) -> None:
        self.address = address
        self._tls = lane_tls() if tls is _FROM_ENV else tls
        self.broken = False
        self.stalled = False
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._watch_task: asyncio.Task | None = None
        self._connecting: asyncio.Lock = asyncio.Lock()
        self._pending: dict[int, asyncio.Future[bytes]] = {}
        self._streams: dict[int, asyncio.Queue[Any]] = {}  # a streamed call's events, then how it ended
        self._next_id = 0
        self._heard = 0.0  # loop time of the last frame from the host (or of the connection)
        self._ping: tuple[int, float] | None = None  # the ping waiting for its answer: id, sent at
        self._unreachable: str | None = None  # why the connection could not be made (nothing was ever sent)

    def _check(self) -> None:
        """Raise, having sent nothing, when no call can go out on this lane now."""
        if self._unreachable is not None:
            raise LaneUnreachable(self._unreachable)
        if self.broken:
            raise LaneBroken("the lane to this host failed; ask the host for its address again")
        if self.stalled:
            raise LaneStalled(f"the session host has not answered for {PING_TIMEOUT_S:.0f} s; nothing was sent to it")

    async def _open_call(self) -> tuple[asyncio.StreamWriter, int]:
        """The connection and a new call's id; raises, having sent nothing, when no call can go out."""
        self._check()
        writer = self._writer
        if writer is None:
            writer = await self._connect()
            self._check()  # it failed, or its host stopped answering, while this call waited for the connection
        self._next_id += 1
        return writer, self._next_id

    async def call(self, method: str, *args: Any) -> bytes:
        writer, call_id = await self._open_call()
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        try:
            writer.write(frame(_encode(_Call(id=call_id, method=method, args=list(args)))))
            return await future
        finally:
            self._pending.pop(call_id, None)

    async def stream(self, method: str, *args: Any) -> AsyncIterator[bytes]:
        """A streamed call's events, as the host yields them. Raises as `call` does: LaneBroken,
        LaneUnreachable (before anything was sent), LaneStalled, LaneError (the host refused the
        call, or failed while running it)."""
        writer, call_id = await self._open_call()
        events: asyncio.Queue[Any] = asyncio.Queue()
        self._streams[call_id] = events
        try:
            writer.write(frame(_encode(_Call(id=call_id, method=method, args=list(args)))))
            while (item := await events.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self._streams.pop(call_id, None)  # a consumer that stops early: later frames are dropped

    async def _connect(self) -> asyncio.StreamWriter:
        async with self._connecting:
            self._check()  # a caller that waited for another's failed connect is told it is unreachable
            if self._writer is None:
                if TLS in self.address.features and self._tls is None:
                    self.broken = True
                    self._unreachable = ("the host's lane speaks TLS and this gateway has no TLS settings "
                                         "(RAY_USE_TLS and its files)")
                    raise LaneUnreachable(self._unreachable)
                tls = self._tls.client if TLS in self.address.features and self._tls is not None else None
                try:
                    reader, writer = await asyncio.wait_for(
                        asyncio.open_connection(self.address.host, self.address.port, ssl=tls), CONNECT_TIMEOUT_S)
                except (OSError, TimeoutError) as exc:
                    self.broken = True
                    self._unreachable = f"cannot connect to the host's lane: {str(exc) or type(exc).__name__}"
                    raise LaneUnreachable(self._unreachable) from exc
                _keep_alive(writer.get_extra_info("socket"))
                writer.write(frame(_encode(self.address.token)))
                if HELLO_ACK in self.address.features:
                    await self._acknowledged(reader, writer)
                self._writer = writer
                self._heard = asyncio.get_running_loop().time()
                self._reader_task = asyncio.create_task(self._read(reader))
                self._watch_task = asyncio.create_task(self._watch())
            return self._writer

    async def _acknowledged(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Wait for the host's answer to the hello (HELLO_ACK); nothing was sent before it, so a
        host that closes or says nothing first is unreachable, not a broken lane."""
        try:
            ack = await asyncio.wait_for(read_frame(reader, MAX_HELLO), HELLO_TIMEOUT_S + CONNECT_TIMEOUT_S)
            if ack != _ACK:
                raise ValueError("the host answered the hello with something else")
        except (asyncio.IncompleteReadError, OSError, TimeoutError, ValueError) as exc:
            writer.close()
            self.broken = True
            self._unreachable = ("the host's lane did not take this gateway's hello: "
                                 f"{str(exc) or type(exc).__name__}")
            raise LaneUnreachable(self._unreachable) from exc

    async def _watch(self) -> None:
        """Ping a host that has said nothing for PROBE_QUIET_S while calls wait on it; find it
        unresponsive when the ping goes unanswered for PING_TIMEOUT_S."""
        loop = asyncio.get_running_loop()
        while not self.broken:
            await asyncio.sleep(WATCH_INTERVAL_S)
            now = loop.time()
            if self._ping is not None:
                if not self.stalled and now - self._ping[1] >= PING_TIMEOUT_S:
                    self._stall()
            elif (self._pending or self._streams) and now - self._heard >= PROBE_QUIET_S and self._writer is not None:
                self._next_id += 1
                self._ping = (self._next_id, now)
                self._writer.write(frame(_encode(_Call(id=self._next_id, method=PING, args=[]))))

    def _stall(self) -> None:
        self.stalled = True
        log.warning("session_host_unresponsive", lane=f"{self.address.host}:{self.address.port}",
                    waiting_calls=len(self._pending) + len(self._streams), ping_timeout_s=PING_TIMEOUT_S)
        said = f"the session host has not answered for {PING_TIMEOUT_S:.0f} s; the call may have run, or may run once the host wakes"
        for future in self._pending.values():
            if not future.done():
                future.set_exception(LaneStalled(said))
        for events in self._streams.values():
            events.put_nowait(LaneStalled(said))
        self._streams.clear()  # what the host sends of them once it wakes is dropped

    async def _read(self, reader: asyncio.StreamReader) -> None:
        error: BaseException = LaneBroken("the host closed the lane")
        loop = asyncio.get_running_loop()
        try:
            while True:
                reply = _reply_decoder.decode(await read_frame(reader))
                self._heard = loop.time()
                if self.stalled:
                    self.stalled = False
                    log.warning("session_host_responsive", lane=f"{self.address.host}:{self.address.port}")
                ping, self._ping = self._ping, None  # any frame answers the ping: the host's loop runs
                if ping is not None and reply.id == ping[0]:
                    continue
                events = self._streams.get(reply.id)
                if events is not None:
                    if reply.error is not None:
                        events.put_nowait(LaneError(reply.error))
                    else:
                        events.put_nowait(reply.body if reply.more else _END)
                    if reply.error is not None or not reply.more:
                        del self._streams[reply.id]
                    continue
                future = self._pending.get(reply.id)
                if future is None or future.done():
                    continue  # its caller was cancelled
                if reply.error is not None:
                    future.set_exception(LaneError(reply.error))
                else:
                    future.set_result(reply.body)
        except asyncio.IncompleteReadError:
            pass
        except OSError as exc:  # reset, or timed out: the host's node vanished (keepalive)
            error = LaneBroken(f"the lane to the host failed: {str(exc) or type(exc).__name__}")
        except (ValueError, msgspec.DecodeError) as exc:
            error = LaneBroken(f"the host's lane sent a malformed reply: {exc}")
        finally:
            self._fail(error)

    def _fail(self, error: BaseException) -> None:
        self.broken = True
        if self._watch_task is not None:
            self._watch_task.cancel()
        for future in self._pending.values():
            if not future.done():
                future.set_exception(LaneBroken(str(error)))
        for events in self._streams.values():
            events.put_nowait(LaneBroken(str(error)))
        self._streams.clear()
        if self._writer is not None:
            self._writer.close()

    def close(self) -> None:
        """Close the connection; calls still waiting raise LaneBroken."""
        if self._reader_task is not None:
            self._reader_task.cancel()
        self._fail(LaneBroken("the lane was closed"))
