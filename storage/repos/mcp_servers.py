"""McpServerRepo: the remote MCP servers each tenant registered as a tool source (ce_mcp_servers).

Every change sends `NOTIFY ce_catalog, '<tenant_id>'` in its transaction (like ToolRepo), so the
session hosts reload that tenant's catalog, and with it the server's tools, on the next message.
The auth header arrives here already encrypted; nothing in this module sees a plaintext secret.
A tenant has at most MAX_SERVERS_PER_TENANT registrations, checked when one is created
(`storage.repos.quotas`: race-free across gateways); changing one is never refused for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import asyncpg

from kernel.errors import InvalidInput, NotFound
from kernel.records import McpServerRecord
from storage.errors import translate
from storage.repos.catalog_sync import NOTIFY_CHANGE, announce_change
from storage.repos.quotas import TenantCap, claim_slot

#: The most MCP servers (enabled or not) a tenant may register. Every catalog load on every
#: session host holding one of the tenant's sessions lists all its enabled servers at once, one
#: outbound connection each, and each adds up to services.tools.mcp.MAX_TOOLS_PER_SERVER (64)
#: tools: 16 servers are at most 16 connections per load and 1,024 remote tools. A bot draws on
#: a handful of services (a shop, a CRM, a calendar, a help desk), so 16 leaves room to spare.
MAX_SERVERS_PER_TENANT = 16
_SERVER_CAP = TenantCap(
    kind="mcp_servers", one="mcp server", many="mcp servers", table="ce_mcp_servers",
    lock=0x63652D6D,  # "ce-m"
    advice="remove servers it no longer uses (DELETE /v1/mcp-servers/{name}) and register this one again",
)
_COLUMNS = (
    "tenant_id, name, url, auth_header_enc, enabled, read_only_tools, include_tools, intents, "
    "timeout_ms, created_at, updated_at"
)
#: the columns a PATCH may change (`auth_header_enc` only with a new ciphertext)
UPDATABLE = frozenset({"url", "auth_header_enc", "enabled", "read_only_tools", "include_tools", "intents", "timeout_ms"})


def _record(row: asyncpg.Record) -> McpServerRecord:
    include = row["include_tools"]
    return McpServerRecord(
        tenant_id=row["tenant_id"], name=row["name"], url=row["url"], auth_header_enc=row["auth_header_enc"],
        enabled=row["enabled"], read_only_tools=tuple(row["read_only_tools"]),
        include_tools=tuple(include) if include is not None else None, intents=tuple(row["intents"]),
        timeout_ms=row["timeout_ms"], created_at=row["created_at"], updated_at=row["updated_at"],
    )


def _not_found(name: str) -> NotFound:
    return NotFound(
        f"mcp server {name[:64]!r} is not registered for this tenant; list them with GET /v1/mcp-servers",
        kind="mcp_server", key=name,
    )


def _params(record: McpServerRecord) -> tuple[Any, ...]:
    return (
        record.url, record.auth_header_enc, record.enabled, list(record.read_only_tools),
        list(record.include_tools) if record.include_tools is not None else None, list(record.intents),
        record.timeout_ms,
    )


class McpServerRepo:
    """Register, read, change and remove a tenant's MCP servers; every query scoped by tenant."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def create(self, record: McpServerRecord) -> McpServerRecord:
        """Store a new registration. Raises Conflict when the tenant already has one of that name,
        LimitReached (a Conflict) when it already has MAX_SERVERS_PER_TENANT."""
        with translate("registering an mcp server", conflict=f"an mcp server named {record.name!r} is "
                       "already registered; change it with PATCH or choose another name"):
            async with self._pool.acquire() as conn, conn.transaction():
                await claim_slot(conn, _SERVER_CAP, record.tenant_id, record.name, MAX_SERVERS_PER_TENANT)
                row = await conn.fetchrow(
                    "INSERT INTO ce_mcp_servers (tenant_id, name, url, auth_header_enc, enabled, "
                    "read_only_tools, include_tools, intents, timeout_ms) "
                    f"VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) RETURNING {_COLUMNS}",
                    record.tenant_id, record.name, *_params(record),
                )
                await conn.execute(NOTIFY_CHANGE, record.tenant_id)
        await announce_change(self._pool)
        return _record(row)

    async def get(self, tenant_id: str, name: str) -> McpServerRecord:
        """The registration `name`. Raises NotFound (also when another tenant owns that name)."""
        with translate("reading an mcp server"):
            row = await self._pool.fetchrow(
                f"SELECT {_COLUMNS} FROM ce_mcp_servers WHERE tenant_id = $1 AND name = $2", tenant_id, name
            )
        if row is None:
            raise _not_found(name)
        return _record(row)

    async def list(self, tenant_id: str, *, after: str = "", limit: int | None = None) -> list[McpServerRecord]:
        """The tenant's registrations (enabled or not) named after `after`, by name, at most `limit`."""
        with translate("listing mcp servers"):
            rows = await self._pool.fetch(
                f"SELECT {_COLUMNS} FROM ce_mcp_servers WHERE tenant_id = $1 AND name > $2 ORDER BY name LIMIT $3",
                tenant_id, after.replace("\x00", ""), limit,
            )
        return [_record(r) for r in rows]

    async def update(self, tenant_id: str, name: str, changes: dict[str, Any], *,
                     check: Callable[[McpServerRecord], None] | None = None) -> McpServerRecord:
        """Change the given columns of registration `name` (keys from UPDATABLE).

        `check`, when given, is called with the registration as it is before the change, on the
        row locked for it: what it raises is raised and nothing changes. A check that reads the
        columns the change leaves alone (the gateway's: a new url must not keep an auth header
        another request stored meanwhile) sees what the change will keep, not an earlier read.

        Raises NotFound, or InvalidInput for a column that may not be changed.
        """
        unknown = set(changes) - UPDATABLE
        if unknown:
            raise InvalidInput(f"mcp server field(s) {sorted(unknown)} cannot be changed")
        if not changes:
            return await self.get(tenant_id, name)
        columns = sorted(changes)
        values = [list(v) if isinstance(v, tuple) else v for v in (changes[c] for c in columns)]
        assignments = ", ".join(f"{c} = ${i}" for i, c in enumerate(columns, start=3))
        with translate("changing an mcp server"):
            async with self._pool.acquire() as conn, conn.transaction():
                if check is not None:
                    current = await conn.fetchrow(
                        f"SELECT {_COLUMNS} FROM ce_mcp_servers WHERE tenant_id = $1 AND name = $2 FOR UPDATE",
                        tenant_id, name,
                    )
                    if current is None:
                        raise _not_found(name)
                    check(_record(current))
                row = await conn.fetchrow(
                    f"UPDATE ce_mcp_servers SET {assignments}, updated_at = now() "
                    f"WHERE tenant_id = $1 AND name = $2 RETURNING {_COLUMNS}",
                    tenant_id, name, *values,
                )
                if row is None:
                    raise _not_found(name)
                await conn.execute(NOTIFY_CHANGE, tenant_id)
        await announce_change(self._pool)
        return _record(row)

    async def delete(self, tenant_id: str, name: str) -> None:
        """Remove registration `name` (its tools leave the catalog). Raises NotFound."""
        with translate("removing an mcp server"):
            async with self._pool.acquire() as conn, conn.transaction():
                gone = await conn.fetchval(
                    "DELETE FROM ce_mcp_servers WHERE tenant_id = $1 AND name = $2 RETURNING true", tenant_id, name
                )
                if not gone:
                    raise _not_found(name)
                await conn.execute(NOTIFY_CHANGE, tenant_id)
        await announce_change(self._pool)

