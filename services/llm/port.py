"""The LLM port: what the tool loop needs from a model, in Anthropic Messages API terms.

Content blocks mirror the Messages API so the anthropic adapter maps them one to one; the
session core imports only this module, never the SDK.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Literal, Protocol, runtime_checkable

import msgspec


class TextBlock(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="text"):
    text: str


class ToolUseBlock(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(
    msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="tool_result"
):
    tool_use_id: str
    content: str
    is_error: bool = False


ContentBlock = TextBlock | ToolUseBlock | ToolResultBlock


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True):
    role: Literal["user", "assistant"]
    content: list[ContentBlock]


class ToolSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A tool as the model sees it."""

    name: str
    description: str
    input_schema: dict[str, Any]


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    input_tokens: int = 0
    output_tokens: int = 0


class LLMRequest(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    system: str
    messages: list[ChatMessage]
    tools: list[ToolSpec] = []
    max_tokens: int = 1024
    #: "none": tools stay defined (history holds tool_use blocks) but the model must answer in text.
    #: The Messages API refuses (400) a request whose messages hold tool_use or tool_result blocks
    #: and which defines no tools, whatever this says: such a request names tools even when none
    #: may be used (the session then defines the history's, with "none")
    tool_choice: Literal["auto", "none"] = "auto"


class TextDelta(msgspec.Struct, frozen=True, kw_only=True, tag_field="event", tag="text"):
    """A piece of assistant text as it streams."""

    text: str


class LLMResponse(msgspec.Struct, frozen=True, kw_only=True, tag_field="event", tag="done"):
    """The complete assistant message; always the last event of a stream."""

    content: list[ContentBlock]
    stop_reason: str | None
    usage: Usage
    model: str


LLMEvent = TextDelta | LLMResponse


class LLMError(Exception):
    """The model could not answer (unreachable, malformed stream, refused). `retryable` says
    whether trying again may help."""

    def __init__(self, message: str, *, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


@runtime_checkable
class LLMClient(Protocol):
    def stream(self, request: LLMRequest) -> AsyncIterator[LLMEvent]:
        """Yield TextDelta events, then exactly one LLMResponse. Raises LLMError."""
        ...

    async def complete(self, request: LLMRequest) -> LLMResponse:
        """The whole answer at once, for a turn nobody watches stream. Raises LLMError.

        The same answer `stream` would end with; an adapter may make it cheaper than reading a
        stream (the anthropic one asks the API for one JSON body).
        """
        ...


async def final_response(events: AsyncIterator[LLMEvent]) -> LLMResponse:
    """The LLMResponse that ends a stream (its text deltas dropped); for clients whose
    `complete` is their own stream read to the end. Raises LLMError when none comes."""
    response: LLMResponse | None = None
    async for event in events:
        if isinstance(event, LLMResponse):
            response = event
    if response is None:
        raise LLMError("the model stream ended without a final message")
    return response
