"""Tool API bodies (seed 000's shape plus seed 001's families) and their conversion to definitions;
the bot config's body (BotConfigIn).

Pure: no aiohttp. A body is decoded once with `forbid_unknown_fields`; `definition_from_body`
checks what a JSON schema cannot (name, URL, template holes, schema validity) and encrypts the
write-only `auth_header`. `tool_view` is the only way a definition leaves the server: it never
carries the auth header, only `auth_header_set`.

A stored write-only credential stays only with the origin it was written for (`same_origin`,
`check_credential_stays`): a change that moves its URL to another scheme, host or port must send
the credential anew (or null), or the engine would hand it, decrypted, to a host of the changer's
choosing. The tool PATCH here, the bot config's backend and MCP servers all apply that rule.
"""

from __future__ import annotations

from typing import Any, Literal
from urllib.parse import urlsplit

import msgspec
import yarl

from kernel.errors import InvalidInput
from services.botconfig import Intent
from services.tools.approval_prompt import MAX_TEMPLATE_CHARS, placeholders, template_problems
from services.tools.model import (
    PROTECTED_KEYS,
    TOOL_NAME_RE,
    TRUSTED_SCOPE_KEYS,
    HttpMethod,
    Mutability,
    ToolDefinition,
    held_spellings,
    is_protected,
    normalise_parameters,
    protected_form,
    protected_forms,
    unheld_spellings,
)
from services.tools.redaction import secret_name
from services.tools.ssrf import DestinationPolicy, literal_refusal
from services.tools.templating import template_holes, unfillable_holes
from services.tools.validation import check_any_schema, check_schema

ToolType = Literal["webhook", "backend_binding", "python", "workflow", "client"]
UNSET: Any = msgspec.UNSET
#: the longest session variable name a tool may set (`completes_variable`): Postgres indexes a
#: session's variables by name and refuses a row whose name outgrows the index, which would fail
#: every turn that calls the tool; far below that, a name is a name
MAX_VARIABLE_NAME = 128
DEFAULT_PORTS = {"http": 80, "https": 443}


class ToolCreate(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str
    description: str
    parameters: dict[str, Any] = {}
    type: ToolType = "webhook"
    webhook_url: str | None = None
    auth_header: str | None = None
    timeout_ms: int = 5000
    method: HttpMethod | None = None
    mutability: Mutability = "read"
    requires_approval: bool | None = None
    #: the question a contact is asked before a held call runs: `{name}` placeholders over the
    #: parameters (`"Book {service} on {start}?"`); null: "Run <tool name> with k=v, ...?"
    approval_prompt: str | None = None
    intents: list[str] = []
    enabled: bool = True
    sensitive: list[str] = []
    protected: list[str] = []
    completes_variable: str | None = None
    resource: str | None = None
    # backend_binding (seed 001)
    path: str | None = None
    parameter_map: dict[str, str] = {}
    scope: list[str] = []
    # python / workflow
    handler: str | None = None
    start_url: str | None = None  # workflow run by the tenant's system
    #: workflow and client tools: the result wakes the session (a turn at once, its reply pushed);
    #: null: true for a workflow, false for a client tool
    notify_on_result: bool | None = None
    # limits, progress, retries, output contract
    max_calls_per_turn: int | None = None
    max_calls_per_session: int | None = None
    max_parallel: int | None = None
    max_result_chars: int | None = None
    progress_after_ms: int | None = None
    progress_message: str | None = None
    retries: int = 0
    output_schema: dict[str, Any] | None = None


class ToolPatch(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Any field of ToolCreate but the name and type; makes a new version (published unless
    `publish` is false)."""

    description: str | msgspec.UnsetType = UNSET
    parameters: dict[str, Any] | msgspec.UnsetType = UNSET
    webhook_url: str | msgspec.UnsetType = UNSET
    auth_header: str | None | msgspec.UnsetType = UNSET
    timeout_ms: int | msgspec.UnsetType = UNSET
    method: HttpMethod | msgspec.UnsetType = UNSET
    mutability: Mutability | msgspec.UnsetType = UNSET
    requires_approval: bool | None | msgspec.UnsetType = UNSET
    approval_prompt: str | None | msgspec.UnsetType = UNSET
    intents: list[str] | msgspec.UnsetType = UNSET
    enabled: bool | msgspec.UnsetType = UNSET
    sensitive: list[str] | msgspec.UnsetType = UNSET
    protected: list[str] | msgspec.UnsetType = UNSET
    completes_variable: str | None | msgspec.UnsetType = UNSET
    resource: str | None | msgspec.UnsetType = UNSET
    path: str | msgspec.UnsetType = UNSET
    parameter_map: dict[str, str] | msgspec.UnsetType = UNSET
    scope: list[str] | msgspec.UnsetType = UNSET
    handler: str | msgspec.UnsetType = UNSET
    start_url: str | msgspec.UnsetType = UNSET
    notify_on_result: bool | None | msgspec.UnsetType = UNSET
    max_calls_per_turn: int | None | msgspec.UnsetType = UNSET
    max_calls_per_session: int | None | msgspec.UnsetType = UNSET
    max_parallel: int | None | msgspec.UnsetType = UNSET
    max_result_chars: int | None | msgspec.UnsetType = UNSET
    progress_after_ms: int | None | msgspec.UnsetType = UNSET
    progress_message: str | None | msgspec.UnsetType = UNSET
    retries: int | msgspec.UnsetType = UNSET
    output_schema: dict[str, Any] | None | msgspec.UnsetType = UNSET
    publish: bool = True


class BackendIn(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    base_url: str
    auth_header: str | None = None
    openapi: dict | None = None
    #: what GET shows of the write-only header, taken back: false removes the stored header, true
    #: or absent keeps it (unless `auth_header` replaces it) while base_url stays on the origin it
    #: was written for; true with no header stored is refused, like the `[set]` placeholder
    auth_header_set: bool | None = None


class ContactVerificationIn(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`contact_verification` as PUT /v1/bot-config takes it: the HS256 secret write-only
    (`"[set]"`, as GET shows it, or left out keeps the stored one; null removes it)."""

    required: bool = False
    algorithms: list[str] = []
    keys: list[dict[str, Any]] = []
    hs256_secret: str | None | msgspec.UnsetType = msgspec.UNSET
    issuer: str = ""
    audience: str = ""
    max_lifetime_s: int = 3600
    scope_claims: dict[str, str] = {}


class BotConfigIn(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """PUT /v1/bot-config: BotConfig with its credentials write-only. It takes back what GET
    shows: a credential left out, or sent back as the view shows it (`notification_secret:
    "[set]"`, `backend.auth_header_set: true`), keeps the stored one; null (false) removes it.
    The backend's header is kept only while `backend.base_url` keeps its origin (scheme, host,
    port): a move to another origin must send it again, or `auth_header_set: false`."""

    persona: str | None = None
    main_model: str | None = None
    cheap_model: str | None = None
    intents: dict[str, Intent] = {}
    allowlist: list[str] | None = None
    allow_writes: bool = True
    language: str = "english"
    notification_webhook: str | None = None
    notification_secret: str | None | msgspec.UnsetType = msgspec.UNSET
    backend: BackendIn | None = None
    approval_ttl_s: float | None = None
    #: recall_memory also reads the verified contact's other sessions (needs contact_verification)
    recall_across_sessions: bool = False
    #: the session variable collect_lead sets to the email it was given: a label, never a key
    contact_id_variable: str = "contact_id"
    contact_verification: ContactVerificationIn | None = None


class Encryptor:
    """What the conversion needs from services.tools.crypto.SecretBox."""

    def encrypt(self, plaintext: str) -> str: ...  # pragma: no cover - protocol


def definition_from_body(body: ToolCreate, *, encrypt, policy: DestinationPolicy | None = None,
                         contact_scope: frozenset[str] = frozenset()) -> ToolDefinition:
    """Build and check a definition. Raises InvalidInput naming the field and the fix.

    With `policy` (the SSRF guard's allowlist), a URL whose host is an IP literal the guard would
    refuse (metadata, private, loopback, ...) is refused here, at registration."""
    if not TOOL_NAME_RE.match(body.name):
        raise InvalidInput(
            f"name {body.name!r} must start with a letter and hold only letters, digits, '_' or '-' "
            "(at most 64) - at `$.name`", path="$.name",
        )
    if not body.description.strip():
        raise InvalidInput("description must say when to call the tool - at `$.description`", path="$.description")
    if not 100 <= body.timeout_ms <= 60_000:
        raise InvalidInput(
            f"timeout_ms must be between 100 and 60000, got {body.timeout_ms} - at `$.timeout_ms`",
            path="$.timeout_ms",
        )
    holes: list[str] = []
    family: dict[str, Any] = {}
    if body.type == "webhook":
        if not body.webhook_url:
            raise InvalidInput("webhook_url is required for a webhook tool - at `$.webhook_url`", path="$.webhook_url")
        check_url(body.webhook_url, policy=policy)
        holes = template_holes(body.webhook_url)
        family = {"webhook_url": body.webhook_url, "method": body.method or ("GET" if body.mutability == "read" else "POST")}
        if body.auth_header:
            family["auth_header_enc"] = encrypt(body.auth_header)
    elif body.type == "backend_binding":
        if not body.path or not body.path.startswith("/"):
            raise InvalidInput("path must start with '/' for a backend_binding tool - at `$.path`", path="$.path")
        holes = template_holes(body.path)
        family = {"path": body.path, "method": body.method or "GET", "parameter_map": body.parameter_map,
                  "scope": tuple(body.scope)}
    elif body.type == "workflow":
        if (body.handler is None) == (body.start_url is None):
            raise InvalidInput(
                "a workflow tool needs exactly one of `handler` (registered in the engine) or `start_url` "
                "(your system runs the job) - at `$.handler`", path="$.handler",
            )
        if body.start_url is not None:
            check_url(body.start_url, field="start_url", policy=policy)
            family = {"start_url": body.start_url}
        else:
            family = {"handler": body.handler}
    elif body.type == "python":
        if not body.handler:
            raise InvalidInput("handler is required for a python tool - at `$.handler`", path="$.handler")
        family = {"handler": body.handler}
    if body.notify_on_result is not None:
        if body.type not in ("workflow", "client"):
            raise InvalidInput(f"notify_on_result does not apply to a {body.type} tool: only a workflow's or a "
                               "client tool's result arrives later - at `$.notify_on_result`", path="$.notify_on_result")
        family["notify_on_result"] = body.notify_on_result
    for field in ("webhook_url", "auth_header", "path", "handler", "start_url"):
        if getattr(body, field) is not None and field not in family and not (field == "auth_header" and body.type == "webhook"):
            raise InvalidInput(f"{field} does not apply to a {body.type} tool - at `$.{field}`", path=f"$.{field}")
    schema = normalise_parameters(body.parameters, required_hint=holes)
    check_schema(schema)
    properties = schema.get("properties", {})
    # Protected names first: a hole or parameter no call could fill is reported as that, with its
    # fix, before "parameters has no ..." asks for a parameter that would not fill it either.
    if body.type == "backend_binding":
        check_binding_scope(holes, body, contact_scope=contact_scope)
        check_parameter_map(body)
    if body.type == "webhook":
        check_protected_holes(holes, frozenset(body.protected))
    check_trusted_spellings(schema)
    for hole in holes:
        if body.type == "backend_binding" and (hole in body.scope or hole in body.parameter_map.values()):
            continue  # filled from the trusted scope, or from the parameter `parameter_map` renames onto it
        if hole not in properties:
            raise InvalidInput(
                f"the URL template uses {{{hole}}} but parameters has no '{hole}' - add it to `$.parameters`",
                path="$.parameters",
            )
    if body.completes_variable is not None and not 0 < len(body.completes_variable) <= MAX_VARIABLE_NAME:
        raise InvalidInput(
            f"completes_variable must be 1-{MAX_VARIABLE_NAME} characters, got {len(body.completes_variable)}; "
            "name the session variable the tool sets - at `$.completes_variable`", path="$.completes_variable",
        )
    for name in body.sensitive:
        if name not in properties:
            raise InvalidInput(f"sensitive names '{name}', which is not a parameter - at `$.sensitive`", path="$.sensitive")
    if body.approval_prompt is not None:
        check_approval_prompt(body.approval_prompt, properties, sensitive=frozenset(body.sensitive),
                              protected=PROTECTED_KEYS | frozenset(body.protected))
    for field in ("max_calls_per_turn", "max_calls_per_session", "max_parallel", "max_result_chars", "progress_after_ms"):
        value = getattr(body, field)
        if value is not None and value < 1:
            raise InvalidInput(f"{field} must be at least 1, got {value} - at `$.{field}`", path=f"$.{field}")
    if not 0 <= body.retries <= 5:
        raise InvalidInput(f"retries must be between 0 and 5, got {body.retries} - at `$.retries`", path="$.retries")
    if body.retries and body.mutability != "read":
        raise InvalidInput(
            "retries are allowed for read tools only: a write is never retried blindly - at `$.retries`",
            path="$.retries",
        )
    if body.output_schema is not None:
        check_any_schema(body.output_schema, where="$.output_schema")
    data = {
        "type": body.type, "name": body.name, "description": body.description, "parameters": schema,
        "mutability": body.mutability, "requires_approval": body.requires_approval,
        "approval_prompt": body.approval_prompt,
        "intents": tuple(body.intents), "enabled": body.enabled, "sensitive": tuple(body.sensitive),
        "protected": tuple(body.protected), "timeout_ms": body.timeout_ms,
        "completes_variable": body.completes_variable, "resource": body.resource,
        "max_calls_per_turn": body.max_calls_per_turn, "max_calls_per_session": body.max_calls_per_session,
        "max_parallel": body.max_parallel, "max_result_chars": body.max_result_chars,
        "progress_after_ms": body.progress_after_ms, "progress_message": body.progress_message,
        "retries": body.retries, "output_schema": body.output_schema, **family,
    }
    return msgspec.convert(data, ToolDefinition)


def check_approval_prompt(template: str, properties: dict[str, Any], *, sensitive: frozenset[str],
                          protected: frozenset[str]) -> None:
    """Raise InvalidInput (at `$.approval_prompt`) unless `template` is one short line whose
    `{name}` placeholders each name a parameter the contact may see: not a `sensitive`,
    secret-looking or `protected` one (in any spelling `is_protected` accepts), whose value the
    prompt would never show; a literal brace is written `{{` or `}}`."""
    where = " - at `$.approval_prompt`"
    if not template.strip():
        raise InvalidInput("approval_prompt is blank; write the question the contact is asked, or leave it out "
                           "(null) to ask 'Run <tool name> with ...?'" + where, path="$.approval_prompt")
    if len(template) > MAX_TEMPLATE_CHARS:
        raise InvalidInput(f"approval_prompt is {len(template)} characters, at most {MAX_TEMPLATE_CHARS}: the contact "
                           "reads it as one short question; shorten it" + where, path="$.approval_prompt")
    if not template.isprintable():
        raise InvalidInput("approval_prompt holds a line break or another control character; write it as one line of "
                           "text" + where, path="$.approval_prompt")
    for problem in template_problems(template):
        what = "an empty placeholder '{}'" if problem.kind == "empty" else f"a '{problem.text}' that is part of no placeholder"
        raise InvalidInput(f"approval_prompt has {what}; write a placeholder as {{name}} with a parameter's name, "
                           "and a literal brace as '{{' or '}}'" + where, path="$.approval_prompt")
    forms = protected_forms(protected)
    for name in placeholders(template):
        if name not in properties:
            known = ", ".join(sorted(properties)[:10]) or "none"
            raise InvalidInput(f"approval_prompt uses {{{name}}}, but parameters has no '{name}' (it has: {known}); "
                               f"name one of the parameters, or take {{{name}}} out" + where, path="$.approval_prompt")
        if name in sensitive or secret_name(name) or is_protected(name, forms):
            why = ("`sensitive` lists it" if name in sensitive else
                   "only the trusted context fills it" if is_protected(name, forms) else
                   "its name looks like a credential")
            raise InvalidInput(f"approval_prompt uses {{{name}}}, whose value is never shown to the contact ({why}); "
                               f"take {{{name}}} out of approval_prompt" + where, path="$.approval_prompt")


def check_protected_holes(holes: list[str], protected: frozenset[str]) -> None:
    """Raise InvalidInput for a URL hole the model may not fill (a protected name, in any spelling
    `is_protected` accepts) and the trusted scope never holds: every call would fail. Holes named
    by the tenant/account keys as the trusted scope spells them are fine: it fills them. One in
    another spelling of those (`{AccountId}`) is refused at `$.webhook_url` with the spellings
    that are filled; one named by the tool's own `protected` at `$.protected`."""
    for hole in unfillable_holes(holes, protected):
        held = held_spellings(hole)
        if held:
            raise InvalidInput(
                f"the URL template uses {{{hole}}}, another spelling of a protected key: the model may not supply "
                f"it and the engine's trusted context holds that key only as {_either(held, hole=True)}, so every "
                f"call would fail; write the hole as {_either(held, hole=True)} to have the engine fill it with the "
                "authenticated tenant's id - at `$.webhook_url`", path="$.webhook_url",
            )
        trusted = ", ".join(sorted(TRUSTED_SCOPE_KEYS))
        listed = _listed_as(hole, protected)
        raise InvalidInput(
            f"the URL template uses {{{hole}}}, which `protected` lists{_as(listed, hole)}: the model may not supply "
            f"it and the engine's trusted context only holds {trusted}, so every call would fail; remove "
            f"'{listed}' from `protected` to let the model supply it, or take {{{hole}}} out of webhook_url - at "
            "`$.protected`", path="$.protected",
        )


def check_binding_scope(holes: list[str], body: ToolCreate, *, contact_scope: frozenset[str] = frozenset()) -> None:
    """Raise InvalidInput for a backend binding no call could complete: a `scope` key the trusted
    context never holds (every call would be refused for it), or a path hole named by a protected
    key, in any spelling `is_protected` accepts, that `scope` does not fill (binding_arguments
    drops the model's value for it in every spelling, and nothing else fills it). The trusted
    context holds the tenant/account keys in their exact spellings only, so a `scope` key or a
    hole spelled another way (`AccountId`, `ACCOUNT_ID`) is refused naming the spellings it holds.
    A verified contact's token adds `contact_scope`: the keys of the tenant's scope_claims."""
    trusted = ", ".join(sorted(TRUSTED_SCOPE_KEYS | contact_scope))
    for key in body.scope:
        if key in TRUSTED_SCOPE_KEYS or key in contact_scope:
            continue
        held = held_spellings(key)
        if held:
            raise InvalidInput(
                f"scope lists '{key}', another spelling of a protected key: the engine's trusted context holds that "
                f"key only as {_either(held)}, so every call would be refused; list {_either(held)} in `scope` "
                "(and name the path's hole the same way) - at `$.scope`", path="$.scope",
            )
        raise InvalidInput(
            f"scope lists '{key}', which the engine's trusted context does not hold (it holds {trusted}), so "
            f"every call would be refused; list only those keys in `scope`, or map a verified contact's claim to it "
            f"in the bot config's contact_verification.scope_claims first - at `$.scope`", path="$.scope",
        )
    protected = frozenset(body.protected)
    forms = protected_forms(PROTECTED_KEYS | protected)
    for hole in holes:
        if hole in body.scope or not is_protected(hole, forms):
            continue
        if hole in TRUSTED_SCOPE_KEYS:
            raise InvalidInput(
                f"the path uses {{{hole}}}, a protected key the model may not supply, and `scope` does not fill it, "
                f"so every call would fail; add '{hole}' to `scope` to fill it from the authenticated tenant - at "
                "`$.scope`", path="$.scope",
            )
        held = held_spellings(hole)
        if held:
            raise InvalidInput(
                f"the path uses {{{hole}}}, another spelling of a protected key the model may not supply, and the "
                f"engine's trusted context holds that key only as {_either(held)}, so nothing could fill it and "
                f"every call would fail; write the hole as {_either(held, hole=True)} and list that key in `scope` "
                "to fill it from the authenticated tenant - at `$.path`", path="$.path",
            )
        listed = _listed_as(hole, protected)
        raise InvalidInput(
            f"the path uses {{{hole}}}, which `protected` lists{_as(listed, hole)}: the model may not supply it and "
            f"the engine's trusted context only holds {trusted}, so every call would fail; remove '{listed}' from "
            "`protected` to let the model supply it - at `$.protected`", path="$.protected",
        )


def check_parameter_map(body: ToolCreate) -> None:
    """Raise InvalidInput (at `$.parameter_map`) for a rename that never applies: of a protected
    name (the model is never offered it), or onto one, in any spelling `is_protected` accepts
    (binding_arguments drops the model's value then, on every call: only `scope` sends the
    tenant's id, and a name the tool's own `protected` lists comes from the model under no name)."""
    protected = frozenset(body.protected)
    forms = protected_forms(PROTECTED_KEYS | protected)
    for model_name, backend_name in body.parameter_map.items():
        if is_protected(model_name, forms):
            raise InvalidInput(
                f"parameter_map renames '{model_name}', a protected key the model may not supply, so the rename "
                f"never applies; take '{model_name}' out of `parameter_map` - at `$.parameter_map`",
                path="$.parameter_map",
            )
        if not is_protected(backend_name, forms):
            continue
        held = held_spellings(backend_name)
        if held:
            fix = (f"to send the authenticated tenant's id, list {_either(held)} in `scope` (the backend gets it "
                   f"under that name) and take the rename out; to let the model supply '{model_name}', rename it onto "
                   "a name that is not a tenant/account key")
            what = "a protected key"
        else:
            listed = _listed_as(backend_name, protected)
            fix = (f"remove '{listed}' from `protected` to let the model supply it, or rename '{model_name}' onto "
                   "another name")
            what = f"which `protected` lists{_as(listed, backend_name)}"
        raise InvalidInput(
            f"parameter_map renames '{model_name}' onto '{backend_name}', {what}: the model may not supply it, so "
            f"the value would be dropped on every call; {fix} - at `$.parameter_map`", path="$.parameter_map",
        )


def check_trusted_spellings(schema: dict[str, Any]) -> None:
    """Raise InvalidInput (at `$.parameters`) for a top-level parameter named by another spelling
    of a tenant/account key (`AccountId`, `account-id`, `TENANT_ID`: `unheld_spellings`). The
    executor treats it as that key, so the model is not offered it and its value is dropped, but
    the trusted context fills only the exact spellings (as for URL holes and `scope`): it would
    never have a value, and a required one would fail every call."""
    properties = schema.get("properties")
    required = schema.get("required")
    names = [*(properties if isinstance(properties, dict) else ()), *(required if isinstance(required, list) else ())]
    for name in unheld_spellings(names):
        held = held_spellings(name)
        raise InvalidInput(
            f"parameters declares '{name}', another spelling of a protected key: the model is not offered it and "
            f"its value is dropped, and the engine fills that key only as {_either(held)} (with the authenticated "
            f"tenant's id), so '{name}' would never have a value; rename it to {_either(held)} to receive the "
            "tenant's id, or to a name that is not a tenant/account key to let the model supply it - at "
            "`$.parameters`", path="$.parameters",
        )


def _either(spellings: tuple[str, ...], *, hole: bool = False) -> str:
    """`'account_id' or 'accountId'` (`{account_id} or {accountId}` for holes), snake case first."""
    shown = [f"{{{k}}}" if hole else f"'{k}'" for k in sorted(spellings, key=lambda k: "_" not in k)]
    return " or ".join(shown)


def _listed_as(name: str, protected: frozenset[str]) -> str:
    """The entry of `protected` that `name` spells (`name` itself when listed as it is)."""
    if name in protected:
        return name
    return min((p for p in protected if protected_form(p) == protected_form(name)), default=name)


def _as(listed: str, name: str) -> str:
    return "" if listed == name else f" as '{listed}'"


def patched_body(current: dict[str, Any], patch: ToolPatch, *,
                 policy: DestinationPolicy | None = None) -> tuple[ToolCreate, str | None]:
    """The ToolCreate equivalent of `current` with `patch` applied, and the kept ciphertext of
    the auth header when the patch does not touch it.

    Raises InvalidInput at `$.auth_header` when the patch moves webhook_url to another origin and
    would keep the stored auth header (check_credential_stays); a new webhook_url that check_url
    (with `policy`) refuses on its own is reported as that first, as a create would report it.
    """
    base = {k: v for k, v in current.items() if k in ToolCreate.__struct_fields__}
    kept_auth = current.get("auth_header_enc")
    for field in ToolPatch.__struct_fields__:
        value = getattr(patch, field)
        if field == "publish" or value is UNSET:
            continue
        base[field] = value
        if field == "auth_header":
            kept_auth = None
    if kept_auth and patch.webhook_url is not UNSET and not same_origin(current.get("webhook_url"), patch.webhook_url):
        check_url(patch.webhook_url, policy=policy)
        check_credential_stays(current.get("webhook_url"), patch.webhook_url, url_field="webhook_url",
                               credential_field="auth_header", without="auth_header: null")
    return msgspec.convert(base, ToolCreate), kept_auth


def url_origin(url: str | None) -> tuple[str, str, int | None] | None:
    """(scheme, host, port) of `url`, lower-cased, with the scheme's default port filled in;
    None for no URL or one yarl cannot read. {param} holes are taken out first (check_url
    allows them in the path and query only)."""
    if not url:
        return None
    try:
        parsed = yarl.URL(url.replace("{", "").replace("}", ""))
        port = parsed.port  # the scheme's default when none is written
    except (ValueError, TypeError):
        return None
    if not parsed.scheme or not parsed.host:
        return None
    return parsed.scheme.lower(), parsed.host.lower(), port


def same_origin(a: str | None, b: str | None) -> bool:
    """Whether URLs `a` and `b` share an origin: scheme, host and port, compared case-insensitively
    with default ports normalised; path, query and fragment do not count. False when either has
    no readable origin (a credential then never follows: the safe answer)."""
    origin = url_origin(a)
    return origin is not None and origin == url_origin(b)


def _shown_origin(url: str | None) -> str:
    origin = url_origin(url)
    if origin is None:
        return "no readable origin"
    scheme, host, port = origin
    host = f"[{host}]" if ":" in host else host
    return f"{scheme}://{host}" if port in (None, DEFAULT_PORTS.get(scheme)) else f"{scheme}://{host}:{port}"


def check_credential_stays(stored_url: str | None, new_url: str, *, url_field: str, credential_field: str,
                           without: str) -> None:
    """Raise InvalidInput (at `$.{credential_field}`) unless `new_url` has the origin of
    `stored_url`, for a change that would keep the stored credential written for `stored_url`.

    The stored credential is write-only: whoever changes the URL may not have written it, so it
    follows a move of path or query but never one to another scheme, host or port. `without`
    says how the caller sends "no credential" (e.g. `auth_header: null`)."""
    if same_origin(stored_url, new_url):
        return
    old = _shown_origin(stored_url)
    raise InvalidInput(
        f"{url_field} moves to {_shown_origin(new_url)} from {old}, and the stored {credential_field} was "
        f"written for {old} only; send {credential_field} again for the new host, "
        f"or {without} to call the new host without one - at `$.{credential_field}`",
        path=f"$.{credential_field}",
    )


#: fields of a definition no tool body can set (the engine's own, for built-ins): a view shows
#: them only when set. Every field a tenant can set is shown, null when unset.
ENGINE_ONLY_FIELDS = frozenset({"idempotency_arguments"})
#: fields a tenant can set that came after some definitions were stored: a view of one stored
#: before shows them as they read (their default), as it shows every other unset field
LATER_FIELDS: dict[str, Any] = {"approval_prompt": None}


def tool_view(definition: dict[str, Any], *, version: int | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A definition as the API shows it: everything but the auth header and unset engine-only
    fields (ENGINE_ONLY_FIELDS), plus auth_header_set."""
    view = {k: v for k, v in definition.items()
            if k != "auth_header_enc" and not (k in ENGINE_ONLY_FIELDS and v is None)}
    for field, default in LATER_FIELDS.items():
        view.setdefault(field, default)
    view["auth_header_set"] = bool(definition.get("auth_header_enc"))
    if version is not None:
        view["version"] = version
    if extra:
        view.update(extra)
    return view


def check_url(url: str, *, field: str = "webhook_url", policy: DestinationPolicy | None = None,
              example: str = "https://example.com/api/orders/{order_id}") -> None:
    """Raise InvalidInput (at `$.{field}`) unless `url` is an http(s) URL without credentials and
    without holes in its host; with `policy`, also when its host is an IP literal (or a legacy
    numeric form) that the SSRF guard would refuse at call time."""
    try:
        parts = urlsplit(url.replace("{", "").replace("}", ""))
        parts.port  # noqa: B018 - raises ValueError for a port out of range or not a number
        netloc = urlsplit(url).netloc
    except ValueError:
        parts, netloc = None, ""
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidInput(
            f"{field} must be an http(s) URL such as {example} - at `$.{field}`",
            path=f"$.{field}",
        )
    if parts.username is not None or parts.password is not None:  # even an empty `@`
        raise InvalidInput(
            f"{field} must not carry credentials; put them in auth_header - at `$.{field}`", path=f"$.{field}",
        )
    if "{" in netloc:
        raise InvalidInput(
            f"{field} may use {{param}} holes in its path and query only, never in the host - at `$.{field}`",
            path=f"$.{field}",
        )
    rule = literal_refusal(url.replace("{", "").replace("}", ""), policy) if policy is not None else None
    if rule == "malformed url":
        raise InvalidInput(
            f"{field} has a host that is neither a host name nor an IP address - at `$.{field}`", path=f"$.{field}",
        )
    if rule is not None:
        raise InvalidInput(
            f"{field} points at {parts.hostname}, a {rule}, which tools may not reach; use a public "
            f"address (an operator can allow it with CE_WEBHOOK_ALLOW) - at `$.{field}`", path=f"$.{field}",
        )
