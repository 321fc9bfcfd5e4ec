"""Opening and serving the gateway: its own pool and repositories, a router, an aiohttp runner."""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import resource
import socket
from pathlib import Path
from typing import Any

import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from kernel.errors import ConfigError
from services.gateway.app import build_app
from services.gateway.common import GatewayDeps, problem
from services.gateway.feed import AgentFeed
from services.gateway.limits import TenantLimiter, TenantRate
from services.settings import Settings
from services.tools.crypto import SecretBox
from services.tools.ssrf import policy_from_entries
from storage.pool import create_pool
from storage.repos import BotConfigRepo, SessionRepo, TenantRepo, ToolCallRepo, ToolRepo
from storage.repos.builtins import HandoffRepo
from storage.repos.egress import EgressRepo
from storage.repos.jobs import JobRepo

log = structlog.get_logger(__name__)


#: how long a stopping gateway lets requests in flight finish (a turn with its tool calls and
#: model rounds, an SSE stream) before it cancels them. Sized to the pod: its grace period (45 s,
#: deploy/kubernetes/gateway.yaml) less its preStop (5 s), less aiohttp's own wait for the last
#: answers to be written (twice SHUTDOWN_WRITE_S, rounded up) and the pool's close and the leave
#: from Ray. The listening socket closes first, so no new connection is taken meanwhile; with
#: nothing in flight the gateway stops at once.
DRAIN_TIMEOUT_S = 30.0
#: aiohttp's shutdown_timeout, once the drain is over: answers already computed are written, and
#: what still runs is cancelled. aiohttp waits it twice (for the handler, then again after
#: cancelling the request's body), hence the drain is counted here and not with it.
SHUTDOWN_WRITE_S = 2.0
#: file descriptors a gateway keeps for what it opens besides its clients' connections (its
#: Postgres pool, Ray, lanes to hosts, logs): the connection limit from the file limit leaves them
FD_RESERVE = 256
#: the listen backlog where the kernel's cap cannot be read
DEFAULT_BACKLOG = 4096
SOMAXCONN = Path("/proc/sys/net/core/somaxconn")
#: how soon a client refused past the connection limit is told to retry
FULL_RETRY_AFTER_S = 1


#: tasks accepting connections, each one per wake-up of the loop: a burst of a thousand clients is
#: taken this many at a time, and the requests of clients already connected are read in between
#: (asyncio's server accepts up to its backlog per wake-up, uvloop's every pending connection)
ACCEPTORS = 8
#: accept errors that pass (descriptors or memory run out), and how soon to try again (asyncio's delay)
_ACCEPT_LATER = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
ACCEPT_RETRY_S = 1.0


def listen_backlog(path: Path = SOMAXCONN) -> int:
    """The backlog the gateway listens with: the kernel's cap (`net.core.somaxconn`; asking for
    more is cut to it). aiohttp's default of 128 let a burst of 600 clients overflow the queue
    while the loop was busy with turns, and they were reset instead of answered."""
    try:
        return max(128, int(path.read_text().strip()))
    except (OSError, ValueError):
        return DEFAULT_BACKLOG


class _PacedSite(web.BaseSite):
    """The gateway's listening sockets (every address `host` resolves to, as asyncio binds them),
    each with a kernel queue `listen_backlog()` deep, accepted by ACCEPTORS tasks at one
    connection each per wake-up of the loop, handed to aiohttp's server as asyncio would."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int) -> None:
        super().__init__(runner, backlog=listen_backlog())
        self._host = host
        self._port = port
        self.sockets: list[socket.socket] = []
        self._acceptors: list[asyncio.Task] = []

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(self._host, self._port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        try:
            for family, kind, proto, _, address in dict.fromkeys(infos):
                sock = socket.socket(family, kind, proto)
                self.sockets.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # its own family only
                sock.bind(address)
                sock.listen(self._backlog)
                sock.setblocking(False)
        except BaseException:
            self._close_sockets()
            raise
        factory = self._runner.server
        assert factory is not None
        self._acceptors = [asyncio.create_task(self._accept(loop, sock, factory))
                           for sock in self.sockets for _ in range(ACCEPTORS)]

    async def _accept(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, factory: Any) -> None:
        while True:
            try:
                conn, _ = await loop.sock_accept(sock)
            except (ConnectionAbortedError, InterruptedError):
                continue  # the client gave up while queued
            except OSError as exc:
                if exc.errno not in _ACCEPT_LATER:
                    raise
                # out of descriptors or memory: the clients wait in the kernel's queue meanwhile
                log.warning("gateway_accept_failed", error=str(exc), retry_in_s=ACCEPT_RETRY_S)
                await asyncio.sleep(ACCEPT_RETRY_S)
                continue
            conn.setblocking(False)
            try:
                await loop.connect_accepted_socket(factory, conn)
            except OSError:
                conn.close()  # the client left before its connection was set up
            await asyncio.sleep(0)  # one per wake-up: what else is ready runs in between

    async def stop(self) -> None:
        for task in self._acceptors:
            task.cancel()
        await asyncio.gather(*self._acceptors, return_exceptions=True)
        self._acceptors = []
        self._close_sockets()
        await super().stop()

    def _close_sockets(self) -> None:
        for sock in self.sockets:
            sock.close()
        self.sockets = []


def connection_limit(configured: int) -> int:
    """The connections a gateway holds at once (CE_GATEWAY_MAX_CONNECTIONS), 0: its file limit
    less FD_RESERVE: past it a new client gets 503 with Retry-After rather than an accept that
    fails for want of a descriptor."""
    if configured > 0:
        return configured
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1_000_000
    return max(64, soft - FD_RESERVE)


class _ConnectionCap:
    """Past `limit` open connections, a request on one of the newer connections is answered at
    once: 503, Retry-After, and the connection closed (never a reset, never a turn); the oldest
    `limit` are served as usual. Counted in ce_refused_total{reason="gateway_connections"}."""

    def __init__(self, limit: int, refused: Any) -> None:
        self.limit = limit
        self.server: web.Server | None = None
        self._refused = refused

    def _over(self, request: web.Request) -> bool:
        # aiohttp's own table of open connections, oldest first (`Server.connections` copies it
        # into a list on every read: too dear per request with thousands of watchers open)
        open_now = getattr(self.server, "_connections", None)
        if open_now is None:
            open_now = self.server.connections if self.server is not None else ()
        if len(open_now) <= self.limit:
            return False
        return request.protocol not in set(itertools.islice(open_now, self.limit))

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self._over(request):
            self._refused.labels("gateway_connections").inc()
            response = problem(503, "Service Unavailable",
                               f"this gateway holds its limit of {self.limit:,} connections; retry shortly "
                               "(another gateway may have room)", headers={"Retry-After": str(FULL_RETRY_AFTER_S)})
            response.force_close()
            return response
        return await handler(request)


class _InFlight:
    """The requests a gateway is handling: what a stopping gateway waits for."""

    def __init__(self) -> None:
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self.count += 1
        self._idle.clear()
        try:
            return await handler(request)
        finally:
            self.count -= 1
            if self.count == 0:
                self._idle.set()

    async def drained(self, timeout: float, hurry: asyncio.Event | None = None) -> bool:
        """Wait until no request is in flight, `timeout` at most and no longer than until `hurry`
        is set; True when none is left."""
        idle = asyncio.ensure_future(self._idle.wait())
        waits = {idle} if hurry is None else {idle, asyncio.ensure_future(hurry.wait())}
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        return self._idle.is_set()


class _UnparsableRequestFilter(logging.Filter):
    """aiohttp logs a request it cannot parse with the parser's message, which quotes the start of
    the offending line: for an over-long `Authorization` line, that is the API key. Keep the fact
    and the error's name, drop the quote and the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            record.msg = f"{record.msg} (%s, status %s; the request line or a header was malformed or too long)"
            record.args = (*(record.args or ()), type(exc).__name__, exc.code)
            record.exc_info = None
            record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def http_server_logger() -> logging.Logger:
    """The stdlib logger for the gateway's aiohttp server (`AppRunner(logger=...)`): errors of
    requests that never reached a handler, without the request text they quote."""
    logger = logging.getLogger("services.gateway.http")
    if not any(isinstance(f, _UnparsableRequestFilter) for f in logger.filters):
        logger.addFilter(_UnparsableRequestFilter())
    return logger


def _cannot_listen(host: str, port: int, exc: OSError) -> ConfigError:
    reason = "the address is already in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
    return ConfigError(
        f"cannot listen on {host}:{port}: {reason}; set CE_HOST/CE_PORT to a free address "
        "(or stop what holds it)",
        variable="CE_PORT",
    )


def check_listen_address(host: str, port: int) -> None:
    """Raise ConfigError (naming CE_HOST/CE_PORT) when the gateway could not listen on host:port,
    before a slow start-up spends time on Postgres, Ray and the hosts. Port 0 (any) always can.
    open_gateway checks again at the real bind: the address may be taken in between."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise _cannot_listen(host, port, exc) from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp binds
            try:
                probe.bind(address)
            except OSError as exc:
                raise _cannot_listen(host, port, exc) from None


class Gateway:
    """A running gateway: `url`, `deps`, `close()`."""

    def __init__(self, runner: web.AppRunner, pool: Any, deps: GatewayDeps, url: str,
                 in_flight: _InFlight | None = None, drain_timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        self._runner = runner
        self._in_flight = in_flight
        self._drain_timeout_s = drain_timeout_s
        self._pool = pool
        self.deps = deps
        self.url = url

    @property
    def connections(self) -> int:
        """The client connections open now."""
        server = self._runner.server
        return len(server.connections) if server is not None else 0

    def listening_sockets(self) -> list[socket.socket]:
        """The sockets the gateway listens on."""
        return [sock for site in self._runner.sites for sock in getattr(site, "sockets", ())]

    async def close(self, *, hurry: asyncio.Event | None = None) -> None:
        """Stop listening, let the requests in flight finish (DRAIN_TIMEOUT_S at most, or until
        `hurry` is set: a second Ctrl-C), close."""
        # watchers' streams end now (they reconnect to another gateway, naming their last event)
        # rather than hold the drain: they are never done
        self.deps.closing.set()
        for stream in list(self.deps.streams):
            stream.cancel()
        if self._in_flight is not None:
            for site in list(self._runner.sites):
                await site.stop()  # new connections are refused from here on
            if self._runner.server is not None:
                self._runner.server.pre_shutdown()  # idle keep-alive connections close; busy ones after their answer
            await asyncio.sleep(0)  # a request whose bytes were read has its handler started (and counted)
            if not await self._in_flight.drained(self._drain_timeout_s, hurry):
                log.warning("gateway_drain_cut_short" if hurry is not None and hurry.is_set() else
                            "gateway_drain_timed_out", in_flight=self._in_flight.count,
                            drain_timeout_s=self._drain_timeout_s)
        await self._runner.cleanup()
        for task in list(self.deps.background):
            task.cancel()
        if self.deps.feed is not None:
            await self.deps.feed.close()
        await self._pool.close()


async def open_gateway(settings: Settings, router: Any, *, contract=None, ready_check=None,
                       host: str | None = None, port: int | None = None,
                       drain_timeout_s: float = DRAIN_TIMEOUT_S) -> Gateway:
    """Serve the gateway for `router` on CE_HOST:CE_PORT (or the given host/port; port 0 picks one).

    Raises ConfigError naming CE_HOST/CE_PORT when it cannot listen there (closing what it opened).
    """
    pool = await create_pool(settings.database_url, min_size=1, max_size=10)
    deps = GatewayDeps(
        router=router, tenants=TenantRepo(pool), tools=ToolRepo(pool), calls=ToolCallRepo(pool),
        sessions=SessionRepo(pool), configs=BotConfigRepo(pool),
        secret_box=SecretBox(settings.secret_keys) if settings.secret_keys else None,
        secret_keys=settings.secret_keys,
        contract=contract, jobs=JobRepo(pool), handoffs=HandoffRepo(pool),
        feed=AgentFeed(pool, SessionRepo(pool)),
        limiter=TenantLimiter(rate=settings.tenant_rate, burst=settings.tenant_burst,
                              concurrency=settings.tenant_concurrency),
        webhook_policy=policy_from_entries(settings.webhook_allow),
        metrics_token=settings.metrics_token, egress=EgressRepo(pool),
        admin_writes=TenantRate(rate=settings.admin_write_rate, burst=settings.admin_write_burst,
                                reason="admin_rate", what="rate of configuration writes"),
    )

    async def ready() -> bool:
        try:
            async with pool.acquire() as conn:
                await conn.fetchval("SELECT 1")
        except Exception:  # noqa: BLE001 - readiness is a yes/no answer
            return False
        return True if ready_check is None else await ready_check()

    deps.ready = ready
    app = build_app(deps)
    in_flight = _InFlight()
    # outermost: a request still in its auth lookup (or rate limit) is in flight too
    app.middlewares.insert(0, in_flight.middleware)
    # before it: a request past the connection limit is answered without being in flight
    cap = _ConnectionCap(connection_limit(settings.gateway_max_connections), deps.metrics.refused)
    app.middlewares.insert(0, cap.middleware)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_WRITE_S, logger=http_server_logger())
    host = host or settings.host
    port = settings.port if port is None else port
    try:
        await runner.setup()
        cap.server = runner.server
        site = _PacedSite(runner, host, port)
        try:
            await site.start()
        except OSError as exc:
            raise _cannot_listen(host, port, exc) from None
    except BaseException:
        await runner.cleanup()
        await pool.close()
        raise
    bound_host, bound_port = site.sockets[0].getsockname()[:2]
    return Gateway(runner, pool, deps, f"http://{bound_host}:{bound_port}", in_flight, drain_timeout_s)
