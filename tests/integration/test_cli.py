"""The CLI as an operator meets it: bad configuration ends in one sentence, not a traceback."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.support.cli import CLI, run_cli


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


async def test_tenant_create_beside_a_running_stack_leaves_its_embedded_postgres_running(pg_server, pg_url):
    # `make run` serving, an operator adds a tenant with the same data directory: the command
    # attaches to the stack's Postgres and must not stop it on its way out
    import asyncio
    import json

    import asyncpg

    if pg_server is None:
        pytest.skip("TEST_DATABASE_URL: no embedded server in this run")
    result = await asyncio.to_thread(run_cli, "tenant", "create", "beside-run", env={"CE_DATA_DIR": str(pg_server.data_dir)})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["name"] == "beside-run"
    conn = await asyncpg.connect(pg_url, timeout=5)  # still serving
    try:
        assert await conn.fetchval("SELECT 1") == 1
    finally:
        await conn.close()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("command", ["contract", "chat"])
def test_a_gateway_that_cannot_be_reached_is_one_sentence_saying_where_it_looked(command):
    url = f"http://127.0.0.1:{_free_port()}"
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("CE_", "DATABASE_URL"))}
    result = subprocess.run([*CLI, command, "--url", url, "--key", "ce_x"], env=full_env, input="hi\n",
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"cannot reach the gateway at {url}" in result.stderr and "make run" in result.stderr


async def test_a_contract_the_gateway_refuses_exits_non_zero_with_its_detail():
    import asyncio

    from aiohttp import web

    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"type": "about:blank", "title": "Unauthorized", "status": 401,
                                  "detail": "this API key is unknown or revoked"}, status=401)

    app = web.Application()
    app.router.add_get("/v1/tools/contract", refuse)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        result = await asyncio.to_thread(run_cli, "contract", "--url", url, "--key", "ce_wrong", env={})
    finally:
        await runner.cleanup()
    assert result.returncode == 2, result.stdout
    assert "answered 401: this API key is unknown or revoked" in result.stderr
