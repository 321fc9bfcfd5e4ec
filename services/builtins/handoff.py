"""escalate_to_human: record why the contact wants a person, tell the tenant, hand the session over.

The row (ce_handoffs) and the `handoff.requested` notification happen here; the engine marks the
session handed off when this tool succeeds (actors.session, as the `[[HANDOFF]]` marker does),
after which the bot no longer answers and tells the contact a person will reply. One handoff per
message: the call's idempotency key leaves the reason out (`idempotency_arguments=()`), so a turn
re-run after a crash, whose model words the reason differently, finds the row the first run wrote.
"""

from __future__ import annotations

from typing import Any, Protocol

from services.builtins.base import TenantConfigs, clip, known_contact
from services.builtins.notify import Notifier
from services.tools.context import TrustedContext
from services.tools.model import PythonTool

HANDLER = "builtin.escalate_to_human"
EVENT = "handoff.requested"

DEFINITION = PythonTool(
    name="escalate_to_human",
    description=(
        "Hand the conversation over to a member of the team. Use when the customer asks for a "
        "person, or when you cannot help and a person should take over. After this the assistant "
        "stops answering in this conversation."
    ),
    parameters={
        "type": "object",
        "properties": {
            "reason": {"type": "string", "maxLength": 1000,
                       "description": "why the customer needs a person, in a sentence"},
        },
        "additionalProperties": False,
    },
    # "read" on purpose: a handoff changes none of the business's records, and an assistant that
    # may not change records (allow_writes=false) must still be able to hand over.
    mutability="read",
    # once per message: a turn re-run after a crash may word the reason differently
    idempotency_arguments=(),
    handler=HANDLER,
)


class HandoffStore(Protocol):
    async def record(self, tenant_id: str, session_id: str, reason: str | None, *,
                     idempotency_key: str | None = None, announce: Any = None) -> tuple[Any, bool]: ...


class HandoffService:
    def __init__(self, store: HandoffStore, *, configs: TenantConfigs, notifier: Notifier) -> None:
        self._store = store
        self._configs = configs
        self._notifier = notifier

    async def escalate(self, args: dict[str, Any], ctx: TrustedContext) -> dict[str, Any]:
        """The handler of escalate_to_human: stores the handoff and notifies the tenant."""
        reason = clip(str(args.get("reason") or "the customer asked for a person"), 1000)
        config = await self._configs.config_for(ctx.tenant_id)
        announce = self._notifier.announcer(config, EVENT, tenant_id=ctx.tenant_id, about=lambda row: (row.id, {
            "handoff_id": row.id, "session_id": ctx.session_id, "contact_id": known_contact(ctx),
            "reason": reason, "created_at": row.created_at.isoformat(),
        }))
        handoff, _created = await self._store.record(
            ctx.tenant_id, ctx.session_id, reason, idempotency_key=ctx.idempotency_key, announce=announce,
        )
        announce.done()
        return {"handoff_id": handoff.id, "status": "handed over to the team"}
