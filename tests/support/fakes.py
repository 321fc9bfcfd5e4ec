"""Fakes for the tool core: a ToolBackend, a Clock, recording handlers and catalog builders,
and the base of the scripted model fakes.

Every fake implements the Protocol its consumer declares (registry.ToolBackend, limiter.Clock,
registry.Handler), so tests never patch a dotted path.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from services.llm.port import LLMRequest, LLMResponse, final_response
from services.tools.context import TrustedContext
from services.tools.model import (
    BackendBindingTool,
    ClientTool,
    PythonTool,
    ToolDefinition,
    WebhookTool,
    WorkflowTool,
)
from services.tools.registry import Catalog, HandlerRegistry, ToolBackend, build_catalog

#: the schema most test tools use: one optional free-text argument
OPEN_SCHEMA: dict[str, Any] = {"type": "object", "properties": {"q": {"type": "string"}}, "additionalProperties": True}

#: seed 000's check_order after normalisation: `order_id` fills the URL hole, so it is required
ORDER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"order_id": {"type": "string", "description": "The order number"}},
    "required": ["order_id"],
}


class StreamScriptedLLM:
    """Base of the model fakes that script `stream` (the LLMClient port): `complete`, which the
    session uses for turns nobody streams, answers with that stream's final response, as the port
    promises, and counts itself in `completions`."""

    completions = 0

    async def complete(self, request: LLMRequest) -> LLMResponse:
        self.completions += 1
        return await final_response(self.stream(request))  # type: ignore[attr-defined]


class FakeClock:
    """A limiter.Clock that moves only when told to."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class BackendCall(msgspec.Struct, frozen=True, kw_only=True):
    kind: str  # "webhook" | "binding"
    tool_name: str
    args: dict[str, Any]
    timeout_s: float
    idempotency_key: str | None
    ctx: TrustedContext | None = None


class FakeToolBackend:
    """registry.ToolBackend that records every call and answers from `responses`.

    `responses[tool_name]` is returned, or raised when it is an exception; otherwise `default`.
    """

    def __init__(self, responses: dict[str, Any] | None = None, *, default: Any = None) -> None:
        self.responses = dict(responses or {})
        self.default = {"ok": True} if default is None else default
        self.calls: list[BackendCall] = []

    async def call_webhook(
        self, tool: WebhookTool, args: dict[str, Any], *, timeout_s: float, idempotency_key: str | None
    ) -> Any:
        self.calls.append(BackendCall(
            kind="webhook", tool_name=tool.name, args=dict(args), timeout_s=timeout_s,
            idempotency_key=idempotency_key,
        ))
        return self._answer(tool.name)

    async def call_binding(
        self,
        tool: BackendBindingTool,
        args: dict[str, Any],
        *,
        ctx: TrustedContext,
        timeout_s: float,
        idempotency_key: str | None,
    ) -> Any:
        self.calls.append(BackendCall(
            kind="binding", tool_name=tool.name, args=dict(args), timeout_s=timeout_s,
            idempotency_key=idempotency_key, ctx=ctx,
        ))
        return self._answer(tool.name)

    def _answer(self, name: str) -> Any:
        answer = self.responses.get(name, self.default)
        if isinstance(answer, BaseException):
            raise answer
        return answer


class FakeHandler:
    """A registry.Handler that records what it saw and the order it started and ended in.

    `gate`: when set, the handler waits for it after starting (to hold a call "in flight").
    `result`: returned, or raised when it is an exception. `journal`: shared start/end log.
    """

    def __init__(
        self,
        name: str,
        *,
        result: Any = None,
        gate: asyncio.Event | None = None,
        journal: list[tuple[str, str]] | None = None,
        yields: int = 0,
    ) -> None:
        self.name = name
        self.result = {"handled_by": name} if result is None else result
        self.gate = gate
        self.journal = journal if journal is not None else []
        self.yields = yields
        self.calls: list[tuple[dict[str, Any], TrustedContext]] = []
        self.cancelled = 0

    @property
    def count(self) -> int:
        return len(self.calls)

    async def __call__(self, args: dict[str, Any], ctx: TrustedContext) -> Any:
        self.calls.append((dict(args), ctx))
        self.journal.append(("start", self.name))
        try:
            for _ in range(self.yields):  # give anything that could interleave the chance to
                await asyncio.sleep(0)
            if self.gate is not None:
                await self.gate.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        self.journal.append(("end", self.name))
        if isinstance(self.result, BaseException):
            raise self.result
        return self.result


def python_tool(name: str, **fields: Any) -> PythonTool:
    """A PythonTool bound to a handler of the same name unless `handler=` says otherwise."""
    fields.setdefault("handler", name)
    fields.setdefault("description", f"{name} for tests")
    fields.setdefault("parameters", OPEN_SCHEMA)
    return PythonTool(name=name, **fields)


def webhook_tool(name: str = "check_order", **fields: Any) -> WebhookTool:
    """Seed 000's tenant tool, parameters already normalised."""
    fields.setdefault(
        "description",
        "Look up a customer order by order number. Use when customer asks about their order status.",
    )
    fields.setdefault("parameters", ORDER_SCHEMA)
    fields.setdefault("webhook_url", "https://mystore.com/api/orders/{order_id}")
    return WebhookTool(name=name, **fields)


def binding_tool(name: str = "example_catalog_search", **fields: Any) -> BackendBindingTool:
    """Seed 001's catalog-search binding."""
    fields.setdefault("description", "Search the catalog.")
    fields.setdefault("parameters", {
        "type": "object",
        "properties": {"search": {"type": "string"}, "limit": {"type": "integer"}},
    })
    fields.setdefault("path", "/example/catalog")
    fields.setdefault("parameter_map", {"search": "q", "limit": "per_page"})
    fields.setdefault("scope", ("account_id",))
    return BackendBindingTool(name=name, **fields)


def workflow_tool(name: str, **fields: Any) -> WorkflowTool:
    fields.setdefault("handler", name)
    fields.setdefault("description", f"{name} workflow for tests")
    fields.setdefault("parameters", OPEN_SCHEMA)
    return WorkflowTool(name=name, **fields)


def client_tool(name: str = "show_map", **fields: Any) -> ClientTool:
    fields.setdefault("description", "Show a map to the customer.")
    fields.setdefault("parameters", OPEN_SCHEMA)
    return ClientTool(name=name, **fields)


def registry_with(*handlers: FakeHandler) -> HandlerRegistry:
    registry = HandlerRegistry()
    for handler in handlers:
        registry.register(handler.name)(handler)
    return registry


def make_catalog(
    *tenant_tools: ToolDefinition,
    builtins: tuple[ToolDefinition, ...] = (),
    handlers: tuple[FakeHandler, ...] = (),
    registry: HandlerRegistry | None = None,
    backend: ToolBackend | None = None,
) -> Catalog:
    """A Catalog of the given tenant tools (version 1) and built-ins.

    Python/workflow tools get a FakeHandler of their handler name unless one is passed in.
    """
    if registry is None:
        given = {h.name: h for h in handlers}
        for d in (*builtins, *tenant_tools):
            handler_name = getattr(d, "handler", None)
            if handler_name is not None and handler_name not in given:
                given[handler_name] = FakeHandler(handler_name)
        registry = registry_with(*given.values())
    return build_catalog(
        builtins, [(d, 1) for d in tenant_tools], registry=registry, backend=backend
    )
