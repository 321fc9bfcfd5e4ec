"""recall_memory: what this contact said or shared before, found by Postgres full-text search.

Two sources, ranked together by ts_rank (storage.repos.builtins.MemoryRepo):
- facts (ce_memories): written by the tools as things happen — a lead's details, a booking, a
  form submission — tagged with the session and, for a verified contact, its `sub`;
- messages (ce_messages): the text of this session's conversation.
Where the tenant turned on `recall_across_sessions` (bot config, which requires contact
verification), both also come from every other session bound to the same verified contact (the
`sub` of its Contact-Token). Nothing the contact types — an email given to collect_lead, a
session variable — reaches another session's memory: an anonymous session recalls itself only.
Searched with the tenant's `language` (a Postgres text search configuration; unknown names fall
back to 'simple'). A question that matches nothing gets the contact's latest facts instead.
"""

from __future__ import annotations

from typing import Any, Protocol

import structlog

from services.builtins.base import TenantConfigs, clip
from services.tools.context import TrustedContext
from services.tools.errors import InvalidArguments
from services.tools.model import PythonTool

log = structlog.get_logger(__name__)

HANDLER = "builtin.recall_memory"
MAX_QUERY = 500
MAX_HITS = 8

DEFINITION = PythonTool(
    name="recall_memory",
    description=(
        "Search what this customer said or shared earlier, in this conversation and in previous "
        "ones: saved facts (their contact details, bookings, forms) and past messages, best "
        "matches first. Use when the customer refers to something from before or asks what you know."
    ),
    parameters={
        "type": "object",
        "properties": {
            "query": {"type": "string", "description": "what to look for, in a few words", "minLength": 1,
                      "maxLength": MAX_QUERY},
        },
        "required": ["query"],
        "additionalProperties": False,
    },
    mutability="read",
    # Names redacted at any depth of the call record, the result's included: what is recalled is
    # the contact's details (a lead's email and phone, a form's answers), kept in ce_memories for
    # the tenant, not copied into ce_tool_calls. The model reads the result whole.
    sensitive=("summary", "content"),
    handler=HANDLER,
    timeout_ms=5000,
)


class MemoryStore(Protocol):
    async def add_fact(self, tenant_id: str, *, session_id: str | None, contact_id: str | None,
                       content: str, language: str) -> str: ...
    async def search(self, tenant_id: str, *, session_id: str, contact_sub: str | None,
                     query: str, language: str, limit: int = 8) -> list[Any]: ...
    async def recent_facts(self, tenant_id: str, *, session_id: str, contact_sub: str | None,
                           limit: int = 5) -> list[Any]: ...


class MemoryService:
    def __init__(self, store: MemoryStore, configs: TenantConfigs) -> None:
        self._store = store
        self._configs = configs

    async def remember(self, ctx: TrustedContext, content: str) -> str:
        """Write a fact for this session (tagged with its verified contact, if any); returns its id."""
        return await self._store.add_fact(
            ctx.tenant_id, session_id=ctx.session_id, contact_id=ctx.contact_sub,
            content=clip(content, 2000), language=ctx.language,
        )

    async def remember_quietly(self, ctx: TrustedContext, content: str) -> None:
        """`remember`, for a fact written after the tool's own row is committed: a failure here is
        logged, not raised, so the contact is never told that a booking which exists failed."""
        try:
            await self.remember(ctx, content)
        except Exception:  # the write it describes already succeeded: log, do not fail the tool
            log.exception("memory_fact_not_stored", tenant_id=ctx.tenant_id, session_id=ctx.session_id)

    async def recall(self, args: dict[str, Any], ctx: TrustedContext) -> dict[str, Any]:
        """The handler of recall_memory: the best matches for `query`, newest first among equals."""
        query = str(args.get("query") or "").strip()
        if not query:
            raise InvalidArguments(
                "'query' is empty", advice="Call recall_memory again with a few words to look for."
            )
        config = await self._configs.config_for(ctx.tenant_id)
        # Other sessions only of the verified contact this one is bound to, where the tenant asks
        # for them: never by anything typed (an email, a variable), which nobody vouched for.
        contact = ctx.contact_sub if config.recall_across_sessions else None
        scope = {"session_id": ctx.session_id, "contact_sub": contact}
        hits = await self._store.search(ctx.tenant_id, query=query[:MAX_QUERY], language=ctx.language,
                                        limit=MAX_HITS, **scope)
        matched = bool(hits)
        if not hits:
            hits = await self._store.recent_facts(ctx.tenant_id, limit=5, **scope)
        memories = [
            {
                "kind": h.kind,
                "from": ("the customer" if h.role == "user" else "you" if h.role == "assistant" else "saved fact"),
                "content": clip(h.content, 500),
                "when": h.created_at.date().isoformat(),
                "conversation": "this one" if h.session_id == ctx.session_id else "an earlier one",
            }
            for h in hits
        ]
        if matched:
            note = f"{len(memories)} match(es) for {clip(query, 60)!r}, best first"
        elif memories:
            note = f"nothing matched {clip(query, 60)!r}; these are the latest saved facts about this customer"
        else:
            note = "nothing is remembered about this customer yet; ask them instead"
        result: dict[str, Any] = {"found": len(memories), "note": note}
        if memories:
            result["summary"] = " | ".join(m["content"] for m in memories[:3])
        result["memories"] = memories
        return result
