"""EgressRepo: the destinations an operator allowed one tenant to reach despite the SSRF guard
(ce_tenant_egress). Each change is announced as a catalog change, so session hosts load the
tenant's tools again with the new allowances."""

from __future__ import annotations

import asyncpg

from kernel.errors import LimitReached
from kernel.records import EgressAllowance
from storage.errors import translate
from storage.repos.catalog_sync import NOTIFY_CHANGE, announce_change

#: allowances one tenant may hold: each is checked on every call its tools make
MAX_ALLOWANCES_PER_TENANT = 64


class EgressRepo:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def list(self, tenant_id: str) -> list[EgressAllowance]:
        """The tenant's allowances, by entry and port."""
        with translate("listing egress allowances"):
            rows = await self._pool.fetch(
                "SELECT entry, port FROM ce_tenant_egress WHERE tenant_id = $1 ORDER BY entry, port", tenant_id)
        return [EgressAllowance(entry=r["entry"], port=r["port"]) for r in rows]

    async def allowances(self, tenant_id: str) -> tuple[tuple[str, int], ...]:
        """The tenant's allowances as (entry, port) pairs, as DestinationPolicy.for_tenant takes them."""
        return tuple((a.entry, a.port) for a in await self.list(tenant_id))

    async def allow(self, tenant_id: str, entry: str, port: int = 0) -> bool:
        """Grant `entry` (a CIDR or host name, checked by the caller) on `port` (0: any); False
        when the tenant already had it. Raises LimitReached past MAX_ALLOWANCES_PER_TENANT."""
        with translate("saving an egress allowance"):
            async with self._pool.acquire() as conn, conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock($1, hashtext($2))", 0x63652D65, tenant_id)  # "ce-e"
                held = await conn.fetchval("SELECT count(*) FROM ce_tenant_egress WHERE tenant_id = $1", tenant_id)
                added = await conn.fetchval(
                    "INSERT INTO ce_tenant_egress (tenant_id, entry, port) VALUES ($1, $2, $3) "
                    "ON CONFLICT DO NOTHING RETURNING true", tenant_id, entry, port)
                if added and held >= MAX_ALLOWANCES_PER_TENANT:
                    raise LimitReached(f"a tenant may hold at most {MAX_ALLOWANCES_PER_TENANT} egress allowances; "
                                       "revoke one it no longer needs first", kind="egress", limit=MAX_ALLOWANCES_PER_TENANT)
                if added:
                    await conn.execute(NOTIFY_CHANGE, tenant_id)
        if added:
            await announce_change(self._pool)
        return bool(added)

    async def revoke(self, tenant_id: str, entry: str, port: int = 0) -> bool:
        """Take `entry` on `port` away; False when the tenant did not have it."""
        with translate("revoking an egress allowance"):
            async with self._pool.acquire() as conn, conn.transaction():
                gone = await conn.fetchval(
                    "DELETE FROM ce_tenant_egress WHERE tenant_id = $1 AND entry = $2 AND port = $3 RETURNING true",
                    tenant_id, entry, port)
                if gone:
                    await conn.execute(NOTIFY_CHANGE, tenant_id)
        if gone:
            await announce_change(self._pool)
        return bool(gone)
