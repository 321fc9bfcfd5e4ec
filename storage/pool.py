"""The asyncpg connection pool: JSON codecs on every connection, connection errors made readable.

JSON and JSONB columns take and return plain Python values (dicts, lists, msgspec Structs on the
way in) through msgspec, in binary format, so no caller ever handles JSON text.
"""

from __future__ import annotations

import re
from typing import Any, NoReturn

import asyncpg
import msgspec

from storage.errors import StorageError, StorageUnavailable, describe_url

_decode = msgspec.json.decode
# a JSON \u0000 escape, not an escaped backslash followed by "u0000"
_NUL_ESCAPE = re.compile(rb"(?<!\\)((?:\\\\)*)\\u0000")


def storable_text(value: Any) -> Any:
    """`value` as Postgres can store it in a TEXT column: NUL characters (which it refuses) and
    lone surrogates (which UTF-8 cannot carry) become U+FFFD and '?'. Anything not a str as is.

    Model output and tool results reach the database unchecked; one such character in one
    session's rows would otherwise fail the flush of every session of its host (group commit)."""
    if not isinstance(value, str) or value.isascii() and "\x00" not in value:
        return value
    return value.replace("\x00", "\ufffd").encode("utf-8", "replace").decode("utf-8")


def _scrub(value: Any) -> Any:
    if isinstance(value, str):
        return storable_text(value)
    if isinstance(value, dict):
        return {storable_text(k): _scrub(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_scrub(v) for v in value]
    return value


def encode_json(value: Any) -> bytes:
    """JSON that json/jsonb columns accept: as `storable_text` for every string (see there)."""
    try:
        data = msgspec.json.encode(value)
    except UnicodeEncodeError:  # a lone surrogate somewhere: rare, so only then walk the value
        data = msgspec.json.encode(_scrub(msgspec.to_builtins(value)))
    if b"\\u0000" in data:
        data = _NUL_ESCAPE.sub(rb"\1\\ufffd", data)
    return data


_JSONB_VERSION = b"\x01"  # the binary jsonb wire format is a version byte, then JSON text

# everything asyncpg.connect raises for a server that is down, refuses us, or a URL it rejects
_CONNECT_ERRORS = (OSError, TimeoutError, ValueError, asyncpg.PostgresError, asyncpg.InterfaceError)

_HINT = "check DATABASE_URL or unset it to use the embedded Postgres"


def _encode_jsonb(value: Any) -> bytes:
    return _JSONB_VERSION + encode_json(value)


def _decode_jsonb(data: bytes) -> Any:
    return _decode(data[1:])


async def init_connection(conn: asyncpg.Connection) -> None:
    """Install the msgspec JSON/JSONB codecs (used as the pool's `init`; public for one-off
    connections such as LISTEN or the test fixtures)."""
    await conn.set_type_codec(
        "jsonb", schema="pg_catalog", encoder=_encode_jsonb, decoder=_decode_jsonb, format="binary"
    )
    await conn.set_type_codec(
        "json", schema="pg_catalog", encoder=encode_json, decoder=_decode, format="binary"
    )


class Connection(asyncpg.Connection):
    """The engine's connections: a pooled one says when it takes session state.

    asyncpg resets a connection on its way back to the pool with a query (`pg_advisory_unlock_all()`,
    `CLOSE ALL`, `UNLISTEN *`, `RESET ALL`): one more round trip on every release, and a
    `pool.fetchval` returns only after it, so every pooled statement cost two round trips in the
    caller's path (README § Performance). The engine's pooled work takes no session state (no
    `SET`, no session-level lock, no `LISTEN`) except where it says so with `hold_session_state`:
    only such a connection is reset with that query. An open transaction is rolled back on release
    either way (asyncpg does that before the pool's reset).
    """

    took_session_state = False

    def hold_session_state(self) -> None:
        self.took_session_state = True


def hold_session_state(conn: Any) -> None:
    """Say that `conn` takes session state (a LISTEN, a session-level advisory lock, a `SET`): when
    it goes back to its pool, the pool undoes all of it. Call it before taking the state. A
    connection of another class (one opened by `connect` or by a test) is not pooled here, and is
    left alone."""
    mark = getattr(conn, "hold_session_state", None)
    if mark is not None:
        mark()


async def _reset_on_release(conn: Connection) -> None:
    """The pool's `reset`: the full reset query only for a connection that took session state."""
    if conn.took_session_state:
        query = conn.get_reset_query()  # empty for a server without these features
        if query:
            await conn.execute(query)
        conn.took_session_state = False


async def connect(url: str, *, timeout: float = 10.0) -> asyncpg.Connection:
    """One connection with the JSON codecs; raises StorageUnavailable/StorageError like create_pool."""
    try:
        conn = await asyncpg.connect(url, timeout=timeout)
    except _CONNECT_ERRORS as exc:
        _raise_connect_error(url, exc)
    await init_connection(conn)
    return conn


async def create_pool(
    url: str, *, min_size: int = 1, max_size: int = 10, timeout: float = 10.0
) -> asyncpg.Pool:
    """Open a pool to `url` with the JSON codecs installed on every connection. A released
    connection is reset only if it took session state (see `Connection`).

    Raises StorageUnavailable when Postgres cannot be reached (retryable) and StorageError when
    it refuses us (bad credentials, unknown database); messages name host, port and database,
    never the password.
    """
    try:
        pool = await asyncpg.create_pool(
            url, min_size=min_size, max_size=max_size, init=init_connection, timeout=timeout,
            connection_class=Connection, reset=_reset_on_release,
        )
    except _CONNECT_ERRORS as exc:
        _raise_connect_error(url, exc)
    assert pool is not None
    return pool


def _raise_connect_error(url: str, exc: BaseException) -> NoReturn:
    where = describe_url(url)
    if isinstance(exc, asyncpg.InvalidPasswordError):
        raise StorageError(
            f"postgres at {where} rejected the password; {_HINT}"
        ) from None
    if isinstance(exc, asyncpg.InvalidAuthorizationSpecificationError):
        raise StorageError(
            f"postgres at {where} rejected the user ({exc.sqlstate}); {_HINT}"
        ) from None
    if isinstance(exc, asyncpg.InvalidCatalogNameError):
        raise StorageError(
            f"postgres at {where}: the database does not exist; create it or {_HINT}"
        ) from None
    if isinstance(exc, ConnectionRefusedError):
        reason = "connection refused"
    elif isinstance(exc, FileNotFoundError):
        reason = "no server socket there"
    elif isinstance(exc, TimeoutError):
        reason = "timed out"
    elif isinstance(exc, OSError):
        reason = exc.strerror or type(exc).__name__
    elif isinstance(exc, (asyncpg.CannotConnectNowError, asyncpg.TooManyConnectionsError)):
        reason = f"server not accepting connections: {exc.sqlstate}"
    elif isinstance(exc, ValueError):
        # asyncpg's URL parser (ClientConfigurationError); its message may echo the URL
        raise StorageError(f"DATABASE_URL is malformed ({where}); {_HINT}") from None
    elif isinstance(exc, (asyncpg.PostgresConnectionError, asyncpg.InterfaceError)):
        reason = type(exc).__name__
    else:
        raise StorageError(
            f"postgres at {where} refused the connection ({type(exc).__name__}); {_HINT}"
        ) from None
    # `from None`: the chained exception may carry the DSN with its password
    raise StorageUnavailable(f"cannot connect to Postgres at {where} ({reason}); {_HINT}") from None
