"""TenantRepo: tenants and their API keys (ce_tenants, ce_api_keys).

A key is `ce_` + 32 random bytes (token_urlsafe). Only its sha256 hex is stored. A fast,
unsalted hash is the right tool here, unlike for passwords: with 256 bits of entropy a key cannot
be guessed or brute-forced from its hash, and a deterministic hash lets the gateway find the
tenant with one indexed lookup per request instead of a slow KDF per key.

Rotation: `issue_key` adds a key beside the live ones, `revoke_key` retires one; `list_keys` shows
keys by id and dates only, since a key's plaintext exists once, in the IssuedKey that made it.
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import datetime

import asyncpg
import msgspec

from kernel.errors import InvalidInput, NotFound
from kernel.records import KEY_KINDS, IssuedKey, KeyHolder, KeyKind, Tenant
from storage.errors import translate

KEY_PREFIX = "ce_"
MAX_NAME_LENGTH = 100


def hash_api_key(api_key: str) -> str:
    """The stored form of an API key: sha256 hex of its UTF-8 bytes."""
    return hashlib.sha256(api_key.encode("utf-8")).hexdigest()


def new_api_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


class ApiKeyRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One of a tenant's API keys as an operator may see it: never the key, nor its hash."""

    key_id: str
    tenant_id: str
    created_at: datetime
    revoked_at: datetime | None = None  # None: the key is live
    kind: KeyKind = "admin"


def _tenant(row: asyncpg.Record) -> Tenant:
    return Tenant(id=row["id"], name=row["name"], created_at=row["created_at"])


def _key(row: asyncpg.Record) -> ApiKeyRecord:
    return ApiKeyRecord(key_id=row["id"], tenant_id=row["tenant_id"], created_at=row["created_at"],
                        revoked_at=row["revoked_at"], kind=row["kind"])


class TenantRepo:
    """Tenants and API keys; the only repository whose lookups are not scoped by a tenant id
    (it is where the tenant id comes from)."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def create_tenant(self, name: str) -> tuple[Tenant, IssuedKey]:
        """Create tenant `name` with its first API key.

        Raises InvalidInput for an empty or over-long name, Conflict when the name is taken.
        """
        name = name.strip()
        if not name or len(name) > MAX_NAME_LENGTH:
            raise InvalidInput(
                f"tenant name must be 1-{MAX_NAME_LENGTH} characters, got {len(name)}", path="$.name"
            )
        tenant_id = "tn_" + secrets.token_hex(8)
        with translate("creating a tenant", conflict=f"tenant name {name!r} is taken; choose another"):
            async with self._pool.acquire() as conn, conn.transaction():
                row = await conn.fetchrow(
                    "INSERT INTO ce_tenants (id, name) VALUES ($1, $2) RETURNING id, name, created_at",
                    tenant_id, name,
                )
                key = await self._insert_key(conn, tenant_id)
        return _tenant(row), key

    async def issue_key(self, tenant_id: str, kind: KeyKind = "admin") -> IssuedKey:
        """A new API key of `kind` for the tenant (older keys stay valid). Raises NotFound for no
        tenant, InvalidInput for a kind that is not admin or chat."""
        if kind not in KEY_KINDS:
            raise InvalidInput(f"a key's kind is admin or chat, got {str(kind)[:20]!r}", path="kind")
        with translate("issuing an api key"):
            async with self._pool.acquire() as conn, conn.transaction():
                exists = await conn.fetchval(
                    "SELECT true FROM ce_tenants WHERE id = $1 FOR SHARE", tenant_id
                )
                if not exists:
                    raise NotFound(f"tenant {tenant_id!r} does not exist", kind="tenant", key=tenant_id)
                return await self._insert_key(conn, tenant_id, kind)

    async def revoke_key(self, tenant_id: str, key_id: str) -> datetime:
        """Revoke one of the tenant's keys; returns when. Gateways that cached the key accept it
        until their cache entry expires (services.gateway.common.KEY_CACHE_TTL_S).

        Raises NotFound if the tenant has no such live key (unknown, another tenant's or already
        revoked: one answer, as for every tenant-scoped lookup; `get_key` tells them apart).
        """
        with translate("revoking an api key"):
            revoked_at = await self._pool.fetchval(
                "UPDATE ce_api_keys SET revoked_at = now() "
                "WHERE tenant_id = $1 AND id = $2 AND revoked_at IS NULL RETURNING revoked_at",
                tenant_id, key_id,
            )
        if revoked_at is None:
            raise NotFound(f"api key {key_id!r} is not a live key of this tenant", kind="api_key", key=key_id)
        return revoked_at

    async def list_keys(self, tenant_id: str) -> list[ApiKeyRecord]:
        """Every key of the tenant, live and revoked, oldest first. Raises NotFound for no tenant."""
        with translate("listing api keys"):
            rows = await self._pool.fetch(
                "SELECT k.id, t.id AS tenant_id, k.created_at, k.revoked_at, k.kind FROM ce_tenants t "
                "LEFT JOIN ce_api_keys k ON k.tenant_id = t.id WHERE t.id = $1 "
                "ORDER BY k.created_at, k.id",
                tenant_id,
            )
        if not rows:
            raise NotFound(f"tenant {tenant_id!r} does not exist", kind="tenant", key=tenant_id)
        return [_key(row) for row in rows if row["id"] is not None]  # NULL id: a tenant with no keys

    async def get_key(self, key_id: str) -> ApiKeyRecord | None:
        """The key with this id, whichever tenant owns it, or None. For operators (the CLI), who
        may see every tenant: unlike the methods above it is not scoped by a tenant id."""
        with translate("reading an api key"):
            row = await self._pool.fetchrow(
                "SELECT id, tenant_id, created_at, revoked_at, kind FROM ce_api_keys WHERE id = $1", key_id
            )
        return None if row is None else _key(row)

    async def tenant_for_key(self, api_key: str) -> Tenant | None:
        """The tenant owning this (unrevoked) key, or None."""
        holder = await self.key_holder(api_key)
        return None if holder is None else holder.tenant

    async def key_holder(self, api_key: str) -> KeyHolder | None:
        """The tenant owning this (unrevoked) key and the key's kind, or None."""
        if not api_key.startswith(KEY_PREFIX):
            return None
        with translate("looking up an api key"):
            row = await self._pool.fetchrow(
                "SELECT t.id, t.name, t.created_at, k.kind FROM ce_api_keys k "
                "JOIN ce_tenants t ON t.id = k.tenant_id "
                "WHERE k.key_hash = $1 AND k.revoked_at IS NULL",
                hash_api_key(api_key),
            )
        return None if row is None else KeyHolder(tenant=_tenant(row), kind=row["kind"])

    async def get_by_name(self, name: str) -> Tenant | None:
        """The tenant called `name`, or None."""
        with translate("reading a tenant"):
            row = await self._pool.fetchrow(
                "SELECT id, name, created_at FROM ce_tenants WHERE name = $1", name
            )
        return None if row is None else _tenant(row)

    async def get(self, tenant_id: str) -> Tenant:
        """The tenant with this id. Raises NotFound."""
        with translate("reading a tenant"):
            row = await self._pool.fetchrow(
                "SELECT id, name, created_at FROM ce_tenants WHERE id = $1", tenant_id
            )
        if row is None:
            raise NotFound(f"tenant {tenant_id!r} does not exist", kind="tenant", key=tenant_id)
        return _tenant(row)

    @staticmethod
    async def _insert_key(conn: asyncpg.Connection, tenant_id: str, kind: KeyKind = "admin") -> IssuedKey:
        key_id = "key_" + secrets.token_hex(8)
        api_key = new_api_key()
        await conn.execute(
            "INSERT INTO ce_api_keys (id, tenant_id, key_hash, kind) VALUES ($1, $2, $3, $4)",
            key_id, tenant_id, hash_api_key(api_key), kind,
        )
        return IssuedKey(tenant_id=tenant_id, key_id=key_id, api_key=api_key, kind=kind)
