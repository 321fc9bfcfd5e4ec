"""Tenant notifications: events such as `lead.created` POSTed to the tenant's webhook, signed as
Standard Webhooks (https://www.standardwebhooks.com) specifies.

Signing: `webhook-signature: v1,<base64(HMAC-SHA256(key, f"{id}.{timestamp}.{body}"))>` where the
key is the base64 text after `whsec_` in the tenant's `notification_secret`, with the headers
`webhook-id` (unique per event; the receiver de-duplicates retries by it) and `webhook-timestamp`
(unix seconds). The body is `{"type", "timestamp", "data"}`.

Delivery never blocks a reply: `Notifier.emit` schedules a background task that POSTs through the
engine's SSRF-guarded `WebhookClient` (the tenant's URL gets no more network reach than its tools),
each attempt bounded in time, a few attempts with backoff for retryable failures, every failure
logged (`notification_failed`) and never raised to the tool.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import secrets
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, Protocol

import msgspec
import structlog

from services.botconfig import BotConfig
from services.tools.errors import ToolError, UpstreamMalformed

log = structlog.get_logger(__name__)

SECRET_PREFIX = "whsec_"
SIGNATURE_VERSION = "v1"
DEFAULT_ATTEMPT_TIMEOUT_S = 5.0
DEFAULT_BACKOFF_S = (0.5, 2.0)  # waits before the 2nd and 3rd attempt


class InvalidSecret(ValueError):
    """The notification secret is not `whsec_` + base64 (or plain base64)."""


def secret_key(secret: str) -> bytes:
    """The HMAC key of a Standard Webhooks secret: base64-decoded text after `whsec_`.

    Raises InvalidSecret when it is not valid base64 or decodes to nothing.
    """
    raw = secret.removeprefix(SECRET_PREFIX)
    try:
        key = base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidSecret("the notification secret is not whsec_ followed by base64") from None
    if not key:
        raise InvalidSecret("the notification secret is empty")
    return key


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` value (`v1,<base64>`) of one message."""
    signed = f"{msg_id}.{timestamp}.".encode() + body
    digest = hmac.new(secret_key(secret), signed, hashlib.sha256).digest()
    return f"{SIGNATURE_VERSION},{base64.b64encode(digest).decode()}"


def verify(secret: str, headers: dict[str, str] | Any, body: bytes, *, tolerance_s: int = 300,
           now: float | None = None) -> bool:
    """What a receiver does: True when one of the space-separated `v1,` signatures matches and the
    timestamp is within `tolerance_s` of now. Header names are matched case-insensitively."""
    get = (lambda k: headers.get(k)) if hasattr(headers, "get") else (lambda k: None)
    msg_id, stamp, signatures = get("webhook-id"), get("webhook-timestamp"), get("webhook-signature")
    if not (msg_id and stamp and signatures):
        return False
    try:
        ts = int(stamp)
    except ValueError:
        return False
    if abs((time.time() if now is None else now) - ts) > tolerance_s:
        return False
    expected = sign(secret, msg_id, ts, body).split(",", 1)[1]
    for candidate in signatures.split(" "):
        version, _, value = candidate.partition(",")
        if version == SIGNATURE_VERSION and hmac.compare_digest(value, expected):
            return True
    return False


class Event(msgspec.Struct, frozen=True, kw_only=True):
    """The body of a notification (no top-level field is ever null)."""

    type: str
    timestamp: str
    data: dict[str, Any]


class WebhookPoster(Protocol):
    """services.tools.webhook.WebhookClient's `call` (the SSRF-guarded client)."""

    async def call(self, *, url_template: str, method: str, args: Any, headers: Any, timeout_s: float,
                   idempotency_key: str | None = None, tool_name: str | None = None) -> Any: ...


class Notifier:
    """Sends tenant events in the background. `drain()` waits for the ones in flight (tests,
    shutdown)."""

    def __init__(
        self,
        client: WebhookPoster | None,
        *,
        attempt_timeout_s: float = DEFAULT_ATTEMPT_TIMEOUT_S,
        backoff_s: tuple[float, ...] = DEFAULT_BACKOFF_S,
        now: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._client = client
        self._attempt_timeout_s = attempt_timeout_s
        self._backoff_s = backoff_s
        self._now = now
        self._sleep = sleep
        self._tasks: set[asyncio.Task] = set()

    def emit(self, config: BotConfig, event_type: str, data: dict[str, Any], *, tenant_id: str) -> str | None:
        """Schedule `event_type` for the tenant's webhook; returns the event id, or None when the
        tenant has no webhook (or no client is configured). Never raises, never waits."""
        url = config.notification_webhook
        if not url or self._client is None:
            return None
        msg_id = f"msg_{secrets.token_urlsafe(18)}"
        task = asyncio.create_task(self._deliver(url, config.notification_secret, msg_id, event_type, data, tenant_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return msg_id

    async def drain(self, timeout_s: float = 30.0) -> None:
        """Wait up to `timeout_s` for deliveries in flight."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)

    async def close(self, timeout_s: float = 5.0) -> None:
        """Give deliveries in flight `timeout_s`, then cancel the rest."""
        await self.drain(timeout_s)
        for task in list(self._tasks):
            task.cancel()

    async def _deliver(self, url: str, secret: str | None, msg_id: str, event_type: str,
                       data: dict[str, Any], tenant_id: str) -> None:
        bound = log.bind(tenant_id=tenant_id, event_type=event_type, webhook_id=msg_id)
        if "{" in url or "}" in url:
            # the client reads {holes} as a URL template; a notification URL is a plain URL
            bound.warning("notification_failed", error_kind="invalid_url", attempts=0)
            return
        stamp = int(self._now())
        event = Event(type=event_type, timestamp=datetime.fromtimestamp(stamp, UTC).isoformat(), data=data)
        payload = msgspec.to_builtins(event)
        # The client sends `args` as the JSON body, encoded by msgspec exactly like this (top-level
        # keys in order, no null values to drop), so these are the bytes the receiver verifies.
        body = msgspec.json.encode(payload)
        headers = {"webhook-id": msg_id, "webhook-timestamp": str(stamp)}
        if secret:
            try:
                headers["webhook-signature"] = sign(secret, msg_id, stamp, body)
            except InvalidSecret as exc:
                bound.error("notification_failed", error_kind="invalid_secret", detail=str(exc), attempts=0)
                return
        else:
            bound.warning("notification_unsigned")  # no secret configured: the receiver cannot verify
        attempts = 1 + len(self._backoff_s)
        for attempt in range(1, attempts + 1):
            try:
                await self._client.call(  # type: ignore[union-attr]
                    url_template=url, method="POST", args=payload, headers=headers,
                    timeout_s=self._attempt_timeout_s, tool_name=f"notify:{event_type}",
                )
            except UpstreamMalformed:
                pass  # a 2xx with a body that is not JSON: delivered all the same
            except ToolError as exc:
                last = attempt == attempts or not exc.retryable
                (bound.warning if last else bound.info)(
                    "notification_failed", error_kind=exc.kind, reason=exc.reason, attempt=attempt,
                    final=last,
                )
                if last:
                    return
                await self._sleep(self._backoff_s[attempt - 1])
                continue
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a background task must log, not die silently
                bound.exception("notification_failed", error_kind="internal", attempt=attempt, final=True)
                return
            bound.info("notification_delivered", attempt=attempt)
            return
