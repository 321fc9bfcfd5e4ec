"""MCP servers as a tool source: a tenant's registered servers become tools of its catalog.

Owns the rules, pure of I/O frameworks:
- naming (`catalog_name`): a remote tool `get_order` of the tenant's server `shop` is offered as
  `shop__get_order`. Server names hold no `__` and do not end in `_`, so the first `__` always
  splits a catalog name back into (server, tool); a remote name that is not a valid tool name
  (dots, too long) is cleaned and suffixed with a hash of the original, so two remote tools never
  map to one catalog name silently (a clash that remains is reported and the second is skipped);
- mutability (`mutability_for`): the server's annotations are untrusted hints. A tool is `read`
  only when the TENANT listed it in the registration's `read_only_tools`, and never when the
  server itself says it is destructive; everything else is `write`, so the executor holds it for
  approval like any other write tool. A `readOnlyHint` never lowers a tool to `read`;
- results (`result_value`): structured content is the result (JSON for the model); otherwise the
  text blocks are joined; an `isError` result is an in-band `McpToolFailed`, and structured
  content nested more than `MAX_VALUE_DEPTH` levels an in-band `UpstreamMalformed`;
- compilation (`compile_server_tools`): listed tools become `CompiledTool`s (origin `mcp`) whose
  handler calls the tool through an `McpConnector`, under the same executor pipeline as every
  other tool (gating, intents, breaker, approvals, limits, analytics);
- `McpCatalogSource`: what the tenant catalog loader calls: the tenant's registered servers,
  listed concurrently under a time limit; a server that cannot be listed adds a problem (the
  contract report shows it) instead of failing the catalog.

The SDK and the network live in `services.tools.mcp_client`; storage in
`storage.repos.mcp_servers`.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import structlog

from kernel.errors import InvalidInput
from services.nesting import nests_deeper_than
from services.tools.context import TrustedContext
from services.tools.errors import ToolError, UpstreamMalformed
from services.tools.model import MAX_VALUE_DEPTH, Mutability, ToolBase
from services.tools.registry import Catalog, CompiledTool
from services.tools.validation import check_schema, schemas_checked

log = structlog.get_logger(__name__)

ORIGIN = "mcp"
SEPARATOR = "__"
MAX_TOOL_NAME = 64  # the LLM APIs' limit on tool names (and services.tools.model.TOOL_NAME_RE)
MAX_SERVER_NAME = 24
MAX_DESCRIPTION = 1024
MAX_TOOLS_PER_SERVER = 64
DEFAULT_TIMEOUT_MS = 10_000
LIST_TIMEOUT_S = 5.0  # a catalog load waits at most this long for one server's tools/list

SERVER_NAME_RE = re.compile(r"^[a-zA-Z][a-zA-Z0-9-]*(?:_[a-zA-Z0-9-]+)*\Z")
_PLAIN_TOOL_RE = re.compile(r"^[a-zA-Z0-9_-]+\Z")
_UNSAFE_RE = re.compile(r"[^a-zA-Z0-9_-]+")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]+")

_FAILED_ADVICE = "Tell the customer you cannot complete this right now and offer another way to help."
_TOO_DEEP_ADVICE = ("Tell the customer you cannot read the answer from the service right now; calling it again "
                    "will not help until the business fixes what it returns.")


class McpTool(ToolBase, tag="mcp"):
    """A tool listed by a tenant's MCP server, as the catalog holds it (never stored as a row)."""

    server: str  # the registration's name (the catalog name's prefix)
    remote_name: str  # the tool's name on the server, sent in tools/call
    url: str  # the server's endpoint, for operators
    #: the server's annotations as listed: untrusted, shown to operators, never used for policy
    hints: dict[str, bool] = msgspec.field(default_factory=dict)


class McpToolInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One entry of a server's tools/list, reduced to what the engine uses."""

    name: str
    description: str = ""
    title: str | None = None
    input_schema: dict[str, Any] = {}
    read_only_hint: bool | None = None
    destructive_hint: bool | None = None
    idempotent_hint: bool | None = None
    open_world_hint: bool | None = None


class McpCallResult(msgspec.Struct, frozen=True, kw_only=True):
    """A tools/call result: the content blocks as text, the structured content, the error flag."""

    texts: list[str] = []
    structured: Any = msgspec.UNSET
    is_error: bool = False


class McpToolFailed(ToolError):
    """The MCP tool ran and reported an error (`isError: true`); counts toward its breaker."""

    kind = "mcp_tool_error"


class McpConnector(Protocol):
    """Port: list and call tools on one server URL (services.tools.mcp_client implements it)."""

    def for_tenant(self, allowances: tuple[tuple[str, int], ...]) -> McpConnector:
        """This connector, its destinations checked with one tenant's egress allowances added."""
        ...

    async def list_tools(self, url: str, *, auth_header: str | None, timeout_s: float) -> list[McpToolInfo]: ...

    async def call_tool(
        self, url: str, name: str, arguments: dict[str, Any], *, auth_header: str | None, timeout_s: float,
        idempotency_key: str | None = None,
    ) -> McpCallResult: ...


class McpServer(Protocol):
    """What a catalog reads of a registered server (a row of ce_mcp_servers, as the store gives it)."""

    @property
    def name(self) -> str: ...  # prefixes its tools' catalog names: <name>__<tool>
    @property
    def url(self) -> str: ...
    @property
    def auth_header_enc(self) -> str | None: ...  # ciphertext, opened with a SecretOpener
    @property
    def enabled(self) -> bool: ...
    @property
    def read_only_tools(self) -> tuple[str, ...]: ...
    @property
    def include_tools(self) -> tuple[str, ...] | None: ...
    @property
    def intents(self) -> tuple[str, ...]: ...
    @property
    def timeout_ms(self) -> int: ...


class McpServerStore(Protocol):
    """Port: a tenant's registered servers (storage.repos.mcp_servers implements it)."""

    async def list(self, tenant_id: str) -> Sequence[McpServer]: ...


class SecretOpener(Protocol):
    def decrypt(self, token: str) -> str: ...


# -- names ----------------------------------------------------------------------------------------

def check_server_name(name: str) -> None:
    """Raise InvalidInput unless `name` can prefix catalog names unambiguously."""
    if not SERVER_NAME_RE.match(name) or len(name) > MAX_SERVER_NAME:
        raise InvalidInput(
            f"server name {name[:40]!r} must be 1-{MAX_SERVER_NAME} letters, digits, '-' or single '_' "
            "between them, starting with a letter (its tools are offered as <name>__<tool>) - at `$.name`",
            path="$.name",
        )


def catalog_name(server: str, remote: str) -> str:
    """The catalog name of remote tool `remote` on server `server`: `server__remote`.

    A remote name with characters a tool name may not hold, or too long to fit, is cleaned
    (runs of other characters become `_`), cut, and suffixed with 8 hex digits of its SHA-256,
    so that different remote names keep different catalog names.
    """
    budget = MAX_TOOL_NAME - len(server) - len(SEPARATOR)
    if _PLAIN_TOOL_RE.match(remote) and len(remote) <= budget:
        return f"{server}{SEPARATOR}{remote}"
    digest = hashlib.sha256(remote.encode("utf-8")).hexdigest()[:8]
    cleaned = _UNSAFE_RE.sub("_", remote).strip("_")[: max(0, budget - len(digest) - 1)]
    return f"{server}{SEPARATOR}{cleaned}_{digest}" if cleaned else f"{server}{SEPARATOR}{digest}"


def split_catalog_name(name: str) -> tuple[str, str] | None:
    """(server, remote part) of a catalog name made by `catalog_name`, or None."""
    server, sep, rest = name.partition(SEPARATOR)
    return (server, rest) if sep and rest else None


def server_problem_key(server: str) -> str:
    """The `Catalog.problems` key for a whole server that could not be listed."""
    return f"{server}{SEPARATOR}*"


# -- mutability -----------------------------------------------------------------------------------

def mutability_for(tool: McpToolInfo, read_only_tools: Iterable[str]) -> Mutability:
    """`read` only if the tenant listed the tool as read-only and the server does not call it
    destructive; otherwise `write` (held for approval). The server's `readOnlyHint` is ignored:
    a hint may make a tool stricter, never looser."""
    if tool.name in set(read_only_tools) and tool.destructive_hint is not True:
        return "read"
    return "write"


def _hints(tool: McpToolInfo) -> dict[str, bool]:
    pairs = {"readOnlyHint": tool.read_only_hint, "destructiveHint": tool.destructive_hint,
             "idempotentHint": tool.idempotent_hint, "openWorldHint": tool.open_world_hint}
    return {k: v for k, v in pairs.items() if v is not None}


# -- results --------------------------------------------------------------------------------------

def result_value(result: McpCallResult) -> Any:
    """What the model reads: the structured content when there is some, else the text joined
    (None for an empty result). Raises McpToolFailed for an `isError` result, carrying the
    server's text (cleaned, cut to 300 characters), and UpstreamMalformed for structured content
    nested more than MAX_VALUE_DEPTH levels (the call record, redacted recursively, could not be
    made of it; the SDK itself decodes some 200 levels)."""
    text = "\n".join(t for t in result.texts if t)
    if result.is_error:
        shown = _clip(_CONTROL_RE.sub(" ", text), 300) or "no details given"
        raise McpToolFailed(f"the tool reported an error: {shown}", advice=_FAILED_ADVICE)
    if result.structured is not msgspec.UNSET and result.structured is not None:
        if nests_deeper_than(result.structured, MAX_VALUE_DEPTH):
            raise UpstreamMalformed(
                f"the tool's structured result nests more than {MAX_VALUE_DEPTH} levels deep, which is not read",
                advice=_TOO_DEEP_ADVICE,
            )
        return result.structured
    return text or None


# -- compilation ----------------------------------------------------------------------------------

def _parameters(schema: dict[str, Any]) -> dict[str, Any]:
    parameters = dict(schema) if isinstance(schema, dict) else {}
    parameters.setdefault("type", "object")
    if parameters.get("type") == "object":
        parameters.setdefault("properties", {})
    return parameters


def _description(server: McpServer, tool: McpToolInfo) -> str:
    text = _CONTROL_RE.sub(" ", tool.description or tool.title or "").strip()
    if not text:
        text = f"{tool.name} (a tool of the {server.name} service)"
    return _clip(text, MAX_DESCRIPTION)


def compile_server_tools(
    server: McpServer, listed: Sequence[McpToolInfo], connector: McpConnector,
    *, open_auth: Callable[[], str | None],
) -> tuple[list[CompiledTool], dict[str, str]]:
    """The catalog tools of one server's listing, and problems (catalog name -> why not loaded).

    `include_tools` (when set) keeps only the named remote tools; at most MAX_TOOLS_PER_SERVER
    are loaded. Remote tools are taken in name order, so which one wins a name clash is stable.
    """
    tools: list[CompiledTool] = []
    problems: dict[str, str] = {}
    names: set[str] = set()
    wanted = set(server.include_tools) if server.include_tools is not None else None
    for info in sorted(listed, key=lambda t: t.name):
        if wanted is not None and info.name not in wanted:
            continue
        name = catalog_name(server.name, info.name)
        if name in names:
            problems[name] = f"mcp tool {_clip(info.name, 80)!r} maps to a name another tool of this server has"
            continue
        if len(tools) >= MAX_TOOLS_PER_SERVER:
            problems[name] = f"mcp server {server.name!r} lists more than {MAX_TOOLS_PER_SERVER} tools; " \
                             "name the ones to load in `include_tools`"
            continue
        parameters = _parameters(info.input_schema)
        try:
            check_schema(parameters, where="$.inputSchema")
        except InvalidInput as exc:
            problems[name] = f"mcp tool {_clip(info.name, 80)!r} has an unusable input schema: {exc}"
            continue
        definition = McpTool(
            name=name, description=_description(server, info), parameters=parameters,
            mutability=mutability_for(info, server.read_only_tools), intents=tuple(server.intents),
            timeout_ms=server.timeout_ms, server=server.name, remote_name=info.name, url=server.url,
            hints=_hints(info),
        )
        names.add(name)
        tools.append(CompiledTool(
            definition,
            _handler(connector, server.url, info.name, open_auth, server.timeout_ms / 1000,
                     send_key=definition.mutability == "write"),
            origin=ORIGIN, version=1,
            runs=f"mcp tools/call {_clip(info.name, 80)} at {server.url} ({definition.mutability}"
                 f"{', held for approval' if definition.needs_approval else ''})",
        ))
    return tools, problems


def _handler(
    connector: McpConnector, url: str, remote: str, open_auth: Callable[[], str | None], timeout_s: float,
    *, send_key: bool,
):
    async def call_mcp_tool(args: dict[str, Any], ctx: TrustedContext) -> Any:
        result = await connector.call_tool(
            url, remote, args, auth_header=open_auth(), timeout_s=timeout_s,
            idempotency_key=ctx.idempotency_key if send_key else None,
        )
        return result_value(result)

    return call_mcp_tool


def with_mcp_tools(catalog: Catalog, tools: Iterable[CompiledTool], problems: dict[str, str]) -> Catalog:
    """`catalog` plus MCP tools. A name already taken (a built-in or a tenant tool) keeps its
    tool; the MCP tool is reported in `problems` instead."""
    merged = {t.name: t for t in catalog}
    merged_problems = {**catalog.problems, **problems}
    for tool in tools:
        if tool.name in merged:
            merged_problems[tool.name] = "a built-in or tenant tool of this name runs instead of the mcp tool"
            continue
        merged[tool.name] = tool
    return Catalog(merged, merged_problems, revision=catalog.revision)


# -- the catalog source ---------------------------------------------------------------------------

@dataclass(frozen=True)
class McpLoad:
    """The MCP part of one tenant's catalog. `complete` is False when a server could not be
    listed, so the loader retries soon instead of keeping the gap for a whole TTL."""

    tools: list[CompiledTool]
    problems: dict[str, str]
    complete: bool = True


class McpCatalogSource:
    """Lists every enabled server a tenant registered and compiles its tools.

    Disabled servers are not contacted and contribute nothing: their tools are not offered and a
    call to one is an unknown tool. Servers are listed concurrently, each within `list_timeout_s`.
    """

    def __init__(
        self,
        store: McpServerStore,
        connector: McpConnector,
        *,
        secret_box: SecretOpener | None,
        list_timeout_s: float = LIST_TIMEOUT_S,
        retry_after_s: float = 10.0,
        egress: Any = None,  # storage EgressRepo: the destinations an operator allowed each tenant
    ) -> None:
        self._store = store
        self._connector = connector
        self._egress = egress
        self._secret_box = secret_box
        self._list_timeout_s = list_timeout_s
        self.retry_after_s = retry_after_s

    async def load(self, tenant_id: str) -> McpLoad:
        servers = [s for s in await self._store.list(tenant_id) if s.enabled]
        if not servers:
            return McpLoad(tools=[], problems={})
        connector = self._connector
        if self._egress is not None:  # listed and called with what an operator allowed this tenant
            allowances = await self._egress.allowances(tenant_id)
            if allowances:
                connector = connector.for_tenant(allowances)
        results = await asyncio.gather(*(self._load_server(s, connector) for s in servers))
        tools: list[CompiledTool] = []
        problems: dict[str, str] = {}
        complete = True
        for server_tools, server_problems, ok in results:
            tools += server_tools
            problems.update(server_problems)
            complete = complete and ok
        return McpLoad(tools=tools, problems=problems, complete=complete)

    async def _load_server(
        self, server: McpServer, connector: McpConnector
    ) -> tuple[list[CompiledTool], dict[str, str], bool]:
        key = server_problem_key(server.name)
        open_auth = auth_opener(server, self._secret_box)
        timeout_s = min(self._list_timeout_s, server.timeout_ms / 1000)
        try:
            listed = await connector.list_tools(server.url, auth_header=open_auth(), timeout_s=timeout_s)
        except ToolError as exc:
            rule = getattr(exc, "rule", None)
            detail = f"{exc.reason} ({rule})" if rule else exc.reason
            log.warning("mcp_server_unlisted", server=server.name, error=exc.kind)
            return [], {key: f"mcp server {server.name!r} could not be listed: {detail}"}, False
        except Exception:
            log.exception("mcp_server_listing_crashed", server=server.name)
            return [], {key: f"mcp server {server.name!r} could not be listed: internal error"}, False
        # a server's input schemas are checked off the event loop when large (validation.schemas_checked)
        tools, problems = await schemas_checked(
            lambda: compile_server_tools(server, listed, connector, open_auth=open_auth))
        return tools, problems, True


def auth_opener(server: McpServer, secret_box: SecretOpener | None) -> Callable[[], str | None]:
    """A function returning the server's decrypted auth header (None when it has none), opened
    on every use so no plaintext is kept in the catalog. It raises ToolError when the header
    cannot be opened (no key configured, key rotated out)."""
    token = server.auth_header_enc

    def open_auth() -> str | None:
        if not token:
            return None
        if secret_box is None:
            raise ToolError("this engine has no CE_SECRET_KEY to open the server's auth header",
                            advice=_FAILED_ADVICE)
        try:
            return secret_box.decrypt(token)
        except Exception:  # noqa: BLE001 - SecretDecryptError; nothing of the secret may leak
            raise ToolError("the server's stored auth header cannot be decrypted; enter it again",
                            advice=_FAILED_ADVICE) from None

    return open_auth


def _clip(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
