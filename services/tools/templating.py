"""URL templating for tools, pure: no HTTP client, no I/O.

Owns
- `render_request`: a webhook's URL template filled from the call's arguments, `{param}` holes
  filled with percent-encoded values that stay inside one path segment or one query value; the
  remaining arguments go to the query (GET/DELETE) or a JSON body (POST/PUT/PATCH);
- `binding_arguments` (seed 001's backend binding contract): `parameter_map` renames model
  arguments to backend names, protected keys are dropped, `scope` keys come from trusted context;
- `template_holes` / `unfillable_holes`: the holes a template names, and those no call can fill.

The webhook client (services.tools.webhook) sends what these build; the contract report
(services.contract) and the tool body parser (services.gateway.bodies) read templates with them
without importing an HTTP client.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import msgspec

from services.tools.errors import SIGN_IN_ADVICE, InvalidArguments, PolicyDenied, ToolError, blocked
from services.tools.model import (
    PROTECTED_KEYS,
    TRUSTED_SCOPE_KEYS,
    BackendBindingTool,
    is_protected,
    protected_forms,
)

_QUERY_METHODS = frozenset({"GET", "DELETE"})
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_HOLE_RE = re.compile(r"\{([a-zA-Z_][a-zA-Z0-9_]*)\}")
_AUTHORITY_RE = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*://[^/?#]*)(.*)$", re.DOTALL)
# characters a template's literal text may keep as is; anything else is percent-encoded
_LITERAL_SAFE = "/:@!$&'()*+,;=-._~%?"
_DOT_SEGMENTS = frozenset({".", "..", "%2e", "%2e%2e", ".%2e", "%2e."})


class RenderedRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A URL template filled with arguments: the URL and, for POST/PUT/PATCH, the JSON body."""

    method: str
    url: str
    body: dict[str, Any] | None = None


# --------------------------------------------------------------------------- templating (pure)


def render_request(url_template: str, method: str, args: Mapping[str, Any]) -> RenderedRequest:
    """Fill `url_template`'s `{param}` holes from `args`; route the other arguments.

    Each value is percent-encoded with nothing left safe, so `../`, `?x=`, `@evil`, `#frag` or
    `%2e%2e` stay inside the one path segment (or query value) of its hole. Holes are allowed in
    the path and the query only. Arguments that fill no hole go to the query for GET/DELETE and to
    a JSON object body for POST/PUT/PATCH; None values are left out.

    Raises InvalidArguments (naming the parameter) for a missing, empty, dot-segment or non-scalar
    hole value; DestinationBlocked for a template whose host or scheme holds a hole;
    ToolError for an unsupported method.
    """
    method = method.upper()
    if method not in _QUERY_METHODS | _BODY_METHODS:
        raise ToolError(
            f"http method {method!r} is not supported; use GET, POST, PUT, PATCH or DELETE",
            advice="Tell the customer this action is unavailable right now.",
        )
    match = _AUTHORITY_RE.match(url_template.strip())
    if match is None:
        raise blocked("malformed url", "url template does not start with http:// or https://")
    origin, rest = match.groups()
    if "{" in origin or "}" in origin:
        raise blocked(
            "parameter in host",
            "url template puts a parameter in the scheme or host; parameters may only fill the path or query",
        )
    rest = rest.split("#", 1)[0]  # a fragment is never sent to the server
    path_template, _, query_template = rest.partition("?")
    used: set[str] = set()
    path = _fill(path_template, args, used, in_path=True) or "/"
    query = _fill(query_template, args, used, in_path=False)
    for segment in path.split("/"):
        if segment.lower() in _DOT_SEGMENTS:
            raise InvalidArguments(
                "the url would contain a '.' or '..' path segment; dot segments are not allowed",
                advice="Check the values you passed and call the tool again with real identifiers.",
            )
    extra = {k: v for k, v in args.items() if k not in used and v is not None}
    body: dict[str, Any] | None = None
    if method in _QUERY_METHODS:
        extra_query = _encode_query(extra, method)
        query = "&".join(part for part in (query, extra_query) if part)
    else:
        body = extra
    url = f"{origin}{path}?{query}" if query else f"{origin}{path}"
    return RenderedRequest(method=method, url=url, body=body)


def _fill(template: str, args: Mapping[str, Any], used: set[str], *, in_path: bool) -> str:
    pieces: list[str] = []
    position = 0
    for hole in _HOLE_RE.finditer(template):
        pieces.append(quote(template[position : hole.start()], safe=_LITERAL_SAFE))
        name = hole.group(1)
        text = _hole_text(name, args.get(name))
        if in_path and text == "":
            raise InvalidArguments(
                f"`{name}` must not be empty; it fills a part of the request url",
                advice=f"Ask the customer for the {name} and call the tool again.",
            )
        if in_path and text in (".", ".."):
            raise InvalidArguments(
                f"`{name}` must not be '.' or '..'",
                advice=f"Ask the customer for the {name} and call the tool again.",
            )
        pieces.append(quote(text, safe=""))
        used.add(name)
        position = hole.end()
    pieces.append(quote(template[position:], safe=_LITERAL_SAFE))
    return "".join(pieces)


def _hole_text(name: str, value: Any) -> str:
    if value is None:
        raise InvalidArguments(
            f"missing value for `{name}`; it is required to build the request url",
            advice=f"Ask the customer for the {name} and call the tool again.",
        )
    return _scalar_text(name, value)


def _scalar_text(name: str, value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value
    if isinstance(value, int | float):
        return str(value)
    raise InvalidArguments(
        f"`{name}` must be text or a number, got {type(value).__name__}",
        advice=f"Call the tool again with `{name}` as a single value.",
    )


def _encode_query(params: Mapping[str, Any], method: str) -> str:
    pairs: list[str] = []
    for name, value in params.items():
        key = quote(str(name), safe="")
        values = value if isinstance(value, list | tuple) else [value]
        for item in values:
            if item is None:
                continue
            if isinstance(item, dict | list | tuple):
                raise InvalidArguments(
                    f"`{name}` is nested; a {method} request can only send text, numbers or lists of them",
                    advice=f"Call the tool again with `{name}` as a single value.",
                )
            pairs.append(f"{key}={quote(_scalar_text(name, item), safe='')}")
    return "&".join(pairs)


# --------------------------------------------------------------------------- bindings (pure)


def binding_arguments(
    tool: BackendBindingTool, model_args: Mapping[str, Any], trusted_scope: Mapping[str, Any]
) -> dict[str, Any]:
    """The backend's arguments for a binding call, by backend name (seed 001).

    Protected keys from the model are dropped in any spelling (`is_protected`; also when
    `parameter_map` would rename a model argument onto one), `parameter_map` renames the rest,
    then every `scope` key is set from `trusted_scope`, overwriting whatever the model sent.
    Raises PolicyDenied when the trusted scope lacks a key the binding needs.
    """
    forms = protected_forms(tool.protected_keys)
    mapped: dict[str, Any] = {}
    for name, value in model_args.items():
        if is_protected(name, forms):
            continue
        backend_name = tool.parameter_map.get(name, name)
        if is_protected(backend_name, forms):
            continue
        mapped[backend_name] = value
    for key in tool.scope:
        if trusted_scope.get(key) is None:
            raise PolicyDenied(
                f"trusted scope has no `{key}` for this tool",
                advice=SIGN_IN_ADVICE,
            )
        mapped[key] = trusted_scope[key]
    return mapped


def join_base(base_url: str, path: str) -> str:
    return f"{base_url.rstrip('/')}/{path.lstrip('/')}"


# --------------------------------------------------------------------------- holes (pure)


def template_holes(template: str) -> list[str]:
    """The `{param}` names of a URL or path template, in order."""
    return _HOLE_RE.findall(template)


def unfillable_holes(holes: list[str], protected: frozenset[str]) -> list[str]:
    """The URL-template holes no call can fill: named by a protected name (`PROTECTED_KEYS` or
    the tool's own `protected`, in any spelling `is_protected` accepts), so never taken from the
    model, and not held by the trusted scope (which holds the exact spellings only: a hole in
    another spelling of a trusted key, `{AccountId}`, is one of these; `held_spellings` names the
    holes that would be filled instead)."""
    forms = protected_forms(PROTECTED_KEYS | protected)
    return [h for h in holes if is_protected(h, forms) and h not in TRUSTED_SCOPE_KEYS]
