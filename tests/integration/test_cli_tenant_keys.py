"""`chat-engine tenant keys | add-key | revoke-key` as an operator meets them: a real Postgres, the
CLI run as a subprocess, the keys checked through the real TenantRepo."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from storage.pool import create_pool
from storage.repos import TenantRepo
from tests.support.cli import run_cli

STAMP = r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z"


async def cli(url: str, *args: str):
    return await asyncio.to_thread(run_cli, "tenant", *args, env={"DATABASE_URL": url})


@pytest_asyncio.fixture
async def db(fresh_db) -> AsyncIterator[tuple[str, TenantRepo]]:
    url = await fresh_db()
    pool = await create_pool(url, max_size=2)
    try:
        yield url, TenantRepo(pool)
    finally:
        await pool.close()


async def created(url: str, name: str) -> dict:
    result = await cli(url, "create", name)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def key_rows(stdout: str) -> dict[str, tuple[str, str]]:
    """`tenant keys` output as {key_id: (created, revoked-or-active)}; checks the header and
    that each key's kind is shown."""
    lines = stdout.splitlines()
    assert lines[0].split() == ["key_id", "kind", "created_at", "revoked_at"], stdout
    rows = {}
    for line in lines[1:]:
        key_id, kind, created_at, status = line.split()
        assert kind in ("admin", "chat"), line
        assert re.fullmatch(STAMP, created_at) and (
            status == "active" or re.fullmatch(STAMP, status)
        ), line
        rows[key_id] = (created_at, status)
    return rows


async def test_add_key_prints_a_second_working_key_once_and_keys_lists_both_without_secrets(db):
    url, repo = db
    first = await created(url, "rotating")
    result = await cli(url, "add-key", "rotating")
    assert result.returncode == 0, result.stderr
    second = json.loads(result.stdout)
    assert set(second) == {"tenant_id", "name", "key_id", "api_key", "kind"} and second["kind"] == "admin"
    assert second["tenant_id"] == first["tenant_id"] and second["name"] == "rotating"
    assert second["api_key"].startswith("ce_") and second["api_key"] != first["api_key"]
    assert "shown only this once" in result.stderr
    for key in (first["api_key"], second["api_key"]):  # both keys work: rotation without downtime
        tenant = await repo.tenant_for_key(key)
        assert tenant is not None and tenant.id == first["tenant_id"]

    listed = await cli(url, "keys", "rotating")
    assert listed.returncode == 0, listed.stderr
    rows = key_rows(listed.stdout)
    assert second["key_id"] in rows and len(rows) == 2
    assert all(status == "active" for _, status in rows.values())
    for key in (first["api_key"], second["api_key"]):  # never a key nor its hash
        assert key not in listed.stdout + listed.stderr
        assert hashlib.sha256(key.encode()).hexdigest() not in listed.stdout + listed.stderr


async def test_revoke_key_refuses_that_key_only_and_keys_shows_when(db):
    url, repo = db
    first = await created(url, "revoking")
    second = json.loads((await cli(url, "add-key", "revoking")).stdout)
    first_id = next(
        k.key_id for k in await repo.list_keys(first["tenant_id"]) if k.key_id != second["key_id"]
    )

    result = await cli(url, "revoke-key", "revoking", first_id)
    assert result.returncode == 0, result.stderr
    done = json.loads(result.stdout)
    assert done["key_id"] == first_id and done["tenant_id"] == first["tenant_id"]
    assert re.fullmatch(STAMP, done["revoked_at"])
    assert await repo.tenant_for_key(first["api_key"]) is None
    assert (await repo.tenant_for_key(second["api_key"])).id == first["tenant_id"]

    rows = key_rows((await cli(url, "keys", "revoking")).stdout)
    assert rows[first_id][1] == done["revoked_at"] and rows[second["key_id"]][1] == "active"


async def test_revoking_the_last_active_key_warns_that_the_tenant_is_locked_out(db):
    url, repo = db
    only = await created(url, "lonely")
    (key,) = await repo.list_keys(only["tenant_id"])
    result = await cli(url, "revoke-key", "lonely", key.key_id)
    assert result.returncode == 0, result.stderr
    assert (
        "no active key left" in result.stderr
        and "chat-engine tenant add-key lonely" in result.stderr
    )


@pytest.mark.parametrize(
    "case", ["unknown tenant", "unknown key id", "key of another tenant", "already revoked"]
)
async def test_revoke_key_errors_say_what_is_wrong_and_what_to_do(db, case):
    url, repo = db
    mine = await created(url, "mine")
    theirs = await created(url, "theirs")
    (my_key,) = await repo.list_keys(mine["tenant_id"])
    (their_key,) = await repo.list_keys(theirs["tenant_id"])
    if case == "already revoked":
        await repo.revoke_key(mine["tenant_id"], my_key.key_id)
    tenant, key_id, says = {
        "unknown tenant": ("nobody", my_key.key_id, "there is no tenant named 'nobody'"),
        "unknown key id": (
            "mine",
            "key_0000000000000000",
            (
                "tenant 'mine' has no api key 'key_0000000000000000'; "
                "run 'chat-engine tenant keys mine' to see its key ids"
            ),
        ),
        "key of another tenant": (
            "mine",
            their_key.key_id,
            f"api key '{their_key.key_id}' belongs to another tenant, not 'mine'",
        ),
        "already revoked": (
            "mine",
            my_key.key_id,
            f"api key '{my_key.key_id}' of tenant 'mine' was already revoked at",
        ),
    }[case]
    result = await cli(url, "revoke-key", tenant, key_id)
    assert result.returncode == 2 and result.stdout == "", result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("chat-engine: ") and says in lines[0], lines[0]
    # nothing else was revoked on the way
    assert (await repo.tenant_for_key(theirs["api_key"])).id == theirs["tenant_id"]
    if case != "already revoked":
        assert (await repo.tenant_for_key(mine["api_key"])).id == mine["tenant_id"]


@pytest.mark.parametrize("command", [("keys", "nobody"), ("add-key", "nobody")])
async def test_keys_and_add_key_of_an_unknown_tenant_fail_naming_it(db, command):
    url, _repo = db
    result = await cli(url, *command)
    assert result.returncode == 2 and result.stdout == ""
    assert (
        "there is no tenant named 'nobody'" in result.stderr
        and "chat-engine tenant create" in result.stderr
    )


async def test_tenant_keys_beside_a_running_stack_leaves_its_embedded_postgres_running(
    pg_server, pg_url
):
    import asyncpg

    if pg_server is None:
        pytest.skip("TEST_DATABASE_URL: no embedded server in this run")
    env = {"CE_DATA_DIR": str(pg_server.data_dir)}
    made = await asyncio.to_thread(run_cli, "tenant", "create", "beside-run-keys", env=env)
    assert made.returncode == 0, made.stderr
    result = await asyncio.to_thread(run_cli, "tenant", "keys", "beside-run-keys", env=env)
    assert result.returncode == 0, result.stderr
    assert len(key_rows(result.stdout)) == 1
    conn = await asyncpg.connect(pg_url, timeout=5)  # still serving
    try:
        assert await conn.fetchval("SELECT 1") == 1
    finally:
        await conn.close()


async def test_keys_of_a_tenant_with_no_key_rows_prints_the_header_and_says_what_to_do(db):
    # a tenant whose key rows were deleted by hand (or never written): before, a TypeError
    url, _repo = db
    first = await created(url, "keyless")
    pool = await create_pool(url, max_size=1)
    try:
        await pool.execute("DELETE FROM ce_api_keys WHERE tenant_id = $1", first["tenant_id"])
    finally:
        await pool.close()
    listed = await cli(url, "keys", "keyless")
    assert listed.returncode == 0, listed.stderr
    assert key_rows(listed.stdout) == {}
    assert "has no active key: make one with 'chat-engine tenant add-key keyless'" in listed.stderr


async def test_add_key_kind_chat_makes_a_chat_key_and_keys_shows_each_keys_kind(db):
    url, repo = db
    first = await created(url, "with-chat")
    result = await cli(url, "add-key", "with-chat", "--kind", "chat")
    assert result.returncode == 0, result.stderr
    chat = json.loads(result.stdout)
    assert chat["kind"] == "chat" and chat["tenant_id"] == first["tenant_id"]
    holder = await repo.key_holder(chat["api_key"])
    assert holder is not None and holder.kind == "chat" and holder.tenant.id == first["tenant_id"]
    assert (await repo.key_holder(first["api_key"])).kind == "admin"  # the first key, as every older one
    listed = await cli(url, "keys", "with-chat")
    kinds = {line.split()[0]: line.split()[1] for line in listed.stdout.splitlines()[1:]}
    assert kinds == {first_key_id(listed.stdout, chat["key_id"]): "admin", chat["key_id"]: "chat"}
    bad = await cli(url, "add-key", "with-chat", "--kind", "owner")
    assert bad.returncode == 2 and "invalid choice: 'owner'" in bad.stderr


def first_key_id(stdout: str, other: str) -> str:
    return next(line.split()[0] for line in stdout.splitlines()[1:] if line.split()[0] != other)
