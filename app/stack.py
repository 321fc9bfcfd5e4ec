"""`chat-engine run`: the whole product on embedded defaults, started and stopped in one place.

Embedded Postgres under `.data/` (unless DATABASE_URL is set), migrations, the encryption key,
the local model (unless ANTHROPIC_API_KEY is set), the demo store on its own loopback address,
a local Ray (unless RAY_ADDRESS is set), the session hosts, tenant `demo` with example tools,
and the gateway. Tests start this same code path.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from pathlib import Path
from typing import Any

import msgspec
import structlog
import yarl

from actors import cluster
from actors.cluster import connect_ray
from actors.placement import Placement
from app.demo_store import OPENAPI as DEMO_OPENAPI
from app.demo_store import start_demo_store
from app.local_model import start_local_model
from app.shards import follow_shards
from kernel.errors import NotFound
from services import offload
from services.builtins.appointments import service_from_body
from services.builtins.forms import check_form
from services.gateway.bodies import ToolCreate, definition_from_body
from services.gateway.server import Gateway, check_listen_address, open_gateway
from services.settings import Settings
from services.tools.crypto import SecretBox, load_or_create_key
from storage.embedded import start_embedded
from storage.migrate import migrate
from storage.pool import create_pool
from storage.repos import BotConfigRepo, TenantRepo, ToolRepo
from storage.repos.builtins import BuiltinRepos
from storage.repos.tools import ToolChanged

log = structlog.get_logger(__name__)

DEMO_TENANT = "demo"
DEMO_FORM = {
    "type": "object", "required": ["name", "email", "message"], "additionalProperties": False,
    "properties": {"name": {"type": "string", "minLength": 1}, "email": {"type": "string", "minLength": 3},
                   "message": {"type": "string", "minLength": 1, "maxLength": 2000}},
}
DEMO_SERVICE = {"duration_minutes": 30, "timezone": "UTC",
                "opening_hours": {d: ["09:00", "17:00"] for d in ("mon", "tue", "wed", "thu", "fri")}}
DEMO_STORE_HOST = "127.0.0.2"  # its own loopback address, so the allowlist admits it and nothing else
DEMO_STORE_PORT = 8090


class Stack:
    def __init__(self) -> None:
        self.settings: Settings | None = None
        self.pg: Any = None
        self.local_model: Any = None
        self.demo_store: Any = None
        self.placement: Placement | None = None
        self.gateway: Gateway | None = None
        self.demo_key: str | None = None
        self.started_ray = False
        self.shards: Any = None  # app.shards.ShardFollower: the stored shard count, followed

    @classmethod
    async def start(cls, settings: Settings, *, port: int | None = None, seed_demo: bool = True) -> Stack:
        stack = cls()
        try:
            await stack._start(settings, port=port, seed_demo=seed_demo)
        except BaseException:
            await stack.stop()
            raise
        return stack

    async def _start(self, settings: Settings, *, port: int | None, seed_demo: bool) -> None:
        # a taken CE_PORT is one sentence now, not a traceback after Postgres, Ray and the hosts
        check_listen_address(settings.host, settings.port if port is None else port)
        data = Path(settings.data_dir)
        data.mkdir(parents=True, exist_ok=True)
        changes: dict[str, Any] = {}
        if not settings.database_url:
            self.pg = await asyncio.to_thread(start_embedded, data)
            changes["database_url"] = self.pg.url
        if not settings.secret_keys:
            changes["secret_keys"] = (load_or_create_key(data / "secret.key"),)
        if not settings.anthropic_api_key and not settings.anthropic_base_url:
            self.local_model = await start_local_model()
            changes["anthropic_base_url"] = self.local_model.url
        if seed_demo:
            try:  # a stable address keeps the demo tools' URLs (and versions) the same across runs
                self.demo_store = await start_demo_store(DEMO_STORE_HOST, DEMO_STORE_PORT)
            except OSError:  # taken (a second stack on this machine): any free port
                self.demo_store = await start_demo_store(DEMO_STORE_HOST)
            changes["webhook_allow"] = (*settings.webhook_allow, f"{DEMO_STORE_HOST}/32")
        settings = msgspec.structs.replace(settings, **changes)
        self.settings = settings

        pool = await create_pool(settings.database_url, min_size=1, max_size=2)
        try:
            applied = await migrate(pool)
            if applied:
                log.info("migrations_applied", migrations=applied)
            if seed_demo:
                self.demo_key = await seed_demo_tenant(pool, settings, self.demo_store.url, data)
        finally:
            await pool.close()

        self.started_ray = not settings.ray_address
        await asyncio.to_thread(connect_ray, settings)
        self.placement = Placement(settings)
        self.shards = await follow_shards(settings, self.placement)
        await self.placement.start_hosts()
        self.gateway = await open_gateway(
            settings, self.placement, port=port, ready_check=self._hosts_ready, contract=self.placement.contract
        )
        if self.demo_key is not None:
            write_demo_env(data, self.gateway.url, self.demo_key)

    async def _hosts_ready(self) -> bool:
        assert self.placement is not None
        stats = await self.placement.stats()
        return self.placement.mode == "dedicated" or len(stats) >= self.placement.shards

    async def stop(self, *, hurry: asyncio.Event | None = None) -> None:
        """Drain and stop everything this stack started: the gateway stops taking requests and
        lets in-flight ones finish (until `hurry` is set, if given), then every host finishes its
        turns and flushes its sessions."""
        if self.gateway is not None:
            await self.gateway.close(hurry=hurry)
        if self.placement is not None:
            try:
                await self.placement.shutdown_hosts()
            except Exception:
                log.exception("host_shutdown_failed")
        if self.shards is not None:
            await self.shards.close()
        if self.started_ray:
            await asyncio.to_thread(cluster.disconnect)
        if self.demo_store is not None:
            await self.demo_store.stop()
        if self.local_model is not None:
            await self.local_model.stop()
        if self.pg is not None:
            await asyncio.to_thread(self.pg.stop)
        # the gateway's schema worker, if it started one: a process run as a multiprocessing child
        # (the benchmark's) would otherwise wait for it on exit, before any atexit handler ran
        await asyncio.to_thread(offload.shutdown)


async def seed_demo_tenant(pool: Any, settings: Settings, store_url: str, data: Path) -> str:
    """Tenant `demo` with seed 000's check_order and seed 001's catalog search; returns its key.

    The key is kept in `.data/demo.env` (only its hash is in Postgres; `write_demo_env` writes
    it once the gateway is bound) and reused while valid.
    """
    tenants, tools, configs = TenantRepo(pool), ToolRepo(pool), BotConfigRepo(pool)
    env_file = data / "demo.env"
    key = None
    if env_file.exists():
        for line in env_file.read_text().splitlines():
            if line.startswith("CE_API_KEY="):
                key = line.split("=", 1)[1].strip()
    tenant = await tenants.get_by_name(DEMO_TENANT)
    if tenant is None:
        tenant, issued = await tenants.create_tenant(DEMO_TENANT)
        key = issued.api_key
    elif key is None or (await tenants.tenant_for_key(key)) is None:
        key = (await tenants.issue_key(tenant.id)).api_key
    box = SecretBox(settings.secret_keys)
    check_order = definition_from_body(ToolCreate(
        name="check_order",
        description="Look up a customer order by order number. Use when customer asks about their order status.",
        parameters={"order_id": {"type": "string", "description": "The order number"}},
        webhook_url=f"{store_url}/api/orders/{{order_id}}",
        auth_header="Bearer demo-store-key", timeout_ms=5000, intents=["orders"],
    ), encrypt=box.encrypt)
    catalog = definition_from_body(ToolCreate(
        name="example_catalog_search", type="backend_binding", mutability="read",
        description="Search the product catalog. Use when the customer looks for a product.",
        parameters={"search": {"type": "string", "description": "what to look for", "required": True},
                    "limit": {"type": "integer", "description": "how many results", "minimum": 1, "maximum": 20}},
        method="GET", path="/example/catalog", parameter_map={"search": "q", "limit": "per_page"},
        # the shop's catalog: the tenant's, for every contact (an `account_id` would be a signed-in
        # customer's, which an anonymous demo session does not have)
        scope=["tenant_id"], intents=["shopping"],
    ), encrypt=box.encrypt)
    # Seeded once: what the tenant changed since (a persona set with PUT /v1/bot-config or the
    # dashboard, a tool edited or a form changed) is theirs and survives a restart. The demo
    # store's address is not theirs: when it had to take another port, what points at it follows.
    for definition in (check_order, catalog):
        try:
            live = await tools.get(tenant.id, definition.name)
        except NotFound:
            data_def = msgspec.to_builtins(definition)
            await tools.create(tenant.id, definition.name, data_def["type"], data_def)
            continue
        moved = _at_the_demo_store(live.definition.get("webhook_url"), store_url)
        if moved is not None:
            # only onto the tool as read: a change the tenant published meanwhile is theirs to keep
            with contextlib.suppress(ToolChanged):
                await tools.new_version(tenant.id, live.name, {**live.definition, "webhook_url": moved,
                                                               "enabled": live.enabled}, publish=True, based_on=live)
    config = await configs.get(tenant.id)
    backend = config.get("backend") if isinstance(config, dict) else None
    moved = _at_the_demo_store(backend.get("base_url"), store_url) if isinstance(backend, dict) else None
    if moved is not None:
        await configs.put(tenant.id, {**config, "backend": {**backend, "base_url": moved}})
    if not config:
        await configs.put(tenant.id, {
            "persona": "You are the assistant of the Demo Store. Be brief and friendly.",
            "intents": {
                "orders": {"phrases": ["order", "delivery", "package", "shipping"], "tools": ["check_order"]},
                "shopping": {"phrases": ["looking for", "do you sell", "buy"], "tools": ["example_catalog_search"]},
            },
            "backend": {"base_url": store_url, "openapi": DEMO_OPENAPI},
        })
    # A form and a bookable service, so the demo offers every built-in (submit_form and the
    # booking tools wait for a tenant's first form and service).
    builtins = BuiltinRepos(pool)
    if await builtins.forms.get(tenant.id, "contact") is None:
        await builtins.forms.put(tenant.id, "contact", check_form("contact", DEMO_FORM))
    if await builtins.appointments.get_service(tenant.id, "consultation") is None:
        await builtins.appointments.put_service(tenant.id, service_from_body("consultation", DEMO_SERVICE))
    return key


_ORIGIN_RE = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://[^/?#]*")


def _at_the_demo_store(url: Any, store_url: str) -> str | None:
    """`url` moved to the demo store's current origin when it points at the demo store
    (DEMO_STORE_HOST, its own loopback address) on another port; else None."""
    if not isinstance(url, str):
        return None
    try:
        parsed, store = yarl.URL(url), yarl.URL(store_url)
    except ValueError:
        return None
    if parsed.host != DEMO_STORE_HOST or parsed.origin() == store.origin():
        return None
    return str(store.origin()) + _ORIGIN_RE.sub("", url, count=1)


def write_demo_env(data: Path, url: str, key: str) -> None:
    """`.data/demo.env` for `chat-engine chat`, `make loadtest` and scripts: the gateway's URL as
    it is bound (CE_PORT=0 picks the port when the gateway opens) and the demo tenant's key."""
    env_file = data / "demo.env"
    env_file.write_text(f"CE_URL={url}\nCE_API_KEY={key}\n")
    env_file.chmod(0o600)
