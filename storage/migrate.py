"""Schema migrations: the numbered SQL files in storage/migrations, applied in order, once.

Each file runs in its own transaction together with its row in `ce_schema_migrations`, so a
failed migration leaves nothing behind. A session-level advisory lock serialises concurrent
migrators (two processes starting at once): the second waits, then finds nothing to apply.
A file changed after it was applied is an error, not silently skipped: add a new file instead.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import asyncpg
import msgspec

from storage.errors import MigrationError, translate
from storage.pool import hold_session_state

MIGRATIONS_DIR = Path(__file__).parent / "migrations"

#: pg_advisory_lock key shared by every migrator of this schema ("ce-migrate", as an int64).
ADVISORY_LOCK_KEY = 0x63652D6D69677261

_FILE_RE = re.compile(r"^(\d{3,})_([a-z0-9_]+)\.sql\Z")

_CREATE_TABLE = """
CREATE TABLE IF NOT EXISTS ce_schema_migrations (
  version    INTEGER PRIMARY KEY,
  name       TEXT NOT NULL,
  applied_at TIMESTAMPTZ NOT NULL DEFAULT now(),
  checksum   TEXT NOT NULL
)
"""


class Migration(msgspec.Struct, frozen=True, kw_only=True):
    version: int
    name: str  # the file name without number and suffix
    sql: str
    checksum: str  # sha256 hex of the file's bytes

    @property
    def label(self) -> str:
        return f"{self.version:03d}_{self.name}"


def load_migrations(directory: Path = MIGRATIONS_DIR) -> list[Migration]:
    """The migration files of `directory`, ordered by version.

    Raises MigrationError for a misnamed .sql file or two files with one version number.
    """
    found: dict[int, Migration] = {}
    for path in sorted(directory.glob("*.sql")):
        match = _FILE_RE.match(path.name)
        if match is None:
            raise MigrationError(
                f"migration file {path.name!r} is misnamed; use NNN_lower_snake_name.sql"
            )
        version = int(match.group(1))
        if version in found:
            raise MigrationError(
                f"migrations {found[version].label}.sql and {path.name} share version {version}; "
                "renumber the newer one",
                version=version,
            )
        data = path.read_bytes()
        found[version] = Migration(
            version=version,
            name=match.group(2),
            sql=data.decode("utf-8"),
            checksum=hashlib.sha256(data).hexdigest(),
        )
    return [found[v] for v in sorted(found)]


async def migrate(
    db: asyncpg.Pool | asyncpg.Connection, *, migrations: list[Migration] | None = None
) -> list[str]:
    """Apply every migration not yet applied; return their labels (`001_seed000_tool_registry`).

    Idempotent: a second run returns []. Raises MigrationError when a migration fails (naming
    it and the Postgres error) or when an applied file has changed since; StorageUnavailable
    when Postgres cannot be reached.
    """
    pending_all = load_migrations() if migrations is None else migrations
    if isinstance(db, asyncpg.Pool):
        with translate("acquiring a connection to migrate"):
            async with db.acquire() as conn:
                return await _migrate(conn, pending_all)
    return await _migrate(db, pending_all)


async def _migrate(conn: asyncpg.Connection, migrations: list[Migration]) -> list[str]:
    hold_session_state(conn)  # the session-level migration lock
    with translate("taking the migration lock"):
        await conn.execute("SELECT pg_advisory_lock($1)", ADVISORY_LOCK_KEY)
    try:
        with translate("reading ce_schema_migrations"):
            await conn.execute(_CREATE_TABLE)
            rows = await conn.fetch("SELECT version, name, checksum FROM ce_schema_migrations")
        applied = {r["version"]: r for r in rows}
        done: list[str] = []
        for m in migrations:
            row = applied.get(m.version)
            if row is not None:
                if row["checksum"] != m.checksum:
                    raise MigrationError(
                        f"migration {m.label}.sql changed after it was applied (checksum "
                        f"{row['checksum'][:12]}… in the database, {m.checksum[:12]}… on disk); "
                        "restore the file and put the change in a new migration",
                        version=m.version,
                    )
                continue
            await _apply(conn, m)
            done.append(m.label)
        return done
    finally:
        with translate("releasing the migration lock"):
            if not conn.is_closed():
                await conn.execute("SELECT pg_advisory_unlock($1)", ADVISORY_LOCK_KEY)


async def _apply(conn: asyncpg.Connection, m: Migration) -> None:
    with translate(f"applying migration {m.label}"):  # a lost connection: StorageUnavailable
        try:
            async with conn.transaction():
                await conn.execute(m.sql)  # no arguments: simple protocol, many statements allowed
                await conn.execute(
                    "INSERT INTO ce_schema_migrations (version, name, checksum) VALUES ($1, $2, $3)",
                    m.version, m.name, m.checksum,
                )
        except _UNREACHABLE:
            raise
        except asyncpg.PostgresError as exc:
            detail = getattr(exc, "message", None) or str(exc)
            raise MigrationError(
                f"migration {m.label}.sql failed ({exc.sqlstate}: {detail}); nothing of it was "
                "applied — fix the file (it was never recorded) and run migrate again",
                version=m.version,
            ) from exc


_UNREACHABLE = (
    asyncpg.PostgresConnectionError,
    asyncpg.OperatorInterventionError,
    asyncpg.InsufficientResourcesError,
)
