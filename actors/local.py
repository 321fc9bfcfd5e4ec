"""The in-process router: a SessionHost in the gateway's own event loop, no Ray.

Same session code as the actors; used by the benchmark's baseline (way "a") and by tests that
exercise the gateway without a cluster. Implements the gateway's SessionRouter port.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from actors.host import SessionHost
from actors.session import SessionError
from services.errors import NotFound
from services.wire import SessionView, StreamEvent, TurnReply


class LocalRouter:
    def __init__(self, host: SessionHost) -> None:
        self.host = host

    async def send(
        self, tenant_id: str, session_id: str, text: str, message_id: str | None, *, new_id: bool = False
    ) -> TurnReply:
        return await self.host.send(tenant_id, session_id, text, message_id, new_id=new_id)

    async def decide(
        self, tenant_id: str, session_id: str, approval_id: str, approve: bool, edited: dict | None = None
    ) -> TurnReply:
        try:
            return await self.host.decide(tenant_id, session_id, approval_id, approve, edited)
        except SessionError as exc:
            raise NotFound(str(exc), kind="approval", key=approval_id) from None

    async def stream(
        self, tenant_id: str, session_id: str, text: str | None, message_id: str | None,
        approval: tuple[str, bool, dict | None] | None = None, *, new_id: bool = False,
    ) -> AsyncIterator[StreamEvent]:
        try:
            async for event in self.host.stream(tenant_id, session_id, text, message_id, approval, new_id=new_id):
                yield event
        except SessionError as exc:
            if approval is None:
                raise
            raise NotFound(str(exc), kind="approval", key=approval[0]) from None

    async def view(self, tenant_id: str, session_id: str) -> SessionView | None:
        return await self.host.view(tenant_id, session_id)

    async def stats(self) -> list[dict[str, Any]]:
        return [self.host.stats()]
