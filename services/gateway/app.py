"""The stateless aiohttp gateway: tenant auth, the routes of CONTRACT.md, problem+json errors.

The tenant comes from the API key alone (never from a body). Bodies are decoded once with typed
msgspec decoders; domain errors become one problem-details body here and nowhere else. The gateway
keeps no session state: every turn goes to the session's actor through a SessionRouter, so two
gateway processes can serve the same sessions.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, Protocol, runtime_checkable

import msgspec
import structlog
from aiohttp import web
from cachetools import TTLCache

from services.botconfig import Backend, BotConfig, Intent, check_approval_ttl
from services.builtins import DEFINITIONS as BUILTIN_DEFINITIONS
from services.builtins.notify import InvalidSecret, secret_key
from services.errors import (
    ChatEngineError,
    Conflict,
    InvalidInput,
    LimitReached,
    NotFound,
    Overloaded,
)
from services.gateway.bodies import (
    MAX_VARIABLE_NAME,
    ToolCreate,
    ToolPatch,
    check_credential_stays,
    check_url,
    definition_from_body,
    patched_body,
    tool_view,
)
from services.gateway.limits import TenantLimiter
from services.gateway.metrics import GatewayMetrics
from services.tools.ssrf import DestinationPolicy
from services.wire import (
    ApprovalDecision,
    DecideApproval,
    SendMessage,
    SessionView,
    StreamEvent,
    Turn,
    TurnCommand,
    TurnReply,
    TurnTiming,
)
from storage.repos.tools import ToolChanged

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
#: the largest tool version (ce_tool_versions.version is a Postgres INTEGER)
MAX_TOOL_VERSION = 2**31 - 1
#: merges of a tool PATCH into the live version, each redone when a change was published meanwhile
#: (storage.repos.tools.ToolChanged); past the last, 409 asks for the PATCH to be sent again
PATCH_ATTEMPTS = 5
RESERVED_TOOL_NAMES = frozenset({"contract"})  # fixed segments under /v1/tools/
BUILTIN_TOOL_NAMES = frozenset(d.name for d in BUILTIN_DEFINITIONS)


@runtime_checkable
class SessionRouter(Protocol):
    """Where turns run (actors.placement.Placement, or a SessionHost in process)."""

    async def send(self, turn: Turn, *, new_id: bool = False) -> TurnReply: ...
    async def decide(self, decision: ApprovalDecision) -> TurnReply: ...
    def stream(self, command: TurnCommand, *, new_id: bool = False) -> AsyncIterator[StreamEvent]: ...
    async def view(self, tenant_id: str, session_id: str) -> SessionView | None: ...
    async def stats(self) -> list[dict[str, Any]]: ...


class BackendIn(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    base_url: str
    auth_header: str | None = None
    openapi: dict | None = None
    #: what GET shows of the write-only header, taken back: false removes the stored header, true
    #: or absent keeps it (unless `auth_header` replaces it) while base_url stays on the origin it
    #: was written for; true with no header stored is refused, like the `[set]` placeholder
    auth_header_set: bool | None = None


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
    recall_across_sessions: bool = False
    #: the session variable that names the contact (collect_lead sets it; recall reads by it)
    contact_id_variable: str = "contact_id"


@dataclass
class GatewayDeps:
    router: SessionRouter
    tenants: Any  # storage TenantRepo
    tools: Any  # storage ToolRepo
    calls: Any  # storage ToolCallRepo
    sessions: Any  # storage SessionRepo
    configs: Any  # storage BotConfigRepo
    secret_box: Any  # services.tools.crypto.SecretBox
    contract: Callable[[str], Awaitable[dict]] | None = None
    jobs: Any = None  # storage JobRepo
    limiter: TenantLimiter = field(default_factory=lambda: TenantLimiter(rate=0, burst=1, concurrency=0))
    ready: Callable[[], Awaitable[bool]] | None = None
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    #: sha256(key) -> tenant id, for keys found in Postgres
    #: (an entry lives its TTL from when it was put, however often it is read; least recently used out)
    key_cache: TTLCache = field(default_factory=lambda: TTLCache(maxsize=KEY_CACHE_MAX, ttl=KEY_CACHE_TTL_S))
    #: sha256(key) of keys Postgres did not know (apart from key_cache: bogus keys cannot push out good ones)
    unknown_keys: TTLCache = field(
        default_factory=lambda: TTLCache(maxsize=UNKNOWN_KEY_CACHE_MAX, ttl=UNKNOWN_KEY_TTL_S))
    #: key lookups in flight, by the key's digest: requests for the same key wait for one
    key_lookups: dict[str, asyncio.Future] = field(default_factory=dict)
    #: the SSRF guard's allowlist: URLs whose IP-literal host it would refuse are refused at registration
    webhook_policy: DestinationPolicy = field(default_factory=DestinationPolicy)


DEPS = web.AppKey("deps", GatewayDeps)
TENANT = web.RequestKey("ce_tenant_id", str)
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


def _http_problem(exc: web.HTTPException, request: web.Request) -> tuple[int, str, str, dict[str, str] | None]:
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        return 405, exc.reason, f"{request.method} is not allowed on {request.path}; use {allowed}", {"Allow": allowed}
    if isinstance(exc, web.HTTPNotFound):
        return 404, exc.reason, f"there is no route {request.path}; the routes are listed in /openapi.json", None
    return exc.status, exc.reason, exc.text or exc.reason, None


def _count_refusal(request: web.Request, exc: Exception) -> None:
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
    if isinstance(exc, Overloaded):
        return exc.status, "Too many requests" if exc.status == 429 else "Overloaded", str(exc), exc.retry_after
    if isinstance(exc, ChatEngineError):
        if getattr(exc, "retryable", False):
            return 503, "Unavailable", str(exc), 1.0
        kind = getattr(getattr(exc, "error", None), "kind", None)
        if kind == "not_found":
            return 404, "Not found", str(exc), None
        if kind == "internal":
            # the host failed on its side (it logged why); not the caller's fault, so not a 4xx
            return 500, "Internal error", str(exc), None
        log.warning("request_failed", error=type(exc).__name__)
        return 400, "Request failed", str(exc), None
    log.error("unhandled_error", path=path, exc_info=exc)
    return 500, "Internal error", f"something went wrong on our side; quote request id {request_id}", None


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


@web.middleware
async def errors_middleware(request: web.Request, handler):
    request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex[:16]
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(request_id=request_id)
    request[REQUEST_ID] = request_id
    response = await _answer(request, handler, request_id)
    # on every answer, errors most of all: the id to quote to support and to find in the logs
    response.headers.setdefault("X-Request-Id", request_id)
    message_id = request.get(MESSAGE_ID)
    if message_id is not None and not response.prepared:
        # a turn's answer, a failed one most of all (a 503 "retry with the same message_id"):
        # the id to send again when the client sent none and the gateway made one up
        response.headers.setdefault("X-Message-Id", message_id)
    return response


async def _answer(request: web.Request, handler, request_id: str) -> web.StreamResponse:
    if "\x00" in request.path or "\x00" in request.query_string:
        # Postgres cannot store or compare a NUL character: refuse it here, not as a storage error
        return problem(422, "Invalid request", "the URL holds a NUL character (%00); remove it")
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        status, title, detail, headers = _http_problem(exc, request)
        return problem(status, title, detail, headers=headers)
    except Exception as exc:  # noqa: BLE001 - failure() logs what it does not know
        _count_refusal(request, exc)
        status, title, detail, retry_after = failure(exc, request_id, request.path)
        headers = None if retry_after is None else {"Retry-After": str(max(1, math.ceil(retry_after)))}
        return problem(status, title, detail, headers=headers)


@web.middleware
async def auth_middleware(request: web.Request, handler):
    if not request.path.startswith("/v1/"):
        return await handler(request)
    header = request.headers.get("Authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return problem(401, "Unauthorized", "send the tenant API key as 'Authorization: Bearer <key>'",
                       headers={"WWW-Authenticate": "Bearer"})
    deps = request.app[DEPS]
    key = key.strip()
    # keys are printable ASCII: anything else cannot match (nor be hashed or sent to Postgres as is)
    printable = key.isascii() and key.isprintable()
    digest = hashlib.sha256(key.encode()).hexdigest() if printable else ""  # no raw key kept in memory
    tenant_id = deps.key_cache.get(digest) if printable else None
    if tenant_id is None:
        tenant = None
        if printable and not deps.unknown_keys.get(digest):
            tenant = await _key_lookup(deps, digest, key)
            if tenant is None:  # only a definite "unknown": a failed lookup raised and is not cached
                deps.unknown_keys[digest] = True
        if tenant is None:
            return problem(401, "Unauthorized", "this API key is unknown or revoked; ask the tenant's operator "
                           "for a key ('chat-engine tenant add-key NAME')", headers={"WWW-Authenticate": "Bearer"})
        tenant_id = tenant.id
        deps.key_cache[digest] = tenant_id
    request[TENANT] = tenant_id
    structlog.contextvars.bind_contextvars(tenant_id=tenant_id)
    return await handler(request)


async def _key_lookup(deps: GatewayDeps, digest: str, key: str) -> Any:
    """The tenant of `key` from Postgres, one lookup for every request that asks for the same key
    at once (a client's burst, or a flood of one bogus key before it is cached as unknown)."""
    pending = deps.key_lookups.get(digest)
    if pending is None:
        pending = asyncio.ensure_future(deps.tenants.tenant_for_key(key))
        deps.key_lookups[digest] = pending

        def forget(done: asyncio.Future) -> None:
            deps.key_lookups.pop(digest, None)
            if not done.cancelled():
                done.exception()  # retrieved: every waiter may have gone (their requests cancelled)

        pending.add_done_callback(forget)
    return await asyncio.shield(pending)  # one waiter cancelled does not cancel the others' lookup


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
    try:
        body = decoder.decode(raw)
    except RecursionError:
        raise InvalidInput("the body nests arrays or objects too deeply; send a flatter JSON object") from None
    if _NUL_ESCAPE.search(raw):
        raise InvalidInput("the body holds a NUL character (\\u0000), which cannot be stored; remove it")
    return body


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=_encoder.encode(data), content_type="application/json")


def reply_body(reply: TurnReply | dict[str, Any]) -> dict[str, Any]:
    """A turn's reply as CONTRACT.md shows it: `handoff` is always there, true or false.

    TurnReply omits default fields on the wire (so `pending_approval` appears only when set),
    which would drop `handoff: false` too; the contract makes it a required field.
    """
    body = dict(reply) if isinstance(reply, dict) else msgspec.to_builtins(reply)
    body.pop("replay", None)
    body.pop("timing", None)
    return body if "handoff" in body else {**body, "handoff": False}


def server_timing(timing: TurnTiming | None, gateway_s: float) -> str:
    """The `Server-Timing` header of a turn's reply (milliseconds): `gateway` from the body read
    to the reply, `host` the session host's part of it, `gate` the host's wait for durability."""
    parts = [f"gateway;dur={gateway_s * 1000:.2f}"]
    if timing is not None:
        parts += [f"host;dur={timing.host_ms:.2f}", f"gate;dur={timing.gate_ms:.2f}"]
    return ", ".join(parts)


def reply_response(reply: TurnReply, gateway_s: float) -> web.Response:
    response = json_response(reply_body(reply))
    response.headers["Server-Timing"] = server_timing(reply.timing, gateway_s)
    if reply.replay:
        response.headers["X-Replayed"] = "true"
    return response


def _session_id(request: web.Request) -> str:
    sid = request.match_info["session_id"]
    if not SESSION_ID_RE.match(sid):
        raise InvalidInput(
            f"session id {sid[:40]!r} must be 1-128 letters, digits or . _ : @ - and start with a letter or digit"
        )
    return sid


def _wants_stream(request: web.Request) -> bool:
    return "text/event-stream" in request.headers.get("Accept", "")


# -- chat -------------------------------------------------------------------------------------

async def post_message(request: web.Request) -> web.StreamResponse:
    deps = request.app[DEPS]
    tenant_id = request[TENANT]
    session_id = _session_id(request)
    body: SendMessage = await decode_body(request, SendMessage)
    if not body.text.strip():
        raise InvalidInput("text is empty - at `$.text`; send what the contact wrote", path="$.text")
    if len(body.text) > MAX_TEXT:
        raise InvalidInput(f"text is longer than {MAX_TEXT} characters - at `$.text`", path="$.text")
    if body.message_id is not None and not 0 < len(body.message_id) <= 128:
        raise InvalidInput("message_id must be 1-128 characters - at `$.message_id`", path="$.message_id")
    if body.message_id is not None and not body.message_id.isprintable():
        # it becomes the Idempotency-Key header of the turn's tool calls, which cannot carry one
        raise InvalidInput("message_id must not hold a line break, tab or other control character - at "
                           "`$.message_id`; send the client's own id as printable text", path="$.message_id")
    structlog.contextvars.bind_contextvars(session_id=session_id)
    # Every turn gets a message id here, so a retry of the hop to the actor (a host that died
    # mid-turn) re-runs it under the same id: same stored answer, same Idempotency-Key for writes.
    # An id made here is new: the host need not look for a stored answer to it (`new_id`).
    message_id = body.message_id or f"m_{uuid.uuid4().hex[:16]}"
    new_id = body.message_id is None
    if message_id.isascii() and message_id.isprintable():  # a header carries no control character
        request[MESSAGE_ID] = message_id
    started = time.perf_counter()
    turn = Turn(tenant_id=tenant_id, session_id=session_id, text=body.text, message_id=message_id)
    with deps.limiter.admit(tenant_id):
        if _wants_stream(request):
            stream = deps.router.stream(turn, new_id=new_id)
            return await _sse(request, stream, started)
        reply = await deps.router.send(turn, new_id=new_id)
    seconds = time.perf_counter() - started
    deps.metrics.observe_turn(reply, seconds)
    return reply_response(reply, seconds)


async def post_approval(request: web.Request) -> web.StreamResponse:
    deps = request.app[DEPS]
    tenant_id = request[TENANT]
    session_id = _session_id(request)
    approval_id = request.match_info["approval_id"]
    body: DecideApproval = await decode_body(request, DecideApproval)
    decision = ApprovalDecision(tenant_id=tenant_id, session_id=session_id, approval_id=approval_id,
                                approve=body.approve, edited=body.arguments)
    started = time.perf_counter()
    with deps.limiter.admit(tenant_id):
        if _wants_stream(request):
            stream = deps.router.stream(decision)
            return await _sse(request, stream, started)
        reply = await deps.router.decide(decision)
    seconds = time.perf_counter() - started
    deps.metrics.observe_turn(reply, seconds)
    return reply_response(reply, seconds)


async def _sse(request: web.Request, events: AsyncIterator[StreamEvent], started: float) -> web.StreamResponse:
    # The status goes out with the first event. Until then a failure (a host at capacity, the
    # session's mailbox full, a forged approval id) is answered as for a JSON turn: a problem with
    # its status and Retry-After, which a client or a proxy acts on without reading the stream.
    events = aiter(events)
    event = await anext(events, None)
    response = web.StreamResponse(headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no",
        "X-Request-Id": request[REQUEST_ID],  # sent with the first event, before the middleware sees it
    })
    if MESSAGE_ID in request:
        response.headers["X-Message-Id"] = request[MESSAGE_ID]
    if event is not None and event.event == "done" and event.data.get("replay"):
        response.headers["X-Replayed"] = "true"  # a stored answer, as a JSON turn says it
    try:
        await response.prepare(request)
    except ConnectionResetError:  # gone before the first event: the turn still completes and is stored
        log.info("sse_client_disconnected")
        return response
    deps = request.app[DEPS]
    try:
        while event is not None:
            data = event.data
            if event.event == "done":
                deps.metrics.observe_turn(msgspec.convert(data, TurnReply), time.perf_counter() - started)
                data = reply_body(data)
            if not await _write_event(response, event.event, data):
                break
            event = await anext(events, None)
    except Exception as exc:  # noqa: BLE001 - failure() logs what it does not know
        # After the first event a failure is the last event, as a problem's fields, not a
        # connection cut without a word.
        _count_refusal(request, exc)
        status, title, detail, retry_after = failure(exc, request[REQUEST_ID], request.path)
        data = {"title": title, "status": status, "detail": detail}
        if retry_after is not None:
            data["retry_after"] = retry_after
        await _write_event(response, "error", data)
    return response


async def _write_event(response: web.StreamResponse, event: str, data: Any) -> bool:
    """Write one SSE event; False when the client has gone away (the turn still completes and
    is stored inside the actor)."""
    try:
        await response.write(b"event: " + event.encode() + b"\ndata: " + _encoder.encode(data) + b"\n\n")
    except (ConnectionResetError, RuntimeError):
        log.info("sse_client_disconnected")
        return False
    return True


async def get_session(request: web.Request) -> web.Response:
    deps = request.app[DEPS]
    tenant_id = request[TENANT]
    session_id = _session_id(request)
    view = await deps.router.view(tenant_id, session_id)
    if view is None:
        view = await deps.sessions.get_session_view(tenant_id, session_id)
    return json_response(view)


# -- tools ------------------------------------------------------------------------------------

def _encrypt(deps: GatewayDeps):
    def encrypt(plaintext: str) -> str:
        if deps.secret_box is None:
            raise InvalidInput("this engine has no CE_SECRET_KEY, so it cannot store secrets; set it and restart")
        return deps.secret_box.encrypt(plaintext)
    return encrypt


def _published_view(row) -> dict[str, Any]:
    return tool_view(row.definition, version=row.version, extra={
        "enabled": row.enabled, "created_at": row.created_at, "updated_at": row.updated_at,
    })


async def create_tool(request: web.Request) -> web.Response:
    deps = request.app[DEPS]
    body: ToolCreate = await decode_body(request, ToolCreate)
    if body.name in RESERVED_TOOL_NAMES:
        # GET /v1/tools/contract is the contract report, so a tool of that name could never be read
        raise InvalidInput(f"name {body.name!r} is reserved by the API; choose another - at `$.name`", path="$.name")
    if body.name in BUILTIN_TOOL_NAMES:
        # a built-in wins over a tenant tool of its name, so such a tool would never run
        raise InvalidInput(f"name {body.name!r} is a built-in tool of the engine; choose another - at `$.name`",
                           path="$.name")
    definition = definition_from_body(body, encrypt=_encrypt(deps), policy=deps.webhook_policy)
    data = msgspec.to_builtins(definition)
    version = await deps.tools.create(request[TENANT], definition.name, body.type, data)
    return json_response(tool_view(version.definition, version=version.version, extra={"published": True}), status=201)


async def list_tools(request: web.Request) -> web.Response:
    deps = request.app[DEPS]
    rows = await deps.tools.list_published(request[TENANT])
    return json_response({"tools": [_published_view(r) for r in rows]})


async def get_tool(request: web.Request) -> web.Response:
    deps = request.app[DEPS]
    row = await deps.tools.get(request[TENANT], request.match_info["name"])
    return json_response(_published_view(row))


async def patch_tool(request: web.Request) -> web.Response:
    deps = request.app[DEPS]
    tenant_id = request[TENANT]
    name = request.match_info["name"]
    patch: ToolPatch = await decode_body(request, ToolPatch)
    for attempt in range(1, PATCH_ATTEMPTS + 1):
        # Merged into the live version, and stored only while that version is still the live one:
        # a change published meanwhile (another PATCH, a rollback) is merged into again, so
        # neither is lost, and the origin rule is judged on the version the write replaces.
        current = await deps.tools.get(tenant_id, name)
        merged, kept_auth = patched_body(current.definition, patch, policy=deps.webhook_policy)
        definition = definition_from_body(merged, encrypt=_encrypt(deps), policy=deps.webhook_policy)
        data = msgspec.to_builtins(definition)
        if kept_auth and not data.get("auth_header_enc"):
            data["auth_header_enc"] = kept_auth
        try:
            version = await deps.tools.new_version(tenant_id, name, data, publish=patch.publish,
                                                   based_on=current)
        except ToolChanged:
            if attempt == PATCH_ATTEMPTS:
                raise  # 409: changed under it every time; the problem says to send it again
            # a moment apart, so PATCHes from several gateways that collided do not collide again in step
            await asyncio.sleep(random.uniform(0.005, 0.05) * attempt)
            continue
        # `based_on_version`: the version this PATCH was merged into, which is not the one the
        # client last read when another change (a rollback, say) was published in between
        return json_response(tool_view(version.definition, version=version.version,
                                       extra={"published": patch.publish, "based_on_version": current.version}))
    raise AssertionError("unreachable")  # the loop returns or raises


async def delete_tool(request: web.Request) -> web.Response:
    deps = request.app[DEPS]
    await deps.tools.delete(request[TENANT], request.match_info["name"])
    return web.Response(status=204)


async def tool_versions(request: web.Request) -> web.Response:
    deps = request.app[DEPS]
    versions = await deps.tools.versions(request[TENANT], request.match_info["name"])
    return json_response({"versions": [
        tool_view(v.definition, version=v.version, extra={"created_at": v.created_at, "published": v.published})
        for v in versions
    ]})


async def publish_tool(request: web.Request) -> web.Response:
    deps = request.app[DEPS]
    name = request.match_info["name"]
    raw = request.match_info["version"]
    try:
        version = whole_number(raw, name="version", low=1, high=MAX_TOOL_VERSION, at="{version}")
    except OutOfRange:
        # no version can be stored there, so none exists: the answer the repository gives a missing one
        raise NotFound(f"tool {name!r} has no version {raw[:20]}; list them with GET /v1/tools/{name}/versions",
                       kind="tool_version", key=f"{name}@{raw[:20]}") from None
    row = await deps.tools.publish(request[TENANT], name, version)
    return json_response(_published_view(row))


async def tool_contract(request: web.Request) -> web.Response:
    deps = request.app[DEPS]
    if deps.contract is None:
        raise NotFound("the contract report is not available in this process", kind="route", key="contract")
    return json_response(await deps.contract(request[TENANT]))


async def tool_analytics(request: web.Request) -> web.Response:
    deps = request.app[DEPS]
    since = parse_since(request.query.get("since"))
    stats = await deps.calls.stats(request[TENANT], since)
    tools = [msgspec.to_builtins(s) for s in stats]
    published = {r.name for r in await deps.tools.list_published(request[TENANT])}
    used = {t["name"] for t in tools}
    return json_response({
        "since": since.isoformat(), "tools": tools,
        "most_used": [t["name"] for t in tools[:5]],
        "never_used": sorted(published - used),
    })


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


# -- workflow jobs ----------------------------------------------------------------------------

class JobResultIn(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/jobs/{job_id}/result: the tenant's system reports a workflow job's outcome."""

    status: Literal["succeeded", "failed"]
    result: Any = None
    error: str | None = None


def _job_view(job) -> dict[str, Any]:
    return {"job_id": job.id, "session_id": job.session_id, "tool": job.tool_name, "runner": job.runner,
            "status": job.status, "result": job.result, "error": job.error, "created_at": job.created_at,
            "updated_at": job.updated_at}


async def post_job_result(request: web.Request) -> web.Response:
    deps = request.app[DEPS]
    body: JobResultIn = await decode_body(request, JobResultIn)
    if body.status == "failed" and not body.error:
        raise InvalidInput("a failed job needs `error`: what went wrong, in words for the customer - at `$.error`",
                           path="$.error")
    job = await deps.jobs.finish(request[TENANT], request.match_info["job_id"],
                                 succeeded=body.status == "succeeded", result=body.result, error=body.error,
                                 posted=True)
    return json_response(_job_view(job))


async def get_job(request: web.Request) -> web.Response:
    deps = request.app[DEPS]
    return json_response(_job_view(await deps.jobs.get(request[TENANT], request.match_info["job_id"])))


# -- bot config -------------------------------------------------------------------------------

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
    if body.backend is not None:
        check_url(body.backend.base_url, field="backend.base_url", policy=deps.webhook_policy)
    if body.notification_webhook:
        check_url(body.notification_webhook, field="notification_webhook", policy=deps.webhook_policy)
    previous = await deps.configs.get(request[TENANT]) or {}
    data = {k: v for k, v in msgspec.to_builtins(body).items()
            if v is not None and k not in ("backend", "notification_secret")}
    if body.allowlist is not None:
        data["allowlist"] = body.allowlist
    if body.backend is not None:
        backend: dict[str, Any] = {"base_url": body.backend.base_url, "openapi": body.backend.openapi}
        if body.backend.auth_header:
            backend["auth_header_enc"] = _encrypt(deps)(body.backend.auth_header)
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
        data["notification_secret_enc"] = _encrypt(deps)(secret)
    config = msgspec.convert(data, BotConfig)  # validates the whole config before storing it
    stored = msgspec.to_builtins(config)
    await deps.configs.put(request[TENANT], stored)
    return json_response(_config_view(stored))


# -- operations -------------------------------------------------------------------------------

async def healthz(request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    deps = request.app[DEPS]
    ok = True if deps.ready is None else await deps.ready()
    if not ok:
        return problem(503, "Not ready", "the database or the session hosts are not reachable yet")
    return json_response({"status": "ready"})


async def metrics(request: web.Request) -> web.Response:
    deps = request.app[DEPS]
    # the hosts the shard count says exist: one that did not answer in time is reported down
    expected = deps.router.host_names() if hasattr(deps.router, "host_names") else ()
    try:
        stats = await deps.router.stats()
    except Exception:  # metrics must render even when the stats read fails
        log.warning("host_stats_unavailable", exc_info=True)
        stats = []  # every expected host is then reported down, with its last values
    deps.metrics.observe_hosts(stats, expected=expected)
    return web.Response(body=deps.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"})


async def openapi(request: web.Request) -> web.Response:
    from services.gateway.openapi import openapi_document

    routes = tuple(
        (r.method, r.resource.canonical, (r.handler.__doc__ or "").strip().split("\n")[0])
        for r in request.app.router.routes() if r.resource is not None
    )
    return json_response(openapi_document(routes))


def build_app(deps: GatewayDeps) -> web.Application:
    app = web.Application(middlewares=[errors_middleware, auth_middleware], client_max_size=MAX_BODY)
    app[DEPS] = deps
    r = app.router
    r.add_post("/v1/sessions/{session_id}/messages", post_message)
    r.add_get("/v1/sessions/{session_id}", get_session)
    r.add_post("/v1/sessions/{session_id}/approvals/{approval_id}", post_approval)
    r.add_post("/v1/tools", create_tool)
    r.add_get("/v1/tools", list_tools)
    r.add_get("/v1/tools/contract", tool_contract)
    r.add_get("/v1/tools/{name}", get_tool)
    r.add_patch("/v1/tools/{name}", patch_tool)
    r.add_delete("/v1/tools/{name}", delete_tool)
    r.add_get("/v1/tools/{name}/versions", tool_versions)
    r.add_post("/v1/tools/{name}/versions/{version}/publish", publish_tool)
    r.add_get("/v1/analytics/tools", tool_analytics)
    r.add_post("/v1/jobs/{job_id}/result", post_job_result)
    r.add_get("/v1/jobs/{job_id}", get_job)
    r.add_get("/v1/bot-config", get_bot_config)
    r.add_put("/v1/bot-config", put_bot_config)
    r.add_get("/healthz", healthz)
    r.add_get("/readyz", readyz)
    r.add_get("/metrics", metrics)
    r.add_get("/openapi.json", openapi)
    from services.gateway.builtin_routes import add_builtin_routes  # here: it imports this module
    add_builtin_routes(app)
    from services.gateway.dashboard import add_dashboard_routes  # here: it imports this module
    add_dashboard_routes(app)
    __import__("services.gateway.mcp_routes", fromlist=["*"]).add_mcp_routes(app)  # late: it imports this module
    return app
