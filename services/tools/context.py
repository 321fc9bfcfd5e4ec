"""Trusted context: who is calling, supplied by the service, never by the model (seed 001)."""

from __future__ import annotations

from typing import Any

import msgspec


class TrustedContext(msgspec.Struct, frozen=True, kw_only=True):
    tenant_id: str
    session_id: str
    message_id: str | None = None
    contact_id: str | None = None
    #: the verified contact the session belongs to (its Contact-Token's `sub`), or None for an
    #: anonymous session: what memory across sessions, and nothing typed, is keyed on
    contact_sub: str | None = None
    #: values that fill protected/scope keys (e.g. {"account_id": tenant_id}); overwrite the model
    scope: dict[str, Any] = {}
    #: session variables as they stand when the call starts (read-only for handlers)
    variables: dict[str, str] = {}
    #: stable per call across a resumed turn: sent as Idempotency-Key by write tools
    idempotency_key: str | None = None
    language: str = "english"
