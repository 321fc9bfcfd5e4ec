"""BotConfigRepo: a tenant's bot configuration (ce_bot_config), stored as one JSON object.

The repository stores what services.botconfig validated; it does not interpret it. A change is
announced on the catalog channel (NOTIFY ce_catalog) because intents and the allowlist decide
which tools live sessions offer.
"""

from __future__ import annotations

from typing import Any

import asyncpg

from kernel.errors import InvalidInput
from storage.errors import translate
from storage.repos.catalog_sync import NOTIFY_CHANGE, announce_change


class BotConfigRepo:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def get(self, tenant_id: str) -> dict[str, Any]:
        """The tenant's stored config, or {} when it never saved one."""
        with translate("reading the bot config"):
            config = await self._pool.fetchval(
                "SELECT config FROM ce_bot_config WHERE tenant_id = $1", tenant_id
            )
        return {} if config is None else config

    async def put(self, tenant_id: str, config: dict[str, Any]) -> None:
        """Replace the tenant's config. Raises InvalidInput when it is not a JSON object."""
        if not isinstance(config, dict):
            raise InvalidInput("the bot config must be a JSON object", path="$")
        with translate("saving the bot config"):
            async with self._pool.acquire() as conn, conn.transaction():
                await conn.execute(
                    "INSERT INTO ce_bot_config (tenant_id, config) VALUES ($1, $2) "
                    "ON CONFLICT (tenant_id) DO UPDATE SET config = EXCLUDED.config, updated_at = now()",
                    tenant_id, config,
                )
                await conn.execute(NOTIFY_CHANGE, tenant_id)
        await announce_change(self._pool)
