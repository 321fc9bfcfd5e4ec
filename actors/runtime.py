"""The composition root of a session-hosting process: pool, repositories, clients, catalogs.

Built once per process from one Settings (a Ray session host, or the in-process mode of the
benchmark and tests). Nothing here is a module-level singleton.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
import structlog

from actors.catalogs import TenantCatalogs
from kernel.errors import ConfigError
from services.approvals import approval_keys
from services.botconfig import BotConfig
from services.builtins import install as install_builtins
from services.catalog_sync import CatalogSync
from services.contacts import ContactVerifier, keys_for_test_contacts
from services.contract import OUTPUT_CONTRACT_FRAGMENT, build_report
from services.llm.anthropic_client import AnthropicLLM, make_anthropic_client
from services.settings import Settings
from services.tools.context import TrustedContext
from services.tools.crypto import SecretBox, SecretDecryptError
from services.tools.errors import ToolError
from services.tools.executor import Executor
from services.tools.limiter import ResourceLimiter
from services.tools.mcp import McpCatalogSource
from services.tools.mcp_client import McpHttpClient
from services.tools.model import BackendBindingTool, ToolDefinition, WebhookTool
from services.tools.registry import HandlerRegistry, ToolBackend
from services.tools.ssrf import policy_from_entries
from services.tools.webhook import WebhookClient, WebhookToolBackend
from services.workflows import WorkflowRunner
from storage.pool import create_pool
from storage.repos import (
    BotConfigRepo,
    SessionRepo,
    TenantRepo,
    ToolCallRepo,
    ToolRepo,
    listen_catalog,
)
from storage.repos.catalog_sync import fence_number
from storage.repos.egress import EgressRepo
from storage.repos.jobs import JobRepo
from storage.repos.mcp_servers import McpServerRepo

log = structlog.get_logger(__name__)

#: why a binding call fails when the bot config's backend auth header cannot be opened: the
#: tool-call record an admin reads says what to do, the advice what the model tells the contact
BACKEND_HEADER_UNDECRYPTABLE = (
    "the backend auth header of the bot config cannot be decrypted with the current secret keys "
    "(CE_SECRET_KEY was rotated without the key it was saved under): an admin must enter "
    "backend.auth_header in the bot config again"
)
BACKEND_HEADER_NO_KEYS = (
    "the backend auth header of the bot config cannot be decrypted: no CE_SECRET_KEY is set on "
    "this host; set the key it was saved under, or have an admin enter backend.auth_header in "
    "the bot config again"
)
_BACKEND_CREDENTIALS_ADVICE = (
    "Tell the customer you cannot access this right now; the business has to update its backend's "
    "credentials."
)


class _BindingsWithoutCredentials:
    """A ToolBackend whose bindings fail in-band (ToolError `reason`) because the backend's auth
    header could not be opened; webhook tools, which carry their own headers, go through."""

    def __init__(self, backend: WebhookToolBackend, reason: str) -> None:
        self._backend = backend
        self._reason = reason

    async def call_webhook(
        self, tool: WebhookTool, args: dict[str, Any], *, timeout_s: float, idempotency_key: str | None
    ) -> Any:
        return await self._backend.call_webhook(tool, args, timeout_s=timeout_s, idempotency_key=idempotency_key)

    async def call_binding(
        self, tool: BackendBindingTool, args: dict[str, Any], *, ctx: TrustedContext, timeout_s: float,
        idempotency_key: str | None,
    ) -> Any:
        raise ToolError(self._reason, advice=_BACKEND_CREDENTIALS_ADVICE, tool_name=tool.name)


class Runtime:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.pool: Any = None
        self.listener: Any = None
        self.catalog_sync: CatalogSync | None = None
        self.webhooks: WebhookClient | None = None
        self.light = False  # a dedicated session actor: background work kept small
        self._closing = False

    @classmethod
    async def open(cls, settings: Settings, *, listen: bool = True, pool_size: int = 10, light: bool = False
                   ) -> Runtime:
        """Connect everything. Raises ConfigError/StorageError with a sentence saying what to fix."""
        if not settings.database_url:
            raise ConfigError("DATABASE_URL is not set for this process; set it or use 'chat-engine run'",
                              variable="DATABASE_URL")
        rt = cls(settings)
        rt.light = light
        rt.pool = await create_pool(settings.database_url, min_size=1, max_size=pool_size)
        rt.tenants_repo = TenantRepo(rt.pool)
        rt.tools = ToolRepo(rt.pool)
        rt.calls = ToolCallRepo(rt.pool)
        rt.sessions = SessionRepo(rt.pool)
        rt.configs = BotConfigRepo(rt.pool)
        rt.secret_box = SecretBox(settings.secret_keys) if settings.secret_keys else None
        rt.webhooks = WebhookClient(policy=policy_from_entries(settings.webhook_allow))
        await rt.webhooks.start()
        rt.llm = AnthropicLLM(make_anthropic_client(settings.anthropic_api_key, settings.anthropic_base_url))
        rt.registry = HandlerRegistry()
        rt.executor = Executor(limiter=ResourceLimiter())
        rt.jobs = JobRepo(rt.pool)
        rt.workflows = WorkflowRunner(rt.jobs, rt.webhooks, egress=EgressRepo(rt.pool))
        rt.workflows.start_sweeping()  # jobs whose runner died with its process fail, not wait for ever
        builtins = rt._install_builtins()
        rt.tenants = TenantCatalogs(
            tools=rt.tools, configs=rt.configs, registry=rt.registry, backend_for=rt._backend_for,
            contacts_for=rt._contacts_for,
            builtins=builtins, llm=rt.llm, executor=rt.executor, workflows=rt.workflows,
            approval_keys=approval_keys(settings.secret_keys), approval_ttl_s=settings.approval_ttl_s,
            main_model=settings.main_model, cheap_model=settings.cheap_model,
            handoffs=rt.builtin_services.handoff, egress=EgressRepo(rt.pool),
        )
        rt._install_mcp()
        if listen:
            # A dedicated session actor (light) reads the stamp every turn rather than beat on its
            # own: there may be thousands of them.
            if settings.catalog_check == "notify" and not light:
                rt.catalog_sync = CatalogSync(rt.pool, rt.tenants.invalidate)
                rt.tenants.trust_while(rt.catalog_sync.trusted)
            rt.listener = await listen_catalog(rt.pool, rt._catalog_notified, on_lost=rt._listener_lost)
            if rt.catalog_sync is not None:
                rt.catalog_sync.listener_up(rt.listener.server_pid)
        return rt

    def _catalog_notified(self, payload: str) -> None:
        if self.catalog_sync is not None:
            self.catalog_sync.notified(payload)
        elif fence_number(payload) is None:  # a fence is for acknowledging listeners only
            self.tenants.invalidate(payload)

    def _install_mcp(self) -> None:
        """MCP servers as a tool source: the same SSRF policy as webhooks (CE_WEBHOOK_ALLOW)."""
        client = McpHttpClient(policy=policy_from_entries(self.settings.webhook_allow))
        self.mcp = McpCatalogSource(McpServerRepo(self.pool), client, secret_box=self.secret_box,
                                    egress=EgressRepo(self.pool))
        self.tenants.attach_mcp(self.mcp)

    def _install_builtins(self):
        return install_builtins(self)

    def _backend_for(self, config: BotConfig, egress: tuple[tuple[str, int], ...] = ()) -> ToolBackend:
        """The tool backend of a tenant's catalog: its webhooks, and its bindings sent to the bot
        config's backend with its auth header, each call checked against CE_WEBHOOK_ALLOW and the
        tenant's `egress` allowances. Called while the catalog loads, so it never raises: a header the keys cannot open (CE_SECRET_KEY rotated without the key it was
        saved under) fails each binding call in-band, as a webhook tool's does; every other tool
        of the tenant works."""
        headers: dict[str, str] = {}
        base_url = None
        unopened: str | None = None
        if config.backend is not None:
            base_url = config.backend.base_url
            if config.backend.auth_header_enc:
                if self.secret_box is None:
                    unopened = BACKEND_HEADER_NO_KEYS
                else:
                    try:
                        headers["Authorization"] = self.secret_box.decrypt(config.backend.auth_header_enc)
                    except SecretDecryptError:
                        unopened = BACKEND_HEADER_UNDECRYPTABLE
        policy = None
        if egress:
            try:
                policy = self.webhooks.policy.for_tenant(egress)
            except ConfigError:  # stored before a check refused it: the operator-wide policy alone
                log.warning("egress_allowance_unreadable", allowances=len(egress))
        backend = WebhookToolBackend(self.webhooks, secret_box=self.secret_box,
                                     binding_base_url=base_url, binding_headers=headers, policy=policy)
        if unopened is None:
            return backend
        log.warning("backend_auth_header_undecryptable", keys_set=self.secret_box is not None)
        return _BindingsWithoutCredentials(backend, unopened)

    def _contacts_for(self, tenant_id: str, config: BotConfig) -> ContactVerifier | None:
        """The tenant's Contact-Token verifier (with its test-contact keys), or None when it
        verifies no contact. Never raises (called while the catalog loads): an HS256 secret the
        keys cannot open is left out, so HS256 tokens are refused ("key") and the other
        algorithms still work."""
        settings = config.contact_verification
        if settings is None:
            return None
        secret = None
        if settings.hs256_secret_enc and self.secret_box is not None:
            try:
                secret = self.secret_box.decrypt(settings.hs256_secret_enc)
            except SecretDecryptError:
                log.warning("contact_secret_undecryptable")
        return ContactVerifier(settings, hs256_secret=secret,
                               test_keys=keys_for_test_contacts(self.settings.secret_keys, tenant_id))

    async def contract_report(self, tenant_id: str) -> dict:
        """The tool-contract report against this process's running catalog."""
        rows = await self.tools.list_published(tenant_id)
        env = await self.tenants.env_for(tenant_id)
        published = []
        for row in rows:
            try:
                published.append((msgspec.convert(row.definition, ToolDefinition), row.version))
            except msgspec.ValidationError:
                continue  # unreadable rows are reported by the catalog as not loaded
        since = datetime.now(UTC) - timedelta(hours=24)
        broken = await self.calls.failures_matching(tenant_id, since, OUTPUT_CONTRACT_FRAGMENT)
        return msgspec.to_builtins(build_report(tenant_id, published, env.catalog, env.config, broken))

    def _listener_lost(self) -> None:
        # Notifications sent while the connection was down are lost: forget every cached
        # catalog, then subscribe again (Postgres may be restarting: back off until it is back).
        log.warning("catalog_listener_lost")
        if self.catalog_sync is not None:
            self.catalog_sync.listener_lost()
        self.tenants.invalidate()
        if not self._closing:
            self._resubscribe = asyncio.get_running_loop().create_task(self._listen_again())

    async def _listen_again(self) -> None:
        delay = 0.2
        while not self._closing:
            await asyncio.sleep(delay)
            try:
                old, self.listener = self.listener, None
                if old is not None:
                    await old.close()
                self.listener = await listen_catalog(self.pool, self._catalog_notified, on_lost=self._listener_lost)
                self.tenants.invalidate()  # anything changed while we were deaf
                if self.catalog_sync is not None:
                    self.catalog_sync.listener_up(self.listener.server_pid)
                log.info("catalog_listener_restored")
                return
            except Exception as exc:  # noqa: BLE001 - Postgres still away: try again later
                log.info("catalog_listener_retry", error=type(exc).__name__, retry_in_s=delay)
                delay = min(delay * 2, 5.0)

    async def close(self) -> None:
        self._closing = True
        if self.catalog_sync is not None:
            await self.catalog_sync.close()
        if self.listener is not None:
            await self.listener.close()
        if getattr(self, "workflows", None) is not None:
            await self.workflows.close()
        if getattr(self, "builtin_services", None) is not None:
            await self.builtin_services.close()  # queued notifications get a second; the rest wait in the outbox
        if self.webhooks is not None:
            await self.webhooks.close()
        if getattr(self, "llm", None) is not None:
            await self.llm.close()
        if self.pool is not None:
            await self.pool.close()
