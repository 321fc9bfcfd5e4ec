"""The anthropic SDK adapter: `AnthropicLLM` implements the LLMClient port over the Messages API.
The only module that imports `anthropic`.

One `anthropic.AsyncAnthropic` serves the whole process (it holds the connection pool; building
one costs far more than a call): the composition root makes it with `make_anthropic_client` and
passes it in, and closes it with the runtime. The same code talks to the real API and to the local
model (`app.local_model`, reached with `base_url`). Its HTTP runs on the SDK's aiohttp
transport (`anthropic.DefaultAioHttpClient`, the `aiohttp` extra) rather than its default httpx
one: the same streamed call costs the caller ~0.4 ms less CPU (README § Performance, optimisation
7), and aiohttp is already the engine's HTTP stack. Proxy variables are honoured as before.

Both calls send the request body as bytes that msgspec encodes straight from our structs, through
the SDK's own `post` (its documented way to make a request the resource methods do not shape):
the SDK still adds auth and version headers, retries, times out and raises its status errors, but
does not copy, type-walk and re-encode the whole history window on every call, as
`messages.create` does (README § Performance, optimisation 14).

Two ways to call, one answer. `stream` (a turn someone watches over SSE) reads the SDK's stream of
raw events, accumulated here into our content blocks (text deltas are yielded as they arrive; tool
input JSON is parsed once, at the end of its block, with msgspec). The SDK's `messages.stream()`
helper would rebuild a snapshot of the whole message after every event, which is work the hot path
does not need. `complete` (every other turn) asks for the whole Message as one JSON body and
decodes the raw body with msgspec: no events to parse on either side, no SDK model objects
(README § Performance, optimisation 11).

Every SDK or transport failure becomes an `LLMError` whose message says what failed and what to
do, and never carries the API key (the SDK's exception is not chained: it holds the request).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

import anthropic
import httpx2
import msgspec
import structlog

from kernel.errors import ConfigError
from services.llm.port import (
    ChatMessage,
    ContentBlock,
    LLMError,
    LLMEvent,
    LLMRequest,
    LLMResponse,
    TextBlock,
    TextDelta,
    ToolSpec,
    ToolUseBlock,
    Usage,
)
from services.nesting import MAX_JSON_DEPTH, raw_nests_deeper_than

log = structlog.get_logger(__name__)

#: the key the local model is given when none is configured; it accepts any key
LOCAL_API_KEY = "local"

_decode_json = msgspec.json.decode
_TOOL_CHOICE_NONE = {"type": "none"}
_RETRYABLE_STATUS = frozenset({408, 409, 425, 429})
_RETRYABLE_TYPES = frozenset({"overloaded_error", "api_error", "rate_limit_error", "timeout_error"})


def make_anthropic_client(
    api_key: str | None,
    base_url: str | None,
    *,
    timeout: float = 120.0,
    max_retries: int = 2,
    default_headers: Mapping[str, str] | None = None,
) -> anthropic.AsyncAnthropic:
    """The process's one SDK client.

    `api_key` None means the local model at `base_url` (any key works there). Returns the client;
    raises ConfigError when neither a key nor a local model URL is given. Credentials are always
    passed explicitly, so the SDK reads no credential files or variables of its own.
    """
    if api_key is None and base_url is None:
        raise ConfigError(
            "no model is configured: set ANTHROPIC_API_KEY, or start the local model and pass its URL",
            variable="ANTHROPIC_API_KEY",
        )
    return anthropic.AsyncAnthropic(
        api_key=api_key if api_key is not None else LOCAL_API_KEY,
        base_url=base_url,
        timeout=timeout,
        max_retries=max_retries,
        default_headers=default_headers,
        # The aiohttp session behind it is made on the first call, inside the caller's loop.
        http_client=anthropic.DefaultAioHttpClient(timeout=timeout),
    )


class AnthropicLLM:
    """The LLMClient port over `anthropic.AsyncAnthropic` (Messages API, streamed or not, tool use)."""

    def __init__(self, client: anthropic.AsyncAnthropic) -> None:
        self._client = client
        self._secret = client.api_key or client.auth_token or None

    async def close(self) -> None:
        """Close the client's connections (an aiohttp session left open warns when collected)."""
        await self._client.close()

    def is_closed(self) -> bool:
        return self._client.is_closed()

    async def stream(self, request: LLMRequest) -> AsyncIterator[LLMEvent]:
        """Yield a TextDelta per text delta as it arrives, then exactly one LLMResponse.

        Raises LLMError (`retryable` set when trying again may help) for every failure.
        """
        # Errors are raised outside the `except` blocks so that no SDK exception (which holds the
        # request, headers included) rides along as __context__.
        error: LLMError | None = None
        try:
            events = await self._client.post(
                _MESSAGES_PATH, cast_to=_StreamEvent, content=_encode_body(_body(request, stream=True)),
                stream=True, stream_cls=_EventStream)
        except Exception as exc:
            error = self._translate(exc, request.model)
            if error is None:
                raise
        if error is not None:
            raise error
        try:
            async for item in _accumulate(events, request.model):
                yield item
        except LLMError:
            raise
        except Exception as exc:
            error = self._translate(exc, request.model)
            if error is None:
                raise
        finally:
            with contextlib.suppress(Exception):  # closing a broken stream may fail the same way
                await events.close()
        if error is not None:
            raise error

    async def complete(self, request: LLMRequest) -> LLMResponse:
        """The whole answer as one Message body (no stream): for turns nobody watches stream.

        Raises LLMError like `stream`. The SDK sends the request (auth, retries, timeouts, status
        errors) and hands back the raw response (`cast_to=httpx2.Response`), whose body msgspec
        decodes straight into our types: the SDK's model objects would be built only to be copied
        into ours. Against the local model this costs the caller less than reading the same answer
        as a stream (`python -m bench.llm --compare calls`).
        """
        error: LLMError | None = None
        try:
            raw = await self._client.post(
                _MESSAGES_PATH, cast_to=httpx2.Response, content=_encode_body(_body(request)))
            body = await raw.aread()
            if raw_nests_deeper_than(body):
                raise LLMError(f"the model's answer nests more than {MAX_JSON_DEPTH} levels deep; try again",
                               retryable=True)
            return _response_of(_decode_message(body), request.model)
        except LLMError:
            raise
        except Exception as exc:
            error = self._translate(exc, request.model, streaming=False)
            if error is None:
                raise
        raise error

    def _translate(self, exc: Exception, model: str, *, streaming: bool = True) -> LLMError | None:
        """The LLMError for a failure of the model or its transport; None for anything else."""
        error = _to_llm_error(exc, model, "stream" if streaming else "answer")
        if error is None:
            return None
        message = str(error)
        if self._secret and self._secret in message:
            error = LLMError(message.replace(self._secret, "[redacted]"), retryable=error.retryable)
        log.warning(
            "llm_call_failed",
            model=model,
            error_kind=type(exc).__name__,
            status=getattr(exc, "status_code", None),
            retryable=error.retryable,
        )
        return error


_MESSAGES_PATH = "/v1/messages"


class _Body(msgspec.Struct, omit_defaults=True):
    """A Messages API request body, encoded by msgspec straight from our structs (their tagged
    encoding is the API's JSON already) and handed to the SDK's `post` as bytes. Through
    `messages.create` the SDK would copy and type-walk the whole history window, then encode it
    with the json module, on every call (README § Performance, optimisation 14)."""

    model: str
    max_tokens: int
    messages: list[ChatMessage]
    system: str = ""
    tools: list[ToolSpec] = []
    tool_choice: dict[str, str] | None = None
    stream: bool = False


_encode_body = msgspec.json.Encoder().encode
_StreamEvent = anthropic.types.RawMessageStreamEvent
_EventStream = anthropic.AsyncStream[_StreamEvent]


def _body(request: LLMRequest, *, stream: bool = False) -> _Body:
    return _Body(
        model=request.model, max_tokens=request.max_tokens, messages=request.messages,
        system=request.system, tools=request.tools, stream=stream,
        tool_choice=_TOOL_CHOICE_NONE if request.tools and request.tool_choice == "none" else None,
    )


class _Block(msgspec.Struct):
    """A content block of a Message body; kinds other than text and tool_use are ignored (so
    their fields may be anything: what text and tool_use blocks need is checked when read)."""

    type: str
    text: Any = None
    id: Any = None
    name: Any = None
    input: Any = None


class _MessageUsage(msgspec.Struct, frozen=True):
    input_tokens: int | None = 0
    output_tokens: int | None = 0


class _Message(msgspec.Struct):
    """The part of a non-streamed Message body the engine reads (other fields are ignored)."""

    content: list[_Block]
    stop_reason: str | None = None
    model: str = ""
    usage: _MessageUsage = _MessageUsage()


_decode_message = msgspec.json.Decoder(_Message).decode


def _response_of(message: _Message, model: str) -> LLMResponse:
    """Our LLMResponse for a non-streamed Message: the same blocks `_accumulate` builds from a
    stream (empty text blocks dropped, blocks of other kinds ignored)."""
    if message.stop_reason is None:
        raise LLMError(
            f"the answer from model {model!r} has no stop reason; it is incomplete, try again",
            retryable=True,
        )
    content: list[ContentBlock] = []
    for block in message.content:
        if block.type == "text":
            if not isinstance(block.text, str):
                raise LLMError(f"the answer from model {model!r} has a text block without text; try again")
            if block.text:  # the API refuses empty text blocks when they are sent back
                content.append(TextBlock(text=block.text))
        elif block.type == "tool_use":
            if not (isinstance(block.id, str) and isinstance(block.name, str)):
                raise LLMError(f"the answer from model {model!r} has a tool call without its id or name; try again")
            content.append(ToolUseBlock(id=block.id, name=block.name, input=_input_object(block.input, block.name)))
    usage = message.usage
    return LLMResponse(
        content=content,
        stop_reason=message.stop_reason,
        usage=Usage(input_tokens=usage.input_tokens or 0, output_tokens=usage.output_tokens or 0),
        model=message.model or model,
    )


async def _accumulate(events: Any, model: str) -> AsyncIterator[LLMEvent]:
    """Turn raw stream events into TextDeltas and the final LLMResponse."""
    texts: dict[int, list[str]] = {}
    tools: dict[int, tuple[str, str, list[str]]] = {}
    finished: dict[int, ContentBlock] = {}
    input_tokens = output_tokens = 0
    stop_reason: str | None = None
    started = stopped = False
    model_name = model
    async for event in events:
        kind = event.type
        if kind == "content_block_delta":
            delta = event.delta
            if delta.type == "text_delta":
                texts[event.index].append(delta.text)
                yield TextDelta(text=delta.text)
            elif delta.type == "input_json_delta":
                tools[event.index][2].append(delta.partial_json)
        elif kind == "content_block_start":
            block = event.content_block
            if block.type == "text":
                texts[event.index] = [block.text] if block.text else []
            elif block.type == "tool_use":
                tools[event.index] = (block.id, block.name, [])
        elif kind == "content_block_stop":
            index = event.index
            if index in texts:
                text = "".join(texts.pop(index))
                if text:  # the API refuses empty text blocks when they are sent back
                    finished[index] = TextBlock(text=text)
            elif index in tools:
                tool_id, name, parts = tools.pop(index)
                finished[index] = ToolUseBlock(
                    id=tool_id, name=name, input=_tool_input(parts, name)
                )
        elif kind == "message_start":
            started = True
            message = event.message
            model_name = message.model or model
            input_tokens = message.usage.input_tokens or 0
            output_tokens = message.usage.output_tokens or 0
        elif kind == "message_delta":
            stop_reason = event.delta.stop_reason
            usage = event.usage
            output_tokens = usage.output_tokens
            if usage.input_tokens is not None:
                input_tokens = usage.input_tokens
        elif kind == "message_stop":
            stopped = True
    if not (started and stopped):
        raise LLMError(
            f"the stream from model {model!r} ended before message_stop; the answer is incomplete, "
            "try again",
            retryable=True,
        )
    yield LLMResponse(
        content=[finished[i] for i in sorted(finished)],
        stop_reason=stop_reason,
        usage=Usage(input_tokens=input_tokens, output_tokens=output_tokens),
        model=model_name,
    )


def _tool_input(parts: list[str], name: str) -> dict[str, Any]:
    raw = "".join(parts)
    if not raw:
        return {}
    if raw_nests_deeper_than(raw.encode()):
        raise LLMError(f"the model sent tool input for {name!r} nested more than {MAX_JSON_DEPTH} levels deep; "
                       "try again", retryable=True)
    try:
        value = _decode_json(raw)
    except msgspec.DecodeError:
        raise LLMError(
            f"the model sent tool input for {name!r} that is not valid JSON; try again",
            retryable=True,
        ) from None
    return _input_object(value, name)


def _input_object(value: Any, name: str) -> dict[str, Any]:
    """A tool call's input, which must be a JSON object. Raises LLMError."""
    if not isinstance(value, dict):
        raise LLMError(
            f"the model sent tool input for {name!r} that is not a JSON object; try again"
        )
    return value


def _to_llm_error(exc: Exception, model: str, what: str = "stream") -> LLMError | None:
    """The LLMError for an SDK, transport or stream-parsing failure; None for anything else.

    `what` names what was being read: "stream", or "answer" for a non-streamed call.
    """
    if isinstance(exc, anthropic.APITimeoutError):
        return LLMError(f"model {model!r} did not answer in time; try again", retryable=True)
    if isinstance(exc, anthropic.APIConnectionError) and isinstance(
        exc.__cause__, httpx2.ReadError | httpx2.RemoteProtocolError
    ):  # connected and answering, then cut off (a non-streamed body is read inside the call)
        return _broke(exc.__cause__, what)
    if isinstance(exc, anthropic.APIConnectionError):
        host = _host_of(exc)
        return LLMError(
            f"could not reach the model service at {host}: connection failed; check that it is "
            "running and reachable, then try again",
            retryable=True,
        )
    if isinstance(exc, anthropic.APIStatusError):
        return _status_error(exc, model)
    if isinstance(exc, anthropic.APIResponseValidationError | anthropic.APIError):
        return LLMError(
            f"the model service sent a response that could not be read: {exc.message[:200]}"
        )
    if isinstance(exc, httpx2.TimeoutException):
        return LLMError(
            f"model {model!r} stopped answering mid-{what} (timeout); try again", retryable=True
        )
    if isinstance(exc, httpx2.TransportError | httpx2.StreamError):
        return _broke(exc, what)
    if isinstance(exc, ValueError | AttributeError | KeyError | TypeError | IndexError | msgspec.DecodeError):
        # json.JSONDecodeError from an SSE data line, an event missing what its type promises,
        # or a Message body msgspec cannot read
        return LLMError(
            f"the {what} from model {model!r} was malformed ({type(exc).__name__}); try again",
            retryable=True,
        )
    return None


def _broke(exc: BaseException, what: str) -> LLMError:
    return LLMError(
        f"the connection to the model service broke mid-{what} ({type(exc).__name__}); try again",
        retryable=True,
    )


def _status_error(exc: anthropic.APIStatusError, model: str) -> LLMError:
    status = exc.status_code
    kind = exc.type if isinstance(exc.type, str) else None
    detail = exc.api_message if isinstance(exc.api_message, str) else None
    # An `event: error` inside a 200 stream reaches us as a status error with status 200.
    label = f"{status} {kind}" if kind and status != 200 else (kind or str(status))
    text = f"the model service refused the request ({label})"
    if detail:
        text += f": {detail[:300]}"
    if status in (401, 403) or kind in ("authentication_error", "permission_error"):
        return LLMError(text + "; check ANTHROPIC_API_KEY", retryable=False)
    if status == 404 or kind == "not_found_error":
        return LLMError(text + f"; check that model {model!r} exists", retryable=False)
    if status >= 500 or status in _RETRYABLE_STATUS or kind in _RETRYABLE_TYPES:
        return LLMError(text + "; try again later", retryable=True)
    return LLMError(text + "; the request itself must change", retryable=False)


def _host_of(exc: anthropic.APIConnectionError) -> str:
    try:
        url = exc.request.url
        return f"{url.host}:{url.port}" if url.port else str(url.host)
    except Exception:  # noqa: BLE001 - the host is only for the message
        return "the configured URL"
