"""The built-in tools that ship with the engine (seed 000), each backed by a service over Postgres.

    recall_memory            services.builtins.memory         facts + messages, full-text ranked
    collect_lead             services.builtins.leads          one lead per session, lead.created
    book_appointment         services.builtins.appointments   free slots, race-safe booking (write)
    list_appointment_slots   services.builtins.appointments   free slots (read, no approval)
    submit_form              services.builtins.forms          JSON-schema forms, validated rows
    escalate_to_human        services.builtins.handoff        handoff row, handoff.requested; claim and
                                                              resolve (handoff.assigned, handoff.resolved)

`install(runtime)` is called by the composition root (actors.runtime): it builds the services on
the runtime's pool and webhook client, registers their handlers in `runtime.registry` under
`builtin.<tool>`, and returns the zero-argument callable that yields the definitions every
tenant's catalog starts with (built-ins win over tenant tools of the same name).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from services.botconfig import BotConfig
from services.builtins import appointments, forms, handoff, leads, memory
from services.builtins.appointments import AppointmentService
from services.builtins.base import Now, TenantConfigs, utc_now
from services.builtins.forms import FormService
from services.builtins.handoff import HandoffService
from services.builtins.leads import LeadService
from services.builtins.memory import MemoryService
from services.builtins.notify import (
    CLAIM_BATCH,
    LIGHT_BATCH,
    LIGHT_POLL_S,
    POLL_S,
    Notifier,
    WebhookPoster,
)
from services.tools.model import ToolDefinition
from services.tools.registry import HandlerRegistry
from storage.repos.builtins import BuiltinRepos
from storage.repos.egress import EgressRepo
from storage.repos.notifications import NotificationRepo

DEFINITIONS: tuple[ToolDefinition, ...] = (
    memory.DEFINITION,
    leads.DEFINITION,
    appointments.LIST_DEFINITION,
    appointments.BOOK_DEFINITION,
    forms.DEFINITION,
    handoff.DEFINITION,
)


class BuiltinServices:
    """The services behind the built-in tools, wired to one set of repositories."""

    def __init__(self, repos: BuiltinRepos, configs: TenantConfigs, webhooks: WebhookPoster | None, *,
                 now: Now = utc_now, notifier: Notifier | None = None) -> None:
        self.repos = repos
        self.notifier = notifier or Notifier(webhooks, NotificationRepo(repos.pool), configs)
        self.memory = MemoryService(repos.memories, configs)
        self.leads = LeadService(repos.leads, configs, self.notifier, text_config=repos.memories.text_config)
        self.appointments = AppointmentService(
            repos.appointments, configs=configs, notifier=self.notifier, memory=self.memory,
            leads=repos.leads, now=now,
        )
        self.forms = FormService(repos.forms, configs=configs, notifier=self.notifier, memory=self.memory)
        self.handoff = HandoffService(repos.handoffs, configs=configs, notifier=self.notifier)

    def register(self, registry: HandlerRegistry) -> None:
        """Register every handler under its `builtin.<tool>` name."""
        registry.register(memory.HANDLER)(self.memory.recall)
        registry.register(leads.HANDLER)(self.leads.collect)
        registry.register(appointments.LIST_HANDLER)(self.appointments.list_slots)
        registry.register(appointments.BOOK_HANDLER)(self.appointments.book)
        registry.register(forms.HANDLER)(self.forms.submit)
        registry.register(handoff.HANDLER)(self.handoff.escalate)

    async def close(self) -> None:
        await self.notifier.close()


class _RuntimeConfigs:
    """Tenant configs through the runtime's tenant cache (reloaded on NOTIFY like the catalogs).
    Looked up at call time: the cache is built after the built-ins are installed."""

    def __init__(self, runtime: Any) -> None:
        self._runtime = runtime

    async def config_for(self, tenant_id: str) -> BotConfig:
        _catalog, config = await self._runtime.tenants.catalog_for(tenant_id)
        return config


def offered(definitions: tuple[ToolDefinition, ...], *, has_forms: bool, has_services: bool
            ) -> tuple[ToolDefinition, ...]:
    """The built-ins a tenant is offered: the model never sees a tool that could only answer "not
    set up", so `submit_form` waits for the tenant's first form and the booking tools for its first
    appointment service."""
    needs = {forms.DEFINITION.name: has_forms, appointments.LIST_DEFINITION.name: has_services,
             appointments.BOOK_DEFINITION.name: has_services}
    return tuple(d for d in definitions if needs.get(d.name, True))


def install(runtime: Any) -> Callable[[str], Awaitable[tuple[ToolDefinition, ...]]]:
    """Build the services on `runtime.pool` and `runtime.webhooks`, register their handlers in
    `runtime.registry`, keep them as `runtime.builtin_services`; returns the source of the
    definitions each tenant is offered (read when its catalog loads)."""
    repos = BuiltinRepos(runtime.pool)
    configs = _RuntimeConfigs(runtime)
    light = runtime.light  # a dedicated session actor: see notify.LIGHT_POLL_S
    box = runtime.secret_box
    notifier = Notifier(runtime.webhooks, NotificationRepo(runtime.pool), configs,
                        poll_s=LIGHT_POLL_S if light else POLL_S, batch=LIGHT_BATCH if light else CLAIM_BATCH,
                        decrypt=box.decrypt if box is not None else None, egress=EgressRepo(runtime.pool))
    services = BuiltinServices(repos, configs, runtime.webhooks, notifier=notifier)
    services.register(runtime.registry)
    services.notifier.start()  # also delivers what an earlier process queued and did not send
    runtime.builtin_services = services

    async def for_tenant(tenant_id: str) -> tuple[ToolDefinition, ...]:
        has_forms, has_services = await repos.set_up(tenant_id)
        return offered(DEFINITIONS, has_forms=has_forms, has_services=has_services)

    return for_tenant
