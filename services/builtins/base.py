"""What every built-in service shares: the tenant-config port and who the contact is."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Protocol

from services.botconfig import BotConfig
from services.tools.context import TrustedContext

Now = Callable[[], datetime]


def utc_now() -> datetime:
    return datetime.now(UTC)


class TenantConfigs(Protocol):
    """The tenant's bot configuration (webhook, language, contact variable), cached by the caller."""

    async def config_for(self, tenant_id: str) -> BotConfig: ...


def known_contact(ctx: TrustedContext) -> str | None:
    """Who the contact says or is shown to be (the verified `sub`, else the contact variable), or
    None when only the session itself is known (the engine falls back to the session id as
    `contact_id`). A label for people (a handoff's notification), never a key to data: that is
    `ctx.contact_sub` alone."""
    contact = ctx.contact_id
    if not contact or contact == ctx.session_id:
        return None
    return contact


def clip(text: str, limit: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
