"""The local model: `POST /v1/messages` of the Anthropic Messages API, served on loopback by aiohttp.

It owns the wire side only: decoding and validating the request body, turning the rules' answer
(`app.local_model_rules.respond`) into a Message JSON body or into the server-sent event sequence
the anthropic SDK expects (message_start, ping, content_block_start, content_block_delta with
text_delta / input_json_delta, content_block_stop, message_delta with stop_reason and usage,
message_stop). The engine reaches it through the real SDK client with `base_url`, so tests run
the production client code. Any API key is accepted; none is checked or logged.

A bad body is answered the way the real API answers it: HTTP 400 with
`{"type": "error", "error": {"type": "invalid_request_error", "message": ...}}`, the message
naming the offending field (`... - at $.messages[0].role`). The API's rules on tool blocks are
kept too: each tool_use answered by a tool_result in the next message, and none in a request that
defines no tools.

Fault knob, for reliability tests. A request header `x-ce-fault: <fault>`, or a line
`/fault <fault>` in the last user message (so a test can reach the model through the gateway),
makes the server misbehave:

    malformed-stream   streaming: a content_block_delta whose data is not JSON, then the end;
                       not streaming: the first half of the Message JSON
    truncated-stream   streaming: the stream ends cleanly before message_stop;
                       not streaming: a Message without stop_reason, cut after its first block
    drop-connection    the TCP connection is closed in the middle of the stream or of the body
    stream-error       streaming: an `event: error` (overloaded_error) after message_start;
                       not streaming: HTTP 529 overloaded_error, as the API answers then
    overloaded         HTTP 529 overloaded_error (the SDK retries it unless max_retries=0)
    server-error       HTTP 500 api_error
    slow:<ms>          answer normally after <ms> milliseconds (for client timeouts)

Run it alone with `python -m app.local_model --port 8765`.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import re
import signal
from collections.abc import Callable
from datetime import UTC, date, datetime
from typing import Annotated, Any, Literal

import msgspec
import structlog
from aiohttp import web

from app.local_model_rules import RuleReply, respond
from services.llm.port import (
    ChatMessage,
    ContentBlock,
    LLMRequest,
    TextBlock,
    ToolResultBlock,
    ToolSpec,
    ToolUseBlock,
)
from services.logging import configure_logging

log = structlog.get_logger(__name__)

FAULT_HEADER = "x-ce-fault"
FAULTS = (
    "malformed-stream",
    "truncated-stream",
    "drop-connection",
    "stream-error",
    "overloaded",
    "server-error",
    "slow:<ms>",
)
_MAX_BODY = 8 * 1024 * 1024  # the real API takes 32 MB; nothing local needs more than this
_DELTAS_PER_TEXT = 4  # "a few" text deltas per text block
_WORD_START = re.compile(r"(?<=\s)(?=\S)")  # where a word begins after whitespace
_TOOL_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")

# ------------------------------------------------------------------------------------------
# the request body, as the API accepts it (the subset the engine and the SDK send)


class _WireText(msgspec.Struct, frozen=True, tag_field="type", tag="text"):
    text: str
    cache_control: dict[str, Any] | None = None
    citations: list[Any] | None = None


class _WireToolUse(msgspec.Struct, frozen=True, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class _WireToolResult(msgspec.Struct, frozen=True, tag_field="type", tag="tool_result"):
    tool_use_id: str
    content: str | list[_WireText] = ""
    is_error: bool = False
    cache_control: dict[str, Any] | None = None


_WireBlock = _WireText | _WireToolUse | _WireToolResult


class _WireMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    role: Literal["user", "assistant"]
    content: str | list[_WireBlock]


class _WireTool(msgspec.Struct, frozen=True):
    name: str
    input_schema: dict[str, Any]
    description: str = ""
    type: str | None = None
    cache_control: dict[str, Any] | None = None


class _WireToolChoice(msgspec.Struct, frozen=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class _WireRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model: Annotated[str, msgspec.Meta(min_length=1)]
    max_tokens: Annotated[int, msgspec.Meta(ge=1)]
    messages: Annotated[list[_WireMessage], msgspec.Meta(min_length=1)]
    system: str | list[_WireText] = ""
    tools: list[_WireTool] = []
    tool_choice: _WireToolChoice | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    thinking: dict[str, Any] | None = None
    service_tier: str | None = None


_request_decoder = msgspec.json.Decoder(_WireRequest)
_encode = msgspec.json.Encoder().encode


class InvalidRequest(Exception):
    """The body is not a valid Messages API request; the message names the field."""


def decode_request(body: bytes) -> tuple[LLMRequest, bool]:
    """Decode and check a Messages API body.

    Returns (the request in port terms, whether to stream). Raises InvalidRequest.
    """
    try:
        wire = _request_decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(_lower_first(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc}") from None
    messages = [_to_message(m, i) for i, m in enumerate(wire.messages)]
    _check_tool_pairs(messages)
    names: set[str] = set()
    tools = []
    for i, tool in enumerate(wire.tools):
        if not (0 < len(tool.name) <= 128 and set(tool.name) <= _TOOL_NAME_CHARS):
            raise InvalidRequest(
                f"tool name {tool.name!r} must match ^[a-zA-Z0-9_-]{{1,128}}$ - at $.tools[{i}].name"
            )
        if tool.name in names:
            raise InvalidRequest(
                f"tool names must be unique, {tool.name!r} is repeated - at $.tools[{i}].name"
            )
        names.add(tool.name)
        tools.append(
            ToolSpec(name=tool.name, description=tool.description, input_schema=tool.input_schema)
        )
    if not tools and any(isinstance(b, (ToolUseBlock, ToolResultBlock)) for m in messages for b in m.content):
        # The real API refuses this (400), whatever tool_choice says: a client that drops the
        # tools once none may be used (a one-shot tool done, a limit reached) must fail here too.
        raise InvalidRequest(
            "requests which include `tool_use` or `tool_result` blocks must define tools - at $.tools"
        )
    system = wire.system if isinstance(wire.system, str) else "\n".join(b.text for b in wire.system)
    choice = "none" if wire.tool_choice is not None and wire.tool_choice.type == "none" else "auto"
    request = LLMRequest(
        model=wire.model,
        system=system,
        messages=messages,
        tools=tools,
        max_tokens=wire.max_tokens,
        tool_choice=choice,
    )
    return request, wire.stream


def _to_message(wire: _WireMessage, index: int) -> ChatMessage:
    if isinstance(wire.content, str):
        return ChatMessage(role=wire.role, content=[TextBlock(text=wire.content)])
    content: list[ContentBlock] = []
    for j, block in enumerate(wire.content):
        where = f"$.messages[{index}].content[{j}]"
        if isinstance(block, _WireText):
            content.append(TextBlock(text=block.text))
        elif isinstance(block, _WireToolUse):
            if wire.role != "assistant":
                raise InvalidRequest(
                    f"tool_use blocks may only appear in assistant messages - at {where}"
                )
            content.append(ToolUseBlock(id=block.id, name=block.name, input=block.input))
        else:
            if wire.role != "user":
                raise InvalidRequest(
                    f"tool_result blocks may only appear in user messages - at {where}"
                )
            text = (
                block.content
                if isinstance(block.content, str)
                else "\n".join(b.text for b in block.content)
            )
            content.append(
                ToolResultBlock(
                    tool_use_id=block.tool_use_id, content=text, is_error=block.is_error
                )
            )
    return ChatMessage(role=wire.role, content=content)


def _check_tool_pairs(messages: list[ChatMessage]) -> None:
    """As the real API: every tool_use is answered by a tool_result in the next message, and
    every tool_result answers a tool_use of the message before it."""
    for i, message in enumerate(messages):
        if message.role == "assistant":
            ids = [b.id for b in message.content if isinstance(b, ToolUseBlock)]
            if ids and i + 1 < len(messages):
                answered = {
                    b.tool_use_id for b in messages[i + 1].content if isinstance(b, ToolResultBlock)
                }
                missing = [x for x in ids if x not in answered]
                if missing:
                    raise InvalidRequest(
                        f"tool_use ids were found without tool_result blocks immediately after: "
                        f"{', '.join(missing)}; each tool_use block must have a corresponding "
                        f"tool_result block in the next message - at $.messages[{i + 1}]"
                    )
        else:
            results = [b.tool_use_id for b in message.content if isinstance(b, ToolResultBlock)]
            if not results:
                continue
            previous = messages[i - 1] if i > 0 and messages[i - 1].role == "assistant" else None
            asked = (
                {b.id for b in previous.content if isinstance(b, ToolUseBlock)}
                if previous
                else set()
            )
            unexpected = [x for x in results if x not in asked]
            if unexpected:
                raise InvalidRequest(
                    f"unexpected tool_use_id found in tool_result blocks: {', '.join(unexpected)}; each "
                    f"tool_result block must have a corresponding tool_use block in the previous "
                    f"message - at $.messages[{i}]"
                )


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:]


# ------------------------------------------------------------------------------------------
# the response: a Message body, or the SSE event sequence


def _message_id(body: bytes) -> str:
    return "msg_local_" + hashlib.blake2b(body, digest_size=12).hexdigest()


def _block_json(block: ContentBlock) -> dict[str, Any]:
    if isinstance(block, TextBlock):
        return {"type": "text", "text": block.text}
    if isinstance(block, ToolUseBlock):
        return {"type": "tool_use", "id": block.id, "name": block.name, "input": block.input}
    raise TypeError(f"the model cannot answer with a {type(block).__name__}")


def message_body(reply: RuleReply, *, model: str, message_id: str) -> dict[str, Any]:
    """The non-streaming Message JSON for a reply."""
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [_block_json(b) for b in reply.content],
        "stop_reason": reply.stop_reason,
        "stop_sequence": None,
        "usage": {
            "input_tokens": reply.usage.input_tokens,
            "output_tokens": reply.usage.output_tokens,
        },
    }


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + _encode(data) + b"\n\n"


def split_words(text: str, pieces: int = _DELTAS_PER_TEXT) -> list[str]:
    """Split text at word boundaries into at most `pieces` consecutive chunks that join back to it."""
    words = _WORD_START.split(text)
    if len(words) <= pieces:
        return words
    size = -(-len(words) // pieces)
    return ["".join(words[i : i + size]) for i in range(0, len(words), size)]


def _split_json(raw: str) -> list[str]:
    """Tool input as the API streams it: an empty first delta, then a few partial pieces."""
    if len(raw) <= 2:
        return ["", raw]
    third = max(1, len(raw) // 3)
    return ["", raw[:third], raw[third : 2 * third], raw[2 * third :]]


def stream_events(reply: RuleReply, *, model: str, message_id: str) -> list[bytes]:
    """The SSE frames of a reply, in the order the API sends them."""
    usage = reply.usage
    frames = [
        _sse(
            "message_start",
            {
                "type": "message_start",
                "message": {
                    "id": message_id,
                    "type": "message",
                    "role": "assistant",
                    "model": model,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": {"input_tokens": usage.input_tokens, "output_tokens": 1},
                },
            },
        ),
        _sse("ping", {"type": "ping"}),
    ]
    for index, block in enumerate(reply.content):
        if isinstance(block, TextBlock):
            frames.append(
                _sse(
                    "content_block_start",
                    {
                        "type": "content_block_start",
                        "index": index,
                        "content_block": {"type": "text", "text": ""},
                    },
                )
            )
            for piece in split_words(block.text):
                frames.append(
                    _sse(
                        "content_block_delta",
                        {
                            "type": "content_block_delta",
                            "index": index,
                            "delta": {"type": "text_delta", "text": piece},
                        },
                    )
                )
        elif isinstance(block, ToolUseBlock):
            frames.append(
                _sse(
                    "content_block_start",
                    {
                        "type": "content_block_start",
                        "index": index,
                        "content_block": {
                            "type": "tool_use",
                            "id": block.id,
                            "name": block.name,
                            "input": {},
                        },
                    },
                )
            )
            for piece in _split_json(_encode(block.input).decode()):
                frames.append(
                    _sse(
                        "content_block_delta",
                        {
                            "type": "content_block_delta",
                            "index": index,
                            "delta": {"type": "input_json_delta", "partial_json": piece},
                        },
                    )
                )
        frames.append(_sse("content_block_stop", {"type": "content_block_stop", "index": index}))
    frames.append(
        _sse(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": reply.stop_reason, "stop_sequence": None},
                "usage": {"input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens},
            },
        )
    )
    frames.append(_sse("message_stop", {"type": "message_stop"}))
    return frames


def _error(status: int, kind: str, message: str) -> web.Response:
    return web.Response(
        status=status,
        body=_encode({"type": "error", "error": {"type": kind, "message": message}}),
        content_type="application/json",
    )


# ------------------------------------------------------------------------------------------
# faults


def _fault_of(request: web.Request, llm_request: LLMRequest) -> str | None:
    header = request.headers.get(FAULT_HEADER)
    if header:
        return header.strip().lower()
    for message in reversed(llm_request.messages):
        if message.role != "user":
            continue
        for block in message.content:
            if isinstance(block, TextBlock) and "/fault" in block.text:
                for line in block.text.splitlines():
                    parts = line.split()
                    if len(parts) == 2 and parts[0] == "/fault":
                        return parts[1].lower()
        return None
    return None


def _known_fault(fault: str) -> bool:
    if fault.startswith("slow:"):
        return fault[5:].isdigit()
    return fault in FAULTS


# ------------------------------------------------------------------------------------------
# the app

_TODAY_KEY = web.AppKey("today", Callable[[], date])


async def _messages(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    try:
        llm_request, streaming = decode_request(body)
    except InvalidRequest as exc:
        return _error(400, "invalid_request_error", str(exc))
    fault = _fault_of(request, llm_request)
    if fault is not None and not _known_fault(fault):
        return _error(
            400, "invalid_request_error", f"unknown fault {fault!r}; use one of {', '.join(FAULTS)}"
        )
    log.debug(
        "local_model_request",
        messages=len(llm_request.messages),
        tools=len(llm_request.tools),
        stream=streaming,
        fault=fault,
    )
    if fault is not None and fault.startswith("slow:"):
        await asyncio.sleep(int(fault[5:]) / 1000)
        fault = None
    if fault == "overloaded":
        return _error(529, "overloaded_error", "Overloaded (injected fault)")
    if fault == "server-error":
        return _error(500, "api_error", "Internal server error (injected fault)")
    reply = respond(llm_request, today=request.app[_TODAY_KEY]())
    message_id = _message_id(body)
    headers = {"request-id": "req_" + message_id[10:]}
    if not streaming:
        return await _message_response(request, reply, llm_request.model, message_id, headers, fault)
    response = web.StreamResponse(
        headers={
            **headers,
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
        }
    )
    frames = stream_events(reply, model=llm_request.model, message_id=message_id)
    if fault == "malformed-stream":
        frames = frames[:3] + [
            b'event: content_block_delta\ndata: {"type": "content_block_delta", "ind\n\n'
        ]
    elif fault == "truncated-stream":
        frames = frames[:4]
    elif fault == "stream-error":
        error = {
            "type": "error",
            "error": {"type": "overloaded_error", "message": "Overloaded (injected fault)"},
        }
        frames = frames[:2] + [_sse("error", error)]
    try:
        await response.prepare(request)
        if fault == "drop-connection":
            for frame in frames[:4]:
                await response.write(frame)
            if request.transport is not None:
                request.transport.abort()  # an abrupt reset, not a clean end of the chunked body
            return response
        for frame in frames:
            await response.write(frame)
        await response.write_eof()
    except ConnectionResetError:
        log.debug("local_model_client_gone")  # the client timed out or hung up; nothing to answer
    return response


async def _message_response(
    request: web.Request,
    reply: RuleReply,
    model: str,
    message_id: str,
    headers: dict[str, str],
    fault: str | None,
) -> web.StreamResponse:
    """A non-streamed answer: one Message JSON body, or its fault's version of it."""
    if fault == "stream-error":  # the API answers a non-streamed request's overload with a 529
        return _error(529, "overloaded_error", "Overloaded (injected fault)")
    message = message_body(reply, model=model, message_id=message_id)
    if fault == "truncated-stream":  # cut short: no stop reason, the first block at most
        message = {**message, "content": message["content"][:1], "stop_reason": None}
    body = _encode(message)
    if fault == "malformed-stream":
        body = body[: len(body) // 2]
    if fault != "drop-connection":
        return web.Response(body=body, content_type="application/json", headers=headers)
    response = web.StreamResponse(headers=headers)
    response.content_type = "application/json"
    response.content_length = len(body)
    try:
        await response.prepare(request)
        await response.write(body[: len(body) // 2])
    except ConnectionResetError:
        log.debug("local_model_client_gone")
    if request.transport is not None:
        request.transport.abort()  # the connection ends with half the promised body sent
    return response


@web.middleware
async def _api_errors(
    request: web.Request, handler: Callable[[web.Request], Any]
) -> web.StreamResponse:
    """Answer unknown routes and methods with the API's error JSON, not aiohttp's HTML."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return _error(404, "not_found_error", f"no route for {request.method} {request.path}")
    except web.HTTPMethodNotAllowed:
        return _error(
            405, "invalid_request_error", f"{request.method} is not allowed on {request.path}"
        )
    except web.HTTPRequestEntityTooLarge:
        return _error(413, "request_too_large", f"the body exceeds {_MAX_BODY} bytes")


async def _healthz(_request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def make_app(*, today: Callable[[], date] | None = None) -> web.Application:
    """The aiohttp application. `today` resolves relative dates ("tomorrow at 10"); UTC by default."""
    app = web.Application(middlewares=[_api_errors], client_max_size=_MAX_BODY)
    app[_TODAY_KEY] = today or (lambda: datetime.now(UTC).date())
    app.router.add_post("/v1/messages", _messages)
    app.router.add_get("/healthz", _healthz)
    return app


class LocalModelServer:
    """A running local model. `url` is the base URL for the SDK (`base_url=server.url`)."""

    def __init__(self, runner: web.AppRunner, host: str, port: int) -> None:
        self._runner = runner
        self.host = host
        self.port = port
        self.url = f"http://{host}:{port}"

    async def stop(self) -> None:
        """Stop accepting requests and close open connections. Idempotent."""
        await self._runner.cleanup()


async def start_local_model(
    host: str = "127.0.0.1", port: int = 0, *, today: Callable[[], date] | None = None
) -> LocalModelServer:
    """Serve the local model on `host:port` (port 0: a free port). Returns the running server.

    Raises OSError when the address cannot be bound.
    """
    # In-flight answers take milliseconds; only a `slow:` fault could hold a shutdown up.
    runner = web.AppRunner(
        make_app(today=today), access_log=None, handle_signals=False, shutdown_timeout=1.0
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound = runner.addresses[0][1] if runner.addresses else port
    log.info("local_model_started", url=f"http://{host}:{bound}")
    return LocalModelServer(runner, host, bound)


async def _serve(host: str, port: int) -> None:
    server = await start_local_model(host, port)
    print(f"local model listening on {server.url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await server.stop()


def main(argv: list[str] | None = None) -> None:
    """`python -m app.local_model [--host H] [--port N]`."""
    parser = argparse.ArgumentParser(
        description="Serve the deterministic local model (Anthropic Messages API)."
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args(argv)
    configure_logging()
    asyncio.run(_serve(args.host, args.port))


if __name__ == "__main__":
    main()
