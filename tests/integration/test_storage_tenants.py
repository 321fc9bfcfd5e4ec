"""TenantRepo: tenants, API keys stored hashed, lookup by key, revocation."""

from __future__ import annotations

import hashlib

import pytest

from kernel.errors import Conflict, InvalidInput, NotFound
from storage.repos import TenantRepo


@pytest.fixture
def tenants(pool) -> TenantRepo:
    return TenantRepo(pool)


async def test_a_new_tenant_gets_a_key_that_finds_it(tenants, pool, make_tenant):
    tenant, key = await make_tenant("acme")
    assert key.tenant_id == tenant.id
    assert key.api_key.startswith("ce_") and len(key.api_key) >= 40
    assert await tenants.tenant_for_key(key.api_key) == tenant
    assert await tenants.get_by_name(tenant.name) == tenant
    assert await tenants.get(tenant.id) == tenant
    # only the sha256 hex is stored, never the plaintext
    stored = await pool.fetchval("SELECT key_hash FROM ce_api_keys WHERE id = $1", key.key_id)
    assert stored == hashlib.sha256(key.api_key.encode()).hexdigest()
    assert await pool.fetchval(
        "SELECT count(*) FROM ce_api_keys WHERE key_hash = $1 OR id = $1", key.api_key
    ) == 0


async def test_unknown_malformed_and_revoked_keys_find_nobody(tenants, make_tenant):
    tenant, first = await make_tenant()
    second = await tenants.issue_key(tenant.id)
    assert await tenants.tenant_for_key("ce_" + "x" * 43) is None
    assert await tenants.tenant_for_key("Bearer nonsense") is None
    assert await tenants.tenant_for_key("") is None
    await tenants.revoke_key(tenant.id, first.key_id)
    assert await tenants.tenant_for_key(first.api_key) is None
    assert await tenants.tenant_for_key(second.api_key) == tenant
    with pytest.raises(NotFound, match="is not a live key of this tenant"):
        await tenants.revoke_key(tenant.id, first.key_id)


async def test_a_tenant_cannot_revoke_another_tenants_key(tenants, make_tenant):
    a, _ = await make_tenant("a")
    b, b_key = await make_tenant("b")
    with pytest.raises(NotFound):
        await tenants.revoke_key(a.id, b_key.key_id)
    assert await tenants.tenant_for_key(b_key.api_key) == b


async def test_duplicate_and_empty_names_are_refused(tenants, make_tenant):
    tenant, _ = await make_tenant()
    with pytest.raises(Conflict, match=rf"tenant name '{tenant.name}' is taken"):
        await tenants.create_tenant(tenant.name)
    with pytest.raises(InvalidInput, match="tenant name must be 1-100 characters"):
        await tenants.create_tenant("   ")


async def test_unknown_tenants(tenants):
    assert await tenants.get_by_name("nobody-by-this-name") is None
    with pytest.raises(NotFound, match="tenant 'tn_missing' does not exist"):
        await tenants.issue_key("tn_missing")
    with pytest.raises(NotFound):
        await tenants.get("tn_missing")


async def test_list_keys_shows_every_key_of_the_tenant_oldest_first_without_its_secret(tenants, make_tenant):
    tenant, first = await make_tenant("lister")
    second = await tenants.issue_key(tenant.id)
    _other, other_key = await make_tenant("lister-other")
    revoked_at = await tenants.revoke_key(tenant.id, first.key_id)
    keys = await tenants.list_keys(tenant.id)
    assert [k.key_id for k in keys] == [first.key_id, second.key_id]  # never another tenant's
    assert all(k.tenant_id == tenant.id for k in keys)
    assert keys[0].revoked_at == revoked_at and keys[0].revoked_at >= keys[0].created_at
    assert keys[1].revoked_at is None
    assert keys[0].created_at <= keys[1].created_at
    # the record has no field that could carry the key or its hash
    assert set(type(keys[0]).__struct_fields__) == {"key_id", "tenant_id", "created_at", "revoked_at", "kind"}
    assert other_key.key_id not in {k.key_id for k in keys}


async def test_list_keys_of_an_unknown_tenant_is_not_found(tenants):
    with pytest.raises(NotFound, match="tenant 'tn_missing' does not exist") as info:
        await tenants.list_keys("tn_missing")
    assert info.value.kind == "tenant"


async def test_get_key_finds_any_tenants_key_by_id_for_operators(tenants, make_tenant):
    tenant, key = await make_tenant("getkey")
    found = await tenants.get_key(key.key_id)
    assert found is not None and found.tenant_id == tenant.id and found.revoked_at is None
    await tenants.revoke_key(tenant.id, key.key_id)
    assert (await tenants.get_key(key.key_id)).revoked_at is not None
    assert await tenants.get_key("key_0000000000000000") is None
