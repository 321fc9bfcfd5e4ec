"""Shared pieces of the built-in tool integration tests: a tenant-config fake, a trusted-context
factory, the services wired to the real Postgres, a notification receiver on loopback, and one
call run as the engine runs it (`through_executor`: checked, executed, recorded)."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from services.botconfig import BotConfig
from services.builtins import DEFINITIONS as BUILTIN_DEFINITIONS
from services.builtins import BuiltinServices
from services.builtins.notify import Notifier
from services.tools.context import TrustedContext
from services.tools.executor import Executor, ToolCall, ToolOutcome
from services.tools.registry import HandlerRegistry, build_catalog
from services.tools.ssrf import policy_from_entries
from services.tools.toolset import SessionToolState
from services.tools.webhook import WebhookClient
from storage.repos.builtins import BuiltinRepos
from storage.repos.notifications import NotificationRepo

SECRET = "whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"  # base64 of 24 bytes, Standard Webhooks' example shape


class FakeConfigs:
    """TenantConfigs fake: one BotConfig per tenant (default: none configured)."""

    def __init__(self) -> None:
        self.configs: dict[str, BotConfig] = {}

    def set(self, tenant_id: str, **fields: Any) -> BotConfig:
        self.configs[tenant_id] = BotConfig(**fields)
        return self.configs[tenant_id]

    async def config_for(self, tenant_id: str) -> BotConfig:
        return self.configs.get(tenant_id, BotConfig())


def ctx(tenant_id: str, session_id: str | None = None, *, variables: dict[str, str] | None = None,
        language: str = "english", key: str | None = None, contact_sub: str | None = None) -> TrustedContext:
    """The context the engine would build: contact_id the verified contact's `sub`, else the
    `contact_id` variable, else the session."""
    session_id = session_id or f"s-{secrets.token_hex(4)}"
    variables = variables or {}
    return TrustedContext(
        tenant_id=tenant_id, session_id=session_id, message_id="m1",
        contact_id=contact_sub or variables.get("contact_id") or session_id, contact_sub=contact_sub,
        variables=variables,
        idempotency_key=key or f"m-{secrets.token_hex(4)}:call", language=language,
    )


class FixedClock:
    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


class Receiver:
    """A tenant's notification endpoint: records every request (headers, raw body)."""

    def __init__(self) -> None:
        self.requests: list[tuple[dict[str, str], bytes]] = []
        self.delay_s = 0.0
        self.status = 204
        self.arrived = asyncio.Event()
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.requests.append(({k.lower(): v for k, v in request.headers.items()}, body))
        self.arrived.set()
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return web.Response(status=self.status)

    async def wait(self, count: int = 1, timeout: float = 10.0) -> None:
        async with asyncio.timeout(timeout):
            while len(self.requests) < count:
                self.arrived.clear()
                await self.arrived.wait()


@asynccontextmanager
async def receiver(host: str = "127.0.0.1") -> AsyncIterator[Receiver]:
    rec = Receiver()
    app = web.Application()
    app.router.add_post("/hooks/{tail:.*}", rec.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, host, 0)
    await site.start()
    port = runner.addresses[0][1]
    rec.url = f"http://{host}:{port}/hooks/ce"
    try:
        yield rec
    finally:
        await runner.cleanup()


@asynccontextmanager
async def services(pool, *, now: datetime | None = None, allow: tuple[str, ...] = ("127.0.0.1/32",),
                   attempt_timeout_s: float = 2.0, schedule_s: tuple[float, ...] = (0.05,),
                   close_timeout_s: float = 5.0) -> AsyncIterator[tuple[BuiltinServices, FakeConfigs]]:
    """The built-in services on the test pool, a real SSRF-guarded webhook client, fake configs."""
    configs = FakeConfigs()
    async with WebhookClient(policy=policy_from_entries(allow)) as client:
        notifier = Notifier(client, NotificationRepo(pool), configs, attempt_timeout_s=attempt_timeout_s,
                            schedule_s=schedule_s, poll_s=0.05)
        clock = FixedClock(now or datetime.now(UTC))
        svc = BuiltinServices(BuiltinRepos(pool), configs, client, now=clock, notifier=notifier)
        try:
            yield svc, configs
        finally:
            await notifier.close(timeout_s=close_timeout_s)


async def through_executor(svc: BuiltinServices, ctx: TrustedContext, tool: str, args: dict[str, Any],
                           call_id: str = "toolu_1") -> ToolOutcome:
    """One call of a built-in tool as the engine runs it: checked, executed and recorded."""
    registry = HandlerRegistry()
    svc.register(registry)
    catalog = build_catalog(BUILTIN_DEFINITIONS, [], registry=registry, backend=None)
    executor = Executor()
    plan = await executor.prepare([ToolCall(id=call_id, name=tool, arguments=args)], catalog=catalog,
                                  config=BotConfig(), session=SessionToolState(), scope={})
    (outcome,) = await executor.execute(plan, ctx, approved=True)
    return outcome
