"""`chat-engine`: run | serve | scale N | restart-hosts | migrate | tenant ... | chat | contract.

`tenant` is create NAME | keys NAME | add-key NAME [--kind admin|chat] | revoke-key NAME KEY_ID: API keys are shown
once, when made; afterwards only by id and dates. `tenant egress NAME | allow-egress NAME ENTRY
[--port N] | revoke-egress NAME ENTRY [--port N]`: destinations (a CIDR or a host name) that one
tenant's tools may reach despite the SSRF guard, besides CE_WEBHOOK_ALLOW's for every tenant.

The entrypoint reads Settings from the environment once and configures logging once. Bad
configuration ends with one sentence saying what to set or install, and exit status 2.

The commands that use Ray (run, serve, scale, restart-hosts) import it, and the modules that do,
inside the command: `chat-engine chat`, `migrate` and `tenant` start without loading Ray.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from app.chat_client import chat, print_contract
from kernel.errors import ChatEngineError, Conflict, NotFound
from kernel.records import KEY_KINDS, KeyKind
from services import heap
from services.gateway.common import KEY_CACHE_TTL_S
from services.gateway.server import check_listen_address, open_gateway
from services.heap import tune_collector
from services.logging import configure_logging
from services.settings import Settings
from services.tools.ssrf import parse_allow_entry
from storage.embedded import start_embedded
from storage.migrate import migrate
from storage.pool import create_pool
from storage.repos import TenantRepo
from storage.repos.egress import EgressRepo

if TYPE_CHECKING:
    from kernel.records import Tenant


#: the long-running commands: they log on stdout; every other command logs on stderr
SERVERS = ("run", "serve")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="chat-engine", description="multi-tenant chat engine")
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="everything on embedded defaults (Postgres, Ray, local model, demo)")
    p_run.add_argument("--port", type=int, default=None)
    sub.add_parser("serve", help="the gateway only, against DATABASE_URL and RAY_ADDRESS")
    p_scale = sub.add_parser(
        "scale", help="change the number of session hosts of a running cluster (RAY_ADDRESS, DATABASE_URL)"
    )
    p_scale.add_argument("shards", type=int, help="the new number of session hosts (>= 1)")
    sub.add_parser(
        "restart-hosts", help="re-create the session hosts one at a time with this environment's settings"
    )
    sub.add_parser("migrate", help="apply database migrations")
    p_tenant = sub.add_parser("tenant", help="tenant administration")
    tsub = p_tenant.add_subparsers(dest="tenant_command", required=True)
    p_create = tsub.add_parser("create", help="create a tenant and print its API key once")
    p_create.add_argument("name")
    p_keys = tsub.add_parser("keys", help="list a tenant's API keys: ids and dates, never the keys")
    p_keys.add_argument("name", help="the tenant's name")
    p_add_key = tsub.add_parser("add-key", help="make another API key for a tenant and print it once")
    p_add_key.add_argument("name", help="the tenant's name")
    p_add_key.add_argument("--kind", choices=KEY_KINDS, default="admin",
                           help="admin: every route (default); chat: only what a contact's web page needs "
                                "(messages, approvals, the session's view and events), safe to embed")
    p_revoke = tsub.add_parser("revoke-key", help="revoke one of a tenant's API keys (ids: 'tenant keys NAME')")
    p_revoke.add_argument("name", help="the tenant's name")
    p_revoke.add_argument("key_id", help="the key's id, as 'chat-engine tenant keys NAME' lists it")
    p_egress = tsub.add_parser("egress", help="list the destinations a tenant's tools may reach despite the SSRF guard")
    p_egress.add_argument("name", help="the tenant's name")
    allow_help = ("let a tenant's webhook tools and backend bindings reach a destination the SSRF guard refuses "
                  "(a private range of its own backend, say)")
    for verb, what in (("allow-egress", allow_help), ("revoke-egress", "take an egress allowance away from a tenant")):
        p_allow = tsub.add_parser(verb, help=what)
        p_allow.add_argument("name", help="the tenant's name")
        p_allow.add_argument("entry", help="a CIDR (10.20.0.0/16, 10.20.0.5) or a host name (erp.internal)")
        p_allow.add_argument("--port", type=_port, default=0, help="only this port (default: any port)")
    p_chat = sub.add_parser("chat", help="interactive terminal client of the gateway")
    p_chat.add_argument("--session", default=None)
    p_chat.add_argument("--url", default=None, help="gateway URL (default: CE_URL from .data/demo.env)")
    p_chat.add_argument("--key", default=None, help="tenant API key (default: CE_API_KEY from .data/demo.env)")
    p_contract = sub.add_parser("contract", help="print the tool-contract report of a tenant")
    p_contract.add_argument("--url", default=None)
    p_contract.add_argument("--key", default=None)
    args = parser.parse_args(argv)
    try:
        settings = Settings.from_env()
        # servers log on stdout (their collector reads it); a one-shot command's stdout is its
        # report alone (`chat-engine scale 4 | jq`), so its log lines go to stderr
        configure_logging(fmt=settings.log_format, level=settings.log_level,
                          stream=sys.stdout if args.command in SERVERS else sys.stderr)
        if args.command == "run":
            as_server()
            asyncio.run(_run(settings, port=args.port))
        elif args.command == "serve":
            as_server()
            asyncio.run(_serve(settings))
        elif args.command == "scale":
            from app.shards import scale

            _join_cluster(settings)
            report = asyncio.run(scale(settings, args.shards))
            print(msgspec.json.encode(report).decode(), flush=True)
        elif args.command == "restart-hosts":
            from app.shards import restart_hosts

            _join_cluster(settings)
            restarted = asyncio.run(restart_hosts(settings))
            print(msgspec.json.encode({"restarted": restarted}).decode(), flush=True)
        elif args.command == "migrate":
            asyncio.run(_migrate(settings))
        elif args.command == "tenant":
            if args.tenant_command == "create":
                asyncio.run(_tenant_create(settings, args.name))
            elif args.tenant_command == "keys":
                asyncio.run(_tenant_keys(settings, args.name))
            elif args.tenant_command == "add-key":
                asyncio.run(_tenant_add_key(settings, args.name, args.kind))
            elif args.tenant_command == "revoke-key":
                asyncio.run(_tenant_revoke_key(settings, args.name, args.key_id))
            elif args.tenant_command == "egress":
                asyncio.run(_tenant_egress(settings, args.name))
            elif args.tenant_command in ("allow-egress", "revoke-egress"):
                asyncio.run(_tenant_change_egress(settings, args.name, args.entry, args.port,
                                                  allow=args.tenant_command == "allow-egress"))
        elif args.command == "chat":
            url, key = _client_target(settings, args.url, args.key)
            asyncio.run(chat(url, key, args.session or f"cli-{uuid.uuid4().hex[:8]}"))
        elif args.command == "contract":
            url, key = _client_target(settings, args.url, args.key)
            asyncio.run(print_contract(url, key))
    except ChatEngineError as exc:
        print(f"chat-engine: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        pass


def _join_cluster(settings: Settings) -> None:
    """Join RAY_ADDRESS before an operator command uses it (app.shards connects again: a
    no-op then), so that an unreachable cluster is one sentence (ConfigError), not Ray's traceback
    minutes later. Without RAY_ADDRESS the command itself says to set it."""
    if settings.ray_address:
        # here, not at the top: only the commands that use Ray import it (module docstring)
        from actors.cluster import connect_ray

        connect_ray(settings)


def as_server() -> None:
    """Set this process up as a long-running server: the collector's settings (services.heap), uvloop.
    Once it serves, `heap.settle()` freezes what start-up built."""
    tune_collector()
    try:
        import uvloop
    except ImportError:  # pragma: no cover - optional speed-up
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def _client_target(settings: Settings, url: str | None, key: str | None) -> tuple[str, str]:
    env_file = Path(settings.data_dir) / "demo.env"
    values: dict[str, str] = {}
    if env_file.exists():
        for line in env_file.read_text().splitlines():
            name, _, value = line.partition("=")
            values[name.strip()] = value.strip()
    url = url or values.get("CE_URL") or f"http://{settings.host}:{settings.port}"
    key = key or values.get("CE_API_KEY")
    if not key:
        raise ChatEngineError("no API key: pass --key, or start 'make run' which writes .data/demo.env")
    return url, key


async def _wait_for_signal() -> asyncio.Event:
    """Wait for Ctrl-C or SIGTERM. Returns an event set by the next one: a second Ctrl-C cuts the
    gateway's drain short (sessions are still flushed, so nothing stored is lost)."""
    stop, again = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()

    def hurry() -> None:
        if not again.is_set():
            print("chat-engine: stopping now: requests still in flight are cut; sessions are still flushed",
                  file=sys.stderr, flush=True)
        again.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, hurry)
    return again


async def _run(settings: Settings, *, port: int | None) -> None:
    from app.stack import Stack

    print("chat-engine: starting (embedded Postgres, local Ray, local model, demo store)...", flush=True)
    stack = await Stack.start(settings, port=port)
    heap.settle()
    hurry = None
    try:
        gw = stack.gateway
        assert gw is not None
        print(f"""
chat-engine is serving on {gw.url}
  demo tenant API key: {stack.demo_key}
  (also in {Path(settings.data_dir) / 'demo.env'})

Try:
  curl -s {gw.url}/v1/sessions/demo-1/messages \\
    -H 'Authorization: Bearer {stack.demo_key}' -H 'Content-Type: application/json' \\
    -d '{{"text": "where is my order 12345?"}}'

or chat in this terminal:  .venv/bin/chat-engine chat
Ctrl-C flushes every session and stops everything.
""", flush=True)
        hurry = await _wait_for_signal()
        print("chat-engine: stopping (requests in flight finish, sessions are flushed; Ctrl-C again to cut "
              "the requests short)...", flush=True)
    finally:
        await stack.stop(hurry=hurry)


async def _serve(settings: Settings) -> None:
    from actors.cluster import connect_ray
    from actors.placement import Placement
    from app.shards import follow_shards

    if not settings.database_url:
        raise ChatEngineError("DATABASE_URL is not set; 'chat-engine serve' needs an existing Postgres "
                              "(or use 'chat-engine run' for the embedded one)")
    check_listen_address(settings.host, settings.port)
    await asyncio.to_thread(connect_ray, settings)
    placement = Placement(settings)
    shards = await follow_shards(settings, placement)  # the stored count, kept current on NOTIFY
    try:
        await placement.start_hosts()

        async def hosts_ready() -> bool:
            return placement.mode == "dedicated" or len(await placement.stats()) >= placement.shards

        gateway = await open_gateway(settings, placement, contract=placement.contract, ready_check=hosts_ready)
        heap.settle()
        print(f"chat-engine gateway on {gateway.url}", flush=True)
        hurry = None
        try:
            hurry = await _wait_for_signal()
        finally:
            await gateway.close(hurry=hurry)
            placement.close_lanes()
    finally:
        if shards is not None:
            await shards.close()


async def _open_pool(settings: Settings):
    if settings.database_url:
        return None, await create_pool(settings.database_url, min_size=1, max_size=2)
    pg = await asyncio.to_thread(start_embedded, Path(settings.data_dir))
    return pg, await create_pool(pg.url, min_size=1, max_size=2)


async def _migrate(settings: Settings) -> None:
    pg, pool = await _open_pool(settings)
    try:
        applied = await migrate(pool)
        print("applied: " + (", ".join(applied) if applied else "nothing (up to date)"))
    finally:
        await pool.close()
        if pg is not None and pg.started:  # never the Postgres of a running `chat-engine run`
            pg.stop()


@asynccontextmanager
async def _tenant_repo(settings: Settings) -> AsyncIterator[TenantRepo]:
    """A TenantRepo on a migrated database (DATABASE_URL, else the embedded Postgres under
    CE_DATA_DIR), closed on the way out."""
    async with _migrated_pool(settings) as pool:
        yield TenantRepo(pool)


@asynccontextmanager
async def _migrated_pool(settings: Settings) -> AsyncIterator[Any]:
    """A pool on a migrated database (DATABASE_URL, else the embedded Postgres under
    CE_DATA_DIR), closed on the way out."""
    pg, pool = await _open_pool(settings)
    try:
        await migrate(pool)
        yield pool
    finally:
        await pool.close()
        if pg is not None and pg.started:  # never the Postgres of a running `chat-engine run`
            pg.stop()


async def _tenant_create(settings: Settings, name: str) -> None:
    async with _tenant_repo(settings) as tenants:
        tenant, key = await tenants.create_tenant(name)
        print(msgspec.json.encode({"tenant_id": tenant.id, "name": tenant.name, "api_key": key.api_key}).decode())
        print("keep the api_key: it is shown only this once", file=sys.stderr)


def _stamp(moment: datetime) -> str:
    """A timestamp as the key commands print it: UTC to the second, one fixed-width word."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


async def _tenant_named(tenants: TenantRepo, name: str) -> Tenant:
    """The tenant called `name` (stripped, as `tenant create` stores it). Raises NotFound."""
    name = name.strip()
    tenant = await tenants.get_by_name(name)
    if tenant is None:
        raise NotFound(f"there is no tenant named {name!r}; check the name (it is case-sensitive) or "
                       f"create the tenant with 'chat-engine tenant create NAME'", kind="tenant", key=name)
    return tenant


async def _tenant_keys(settings: Settings, name: str) -> None:
    """Print the tenant's keys, oldest first: id, created, revoked time or `active`."""
    async with _tenant_repo(settings) as tenants:
        tenant = await _tenant_named(tenants, name)
        keys = await tenants.list_keys(tenant.id)
    width = max([len("key_id"), *(len(k.key_id) for k in keys)]) + 2
    lines = [f"{'key_id':<{width}}{'kind':<7}{'created_at':<22}revoked_at"]
    for k in keys:
        revoked = "active" if k.revoked_at is None else _stamp(k.revoked_at)
        lines.append(f"{k.key_id:<{width}}{k.kind:<7}{_stamp(k.created_at):<22}{revoked}")
    print("\n".join(lines))
    if all(k.revoked_at is not None for k in keys):
        print(f"tenant {tenant.name!r} has no active key: make one with 'chat-engine tenant add-key {tenant.name}'",
              file=sys.stderr)


async def _tenant_add_key(settings: Settings, name: str, kind: KeyKind = "admin") -> None:
    """Make another key of `kind` for the tenant (its other keys stay valid) and print it once."""
    async with _tenant_repo(settings) as tenants:
        tenant = await _tenant_named(tenants, name)
        key = await tenants.issue_key(tenant.id, kind)
        print(msgspec.json.encode({"tenant_id": tenant.id, "name": tenant.name, "key_id": key.key_id,
                                   "api_key": key.api_key, "kind": key.kind}).decode())
        print("keep the api_key: it is shown only this once. Once every client uses it, revoke the old key "
              f"with 'chat-engine tenant revoke-key {tenant.name} KEY_ID' (ids: 'chat-engine tenant keys "
              f"{tenant.name}')", file=sys.stderr)


async def _tenant_revoke_key(settings: Settings, name: str, key_id: str) -> None:
    """Revoke one of the tenant's keys. Raises NotFound (no such tenant, no such key, another
    tenant's key) or Conflict (already revoked), each saying what to do."""
    async with _tenant_repo(settings) as tenants:
        tenant = await _tenant_named(tenants, name)
        try:
            revoked_at = await tenants.revoke_key(tenant.id, key_id)
        except NotFound:
            # the tenant-scoped answer is one NotFound; an operator may see every tenant, so say which
            key = await tenants.get_key(key_id)
            if key is None:
                raise NotFound(f"tenant {tenant.name!r} has no api key {key_id!r}; run 'chat-engine tenant keys "
                               f"{tenant.name}' to see its key ids", kind="api_key", key=key_id) from None
            if key.tenant_id != tenant.id:
                raise NotFound(f"api key {key_id!r} belongs to another tenant, not {tenant.name!r}; nothing was "
                               f"revoked. Check the id with 'chat-engine tenant keys {tenant.name}'",
                               kind="api_key", key=key_id) from None
            if key.revoked_at is not None:
                raise Conflict(f"api key {key_id!r} of tenant {tenant.name!r} was already revoked at "
                               f"{_stamp(key.revoked_at)}; nothing to do") from None
            raise
        live = [k for k in await tenants.list_keys(tenant.id) if k.revoked_at is None]
    print(msgspec.json.encode({"tenant_id": tenant.id, "name": tenant.name, "key_id": key_id,
                               "revoked_at": _stamp(revoked_at)}).decode())
    print(f"revoked: gateways refuse this key within {KEY_CACHE_TTL_S:g} s (their key cache)", file=sys.stderr)
    if not live:
        print(f"tenant {tenant.name!r} has no active key left: its clients are locked out until you run "
              f"'chat-engine tenant add-key {tenant.name}'", file=sys.stderr)


def _port(raw: str) -> int:
    try:
        port = int(raw)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"--port must be a whole number from 1 to 65535 (0: any), got {raw!r}")
    return port


async def _tenant_egress(settings: Settings, name: str) -> None:
    """Print the tenant's egress allowances (JSON)."""
    async with _migrated_pool(settings) as pool:
        tenant = await _tenant_named(TenantRepo(pool), name)
        held = await EgressRepo(pool).list(tenant.id)
    print(msgspec.json.encode({"tenant_id": tenant.id, "name": tenant.name, "egress": held}).decode())


async def _tenant_change_egress(settings: Settings, name: str, entry: str, port: int, *, allow: bool) -> None:
    """Grant or revoke one egress allowance (`entry` checked and stored in its canonical form).
    Raises ConfigError for an entry that is neither a CIDR nor a host name, NotFound for a
    revoke of one the tenant does not hold."""
    canonical = str(parse_allow_entry(entry.strip(), variable="ENTRY"))
    async with _migrated_pool(settings) as pool:
        tenant = await _tenant_named(TenantRepo(pool), name)
        egress = EgressRepo(pool)
        changed = await (egress.allow if allow else egress.revoke)(tenant.id, canonical, port)
    if not allow and not changed:
        raise NotFound(f"tenant {tenant.name!r} holds no egress allowance {canonical!r}"
                       f"{f' on port {port}' if port else ''}; list them with 'chat-engine tenant egress "
                       f"{tenant.name}'", kind="egress", key=canonical)
    print(msgspec.json.encode({"tenant_id": tenant.id, "name": tenant.name, "entry": canonical, "port": port,
                               "allowed" if allow else "revoked": True, "changed": changed}).decode())
    print("session hosts load the tenant's tools again with it (a catalog change)", file=sys.stderr)


if __name__ == "__main__":  # pragma: no cover
    main()
