"""The tool-contract report (seed 001 § "Validate the running contract").

Joins three facts per tool: the published definition, the handler actually loaded in the running
registry (the compiled catalog of a session host) and the backend's expected parameters (the
OpenAPI document the tenant registered for its backend). Pure: the caller supplies all three.

Findings, each with what to fix: dead route, ignored argument, missing required parameter,
handler override, handler not loaded, absent from the allowlist, intent naming an unknown tool,
a malformed part of the backend's OpenAPI document (named by where it is, never an exception), a
webhook URL hole named by a protected key the trusted scope never holds (every call fails), a
protected webhook parameter that fills no hole (never sent), a parameter named by another spelling
of a tenant/account key (`AccountId`: never filled; every call fails when it is required).

Protected names are judged as the executor and the backends treat them: in any spelling
`is_protected` accepts (`Account_ID`, `account-id`), and filled from the trusted scope only in the
spellings it holds.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec

from services.botconfig import BotConfig
from services.contacts import both_account_spellings
from services.tools.model import (
    TENANT_KEYS,
    TRUSTED_SCOPE_KEYS,
    BackendBindingTool,
    ToolDefinition,
    WebhookTool,
    held_spellings,
    is_protected,
    protected_form,
    protected_forms,
    unheld_spellings,
)
from services.tools.registry import Catalog
from services.tools.templating import template_holes, unfillable_holes

FindingKind = Literal[
    "dead_route", "ignored_argument", "missing_required_parameter", "handler_override",
    "handler_not_loaded", "absent_from_allowlist", "unknown_tool_in_intent", "disabled",
    "output_contract_broken", "malformed_openapi",
]

#: the in-band error text of a result that breaks its output schema (services.tools.executor)
OUTPUT_CONTRACT_FRAGMENT = "does not match its declared output schema"


class Finding(msgspec.Struct, frozen=True, kw_only=True):
    kind: FindingKind
    severity: Literal["error", "warning"]
    message: str
    fix: str


class FieldMapping(msgspec.Struct, frozen=True, kw_only=True):
    model_name: str | None  # None: not from the model
    backend_name: str | None  # None: not sent to the backend
    source: Literal["model", "trusted_scope", "path"]
    required_by_model: bool = False
    required_by_backend: bool = False


class ScopeNeed(msgspec.Struct, frozen=True, kw_only=True):
    """A trusted scope key a tool sends, and what fills it: `tenant` (the engine, in every
    session: the tenant's id, as today's tenant/account keys), `claim` (only in a session of a
    verified contact, from the token's `claim`, as the tenant's `scope_claims` maps it; elsewhere a
    call fails in-band asking the customer to sign in) or `none` (nothing: every call fails)."""

    key: str
    provided_by: Literal["tenant", "claim", "none"]
    claim: str | None = None


class ToolContract(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    type: str
    version: int | None
    origin: str  # "tenant" | "builtin"
    runs: str | None  # what really executes; None when nothing is loaded
    enabled: bool
    offered: bool  # could the model ever be offered it (enabled, allowlisted, loaded)
    fields: list[FieldMapping]
    findings: list[Finding]
    #: the trusted scope keys it sends, each with what fills it
    scope: list[ScopeNeed] = []


class ContractReport(msgspec.Struct, frozen=True, kw_only=True):
    tenant_id: str
    tools: list[ToolContract]
    findings: int
    ok: bool


_PARAM_RE = re.compile(r"\{([^}/]+)\}")


def build_report(
    tenant_id: str,
    published: list[tuple[ToolDefinition, int]],
    catalog: Catalog,
    config: BotConfig,
    output_failures: dict[str, int] | None = None,
) -> ContractReport:
    """The report for one tenant. `published` are its rows as stored; `catalog` what runs;
    `output_failures` how many recent calls per tool broke the tool's output schema."""
    openapi = config.backend.openapi if config.backend is not None else None
    tools: list[ToolContract] = []
    seen: set[str] = set()
    for definition, version in published:
        seen.add(definition.name)
        tools.append(_tool(definition, version, catalog, config, openapi, (output_failures or {}).get(definition.name, 0)))
    for compiled in catalog:
        if compiled.name not in seen and compiled.origin == "builtin":
            tools.append(_tool(compiled.definition, None, catalog, config, openapi))
    tools += _mcp_tools(catalog, config, openapi, seen)
    known = {t.name for t in tools}
    intent_findings: dict[str, list[Finding]] = {}
    for intent_name, intent in config.intents.items():
        for tool_name in intent.tools:
            if tool_name not in known:
                intent_findings.setdefault(tool_name, []).append(Finding(
                    kind="unknown_tool_in_intent", severity="error",
                    message=f"intent '{intent_name}' offers '{tool_name}', but no such tool is published",
                    fix=f"publish a tool named '{tool_name}' or remove it from the intent in PUT /v1/bot-config",
                ))
    for name, findings in sorted(intent_findings.items()):
        tools.append(ToolContract(name=name, type="missing", version=None, origin="none", runs=None,
                                  enabled=False, offered=False, fields=[], findings=findings))
    total = sum(len(t.findings) for t in tools)
    errors = sum(1 for t in tools for f in t.findings if f.severity == "error")
    return ContractReport(tenant_id=tenant_id, tools=tools, findings=total, ok=errors == 0)


def _tool(
    definition: ToolDefinition, version: int | None, catalog: Catalog, config: BotConfig, openapi: dict | None,
    output_failures: int = 0,
) -> ToolContract:
    findings: list[Finding] = []
    if output_failures:
        findings.append(Finding(
            kind="output_contract_broken", severity="error",
            message=f"{output_failures} recent result(s) did not match the declared output_schema; "
                    "the model was told the result could not be relied on",
            fix="fix the backend's response, or update output_schema to what the backend really returns",
        ))
    name = definition.name
    compiled = catalog.get(name)
    problem = catalog.problems.get(name)
    origin = "tenant" if version is not None else "builtin"
    runs: str | None = None
    if compiled is not None:
        runs = compiled.runs
        if version is not None and compiled.origin == "builtin":
            findings.append(Finding(
                kind="handler_override", severity="error",
                message=f"the built-in '{name}' runs instead of this tenant tool ({compiled.runs})",
                fix="rename the tenant tool; built-ins are dispatched by name first",
            ))
    elif problem and problem.startswith("handler override"):
        findings.append(Finding(kind="handler_override", severity="error", message=problem,
                                fix="rename the tenant tool; built-ins are dispatched by name first"))
    else:
        findings.append(Finding(
            kind="handler_not_loaded", severity="error",
            message=f"no handler is loaded for this tool: {problem or 'it is not in the running catalog'}",
            fix="bind it to a handler registered in code, or fix the definition and publish again",
        ))
    if not definition.enabled:
        findings.append(Finding(kind="disabled", severity="warning", message="the tool is disabled",
                                fix="enable it with PATCH /v1/tools/{name} {\"enabled\": true} if it should run"))
    allowlisted = config.allowlist is None or name in config.allowlist
    if not allowlisted:
        findings.append(Finding(
            kind="absent_from_allowlist", severity="warning",
            message="the agent allowlist does not name this tool, so the model is never offered it",
            fix="add it to `allowlist` in PUT /v1/bot-config, or delete the tool",
        ))
    fields = _fields(definition)
    scope = _scope_needs(fields, config)
    findings += _scope_findings(scope)
    findings += _spelling_findings(definition)
    if isinstance(definition, WebhookTool):
        findings += _webhook_findings(definition)
    if isinstance(definition, BackendBindingTool):
        findings += _binding_findings(definition, fields, openapi)
    offered = compiled is not None and compiled.origin == origin and definition.enabled and allowlisted
    return ToolContract(
        name=name, type=_type(definition), version=version, origin=origin, runs=runs,
        enabled=definition.enabled, offered=offered, fields=fields, findings=findings, scope=scope,
    )


def _scope_needs(fields: list[FieldMapping], config: BotConfig) -> list[ScopeNeed]:
    """What fills each trusted scope key the tool sends (actors.session._scope): the tenant's id
    under its keys, always; any other key (`account_id` too) only from a claim the tenant maps,
    for a verified contact."""
    verification = config.contact_verification
    claims = both_account_spellings(verification.scope_claims) if verification is not None else {}
    needs: list[ScopeNeed] = []
    for f in fields:
        key = f.backend_name
        if f.source != "trusted_scope" or key is None or any(n.key == key for n in needs):
            continue
        if key in claims:
            needs.append(ScopeNeed(key=key, provided_by="claim", claim=claims[key]))
        else:
            needs.append(ScopeNeed(key=key, provided_by="tenant" if key in TENANT_KEYS else "none"))
    return needs


def _scope_findings(needs: list[ScopeNeed]) -> list[Finding]:
    return [Finding(
        kind="missing_required_parameter", severity="error",
        message=f"the tool sends '{n.key}' from the trusted scope, which nothing fills: no claim of a verified "
                "contact's token is mapped to it, so every call fails in-band (the model is told to ask the customer "
                "to sign in)",
        fix=f"map a claim of your contacts' tokens to '{n.key}' in contact_verification.scope_claims "
            "(PUT /v1/bot-config), or take it out of the tool's `scope` with PATCH /v1/tools/{name}",
    ) for n in needs if n.provided_by == "none"]


def _mcp_tools(catalog: Catalog, config: BotConfig, openapi: dict | None, seen: set[str]) -> list[ToolContract]:
    """Tools listed from the tenant's MCP servers, and what of them could not be loaded (a server
    that could not be listed is one entry named `<server>__*`)."""
    out: list[ToolContract] = []
    for compiled in catalog:
        if compiled.name not in seen and compiled.origin == "mcp":
            entry = _tool(compiled.definition, None, catalog, config, openapi)
            allowlisted = config.allowlist is None or compiled.name in config.allowlist
            out.append(msgspec.structs.replace(entry, origin="mcp", offered=allowlisted))
    for name, problem in sorted(catalog.problems.items()):
        if name not in seen and catalog.get(name) is None:
            out.append(ToolContract(
                name=name, type="mcp", version=None, origin="mcp", runs=None, enabled=True, offered=False,
                fields=[], findings=[Finding(
                    kind="handler_not_loaded", severity="error", message=problem,
                    fix="check the server's registration (GET /v1/mcp-servers/{name}) and that it answers",
                )],
            ))
    return out


def _type(definition: ToolDefinition) -> str:
    return msgspec.to_builtins(definition)["type"]


def _fields(definition: ToolDefinition) -> list[FieldMapping]:
    """Where each parameter comes from and under which name it is sent. A protected parameter
    (in any spelling: services.tools.executor strips every one from the model's arguments) comes
    from the trusted scope when the scope holds it as it is spelled, and is not listed when nothing
    fills it or it is never sent (a webhook sends protected keys only into URL holes; a binding
    sends what `scope` lists, and drops a `parameter_map` rename onto a protected name)."""
    props = definition.parameters.get("properties", {})
    required = set(definition.parameters.get("required", []))
    forms = protected_forms(definition.protected_keys)
    #: what a trusted scope may hold: the tenant/account keys, and the tool's own `protected`
    #: names, exactly as spelled (services.tools.executor merges it by exact name)
    held = TRUSTED_SCOPE_KEYS | frozenset(definition.protected)
    out: list[FieldMapping] = []
    holes: set[str] = set()
    if isinstance(definition, WebhookTool):
        holes = set(template_holes(definition.webhook_url))
    elif isinstance(definition, BackendBindingTool):
        holes = set(template_holes(definition.path))
    binding = isinstance(definition, BackendBindingTool)
    pmap = definition.parameter_map if binding else {}
    for model_name in props:
        if is_protected(model_name, forms):
            if model_name not in held:
                continue  # another spelling: never filled (_spelling_findings)
            if isinstance(definition, WebhookTool) and (model_name not in holes or model_name not in TRUSTED_SCOPE_KEYS):
                continue  # never sent: see _webhook_findings
            if binding:
                continue  # sent only as `scope` lists it: added below
            out.append(FieldMapping(model_name=None, backend_name=model_name, source="trusted_scope",
                                    required_by_backend=model_name in required))
            continue
        backend_name = pmap.get(model_name, model_name)
        if binding and is_protected(backend_name, forms):
            continue  # renamed onto a protected name: dropped (services.tools.templating.binding_arguments)
        out.append(FieldMapping(
            model_name=model_name, backend_name=backend_name,
            source="path" if backend_name in holes else "model",
            required_by_model=model_name in required,
        ))
    if isinstance(definition, BackendBindingTool):
        for key in definition.scope:
            if not any(f.backend_name == key for f in out):
                out.append(FieldMapping(model_name=None, backend_name=key, source="trusted_scope",
                                        required_by_backend=key in required))
    return out


def _spelling_findings(definition: ToolDefinition) -> list[Finding]:
    """A top-level parameter named by another spelling of a tenant/account key (`AccountId`,
    `account-id`: `unheld_spellings`): the executor strips the model's value for it as for the key
    itself and the model is not offered it, but the trusted scope fills only the exact spellings,
    so it never has a value, and a required one fails every call. Registration refuses these; a
    row stored before that, or an MCP server's tool, may still hold one."""
    props = definition.parameters.get("properties", {})
    required = definition.parameters.get("required", [])
    required = required if isinstance(required, list) else []
    findings: list[Finding] = []
    for name in unheld_spellings([*props, *required]):
        spellings = " or ".join(f"'{k}'" for k in sorted(held_spellings(name), key=lambda k: "_" not in k))
        why = (f"another spelling of a protected key: the model is not offered it and its value is dropped, and "
               f"the trusted context fills that key only as {spellings}")
        fix = (f"rename it to {spellings} to receive the tenant's id, or to a name that is not a tenant/account key "
               "to let the model supply it (PATCH /v1/tools/{name}; for an MCP tool, in the server's input schema)")
        if name in required:
            findings.append(Finding(
                kind="missing_required_parameter", severity="error",
                message=f"parameters requires '{name}', {why}, so every call fails as misconfigured", fix=fix,
            ))
        else:
            findings.append(Finding(
                kind="ignored_argument", severity="warning",
                message=f"parameters declares '{name}', {why}, so it never has a value", fix=fix,
            ))
    return findings


def _webhook_findings(tool: WebhookTool) -> list[Finding]:
    """What a webhook's protected keys really do: the webhook client sends them only into the URL
    holes they name, filled from the trusted scope (services.tools.webhook.WebhookClient.call_webhook);
    a hole the trusted scope never holds fails every call (one in another spelling of a
    tenant/account key too, `{AccountId}`), a declared one that fills no hole is never sent.
    Protected names in any spelling `is_protected` accepts, as the webhook client judges them."""
    findings: list[Finding] = []
    holes = template_holes(tool.webhook_url)
    trusted = ", ".join(sorted(TRUSTED_SCOPE_KEYS))
    for hole in unfillable_holes(holes, tool.protected_keys):
        held = held_spellings(hole)
        if held:
            spellings = " or ".join(f"{{{k}}}" for k in sorted(held, key=lambda k: "_" not in k))
            findings.append(Finding(
                kind="missing_required_parameter", severity="error",
                message=f"the URL needs {{{hole}}}, another spelling of a protected key (the model may not supply "
                        f"it), and the trusted context fills that key only as {spellings}: every call fails",
                fix=f"write the hole as {spellings} in webhook_url (and name its parameter the same way), with "
                    "PATCH /v1/tools/{name}",
            ))
            continue
        # the entry of `protected` the hole spells (`{StoreId}` for `store_id`)
        listed = hole if hole in tool.protected else min(
            (p for p in tool.protected if protected_form(p) == protected_form(hole)), default=hole)
        findings.append(Finding(
            kind="missing_required_parameter", severity="error",
            message=f"the URL needs {{{hole}}}, which is protected (the model may not supply it) and which the "
                    f"trusted context never holds (it holds {trusted}): every call fails",
            fix=f"remove '{listed}' from `protected` to let the model supply it, or take {{{hole}}} out of "
                "webhook_url, with PATCH /v1/tools/{name}",
        ))
    forms = protected_forms(tool.protected_keys)
    props = tool.parameters.get("properties", {})
    misspelt = set(unheld_spellings(props))  # found by _spelling_findings, with their own fix
    for name in props:
        if is_protected(name, forms) and name not in holes and name not in misspelt:
            findings.append(Finding(
                kind="ignored_argument", severity="warning",
                message=f"parameters declares '{name}', which is protected: the model is not offered it and the "
                        "webhook sends protected keys only into URL holes, so it is never sent",
                fix=f"put {{{name}}} in webhook_url if the backend needs it (filled from the trusted context when "
                    f"it is one of {trusted}), or remove it from parameters",
            ))
    return findings


def _binding_findings(tool: BackendBindingTool, fields: list[FieldMapping], openapi: dict | None) -> list[Finding]:
    if openapi is None:
        return []
    problems: list[str] = []
    found = _operation(openapi, tool.method, tool.path, problems)
    expected: dict[str, bool] = {}
    if found is not None:
        operation, item, where = found
        expected = _parameters(operation, item, where, tool.method.lower(), problems)
    if problems:
        # A part of the document that cannot be read leaves the expected parameters unknown, so
        # "ignored argument" or "missing parameter" would be guesses: report only what to repair.
        return [Finding(
            kind="malformed_openapi", severity="error",
            message=f"{tool.method} {tool.path} cannot be checked against the backend's OpenAPI document: {problem}",
            fix="correct that part of the document and store it again in `backend.openapi` with PUT /v1/bot-config",
        ) for problem in problems]
    if found is None:
        known = ", ".join(sorted(_member(openapi, "paths", dict, _ROOT, []))) or "none"
        return [Finding(
            kind="dead_route", severity="error",
            message=f"the backend has no {tool.method} {tool.path} (its OpenAPI document lists: {known})",
            fix="correct `path`/`method` of the binding, or register the backend's current OpenAPI document",
        )]
    findings: list[Finding] = []
    sent = {f.backend_name: f for f in fields if f.backend_name is not None}
    for backend_name, f in sent.items():
        if backend_name not in expected:
            origin = f"model argument '{f.model_name}'" if f.model_name else f"trusted field '{backend_name}'"
            accepted = ", ".join(sorted(expected)) or "none"
            findings.append(Finding(
                kind="ignored_argument", severity="error",
                message=f"{origin} is sent as '{backend_name}', which {tool.method} {tool.path} does not read "
                        f"(it reads: {accepted}); the call can succeed while ignoring it",
                fix=f"map it in `parameter_map` to the backend's name (e.g. {{\"{f.model_name or backend_name}\": \"<backend name>\"}})",
            ))
    for backend_name, required in sorted(expected.items()):
        if required and backend_name not in sent:
            findings.append(Finding(
                kind="missing_required_parameter", severity="error",
                message=f"{tool.method} {tool.path} requires '{backend_name}', which neither the model's "
                        "arguments nor the trusted scope provide",
                fix=f"add a parameter mapped to '{backend_name}', or list it in `scope` if it comes from the trusted context",
            ))
    return findings


# The document is whatever the tenant stored (any JSON object): every step below checks the type
# of what it reads, and a wrong one becomes a problem naming where it is, never an exception.
_ROOT = "$.backend.openapi"


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object" if isinstance(value, dict) else type(value).__name__


def _problem(expected: str, value: object, where: str) -> str:
    return f"expected {expected}, got {_json_type(value)} - at `{where}`"


def _at(where: str, key: str) -> str:
    return f"{where}.{key}" if key.isidentifier() else f"{where}[{key!r}]"


def _member(parent: dict, key: str, want: type[dict | list], where: str, problems: list[str]) -> Any:
    """`parent[key]` when it is a `want` (empty when absent); a value of another type is added to
    `problems` and reads as empty."""
    if key not in parent:
        return want()
    value = parent[key]
    if isinstance(value, want):
        return value
    problems.append(_problem("an object" if want is dict else "an array", value, _at(where, key)))
    return want()


def _operation(openapi: dict, method: str, path: str, problems: list[str]) -> tuple[dict, dict, str] | None:
    """(operation, its path item, where that item is) for `method path`, or None when the
    document has none; unreadable parts on the way are added to `problems`."""
    verb = method.lower()
    paths = _member(openapi, "paths", dict, _ROOT, problems)
    norm = _PARAM_RE.sub("{}", path)
    for key, item in paths.items():
        if _PARAM_RE.sub("{}", key) != norm:
            continue
        where = _at(f"{_ROOT}.paths", key)
        if not isinstance(item, dict):
            problems.append(_problem("an object", item, where))
        elif verb in item and not isinstance(item[verb], dict):
            problems.append(_problem("an object", item[verb], _at(where, verb)))
        elif verb in item:
            return item[verb], item, where
    return None


def _parameters(operation: dict, item: dict, where: str, verb: str, problems: list[str]) -> dict[str, bool]:
    """Backend parameter name -> required, from path-level and operation-level parameters and a
    JSON request body's top-level properties; unreadable parts are added to `problems`."""
    params: dict[str, bool] = {}
    op_where = _at(where, verb)
    for parent, at in ((item, where), (operation, op_where)):
        for i, p in enumerate(_member(parent, "parameters", list, at, problems)):
            p_where = f"{at}.parameters[{i}]"
            if not isinstance(p, dict):
                problems.append(_problem("an object", p, p_where))
            elif "name" in p and not isinstance(p["name"], str):
                problems.append(_problem("a string", p["name"], f"{p_where}.name"))
            elif "name" in p:  # without a name it is a $ref, which the report does not follow
                params[p["name"]] = bool(p.get("required")) or p.get("in") == "path"
    body_where = _at(op_where, "requestBody")
    content_where = _at(body_where, "content")
    media_where = _at(content_where, "application/json")
    schema_where = _at(media_where, "schema")
    body = _member(operation, "requestBody", dict, op_where, problems)
    content = _member(body, "content", dict, body_where, problems)
    media = _member(content, "application/json", dict, content_where, problems)
    schema = _member(media, "schema", dict, media_where, problems)
    required = _member(schema, "required", list, schema_where, problems)
    for i, name in enumerate(required):
        if not isinstance(name, str):
            problems.append(_problem("a string", name, f"{schema_where}.required[{i}]"))
    for prop in _member(schema, "properties", dict, schema_where, problems):
        params[prop] = prop in required
    return params


def report_as_dict(report: ContractReport) -> dict[str, Any]:
    return msgspec.to_builtins(report)


