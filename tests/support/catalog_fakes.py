"""The tool repository a host's TenantCatalogs reads, faked: no tools published, one stamp."""

from __future__ import annotations


class FakeTools:
    async def list_published(self, tenant_id: str) -> list:
        return []

    async def catalog_stamp(self, tenant_id: str) -> str:
        return "s1"
