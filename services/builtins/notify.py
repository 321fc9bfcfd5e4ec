"""Tenant notifications: events such as `lead.created` POSTed to the tenant's webhook, signed as
Standard Webhooks (https://www.standardwebhooks.com) specifies.

Signing: `webhook-signature: v1,<base64(HMAC-SHA256(key, f"{id}.{timestamp}.{body}"))>` where the
key is the base64 text after `whsec_` in the tenant's `notification_secret`, with the headers
`webhook-id` (unique per event; the receiver de-duplicates retries by it) and `webhook-timestamp`
(unix seconds). The body is `{"type", "timestamp", "data"}`.

Nothing is lost and no reply waits for the tenant: `Notifier.emit` writes the event to the outbox
(ce_notifications) and a background loop POSTs it through the engine's SSRF-guarded
`WebhookClient` (the tenant's URL gets no more network reach than its tools), each attempt bounded
in time, retried on a schedule of hours for retryable failures, even by another process after a
crash (at least once: receivers de-duplicate by `webhook-id`). Every failure is logged
(`notification_failed`), none is raised to the tool. Delivered and given-up events are deleted
after KEEP_S (7 days) by any process that runs the loop, timed by a clock (PRUNE_EVERY_S).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import hmac
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Protocol

import msgspec
import structlog

from services.botconfig import BotConfig
from services.tools.errors import (
    DestinationBlocked,
    ToolError,
    UpstreamMalformed,
)
from storage.repos.notifications import NewNotification

log = structlog.get_logger(__name__)

SECRET_PREFIX = "whsec_"
SIGNATURE_VERSION = "v1"
DEFAULT_ATTEMPT_TIMEOUT_S = 5.0
#: waits before the 2nd, 3rd, ... attempt: about 11 hours in all, then the event is given up
RETRY_SCHEDULE_S = (5.0, 30.0, 120.0, 600.0, 1800.0, 3600.0, 3 * 3600.0, 6 * 3600.0)
POLL_S = 2.0  # how often the loop looks for due events queued by other processes
LEASE_S = 60.0  # a claimed event is claimed again after this if its process died meanwhile
CLAIM_BATCH = 32
#: a dedicated session actor (a process per live session, two connections) delivers what it
#: queues at once, and looks for other processes' due events rarely and a few at a time
LIGHT_POLL_S = 30.0
LIGHT_BATCH = 4
#: how often a delivering process deletes old events: at its first idle poll, then at the first
#: idle poll an hour after its last prune (a clock, not a count of polls: a dedicated session
#: actor polls every 30 s and lives minutes, and must prune too)
PRUNE_EVERY_S = 3600.0
FORGET_EVERY_POLLS = 30  # idle polls between forgetting the ids other processes settled
KEEP_S = 7 * 86400.0  # delivered and given-up events (their payloads hold contact details) are deleted after
DRAIN_BATCH = 1000


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


def event_id(tenant_id: str, event_type: str, key: str) -> str:
    """The `webhook-id` of the one event of `event_type` about `key` (stable across retries)."""
    digest = hashlib.sha256(f"{tenant_id}\x00{event_type}\x00{key}".encode()).digest()
    return "msg_" + base64.urlsafe_b64encode(digest[:18]).decode()


class Event(msgspec.Struct, frozen=True, kw_only=True):
    """The body of a notification (no top-level field is ever null)."""

    type: str
    timestamp: str
    data: dict[str, Any]


class WebhookPoster(Protocol):
    """services.tools.webhook.WebhookClient's `call` (the SSRF-guarded client)."""

    policy: Any  # services.tools.ssrf.DestinationPolicy: the operator's (CE_WEBHOOK_ALLOW)

    async def call(self, *, url_template: str, method: str, args: Any, headers: Any, timeout_s: float,
                   idempotency_key: str | None = None, tool_name: str | None = None, policy: Any = None) -> Any: ...


class EgressSource(Protocol):
    """storage.repos.egress.EgressRepo: the destinations an operator allowed each tenant."""

    async def allowances(self, tenant_id: str) -> tuple[tuple[str, int], ...]: ...


class Outbox(Protocol):
    """storage.repos.notifications.NotificationRepo: where events wait until delivered."""

    async def enqueue(self, n: NewNotification) -> bool: ...
    async def claim_due(self, limit: int, lease_s: float) -> list[Any]: ...
    async def delivered(self, id: str, attempt: int) -> None: ...
    async def retry_in(self, id: str, attempt: int, delay_s: float, error: str) -> None: ...
    async def give_up(self, id: str, attempt: int, error: str) -> None: ...
    async def settled(self, ids: list[str]) -> set[str]: ...
    async def prune(self, older_than_s: float) -> int: ...


class Announcer:
    """Builds a tool's event from the row it wrote (see Notifier.announcer)."""

    def __init__(self, notifier: Notifier, config: BotConfig, event_type: str, tenant_id: str,
                 about: Callable[[Any], tuple[Any, dict[str, Any]]]) -> None:
        self._notifier = notifier
        self._on = bool(config.notification_webhook) and notifier.sends
        self._event_type = event_type
        self._tenant_id = tenant_id
        self._about = about
        self._built: list[str] = []

    def __bool__(self) -> bool:
        """False when nothing would be announced (the tenant has no webhook): the repository
        then writes its row alone, in one statement."""
        return self._on

    def __call__(self, row: Any) -> NewNotification | None:
        if not self._on:
            return None
        key, data = self._about(row)
        n = self._notifier.build(self._tenant_id, self._event_type, key, data)
        self._built = [n.id]  # one row per call: an attempt rolled back and tried again replaces it
        return n

    def done(self) -> None:
        """The row's transaction committed: deliver what it queued."""
        self._notifier.announced(self._built)
        self._built = []


class ConfigSource(Protocol):
    async def config_for(self, tenant_id: str) -> BotConfig: ...


_UNDECRYPTABLE = ("the stored notification_secret cannot be decrypted with this engine's CE_SECRET_KEY; "
                  "PUT /v1/bot-config with it again")


class Notifier:
    """Queues tenant events in the outbox and delivers them from a background loop.

    An event is written with the row it is about (`announcer`, in that row's transaction) or on
    its own (`emit`); either way it survives a crash of this process, and the loop is woken. The
    loop claims due events (any host may: rows are leased), signs each attempt afresh with the
    tenant's current secret and URL, and after any answer but 2xx schedules the next attempt from
    `schedule_s`; when the schedule ends, or the failure is the tenant's own setting (a blocked,
    missing or malformed URL, a bad secret), the event is given up and logged. `drain()` waits
    until every event this notifier queued is delivered or given up (tests, shutdown).
    """

    def __init__(
        self,
        client: WebhookPoster | None,
        outbox: Outbox,
        configs: ConfigSource,
        *,
        attempt_timeout_s: float = DEFAULT_ATTEMPT_TIMEOUT_S,
        schedule_s: tuple[float, ...] = RETRY_SCHEDULE_S,
        poll_s: float = POLL_S,
        batch: int = CLAIM_BATCH,
        lease_s: float = LEASE_S,
        now: Callable[[], float] = time.time,
        decrypt: Callable[[str], str] | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        egress: EgressSource | None = None,
    ) -> None:
        self._client = client
        self._egress = egress  # a tenant's webhook is checked with its egress allowances added
        self._outbox = outbox
        self._configs = configs
        self._attempt_timeout_s = attempt_timeout_s
        self._schedule_s = schedule_s
        self._poll_s = poll_s
        self._batch = batch
        self._lease_s = max(lease_s, attempt_timeout_s * 2)
        self._now = now
        self._decrypt = decrypt  # the secret box of CE_SECRET_KEY: reads `notification_secret_enc`
        self._monotonic = monotonic  # when this process last pruned the outbox
        self._pruned_at: float | None = None
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._queued: set[str] = set()  # queued by this notifier, not yet known to be settled

    def start(self) -> None:
        """Start the delivery loop (idempotent). Events queued by any process are delivered."""
        if self._loop_task is None and self._client is not None:
            self._loop_task = asyncio.create_task(self._run(), name="notifications")

    def announcer(self, config: BotConfig, event_type: str, *, tenant_id: str,
                  about: Callable[[Any], tuple[Any, dict[str, Any]]]) -> Announcer:
        """For a tool that writes a row: `about(row)` gives (the row's id, the event's data). Pass
        the announcer to the repository, which queues the event in the row's transaction (the row
        and its event are written together or not at all), then call `done()`."""
        return Announcer(self, config, event_type, tenant_id, about)

    def build(self, tenant_id: str, event_type: str, key: Any, data: dict[str, Any]) -> NewNotification:
        """The event about `key`; its id (the `webhook-id`) derives from it, so a replayed call
        that reaches the same row queues nothing new."""
        stamp = int(self._now())
        event = Event(type=event_type, timestamp=datetime.fromtimestamp(stamp, UTC).isoformat(), data=data)
        return NewNotification(id=event_id(tenant_id, event_type, str(key)), tenant_id=tenant_id,
                               event_type=event_type, payload=msgspec.to_builtins(event))

    def announced(self, ids: list[str]) -> None:
        """Events were queued (committed): deliver them now."""
        if ids:
            self._queued.update(ids)
            self.start()
            self._wake.set()

    async def emit(self, config: BotConfig, event_type: str, data: dict[str, Any], *, tenant_id: str,
                   key: Any) -> str | None:
        """Queue an event on its own (not tied to a row's transaction); returns its id, or None
        when the tenant has no webhook. Raises the storage error when it cannot be queued."""
        if not config.notification_webhook or self._client is None:
            return None
        n = self.build(tenant_id, event_type, key, data)
        if await self._outbox.enqueue(n):
            self.announced([n.id])
        return n.id

    @property
    def sends(self) -> bool:
        return self._client is not None

    async def drain(self, timeout_s: float = 30.0) -> None:
        """Wait up to `timeout_s` until every event this notifier queued is delivered or given up."""
        deadline = time.monotonic() + timeout_s
        while self._queued and time.monotonic() < deadline:
            self._queued -= await self._outbox.settled(list(self._queued)[:DRAIN_BATCH])
            if self._queued:
                self._wake.set()
                await asyncio.sleep(0.02)

    async def close(self, timeout_s: float = 1.0) -> None:
        """Give queued events `timeout_s`, then stop the loop. What is left waits in the outbox
        for the next process, so a stopping host need not wait for a tenant's slow endpoint."""
        with contextlib.suppress(Exception):
            await self.drain(timeout_s)
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
            self._loop_task = None

    async def _run(self) -> None:
        polls = 0
        while True:
            self._wake.clear()  # before the claim: an emit during it wakes the next wait
            try:
                batch = await self._outbox.claim_due(self._batch, self._lease_s)
                if batch:
                    for n, outcome in zip(batch, await asyncio.gather(
                            *(self._attempt(n) for n in batch), return_exceptions=True), strict=True):
                        if isinstance(outcome, Exception):  # recording the outcome failed: leased, retried
                            log.warning("notification_loop_retry", webhook_id=n.id, error=type(outcome).__name__)
                    continue
                polls += 1
                if self._queued and polls % FORGET_EVERY_POLLS == 0:  # settled by other processes
                    self._queued -= await self._outbox.settled(list(self._queued)[:DRAIN_BATCH])
                await self._prune_when_due()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - Postgres away: the events wait in the outbox
                log.warning("notification_loop_retry", error=type(exc).__name__)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._poll_s)

    async def _prune_when_due(self) -> None:
        """Delete events settled more than KEEP_S ago, when this process has not for PRUNE_EVERY_S
        (or ever). The time is taken first: a prune that fails waits for the next hour too."""
        now = self._monotonic()
        if self._pruned_at is not None and now - self._pruned_at < PRUNE_EVERY_S:
            return
        self._pruned_at = now
        pruned = await self._outbox.prune(KEEP_S)
        if pruned:
            log.info("notifications_pruned", count=pruned)

    async def _attempt(self, n: Any) -> None:
        bound = log.bind(tenant_id=n.tenant_id, event_type=n.event_type, webhook_id=n.id, attempt=n.attempts)
        try:
            config = await self._configs.config_for(n.tenant_id)
            error = await self._send(n, config)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a background loop must log, not die
            bound.exception("notification_failed", error_kind="internal", final=False)
            error = ("internal", type(exc).__name__, True)
        if error is None:
            await self._outbox.delivered(n.id, n.attempts)
            self._queued.discard(n.id)
            bound.info("notification_delivered")
            return
        kind, reason, retryable = error
        # Any answer but 2xx is retried on the schedule (a 404 or 401 during the tenant's deploy or
        # secret rotation too, as Standard Webhooks senders do); only the tenant's own settings
        # (no URL, a blocked or malformed one, a bad secret) make a failure final at once.
        final = not retryable or n.attempts > len(self._schedule_s)
        (bound.warning if final else bound.info)("notification_failed", error_kind=kind, reason=reason, final=final)
        text = f"{kind}: {reason}" if reason else kind
        if final:
            await self._outbox.give_up(n.id, n.attempts, text)
            self._queued.discard(n.id)
        else:
            await self._outbox.retry_in(n.id, n.attempts, self._delay(n.attempts), text)

    async def _policy(self, tenant_id: str) -> Any:
        """The operator's policy with the tenant's egress allowances added; None (the client's
        own) when it has none. Raises the storage error when they cannot be read (retried)."""
        allowances = await self._egress.allowances(tenant_id) if self._egress is not None else ()
        return self._client.policy.for_tenant(allowances) if allowances else None  # type: ignore[union-attr]

    def _delay(self, attempts: int) -> float:
        return self._schedule_s[min(attempts, len(self._schedule_s)) - 1] if self._schedule_s else self._poll_s

    async def _send(self, n: Any, config: BotConfig) -> tuple[str, str | None, bool] | None:
        """One attempt; None when delivered, else (error kind, reason, retryable)."""
        url, secret = config.notification_webhook, config.notification_secret
        if not url:
            return ("no_webhook", "the tenant has no notification_webhook now", False)
        if config.notification_secret_enc:
            try:
                if self._decrypt is None:
                    raise ValueError("no CE_SECRET_KEY")
                secret = self._decrypt(config.notification_secret_enc)
            except Exception:  # noqa: BLE001 - a key rotated away, or none: the tenant's setting to fix
                return ("invalid_secret", _UNDECRYPTABLE, False)
        if "{" in url or "}" in url:
            # the client reads {holes} as a URL template; a notification URL is a plain URL
            return ("invalid_url", "the notification_webhook contains { or }", False)
        # The client sends `args` as the JSON body, encoded by msgspec exactly like this (top-level
        # keys in order, no null values to drop), so these are the bytes the receiver verifies.
        body = msgspec.json.encode(n.payload)
        stamp = int(self._now())
        headers = {"webhook-id": n.id, "webhook-timestamp": str(stamp)}
        if secret:
            try:
                headers["webhook-signature"] = sign(secret, n.id, stamp, body)
            except InvalidSecret as exc:
                return ("invalid_secret", str(exc), False)
        else:
            log.warning("notification_unsigned", tenant_id=n.tenant_id, webhook_id=n.id)
        try:
            await self._client.call(  # type: ignore[union-attr]
                url_template=url, method="POST", args=n.payload, headers=headers,
                timeout_s=self._attempt_timeout_s, tool_name=f"notify:{n.event_type}",
                policy=await self._policy(n.tenant_id),
            )
        except UpstreamMalformed:
            return None  # a 2xx with a body that is not JSON: delivered all the same
        except DestinationBlocked as exc:
            return (exc.kind, exc.reason, False)
        except ToolError as exc:
            return (exc.kind, exc.reason, True)
        return None
