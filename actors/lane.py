"""The turn lane: a gateway's turns to a shard host over one TCP connection, beside Ray's task path.

Ray places, names, restarts and kills the session hosts, and carries every control call (ready,
stats, rescale, shutdown). A turn is the one call made per message, and Ray's actor task path
costs it ~0.8 ms of CPU (caller and actor) and ~1.5 ms of latency on an idle 2-core machine
(measured: README § Performance). So a shard host also listens on its node's address, on a port
the OS picks, and the gateway sends `send`/`decide` there: length-prefixed msgpack frames,
many calls multiplexed on one connection, replies matched by call id (they come back out of
order). The host's reply body is the same encoded HostResult the Ray path returns.

Only a gateway that got the host's address from the host itself (a Ray call) may use it: the
address carries a random token, the connection's first frame must present it, and a connection
that does not is closed before anything is read from it. The lane is no wider than Ray's own
ports on the same node.

When no connection can be made (LaneUnreachable) nothing was sent and the caller uses Ray's path.
When a connection fails, every call waiting on it raises LaneBroken: the caller does not know
whether the turn ran, and retries it through Ray under the same message id (the host answers a
repeated message id with its stored reply; a host that died is Ray's to report).
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import structlog

log = structlog.get_logger(__name__)

_LENGTH = struct.Struct(">I")
#: largest frame either side accepts (a turn's text is at most 16 KB; a reply carries tool
#: results, bounded far below this); a larger length prefix means a broken peer: the connection closes
MAX_FRAME = 16 * 1024 * 1024
#: how long a gateway waits for a lane's TCP connection (a network that drops the packets, rather
#: than refusing them, would otherwise hold the turn for the OS's connect timeout of minutes)
CONNECT_TIMEOUT_S = 2.0
#: how long a connection may take to present its token
HELLO_TIMEOUT_S = 5.0
#: how long `LaneServer.close` waits for the replies of calls still running
CLOSE_GRACE_S = 10.0


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


class LaneBroken(ConnectionError):
    """The connection failed before the reply came: the call may or may not have run."""


class LaneUnreachable(LaneBroken):
    """No connection could be made: nothing was sent, so nothing ran."""


class LaneError(RuntimeError):
    """The host refused the call (an unknown method): it did not run."""


_encode = msgspec.msgpack.Encoder().encode
_call_decoder = msgspec.msgpack.Decoder(_Call)
_reply_decoder = msgspec.msgpack.Decoder(_Reply)
_hello_decoder = msgspec.msgpack.Decoder(str)


def frame(payload: bytes) -> bytes:
    return _LENGTH.pack(len(payload)) + payload


async def read_frame(reader: asyncio.StreamReader) -> bytes:
    """One frame's payload. Raises IncompleteReadError at end of stream, ValueError when the
    length prefix exceeds MAX_FRAME."""
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if length > MAX_FRAME:
        raise ValueError(f"lane frame of {length} bytes exceeds {MAX_FRAME}")
    return await reader.readexactly(length)


Dispatch = Callable[[str, list[Any]], Awaitable[bytes]]


class LaneServer:
    """Accepts gateways' connections and runs each call through `dispatch(method, args)`.

    `methods` is what a call may name; anything else is answered with an error and not run.
    """

    def __init__(self, dispatch: Dispatch, methods: frozenset[str]) -> None:
        self._dispatch = dispatch
        self._methods = methods
        self._token = secrets.token_urlsafe(32)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._running: set[asyncio.Task] = set()
        self.calls = 0  # calls run (for the host's stats)

    async def start(self, host: str, features: tuple[str, ...] = ()) -> LaneAddress:
        self._server = await asyncio.start_server(self._serve, host=host, port=0)
        port = self._server.sockets[0].getsockname()[1]
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
        self._writers.add(writer)
        try:
            if not await self._admit(reader, writer):
                return  # not a gateway: nothing was read beyond the hello
            while True:
                call = _call_decoder.decode(await read_frame(reader))
                task = asyncio.create_task(self._run(call, writer))
                self._running.add(task)
                task.add_done_callback(self._running.discard)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the gateway went away; calls still running finish, their replies are dropped
        except (ValueError, msgspec.DecodeError) as exc:
            log.warning("lane_protocol_error", error=str(exc)[:200])
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _admit(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        try:
            hello = _hello_decoder.decode(await asyncio.wait_for(read_frame(reader), HELLO_TIMEOUT_S))
        except (asyncio.IncompleteReadError, TimeoutError, ValueError, msgspec.DecodeError, ConnectionError):
            return False
        if hmac.compare_digest(hello.encode(), self._token.encode()):
            return True
        log.warning("lane_refused", peer=str(writer.get_extra_info("peername")), reason="bad token")
        return False

    async def _run(self, call: _Call, writer: asyncio.StreamWriter) -> None:
        if call.method not in self._methods:
            reply = _Reply(id=call.id, error=f"the lane does not carry {call.method!r}")
        else:
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


class LaneClient:
    """One connection to one host's lane, opened on first use; calls are multiplexed on it.

    After the connection fails the client is spent (`broken` is True): its owner drops it and
    asks the host for its address again (a restarted host listens on another port)."""

    def __init__(self, address: LaneAddress) -> None:
        self.address = address
        self.broken = False
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._connecting: asyncio.Lock = asyncio.Lock()
        self._pending: dict[int, asyncio.Future[bytes]] = {}
        self._next_id = 0

    async def call(self, method: str, *args: Any) -> bytes:
        if self.broken:
            raise LaneBroken("the lane to this host failed; ask the host for its address again")
        writer = self._writer or await self._connect()
        if self.broken:  # failed while this call waited for the connection
            raise LaneBroken("the lane to this host failed; ask the host for its address again")
        self._next_id += 1
        call_id = self._next_id
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        try:
            writer.write(frame(_encode(_Call(id=call_id, method=method, args=list(args)))))
            return await future
        finally:
            self._pending.pop(call_id, None)

    async def _connect(self) -> asyncio.StreamWriter:
        async with self._connecting:
            if self.broken:
                raise LaneBroken("the lane to this host failed; ask the host for its address again")
            if self._writer is None:
                try:
                    reader, writer = await asyncio.wait_for(
                        asyncio.open_connection(self.address.host, self.address.port), CONNECT_TIMEOUT_S)
                except (OSError, TimeoutError) as exc:
                    self.broken = True
                    raise LaneUnreachable(f"cannot connect to the host's lane: {str(exc) or type(exc).__name__}") from exc
                writer.write(frame(_encode(self.address.token)))
                self._writer = writer
                self._reader_task = asyncio.create_task(self._read(reader))
            return self._writer

    async def _read(self, reader: asyncio.StreamReader) -> None:
        error: BaseException = LaneBroken("the host closed the lane")
        try:
            while True:
                reply = _reply_decoder.decode(await read_frame(reader))
                future = self._pending.get(reply.id)
                if future is None or future.done():
                    continue  # its caller was cancelled
                if reply.error is not None:
                    future.set_exception(LaneError(reply.error))
                else:
                    future.set_result(reply.body)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        except (ValueError, msgspec.DecodeError) as exc:
            error = LaneBroken(f"the host's lane sent a malformed reply: {exc}")
        finally:
            self._fail(error)

    def _fail(self, error: BaseException) -> None:
        self.broken = True
        for future in self._pending.values():
            if not future.done():
                future.set_exception(LaneBroken(str(error)))
        if self._writer is not None:
            self._writer.close()

    def close(self) -> None:
        """Close the connection; calls still waiting raise LaneBroken."""
        if self._reader_task is not None:
            self._reader_task.cancel()
        self._fail(LaneBroken("the lane was closed"))
