"""Opening and serving the gateway: its own pool and repositories, a router, an aiohttp runner."""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from services.gateway.app import GatewayDeps, build_app
from services.gateway.limits import TenantLimiter
from services.settings import Settings
from services.tools.crypto import SecretBox
from services.tools.ssrf import policy_from_entries
from storage.pool import create_pool
from storage.repos import BotConfigRepo, SessionRepo, TenantRepo, ToolCallRepo, ToolRepo
from storage.repos.jobs import JobRepo


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


class Gateway:
    """A running gateway: `url`, `deps`, `close()`."""

    def __init__(self, runner: web.AppRunner, pool: Any, deps: GatewayDeps, url: str) -> None:
        self._runner = runner
        self._pool = pool
        self.deps = deps
        self.url = url

    async def close(self) -> None:
        await self._runner.cleanup()
        await self._pool.close()


async def open_gateway(settings: Settings, router: Any, *, contract=None, ready_check=None,
                       host: str | None = None, port: int | None = None) -> Gateway:
    """Serve the gateway for `router` on CE_HOST:CE_PORT (or the given host/port; port 0 picks one)."""
    pool = await create_pool(settings.database_url, min_size=1, max_size=10)
    deps = GatewayDeps(
        router=router, tenants=TenantRepo(pool), tools=ToolRepo(pool), calls=ToolCallRepo(pool),
        sessions=SessionRepo(pool), configs=BotConfigRepo(pool),
        secret_box=SecretBox(settings.secret_keys) if settings.secret_keys else None,
        contract=contract, jobs=JobRepo(pool),
        limiter=TenantLimiter(rate=settings.tenant_rate, burst=settings.tenant_burst,
                              concurrency=settings.tenant_concurrency),
        webhook_policy=policy_from_entries(settings.webhook_allow),
    )

    async def ready() -> bool:
        try:
            async with pool.acquire() as conn:
                await conn.fetchval("SELECT 1")
        except Exception:  # noqa: BLE001 - readiness is a yes/no answer
            return False
        return True if ready_check is None else await ready_check()

    deps.ready = ready
    runner = web.AppRunner(build_app(deps), access_log=None, shutdown_timeout=5.0, logger=http_server_logger())
    await runner.setup()
    site = web.TCPSite(runner, host or settings.host, settings.port if port is None else port)
    await site.start()
    bound_host, bound_port = runner.addresses[0][:2]
    return Gateway(runner, pool, deps, f"http://{bound_host}:{bound_port}")
