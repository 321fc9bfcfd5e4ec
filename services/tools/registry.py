"""Compile published tool definitions into handlers with known compilers; the running catalog.

Seed 001: "A known compiler selects the appropriate handler type. It does not execute arbitrary
Python". Each family has one compiler here; a `python` or `workflow` row may bind only to a name
registered in code through `HandlerRegistry.register`. Built-ins win over tenant tools of the same
name (seed 000: "Built-in name -> built-in handler"); the shadowed row is reported, not loaded.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol

import msgspec

from kernel.errors import InvalidInput
from services.llm.port import ToolSpec
from services.tools.context import TrustedContext
from services.tools.model import (
    TOOL_NAME_RE,
    BackendBindingTool,
    ClientTool,
    PythonTool,
    ToolDefinition,
    WebhookTool,
    WorkflowTool,
    model_facing_parameters,
)
from services.tools.validation import check_any_schema, check_schema, validator_for

Handler = Callable[[dict[str, Any], TrustedContext], Awaitable[Any]]


class ToolBackend(Protocol):
    """The HTTP side of webhook and binding tools (services.tools.webhook implements it)."""

    async def call_webhook(
        self, tool: WebhookTool, args: dict[str, Any], *, timeout_s: float, idempotency_key: str | None
    ) -> Any: ...

    async def call_binding(
        self,
        tool: BackendBindingTool,
        args: dict[str, Any],
        *,
        ctx: TrustedContext,
        timeout_s: float,
        idempotency_key: str | None,
    ) -> Any: ...


class WorkflowStarter(Protocol):
    """Starts workflow jobs (services.workflows implements it)."""

    async def start(
        self, tool: WorkflowTool, handler: Handler | None, args: dict[str, Any], ctx: TrustedContext
    ) -> JobStarted: ...

    async def await_client(self, tool: ClientTool, args: dict[str, Any], ctx: TrustedContext) -> str:
        """Open a job the client UI answers; returns its id."""
        ...


class JobStarted(msgspec.Struct, frozen=True, kw_only=True):
    """What a workflow tool returns at once: a reference to the job that finishes later."""

    job_id: str
    status: str = "running"
    note: str = (
        "The task runs in the background; tell the customer you started it and that the result "
        "will follow in this conversation."
    )


class ClientAction(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What a `client` tool produces: an event for the UI; nothing runs server-side.

    With `job_id`, the client may answer: `POST /v1/jobs/{job_id}/result` delivers its answer
    into the session on the next turn, like a workflow's result.
    """

    name: str
    arguments: dict[str, Any]
    job_id: str | None = None


class SetVariables(msgspec.Struct, frozen=True, kw_only=True):
    """What a code-registered handler may return to set session variables besides its result.

    `result` is what the model reads (as if returned alone); `variables` are set on the session
    only when the call succeeds. Upstream HTTP answers are decoded to plain JSON, so only code
    registered in this engine can produce this marker, never a tenant's webhook.
    """

    result: Any = None
    variables: dict[str, str] = {}


class CompileError(Exception):
    def __init__(self, message: str, *, tool_name: str) -> None:
        super().__init__(message)
        self.tool_name = tool_name


class HandlerRegistry:
    """Handlers registered in code by name: the only things `python`/`workflow` rows may bind to."""

    def __init__(self) -> None:
        self._handlers: dict[str, Handler] = {}

    def register(self, name: str) -> Callable[[Handler], Handler]:
        def decorate(fn: Handler) -> Handler:
            if name in self._handlers and self._handlers[name] is not fn:
                raise ValueError(f"handler {name!r} is already registered")
            self._handlers[name] = fn
            return fn

        return decorate

    def get(self, name: str) -> Handler | None:
        return self._handlers.get(name)

    def names(self) -> list[str]:
        return sorted(self._handlers)


class CompiledTool:
    """A definition joined to the handler that actually runs it."""

    __slots__ = ("definition", "handler", "origin", "output_validator", "runs", "spec", "validator", "version")

    def __init__(
        self, definition: ToolDefinition, handler: Handler, *, origin: str, runs: str, version: int
    ) -> None:
        self.definition = definition
        self.handler = handler
        self.origin = origin  # "builtin" | "tenant"
        self.runs = runs  # what really executes, for operators ("GET https://.../{order_id}")
        self.validator = validator_for(definition.parameters, sensitive=definition.sensitive)
        schema = definition.output_schema
        self.output_validator = (
            validator_for(schema, sensitive=definition.sensitive, subject="result") if schema else None
        )
        self.version = version
        #: what the model is offered of it, made once here (the offer is built every turn): the
        #: schema without protected keys at any depth (model_facing_parameters). The executor
        #: drops the model's value for those, fills the trusted one and validates the whole
        #: schema, so a required `account_id` is met by the trusted scope, never asked of the model.
        self.spec = ToolSpec(name=definition.name, description=definition.description,
                             input_schema=model_facing_parameters(definition.parameters, definition.protected_keys))

    @property
    def name(self) -> str:
        return self.definition.name


def compile_tool(
    definition: ToolDefinition,
    *,
    registry: HandlerRegistry,
    backend: ToolBackend | None,
    origin: str = "tenant",
    version: int = 1,
    workflows: WorkflowStarter | None = None,
) -> CompiledTool:
    """Turn one definition into a CompiledTool. Raises CompileError when no handler fits or
    the parameter schema is unusable."""
    name = definition.name
    if not TOOL_NAME_RE.match(name):
        # refused on save since names are matched whole; one stored before (`"lookup\n"`) would
        # make the model API refuse every request that offers it, every turn of the tenant
        raise CompileError(f"the name {name[:70]!r} is not a tool name (a letter, then letters, digits, '_' or '-', "
                           "64 at most); create the tool again under a valid name", tool_name=name)
    try:
        # Also checked on save; checked again here because a broken schema would otherwise
        # raise from argument validation mid-turn instead of failing in-band or in `problems`.
        check_schema(definition.parameters)
        if definition.output_schema is not None:
            check_any_schema(definition.output_schema, where="$.output_schema")
    except InvalidInput as exc:
        raise CompileError(str(exc), tool_name=name) from None
    if isinstance(definition, WebhookTool):
        if backend is None:
            raise CompileError("no webhook client is configured", tool_name=name)

        async def call_webhook(args: dict[str, Any], ctx: TrustedContext, _d=definition) -> Any:
            return await backend.call_webhook(
                _d, args, timeout_s=_d.timeout_ms / 1000, idempotency_key=ctx.idempotency_key
            )

        return CompiledTool(
            definition, call_webhook, origin=origin, version=version,
            runs=f"webhook {definition.method} {definition.webhook_url}",
        )
    if isinstance(definition, BackendBindingTool):
        if backend is None:
            raise CompileError("no backend client is configured", tool_name=name)

        async def call_binding(args: dict[str, Any], ctx: TrustedContext, _d=definition) -> Any:
            return await backend.call_binding(
                _d, args, ctx=ctx, timeout_s=_d.timeout_ms / 1000, idempotency_key=ctx.idempotency_key
            )

        return CompiledTool(
            definition, call_binding, origin=origin, version=version,
            runs=f"binding {definition.method} {definition.path}",
        )
    if isinstance(definition, WorkflowTool):
        return _compile_workflow(definition, registry=registry, workflows=workflows, origin=origin, version=version)
    if isinstance(definition, PythonTool):
        handler = registry.get(definition.handler)
        if handler is None:
            raise CompileError(
                f"handler {definition.handler!r} is not registered in this engine", tool_name=name
            )
        kind = "python" if isinstance(definition, PythonTool) else "workflow"
        return CompiledTool(
            definition, handler, origin=origin, version=version, runs=f"{kind} {definition.handler}"
        )
    if isinstance(definition, ClientTool):

        async def to_client(args: dict[str, Any], ctx: TrustedContext, _d=definition) -> Any:
            job_id = await workflows.await_client(_d, args, ctx) if workflows is not None else None
            return ClientAction(name=_d.name, arguments=args, job_id=job_id)

        return CompiledTool(definition, to_client, origin=origin, version=version, runs="client event")
    raise CompileError(f"unknown tool family {type(definition).__name__}", tool_name=name)


def _compile_workflow(
    definition: WorkflowTool, *, registry: HandlerRegistry, workflows: WorkflowStarter | None,
    origin: str, version: int,
) -> CompiledTool:
    name = definition.name
    if workflows is None:
        raise CompileError("no workflow runner is configured", tool_name=name)
    if (definition.handler is None) == (definition.start_url is None):
        raise CompileError("a workflow tool needs exactly one of `handler` or `start_url`", tool_name=name)
    handler = None
    if definition.handler is not None:
        handler = registry.get(definition.handler)
        if handler is None:
            raise CompileError(
                f"handler {definition.handler!r} is not registered in this engine", tool_name=name
            )
    runs = f"workflow {definition.handler}" if definition.handler else f"workflow POST {definition.start_url}"

    async def start(args: dict[str, Any], ctx: TrustedContext, _d=definition, _h=handler) -> Any:
        return await workflows.start(_d, _h, args, ctx)

    return CompiledTool(definition, start, origin=origin, version=version, runs=runs)


class Catalog:
    """The tools one tenant's sessions can resolve: built-ins first, then published tenant tools."""

    def __init__(self, tools: dict[str, CompiledTool], problems: dict[str, str], *, revision: int = 0) -> None:
        self._tools = tools
        self.problems = problems  # tool name -> why it is not loaded (contract report input)
        self.revision = revision

    def get(self, name: str) -> CompiledTool | None:
        return self._tools.get(name)

    def __iter__(self):
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)

    def names(self) -> list[str]:
        return list(self._tools)


def build_catalog(
    builtins: Iterable[ToolDefinition],
    tenant_tools: Iterable[tuple[ToolDefinition, int]],
    *,
    registry: HandlerRegistry,
    backend: ToolBackend | None,
    revision: int = 0,
    workflows: WorkflowStarter | None = None,
) -> Catalog:
    """Compile built-ins and (definition, version) tenant rows into one Catalog.

    A tenant tool named like a built-in is not loaded: the built-in runs and the shadowing is
    recorded in `problems` (the contract report's "handler override").
    """
    tools: dict[str, CompiledTool] = {}
    problems: dict[str, str] = {}
    for definition in builtins:
        tools[definition.name] = compile_tool(
            definition, registry=registry, backend=backend, origin="builtin", workflows=workflows
        )
    for definition, version in tenant_tools:
        if definition.name in tools and tools[definition.name].origin == "builtin":
            problems[definition.name] = "handler override: the built-in tool of this name runs instead"
            continue
        try:
            tools[definition.name] = compile_tool(
                definition, registry=registry, backend=backend, version=version, workflows=workflows
            )
        except CompileError as exc:
            problems[definition.name] = str(exc)
    return Catalog(tools, problems, revision=revision)
