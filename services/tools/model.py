"""Tool definitions as data: a tagged union over the families of seed 001, plus seed 000's shape.

A definition is inert data. `services.tools.registry` compiles a published definition into a
handler with a known compiler; nothing in a definition is ever evaluated as code.

Also the rules every family's values share, so the executor, the schema the model is offered and
the backends apply them alike: which argument names are protected (`is_protected`: compared
case-insensitively, every character but letters and digits ignored), which spellings of them the trusted scope fills
(`held_spellings`: the exact ones only) and how deep a tool's JSON may nest (`MAX_VALUE_DEPTH`,
checked with services.nesting).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, Literal

import msgspec

Mutability = Literal["read", "write"]
HttpMethod = Literal["GET", "POST", "PUT", "PATCH", "DELETE"]

#: Argument names the model may never supply (seed 001 § "Tenant scope comes from the service").
PROTECTED_KEYS: frozenset[str] = frozenset({"tenant_id", "tenantId", "account_id", "accountId"})
#: The keys the engine's trusted scope may hold (actors.session._scope). A tool's own `protected`
#: names are not in it, so a URL hole named by one of those could never be filled (registration
#: refuses it).
TRUSTED_SCOPE_KEYS: frozenset[str] = PROTECTED_KEYS
#: held in every session: the authenticated tenant's id, never anything a token or the model says
TENANT_KEYS: frozenset[str] = frozenset({"tenant_id", "tenantId"})
#: held only in a verified contact's session, from the claim the tenant maps to them
#: (contact_verification.scope_claims): an anonymous session has no account
ACCOUNT_KEYS: frozenset[str] = frozenset({"account_id", "accountId"})
#: how deeply a tool's arguments or result may nest (objects and arrays): deeper is refused in-band
#: as it comes (services.tools.executor for arguments; services.tools.webhook and
#: services.tools.mcp for results). The call record redacts a value recursively, two stack frames a
#: level: a 1 KB body 600 levels deep ran the turn out of stack. No real API's answer nests so deep.
MAX_VALUE_DEPTH = 64

TOOL_NAME_RE = re.compile(r"^[a-zA-Z][a-zA-Z0-9_-]{0,63}\Z")


class ToolBase(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """What every tool family shares: the model-facing contract and the policy around it."""

    name: str
    description: str
    parameters: dict[str, Any]  # a JSON-schema object, normalised by `normalise_parameters`
    mutability: Mutability = "read"
    requires_approval: bool | None = None  # None: approval required exactly for write tools
    #: the question the contact is asked before a held call runs, filled from its arguments
    #: (`"Book {service} on {start}?"`, services.tools.approval_prompt); None: one built from the
    #: tool's name and arguments (`"Run book appointment with service=cut?"`)
    approval_prompt: str | None = None
    intents: tuple[str, ...] = ()
    enabled: bool = True
    #: names whose values are redacted at any depth in traces and ce_tool_calls (parameters and
    #: result; services.tools.redaction), and never quoted in a validation error
    sensitive: tuple[str, ...] = ()
    protected: tuple[str, ...] = ()  # extra argument names stripped from model input
    timeout_ms: int = 5000
    #: session variable set on success; while set, the tool is not offered again (seed 000 dedup)
    completes_variable: str | None = None
    #: the resource whose concurrency limit this tool shares (default: the tool itself)
    resource: str | None = None
    #: the arguments that make a call the same call when a retried message re-runs its turn (the
    #: idempotency key: the message and a digest of these). None: all of them; (): none, so one
    #: call of the tool per message (a re-run's model may reword free text such as a reason)
    idempotency_arguments: tuple[str, ...] | None = None
    # -- limits beyond the breaker ----------------------------------------------------------
    max_calls_per_turn: int | None = None
    max_calls_per_session: int | None = None
    max_parallel: int | None = None  # calls of this tool running at once within one round
    max_result_chars: int | None = None  # results longer are truncated for the model (kept whole in the record)
    # -- progress while slow ------------------------------------------------------------------
    progress_after_ms: int | None = None  # None: the engine default
    progress_message: str | None = None  # shown to the contact, e.g. "Still checking your order…"
    # -- retries (idempotent reads only), output contract ---------------------------------------
    retries: int = 0  # extra attempts on a retryable failure, with backoff and jitter, within the deadline
    output_schema: dict[str, Any] | None = None  # a result that does not match is a contract failure

    @property
    def needs_approval(self) -> bool:
        if self.requires_approval is None:
            return self.mutability == "write"
        return self.requires_approval

    @property
    def protected_keys(self) -> frozenset[str]:
        return PROTECTED_KEYS | frozenset(self.protected)


class WebhookTool(ToolBase, tag="webhook"):
    """Seed 000's tenant tool: a URL template with `{param}` holes, called over HTTP."""

    webhook_url: str
    method: HttpMethod = "GET"
    auth_header_enc: str | None = None  # ciphertext (services.tools.crypto); never leaves the server


class BackendBindingTool(ToolBase, tag="backend_binding"):
    """Seed 001's declarative binding against the tenant's configured backend."""

    path: str
    method: HttpMethod = "GET"
    parameter_map: dict[str, str] = {}  # model-facing name -> backend-facing name
    scope: tuple[str, ...] = ()  # backend keys filled from trusted context, never from the model


class PythonTool(ToolBase, tag="python"):
    """Binds to a handler registered in code under `handler`; nothing else."""

    handler: str


class WorkflowTool(ToolBase, tag="workflow"):
    """Starts a long-running job now (returns a reference); the result reaches the session later.

    Either `handler` (a workflow registered in code, run in the background by the engine) or
    `start_url` (the tenant's system gets `POST {job_id, tool, arguments, callback_path}` and
    reports back through `POST /v1/jobs/{job_id}/result`).
    """

    handler: str | None = None
    start_url: str | None = None
    #: when the job's result arrives, the session runs a turn at once and the contact's stream gets
    #: the reply; false: the result waits for the contact's next message
    notify_on_result: bool = True


class ClientTool(ToolBase, tag="client"):
    """Presentation: the call becomes a `client_action` event for the UI; nothing runs here."""

    #: as WorkflowTool's, for the client's answer (POST /v1/jobs/{id}/result); off unless set
    notify_on_result: bool = False


ToolDefinition = WebhookTool | BackendBindingTool | PythonTool | WorkflowTool | ClientTool

tool_decoder = msgspec.json.Decoder(ToolDefinition)


def protected_form(name: str) -> str:
    """`name` as the protected-key checks compare it: case-folded, with every character that is
    not a letter or a digit left out. Backends that bind JSON names case-insensitively (Go's
    encoding/json, ASP.NET Core's web defaults) or that normalise separators read `Account_ID`,
    `ACCOUNTID`, `account-id`, `account.id`, `account id` or `account_id[]` (a form binder's
    array) as `account_id`, so every such spelling of a protected name is that name. casefold,
    not lower: Go folds the Kelvin sign into `k` and the long s into `s`, and so does casefold."""
    return "".join(c for c in name.casefold() if c.isalnum())


def protected_forms(names: Iterable[str]) -> frozenset[str]:
    """The `protected_form`s of `names`, for `is_protected`."""
    return frozenset(protected_form(n) for n in names)


def is_protected(name: Any, forms: frozenset[str]) -> bool:
    """Whether `name` is a spelling of one of the names whose `protected_forms` are `forms`."""
    return isinstance(name, str) and protected_form(name) in forms


#: each trusted scope key's `protected_form` -> the spellings the trusted scope holds it under
#: (`accountid` -> ("accountId", "account_id"))
_HELD_SPELLINGS: dict[str, tuple[str, ...]] = {
    form: tuple(sorted(k for k in TRUSTED_SCOPE_KEYS if protected_form(k) == form))
    for form in protected_forms(TRUSTED_SCOPE_KEYS)
}


def held_spellings(name: Any) -> tuple[str, ...]:
    """The spellings under which the trusted scope holds the key `name` spells, sorted
    (`AccountId`, `account-id` -> `("accountId", "account_id")`); `()` when `name` spells no
    trusted scope key."""
    return _HELD_SPELLINGS.get(protected_form(name), ()) if isinstance(name, str) else ()


def unheld_spellings(names: Iterable[Any]) -> list[str]:
    """The `names` that spell a trusted scope key another way (`AccountId`, `account-id`,
    `TENANT_ID`), in order, once each. Such a name is protected like the key (`is_protected`: the
    model is not offered it and its value is stripped) but nothing ever fills it: the trusted scope
    holds the exact spellings only (`held_spellings`), as it does for URL holes and a binding's
    `scope`. Registration refuses such a parameter (services.gateway.bodies) rather than fill it
    from the key it spells, so a tool's names mean the same to every check; the contract report
    finds one stored before, or listed by an MCP server."""
    out: list[str] = []
    for name in names:
        if isinstance(name, str) and name not in TRUSTED_SCOPE_KEYS and held_spellings(name) and name not in out:
            out.append(name)
    return out


#: schema keywords whose values are data, not schemas: never searched for properties
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples", "example"})


def model_facing_parameters(schema: dict[str, Any], protected: frozenset[str]) -> dict[str, Any]:
    """`schema` as the model is offered it: every `protected` name, in any spelling `is_protected`
    accepts, left out of `properties`, `required`, `dependentRequired` and `dependentSchemas`, at
    any depth (the executor strips them from the model's arguments at any depth, so a model shown
    one would supply a value that is silently replaced or dropped). Returns `schema` itself when
    it names no protected property, else a copy; never changes `schema`."""
    shown = _without_protected(schema, protected_forms(protected))
    return schema if shown == schema else shown


def _without_protected(node: Any, forms: frozenset[str]) -> Any:
    if isinstance(node, list):
        return [_without_protected(item, forms) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("properties", "dependentSchemas") and isinstance(value, dict):
            # a map of property name -> schema: its keys are names, never keywords
            out[key] = {k: _without_protected(v, forms) for k, v in value.items() if not is_protected(k, forms)}
        elif key in ("$defs", "definitions") and isinstance(value, dict):
            # a map of definition name -> schema: a definition may be named like a keyword
            out[key] = {k: _without_protected(v, forms) for k, v in value.items()}
        elif key == "dependentRequired" and isinstance(value, dict):
            # `{"a": ["account_id"]}`: the model cannot meet a dependency on a name it is not shown
            kept_deps = {k: [n for n in v if not is_protected(n, forms)] if isinstance(v, list) else v
                         for k, v in value.items() if not is_protected(k, forms)}
            kept_deps = {k: v for k, v in kept_deps.items() if v != []}
            if kept_deps:
                out[key] = kept_deps
        elif key == "required" and isinstance(value, list):
            kept = [name for name in value if not is_protected(name, forms)]
            if kept:
                out[key] = kept
        elif key in _DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = _without_protected(value, forms)
    return out


def normalise_parameters(parameters: dict[str, Any], *, required_hint: list[str] = ()) -> dict[str, Any]:
    """Return a JSON-schema object for either accepted shape of `parameters`.

    Seed 000 gives a map of name -> property schema; a full JSON schema (`"type": "object"`)
    is taken as is. In the map form a property is required when it fills a template hole
    (`required_hint`) or its schema says `"required": true`.
    """
    if parameters.get("type") == "object" and (
        "properties" in parameters or not parameters.keys() - {"type", "required", "additionalProperties"}
    ):
        schema = dict(parameters)
        schema.setdefault("properties", {})
        return schema
    properties: dict[str, Any] = {}
    required: list[str] = []
    for name, prop in parameters.items():
        prop = dict(prop) if isinstance(prop, dict) else {"type": "string", "description": str(prop)}
        # Only seed 000's boolean flag is ours to strip: a list is a nested object's own rule.
        flag = prop.pop("required") if isinstance(prop.get("required"), bool) else False
        is_required = flag is True or name in required_hint
        properties[name] = prop
        if is_required:
            required.append(name)
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    return schema
