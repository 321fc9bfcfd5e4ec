"""A session host's runtime on loopback, and one tool call through a tenant's catalog as that
host loads it (TenantCatalogs)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from actors.runtime import Runtime
from services.settings import Settings
from services.tools.context import TrustedContext
from services.tools.crypto import SecretBox
from services.tools.executor import Executor, ToolCall, ToolOutcome
from services.tools.ssrf import DestinationPolicy
from services.tools.toolset import SessionToolState
from services.tools.webhook import WebhookClient
from tests.support.net_fakes import LoopbackOnlySockets, MapResolver


async def through_catalog(catalogs: Any, tenant_id: str, tool: str, args: dict[str, Any]) -> ToolOutcome:
    """`tool` called with `args` in one of the tenant's sessions: checked, run and recorded."""
    env = await catalogs.env_for(tenant_id)
    executor = Executor()
    plan = await executor.prepare([ToolCall(id=f"toolu_{tool}", name=tool, arguments=args)], catalog=env.catalog,
                                  config=env.config, session=SessionToolState(), scope={})
    context = TrustedContext(tenant_id=tenant_id, session_id="s1", message_id="m1", contact_id="c1",
                             idempotency_key=f"m1:{tool}")
    (outcome,) = await executor.execute(plan, context, approved=True)
    return outcome


@asynccontextmanager
async def loopback_runtime(policy: DestinationPolicy, keys: tuple[str, ...] = ()) -> AsyncIterator[Runtime]:
    """A host's runtime holding `keys`, its webhook client checking `policy`, names resolved
    through a map and every socket loopback-only (asserted on the way out)."""
    sockets = LoopbackOnlySockets()
    rt = Runtime(Settings(secret_keys=keys))
    rt.secret_box = SecretBox(list(keys)) if keys else None
    rt.webhooks = WebhookClient(policy=policy, resolver=MapResolver(), socket_factory=sockets)
    await rt.webhooks.start()
    try:
        yield rt
    finally:
        await rt.webhooks.close()
    assert sockets.refused == [], "a client tried to connect off loopback"


async def no_builtins(tenant_id: str) -> tuple:
    """A tenant offered no built-in tools."""
    return ()
