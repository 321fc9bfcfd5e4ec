"""ToolRepo: tenant tools as versioned data (ce_tool_versions) with one live row each
(ce_custom_tools, seed 000's table), plus the catalog change notifications.

The live version and the newest MAX_VERSIONS_KEPT versions of each tool are kept (older ones are
pruned as new ones are stored); the live row is the published version with seed 000's columns
filled from its definition. Each change sends `NOTIFY ce_catalog, '<tenant_id>'` in the same
transaction, so it is delivered only if the change commits; `listen_catalog` subscribes to it.

A tenant has at most MAX_TOOLS_PER_TENANT live tools, checked when one is created
(`storage.repos.quotas`: race-free across gateways); a new version of an existing tool is never
refused for it.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import asyncpg

from kernel.errors import Conflict, InvalidInput, NotFound
from kernel.records import PublishedTool, ToolVersion
from storage.errors import translate
from storage.repos.catalog_sync import NOTIFY_CHANGE, announce_change
from storage.repos.notify import ChannelListener, listen
from storage.repos.quotas import TenantCap, claim_slot

CATALOG_CHANNEL = "ce_catalog"

#: versions kept per tool besides the live one: storing a new version prunes those older than
#: the newest MAX_VERSIONS_KEPT (never the live one). Every version held its whole definition, up
#: to 256 KB, forever, and one listing returned them all: thousands of PATCHes made a gigabyte.
MAX_VERSIONS_KEPT = 50

#: The most live tools (enabled or not) a tenant may have; their versions and the history of
#: deleted tools do not count. Every live tool is compiled into the tenant's catalog on each
#: session host that holds one of its sessions, and a turn offers the model the whole catalog
#: when no intent narrows it, each definition costing input tokens every round. A definition may
#: be as large as the gateway's body limit (256 KB), so 256 tools bound a tenant's catalog to
#: ~64 MB per host and keep an un-narrowed tool list within what a model can choose from; a
#: bot's tools are tens, so this leaves room several times over (and it is the engine's other
#: per-tenant bound: CE_TENANT_CONCURRENCY's default, the MCP routes' name lists).
MAX_TOOLS_PER_TENANT = 256
_TOOL_CAP = TenantCap(
    kind="tools", one="tool", many="tools", table="ce_custom_tools",
    lock=0x63652D74,  # "ce-t"
    advice="delete tools it no longer uses (DELETE /v1/tools/{name}; their versions are kept) and create "
    "this one again",
)

_LIVE_COLUMNS = (
    "id, tenant_id, name, type, version, coalesce(enabled, true) AS enabled, definition, "
    "coalesce(created_at, now()) AS created_at, updated_at"
)


_STAMP = (
    "SELECT md5(coalesce((SELECT string_agg(name || ':' || version || ':' || coalesce(enabled, true) "
    "|| ':' || updated_at, ',' ORDER BY name) FROM ce_custom_tools WHERE tenant_id = $1), '') "
    "|| '|' || coalesce((SELECT updated_at::text FROM ce_bot_config WHERE tenant_id = $1), '') "
    # which built-ins are offered: submit_form once a form exists, the booking tools once a service does
    "|| '|' || EXISTS (SELECT 1 FROM ce_forms WHERE tenant_id = $1)::text "
    "|| EXISTS (SELECT 1 FROM ce_appointment_services WHERE tenant_id = $1)::text "
    # the MCP servers it registered (their tools join the catalog): any create, update or delete
    "|| '|' || coalesce((SELECT string_agg(name || ':' || updated_at::text, ',' ORDER BY name) "
    "FROM ce_mcp_servers WHERE tenant_id = $1), '') "
    # the egress allowances an operator granted it (its tools' destinations)
    "|| '|' || coalesce((SELECT string_agg(entry || ':' || port, ',' ORDER BY entry, port) "
    "FROM ce_tenant_egress WHERE tenant_id = $1), ''))"
)


def _published(row: asyncpg.Record) -> PublishedTool:
    return PublishedTool(
        id=row["id"], tenant_id=row["tenant_id"], name=row["name"], type=row["type"],
        version=row["version"], enabled=row["enabled"], definition=row["definition"],
        created_at=row["created_at"], updated_at=row["updated_at"],
    )


def _version(row: asyncpg.Record, *, published: bool) -> ToolVersion:
    return ToolVersion(
        tenant_id=row["tenant_id"], name=row["name"], version=row["version"],
        definition=row["definition"], created_at=row["created_at"], published=published,
    )


class ToolChanged(Conflict):
    """A new version was merged from a live version that another change has since replaced."""

    def __init__(self, name: str, *, live: int, read: int) -> None:
        super().__init__(
            f"tool {name!r} changed while this change was prepared (version {live} is live now; the change was "
            f"made from version {read} as it was then); nothing was stored: send it again to apply it to what is "
            "live now"
        )
        self.live = live


def _not_found(name: str) -> NotFound:
    return NotFound(f"tool {name!r} does not exist for this tenant", kind="tool", key=name)


def _normalise(name: str, type_: str, definition: dict[str, Any]) -> dict[str, Any]:
    """The definition as stored: carries its own `name` and `type`; never a plaintext secret."""
    if not isinstance(definition, dict):
        raise InvalidInput("a tool definition must be a JSON object", path="$")
    if "auth_header" in definition:
        raise InvalidInput(
            "the definition carries a plaintext auth_header; encrypt it into auth_header_enc "
            "before storing (services.tools.crypto)",
            path="$.auth_header",
        )
    for key, want in (("name", name), ("type", type_)):
        got = definition.get(key, want)
        if got != want:
            raise InvalidInput(f"definition {key} {got!r} does not match {want!r}", path=f"$.{key}")
    parameters = definition.get("parameters", {})
    if not isinstance(parameters, dict):
        raise InvalidInput("tool parameters must be a JSON object", path="$.parameters")
    return {**definition, "name": name, "type": type_}


def _seed_columns(type_: str, d: dict[str, Any]) -> tuple[Any, ...]:
    """description, parameters, webhook_url, auth_header, timeout_ms, enabled for ce_custom_tools."""
    timeout = d.get("timeout_ms", 5000)
    if not isinstance(timeout, int) or isinstance(timeout, bool) or timeout <= 0:
        raise InvalidInput(f"timeout_ms must be a positive whole number, got {timeout!r}", path="$.timeout_ms")
    return (
        str(d.get("description", "")),
        d.get("parameters", {}),
        str(d.get("webhook_url", "")) if type_ == "webhook" else "",
        d.get("auth_header_enc"),  # ciphertext from services.tools.crypto, or None
        timeout,
        bool(d.get("enabled", True)),
    )


class ToolRepo:
    """Tenant tools: create, version, publish, roll back, enable/disable, delete."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def create(
        self, tenant_id: str, name: str, type: str, definition: dict[str, Any]
    ) -> ToolVersion:
        """Create tool `name` and publish its first version.

        The version is 1 for a new name; a name deleted earlier continues its numbering (its
        history is kept). Raises Conflict when the tenant already has a live tool of this name,
        LimitReached (a Conflict) when it already has MAX_TOOLS_PER_TENANT, InvalidInput for a
        definition that cannot be stored.
        """
        d = _normalise(name, type, definition)
        cols = _seed_columns(type, d)
        with translate("creating a tool", conflict=f"a tool named {name!r} already exists; "
                       "change it with PATCH or choose another name"):
            async with self._pool.acquire() as conn, conn.transaction():
                await claim_slot(conn, _TOOL_CAP, tenant_id, name, MAX_TOOLS_PER_TENANT)
                version = await _next_version(conn, tenant_id, name)
                await conn.execute(
                    "INSERT INTO ce_custom_tools (id, tenant_id, name, description, parameters, "
                    "webhook_url, auth_header, timeout_ms, enabled, type, version, definition) "
                    "VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)",
                    str(uuid.uuid4()), tenant_id, name, *cols, type, version, d,
                )
                row = await _insert_version(conn, tenant_id, name, version, d)
                await _prune_versions(conn, tenant_id, name)
                await conn.execute(NOTIFY_CHANGE, tenant_id)
        await announce_change(self._pool)
        return _version(row, published=True)

    async def new_version(
        self, tenant_id: str, name: str, definition: dict[str, Any], *, publish: bool = False,
        based_on: PublishedTool | None = None,
    ) -> ToolVersion:
        """Store a new version of an existing tool; publish it at once when `publish`.

        The type defaults to the live tool's. Publishing a new definition takes its `enabled`.
        Raises NotFound when the tenant has no live tool `name`, and ToolChanged, storing nothing,
        when `based_on` (the live tool as read when `definition` was merged from it) is no longer
        what is live: another version published, or the live tool switched on or off since
        (`set_enabled`: same version, later `updated_at`). Judged on the locked row, so two merges
        of one live tool cannot both be published.
        """
        with translate("adding a tool version"):
            async with self._pool.acquire() as conn, conn.transaction():
                live = await conn.fetchrow(
                    "SELECT type, version, updated_at FROM ce_custom_tools "
                    "WHERE tenant_id = $1 AND name = $2 FOR UPDATE",
                    tenant_id, name,
                )
                if live is None:
                    raise _not_found(name)
                if based_on is not None and (live["version"], live["updated_at"]) != (
                        based_on.version, based_on.updated_at):
                    raise ToolChanged(name, live=live["version"], read=based_on.version)
                type_ = definition.get("type", live["type"]) if isinstance(definition, dict) else live["type"]
                d = _normalise(name, type_, definition)
                cols = _seed_columns(type_, d)
                version = await _next_version(conn, tenant_id, name)
                row = await _insert_version(conn, tenant_id, name, version, d)
                if publish:
                    await conn.execute(
                        "UPDATE ce_custom_tools SET description = $3, parameters = $4, "
                        "webhook_url = $5, auth_header = $6, timeout_ms = $7, enabled = $8, "
                        "type = $9, version = $10, definition = $11, updated_at = now() "
                        "WHERE tenant_id = $1 AND name = $2",
                        tenant_id, name, *cols, type_, version, d,
                    )
                    await conn.execute(NOTIFY_CHANGE, tenant_id)
                await _prune_versions(conn, tenant_id, name)
        if publish:
            await announce_change(self._pool)
        return _version(row, published=publish)

    async def publish(self, tenant_id: str, name: str, version: int) -> PublishedTool:
        """Make stored `version` the live one (a rollback when it is older).

        The live enabled/disabled switch is kept as it is. Raises NotFound for no live tool or
        no such version.
        """
        with translate("publishing a tool version"):
            async with self._pool.acquire() as conn, conn.transaction():
                live = await conn.fetchrow(
                    "SELECT coalesce(enabled, true) AS enabled FROM ce_custom_tools "
                    "WHERE tenant_id = $1 AND name = $2 FOR UPDATE",
                    tenant_id, name,
                )
                if live is None:
                    raise _not_found(name)
                d = await conn.fetchval(
                    "SELECT definition FROM ce_tool_versions "
                    "WHERE tenant_id = $1 AND name = $2 AND version = $3",
                    tenant_id, name, version,
                )
                if d is None:
                    raise NotFound(
                        f"tool {name!r} has no version {version}; list them with "
                        f"GET /v1/tools/{name}/versions",
                        kind="tool_version", key=f"{name}@{version}",
                    )
                type_ = d.get("type", "webhook")
                d = {**d, "enabled": live["enabled"]}
                cols = _seed_columns(type_, d)
                row = await conn.fetchrow(
                    "UPDATE ce_custom_tools SET description = $3, parameters = $4, "
                    "webhook_url = $5, auth_header = $6, timeout_ms = $7, enabled = $8, "
                    "type = $9, version = $10, definition = $11, updated_at = now() "
                    f"WHERE tenant_id = $1 AND name = $2 RETURNING {_LIVE_COLUMNS}",
                    tenant_id, name, *cols, type_, version, d,
                )
                await conn.execute(NOTIFY_CHANGE, tenant_id)
        await announce_change(self._pool)
        return _published(row)

    async def list_published(self, tenant_id: str, *, after: str = "", limit: int | None = None) -> list[PublishedTool]:
        """The tenant's live tools (enabled or not) named after `after`, by name, at most `limit`."""
        with translate("listing tools"):
            rows = await self._pool.fetch(
                f"SELECT {_LIVE_COLUMNS} FROM ce_custom_tools WHERE tenant_id = $1 AND name > $2 ORDER BY name LIMIT $3",
                tenant_id, after, limit,
            )
        return [_published(r) for r in rows]

    async def get(self, tenant_id: str, name: str) -> PublishedTool:
        """The live tool `name`. Raises NotFound (also when another tenant owns that name)."""
        with translate("reading a tool"):
            row = await self._pool.fetchrow(
                f"SELECT {_LIVE_COLUMNS} FROM ce_custom_tools WHERE tenant_id = $1 AND name = $2",
                tenant_id, name,
            )
        if row is None:
            raise _not_found(name)
        return _published(row)

    async def versions(self, tenant_id: str, name: str, *, after: int = 0, limit: int | None = None) -> list[ToolVersion]:
        """The stored versions of `name` numbered above `after`, oldest first, at most `limit`;
        `published` marks the live one.

        Raises NotFound when the tenant has no stored version of that name.
        """
        with translate("listing tool versions"):
            rows = await self._pool.fetch(
                "SELECT v.tenant_id, v.name, v.version, v.definition, v.created_at, "
                "(t.version IS NOT DISTINCT FROM v.version) AS published "
                "FROM ce_tool_versions v LEFT JOIN ce_custom_tools t "
                "ON t.tenant_id = v.tenant_id AND t.name = v.name "
                "WHERE v.tenant_id = $1 AND v.name = $2 AND v.version > $3 ORDER BY v.version LIMIT $4",
                tenant_id, name, after, limit,
            )
            if not rows and after > 0 and await self._pool.fetchval(
                    "SELECT true FROM ce_tool_versions WHERE tenant_id = $1 AND name = $2 LIMIT 1", tenant_id, name):
                return []  # a page past the last
        if not rows:
            raise _not_found(name)
        return [_version(r, published=r["published"]) for r in rows]

    async def delete(self, tenant_id: str, name: str) -> None:
        """Remove the live tool (its versions stay for audit and re-creation). Raises NotFound."""
        with translate("deleting a tool"):
            async with self._pool.acquire() as conn, conn.transaction():
                gone = await conn.fetchval(
                    "DELETE FROM ce_custom_tools WHERE tenant_id = $1 AND name = $2 RETURNING true",
                    tenant_id, name,
                )
                if not gone:
                    raise _not_found(name)
                await conn.execute(NOTIFY_CHANGE, tenant_id)
        await announce_change(self._pool)

    async def catalog_stamp(self, tenant_id: str) -> str:
        """A fingerprint of everything a tenant's catalog is built from: its live tools (name,
        version, switch, last change), its bot config's last change, whether it has forms and
        appointment services (which built-ins it is offered), its MCP server registrations and
        its egress allowances.
        Any committed write through this module, BotConfigRepo, McpServerRepo, or the first/last
        form or service changes it. One statement of indexed reads: a turn makes it every time."""
        with translate("checking the tool catalog"):
            return await self._pool.fetchval(_STAMP, tenant_id)

    async def set_enabled(self, tenant_id: str, name: str, enabled: bool) -> PublishedTool:
        """Switch the live tool on or off (column and live definition). Raises NotFound."""
        with translate("enabling or disabling a tool"):
            async with self._pool.acquire() as conn, conn.transaction():
                row = await conn.fetchrow(
                    "UPDATE ce_custom_tools SET enabled = $3, updated_at = now(), "
                    "definition = jsonb_set(definition, '{enabled}', to_jsonb($3::boolean)) "
                    f"WHERE tenant_id = $1 AND name = $2 RETURNING {_LIVE_COLUMNS}",
                    tenant_id, name, enabled,
                )
                if row is None:
                    raise _not_found(name)
                await conn.execute(NOTIFY_CHANGE, tenant_id)
        await announce_change(self._pool)
        return _published(row)


async def _next_version(conn: asyncpg.Connection, tenant_id: str, name: str) -> int:
    return await conn.fetchval(
        "SELECT coalesce(max(version), 0) + 1 FROM ce_tool_versions WHERE tenant_id = $1 AND name = $2",
        tenant_id, name,
    )


async def _prune_versions(conn: asyncpg.Connection, tenant_id: str, name: str) -> None:
    """Drop the versions of `name` older than its newest MAX_VERSIONS_KEPT, the live one never."""
    await conn.execute(
        "DELETE FROM ce_tool_versions v WHERE v.tenant_id = $1 AND v.name = $2 "
        "AND v.version <= (SELECT max(version) FROM ce_tool_versions WHERE tenant_id = $1 AND name = $2) - $3 "
        "AND v.version IS DISTINCT FROM (SELECT version FROM ce_custom_tools WHERE tenant_id = $1 AND name = $2)",
        tenant_id, name, MAX_VERSIONS_KEPT,
    )


async def _insert_version(
    conn: asyncpg.Connection, tenant_id: str, name: str, version: int, d: dict[str, Any]
) -> asyncpg.Record:
    return await conn.fetchrow(
        "INSERT INTO ce_tool_versions (tenant_id, name, version, definition) VALUES ($1, $2, $3, $4) "
        "RETURNING tenant_id, name, version, definition, created_at",
        tenant_id, name, version, d,
    )


CatalogCallback = Callable[[str], Any]
CatalogListener = ChannelListener


async def listen_catalog(
    source: asyncpg.Pool | asyncpg.Connection,
    callback: CatalogCallback,
    *,
    on_lost: Callable[[], Any] | None = None,
) -> CatalogListener:
    """Call `callback(tenant_id)` whenever a tenant's tools or bot config change.

    With a pool, one of its connections is held for the subscription until `close()`. A callback
    may be a coroutine function (its coroutine is scheduled as a task). `on_lost` is called if the
    connection dies: notifications sent meanwhile are lost, so the caller should reload all it
    caches and subscribe again. Raises StorageUnavailable when Postgres cannot be reached.
    """
    return await listen(source, CATALOG_CHANNEL, callback, on_lost=on_lost, doing="subscribing to catalog changes")
