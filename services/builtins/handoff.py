"""escalate_to_human: record why the contact wants a person, tell the tenant, hand the session over.

The row (ce_handoffs) and the `handoff.requested` notification happen here; the engine marks the
session handed off when this tool succeeds (actors.session, as the `[[HANDOFF]]` marker does),
after which the bot no longer answers and tells the contact a person will reply. One handoff per
message: the call's idempotency key leaves the reason out (`idempotency_arguments=()`), so a turn
re-run after a crash, whose model words the reason differently, finds the row the first run wrote.
A session has at most one open handoff: escalating it again while one is open answers with that one.

Then a person takes over: `claim` assigns the handoff to an agent (`handoff.assigned`), `resolve`
closes it, saying whether the bot answers the session again (`handoff.resolved`). Each event is
written with the state change, in its transaction, and only when the state changed: a repeated
claim by the same agent or a repeated resolve answers with the row and announces nothing.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Protocol

from kernel.errors import InvalidInput
from services.botconfig import BotConfig
from services.builtins.base import TenantConfigs, clip, known_contact
from services.builtins.notify import Announcer, Notifier
from services.tools.context import TrustedContext
from services.tools.model import PythonTool
from storage.repos.builtins import HandoffRecord

HANDLER = "builtin.escalate_to_human"
EVENT = "handoff.requested"
ASSIGNED_EVENT = "handoff.assigned"
RESOLVED_EVENT = "handoff.resolved"
#: the longest agent name `claim` takes (it names a person of the tenant's team)
AGENT_MAX = 200

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
    """storage.repos.builtins.HandoffRepo: each write returns (row, whether this call changed it)."""

    async def record(self, tenant_id: str, session_id: str, reason: str | None, *,
                     idempotency_key: str | None = None, announce: Any = None) -> tuple[Any, bool]: ...
    async def claim(self, tenant_id: str, handoff_id: str, agent: str, *,
                    announce: Any = None) -> tuple[HandoffRecord, bool]: ...
    async def resolve(self, tenant_id: str, handoff_id: str, return_to_bot: bool, *,
                      announce: Any = None) -> tuple[HandoffRecord, bool]: ...


def agent_name(agent: Any) -> str:
    """`agent` without the spaces around it. Raises InvalidInput when it is not text, is empty or
    is longer than AGENT_MAX."""
    if not isinstance(agent, str):
        raise InvalidInput(f"agent must be text naming who takes the handoff, got {type(agent).__name__}")
    name = agent.strip()
    if not name:
        raise InvalidInput("agent must name who takes the handoff, got an empty name")
    if len(name) > AGENT_MAX:
        raise InvalidInput(f"agent must be at most {AGENT_MAX} characters, got {len(name)}")
    return name


def _stamp(at: datetime | None) -> str | None:
    return None if at is None else at.isoformat()


def transition_data(row: HandoffRecord) -> dict[str, Any]:
    """The data of the `handoff.assigned` or `handoff.resolved` event about `row` (as it is after
    the change): `return_to_bot` and `resolved_at` only once resolved; `agent` and `assigned_at`
    are null for a handoff resolved without being claimed."""
    data: dict[str, Any] = {
        "handoff_id": row.id, "session_id": row.session_id, "state": row.state, "agent": row.agent,
        "created_at": _stamp(row.created_at), "assigned_at": _stamp(row.assigned_at),
    }
    if row.state == "resolved":
        data |= {"return_to_bot": row.return_to_bot, "resolved_at": _stamp(row.resolved_at)}
    return data


class HandoffService:
    def __init__(self, store: HandoffStore, *, configs: TenantConfigs, notifier: Notifier) -> None:
        self._store = store
        self._configs = configs
        self._notifier = notifier

    async def escalate(self, args: dict[str, Any], ctx: TrustedContext) -> dict[str, Any]:
        """The handler of escalate_to_human: stores the handoff and notifies the tenant (or, when
        the session has an open handoff already, answers with that one and notifies no one)."""
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

    async def claim(self, tenant_id: str, handoff_id: str, agent: str) -> HandoffRecord:
        """Assign a requested handoff to `agent` and send `handoff.assigned`; returns the handoff.
        The same agent claiming it again gets it back and sends nothing. Raises InvalidInput for
        an empty or overlong agent, NotFound for a handoff the tenant does not have, Conflict
        (HandoffConflict) when another agent holds it or it is resolved."""
        name = agent_name(agent)
        config = await self._configs.config_for(tenant_id)
        announce = self._announcer(config, ASSIGNED_EVENT, tenant_id)
        row, _changed = await self._store.claim(tenant_id, handoff_id, name, announce=announce)
        announce.done()
        return row

    async def resolve(self, tenant_id: str, handoff_id: str, return_to_bot: bool) -> HandoffRecord:
        """Resolve a requested or assigned handoff and send `handoff.resolved`; returns the
        handoff. `return_to_bot` says whether the bot answers the session again (the session side
        acts on it). Resolving it again the same way returns it and sends nothing. Raises
        InvalidInput when `return_to_bot` is not a bool, NotFound for a handoff the tenant does not
        have, Conflict (HandoffConflict) when it was resolved the other way."""
        if not isinstance(return_to_bot, bool):
            raise InvalidInput(f"return_to_bot must be true or false, got {type(return_to_bot).__name__}")
        config = await self._configs.config_for(tenant_id)
        announce = self._announcer(config, RESOLVED_EVENT, tenant_id)
        row, _changed = await self._store.resolve(tenant_id, handoff_id, return_to_bot, announce=announce)
        announce.done()
        return row

    def _announcer(self, config: BotConfig, event: str, tenant_id: str) -> Announcer:
        # keyed by the handoff: each transition happens once per handoff, so its event id does too
        return self._notifier.announcer(config, event, tenant_id=tenant_id,
                                        about=lambda row: (row.id, transition_data(row)))
