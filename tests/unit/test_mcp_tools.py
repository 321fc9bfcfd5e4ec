"""MCP as a tool source, the pure parts: catalog names, untrusted hints, results, compilation and
the catalog source, with a fake connector and store (no network, no SDK session)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from kernel.errors import InvalidInput
from kernel.records import McpServerRecord
from services.botconfig import BotConfig
from services.tools.context import TrustedContext
from services.tools.crypto import SecretBox, generate_key
from services.tools.errors import DestinationBlocked, UpstreamUnreachable
from services.tools.executor import Executor, ToolCall
from services.tools.mcp import (
    MAX_TOOL_NAME,
    McpCallResult,
    McpCatalogSource,
    McpToolFailed,
    McpToolInfo,
    catalog_name,
    check_server_name,
    compile_server_tools,
    mutability_for,
    result_value,
    server_problem_key,
    split_catalog_name,
    with_mcp_tools,
)
from services.tools.model import TOOL_NAME_RE
from services.tools.registry import Catalog, HandlerRegistry, build_catalog
from services.tools.toolset import SessionToolState, build_tool_set

SCHEMA = {"type": "object", "properties": {"ref": {"type": "string"}}, "required": ["ref"]}
CTX = TrustedContext(tenant_id="t1", session_id="s1", message_id="m1", idempotency_key="m1")


def server(**kw: Any) -> McpServerRecord:
    return McpServerRecord(**{"tenant_id": "t1", "name": "shop", "url": "https://mcp.example.com/mcp", **kw})


def info(name: str, **kw: Any) -> McpToolInfo:
    return McpToolInfo(**{"name": name, "description": f"{name} tool", "input_schema": SCHEMA, **kw})


class FakeConnector:
    """services.tools.mcp.McpConnector: answers from `listing` and `results`, records calls."""

    def __init__(self, listing: dict[str, list[McpToolInfo] | Exception] | None = None,
                 results: dict[str, McpCallResult] | None = None) -> None:
        self.listing = listing or {}
        self.results = results or {}
        self.listed: list[tuple[str, str | None]] = []
        self.calls: list[dict[str, Any]] = []

    async def list_tools(self, url: str, *, auth_header: str | None, timeout_s: float) -> list[McpToolInfo]:
        self.listed.append((url, auth_header))
        answer = self.listing[url]
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def call_tool(self, url: str, name: str, arguments: dict[str, Any], *, auth_header: str | None,
                        timeout_s: float, idempotency_key: str | None = None) -> McpCallResult:
        self.calls.append({"url": url, "name": name, "arguments": arguments, "auth": auth_header,
                           "key": idempotency_key, "timeout_s": timeout_s})
        return self.results.get(name, McpCallResult(texts=["ok"]))


class FakeStore:
    def __init__(self, records: list[McpServerRecord]) -> None:
        self.records = records

    async def list(self, tenant_id: str) -> list[McpServerRecord]:
        return [r for r in self.records if r.tenant_id == tenant_id]


def compiled(record: McpServerRecord, *tools: McpToolInfo, connector: FakeConnector | None = None):
    return compile_server_tools(record, list(tools), connector or FakeConnector(), open_auth=lambda: None)


# -- names ----------------------------------------------------------------------------------------

def test_a_plain_remote_name_is_prefixed_with_the_server() -> None:
    assert catalog_name("shop", "get_order") == "shop__get_order"
    assert split_catalog_name("shop__get_order") == ("shop", "get_order")
    assert split_catalog_name("crm-eu_2__find__deep") == ("crm-eu_2", "find__deep")


@pytest.mark.parametrize("remote", ["orders.get", "a/b c", "ü-tool", "x" * 80, "orders.get.v2", "____"])
def test_a_remote_name_that_is_no_valid_tool_name_is_cleaned_and_hashed(remote: str) -> None:
    name = catalog_name("shop", remote)
    assert TOOL_NAME_RE.match(name) and len(name) <= MAX_TOOL_NAME
    assert name.startswith("shop__")


def test_cleaned_names_of_different_remote_tools_stay_different() -> None:
    remotes = ["orders.get", "orders/get", "orders get", "orders_get", "x" * 70, "x" * 71]
    names = {catalog_name("shop", r) for r in remotes}
    assert len(names) == len(remotes)


@pytest.mark.parametrize("name", ["shop", "crm-eu", "a_b", "s3_v2-x"])
def test_server_names_that_split_unambiguously_are_accepted(name: str) -> None:
    check_server_name(name)


@pytest.mark.parametrize("name", ["a__b", "shop_", "_shop", "1shop", "", "sh op", "x" * 25, "shop.eu"])
def test_server_names_that_could_make_two_tools_share_a_name_are_refused(name: str) -> None:
    with pytest.raises(InvalidInput, match="server name"):
        check_server_name(name)


# -- hints are untrusted --------------------------------------------------------------------------

@pytest.mark.parametrize(("hints", "tenant_says_read", "expected"), [
    ({}, False, "write"),
    ({"read_only_hint": True}, False, "write"),  # the server's word alone never makes a read
    ({"read_only_hint": True, "destructive_hint": False}, False, "write"),
    ({}, True, "read"),
    ({"read_only_hint": False}, True, "read"),  # the tenant vouches for it
    ({"destructive_hint": True}, True, "write"),  # destructive stays a write even when the tenant says read
    ({"read_only_hint": True, "destructive_hint": True}, True, "write"),
])
def test_only_the_tenant_makes_a_tool_read_and_destructive_is_always_a_write(
    hints: dict[str, bool], tenant_says_read: bool, expected: str
) -> None:
    tool = info("t", **hints)
    assert mutability_for(tool, ["t"] if tenant_says_read else []) == expected


async def test_a_write_tool_of_an_mcp_server_is_held_for_approval_whatever_its_hints_say() -> None:
    record = server(read_only_tools=("lookup",))
    tools, problems = compiled(record, info("lookup"), info("wipe", read_only_hint=True),
                               info("purge", destructive_hint=True))
    by_name = {t.name: t for t in tools}
    assert not problems
    assert by_name["shop__lookup"].definition.needs_approval is False
    assert by_name["shop__wipe"].definition.mutability == "write"
    assert by_name["shop__wipe"].definition.needs_approval is True
    assert by_name["shop__purge"].definition.needs_approval is True
    assert by_name["shop__wipe"].definition.hints == {"readOnlyHint": True}  # kept for operators only
    plan = await Executor().prepare([ToolCall(id="c1", name="shop__wipe", arguments={"ref": "x"})],
                                    catalog=Catalog(by_name, {}), config=BotConfig(),
                                    session=SessionToolState(), scope={})
    assert plan.needs_approval


# -- results --------------------------------------------------------------------------------------

def test_text_content_is_joined() -> None:
    assert result_value(McpCallResult(texts=["line one", "", "line two"])) == "line one\nline two"


def test_structured_content_is_the_result() -> None:
    result = McpCallResult(texts=['{"status": "shipped"}'], structured={"status": "shipped", "eta": 3})
    assert result_value(result) == {"status": "shipped", "eta": 3}


def test_an_empty_result_is_none() -> None:
    assert result_value(McpCallResult()) is None


def test_an_is_error_result_is_an_in_band_tool_error_counting_for_the_breaker() -> None:
    with pytest.raises(McpToolFailed, match="the tool reported an error: stock service down") as exc:
        result_value(McpCallResult(texts=["stock service\n down"], is_error=True))
    assert exc.value.counts_for_breaker


# -- compilation ----------------------------------------------------------------------------------

async def test_a_compiled_tool_calls_the_remote_name_with_the_arguments_and_the_servers_timeout() -> None:
    connector = FakeConnector(results={"get.order": McpCallResult(structured={"status": "shipped"})})
    record = server(read_only_tools=("get.order",), timeout_ms=2500, intents=("orders",))
    [tool], _ = compiled(record, info("get.order"), connector=connector)
    assert tool.origin == "mcp" and tool.definition.intents == ("orders",)
    assert tool.definition.timeout_ms == 2500 and "tools/call get.order" in tool.runs
    assert await tool.handler({"ref": "A1"}, CTX) == {"status": "shipped"}
    assert connector.calls == [{"url": record.url, "name": "get.order", "arguments": {"ref": "A1"},
                                "auth": None, "key": None, "timeout_s": 2.5}]


async def test_a_write_tool_sends_the_calls_idempotency_key() -> None:
    connector = FakeConnector()
    [tool], _ = compiled(server(), info("wipe"), connector=connector)
    await tool.handler({"ref": "x"}, CTX)
    assert connector.calls[0]["key"] == "m1"


def test_include_tools_keeps_only_the_named_remote_tools() -> None:
    tools, _ = compiled(server(include_tools=("a",)), info("a"), info("b"))
    assert [t.name for t in tools] == ["shop__a"]


def test_a_tool_with_an_unusable_schema_is_reported_not_loaded() -> None:
    bad = info("broken", input_schema={"type": "object", "properties": {"x": {"type": 7}}})
    tools, problems = compiled(server(), info("fine"), bad)
    assert [t.name for t in tools] == ["shop__fine"]
    assert "unusable input schema" in problems["shop__broken"]


def test_an_empty_description_names_the_server() -> None:
    [tool], _ = compiled(server(), info("x", description=""))
    assert tool.definition.description == "x (a tool of the shop service)"


def test_a_tenant_or_builtin_tool_keeps_its_name_over_an_mcp_tool() -> None:
    registry = HandlerRegistry()

    @registry.register("h")
    async def handler(args, ctx):  # pragma: no cover - never called
        return None

    from services.tools.model import PythonTool
    base = build_catalog([], [(PythonTool(name="shop__a", description="d", parameters=SCHEMA, handler="h"), 1)],
                         registry=registry, backend=None)
    tools, _ = compiled(server(), info("a"), info("b"))
    merged = with_mcp_tools(base, tools, {})
    assert merged.get("shop__a").origin == "tenant" and merged.get("shop__b").origin == "mcp"
    assert "runs instead" in merged.problems["shop__a"]


def test_mcp_tools_are_gated_like_any_other_tool() -> None:
    tools, _ = compiled(server(read_only_tools=("a",)), info("a"), info("w"))
    catalog = Catalog({t.name: t for t in tools}, {})

    def offered(config: BotConfig, state: SessionToolState | None = None) -> list[str]:
        return [t.name for t in build_tool_set(config, None, state or SessionToolState(), catalog)]

    assert offered(BotConfig()) == ["shop__a", "shop__w"]
    assert offered(BotConfig(allow_writes=False)) == ["shop__a"]
    assert offered(BotConfig(allowlist=["shop__w"])) == ["shop__w"]
    assert offered(BotConfig(), SessionToolState(breakers={"shop__a": 3})) == ["shop__w"]


# -- the catalog source ---------------------------------------------------------------------------

async def test_a_disabled_server_is_not_contacted_and_offers_nothing() -> None:
    connector = FakeConnector({"https://on/mcp": [info("a")]})
    store = FakeStore([server(name="on", url="https://on/mcp"),
                       server(name="off", url="https://off/mcp", enabled=False)])
    loaded = await McpCatalogSource(store, connector, secret_box=None).load("t1")
    assert [t.name for t in loaded.tools] == ["on__a"] and loaded.complete
    assert connector.listed == [("https://on/mcp", None)]


async def test_a_server_that_cannot_be_listed_is_a_problem_and_the_load_asks_for_a_retry() -> None:
    refused = DestinationBlocked("destination not allowed")
    refused.rule = "link-local address (cloud metadata)"  # type: ignore[attr-defined]
    connector = FakeConnector({"https://ok/mcp": [info("a")], "http://169.254.169.254/mcp": refused,
                               "https://down/mcp": UpstreamUnreachable("could not connect to the mcp server")})
    store = FakeStore([server(name="ok", url="https://ok/mcp"), server(name="meta", url="http://169.254.169.254/mcp"),
                       server(name="down", url="https://down/mcp")])
    loaded = await McpCatalogSource(store, connector, secret_box=None).load("t1")
    assert [t.name for t in loaded.tools] == ["ok__a"] and not loaded.complete
    assert loaded.problems[server_problem_key("meta")] == (
        "mcp server 'meta' could not be listed: destination not allowed (link-local address (cloud metadata))")
    assert "could not connect" in loaded.problems["down__*"]


async def test_the_auth_header_is_decrypted_for_each_use_and_reaches_the_connector() -> None:
    box = SecretBox([generate_key()])
    connector = FakeConnector({"https://s/mcp": [info("a")]})
    store = FakeStore([server(name="s", url="https://s/mcp", auth_header_enc=box.encrypt("Bearer s3cret"))])
    loaded = await McpCatalogSource(store, connector, secret_box=box).load("t1")
    assert connector.listed == [("https://s/mcp", "Bearer s3cret")]
    await loaded.tools[0].handler({"ref": "x"}, CTX)
    assert connector.calls[0]["auth"] == "Bearer s3cret"
    assert "s3cret" not in repr(loaded.tools[0].definition) and "s3cret" not in msgspec.json.encode(
        loaded.tools[0].definition).decode()


async def test_an_auth_header_that_cannot_be_opened_is_a_problem_without_the_secret() -> None:
    token = SecretBox([generate_key()]).encrypt("Bearer s3cret")
    connector = FakeConnector({"https://s/mcp": [info("a")]})
    store = FakeStore([server(name="s", url="https://s/mcp", auth_header_enc=token)])
    loaded = await McpCatalogSource(store, connector, secret_box=SecretBox([generate_key()])).load("t1")
    assert loaded.tools == [] and connector.listed == []
    assert "cannot be decrypted" in loaded.problems["s__*"] and token not in loaded.problems["s__*"]
