"""Fixtures shared by every test directory: one throwaway Postgres, migrated databases, tenants.

- `pg_server` (session): the EmbeddedPostgres started for this run, or None when
  TEST_DATABASE_URL points at an existing server. Started lazily, once, only if a test needs it;
  unit tests never start it.
- `pg_url` (session): the admin URL of that server (TEST_DATABASE_URL if set).
- `fresh_db` (session): async factory; `await fresh_db()` returns the URL of a new database with
  all migrations applied (a copy of a migrated template: milliseconds), `await fresh_db(migrated=False)`
  an empty one. Dropped at the end of the run when the server is external.
- `pool` (session): an asyncpg pool on one migrated database shared by the whole run. Tests
  isolate themselves by tenant (`make_tenant`), not by database.
- `make_tenant`: async factory; `await make_tenant("acme")` returns (Tenant, IssuedKey) for a
  new tenant with a unique name starting with the given prefix.

Add directory-specific fixtures (Ray, gateway) in that directory's conftest.py.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from kernel.records import IssuedKey, Tenant
from tests.support.postgres import database_url


@pytest.fixture(scope="session")
def pg_server() -> Iterator[object | None]:
    if os.environ.get("TEST_DATABASE_URL"):
        yield None
        return
    from storage.embedded import start_embedded

    # Not tmp_path_factory: pytest prunes old base temp dirs, and a concurrent pytest run on the
    # same machine could delete the cluster under the running server.
    data_dir = Path(tempfile.mkdtemp(prefix="ce-test-pg-"))
    server = start_embedded(data_dir, ephemeral=True)
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def pg_url(pg_server) -> str:
    return os.environ.get("TEST_DATABASE_URL") or pg_server.url


FreshDb = Callable[..., Awaitable[str]]


@pytest_asyncio.fixture(scope="session")
async def fresh_db(pg_url: str, pg_server) -> AsyncIterator[FreshDb]:
    from storage.migrate import migrate
    from storage.pool import connect

    run = secrets.token_hex(3)  # several runs may share one external server
    created: list[str] = []
    template: str | None = None
    admin = await connect(pg_url)

    async def create(name: str, *, from_template: str | None = None) -> str:
        suffix = f" TEMPLATE {from_template}" if from_template else ""
        await admin.execute(f"CREATE DATABASE {name}{suffix}")
        created.append(name)
        return database_url(pg_url, name)

    async def make(*, migrated: bool = True) -> str:
        nonlocal template
        name = f"ce_test_{run}_{len(created)}"
        if not migrated:
            return await create(name)
        if template is None:
            tmpl = f"ce_tmpl_{run}"
            conn = await connect(await create(tmpl))
            try:
                await migrate(conn)
            finally:
                await conn.close()
            template = tmpl
        return await create(name, from_template=template)

    try:
        yield make
    finally:
        if pg_server is None:  # external server: leave it as we found it
            for name in reversed(created):
                await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        await admin.close()


@pytest_asyncio.fixture(scope="session")
async def pool(fresh_db: FreshDb):
    from storage.pool import create_pool

    p = await create_pool(await fresh_db(), min_size=1, max_size=8)
    try:
        yield p
    finally:
        await p.close()


MakeTenant = Callable[..., Awaitable[tuple[Tenant, IssuedKey]]]


@pytest.fixture
def make_tenant(pool) -> MakeTenant:
    from storage.repos import TenantRepo

    repo = TenantRepo(pool)

    async def make(prefix: str = "tenant") -> tuple[Tenant, IssuedKey]:
        return await repo.create_tenant(f"{prefix}-{secrets.token_hex(4)}")

    return make
