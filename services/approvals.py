"""Signed approval ids: a client cannot forge one, nor move one to another session or tenant.

An id is `apr_<nonce>.<mac>` where mac = HMAC-SHA256(key, "tenant\\0session\\0nonce"), truncated.
The key is derived from CE_SECRET_KEY (every configured key verifies, the first signs: rotation).
Replay is prevented by the session itself: a decided approval is no longer pending, and asked again
it answers with the stored answer of the turn it resumed (actors.session), running nothing.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections.abc import Sequence


def approval_keys(secret_keys: Sequence[str]) -> tuple[bytes, ...]:
    """HMAC keys for approvals, one per configured secret (domain-separated from encryption)."""
    return tuple(hmac.new(k.encode(), b"chat-engine approvals v1", hashlib.sha256).digest() for k in secret_keys)


def _mac(key: bytes, tenant_id: str, session_id: str, nonce: str) -> str:
    digest = hmac.new(key, f"{tenant_id}\x00{session_id}\x00{nonce}".encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest[:18]).decode()


def new_approval_id(keys: Sequence[bytes], tenant_id: str, session_id: str) -> str:
    nonce = secrets.token_urlsafe(12)
    if not keys:
        return f"apr_{nonce}"
    return f"apr_{nonce}.{_mac(keys[0], tenant_id, session_id, nonce)}"


def verify_approval_id(keys: Sequence[bytes], tenant_id: str, session_id: str, approval_id: str) -> bool:
    """True when `approval_id` was signed for this tenant's session by one of `keys` (or, with
    no keys configured, when it is well formed)."""
    # ids are ASCII (hmac.compare_digest raises on anything else: a forged id was a 500)
    if not approval_id.startswith("apr_") or len(approval_id) > 100 or not approval_id.isascii():
        return False
    if not keys:
        return True
    nonce, _, mac = approval_id[4:].partition(".")
    if not nonce or not mac:
        return False
    return any(hmac.compare_digest(mac, _mac(k, tenant_id, session_id, nonce)) for k in keys)
