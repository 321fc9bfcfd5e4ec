"""The bot config routes: GET shows the tenant's config with its credentials as set or not; PUT
replaces it, credentials write-only and encrypted at rest (services/gateway/bodies.py BotConfigIn).
POST /v1/contact-tokens mints a test contact's token (services.contacts) for trying a verified
session out, the dashboard's "Try it" among others."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

import msgspec
from aiohttp import web

from kernel.errors import Conflict, InvalidInput
from services.botconfig import Backend, BotConfig, check_approval_ttl
from services.builtins.notify import InvalidSecret, secret_key
from services.contacts import (
    MAX_CLAIM,
    MAX_SCOPE_CLAIMS,
    TEST_TTL_S,
    ContactVerification,
    check_verification,
    keys_for_test_contacts,
    mint_test_token,
)
from services.gateway.bodies import (
    MAX_VARIABLE_NAME,
    BotConfigIn,
    ContactVerificationIn,
    check_credential_stays,
    check_url,
)
from services.gateway.common import (
    DEPS,
    TENANT,
    decode_body,
    encrypter,
    json_response,
    tenant_policy,
)
from services.tools.model import ACCOUNT_KEYS, held_spellings

#: a scope key is a parameter name (a binding's `scope` entry, a URL hole)
_SCOPE_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
#: what a view shows for a stored notification secret; sent back in a PUT it keeps the secret
SECRET_SET = "[set]"


def _config_view(config: dict[str, Any]) -> dict[str, Any]:
    view = dict(config)
    backend = view.get("backend")
    if backend:
        backend = dict(backend)
        backend["auth_header_set"] = bool(backend.pop("auth_header_enc", None))
        view["backend"] = backend
    if view.pop("notification_secret_enc", None) or view.get("notification_secret"):
        view["notification_secret"] = SECRET_SET
    verification = view.get("contact_verification")
    if verification:
        verification = dict(verification)
        verification["hs256_secret"] = SECRET_SET if verification.pop("hs256_secret_enc", None) else None
        view["contact_verification"] = verification
    return view


async def get_bot_config(request: web.Request) -> web.Response:
    deps = request.app[DEPS]
    stored = await deps.configs.get(request[TENANT])
    config = msgspec.to_builtins(msgspec.convert(stored or {}, BotConfig))
    return json_response(_config_view(config))


def check_bot_config(body: BotConfigIn) -> None:
    """Raise InvalidInput (naming the field) for a value no turn or notification could use."""
    check_approval_ttl(body.approval_ttl_s)  # the rule approval_ttl() applies to what is stored
    if not 0 < len(body.contact_id_variable) <= MAX_VARIABLE_NAME:
        raise InvalidInput(f"contact_id_variable must be a session variable's name of 1-{MAX_VARIABLE_NAME} "
                           "characters - at `$.contact_id_variable`", path="$.contact_id_variable")
    if body.recall_across_sessions and body.contact_verification is None:
        # an earlier session is recalled only as the same verified contact's: without tokens there
        # is no contact to follow, and a typed email must never stand in for one
        raise InvalidInput("recall_across_sessions needs contact_verification: recall follows a contact only across "
                           "sessions bound to the same verified Contact-Token `sub`; configure contact_verification "
                           "in the same PUT, or set recall_across_sessions to false - at `$.recall_across_sessions`",
                           path="$.recall_across_sessions")
    if body.notification_secret and body.notification_secret != SECRET_SET:
        try:
            secret_key(body.notification_secret)  # how the notifier reads it to sign each notification
        except InvalidSecret:
            # the value is a secret: never echoed, not even a bad one
            raise InvalidInput("notification_secret must be whsec_ followed by base64 (a Standard Webhooks "
                               "secret, such as whsec_ and 32 random bytes in base64) - at `$.notification_secret`",
                               path="$.notification_secret") from None


async def put_bot_config(request: web.Request) -> web.Response:
    deps = request.app[DEPS]
    body: BotConfigIn = await decode_body(request, BotConfigIn)
    check_bot_config(body)
    if body.backend is not None or body.notification_webhook:
        policy = await tenant_policy(deps, request[TENANT])  # the operator's list and this tenant's allowances
        if body.backend is not None:
            check_url(body.backend.base_url, field="backend.base_url", policy=policy)
        if body.notification_webhook:
            check_url(body.notification_webhook, field="notification_webhook", policy=policy)
    previous = await deps.configs.get(request[TENANT]) or {}
    data = {k: v for k, v in msgspec.to_builtins(body).items()
            if v is not None and k not in ("backend", "notification_secret", "contact_verification")}
    if body.contact_verification is not None:
        data["contact_verification"] = _verification(deps, body.contact_verification,
                                                     previous.get("contact_verification") or {})
    if body.allowlist is not None:
        data["allowlist"] = body.allowlist
    if body.backend is not None:
        backend: dict[str, Any] = {"base_url": body.backend.base_url, "openapi": body.backend.openapi}
        if body.backend.auth_header:
            backend["auth_header_enc"] = encrypter(deps)(body.backend.auth_header)
        elif body.backend.auth_header_set is not False:  # left out, or shown as set: kept
            stored = previous.get("backend") or {}
            kept = stored.get("auth_header_enc")
            if body.backend.auth_header_set and not kept:
                raise InvalidInput("backend.auth_header_set is true but no backend auth header is stored to keep; "
                                   "send backend.auth_header itself, or backend.auth_header_set: false - at "
                                   "`$.backend.auth_header_set`", path="$.backend.auth_header_set")
            if kept:
                # kept only for the origin it was written for; the base_url it is checked against is
                # the one stored beside it in the same read, so the two never come from different writes
                check_credential_stays(stored.get("base_url"), body.backend.base_url, url_field="backend.base_url",
                                       credential_field="backend.auth_header",
                                       without="backend.auth_header_set: false")
                backend["auth_header_enc"] = kept
        data["backend"] = msgspec.to_builtins(msgspec.convert(backend, Backend))
    secret = body.notification_secret
    if secret is msgspec.UNSET or secret == SECRET_SET:  # left out, or shown as set: kept
        kept = {k: previous[k] for k in ("notification_secret_enc", "notification_secret") if previous.get(k)}
        if secret == SECRET_SET and not kept:
            raise InvalidInput(f"notification_secret is {SECRET_SET!r} but no notification_secret is stored to keep; "
                               "send the secret itself (whsec_...) or null - at `$.notification_secret`",
                               path="$.notification_secret")
        data.update(kept)
    elif secret:  # encrypted at rest, like every credential a tenant stores
        data["notification_secret_enc"] = encrypter(deps)(secret)
    config = msgspec.convert(data, BotConfig)  # validates the whole config before storing it
    stored = msgspec.to_builtins(config)
    await deps.configs.put(request[TENANT], stored)
    return json_response(_config_view(stored))


MIN_HS256_SECRET = 32


def _verification(deps: Any, body: ContactVerificationIn, previous: dict[str, Any]) -> dict[str, Any]:
    """The stored contact_verification: the HS256 secret encrypted, or kept as stored when left
    out (or sent back as `"[set]"`); checked so that a token could pass it."""
    at = "$.contact_verification.hs256_secret"
    secret = body.hs256_secret
    kept = previous.get("hs256_secret_enc")
    if secret is msgspec.UNSET or secret == SECRET_SET:
        if secret == SECRET_SET and not kept:
            raise InvalidInput(f"hs256_secret is {SECRET_SET!r} but none is stored to keep; send the secret "
                               f"itself or null - at `{at}`", path=at)
        secret_enc = kept
    elif secret is None:
        secret_enc = None
    else:
        if len(secret) < MIN_HS256_SECRET:  # never echoed, not even a bad one
            raise InvalidInput(f"hs256_secret must be at least {MIN_HS256_SECRET} characters of random data - "
                               f"at `{at}`", path=at)
        secret_enc = encrypter(deps)(secret)
    settings = ContactVerification(
        required=body.required, algorithms=tuple(body.algorithms), keys=tuple(body.keys),
        hs256_secret_enc=secret_enc, issuer=body.issuer, audience=body.audience,
        max_lifetime_s=body.max_lifetime_s, scope_claims=body.scope_claims,
    )
    check_verification(settings, has_secret=secret_enc is not None)
    check_scope_claims(settings.scope_claims)
    return msgspec.to_builtins(settings)


class TestContactIn(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/contact-tokens: a made-up customer to chat as; their `sub` gets `test:` in front."""

    sub: str
    #: the claims the tenant's scope_claims read (`{"stay": "S-100"}`)
    claims: dict[str, str | int] = {}
    ttl_s: int = TEST_TTL_S


async def post_contact_token(request: web.Request) -> web.Response:
    """A test contact's Contact-Token, signed with this tenant's test key (admin keys only, as
    every route but a chat key's few): it passes this tenant's verification and no other's, and
    names a `test:` contact, never a real customer."""
    deps = request.app[DEPS]
    tenant_id = request[TENANT]
    body: TestContactIn = await decode_body(request, TestContactIn)
    stored = await deps.configs.get(tenant_id) or {}
    settings = msgspec.convert(stored, BotConfig).contact_verification
    if settings is None:
        raise Conflict("this tenant verifies no contact, so a contact token means nothing to it: configure "
                       "contact_verification in PUT /v1/bot-config first")
    keys = keys_for_test_contacts(deps.secret_keys, tenant_id)
    if not keys:
        raise InvalidInput("this engine has no CE_SECRET_KEY, so it has no key to sign a test contact's token with; "
                           "set it and restart")
    token, sub, expires = mint_test_token(keys[0], settings, body.sub, body.claims, ttl_s=body.ttl_s)
    return json_response({"token": token, "sub": sub,
                          "expires_at": datetime.fromtimestamp(expires, UTC).isoformat()})


def check_scope_claims(scope_claims: dict[str, str]) -> None:
    """Refuse a claim mapping that could not fill a tool's scope, or that would let a token say
    which tenant it is (the tenant's id is the authenticated key's, always)."""
    at = "$.contact_verification.scope_claims"
    if len(scope_claims) > MAX_SCOPE_CLAIMS:
        raise InvalidInput(f"at most {MAX_SCOPE_CLAIMS} scope_claims - at `{at}`", path=at)
    for key, claim in scope_claims.items():
        where = f"{at}.{key}"
        if not _SCOPE_KEY.fullmatch(key):
            raise InvalidInput(f"scope key {key[:70]!r} is not a parameter name (a letter or _, then letters, digits "
                               f"or _, at most 64) - at `{at}`", path=at)
        if not isinstance(claim, str) or not 0 < len(claim) <= MAX_CLAIM:
            raise InvalidInput(f"the claim mapped to {key!r} must name a claim of the token (1-{MAX_CLAIM} "
                               f"characters) - at `{where}`", path=where)
        spellings = held_spellings(key)
        if spellings and not ACCOUNT_KEYS & set(spellings):  # tenant_id, in any spelling
            raise InvalidInput(f"{key!r} is the tenant's id, which the engine fills from the authenticated key; a "
                               f"token cannot set it: map account_id (or another key) instead - at `{where}`",
                               path=where)
        if spellings and key not in spellings:
            names = " or ".join(repr(s) for s in spellings)
            raise InvalidInput(f"{key!r} spells {names} another way; tools are filled under {names} only: map that "
                               f"name - at `{where}`", path=where)


def add_config_routes(app: web.Application) -> None:
    """Register the routes above on the gateway app (called once from build_app)."""
    r = app.router
    r.add_get("/v1/bot-config", get_bot_config)
    r.add_put("/v1/bot-config", put_bot_config)
    r.add_post("/v1/contact-tokens", post_contact_token)
