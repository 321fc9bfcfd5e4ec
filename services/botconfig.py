"""A tenant's bot configuration (ce_bot_config): persona, models, intents, allowlist, backend.

Decoded with `forbid_unknown_fields` at the API edge so a typo is a 422, not a silent no-op.
"""

from __future__ import annotations

import msgspec

from kernel.errors import InvalidInput
from services.contacts import ContactVerification


class Intent(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Phrases that signal the intent and the tools offered when it is detected."""

    phrases: tuple[str, ...] = ()
    tools: tuple[str, ...] = ()


class Backend(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The tenant backend that `backend_binding` tools call (seed 001)."""

    base_url: str
    auth_header_enc: str | None = None  # ciphertext; the API accepts `auth_header` write-only
    openapi: dict | None = None  # the backend's OpenAPI document, for the contract report


class BotConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    persona: str = "You are a helpful assistant for this business. Be brief and friendly."
    main_model: str | None = None  # None: the engine's CE_MAIN_MODEL
    cheap_model: str | None = None  # None: the engine's CE_CHEAP_MODEL; used after tool results
    intents: dict[str, Intent] = {}
    #: the agent allowlist: when set, only these tools may ever be offered or run
    allowlist: tuple[str, ...] | None = None
    #: writes allowed at all; False turns every write tool away (policy: mutability)
    allow_writes: bool = True
    language: str = "english"  # full-text search configuration for recall_memory
    notification_webhook: str | None = None
    #: the Standard Webhooks signing secret (whsec_...) as rows stored before it was encrypted
    #: kept it; `PUT /v1/bot-config` stores `notification_secret_enc` instead
    notification_secret: str | None = None
    notification_secret_enc: str | None = None  # the secret, encrypted with CE_SECRET_KEY
    backend: Backend | None = None
    contact_id_variable: str = "contact_id"
    #: recall_memory also searches the other sessions bound to this session's verified contact
    #: (the same Contact-Token `sub`); PUT /v1/bot-config accepts it only with contact_verification.
    #: Off, or in an anonymous session: this session only. Nothing typed (an email) ever counts.
    recall_across_sessions: bool = False
    approval_ttl_s: float | None = None  # None: the engine's CE_APPROVAL_TTL_S
    #: verified contacts: how a Contact-Token is checked (services.contacts); None: none accepted
    contact_verification: ContactVerification | None = None


#: a tenant's approval TTL: a second at least, 30 days at most (an expiry time must be a date)
APPROVAL_TTL_MIN_S, APPROVAL_TTL_MAX_S = 1, 30 * 86400


def _approval_ttl_usable(ttl: float) -> bool:
    # A held approval's expiry is now + TTL: beyond the calendar no turn could be held, and at or
    # below 0 every approval would be expired at birth. NaN compares false: not usable either.
    return APPROVAL_TTL_MIN_S <= ttl <= APPROVAL_TTL_MAX_S


def check_approval_ttl(ttl: float | None) -> None:
    """Refuse an approval TTL no held turn could use; None (the engine's default) passes.

    Raises InvalidInput naming the range and the field (`$.approval_ttl_s`). The rule is
    approval_ttl's: a TTL this accepts is the one a turn is held for.
    """
    if ttl is not None and not _approval_ttl_usable(ttl):
        raise InvalidInput(f"approval_ttl_s must be a number of seconds from {APPROVAL_TTL_MIN_S} to "
                           f"{APPROVAL_TTL_MAX_S} (30 days), got {ttl}; leave it out for the engine's "
                           "default - at `$.approval_ttl_s`", path="$.approval_ttl_s")


def approval_ttl(config: BotConfig, default: float) -> float:
    """The tenant's approval TTL, or `default` when it has none or one check_approval_ttl refuses
    (stored before `PUT /v1/bot-config` checked it: held turns would otherwise fail or expire at
    birth)."""
    ttl = config.approval_ttl_s
    return ttl if ttl is not None and _approval_ttl_usable(ttl) else default


DEFAULT_CONFIG = BotConfig()
botconfig_decoder = msgspec.json.Decoder(BotConfig)


def botconfig_from_dict(data: dict) -> BotConfig:
    """Build from a stored JSON object; raises msgspec.ValidationError naming the path."""
    return msgspec.convert(data, BotConfig) if data else DEFAULT_CONFIG
