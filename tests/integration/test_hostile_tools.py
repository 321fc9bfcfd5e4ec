"""Hostile tool definitions and hostile data at the tool boundary, with real HTTP on loopback.

- A host name that resolves to the metadata address or a private range, a redirect to one, and a
  stored definition with such a literal are refused in-band ("destination not allowed" / "redirects
  are not followed") before anything connects.
- A turn with tools carrying an encrypted auth header and a sensitive argument leaks neither into
  span attributes, logs, the reply, the tool-call records or the error texts.
- Characters Postgres cannot store (NUL, lone surrogates), which a model or a tool can produce, do
  not fail a group commit: the other sessions of the flush are written too.

Safety: no test may send a packet off this machine, even with a broken guard. Upstreams bind
127.0.0.1; host names "resolve" only through `MapResolver`; every client gets `LoopbackOnlySockets`,
which refuses (and records) any non-loopback connect before a socket exists; and the guard cases
assert that nothing reached even that factory.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import pytest_asyncio
from aiohttp import web
from structlog.testing import capture_logs

from actors.session import TurnEnv, handle_message, new_state
from kernel.records import (
    MessageRecord,
    SessionDelta,
    SessionSnapshot,
    ToolCallRecord,
    TurnRecord,
    session_uid,
)
from services.botconfig import BotConfig
from services.tools.context import TrustedContext
from services.tools.crypto import SecretBox, generate_key
from services.tools.executor import Executor, ToolCall
from services.tools.model import WebhookTool
from services.tools.registry import HandlerRegistry, build_catalog
from services.tools.ssrf import DestinationPolicy
from services.tools.toolset import SessionToolState
from services.tools.webhook import WebhookClient, WebhookToolBackend
from storage.repos import SessionRepo
from tests.support import tracing
from tests.support.net_fakes import LoopbackOnlySockets, MapResolver
from tests.support.turns import ScriptedLLM

spans = tracing.spans  # the fixture

ORDER = {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]}


# --------------------------------------------------------------------------- safety fakes


# --------------------------------------------------------------------------- a loopback upstream


class Upstream:
    """Records every request; answers by path: redirects, errors echoing the auth header, JSON."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> Upstream:
        async def handle(request: web.Request) -> web.StreamResponse:
            self.requests.append({"path": request.path_qs, "headers": dict(request.headers),
                                  "body": await request.text()})
            what = request.match_info["what"]
            auth = request.headers.get("Authorization", "")
            if what.startswith("redirect"):
                return web.Response(status=302, headers={"Location": request.query["to"]})
            if what == "fail500":
                return web.Response(status=500, text=f"upstream broke; you sent {auth}")
            if what == "fail401":
                return web.json_response({"error": f"bad credentials {auth}"}, status=401)
            if what == "garbage":
                return web.Response(status=200, text=f"<html>{auth}</html>", content_type="text/html")
            return web.json_response({"ok": True, "order": request.match_info.get("rest", "")})

        app = web.Application()
        app.router.add_route("*", "/{what}", handle)
        app.router.add_route("*", "/{what}/{rest:.*}", handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@pytest_asyncio.fixture
async def upstream() -> AsyncIterator[Upstream]:
    u = await Upstream().start()
    try:
        yield u
    finally:
        await u.stop()


class Guarded:
    """A WebhookClient as the engine builds it, but with test resolver and loopback-only sockets."""

    def __init__(self, answers: dict[str, list[str]], allow: tuple[str, ...] = ("127.0.0.1/32",)) -> None:
        self.resolver = MapResolver(answers)
        self.sockets = LoopbackOnlySockets()
        self.client = WebhookClient(policy=DestinationPolicy(allow=allow), resolver=self.resolver,
                                    socket_factory=self.sockets)


@pytest_asyncio.fixture
async def guarded_factory() -> AsyncIterator[Any]:
    made: list[Guarded] = []

    async def make(answers: dict[str, list[str]] | None = None, allow: tuple[str, ...] = ("127.0.0.1/32",)) -> Guarded:
        g = Guarded(answers or {}, allow)
        await g.client.start()
        made.append(g)
        return g

    try:
        yield make
    finally:
        for g in made:
            await g.client.close()


def _ctx() -> TrustedContext:
    return TrustedContext(tenant_id="tn_A", session_id="s1", message_id="m1",
                          scope={"tenant_id": "tn_A", "account_id": "tn_A"})


async def _run_in_band(tool: WebhookTool, args: dict[str, Any], backend: WebhookToolBackend):
    """One call through the executor, as a session runs it: the outcome the model would read."""
    catalog = build_catalog([], [(tool, 1)], registry=HandlerRegistry(), backend=backend)
    executor = Executor()
    plan = await executor.prepare([ToolCall(id="c1", name=tool.name, arguments=args)], catalog=catalog,
                                  config=BotConfig(), session=SessionToolState(), scope={})
    [outcome] = await executor.execute(plan, _ctx())
    return outcome


# --------------------------------------------------------------------------- hostile destinations


@pytest.mark.parametrize(("answers", "rule"), [
    (["169.254.169.254"], "link-local address (cloud metadata)"),
    (["10.0.0.1"], "private address"),
    (["93.184.216.34", "10.0.0.1"], "private address"),  # one bad answer among good ones is enough
    (["fd00::1"], "unique-local address"),
    (["::ffff:169.254.169.254"], "ipv4-mapped link-local address (cloud metadata)"),
    (["127.0.0.1"], None),  # allowed by the test's allowlist: the control case, it connects
], ids=["metadata", "10/8", "mixed", "ula", "mapped-metadata", "allowed-loopback"])
async def test_a_tool_host_that_resolves_privately_is_refused_in_band_before_any_connect(
    guarded_factory, upstream, answers, rule
):
    port = upstream.url.rsplit(":", 1)[1]
    guarded = await guarded_factory({"orders.tenant.test": answers})
    tool = WebhookTool(name="check_order", description="look up an order", parameters=ORDER,
                       webhook_url=f"http://orders.tenant.test:{port}/order/{{order_id}}")
    with capture_logs() as logs:
        outcome = await _run_in_band(tool, {"order_id": "12345"}, WebhookToolBackend(guarded.client, secret_box=None))

    assert guarded.resolver.calls == [("orders.tenant.test", int(port))], "resolved exactly once"
    assert guarded.sockets.refused == [], "the guard refused before the connector ever tried"
    if rule is None:
        assert outcome.success and guarded.sockets.connects == ["127.0.0.1"] and len(upstream.requests) == 1
        return
    assert not outcome.success and guarded.sockets.connects == [] and upstream.requests == []
    assert outcome.content.startswith("Tool 'check_order' failed: destination not allowed. ")
    assert outcome.error_kind == "destination_blocked" and outcome.counts_for_breaker
    assert rule not in outcome.content and answers[-1] not in outcome.content, "the model learns nothing of the network"
    [failed] = [e for e in logs if e["event"] == "webhook_call_failed"]
    assert failed["rule"] == rule  # ...the operator does


@pytest.mark.parametrize("location", [
    "http://169.254.169.254/latest/meta-data/iam/security-credentials/",
    "http://10.0.0.1/admin",
    "http://metadata.tenant.test/latest/",  # a name that would resolve privately
    "http://[::ffff:10.0.0.1]/",
])
async def test_a_redirect_to_a_private_address_is_not_followed(guarded_factory, upstream, location):
    guarded = await guarded_factory({"metadata.tenant.test": ["169.254.169.254"]})
    tool = WebhookTool(name="check_order", description="look up an order", parameters=ORDER,
                       webhook_url=f"{upstream.url}/redirect/{{order_id}}?to={location}")
    outcome = await _run_in_band(tool, {"order_id": "1"}, WebhookToolBackend(guarded.client, secret_box=None))
    assert not outcome.success
    assert "redirected (302); redirects are not followed" in outcome.content
    assert len(upstream.requests) == 1
    assert guarded.sockets.connects == ["127.0.0.1"] and guarded.sockets.refused == []
    assert guarded.resolver.calls == []  # the redirect target was never even resolved


@pytest.mark.parametrize("url", [
    "http://169.254.169.254/latest/meta-data/{order_id}",
    "http://10.0.0.1/orders/{order_id}",
    "http://[fd00::1]:8080/orders/{order_id}",
    "http://2852039166/{order_id}",  # 169.254.169.254 as one decimal number
    "http://0xa9.0xfe.0xa9.0xfe/{order_id}",
    "http://169.254.169.254./{order_id}",
])
async def test_a_stored_tool_with_a_private_literal_is_refused_at_call_time(guarded_factory, url):
    """Registration refuses these now; a definition stored before (or under a wider allowlist that
    an operator has since narrowed) is still refused when it runs."""
    guarded = await guarded_factory()
    tool = WebhookTool(name="check_order", description="look up an order", parameters=ORDER, webhook_url=url)
    outcome = await _run_in_band(tool, {"order_id": "1"}, WebhookToolBackend(guarded.client, secret_box=None))
    assert not outcome.success
    assert outcome.content.startswith("Tool 'check_order' failed: destination not allowed. ")
    assert guarded.sockets.connects == [] and guarded.sockets.refused == [] and guarded.resolver.calls == []


# --------------------------------------------------------------------------- secrets in a traced turn


async def test_a_turn_leaks_no_auth_header_or_sensitive_argument_into_spans_logs_records_or_errors(
    guarded_factory, upstream, spans
):
    secret = f"Bearer sk-SECRET-canary-{secrets.token_hex(8)}"
    card = f"4000{secrets.randbelow(10**12):012d}"
    box = SecretBox((generate_key(),))
    guarded = await guarded_factory()
    schema = {"type": "object", "properties": {"order_id": {"type": "string"}, "card": {"type": "string"}},
              "required": ["order_id"]}

    def tool(name: str, path: str, **kw: Any) -> WebhookTool:
        return WebhookTool(name=name, description=name, parameters=schema, sensitive=("card",),
                           auth_header_enc=box.encrypt(secret), webhook_url=f"{upstream.url}/{path}/{{order_id}}", **kw)

    hop = WebhookTool(name="hop", description="hop", parameters=schema, sensitive=("card",),
                      auth_header_enc=box.encrypt(secret),
                      webhook_url=f"{upstream.url}/redirect/{{order_id}}?to=http://10.0.0.1/{{card}}")
    tools = [tool("pay_order", "ok", method="POST"), tool("fail_500", "fail500"), tool("fail_401", "fail401"),
             tool("garbage", "garbage"), hop]
    calls = [(t.name, {"order_id": str(i), "card": card}) for i, t in enumerate(tools)]
    catalog = build_catalog([], [(t, 1) for t in tools], registry=HandlerRegistry(),
                            backend=WebhookToolBackend(guarded.client, secret_box=box))
    env = TurnEnv(llm=ScriptedLLM([calls, "done"]), executor=Executor(), catalog=catalog, config=BotConfig(),
                  main_model="main", cheap_model="cheap")
    state = new_state("tn_A", "s-secrets")
    with capture_logs() as logs:
        reply = await handle_message(state, "pay my order", "m1", env)

    # the secret really was used: every upstream request carried it
    assert len(upstream.requests) == len(tools)
    assert all(r["headers"].get("Authorization") == secret for r in upstream.requests)
    assert [c.success for c in reply.tool_calls] == [True, False, False, False, False]
    delta = state.take_delta()
    token = secret.split()[1]

    places: dict[str, str] = {
        "reply": json.dumps(msgspec.to_builtins(reply)),
        "error texts": json.dumps([c.error for c in reply.tool_calls]),
        "logs": repr(logs),
        "spans": repr([dict(s.attributes or {}) for s in spans.get_finished_spans()]),
        "span events": repr([e.attributes for s in spans.get_finished_spans() for e in s.events]),
        "tool-call records": msgspec.json.encode(delta.tool_calls).decode(),
        "turn records": msgspec.json.encode(delta.turns).decode(),
        "messages": msgspec.json.encode(delta.messages).decode(),
    }
    assert any(s.name == "tool_call" for s in spans.get_finished_spans())
    for where, text in places.items():
        assert token not in text, f"the auth header is in the {where}"
    for where in ("logs", "spans", "span events", "tool-call records", "error texts", "reply"):
        assert card not in places[where], f"the sensitive argument is in the {where}"
    assert all(r.parameters.get("card") == "[redacted]" for r in delta.tool_calls)


# --------------------------------------------------------------------------- unstorable characters


async def test_unstorable_characters_from_a_model_or_tool_do_not_fail_a_group_commit(pool, make_tenant):
    sessions = SessionRepo(pool)
    tenant, _ = await make_tenant("nul")
    hostile, plain = f"hostile-{secrets.token_hex(3)}", f"plain-{secrets.token_hex(3)}"
    leases = [await sessions.activate(tenant.id, s, owner="host") for s in (hostile, plain)]
    bad = "a\x00b\ud800c"  # NUL (Postgres refuses it in text and jsonb) and a lone surrogate (not UTF-8)

    def record(session_id: str, text: str) -> ToolCallRecord:
        return ToolCallRecord(
            id="call_" + secrets.token_hex(6), tenant_id=tenant.id, session_id=session_id, message_id=f"m{text}",
            tool_name=f"t{text}", parameters={"q": text, text: [text]}, result={"r": text}, success=False,
            latency_ms=1, queue_ms=0, error=f"Tool 't{text}' failed: {text}",
        )

    def delta(lease, text: str) -> SessionDelta:
        return SessionDelta(
            tenant_id=tenant.id, session_id=lease.session_id, epoch=lease.epoch,
            snapshot=SessionSnapshot(message_count=1, breakers={f"t{text}": 1}),
            messages=[MessageRecord(seq=0, role="user", content=[{"type": "text", "text": text}], message_id=f"m{text}")],
            variables={f"v{text}": text}, tool_calls=[record(lease.session_id, text)],
            turns=[TurnRecord(message_id=f"m{text}", response={"reply": text})],
        )

    result = await sessions.flush([delta(leases[0], bad), delta(leases[1], "fine")])
    assert sorted(s for _, s in result.written) == sorted([hostile, plain]) and result.refused == []

    uid = session_uid(tenant.id, hostile)
    stored = await pool.fetchrow(
        "SELECT (SELECT content::text FROM ce_messages WHERE session_id = $1) AS content, "
        "(SELECT value FROM ce_session_variables WHERE session_id = $1) AS value, "
        "(SELECT error FROM ce_tool_calls WHERE session_id = $1) AS error, "
        "(SELECT message_id FROM ce_turns WHERE session_id = $1) AS turn", uid)
    replaced = "a\ufffdb?c"
    assert replaced in stored["content"] and stored["value"] == replaced
    assert stored["error"].endswith(replaced) and stored["turn"] == f"m{replaced}"
    assert await pool.fetchval("SELECT count(*) FROM ce_tool_calls WHERE session_id = $1",
                               session_uid(tenant.id, plain)) == 1


async def test_variable_keys_that_become_one_key_when_stored_do_not_fail_a_group_commit(pool, make_tenant):
    # "k\x00" is stored as "k\ufffd", the key the tool also set: one row, the later value winning
    sessions = SessionRepo(pool)
    tenant, _ = await make_tenant("nulkeys")
    hostile, plain = f"hostile-{secrets.token_hex(3)}", f"plain-{secrets.token_hex(3)}"
    leases = [await sessions.activate(tenant.id, s, owner="host") for s in (hostile, plain)]
    deltas = [
        SessionDelta(tenant_id=tenant.id, session_id=hostile, epoch=leases[0].epoch, snapshot=SessionSnapshot(),
                     variables={"k\x00": "1", "k\ufffd": "2", "v\ud800": "3", "v?": "4"}),
        SessionDelta(tenant_id=tenant.id, session_id=plain, epoch=leases[1].epoch,
                     snapshot=SessionSnapshot(message_count=1),
                     messages=[MessageRecord(seq=0, role="user", content=[{"type": "text", "text": "hi"}])]),
    ]
    result = await sessions.flush(deltas)
    assert sorted(s for _, s in result.written) == sorted([hostile, plain]) and result.refused == []
    assert (await sessions.get_session_view(tenant.id, hostile)).variables == {"k\ufffd": "2", "v?": "4"}
    assert (await sessions.get_session_view(tenant.id, plain)).messages == 1
