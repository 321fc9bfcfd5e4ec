"""Compiling definitions into handlers with known compilers, and the catalog built from them."""

from __future__ import annotations

import pytest

from services.tools.context import TrustedContext
from services.tools.model import ToolDefinition, WorkflowTool
from services.tools.registry import (
    ClientAction,
    CompileError,
    HandlerRegistry,
    JobStarted,
    build_catalog,
    compile_tool,
)
from tests.support.fakes import (
    FakeHandler,
    FakeToolBackend,
    binding_tool,
    client_tool,
    python_tool,
    registry_with,
    webhook_tool,
    workflow_tool,
)

CTX = TrustedContext(tenant_id="t1", session_id="s1", message_id="m1", idempotency_key="m1:call-1")


# -- python / workflow rows bind only to registered handlers -----------------------------------


@pytest.mark.parametrize("make", [python_tool, workflow_tool], ids=["python", "workflow"])
@pytest.mark.parametrize(
    "handler_name",
    # names that exist somewhere in the process: none of them may be resolved
    ["not_registered", "os.system", "builtins.print", "services.tools.registry.compile_tool", "eval"],
)
def test_code_rows_bind_only_to_registered_handlers(make, handler_name: str) -> None:
    registry = registry_with(FakeHandler("registered"))
    definition = make("t", handler=handler_name)
    with pytest.raises(CompileError, match=f"handler '{handler_name}' is not registered in this engine") as info:
        compile_tool(definition, registry=registry, backend=None, workflows=FakeWorkflows())
    assert info.value.tool_name == "t"


async def test_python_row_runs_exactly_the_registered_handler() -> None:
    handler = FakeHandler("leads.collect", result={"lead_id": "L1"})
    compiled = compile_tool(python_tool("collect_lead", handler="leads.collect"), registry=registry_with(handler), backend=None)
    assert compiled.handler is handler
    assert compiled.runs == "python leads.collect"
    assert await compiled.handler({"q": "x"}, CTX) == {"lead_id": "L1"}
    assert handler.calls == [({"q": "x"}, CTX)]


async def test_workflow_row_starts_a_job_with_exactly_the_registered_handler() -> None:
    handler = FakeHandler("reports.build")
    workflows = FakeWorkflows()
    definition = workflow_tool("build_report", handler="reports.build")
    compiled = compile_tool(definition, registry=registry_with(handler), backend=None, workflows=workflows)
    assert compiled.runs == "workflow reports.build"
    started = await compiled.handler({"q": "x"}, CTX)
    assert started == JobStarted(job_id="job-1")
    assert workflows.started == [(definition, handler, {"q": "x"}, CTX)]
    assert handler.calls == []  # the job runs in the background, not in the call


@pytest.mark.parametrize("fields", [{}, {"handler": "reports.build", "start_url": "https://x.test/jobs"}])
def test_workflow_row_needs_exactly_one_of_handler_or_start_url(fields) -> None:
    definition = WorkflowTool(name="w", description="d", parameters={"type": "object"}, **fields)
    with pytest.raises(CompileError, match="exactly one of `handler` or `start_url`"):
        compile_tool(definition, registry=registry_with(FakeHandler("reports.build")), backend=None, workflows=FakeWorkflows())


def test_workflow_row_without_a_runner_is_not_loaded() -> None:
    with pytest.raises(CompileError, match="no workflow runner"):
        compile_tool(workflow_tool("w", handler="x"), registry=HandlerRegistry(), backend=None)


class FakeWorkflows:
    def __init__(self) -> None:
        self.started: list = []

    async def start(self, tool, handler, args, ctx):
        self.started.append((tool, handler, args, ctx))
        return JobStarted(job_id=f"job-{len(self.started)}")


def test_registering_a_different_handler_under_a_taken_name_raises() -> None:
    registry = HandlerRegistry()
    registry.register("lookup")(FakeHandler("lookup"))
    with pytest.raises(ValueError, match="handler 'lookup' is already registered"):
        registry.register("lookup")(FakeHandler("lookup"))


def test_registering_the_same_handler_twice_is_idempotent() -> None:
    registry = HandlerRegistry()
    handler = FakeHandler("lookup")
    registry.register("lookup")(handler)
    assert registry.register("lookup")(handler) is handler
    assert registry.names() == ["lookup"]
    assert registry.get("lookup") is handler


# -- what runs, per family ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("definition", "runs"),
    [
        (webhook_tool(), "webhook GET https://mystore.com/api/orders/{order_id}"),
        (webhook_tool(method="POST", webhook_url="https://crm.test/leads"), "webhook POST https://crm.test/leads"),
        (binding_tool(), "binding GET /example/catalog"),
        (python_tool("lookup"), "python lookup"),
        (workflow_tool("book"), "workflow book"),
        (client_tool(), "client event"),
    ],
    ids=["webhook-get", "webhook-post", "binding", "python", "workflow", "client"],
)
def test_compiled_tool_runs_describes_what_executes(definition: ToolDefinition, runs: str) -> None:
    registry = registry_with(FakeHandler("lookup"), FakeHandler("book"))
    compiled = compile_tool(definition, registry=registry, backend=FakeToolBackend(), version=7, workflows=FakeWorkflows())
    assert compiled.runs == runs
    assert compiled.name == definition.name
    assert compiled.definition is definition
    assert compiled.version == 7
    assert compiled.origin == "tenant"


@pytest.mark.parametrize(
    ("definition", "message"),
    [
        (webhook_tool(), "no webhook client is configured"),
        (binding_tool(), "no backend client is configured"),
    ],
    ids=["webhook", "binding"],
)
def test_http_families_need_a_backend(definition: ToolDefinition, message: str) -> None:
    with pytest.raises(CompileError, match=message):
        compile_tool(definition, registry=HandlerRegistry(), backend=None)


async def test_compiled_webhook_calls_the_backend_with_its_timeout_and_idempotency_key() -> None:
    backend = FakeToolBackend({"check_order": {"status": "shipped"}})
    compiled = compile_tool(webhook_tool(timeout_ms=2500), registry=HandlerRegistry(), backend=backend)
    assert await compiled.handler({"order_id": "12345"}, CTX) == {"status": "shipped"}
    [call] = backend.calls
    assert (call.kind, call.tool_name, call.args) == ("webhook", "check_order", {"order_id": "12345"})
    assert call.timeout_s == 2.5
    assert call.idempotency_key == "m1:call-1"


async def test_compiled_binding_passes_the_trusted_context_to_the_backend() -> None:
    backend = FakeToolBackend()
    compiled = compile_tool(binding_tool(timeout_ms=800), registry=HandlerRegistry(), backend=backend)
    await compiled.handler({"search": "lamp"}, CTX)
    [call] = backend.calls
    assert (call.kind, call.args, call.ctx) == ("binding", {"search": "lamp"}, CTX)
    assert call.timeout_s == 0.8
    assert call.idempotency_key == "m1:call-1"


async def test_compiled_client_tool_produces_a_client_action_and_calls_nothing() -> None:
    backend = FakeToolBackend()
    compiled = compile_tool(client_tool("show_map"), registry=HandlerRegistry(), backend=backend)
    action = await compiled.handler({"q": "Lisbon"}, CTX)
    assert action == ClientAction(name="show_map", arguments={"q": "Lisbon"})
    assert backend.calls == []


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        # seed 000's map form must be normalised before it is compiled
        ({"order_id": {"type": "string"}}, r"parameters must be a JSON-schema object"),
        ({"type": "object", "properties": {"n": {"type": "strng"}}}, r"invalid JSON schema: .*strng"),
    ],
    ids=["map-form", "unknown-type"],
)
def test_a_definition_with_an_unusable_schema_does_not_compile(parameters: dict, message: str) -> None:
    # otherwise the first call crashes argument validation instead of failing in-band
    registry = registry_with(FakeHandler("t"))
    with pytest.raises(CompileError, match=message):
        compile_tool(python_tool("t", parameters=parameters), registry=registry, backend=None)


# -- build_catalog -------------------------------------------------------------------------------


def test_builtin_wins_over_a_tenant_tool_of_the_same_name_and_the_override_is_reported() -> None:
    registry = registry_with(FakeHandler("leads.builtin"))
    catalog = build_catalog(
        [python_tool("collect_lead", handler="leads.builtin", mutability="write")],
        [(webhook_tool("collect_lead", webhook_url="https://tenant.test/leads"), 3)],
        registry=registry,
        backend=FakeToolBackend(),
    )
    tool = catalog.get("collect_lead")
    assert tool is not None
    assert (tool.origin, tool.runs) == ("builtin", "python leads.builtin")
    assert catalog.problems == {
        "collect_lead": "handler override: the built-in tool of this name runs instead"
    }
    assert len(catalog) == 1


def test_a_tool_that_fails_to_compile_does_not_prevent_the_others() -> None:
    registry = registry_with(FakeHandler("lookup"))
    catalog = build_catalog(
        [],
        [
            (python_tool("ghost", handler="nowhere"), 1),
            (python_tool("lookup"), 2),
            (python_tool("broken_schema", handler="lookup", parameters={"type": "array"}), 1),
            (client_tool("show_map"), 4),
        ],
        registry=registry,
        backend=None,
        revision=9,
    )
    assert catalog.names() == ["lookup", "show_map"]
    assert catalog.get("ghost") is None
    assert catalog.problems["ghost"] == "handler 'nowhere' is not registered in this engine"
    assert "JSON-schema object" in catalog.problems["broken_schema"]
    assert catalog.get("lookup").version == 2
    assert catalog.revision == 9


def test_tools_stored_before_their_names_or_schemas_were_checked_whole_are_left_out_and_reported() -> None:
    # a name ending in a line break (saved while `^...$` let it through) would make the model API
    # refuse every request that offers it; a schema whose $refs fan out would stall the host
    registry = registry_with(FakeHandler("lookup"))
    defs = {"d0": {"type": "object"}} | {
        f"d{i}": {"allOf": [{"$ref": f"#/$defs/d{i - 1}"}, {"$ref": f"#/$defs/d{i - 1}"}]} for i in range(1, 31)}
    fanning = {"type": "object", "$defs": defs, "allOf": [{"$ref": "#/$defs/d30"}]}
    catalog = build_catalog(
        [],
        [(python_tool("lookup\n", handler="lookup"), 1), (python_tool("lookup"), 2),
         (python_tool("fan", handler="lookup", parameters=fanning), 1)],
        registry=registry, backend=None,
    )
    assert catalog.names() == ["lookup"]
    assert "is not a tool name" in catalog.problems["lookup\n"]
    assert "unfold" in catalog.problems["fan"]


def test_catalog_lists_builtins_before_tenant_tools() -> None:
    registry = registry_with(FakeHandler("recall_memory"), FakeHandler("lookup"))
    catalog = build_catalog(
        [python_tool("recall_memory")],
        [(python_tool("lookup"), 1), (client_tool("show_map"), 1)],
        registry=registry,
        backend=None,
    )
    assert [t.name for t in catalog] == ["recall_memory", "lookup", "show_map"]
    assert [t.origin for t in catalog] == ["builtin", "tenant", "tenant"]
    assert catalog.problems == {}
