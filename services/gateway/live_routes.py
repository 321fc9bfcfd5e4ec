"""Live sessions: a session's event stream (SSE and WebSocket), a person's messages, handoffs.

    GET  /v1/sessions/{id}/events            SSE; `Last-Event-ID` or ?after=N resumes after event N
    GET  /v1/sessions/{id}/ws                WebSocket: the same events; contact messages in
    POST /v1/sessions/{id}/agent-messages    {"text", "agent", "message_id"?}: 409 unless handed off
    GET  /v1/handoffs?state=                 open handoffs with their last messages
    POST /v1/handoffs/{id}/claim             {"agent"}
    POST /v1/handoffs/{id}/resolve           {"return_to_bot": true|false}
    GET  /v1/handoffs/events                 SSE: the tenant's agents' feed (services.gateway.feed)

A watcher's connection is served by asking the session's host for the events after the last one
it has (SessionRouter.watch, a long wait on the host, over its lane or Ray): the host answers
when its flush has written new ones, so events arrive pushed, in order, once durable, and a
watcher on any gateway gets them. A host that restarts or a session that moves costs the watcher
a retry here, never an event: the next host reads the log from Postgres after the same number.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import msgspec
import structlog
from aiohttp import WSMsgType, web

from kernel.errors import ChatEngineError, InvalidInput, NotFound
from kernel.records import SessionEvent
from services.gateway.common import (
    DEPS,
    MAX_TEXT,
    TENANT,
    count_refusal,
    decode_body,
    failure,
    json_response,
    keyset_cursor,
    keyset_of,
    page_of,
    paged,
    path_session_id,
    whole_number,
)
from services.gateway.session_routes import (
    check_message_id,
    check_reader,
    contact_token,
    contact_turn,
    reply_body,
)
from services.wire import (
    AgentMessage,
    ClaimHandoff,
    HandoffChange,
    ResolveHandoff,
    SendAgentMessage,
    SendMessage,
)

log = structlog.get_logger(__name__)

_encoder = msgspec.json.Encoder()
_message_decoder = msgspec.json.Decoder(SendMessage)

#: how long one wait on the session's host lasts; between two, an idle stream gets a comment line
#: (proxies close a connection that stays silent for a minute or so)
WATCH_WAIT_S = 15.0
#: the longest pause between two attempts while the session's host cannot be reached
RETRY_MAX_S = 2.0
#: the longest name an agent may give (it is shown to the contact and kept in the history)
MAX_AGENT = 100
_HANDOFF_STATES = ("requested", "assigned", "resolved")


def resume_point(request: web.Request) -> int:
    """The number of the last event the watcher has: `Last-Event-ID` (what a browser's
    EventSource sends when it reconnects) over `?after=`; 0 (everything) when neither is sent."""
    header = request.headers.get("Last-Event-ID")
    if header is not None and header.strip():
        return whole_number(header.strip(), name="Last-Event-ID", low=0, high=2**62, at="Last-Event-ID")
    raw = request.query.get("after")
    return 0 if raw is None else whole_number(raw, name="after", low=0, high=2**62, at="?after")


def event_data(event: SessionEvent) -> dict[str, Any]:
    """What a watcher reads of an event: its number and type with its fields."""
    return {"seq": event.seq, "type": event.type, **event.data}


def sse_frame(event: SessionEvent) -> bytes:
    return (b"id: %d\nevent: %s\ndata: " % (event.seq, event.type.encode())) + _encoder.encode(event_data(event)) + b"\n\n"


class Follower:
    """The session's events after `after`, in order, for as long as the caller asks (`next`):
    each batch as its host hands it over, an empty batch after each quiet wait. The host
    unreachable for a moment (restarting, the session moving) is retried with backoff from the
    same point: an empty batch at once, the next ask after the pause. A slotted object, not an
    async generator, since every idle watcher holds one."""

    __slots__ = ("_pause", "_retry", "_router", "_session_id", "_tenant_id", "after")

    def __init__(self, request: web.Request, tenant_id: str, session_id: str, after: int) -> None:
        self._router = request.app[DEPS].router
        self._tenant_id, self._session_id, self.after = tenant_id, session_id, after
        self._pause = 0.1
        self._retry = False  # the last ask failed: wait `_pause` before the next

    async def next(self) -> list[SessionEvent]:
        if self._retry:
            await asyncio.sleep(self._pause)
            self._pause = min(self._pause * 2, RETRY_MAX_S)
        try:
            events = await self._router.watch(self._tenant_id, self._session_id, self.after, WATCH_WAIT_S)
        except ChatEngineError as exc:
            log.info("watch_retry", session_id=self._session_id, error=type(exc).__name__, retry_in_s=self._pause)
            self._retry = True
            return []
        self._retry, self._pause = False, 0.1
        if events:
            self.after = events[-1].seq
        return events


# -- the event stream ----------------------------------------------------------------------------

class Live:
    """A watcher's stream, which never ends by itself: its handler is cancelled when the gateway
    begins to close (it must not hold the drain), and ends quietly then; the client reconnects
    to another gateway naming its last event. No task of its own: a stream costs its handler's.
    A class with slots rather than a generator: every idle watcher holds one."""

    __slots__ = ("_deps", "_task")

    def __init__(self, request: web.Request) -> None:
        self._deps = request.app[DEPS]
        task = asyncio.current_task()
        assert task is not None
        self._task = task

    def __enter__(self) -> None:
        self._deps.streams.add(self._task)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> bool:
        self._deps.streams.discard(self._task)
        if kind is asyncio.CancelledError and self._deps.closing.is_set():
            self._task.uncancel()
            return True
        return False


async def get_events(request: web.Request) -> web.StreamResponse:
    tenant_id = request[TENANT]
    session_id = path_session_id(request)
    after = resume_point(request)
    await check_reader(request, tenant_id, session_id)
    response = web.StreamResponse(headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no",
    })
    await response.prepare(request)

    try:
        with Live(request):
            await response.write(b"retry: 1000\n\n")  # a browser reconnects after a second, with Last-Event-ID
            follower = Follower(request, tenant_id, session_id, after)
            while True:
                events = await follower.next()
                await response.write(b"".join(map(sse_frame, events)) if events else b": waiting\n\n")
    except (ConnectionResetError, RuntimeError):
        log.info("sse_watcher_gone", session_id=session_id)
    return response


async def session_socket(request: web.Request) -> web.WebSocketResponse:
    """The session's events as JSON text frames ({"seq", "type", ...}); a frame the client sends
    is a contact's message ({"text", "message_id"?}), run as POST .../messages runs it and
    answered with {"type": "reply", ...the reply} or {"type": "error", "status", "title", "detail"}."""
    tenant_id = request[TENANT]
    session_id = path_session_id(request)
    after = resume_point(request)
    await check_reader(request, tenant_id, session_id)
    ws = web.WebSocketResponse(heartbeat=30.0, max_msg_size=64 * 1024)
    await ws.prepare(request)

    async def push() -> None:
        follower = Follower(request, tenant_id, session_id, after)
        while True:
            for event in await follower.next():
                await ws.send_str(_encoder.encode(event_data(event)).decode())

    pusher = asyncio.create_task(push())
    try:
        with Live(request):
            async for frame in ws:
                if frame.type == WSMsgType.TEXT:
                    answer = await _socket_message(request, tenant_id, session_id, frame.data)
                    await ws.send_str(_encoder.encode(answer).decode())
    finally:
        pusher.cancel()
        with contextlib.suppress(asyncio.CancelledError, ConnectionResetError):
            await pusher
        await ws.close()
    return ws


async def _socket_message(request: web.Request, tenant_id: str, session_id: str, raw: str) -> dict[str, Any]:
    deps = request.app[DEPS]
    try:
        body = _message_decoder.decode(raw)
        turn, new_id = contact_turn(body, tenant_id, session_id, contact_token(request))
        with deps.limiter.admit(tenant_id):
            reply = await deps.router.send(turn, new_id=new_id)
    except Exception as exc:  # noqa: BLE001 - answered in-band, as a problem's fields; the socket stays
        count_refusal(request, exc)
        status, title, detail, retry_after = failure(exc, "", request.path)
        problem: dict[str, Any] = {"type": "error", "status": status, "title": title, "detail": detail}
        if retry_after is not None:
            problem["retry_after"] = retry_after
        return problem
    return {"type": "reply", **reply_body(reply)}


# -- a person in the conversation ------------------------------------------------------------------

def _agent_name(agent: str, at: str) -> str:
    name = agent.strip()
    if not name or len(name) > MAX_AGENT or not name.isprintable():
        raise InvalidInput(f"agent must be 1-{MAX_AGENT} printable characters - at `{at}`; send the name "
                           "the contact will see", path=at)
    return name


async def post_agent_message(request: web.Request) -> web.Response:
    deps = request.app[DEPS]
    tenant_id = request[TENANT]
    session_id = path_session_id(request)
    body: SendAgentMessage = await decode_body(request, SendAgentMessage)
    if not body.text.strip():
        raise InvalidInput("text is empty - at `$.text`; send what the agent wrote", path="$.text")
    if len(body.text) > MAX_TEXT:
        raise InvalidInput(f"text is longer than {MAX_TEXT} characters - at `$.text`", path="$.text")
    check_message_id(body.message_id)
    agent = _agent_name(body.agent, "$.agent")
    reply = await deps.router.act(AgentMessage(tenant_id=tenant_id, session_id=session_id, text=body.text,
                                               agent=agent, message_id=body.message_id))
    response = json_response({"session_id": session_id, "message_id": reply.message_id, "agent": agent,
                              "text": reply.reply})
    if reply.replay:
        response.headers["X-Replayed"] = "true"
    return response


async def get_agents_feed(request: web.Request) -> web.StreamResponse:
    """Every event of the tenant's sessions that a person has or that change hands, as they are
    written: `event: <type>`, data as a session stream's plus `session_id`. No resume: a watcher
    that connects, or reads `event: reset` (it missed some: the stream then ends), loads the
    open handoffs (GET /v1/handoffs) and listens again."""
    feed = request.app[DEPS].feed
    if feed is None:
        raise NotFound("the agents' feed is not available in this process", kind="route", key=request.path)
    tenant_id = request[TENANT]
    queue = await feed.subscribe(tenant_id)
    response = web.StreamResponse(headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no",
    })
    try:
        with Live(request):
            await response.prepare(request)
            await response.write(b"retry: 1000\n\n")
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), WATCH_WAIT_S)
                except TimeoutError:
                    await response.write(b": waiting\n\n")
                    continue
                if isinstance(item, str):  # RESET
                    await response.write(b"event: reset\ndata: {}\n\n")
                    break
                session_id, event = item
                data = {"session_id": session_id, **event_data(event)}
                await response.write(b"event: " + event.type.encode() + b"\ndata: " + _encoder.encode(data) + b"\n\n")
    except (ConnectionResetError, RuntimeError):
        log.info("feed_watcher_gone")
    finally:
        feed.unsubscribe(tenant_id, queue)
    return response


def _desk(request: web.Request) -> Any:
    desk = request.app[DEPS].handoffs  # storage HandoffRepo
    if desk is None:
        raise NotFound("the handoff routes are not available in this process", kind="route", key=request.path)
    return desk


async def list_handoffs(request: web.Request) -> web.Response:
    state = request.query.get("state")
    if state is not None and state not in _HANDOFF_STATES:
        raise InvalidInput(f"state must be one of {', '.join(_HANDOFF_STATES)}, got {state[:20]!r} - at ?state")
    limit, cursor = page_of(request, default=100)
    rows, next_cursor = paged(await _desk(request).list(request[TENANT], state=state, limit=limit + 1,
                                                        before=keyset_of(cursor)),
                              limit, lambda row: keyset_cursor(row.created_at, row.id))
    return json_response({"handoffs": [msgspec.to_builtins(r) for r in rows], "next_cursor": next_cursor})


async def _change(request: web.Request, **change: Any) -> web.Response:
    """Run a handoff's change in its session (the session's host moves the handoff on in the store,
    notifying the tenant, then follows it: one writer, in turn with the contact's messages);
    answers the handoff as it stands after."""
    deps = request.app[DEPS]
    tenant_id = request[TENANT]
    desk = _desk(request)
    handoff = await desk.get(tenant_id, request.match_info["handoff_id"], last_messages=0)
    await deps.router.act(HandoffChange(tenant_id=tenant_id, session_id=handoff.session_id, handoff_id=handoff.id,
                                        **change))
    return json_response(msgspec.to_builtins(await desk.get(tenant_id, handoff.id)))


async def claim_handoff(request: web.Request) -> web.Response:
    body: ClaimHandoff = await decode_body(request, ClaimHandoff)
    return await _change(request, state="assigned", agent=_agent_name(body.agent, "$.agent"))


async def resolve_handoff(request: web.Request) -> web.Response:
    body: ResolveHandoff = await decode_body(request, ResolveHandoff)
    return await _change(request, state="resolved", return_to_bot=body.return_to_bot)


def add_live_routes(app: web.Application) -> None:
    """Register the routes above on the gateway app (called once from build_app)."""
    r = app.router
    r.add_get("/v1/sessions/{session_id}/events", get_events)
    r.add_get("/v1/sessions/{session_id}/ws", session_socket)
    r.add_post("/v1/sessions/{session_id}/agent-messages", post_agent_message)
    r.add_get("/v1/handoffs", list_handoffs)
    r.add_get("/v1/handoffs/events", get_agents_feed)
    r.add_post("/v1/handoffs/{handoff_id}/claim", claim_handoff)
    r.add_post("/v1/handoffs/{handoff_id}/resolve", resolve_handoff)
