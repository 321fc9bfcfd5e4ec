"""The CLI as an operator meets it: bad configuration ends in one sentence, not a traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CLI = [sys.executable, "-m", "services.cli"]


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("CE_", "DATABASE_URL"))}
    full_env.update(env)
    return subprocess.run([*CLI, *args], env=full_env, capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"DATABASE_URL": "mysql://user@localhost/db"}, "DATABASE_URL must look like postgresql://"),
        ({"DATABASE_URL": "postgresql://user:hunter2@127.0.0.1:1/db"}, "cannot connect to Postgres at 127.0.0.1:1"),
        ({"CE_PLACEMENT": "everywhere"}, "CE_PLACEMENT must be 'sharded' or 'dedicated'"),
        ({"CE_SHARDS": "many"}, "CE_SHARDS must be a whole number"),
    ],
)
def test_bad_configuration_ends_with_one_clear_sentence(env, says):
    result = run_cli("migrate", env=env)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and says in lines[0], result.stderr
    assert "hunter2" not in result.stderr  # never the password


async def test_tenant_create_prints_a_working_key(fresh_db):
    import asyncio
    import json

    from storage.pool import create_pool
    from storage.repos import TenantRepo

    url = await fresh_db()
    result = await asyncio.to_thread(run_cli, "tenant", "create", "acme-cli", env={"DATABASE_URL": url})
    assert result.returncode == 0, result.stderr
    created = json.loads(result.stdout)
    assert created["name"] == "acme-cli" and created["api_key"].startswith("ce_")
    pool = await create_pool(url, max_size=1)
    try:
        tenant = await TenantRepo(pool).tenant_for_key(created["api_key"])
    finally:
        await pool.close()
    assert tenant is not None and tenant.id == created["tenant_id"]
