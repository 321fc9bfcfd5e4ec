"""The real anthropic SDK against the local model on loopback, through AnthropicLLM.

What production runs: `AsyncAnthropic(base_url=...)` -> HTTP -> `POST /v1/messages` (SSE, or one
Message body for `complete`) -> the rules, and back through the adapter's event accumulation or
Message conversion, and its error mapping. Tests marked with `mode` run both ways.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from datetime import date
from typing import Any

import anthropic
import pytest
import pytest_asyncio

from app.local_model import LocalModelServer, start_local_model
from app.local_model_rules import respond
from kernel.errors import ConfigError
from services.llm.anthropic_client import AnthropicLLM, make_anthropic_client
from services.llm.port import (
    ChatMessage,
    LLMError,
    LLMEvent,
    LLMRequest,
    LLMResponse,
    TextBlock,
    TextDelta,
    ToolResultBlock,
    ToolSpec,
    ToolUseBlock,
    Usage,
)

SECRET = "sk-ant-test-SECRET-never-shown"
TODAY = date(2026, 12, 2)
CHECK_ORDER = ToolSpec(
    name="check_order",
    description="Look up a customer order by order number.",
    input_schema={
        "type": "object",
        "properties": {"order_id": {"type": "string", "description": "The order number"}},
        "required": ["order_id"],
    },
)


@pytest_asyncio.fixture(scope="module")
async def server() -> AsyncIterator[LocalModelServer]:
    srv = await start_local_model(today=lambda: TODAY)
    try:
        yield srv
    finally:
        await srv.stop()


@pytest_asyncio.fixture(scope="module")
async def sdk(server: LocalModelServer) -> AsyncIterator[anthropic.AsyncAnthropic]:
    client = make_anthropic_client("local", server.url, max_retries=0)
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
def llm(sdk: anthropic.AsyncAnthropic) -> AnthropicLLM:
    return AnthropicLLM(sdk)


def request(text: str, *, tools: list[ToolSpec] | None = None, **kw: Any) -> LLMRequest:
    return LLMRequest(
        model="claude-haiku-4-5",
        system="You are Mia, the assistant of Acme Store.",
        messages=[ChatMessage(role="user", content=[TextBlock(text=text)])],
        tools=[CHECK_ORDER] if tools is None else tools,
        **kw,
    )


async def collect(llm: AnthropicLLM, req: LLMRequest) -> tuple[list[TextDelta], LLMResponse]:
    events: list[LLMEvent] = [e async for e in llm.stream(req)]
    assert isinstance(events[-1], LLMResponse)
    assert all(isinstance(e, TextDelta) for e in events[:-1]), "exactly one LLMResponse, last"
    return events[:-1], events[-1]  # type: ignore[return-value]


@pytest.fixture(params=["stream", "complete"])
def mode(request: pytest.FixtureRequest) -> str:
    return request.param


async def answer(llm: AnthropicLLM, req: LLMRequest, mode: str) -> LLMResponse:
    """The model's answer to `req`, read as a stream or asked for whole."""
    if mode == "complete":
        return await llm.complete(req)
    return (await collect(llm, req))[1]


def without_ids(response: LLMResponse) -> list[Any]:
    return [(b.name, b.input) if isinstance(b, ToolUseBlock) else b for b in response.content]


@pytest.mark.parametrize(
    "text",
    [
        "hello there, who are you?",
        '/call check_order {"order_id": "12345"}\n/call check_order',
        "Where is my order 98765?",
    ],
)
async def test_complete_gives_the_answer_the_stream_ends_with(llm: AnthropicLLM, text: str):
    req = request(text)
    streamed, whole = (await collect(llm, req))[1], await llm.complete(req)
    assert without_ids(whole) == without_ids(streamed)
    assert (whole.stop_reason, whole.usage, whole.model) == (
        streamed.stop_reason, streamed.usage, streamed.model)


async def test_text_streams_as_several_deltas_before_the_response(llm: AnthropicLLM):
    deltas, response = await collect(llm, request("hello there, who are you?"))
    assert len(deltas) >= 2
    [block] = response.content
    assert isinstance(block, TextBlock)
    assert "".join(d.text for d in deltas) == block.text
    assert block.text.startswith("Hi, I'm Mia, the assistant of Acme Store.")
    assert response.stop_reason == "end_turn"
    assert response.model == "claude-haiku-4-5"


async def test_several_tool_calls_arrive_in_one_response_with_parsed_inputs(llm: AnthropicLLM):
    text = (
        '/call check_order {"order_id": "12345"}\n'
        '/call not_offered {"nested": {"a": [1, 2.5, null, true]}, "s": "h\\u00e9 \\"q\\""}\n'
        "/call check_order"
    )
    deltas, response = await collect(llm, request(text))
    assert deltas == []
    assert response.stop_reason == "tool_use"
    assert all(isinstance(b, ToolUseBlock) for b in response.content)
    assert [(b.name, b.input) for b in response.content] == [  # type: ignore[union-attr]
        ("check_order", {"order_id": "12345"}),
        ("not_offered", {"nested": {"a": [1, 2.5, None, True]}, "s": 'hé "q"'}),
        ("check_order", {}),
    ]
    ids = [b.id for b in response.content]  # type: ignore[union-attr]
    assert len(set(ids)) == 3 and all(i.startswith("toolu_") for i in ids)


async def test_the_model_picks_a_tool_from_plain_text(llm: AnthropicLLM, mode: str):
    response = await answer(llm, mode=mode, req=request("Where is my order 98765?"))
    [block] = response.content
    assert isinstance(block, ToolUseBlock)
    assert (block.name, block.input) == ("check_order", {"order_id": "98765"})


async def test_usage_is_nonzero_and_matches_the_rules_and_the_non_streaming_answer(
    llm: AnthropicLLM, sdk: anthropic.AsyncAnthropic
):
    req = request("hello there, who are you?")
    _, response = await collect(llm, req)
    expected = respond(req, today=TODAY).usage
    assert response.usage.input_tokens > 0 and response.usage.output_tokens > 0
    assert response.usage == expected
    message = await sdk.messages.create(
        model=req.model,
        max_tokens=req.max_tokens,
        system=req.system,
        messages=[{"role": "user", "content": "hello there, who are you?"}],
        tools=[
            {
                "name": CHECK_ORDER.name,
                "description": CHECK_ORDER.description,
                "input_schema": CHECK_ORDER.input_schema,
            }
        ],
    )
    assert (message.usage.input_tokens, message.usage.output_tokens) == (
        expected.input_tokens,
        expected.output_tokens,
    )
    assert message.content[0].text == response.content[0].text  # type: ignore[union-attr]


async def test_tool_result_round_trip(llm: AnthropicLLM):
    first = request(
        '/call check_order {"order_id": "12345"}\n/call check_order {"order_id": "777"}'
    )
    _, calls = await collect(llm, first)
    ok, failing = calls.content
    assert isinstance(ok, ToolUseBlock) and isinstance(failing, ToolUseBlock)
    results = [
        ToolResultBlock(
            tool_use_id=ok.id,
            content='{"order_id": "12345", "status": "shipped", "eta": "2026-12-05"}',
        ),
        ToolResultBlock(
            tool_use_id=failing.id,
            content="Tool 'check_order' failed: upstream timeout. "
            "Inform the customer you cannot retrieve their order right now.",
            is_error=True,
        ),
    ]
    second = LLMRequest(
        model=first.model,
        system=first.system,
        messages=[
            *first.messages,
            ChatMessage(role="assistant", content=calls.content),
            ChatMessage(role="user", content=results),
        ],
        tools=first.tools,
    )
    deltas, reply = await collect(llm, second)
    assert len(deltas) >= 2
    [block] = reply.content
    assert isinstance(block, TextBlock)
    assert block.text.startswith("Order 12345: status: shipped, eta: 2026-12-05.")
    assert "I'm sorry, I can't retrieve your order right now." in block.text
    assert reply.stop_reason == "end_turn"
    assert reply.usage.input_tokens > calls.usage.input_tokens


async def test_tool_choice_none_reaches_the_model(llm: AnthropicLLM, mode: str):
    response = await answer(llm, request('/call check_order {"order_id": "1"}', tool_choice="none"), mode)
    assert response.stop_reason == "end_turn"
    assert not any(isinstance(b, ToolUseBlock) for b in response.content)


async def test_loop_marker_keeps_calling_across_rounds(llm: AnthropicLLM, mode: str):
    req = request('/loop\n/call check_order {"order_id": "1"}')
    seen: set[str] = set()
    for _ in range(3):
        response = await answer(llm, req, mode)
        [use] = response.content
        assert isinstance(use, ToolUseBlock) and use.id not in seen
        seen.add(use.id)
        req = LLMRequest(
            model=req.model,
            system=req.system,
            tools=req.tools,
            messages=[
                *req.messages,
                ChatMessage(role="assistant", content=response.content),
                ChatMessage(
                    role="user", content=[ToolResultBlock(tool_use_id=use.id, content="{}")]
                ),
            ],
        )


# -- failures ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fault",
    [
        "malformed-stream",
        "truncated-stream",
        "drop-connection",
        "stream-error",
        "overloaded",
        "server-error",
    ],
)
async def test_faults_become_retryable_llm_errors_without_the_key(
    server: LocalModelServer, fault: str, mode: str
):
    client = make_anthropic_client(
        SECRET, server.url, max_retries=0, default_headers={"x-ce-fault": fault}
    )
    try:
        with pytest.raises(LLMError) as caught:
            await answer(AnthropicLLM(client), request("hello there"), mode)
    finally:
        await client.close()
    assert caught.value.retryable is True
    assert SECRET not in str(caught.value)
    assert caught.value.__cause__ is None and caught.value.__context__ is None


@pytest.mark.parametrize(
    ("fault", "mode", "message"),
    [
        ("malformed-stream", "stream", r"the stream from model 'claude-haiku-4-5' was malformed"),
        ("malformed-stream", "complete", r"the answer from model 'claude-haiku-4-5' was malformed"),
        ("truncated-stream", "stream", r"ended before message_stop"),
        ("truncated-stream", "complete", r"answer from model 'claude-haiku-4-5' has no stop reason"),
        ("drop-connection", "complete", r"connection to the model service broke mid-answer"),
        ("stream-error", "complete", r"refused the request \(529 overloaded_error\)"),
    ],
)
async def test_a_broken_answer_names_the_problem(
    server: LocalModelServer, fault: str, mode: str, message: str
):
    client = make_anthropic_client(
        SECRET, server.url, max_retries=0, default_headers={"x-ce-fault": fault}
    )
    try:
        with pytest.raises(LLMError, match=message):
            await answer(AnthropicLLM(client), request("hello there"), mode)
    finally:
        await client.close()


async def test_fault_line_in_the_message_works_like_the_header(llm: AnthropicLLM, mode: str):
    with pytest.raises(LLMError, match="ended before message_stop|has no stop reason"):
        await answer(llm, request("hello\n/fault truncated-stream"), mode)


async def test_timeout_is_a_retryable_llm_error(server: LocalModelServer, mode: str):
    client = make_anthropic_client(
        SECRET, server.url, max_retries=0, timeout=0.2, default_headers={"x-ce-fault": "slow:500"}
    )
    try:
        with pytest.raises(LLMError, match="did not answer in time") as caught:
            await answer(AnthropicLLM(client), request("hello there"), mode)
    finally:
        await client.close()
    assert caught.value.retryable is True


async def test_unreachable_model_is_a_retryable_llm_error_without_the_key(mode: str):
    client = make_anthropic_client(SECRET, "http://127.0.0.1:9", max_retries=0)
    try:
        with pytest.raises(
            LLMError, match=r"could not reach the model service at 127\.0\.0\.1:9"
        ) as caught:
            await answer(AnthropicLLM(client), request("hello there"), mode)
    finally:
        await client.close()
    assert caught.value.retryable is True and SECRET not in str(caught.value)


async def test_a_request_the_api_would_refuse_is_not_retryable(llm: AnthropicLLM, mode: str):
    orphan = LLMRequest(
        model="claude-haiku-4-5",
        system="",
        messages=[
            ChatMessage(role="user", content=[ToolResultBlock(tool_use_id="toolu_x", content="{}")])
        ],
    )
    with pytest.raises(
        LLMError, match=r"400 invalid_request_error.*unexpected tool_use_id"
    ) as caught:
        await answer(llm, orphan, mode)
    assert caught.value.retryable is False


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"max_tokens": 0}, r"expected `int` >= 1 - at `\$.max_tokens`"),
        ({"messages": [{"role": "system", "content": "x"}]}, r"at `\$.messages\[0\].role`"),
        ({"messages": []}, r"at `\$.messages`"),
        ({"temperature_x": 1}, r"unknown field `temperature_x`"),
    ],
)
async def test_bad_bodies_get_the_api_error_shape(
    sdk: anthropic.AsyncAnthropic, body: dict, message: str
):
    params: dict[str, Any] = {
        "model": "m",
        "max_tokens": 10,
        "messages": [{"role": "user", "content": "hi"}],
    }
    extra = {k: v for k, v in body.items() if k not in params}
    params.update({k: v for k, v in body.items() if k not in extra})
    with pytest.raises(anthropic.BadRequestError, match=message) as caught:
        await sdk.messages.create(**params, extra_body=extra or None)
    assert caught.value.status_code == 400
    assert caught.value.type == "invalid_request_error"


async def test_unknown_route_answers_in_the_api_error_shape(sdk: anthropic.AsyncAnthropic):
    with pytest.raises(anthropic.NotFoundError) as caught:
        await sdk.models.list()
    assert caught.value.type == "not_found_error"


async def test_calls_run_on_the_aiohttp_transport_and_close_with_the_adapter(server: LocalModelServer):
    client = make_anthropic_client("local", server.url, max_retries=0)
    # The SDK keeps its HTTP client as `_client`; ours is its aiohttp one, not its httpx default.
    assert isinstance(client._client, anthropic.DefaultAioHttpClient)
    adapter = AnthropicLLM(client)
    _, response = await collect(adapter, request("hello there"))
    assert response.stop_reason == "end_turn"
    assert not adapter.is_closed()
    await adapter.close()
    assert adapter.is_closed() and client.is_closed()


def test_factory_refuses_to_guess_a_model():
    with pytest.raises(ConfigError, match="ANTHROPIC_API_KEY") as caught:
        make_anthropic_client(None, None)
    assert caught.value.variable == "ANTHROPIC_API_KEY"


async def test_the_module_runs_as_a_server_process():
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "app.local_model",
        "--port",
        "0",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        url = None
        async with asyncio.timeout(30):
            while url is None:
                line = (await proc.stdout.readline()).decode()  # type: ignore[union-attr]
                assert line, "the server exited before printing its URL"
                if line.startswith("local model listening on "):
                    url = line.split()[-1]
        client = make_anthropic_client(None, url, max_retries=0)
        try:
            _, response = await collect(AnthropicLLM(client), request("hello there"))
        finally:
            await client.close()
        assert response.content and response.stop_reason == "end_turn"
    finally:
        proc.terminate()
        await proc.wait()
    assert proc.returncode == 0


def test_a_message_body_from_the_real_api_reads_as_the_stream_would():
    # Fields and block kinds the local model never sends (thinking, server tools, cache usage)
    # are ignored, as `_accumulate` ignores their events; empty text is dropped.
    from services.llm.anthropic_client import _decode_message, _response_of

    body = (
        b'{"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x",'
        b' "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"},'
        b' {"type": "text", "text": "", "citations": null},'
        b' {"type": "text", "text": "Looking.", "citations": null},'
        b' {"type": "tool_use", "id": "toolu_1", "name": "check_order", "input": {"order_id": "7"}},'
        b' {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": [], "name": null}],'
        b' "stop_reason": "tool_use", "stop_sequence": null, "container": null,'
        b' "usage": {"input_tokens": 12, "output_tokens": 5, "cache_read_input_tokens": 3,'
        b' "server_tool_use": null, "service_tier": "standard"}}'
    )
    response = _response_of(_decode_message(body), "claude-asked")
    assert response == LLMResponse(
        content=[TextBlock(text="Looking."),
                 ToolUseBlock(id="toolu_1", name="check_order", input={"order_id": "7"})],
        stop_reason="tool_use", usage=Usage(input_tokens=12, output_tokens=5), model="claude-x",
    )
    with pytest.raises(LLMError, match="tool call without its id or name"):
        _response_of(_decode_message(
            b'{"content": [{"type": "tool_use", "id": null, "name": "n", "input": {}}], "stop_reason": "tool_use"}'
        ), "m")
    with pytest.raises(LLMError, match="not a JSON object"):
        _response_of(_decode_message(
            b'{"content": [{"type": "tool_use", "id": "t", "name": "n", "input": [1]}], "stop_reason": "tool_use"}'
        ), "m")


def test_the_request_body_is_the_messages_apis_json():
    # Both calls send this body as bytes through the SDK's `post`; what the API reads is spelled
    # out here, since the local model would accept more than the API does.
    import msgspec

    from services.llm.anthropic_client import _body, _encode_body

    req = LLMRequest(
        model="claude-x", max_tokens=300, system="Be brief.", tool_choice="none",
        tools=[ToolSpec(name="check_order", description="Looks up an order.",
                        input_schema={"type": "object", "properties": {"order_id": {"type": "string"}}})],
        messages=[
            ChatMessage(role="user", content=[TextBlock(text="where is 7?")]),
            ChatMessage(role="assistant", content=[
                TextBlock(text="Looking."), ToolUseBlock(id="toolu_1", name="check_order", input={"order_id": "7"})]),
            ChatMessage(role="user", content=[ToolResultBlock(tool_use_id="toolu_1", content="shipped")]),
        ],
    )
    assert msgspec.json.decode(_encode_body(_body(req, stream=True))) == {
        "model": "claude-x", "max_tokens": 300, "system": "Be brief.", "stream": True,
        "tools": [{"name": "check_order", "description": "Looks up an order.",
                   "input_schema": {"type": "object", "properties": {"order_id": {"type": "string"}}}}],
        "tool_choice": {"type": "none"},
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "where is 7?"}]},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "toolu_1", "name": "check_order", "input": {"order_id": "7"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "shipped", "is_error": False}]},
        ],
    }
    # no system prompt, no tools (then no tool_choice either), not streamed: left out, as the API's defaults
    bare = LLMRequest(model="m", system="", tool_choice="none", messages=req.messages[:1])
    assert msgspec.json.decode(_encode_body(_body(bare))) == {
        "model": "m", "max_tokens": 1024, "messages": [{"role": "user", "content": [{"type": "text", "text": "where is 7?"}]}]}
