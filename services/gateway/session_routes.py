"""The chat routes: a message, an approval decision (each as JSON or as an SSE stream) and a
session's view. Every turn goes to the session's actor through the SessionRouter."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import structlog
from aiohttp import web

from kernel.errors import InvalidInput, Unauthorized
from services.gateway.common import (
    DEPS,
    KEY_KIND,
    MAX_TEXT,
    MESSAGE_ID,
    REQUEST_ID,
    TENANT,
    count_refusal,
    decode_body,
    failure,
    json_response,
    path_session_id,
)
from services.wire import (
    ApprovalDecision,
    CheckContact,
    DecideApproval,
    SendMessage,
    StreamEvent,
    Turn,
    TurnReply,
    TurnTiming,
)

log = structlog.get_logger(__name__)

#: the longest Contact-Token read (a JWT with a few claims is well under 2 KB)
MAX_CONTACT_TOKEN = 8192

_encoder = msgspec.json.Encoder()


def reply_body(reply: TurnReply | dict[str, Any]) -> dict[str, Any]:
    """A turn's reply as docs/api.md shows it: `handoff` is always there, true or false.

    TurnReply omits default fields on the wire (so `pending_approval` appears only when set),
    which would drop `handoff: false` too; the contract makes it a required field.
    """
    body = dict(reply) if isinstance(reply, dict) else msgspec.to_builtins(reply)
    body.pop("replay", None)
    body.pop("timing", None)
    return body if "handoff" in body else {**body, "handoff": False}


def server_timing(timing: TurnTiming | None, gateway_s: float) -> str:
    """The `Server-Timing` header of a turn's reply (milliseconds): `gateway` from the body read
    to the reply, `host` the session host's part of it, `gate` the host's wait for durability,
    `share` its wait for a compute slot behind other turns (services.fairshare), `model` and
    `upstream` its waits for the model's answers and its tools' upstreams."""
    parts = [f"gateway;dur={gateway_s * 1000:.2f}"]
    if timing is not None:
        parts += [f"host;dur={timing.host_ms:.2f}", f"gate;dur={timing.gate_ms:.2f}",
                  f"share;dur={timing.share_ms:.2f}", f"model;dur={timing.model_ms:.2f}",
                  f"upstream;dur={timing.upstream_ms:.2f}"]
    return ", ".join(parts)


def reply_response(reply: TurnReply, gateway_s: float) -> web.Response:
    response = json_response(reply_body(reply))
    response.headers["Server-Timing"] = server_timing(reply.timing, gateway_s)
    if reply.replay:
        response.headers["X-Replayed"] = "true"
    return response


def contact_token(request: web.Request) -> str | None:
    """The contact's JWT from the `Contact-Token` header, or None (checked by the session's host)."""
    token = request.headers.get("Contact-Token", "").strip()
    if not token:
        return None
    if len(token) > MAX_CONTACT_TOKEN:
        raise Unauthorized(f"the Contact-Token is longer than {MAX_CONTACT_TOKEN} characters; send the token the "
                           "sign-in service issued")
    return token


def contact_turn(body: SendMessage, tenant_id: str, session_id: str,
                 token: str | None = None) -> tuple[Turn, bool]:
    """A contact's message as the turn it runs (POST .../messages, or a frame on the session's
    WebSocket), and whether its message id was made up here (`new_id`). Raises InvalidInput
    naming the field that is wrong and what to send instead."""
    if not body.text.strip():
        raise InvalidInput("text is empty - at `$.text`; send what the contact wrote", path="$.text")
    if len(body.text) > MAX_TEXT:
        raise InvalidInput(f"text is longer than {MAX_TEXT} characters - at `$.text`", path="$.text")
    check_message_id(body.message_id)
    # Every turn gets a message id here, so a retry of the hop to the actor (a host that died
    # mid-turn) re-runs it under the same id: same stored answer, same Idempotency-Key for writes.
    # An id made here is new: the host need not look for a stored answer to it (`new_id`).
    message_id = body.message_id or f"m_{uuid.uuid4().hex[:16]}"
    turn = Turn(tenant_id=tenant_id, session_id=session_id, text=body.text, message_id=message_id,
                contact_token=token)
    return turn, body.message_id is None


def check_message_id(message_id: str | None) -> None:
    """A client's message id: 1-128 printable characters (it becomes the Idempotency-Key header
    of the turn's tool calls, which cannot carry a control character)."""
    if message_id is not None and not 0 < len(message_id) <= 128:
        raise InvalidInput("message_id must be 1-128 characters - at `$.message_id`", path="$.message_id")
    if message_id is not None and not message_id.isprintable():
        raise InvalidInput("message_id must not hold a line break, tab or other control character - at "
                           "`$.message_id`; send the client's own id as printable text", path="$.message_id")


def _wants_stream(request: web.Request) -> bool:
    return "text/event-stream" in request.headers.get("Accept", "")


# -- chat -------------------------------------------------------------------------------------

async def post_message(request: web.Request) -> web.StreamResponse:
    deps = request.app[DEPS]
    tenant_id = request[TENANT]
    session_id = path_session_id(request)
    body: SendMessage = await decode_body(request, SendMessage)
    structlog.contextvars.bind_contextvars(session_id=session_id)
    turn, new_id = contact_turn(body, tenant_id, session_id, contact_token(request))
    assert turn.message_id is not None
    if turn.message_id.isascii() and turn.message_id.isprintable():  # a header carries no control character
        request[MESSAGE_ID] = turn.message_id
    started = time.perf_counter()
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
    session_id = path_session_id(request)
    approval_id = request.match_info["approval_id"]
    body: DecideApproval = await decode_body(request, DecideApproval)
    decision = ApprovalDecision(tenant_id=tenant_id, session_id=session_id, approval_id=approval_id,
                                approve=body.approve, edited=body.arguments, contact_token=contact_token(request))
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
        count_refusal(request, exc)
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


async def check_reader(request: web.Request, tenant_id: str, session_id: str) -> None:
    """A chat key reads a session only as its contact: the session's host checks the
    Contact-Token against the contact the session belongs to (401/403 otherwise). An admin key
    reads any session of its tenant."""
    if request[KEY_KIND] != "admin":
        await request.app[DEPS].router.act(
            CheckContact(tenant_id=tenant_id, session_id=session_id, contact_token=contact_token(request)))


async def get_session(request: web.Request) -> web.Response:
    deps = request.app[DEPS]
    tenant_id = request[TENANT]
    session_id = path_session_id(request)
    await check_reader(request, tenant_id, session_id)
    view = await deps.router.view(tenant_id, session_id)
    if view is None:
        view = await deps.sessions.get_session_view(tenant_id, session_id)
    return json_response(view)


def add_session_routes(app: web.Application) -> None:
    """Register the routes above on the gateway app (called once from build_app)."""
    r = app.router
    r.add_post("/v1/sessions/{session_id}/messages", post_message)
    r.add_get("/v1/sessions/{session_id}", get_session)
    r.add_post("/v1/sessions/{session_id}/approvals/{approval_id}", post_approval)
