"""Migrations against a real Postgres: order, idempotence, concurrency, seed-000 fidelity, failures."""

from __future__ import annotations

import asyncio
import hashlib
from datetime import datetime

import asyncpg
import pytest

from storage.errors import MigrationError
from storage.migrate import Migration, load_migrations, migrate
from storage.pool import connect

# Seed 000 § Database, column by column: (name, data_type, nullable, default or None).
SEED_000 = {
    "ce_custom_tools": [
        ("id", "text", False, None),
        ("tenant_id", "text", False, None),
        ("name", "text", False, None),
        ("description", "text", False, None),
        ("parameters", "jsonb", False, None),
        ("webhook_url", "text", False, None),
        ("auth_header", "text", True, None),
        ("timeout_ms", "integer", True, "5000"),
        ("enabled", "boolean", True, "true"),
        ("created_at", "timestamp with time zone", True, "now()"),
    ],
    "ce_tool_calls": [
        ("id", "text", False, None),
        ("session_id", "text", False, None),
        ("tenant_id", "text", False, None),
        ("message_id", "text", True, None),
        ("tool_name", "text", False, None),
        ("parameters", "jsonb", True, None),
        ("result", "jsonb", True, None),
        ("success", "boolean", False, None),
        ("latency_ms", "integer", True, None),
        ("error", "text", True, None),
        ("created_at", "timestamp with time zone", True, "now()"),
    ],
    "ce_session_variables": [
        ("id", "text", False, None),
        ("session_id", "text", False, None),
        ("tenant_id", "text", False, None),
        ("key", "text", False, None),
        ("value", "text", False, None),
        ("created_at", "timestamp with time zone", True, "now()"),
    ],
}
SEED_000_KEYS = {  # (constraint type, columns)
    "ce_custom_tools": {("p", ("id",)), ("u", ("tenant_id", "name"))},
    "ce_tool_calls": {("p", ("id",))},
    "ce_session_variables": {("p", ("id",)), ("u", ("session_id", "key"))},
}

SCHEMA_SQL = """
SELECT 'col' AS what, table_name || '.' || column_name || ' ' || data_type || ' '
       || is_nullable || ' ' || coalesce(column_default, '-') AS item
FROM information_schema.columns WHERE table_schema = 'public'
UNION ALL
SELECT 'con', conrelid::regclass::text || ' ' || pg_get_constraintdef(oid)
FROM pg_constraint WHERE connamespace = 'public'::regnamespace
UNION ALL
SELECT 'idx', indexdef FROM pg_indexes WHERE schemaname = 'public'
ORDER BY 1, 2
"""


async def schema_of(conn: asyncpg.Connection) -> list[tuple[str, str]]:
    return [(r["what"], r["item"]) for r in await conn.fetch(SCHEMA_SQL)]


@pytest.fixture
async def empty_db(fresh_db):
    conn = await connect(await fresh_db(migrated=False))
    yield conn
    await conn.close()


async def test_migrate_applies_every_file_in_order_then_nothing(empty_db):
    files = load_migrations()
    assert [m.version for m in files] == sorted(m.version for m in files)

    first = await migrate(empty_db)
    assert first == [m.label for m in files]
    assert first[0] == "001_seed000_tool_registry"
    before = await schema_of(empty_db)

    assert await migrate(empty_db) == []
    assert await schema_of(empty_db) == before
    rows = await empty_db.fetch("SELECT version, name, checksum FROM ce_schema_migrations ORDER BY version")
    assert [(r["version"], r["name"], r["checksum"]) for r in rows] == [
        (m.version, m.name, m.checksum) for m in files
    ]


async def test_two_migrators_at_once_apply_each_file_exactly_once(fresh_db):
    url = await fresh_db(migrated=False)
    a, b = await connect(url), await connect(url)
    try:
        ra, rb = await asyncio.gather(migrate(a), migrate(b))
    finally:
        await a.close()
        await b.close()
    assert sorted(ra + rb) == [m.label for m in load_migrations()]
    assert not (set(ra) & set(rb))


@pytest.mark.parametrize("table", sorted(SEED_000))
async def test_seed_000_table_is_exactly_as_written(pool, table):
    rows = await pool.fetch(
        "SELECT column_name, data_type, is_nullable = 'YES' AS nullable, column_default "
        "FROM information_schema.columns WHERE table_schema = 'public' AND table_name = $1",
        table,
    )
    actual = {r["column_name"]: (r["data_type"], r["nullable"], r["column_default"]) for r in rows}
    for name, data_type, nullable, default in SEED_000[table]:
        assert name in actual, f"{table}.{name} is missing"
        assert actual[name] == (data_type, nullable, default), f"{table}.{name}"

    keys = await pool.fetch(
        "SELECT c.contype::text AS type, array_agg(a.attname::text ORDER BY k.ord) AS cols "
        "FROM pg_constraint c "
        "CROSS JOIN LATERAL unnest(c.conkey) WITH ORDINALITY AS k(attnum, ord) "
        "JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = k.attnum "
        "WHERE c.conrelid = $1::regclass AND c.contype IN ('p', 'u') GROUP BY c.oid, c.contype",
        table,
    )
    assert {(k["type"], tuple(k["cols"])) for k in keys} == SEED_000_KEYS[table]


async def test_later_columns_were_added_not_changed(pool):
    rows = await pool.fetch(
        "SELECT table_name, column_name, data_type, column_default FROM information_schema.columns "
        "WHERE table_schema = 'public' AND (table_name, column_name) IN "
        "(('ce_custom_tools', 'type'), ('ce_custom_tools', 'version'), ('ce_tool_calls', 'queue_ms'))"
    )
    got = {(r["table_name"], r["column_name"]): r["data_type"] for r in rows}
    assert got == {
        ("ce_custom_tools", "type"): "text",
        ("ce_custom_tools", "version"): "integer",
        ("ce_tool_calls", "queue_ms"): "integer",
    }


async def test_every_tenant_table_has_tenant_id_not_null_and_a_leading_index(pool):
    rows = await pool.fetch(
        """
        SELECT c.relname AS table_name, a.attnotnull AS not_null,
               EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indkey[0] = a.attnum)
                 AS leading_index
        FROM pg_class c JOIN pg_attribute a ON a.attrelid = c.oid AND a.attname = 'tenant_id'
        WHERE c.relkind = 'r' AND c.relnamespace = 'public'::regnamespace AND c.relname LIKE 'ce\\_%'
        """
    )
    tables = {r["table_name"]: (r["not_null"], r["leading_index"]) for r in rows}
    assert len(tables) >= 18
    assert {t: v for t, v in tables.items() if v != (True, True)} == {}


async def test_a_changed_applied_migration_is_refused(empty_db):
    one = Migration(version=1, name="one", sql="CREATE TABLE t_one (x int)", checksum="a" * 64)
    assert await migrate(empty_db, migrations=[one]) == ["001_one"]
    edited = Migration(version=1, name="one", sql="CREATE TABLE t_one (y int)", checksum="b" * 64)
    with pytest.raises(MigrationError, match=r"001_one\.sql changed after it was applied"):
        await migrate(empty_db, migrations=[edited])


async def test_a_failing_migration_leaves_nothing_behind(empty_db):
    good = Migration(version=1, name="good", sql="CREATE TABLE t_good (x int)", checksum="1" * 64)
    bad_sql = "CREATE TABLE t_half (x int); SELECT no_such_column FROM t_half"
    bad = Migration(version=2, name="bad", sql=bad_sql, checksum=hashlib.sha256(bad_sql.encode()).hexdigest())
    with pytest.raises(MigrationError, match=r"migration 002_bad\.sql failed \(42703"):
        await migrate(empty_db, migrations=[good, bad])
    assert await empty_db.fetchval("SELECT to_regclass('t_good') IS NOT NULL")
    assert await empty_db.fetchval("SELECT to_regclass('t_half') IS NULL")
    assert await empty_db.fetchval("SELECT array_agg(version) FROM ce_schema_migrations") == [1]
    # the lock was released: a corrected run goes through
    fixed = Migration(version=2, name="bad", sql="SELECT 1", checksum="2" * 64)
    assert await migrate(empty_db, migrations=[good, fixed]) == ["002_bad"]


def test_misnamed_migration_file_is_refused(tmp_path):
    (tmp_path / "001_ok.sql").write_text("SELECT 1")
    (tmp_path / "2_Bad.sql").write_text("SELECT 1")
    with pytest.raises(MigrationError, match=r"'2_Bad\.sql' is misnamed"):
        load_migrations(tmp_path)


async def test_overlapping_appointments_of_one_service_are_impossible(pool):
    insert = (
        "INSERT INTO ce_appointments (tenant_id, service, starts_at, ends_at) "
        "VALUES ($1, $2, $3, $4)"
    )
    t = "appt-tenant"

    def at(hh_mm: str) -> datetime:
        return datetime.fromisoformat(f"2030-01-01T{hh_mm}:00+00:00")

    await pool.execute(insert, t, "cut", at("10:00"), at("10:30"))
    await pool.execute(insert, t, "cut", at("10:30"), at("11:00"))  # back to back is fine
    await pool.execute(insert, t, "color", at("10:00"), at("10:30"))  # another service
    await pool.execute(insert, "other-tenant", "cut", at("10:00"), at("10:30"))  # another tenant
    with pytest.raises(asyncpg.ExclusionViolationError):
        await pool.execute(insert, t, "cut", at("10:15"), at("10:45"))


async def test_memories_are_searchable_in_their_language(pool):
    await pool.execute(
        "INSERT INTO ce_memories (tenant_id, kind, content, language) VALUES "
        "('mem-tenant', 'fact', 'The customer prefers running shoes', 'english'), "
        "('mem-tenant', 'fact', 'Der Kunde mag Laufschuhe', 'german')"
    )
    found = await pool.fetch(
        "SELECT content FROM ce_memories WHERE tenant_id = 'mem-tenant' "
        "AND tsv @@ plainto_tsquery(language, $1)",
        "run",
    )
    assert [r["content"] for r in found] == ["The customer prefers running shoes"]
