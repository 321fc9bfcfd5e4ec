"""Per-tenant caps on what a tenant registers (tools, MCP servers), checked where the row is created.

The repositories own the caps (`storage.repos.tools.MAX_TOOLS_PER_TENANT`,
`storage.repos.mcp_servers.MAX_SERVERS_PER_TENANT`) and call `claim_slot` inside the transaction
that inserts the row. It first takes a transaction-scoped advisory lock on (the cap's namespace,
the tenant), then counts: two gateways creating a tenant's last allowed tool at once take turns,
and the second counts the first's committed row and is refused. A count without the lock is not
enough: under READ COMMITTED both would count before either committed, and both would insert.
The lock is released at commit or rollback, is per kind and per tenant (another tenant waits only
when its id hashes alike, and then only for one insert), and only creation takes it: updates,
publishes and deletes never wait for it, and a delete makes room at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import asyncpg

from kernel.errors import LimitReached


@dataclass(frozen=True, slots=True)
class TenantCap:
    """What one cap counts and how its refusal reads."""

    kind: str  # LimitReached.kind: "tools", "mcp_servers"
    one: str  # in the message, one of them: "tool", "mcp server"
    many: str  # and several: "tools", "mcp servers"
    table: str  # rows (tenant_id, name) of this table count; a constant, never input
    lock: int  # pg_advisory_xact_lock namespace (int4); the tenant is the second key
    advice: str  # what to do instead, ending the message


async def claim_slot(conn: asyncpg.Connection, cap: TenantCap, tenant_id: str, name: str, limit: int) -> None:
    """Within the caller's transaction on `conn`: wait for the tenant's other creations of this
    kind, then let the insert of `name` go ahead when the tenant has fewer than `limit` rows.

    A `name` the tenant already has is let through so that the insert fails as the duplicate it
    is (Conflict), not as a limit. Raises LimitReached (409 at the gateway) naming the limit.
    """
    await conn.execute("SELECT pg_advisory_xact_lock($1, hashtext($2))", cap.lock, tenant_id)
    row = await conn.fetchrow(
        f"SELECT count(*) AS n, coalesce(bool_or(name = $2), false) AS taken FROM {cap.table} "
        "WHERE tenant_id = $1",
        tenant_id, name,
    )
    if row["n"] >= limit and not row["taken"]:
        raise LimitReached(
            f"{cap.one} limit reached: a tenant may register at most {limit} {cap.many} and this one "
            f"has {row['n']}; {cap.advice}",
            kind=cap.kind, limit=limit,
        )
