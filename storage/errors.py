"""Storage errors, and the one place asyncpg's exceptions are translated into them.

Callers above `storage/` never see an asyncpg exception: a dependency that is down becomes
`StorageUnavailable` (retryable), a duplicate becomes `kernel.errors.Conflict`, a missing row
`kernel.errors.NotFound`, and anything else a plain `StorageError` naming what was being done.
Messages never contain a password or a row's contents.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import parse_qs, urlsplit

import asyncpg

from kernel.errors import ChatEngineError, Conflict


class StorageError(ChatEngineError):
    """Root of the storage package's errors; `retryable` says whether trying again may help."""

    retryable: bool = False


class StorageUnavailable(StorageError):
    """Postgres cannot be reached or dropped the connection; retry with backoff."""

    retryable = True


class EmbeddedPostgresError(StorageError):
    """The embedded Postgres (pgserver) is missing, broken or failed to start."""


class MigrationError(StorageError):
    """A migration failed or an applied migration no longer matches its file."""

    def __init__(self, message: str, *, version: int | None = None) -> None:
        super().__init__(message)
        self.version = version


class StaleEpoch(StorageError):
    """A write carried the epoch of a lease that a newer activation has replaced (fencing).

    The session's owner lost its lease: it must drop the session from memory without writing.
    """

    def __init__(self, message: str, *, tenant_id: str, session_id: str, epoch: int) -> None:
        super().__init__(message)
        self.tenant_id = tenant_id
        self.session_id = session_id
        self.epoch = epoch


#: The same condition seen from the owner's side: its lease on the session is gone.
LeaseLost = StaleEpoch


def describe_url(url: str) -> str:
    """`host:port/dbname` (or `socket dir/dbname`) of a Postgres URL, never user or password."""
    try:
        parts = urlsplit(url)
        db = parts.path.lstrip("/") or "postgres"
        host = parts.hostname
        if not host:
            sock = parse_qs(parts.query).get("host", [""])[0]
            return f"unix socket {sock or '(default)'}/{db}"
        return f"{host}:{parts.port or 5432}/{db}"
    except ValueError:
        return "(unparseable DATABASE_URL)"


# SQLSTATE class 08 (connection exception), 53 (insufficient resources), 57P0x (shutdown).
_UNAVAILABLE = (
    asyncpg.PostgresConnectionError,
    asyncpg.InsufficientResourcesError,
    asyncpg.CannotConnectNowError,
    asyncpg.AdminShutdownError,
    asyncpg.CrashShutdownError,
    asyncpg.ConnectionDoesNotExistError,
    OSError,
    TimeoutError,
)


@contextmanager
def translate(doing: str, *, conflict: str | None = None) -> Iterator[None]:
    """Map asyncpg/OS errors raised inside the block to storage errors.

    `doing` completes "postgres failed while ...". A unique violation becomes `Conflict(conflict)`
    when `conflict` is given. Errors of this package and kernel.errors pass through untouched.
    """
    try:
        yield
    except ChatEngineError:
        raise
    except asyncpg.UniqueViolationError as exc:
        if conflict is not None:
            raise Conflict(conflict) from exc
        raise StorageError(f"postgres refused a duplicate while {doing} ({exc.constraint_name})") from exc
    except asyncpg.SerializationError as exc:
        raise StorageUnavailable(f"postgres aborted a transaction while {doing} (serialization); retry") from exc
    except asyncpg.DeadlockDetectedError as exc:
        raise StorageUnavailable(f"postgres detected a deadlock while {doing}; retry") from exc
    except _UNAVAILABLE as exc:
        raise StorageUnavailable(
            f"postgres became unreachable while {doing} ({type(exc).__name__}); "
            "the operation can be retried once it is back"
        ) from exc
    except asyncpg.PostgresError as exc:
        raise StorageError(
            f"postgres failed while {doing}: {exc.sqlstate} {type(exc).__name__}"
        ) from exc
    except asyncpg.InterfaceError as exc:
        if _caused_by_lost_connection(exc):
            # e.g. "cannot call Transaction.__aexit__(): the underlying connection is closed",
            # raised while unwinding from the connection loss itself
            raise StorageUnavailable(
                f"postgres became unreachable while {doing}; "
                "the operation can be retried once it is back"
            ) from exc
        # misuse of the driver (a closed pool, concurrent use of one connection): not retryable
        raise StorageError(f"the postgres client was misused while {doing}: {exc}") from exc


def _caused_by_lost_connection(exc: BaseException) -> bool:
    seen: set[int] = set()
    cur: BaseException | None = exc.__cause__ or exc.__context__
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, _UNAVAILABLE):
            return True
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return False
