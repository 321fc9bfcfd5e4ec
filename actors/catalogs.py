"""Per-tenant turn environments (catalog + bot config + ports), cached and reloaded on change.

The cache is the TenantSource of the session hosts. A change to a tenant's tools or bot config is
announced on Postgres's `ce_catalog` channel; every host process listens and drops that tenant's
entry. A notification reaches a host a moment after the write commits, so a message sent right
after the write could overtake it. Writers close that gap by waiting until every listening
process has acknowledged the change (services.catalog_sync): while `trusted()` says this process
is one of them, a turn uses its cached entry as it is. Otherwise (the LISTEN connection is down,
its beats do not reach Postgres, CE_CATALOG_CHECK=read, a process that does not listen), every
turn compares its cached entry with the tenant's catalog stamp (one small indexed read) and
reloads on a difference. A TTL bounds the staleness should both fail. At most
MAX_CACHED tenants' environments are kept, the least recently loaded dropped first: a host sees
many tenants over its life, and an environment holds a whole compiled catalog.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import msgspec
import structlog

from actors.session import TurnEnv
from services.botconfig import BotConfig, approval_ttl, botconfig_from_dict
from services.builtins.handoff import HANDLER as HANDOFF_HANDLER
from services.fairshare import waiting
from services.tools.mcp import with_mcp_tools
from services.tools.model import ToolDefinition
from services.tools.registry import Catalog, HandlerRegistry, ToolBackend, build_catalog
from services.tools.validation import schemas_checked

log = structlog.get_logger(__name__)

#: tenants whose environments a host keeps (each reloads in one round of reads when it comes back)
MAX_CACHED = 1024


class _Load:
    """One catalog load running; `stale` once its tenant was invalidated while it ran."""

    __slots__ = ("stale",)

    def __init__(self) -> None:
        self.stale = False


class TenantCatalogs:
    _mcp: Any = None  # services.tools.mcp.McpCatalogSource, set by attach_mcp

    def __init__(
        self,
        *,
        tools: Any,  # storage ToolRepo
        configs: Any,  # storage BotConfigRepo
        registry: HandlerRegistry,
        backend_for: Callable[..., ToolBackend],  # (config) or (config, egress allowances)
        builtins: Callable[[str], Awaitable[Iterable[ToolDefinition]]],  # the built-ins a tenant is offered
        llm: Any,
        executor: Any,
        main_model: str,
        cheap_model: str,
        ttl_s: float = 60.0,
        stamp: Callable[[str], Awaitable[str]] | None = None,
        workflows: Any = None,
        approval_keys: tuple[bytes, ...] = (),
        approval_ttl_s: float = 900.0,
        handoffs: Any = None,  # actors.session.HandoffDesk: the built-in handoff service
        contacts_for: Callable[[str, BotConfig], Any] | None = None,  # the tenant's ContactVerifier
        egress: Any = None,  # storage EgressRepo: the destinations an operator allowed each tenant
    ) -> None:
        self._egress = egress
        self._workflows = workflows
        self._approval_keys = approval_keys
        self._approval_ttl_s = approval_ttl_s
        self._handoffs = handoffs
        self._contacts_for = contacts_for
        self._tools = tools
        self._configs = configs
        self._registry = registry
        self._backend_for = backend_for
        self._builtins = builtins
        self._llm = llm
        self._executor = executor
        self._main = main_model
        self._cheap = cheap_model
        self._ttl = ttl_s
        # the ToolRepo's fingerprint of the tenant's tools, config and MCP servers (a `stamp`
        # given here must cover what its catalogs are built from); None: trust NOTIFY alone
        self._stamp = stamp if stamp is not None else getattr(tools, "catalog_stamp", None)
        # True while writers wait for this process to drop a changed catalog (see the docstring)
        self._trusted: Callable[[], bool] | None = None
        self.stamp_reads = 0
        self._cache: dict[str, tuple[TurnEnv, float, str | None]] = {}
        self._loading: dict[str, tuple[str | None, asyncio.Future[TurnEnv]]] = {}
        # every load running now, per tenant (an entry only while one runs): an invalidate marks
        # that tenant's loads stale, so what they read before the change is not cached; a load
        # of another tenant is left alone (one counter for all let one tenant's MCP retry timer,
        # every 10 s, keep every other tenant's loads out of the cache)
        self._running: dict[str, list[_Load]] = {}
        self.reloads = 0

    def trust_while(self, trusted: Callable[[], bool]) -> None:
        """Skip the per-turn stamp read while `trusted()` (services.catalog_sync.CatalogSync)."""
        self._trusted = trusted

    def invalidate(self, tenant_id: str | None = None) -> None:
        """Forget one tenant's environment (or all); the next turn reloads it, and a load of it
        running now is not cached."""
        # A load running now read the rows before the change: no later turn may join it either.
        if tenant_id is None:
            self._cache.clear()
            self._loading.clear()
            running: Iterable[list[_Load]] = self._running.values()
        else:
            self._cache.pop(tenant_id, None)
            self._loading.pop(tenant_id, None)
            running = (self._running.get(tenant_id, []),)
        for loads in running:
            for load in loads:
                load.stale = True

    async def env_for(self, tenant_id: str) -> TurnEnv:
        # Unless trusted, read first, on every turn: a stamp read that began before this turn
        # arrived could miss a change committed just before it, so it is neither cached nor shared.
        trusted = self._trusted is not None and self._trusted()
        stamp = None if trusted else await self._current_stamp(tenant_id)
        cached = self._cache.get(tenant_id)
        if cached is not None and cached[1] > time.monotonic() and stamp in (None, cached[2]):
            return cached[0]
        loading = self._loading.get(tenant_id)
        if loading is not None and stamp in (None, loading[0]):
            # another turn's load: it needs a compute slot to finish, so this wait holds none
            async with waiting():
                return await asyncio.shield(loading[1])
        future: asyncio.Future[TurnEnv] = asyncio.get_running_loop().create_future()
        self._loading[tenant_id] = (stamp, future)
        load = _Load()
        self._running.setdefault(tenant_id, []).append(load)
        try:
            # The rows are read after the stamp: a change committed in between makes the next
            # turn load once more, never keeps a stale catalog.
            env = await self._load(tenant_id)
            if not load.stale:  # not invalidated while loading
                self._remember(tenant_id, (env, time.monotonic() + self._ttl, stamp))
            future.set_result(env)
            return env
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()
            raise
        finally:
            if self._loading.get(tenant_id, (None, None))[1] is future:
                del self._loading[tenant_id]
            others = [other for other in self._running.get(tenant_id, []) if other is not load]
            if others:
                self._running[tenant_id] = others
            else:
                self._running.pop(tenant_id, None)

    def _remember(self, tenant_id: str, entry: tuple[TurnEnv, float, str | None]) -> None:
        """Cache an environment as the most recently loaded; past MAX_CACHED drop the oldest."""
        self._cache.pop(tenant_id, None)
        self._cache[tenant_id] = entry
        while len(self._cache) > MAX_CACHED:
            del self._cache[next(iter(self._cache))]

    async def _current_stamp(self, tenant_id: str) -> str | None:
        """The tenant's catalog stamp now; None when there is no stamp source or the read failed
        (then the NOTIFY and the TTL decide, as they did before stamps)."""
        if self._stamp is None:
            return None
        self.stamp_reads += 1
        try:
            return await self._stamp(tenant_id)
        except Exception as exc:  # noqa: BLE001 - a missed check must not fail the turn
            log.warning("catalog_stamp_unavailable", tenant_id=tenant_id, error=type(exc).__name__)
            return None

    async def catalog_for(self, tenant_id: str) -> tuple[Catalog, BotConfig]:
        env = await self.env_for(tenant_id)
        return env.catalog, env.config

    def attach_mcp(self, source: Any) -> None:
        """Add the tools of the tenant's MCP servers (services.tools.mcp.McpCatalogSource) to
        every catalog loaded from now on. Their registrations are already in the catalog stamp
        (ToolRepo.catalog_stamp reads them in the same statement, one round trip per turn)."""
        self._mcp = source

    async def _load_mcp(self, tenant_id: str) -> Any:
        return None if self._mcp is None else await self._mcp.load(tenant_id)

    def _with_mcp(self, tenant_id: str, catalog: Catalog, loaded: Any) -> Catalog:
        if loaded is None:
            return catalog
        if not loaded.complete:  # a server could not be listed: try again soon, not after the TTL
            asyncio.get_running_loop().call_later(self._mcp.retry_after_s, self.invalidate, tenant_id)
        return with_mcp_tools(catalog, loaded.tools, loaded.problems)

    async def _allowances(self, tenant_id: str) -> tuple[tuple[str, int], ...]:
        """The tenant's egress allowances as (entry, port) pairs; none without a repository."""
        if self._egress is None:
            return ()
        return await self._egress.allowances(tenant_id)

    async def _load(self, tenant_id: str) -> TurnEnv:
        self.reloads += 1
        config_data, rows, mcp, builtins, egress = await asyncio.gather(
            self._configs.get(tenant_id), self._tools.list_published(tenant_id), self._load_mcp(tenant_id),
            self._builtins(tenant_id), self._allowances(tenant_id),
        )
        config = botconfig_from_dict(config_data)
        definitions = []
        for row in rows:
            try:
                definitions.append((msgspec.convert(row.definition, ToolDefinition), row.version))
            except msgspec.ValidationError as exc:
                log.error("tool_definition_unreadable", tool_name=row.name, error=str(exc))
        # compiled off the event loop where a schema is large, and only what changed since the
        # last load (verdicts and validators are kept by schema content)
        backend = self._backend_for(config, egress) if egress else self._backend_for(config)
        catalog = await schemas_checked(lambda: build_catalog(
            builtins, definitions, registry=self._registry, backend=backend, workflows=self._workflows,
        ))
        catalog = self._with_mcp(tenant_id, catalog, mcp)
        return TurnEnv(
            llm=self._llm, executor=self._executor, catalog=catalog, config=config,
            main_model=config.main_model or self._main, cheap_model=config.cheap_model or self._cheap,
            approval_keys=self._approval_keys, approval_ttl_s=approval_ttl(config, self._approval_ttl_s),
            handoff=self._registry.get(HANDOFF_HANDLER) if self._registry is not None else None,
            handoffs=self._handoffs,
            contacts=self._contacts_for(tenant_id, config) if self._contacts_for is not None else None,
        )
