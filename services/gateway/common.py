"""What the gateway's route modules share: the dependencies and keys of the app, request helpers
(typed body decoding, JSON answers, whole numbers and times from a URL, the session id of a path),
and the one mapping of domain errors to problem-details answers.

services/gateway/app.py assembles the app from the route modules; they import this module, never
app.py.
"""

from __future__ import annotations

import asyncio
import base64
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol, runtime_checkable

import msgspec
import structlog
from aiohttp import web
from cachetools import TTLCache

from kernel.errors import (
    ChatEngineError,
    Conflict,
    Forbidden,
    InvalidInput,
    LimitReached,
    NotFound,
    Overloaded,
    Unauthorized,
)
from kernel.records import SessionEvent
from services.gateway.limits import TenantLimiter, TenantRate
from services.gateway.metrics import GatewayMetrics
from services.nesting import MAX_JSON_DEPTH, raw_nests_deeper_than
from services.tools.ssrf import DestinationPolicy
from services.wire import (
    ApprovalDecision,
    SessionCommand,
    SessionView,
    StreamEvent,
    Turn,
    TurnCommand,
    TurnReply,
)

log = structlog.get_logger(__name__)

SESSION_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}\Z")
MAX_TEXT = 16_000
MAX_BODY = 256 * 1024
#: how long a gateway trusts a key it found in Postgres: a revoked key is refused within this
KEY_CACHE_TTL_S = 30.0
KEY_CACHE_MAX = 10_000
#: how long a gateway remembers that a key digest is unknown, so that the same bogus key sent again
#: costs no Postgres lookup. Keys are random, so a digest unknown now becomes known only if that
#: very key is issued later (never in practice); a newly issued key has a digest of its own and
#: works at once. Bounded: under a flood of distinct bogus keys the least recently seen go first.
UNKNOWN_KEY_TTL_S = 30.0
UNKNOWN_KEY_CACHE_MAX = 4096


@runtime_checkable
class SessionRouter(Protocol):
    """Where turns run (actors.placement.Placement, or a SessionHost in process)."""

    async def send(self, turn: Turn, *, new_id: bool = False) -> TurnReply: ...
    async def decide(self, decision: ApprovalDecision) -> TurnReply: ...
    def stream(self, command: TurnCommand, *, new_id: bool = False) -> AsyncIterator[StreamEvent]: ...
    async def act(self, command: SessionCommand) -> TurnReply: ...
    async def watch(self, tenant_id: str, session_id: str, after: int, wait_s: float) -> list[SessionEvent]: ...
    async def view(self, tenant_id: str, session_id: str) -> SessionView | None: ...
    async def stats(self) -> list[dict[str, Any]]: ...


@dataclass
class GatewayDeps:
    router: SessionRouter
    tenants: Any  # storage TenantRepo
    tools: Any  # storage ToolRepo
    calls: Any  # storage ToolCallRepo
    sessions: Any  # storage SessionRepo
    configs: Any  # storage BotConfigRepo
    secret_box: Any  # services.tools.crypto.SecretBox
    #: CE_SECRET_KEY's keys, from which each tenant's test-contact key is derived (services.contacts)
    secret_keys: tuple[str, ...] = ()
    contract: Callable[[str], Awaitable[dict]] | None = None
    jobs: Any = None  # storage JobRepo
    #: storage HandoffRepo (list and read handoffs; their changes run in the session); None: no such routes
    handoffs: Any = None
    #: the agents' feed (services.gateway.feed.AgentFeed); None: GET /v1/handoffs/events is 404
    feed: Any = None
    #: set when the gateway begins to close: live streams (watchers) end at once
    closing: asyncio.Event = field(default_factory=asyncio.Event)
    #: the handlers of live streams (watchers), cancelled when the gateway begins to close
    streams: set[asyncio.Task] = field(default_factory=set)
    #: work a request started and did not wait for (a job's result waking its session)
    background: set[asyncio.Task] = field(default_factory=set)
    limiter: TenantLimiter = field(default_factory=lambda: TenantLimiter(rate=0, burst=1, concurrency=0))
    ready: Callable[[], Awaitable[bool]] | None = None
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    #: sha256(key) -> (tenant id, key kind), for keys found in Postgres
    #: (an entry lives its TTL from when it was put, however often it is read; least recently used out)
    key_cache: TTLCache = field(default_factory=lambda: TTLCache(maxsize=KEY_CACHE_MAX, ttl=KEY_CACHE_TTL_S))
    #: sha256(key) of keys Postgres did not know (apart from key_cache: bogus keys cannot push out good ones)
    unknown_keys: TTLCache = field(
        default_factory=lambda: TTLCache(maxsize=UNKNOWN_KEY_CACHE_MAX, ttl=UNKNOWN_KEY_TTL_S))
    #: key lookups in flight, by the key's digest: requests for the same key wait for one
    key_lookups: dict[str, asyncio.Future] = field(default_factory=dict)
    #: the SSRF guard's allowlist: URLs whose IP-literal host it would refuse are refused at registration
    webhook_policy: DestinationPolicy = field(default_factory=DestinationPolicy)
    #: storage EgressRepo: the destinations an operator allowed each tenant (`tenant_policy`)
    egress: Any = None
    #: the bearer token GET /metrics asks of a scraper (CE_METRICS_TOKEN); None: loopback peers only
    metrics_token: str | None = None
    #: a tenant's configuration writes (CONFIG_ROUTES' POST, PUT, PATCH, DELETE) per second at this
    #: gateway (CE_ADMIN_WRITE_RATE); unlimited unless set
    admin_writes: TenantRate = field(default_factory=lambda: TenantRate(
        rate=0, burst=1, reason="admin_rate", what="rate of configuration writes"))


DEPS = web.AppKey("deps", GatewayDeps)
TENANT = web.RequestKey("ce_tenant_id", str)
KEY_KIND = web.RequestKey("ce_key_kind", str)  # "admin" or "chat" (kernel.records.KeyKind)

#: all a `chat` key may do, as (method, route): what a contact's page needs, nothing else
CHAT_ROUTES = frozenset({
    ("POST", "/v1/sessions/{session_id}/messages"),
    ("POST", "/v1/sessions/{session_id}/approvals/{approval_id}"),
    ("GET", "/v1/sessions/{session_id}"),
    ("GET", "/v1/sessions/{session_id}/events"),
    ("GET", "/v1/sessions/{session_id}/ws"),
})
#: what a configuration write is: a POST, PUT, PATCH or DELETE under one of these (a tenant's
#: tools, forms, services, MCP servers, bot config), limited by GatewayDeps.admin_writes
CONFIG_PREFIXES = ("/v1/tools", "/v1/forms", "/v1/appointment-services", "/v1/mcp-servers", "/v1/bot-config")
WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
REQUEST_ID = web.RequestKey("ce_request_id", str)
MESSAGE_ID = web.RequestKey("ce_message_id", str)  # the turn's message id, the client's or made up here


_DIGITS_RE = re.compile(r"[0-9]+")  # ASCII only, unlike str.isdigit() and \d
_decoders: dict[type, msgspec.json.Decoder] = {}
_encoder = msgspec.json.Encoder()


# -- problems ---------------------------------------------------------------------------------

def problem(status: int, title: str, detail: str, *, headers: dict[str, str] | None = None) -> web.Response:
    body = {"type": f"https://chat-engine.dev/problems/{title.lower().replace(' ', '-')}",
            "title": title, "status": status, "detail": detail}
    return web.Response(status=status, body=_encoder.encode(body),
                        content_type="application/problem+json", headers=headers)


def count_refusal(request: web.Request, exc: Exception) -> None:
    """`ce_refused_total{reason}` for a request refused with Retry-After (Overloaded)."""
    deps = request.app.get(DEPS)
    if isinstance(exc, Overloaded) and deps is not None:
        deps.metrics.refused.labels(exc.reason).inc()


def failure(exc: Exception, request_id: str, path: str) -> tuple[int, str, str, float | None]:
    """What a request that failed with `exc` answers: (status, title, detail, retry after s or
    None). A problem+json response says it, or, once an SSE stream began, its last event."""
    if isinstance(exc, msgspec.ValidationError):
        return 422, "Invalid body", f"{exc}; fix the field and send again", None
    if isinstance(exc, msgspec.DecodeError):
        return 400, "Malformed JSON", f"the body is not valid JSON ({exc}); send a JSON object", None
    if isinstance(exc, InvalidInput):
        return 422, "Invalid body", str(exc), None
    if isinstance(exc, NotFound):
        return 404, "Not found", str(exc), None
    if isinstance(exc, LimitReached):
        # a Conflict (409: the same request succeeds once the tenant deletes one), with a problem
        # type of its own so a client can tell a full registry from a duplicate name
        return 409, "Limit reached", str(exc), None
    if isinstance(exc, Conflict):
        return 409, "Conflict", str(exc), None
    if isinstance(exc, Unauthorized):
        return 401, "Unauthorized", str(exc), None
    if isinstance(exc, Forbidden):
        return 403, "Forbidden", str(exc), None
    if isinstance(exc, Overloaded):
        return exc.status, "Too many requests" if exc.status == 429 else "Overloaded", str(exc), exc.retry_after
    if isinstance(exc, ChatEngineError):
        if getattr(exc, "retryable", False):
            return 503, "Unavailable", str(exc), 1.0
        kind = getattr(getattr(exc, "error", None), "kind", None)
        if kind == "not_found":
            return 404, "Not found", str(exc), None
        if kind == "conflict":
            return 409, "Conflict", str(exc), None
        if kind == "unauthorized":
            return 401, "Unauthorized", str(exc), None
        if kind == "forbidden":
            return 403, "Forbidden", str(exc), None
        if kind == "internal":
            # the host failed on its side (it logged why); not the caller's fault, so not a 4xx
            return 500, "Internal error", str(exc), None
        log.warning("request_failed", error=type(exc).__name__)
        return 400, "Request failed", str(exc), None
    log.error("unhandled_error", path=path, exc_info=exc)
    return 500, "Internal error", f"something went wrong on our side; quote request id {request_id}", None


# -- request helpers --------------------------------------------------------------------------

class OutOfRange(InvalidInput):
    """A whole number was sent where one is expected, but outside the range the route takes."""


def whole_number(raw: str, *, name: str, low: int, high: int, at: str) -> int:
    """`raw`, a value from a query string or a path, as an int from `low` to `high`.

    Only ASCII digits make a whole number: str.isdigit() also passes '²' (which int() refuses)
    and int() reads other scripts' digits. Raises InvalidInput naming `name`, the range and
    where it was (`at`) when `raw` is not a whole number, and OutOfRange (an InvalidInput) when
    it is one outside the range. A number with more digits than `high` is refused without being
    converted (int() itself fails beyond 4300 digits).
    """
    message = f"{name} must be a whole number from {low} to {high}, got {raw[:20]!r} - at `{at}`"
    if not _DIGITS_RE.fullmatch(raw):
        raise InvalidInput(message, path=at)
    digits = raw.lstrip("0") or "0"
    if len(digits) > len(str(high)) or not low <= int(digits) <= high:
        raise OutOfRange(message, path=at)
    return int(digits)


async def tenant_policy(deps: GatewayDeps, tenant_id: str) -> DestinationPolicy:
    """What a tenant's tool URLs (webhooks, its backend's base URL) are checked against:
    CE_WEBHOOK_ALLOW with the egress allowances an operator granted that tenant."""
    if deps.egress is None:
        return deps.webhook_policy
    return deps.webhook_policy.for_tenant(await deps.egress.allowances(tenant_id))


#: the most items one page of a list route holds (`?limit=`)
PAGE_MAX = 1000


def page_of(request: web.Request, *, default: int) -> tuple[int, str]:
    """A list route's `?limit=` (1 to PAGE_MAX; `default` when absent) and `?cursor=` (the
    `next_cursor` of the page before; "" for the first page). Raises InvalidInput naming them."""
    raw = request.query.get("limit")
    limit = default if raw is None else whole_number(raw, name="limit", low=1, high=PAGE_MAX, at="?limit")
    cursor = request.query.get("cursor", "")
    if len(cursor) > 256 or "\x00" in cursor:
        raise InvalidInput("cursor must be the next_cursor of the page before - at `?cursor`", path="?cursor")
    return limit, cursor


def keyset_cursor(at: datetime, row_id: str) -> str:
    """The `next_cursor` of a list read by time (a row's time and id), opaque to clients: URL-safe
    base64 of both, so that it goes into a query string as it is."""
    return base64.urlsafe_b64encode(f"{at.isoformat()}|{row_id}".encode()).decode().rstrip("=")


def keyset_of(cursor: str) -> tuple[datetime, str] | None:
    """The row `cursor` (a `keyset_cursor`) names; None for "" (the first page). Raises InvalidInput."""
    if not cursor:
        return None
    try:
        at, sep, row_id = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode().partition("|")
        moment = datetime.fromisoformat(at)
    except ValueError:  # binascii.Error and UnicodeDecodeError are ValueErrors
        sep = ""
    if not sep or not row_id or moment.tzinfo is None:
        raise InvalidInput("cursor must be the next_cursor of the page before, as it was given - at `?cursor`",
                           path="?cursor")
    return moment, row_id


def paged(rows: list[Any], limit: int, cursor_of: Callable[[Any], str]) -> tuple[list[Any], str | None]:
    """`rows` (fetched with `limit + 1`) cut to one page, and the cursor of the next page (None
    when this is the last)."""
    if len(rows) <= limit:
        return rows, None
    return rows[:limit], cursor_of(rows[limit - 1])


_TOO_DEEP_BODY = (f"the body nests arrays or objects too deeply (more than {MAX_JSON_DEPTH} levels); "
                  "send a flatter JSON object")
_NUL_ESCAPE = re.compile(rb"(?<!\\)(?:\\\\)*\\u0000")  # a JSON \u0000 escape (not an escaped backslash)


async def decode_body(request: web.Request, type_: type) -> Any:
    if request.content_length is not None and request.content_length > MAX_BODY:
        raise web.HTTPRequestEntityTooLarge(max_size=MAX_BODY, actual_size=request.content_length,
                                            text=f"the body is larger than {MAX_BODY} bytes; send less")
    encoding = request.headers.get("Content-Encoding", "").strip()[:40]
    fix = "send a JSON object compressed as that header says, or uncompressed without the header"
    try:
        raw = await request.read()
    except web.RequestPayloadError:
        # aiohttp decompresses while reading: a corrupt body fails here (so does one cut short of
        # its Content-Length or its chunked framing, whatever its encoding)
        raise web.HTTPBadRequest(text=f"the body could not be decoded (Content-Encoding: {encoding}); {fix}"
                                 if encoding else "the body could not be read: it ended before its "
                                 "Content-Length or its chunked framing is broken; send it again") from None
    if not raw:
        # a corrupt or cut-short gzip body decompresses to nothing rather than failing
        if encoding and (request.content_length or getattr(request.content, "total_raw_bytes", 0)):
            raise web.HTTPBadRequest(text=f"the body could not be decoded (Content-Encoding: {encoding}): it "
                                     f"decompresses to nothing; {fix}")
        raise InvalidInput("the body is empty; send a JSON object")
    decoder = _decoders.get(type_)
    if decoder is None:
        decoder = _decoders[type_] = msgspec.json.Decoder(type_)
    if raw_nests_deeper_than(raw):  # counted, not left to the decoder: the same answer on every Python
        raise InvalidInput(_TOO_DEEP_BODY)
    try:
        body = decoder.decode(raw)
    except RecursionError:  # only under an unusually deep stack on Python 3.11: the same answer
        raise InvalidInput(_TOO_DEEP_BODY) from None
    if _NUL_ESCAPE.search(raw):
        raise InvalidInput("the body holds a NUL character (\\u0000), which cannot be stored; remove it")
    return body


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=_encoder.encode(data), content_type="application/json")


def path_session_id(request: web.Request) -> str:
    """The `{session_id}` of the request's path; raises InvalidInput when it is not a session id."""
    sid = request.match_info["session_id"]
    if not SESSION_ID_RE.match(sid):
        raise InvalidInput(
            f"session id {sid[:40]!r} must be 1-128 letters, digits or . _ : @ - and start with a letter or digit"
        )
    return sid


def encrypter(deps: GatewayDeps) -> Callable[[str], str]:
    """Encrypts a credential a tenant stores; raises InvalidInput when this engine has no CE_SECRET_KEY."""
    def encrypt(plaintext: str) -> str:
        if deps.secret_box is None:
            raise InvalidInput("this engine has no CE_SECRET_KEY, so it cannot store secrets; set it and restart")
        return deps.secret_box.encrypt(plaintext)
    return encrypt


def parse_since(raw: str | None) -> datetime:
    """`since` as an ISO-8601 time or a look-back like 24h, 7d, 30m; default: the last 24 hours."""
    now = datetime.now(UTC)
    if not raw:
        return now - timedelta(hours=24)
    m = re.fullmatch(r"(\d+)([mhd])", raw)
    try:
        if m:
            n, unit = int(m.group(1)), m.group(2)
            return now - {"m": timedelta(minutes=n), "h": timedelta(hours=n), "d": timedelta(days=n)}[unit]
        value = datetime.fromisoformat(raw)
        # in UTC, as Postgres will compare it: a year-1 time with a +14:00 offset would fall before year 1
        return (value if value.tzinfo else value.replace(tzinfo=UTC)).astimezone(UTC)
    except (ValueError, OverflowError):
        raise InvalidInput(f"since must be an ISO-8601 time (2026-12-01T00:00:00Z) or a look-back like 24h or 7d "
                           f"within the calendar, got {raw[:40]!r}") from None
