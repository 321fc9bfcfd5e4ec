"""The in-process router: a SessionHost in the gateway's own event loop, no Ray.

Same session code as the actors; used by the benchmark's baseline (way "a") and by tests that
exercise the gateway without a cluster. Implements the gateway's SessionRouter port.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from actors.host import SessionHost
from actors.session import SessionError
from kernel.errors import Conflict, NotFound
from kernel.records import SessionEvent
from services.wire import (
    ApprovalDecision,
    SessionCommand,
    SessionView,
    StreamEvent,
    Turn,
    TurnCommand,
    TurnReply,
)


class LocalRouter:
    def __init__(self, host: SessionHost) -> None:
        self.host = host

    async def send(self, turn: Turn, *, new_id: bool = False) -> TurnReply:
        return await self.host.send(turn, new_id=new_id)

    async def decide(self, decision: ApprovalDecision) -> TurnReply:
        try:
            return await self.host.decide(decision)
        except SessionError as exc:
            raise NotFound(str(exc), kind="approval", key=decision.approval_id) from None

    async def stream(self, command: TurnCommand, *, new_id: bool = False) -> AsyncIterator[StreamEvent]:
        try:
            async for event in self.host.stream(command, new_id=new_id):
                yield event
        except SessionError as exc:
            if not isinstance(command, ApprovalDecision):
                raise
            raise NotFound(str(exc), kind="approval", key=command.approval_id) from None

    async def act(self, command: SessionCommand) -> TurnReply:
        try:
            return await self.host.act(command)
        except SessionError as exc:
            raise Conflict(str(exc)) from None

    async def watch(self, tenant_id: str, session_id: str, after: int, wait_s: float) -> list[SessionEvent]:
        return await self.host.watch(tenant_id, session_id, after, wait_s)

    async def view(self, tenant_id: str, session_id: str) -> SessionView | None:
        return await self.host.view(tenant_id, session_id)

    async def stats(self) -> list[dict[str, Any]]:
        return [self.host.stats()]
