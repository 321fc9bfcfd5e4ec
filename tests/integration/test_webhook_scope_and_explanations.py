"""Webhook tools through the real executor and WebhookClient against a loopback server:

- a URL hole named by a protected key (`{account_id}`) is filled from the trusted scope, never
  from the model; a protected hole the trusted scope cannot fill fails in-band as a configuration
  problem of the business, never by telling the model to ask the customer for it;
- an upstream's own explanation of a 400/404/409/422 (a JSON `error`/`message`/`detail`, a
  problem+json `detail`/`title`, a short text/plain body) reaches the model's failure text,
  capped, on one line and without a credential the call sent; a 5xx is answered as before.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from aiohttp import web

from services.botconfig import BotConfig
from services.tools.context import TrustedContext
from services.tools.crypto import SecretBox, generate_key
from services.tools.executor import Executor, ToolCall, ToolOutcome
from services.tools.model import WebhookTool, normalise_parameters
from services.tools.registry import HandlerRegistry, build_catalog
from services.tools.ssrf import DestinationPolicy
from services.tools.templating import template_holes
from services.tools.toolset import SessionToolState
from services.tools.webhook import ERROR_BODY_WAIT_S, WebhookClient, WebhookToolBackend
from tests.support.net_fakes import LoopbackOnlySockets, MapResolver

#: what the session host puts in the trusted scope (actors.session._scope): the tenant's id
TRUSTED_SCOPE = {"tenant_id": "tn_A", "tenantId": "tn_A", "account_id": "tn_A", "accountId": "tn_A"}
AUTH = "Bearer sk-live-SUPERSECRET-4242"


class Upstream:
    """Records each request's raw path and body; answers what a route says."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.port = 0
        self._runner: web.AppRunner | None = None

    def url(self, path: str) -> str:
        return f"http://api.test:{self.port}{path}"

    async def start(self) -> Upstream:
        async def order(request: web.Request) -> web.Response:
            self.seen.append({"path": request.raw_path, "query": dict(request.query)})
            return web.json_response(
                {"account": request.match_info["account_id"], "status": "shipped"}
            )

        async def answer(request: web.Request) -> web.Response:
            self.seen.append({"path": request.raw_path, "body": await request.text()})
            kind = request.match_info["kind"]
            status = int(request.query.get("status", "422"))
            if kind == "json":
                return web.json_response(
                    {
                        "error": "check_out must be after check_in; ask the guest for corrected dates"
                    },
                    status=status,
                )
            if kind == "problem":
                body = {
                    "type": "about:blank",
                    "title": "Unprocessable",
                    "status": status,
                    "detail": "the listing is not available on 2026-07-10",
                }
                return web.Response(
                    status=status, text=json.dumps(body), content_type="application/problem+json"
                )
            if kind == "nested":
                return web.json_response(
                    {"error": {"code": "E1", "message": "order 12345 does not exist"}},
                    status=status,
                )
            if kind == "text":
                return web.Response(
                    status=status, text="  quantity must be\nat most 5  ", content_type="text/plain"
                )
            if kind == "html":
                return web.Response(status=status, text="<h1>Bad</h1>", content_type="text/html")
            if kind == "echo":  # a careless upstream quoting the request's credential back
                auth = request.headers.get("Authorization", "")
                return web.json_response(
                    {"message": f"token {auth.partition(' ')[2]} may not book; use {auth}"},
                    status=status,
                )
            if kind == "long":
                return web.json_response(
                    {"message": "dates are wrong " + "x" * 2000}, status=status
                )
            if kind == "huge":  # larger than the error-body cap: not read at all
                return web.json_response(
                    {"message": "too much", "pad": "y" * 10_000}, status=status
                )
            raise web.HTTPNotFound()

        app = web.Application()
        app.router.add_get("/api/accounts/{account_id}/orders/{order_id}", order)
        app.router.add_get("/api/stores/{store_id}/orders/{order_id}", order)
        app.router.add_post("/api/answer/{kind}", answer)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@pytest.fixture
async def upstream():
    server = await Upstream().start()
    yield server
    await server.stop()


@pytest.fixture
async def client():
    sockets = LoopbackOnlySockets()
    client = WebhookClient(
        policy=DestinationPolicy(allow=("127.0.0.1/32",)),
        resolver=MapResolver({"api.test": ["127.0.0.1"]}),
        socket_factory=sockets,
    )
    await client.start()
    yield client
    await client.close()
    assert sockets.refused == [], "a client tried to connect off loopback"


BOX = SecretBox([generate_key()])


async def run(
    client: WebhookClient,
    tool: WebhookTool,
    args: dict[str, Any],
    scope: dict[str, Any] = TRUSTED_SCOPE,
) -> ToolOutcome:
    catalog = build_catalog(
        [],
        [(tool, 1)],
        registry=HandlerRegistry(),
        backend=WebhookToolBackend(client, secret_box=BOX),
    )
    executor = Executor()
    plan = await executor.prepare(
        [ToolCall(id="c1", name=tool.name, arguments=args)],
        catalog=catalog,
        config=BotConfig(),
        session=SessionToolState(),
        scope=scope,
    )
    ctx = TrustedContext(tenant_id="tn_A", session_id="s1", message_id="m1", scope=scope)
    [outcome] = await executor.execute(plan, ctx, approved=True)
    return outcome


def order_tool(url: str, **fields: Any) -> WebhookTool:
    holes = template_holes(url)
    params = {h: {"type": "string"} for h in holes}
    return WebhookTool(
        name="check_order",
        description="Look up an order.",
        webhook_url=url,
        parameters=normalise_parameters(params, required_hint=holes),
        **fields,
    )


# --------------------------------------------------------------------------- protected holes


async def test_a_protected_url_hole_is_filled_from_the_trusted_scope_not_from_the_model(
    client, upstream
) -> None:
    # before: the executor filled account_id from the trusted scope, then the webhook client
    # stripped it again and the url had a hole with no value: the tool could never run
    tool = order_tool(upstream.url("/api/accounts/{account_id}/orders/{order_id}"))
    outcome = await run(client, tool, {"order_id": "12345", "account_id": "tn_B"})
    assert outcome.success, outcome.content
    assert upstream.seen == [{"path": "/api/accounts/tn_A/orders/12345", "query": {}}]
    assert json.loads(outcome.content) == {"account": "tn_A", "status": "shipped"}


async def test_a_protected_hole_is_filled_even_when_the_model_leaves_it_out(
    client, upstream
) -> None:
    tool = order_tool(upstream.url("/api/accounts/{accountId}/orders/{order_id}"))
    outcome = await run(client, tool, {"order_id": "7"})
    assert outcome.success, outcome.content
    assert upstream.seen[-1]["path"] == "/api/accounts/tn_A/orders/7"


async def test_a_protected_hole_the_trusted_scope_cannot_fill_is_a_configuration_failure(
    client, upstream
) -> None:
    # a row stored before registration refused such a hole: `store_id` is the tool's own
    # protected name, which the model may not supply and the trusted scope does not hold
    params = {
        "type": "object",
        "properties": {"store_id": {"type": "string"}, "order_id": {"type": "string"}},
        "required": ["order_id"],
    }
    tool = WebhookTool(
        name="check_order",
        description="Look up an order.",
        parameters=params,
        webhook_url=upstream.url("/api/stores/{store_id}/orders/{order_id}"),
        protected=("store_id",),
    )
    outcome = await run(client, tool, {"order_id": "7", "store_id": "berlin"})
    assert not outcome.success
    assert upstream.seen == []  # nothing was sent
    assert "ask the customer" not in outcome.content.lower()
    assert "{store_id}" in outcome.content and "configur" in outcome.content
    assert "berlin" not in outcome.content  # the model's value is never used, nor quoted
    assert outcome.error_kind == "policy_denied"


@pytest.mark.parametrize("hole", ["account_id", "accountId"])
async def test_an_account_hole_in_an_anonymous_session_asks_the_customer_to_sign_in(client, upstream, hole) -> None:
    # the customer's account comes only from a verified contact's token: an anonymous session's
    # scope holds the tenant's id alone, and the tenant's id never stands in for the account
    url = upstream.url(f"/api/accounts/{{{hole}}}/orders/{{order_id}}")
    tool = WebhookTool(name="check_order", description="Look up an order.", webhook_url=url,
                       parameters=normalise_parameters({"order_id": {"type": "string"}}, required_hint=["order_id"]))
    outcome = await run(client, tool, {"order_id": "7", hole: "tn_B"}, scope={"tenant_id": "tn_A", "tenantId": "tn_A"})
    assert not outcome.success and outcome.error_kind == "policy_denied"
    assert upstream.seen == []  # nothing was sent
    assert f"the url needs {{{hole}}}, the customer's account" in outcome.content, outcome.content
    assert "sign in" in outcome.content and "tn_B" not in outcome.content


# --------------------------------------------------------------------------- 4xx explanations


def booking_tool(upstream: Upstream, kind: str, status: int = 422) -> WebhookTool:
    return WebhookTool(
        name="book_stay",
        description="Book a stay.",
        mutability="write",
        requires_approval=False,
        method="POST",
        parameters=normalise_parameters(
            {"check_in": {"type": "string"}, "check_out": {"type": "string"}}
        ),
        webhook_url=upstream.url(f"/api/answer/{kind}?status={status}"),
        auth_header_enc=BOX.encrypt(AUTH),
    )


DATES = {"check_in": "2026-07-10", "check_out": "2026-07-01"}


async def test_the_upstreams_explanation_of_a_422_reaches_the_model(client, upstream) -> None:
    # before: the body was closed unread and the model got "upstream rejected the request (422)"
    outcome = await run(client, booking_tool(upstream, "json"), DATES)
    assert not outcome.success
    assert outcome.content == (
        "Tool 'book_stay' failed: upstream rejected the request (422); the service said: "
        '"check_out must be after check_in; ask the guest for corrected dates". '
        "Check the details you sent with the customer, then try once more."
    )
    assert outcome.record.error == outcome.content


@pytest.mark.parametrize(
    ("kind", "status", "said"),
    [
        ("problem", 422, "the listing is not available on 2026-07-10"),
        ("nested", 404, "order 12345 does not exist"),
        ("text", 400, "quantity must be at most 5"),
        ("json", 409, "check_out must be after check_in; ask the guest for corrected dates"),
    ],
    ids=[
        "problem-json-detail",
        "nested-error-message-404",
        "short-text-plain-one-line",
        "json-error-409",
    ],
)
async def test_each_readable_explanation_is_quoted_on_one_line(
    client, upstream, kind, status, said
) -> None:
    outcome = await run(client, booking_tool(upstream, kind, status), DATES)
    assert f'the service said: "{said}"' in outcome.content
    assert f"({status})" in outcome.content


@pytest.mark.parametrize(
    ("kind", "status"), [("html", 422), ("huge", 422), ("json", 500), ("json", 503)]
)
async def test_an_unreadable_explanation_or_a_5xx_keeps_the_generic_text(
    client, upstream, kind, status
) -> None:
    outcome = await run(client, booking_tool(upstream, kind, status), DATES)
    assert not outcome.success
    assert "the service said" not in outcome.content
    if status >= 500:
        assert outcome.content.startswith(
            f"Tool 'book_stay' failed: upstream error ({status}). Tell the customer"
        )
    else:
        assert outcome.content.startswith(
            "Tool 'book_stay' failed: upstream rejected the request (422). Check"
        )


async def test_an_explanation_is_capped(client, upstream) -> None:
    outcome = await run(client, booking_tool(upstream, "long"), DATES)
    said = outcome.content.split('the service said: "', 1)[1].split('"', 1)[0]
    assert said.startswith("dates are wrong xxx") and said.endswith("…")
    assert len(said) <= 300


async def test_an_explanation_never_repeats_the_credential_the_call_sent(client, upstream) -> None:
    outcome = await run(client, booking_tool(upstream, "echo"), DATES)
    assert "SUPERSECRET" not in outcome.content and "SUPERSECRET" not in (
        outcome.record.error or ""
    )
    assert 'the service said: "token [redacted] may not book; use [redacted]"' in outcome.content


async def test_a_slow_error_body_is_not_waited_for_past_its_short_budget(client) -> None:
    # headers at once, then the body drips: the status is answered without the explanation,
    # well before the call's own 5 s deadline, and not as a timeout
    async def drip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 422 Unprocessable\r\nContent-Type: application/json\r\nContent-Length: 400\r\n\r\n"
        )
        await writer.drain()
        try:
            for _ in range(400):
                writer.write(b" ")
                await writer.drain()
                await asyncio.sleep(0.05)
        except ConnectionError:
            pass

    server = await asyncio.start_server(drip, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        tool = WebhookTool(
            name="book_stay",
            description="Book a stay.",
            parameters=normalise_parameters({}),
            webhook_url=f"http://api.test:{port}/book",
        )
        started = time.monotonic()
        outcome = await run(client, tool, {})
        assert time.monotonic() - started < ERROR_BODY_WAIT_S + 1.5
        assert outcome.error_kind == "upstream_status"
        assert outcome.content.startswith(
            "Tool 'book_stay' failed: upstream rejected the request (422). Check"
        )
    finally:
        server.close()
        await server.wait_closed()
