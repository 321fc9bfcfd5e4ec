"""Per-tenant turn environments (catalog + bot config + ports), cached and reloaded on change.

The cache is the TenantSource of the session hosts. A change to a tenant's tools or bot config is
announced on Postgres's `ce_catalog` channel; every host process listens and drops that tenant's
entry, so live sessions see the change on their next message without a restart. A TTL bounds the
staleness should a notification be lost while the listening connection was down.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
import structlog

from actors.session import TurnEnv
from services.botconfig import BotConfig, botconfig_from_dict
from services.tools.model import ToolDefinition
from services.tools.registry import Catalog, HandlerRegistry, ToolBackend, build_catalog

log = structlog.get_logger(__name__)


class TenantCatalogs:
    def __init__(
        self,
        *,
        tools: Any,  # storage ToolRepo
        configs: Any,  # storage BotConfigRepo
        registry: HandlerRegistry,
        backend_for: Callable[[BotConfig], ToolBackend],
        builtins: Callable[[], Iterable[ToolDefinition]],
        llm: Any,
        executor: Any,
        main_model: str,
        cheap_model: str,
        ttl_s: float = 60.0,
        workflows: Any = None,
    ) -> None:
        self._workflows = workflows
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
        self._cache: dict[str, tuple[TurnEnv, float]] = {}
        self._loading: dict[str, asyncio.Future[TurnEnv]] = {}
        self._generation = 0
        self.reloads = 0

    def invalidate(self, tenant_id: str | None = None) -> None:
        """Forget one tenant's environment (or all); the next turn reloads it."""
        self._generation += 1
        if tenant_id is None:
            self._cache.clear()
        else:
            self._cache.pop(tenant_id, None)

    async def env_for(self, tenant_id: str) -> TurnEnv:
        cached = self._cache.get(tenant_id)
        if cached is not None and cached[1] > time.monotonic():
            return cached[0]
        loading = self._loading.get(tenant_id)
        if loading is not None:
            return await asyncio.shield(loading)
        future: asyncio.Future[TurnEnv] = asyncio.get_running_loop().create_future()
        self._loading[tenant_id] = future
        generation = self._generation
        try:
            env = await self._load(tenant_id)
            if generation == self._generation:  # not invalidated while loading
                self._cache[tenant_id] = (env, time.monotonic() + self._ttl)
            future.set_result(env)
            return env
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()
            raise
        finally:
            del self._loading[tenant_id]

    async def catalog_for(self, tenant_id: str) -> tuple[Catalog, BotConfig]:
        env = await self.env_for(tenant_id)
        return env.catalog, env.config

    async def _load(self, tenant_id: str) -> TurnEnv:
        self.reloads += 1
        config_data, rows = await asyncio.gather(
            self._configs.get(tenant_id), self._tools.list_published(tenant_id)
        )
        config = botconfig_from_dict(config_data)
        definitions = []
        for row in rows:
            try:
                definitions.append((msgspec.convert(row.definition, ToolDefinition), row.version))
            except msgspec.ValidationError as exc:
                log.error("tool_definition_unreadable", tool_name=row.name, error=str(exc))
        catalog = build_catalog(
            self._builtins(), definitions, registry=self._registry, backend=self._backend_for(config),
            workflows=self._workflows,
        )
        return TurnEnv(
            llm=self._llm, executor=self._executor, catalog=catalog, config=config,
            main_model=config.main_model or self._main, cheap_model=config.cheap_model or self._cheap,
        )
