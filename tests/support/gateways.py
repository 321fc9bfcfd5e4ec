"""In-process gateways: the real aiohttp app on loopback over the real Postgres repositories,
with the session router faked or a real SessionHost over the unit fakes (no Ray).

- `FakeRouter` answers every turn with one reply; the `gateway` fixture serves a new tenant
  through it; `problem_of` checks a problem+json answer and returns its detail.
- `ScriptedRouter` answers with a scripted reply, error, handoff or timing;
  `scripted_gateway` serves a new tenant through it.
- `documented_gateway`: a gateway over a real SessionHost (LocalRouter) with its /openapi.json,
  whose `documented` checks an answer against the document.
- `OriginGateway`: a tenant's calls and the credentials stored for it, decrypted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer

from actors.host import HostSettings, SessionHost
from actors.local import LocalRouter
from services.gateway.app import build_app
from services.gateway.common import GatewayDeps
from services.tools.crypto import SecretBox, generate_key
from services.wire import (
    ApprovalDecision,
    SessionView,
    StreamEvent,
    ToolCallSummary,
    Turn,
    TurnCommand,
    TurnReply,
    TurnTiming,
    UsageOut,
)
from storage.repos import BotConfigRepo, SessionRepo, TenantRepo, ToolCallRepo, ToolRepo
from storage.repos.jobs import JobRepo
from storage.repos.mcp_servers import McpServerRepo
from tests.support.host_fakes import FakeSessionStore, FakeTenants

PROBLEM_JSON = "application/problem+json"


class FakeRouter:
    """SessionRouter answering every turn with one reply, or raising `raises`."""

    def __init__(self) -> None:
        self.raises: BaseException | None = None
        self.texts: list[str] = []

    async def send(self, turn: Turn, *, new_id=False) -> TurnReply:
        self.texts.append(turn.text)
        if self.raises is not None:
            raise self.raises
        return TurnReply(session_id=turn.session_id, message_id=turn.message_id or "m-1", reply="hello", rounds=1,
                         tool_calls=[ToolCallSummary(id="t1", name="x", success=True, latency_ms=1)],
                         usage=UsageOut())

    async def decide(self, *args, **kw):  # pragma: no cover - not used here
        raise AssertionError("not called")

    async def stream(self, *args, **kw):  # pragma: no cover - not used here
        raise AssertionError("not called")
        yield

    async def view(self, tenant_id, session_id):
        return None

    async def act(self, command) -> TurnReply:
        """Every command done (a chat key's check of a session nobody is bound to passes)."""
        return TurnReply(session_id=command.session_id, message_id="", reply="", tool_calls=[], rounds=0,
                         usage=UsageOut())

    async def watch(self, tenant_id: str, session_id: str, after: int, wait_s: float) -> list:
        """A session where nothing happens: waits, then has nothing new."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.Event().wait(), wait_s)
        return []

    async def stats(self) -> list[dict[str, Any]]:
        return []


def repo_deps(pool, router: Any = None, **extra: Any) -> GatewayDeps:
    """A gateway's deps over the real repositories on `pool`, a FakeRouter unless `router` is
    given, a fresh encryption key; `extra` sets any other field (jobs, egress, metrics_token...)."""
    return GatewayDeps(router=router if router is not None else FakeRouter(), tenants=TenantRepo(pool),
                       tools=ToolRepo(pool), calls=ToolCallRepo(pool), sessions=SessionRepo(pool),
                       configs=BotConfigRepo(pool), secret_box=SecretBox([generate_key()]), **extra)


@pytest_asyncio.fixture
async def gateway(pool, make_tenant) -> AsyncIterator[tuple[TestClient, FakeRouter, dict[str, str]]]:
    router = FakeRouter()
    deps = repo_deps(pool, router)
    _, key = await make_tenant("bad-input")
    async with TestClient(TestServer(build_app(deps), host="127.0.0.1")) as client:
        yield client, router, {"Authorization": f"Bearer {key.api_key}"}


async def problem_of(resp, status: int) -> str:
    """The detail of a problem+json answer with `status`, checked for its shape."""
    text = await resp.text()
    assert (resp.status, resp.content_type) == (status, PROBLEM_JSON), text
    body = json.loads(text)
    assert {"type", "title", "status", "detail"} <= body.keys() and body["status"] == status
    assert "Traceback" not in text and "postgres" not in text.lower(), text
    return body["detail"]


# -- a scripted router --------------------------------------------------------------------------

def reply(session_id: str, message_id: str = "m-1", **kw: Any) -> TurnReply:
    return TurnReply(session_id=session_id, message_id=message_id, reply="hello", rounds=1,
                     tool_calls=[ToolCallSummary(id="t1", name="check_order", success=True, latency_ms=3)],
                     usage=UsageOut(input_tokens=1, output_tokens=1), **kw)


class ScriptedRouter:
    """SessionRouter that answers with a scripted reply or raises a scripted error."""

    def __init__(self) -> None:
        self.raises: BaseException | None = None
        self.handoff = False
        self.timing: TurnTiming | None = None
        self.calls: list[tuple[str, str]] = []
        self.ids: list[tuple[str | None, bool]] = []  # (message_id, new_id) of each send and stream
        self.refuses: BaseException | None = None  # raised by a stream before its first event
        self.hold: asyncio.Event | None = None  # a stream's first event waits for it

    async def send(self, turn: Turn, *, new_id: bool = False) -> TurnReply:
        self.calls.append((turn.tenant_id, turn.session_id))
        self.ids.append((turn.message_id, new_id))
        if self.raises is not None:
            raise self.raises
        return reply(turn.session_id, turn.message_id or "m-1", handoff=self.handoff, timing=self.timing)

    async def decide(self, decision: ApprovalDecision) -> TurnReply:
        return await self.send(Turn(tenant_id=decision.tenant_id, session_id=decision.session_id, text="",
                                    message_id=decision.approval_id))

    async def stream(self, command: TurnCommand, *, new_id: bool = False) -> AsyncIterator[StreamEvent]:
        session_id = command.session_id
        message_id = command.message_id if isinstance(command, Turn) else None
        self.ids.append((message_id, new_id))
        if self.refuses is not None:
            raise self.refuses
        if self.hold is not None:
            await self.hold.wait()
        yield StreamEvent(event="text", data="hel")
        if self.raises is not None:  # as the routers do: the turn's error once the events before it are out
            raise self.raises
        yield StreamEvent(event="done", data=msgspec.to_builtins(
            reply(session_id, message_id or "m-1", timing=self.timing)))

    async def view(self, tenant_id: str, session_id: str) -> SessionView | None:
        return None

    async def stats(self) -> list[dict[str, Any]]:
        raise RuntimeError("host down")


async def scripted_deps(pool, router: ScriptedRouter) -> tuple[GatewayDeps, Any]:
    """The gateway's real repositories over `router`, and a new tenant's key."""
    deps = GatewayDeps(router=router, tenants=TenantRepo(pool), tools=ToolRepo(pool), calls=ToolCallRepo(pool),
                       sessions=SessionRepo(pool), configs=BotConfigRepo(pool), secret_box=SecretBox([generate_key()]))
    _, key = await TenantRepo(pool).create_tenant(f"edges-{id(router)}")
    return deps, key


@pytest_asyncio.fixture
async def scripted_gateway(pool) -> AsyncIterator[tuple[TestClient, ScriptedRouter, dict[str, str]]]:
    router = ScriptedRouter()
    deps, key = await scripted_deps(pool, router)
    async with TestClient(TestServer(build_app(deps), host="127.0.0.1")) as client:
        yield client, router, {"Authorization": f"Bearer {key.api_key}"}


# -- a real session host, and the OpenAPI document ----------------------------------------------

@dataclass
class DocumentedGateway:
    client: TestClient
    deps: GatewayDeps
    host: SessionHost
    store: FakeSessionStore
    headers: dict[str, str]
    tenant_id: str
    doc: dict[str, Any]

    async def documented(self, resp, method: str, path: str) -> None:
        """`resp` (to `method path`, as the document names the path) has a status the document
        lists for that operation, and the content type it lists (none for a body-less status)."""
        op = self.doc["paths"][path][method.lower()]
        status = str(resp.status)
        assert status in op["responses"], (
            f"{method} {path} answered {status}, documented: {sorted(op['responses'])}: {await resp.text()}")
        documented = op["responses"][status].get("content", {})
        ctype = resp.headers.get("Content-Type", "").split(";")[0].strip()
        if documented:
            assert ctype in documented, f"{method} {path} {status} is {ctype!r}, documented {sorted(documented)}"
        else:
            assert await resp.read() == b"", f"{method} {path} {status} has a body, documented none"
        for header in op["responses"][status].get("headers", {}):
            if header in ("Retry-After", "X-Message-Id"):
                assert header in resp.headers, f"{method} {path} {status} lacks its documented {header}"


@pytest_asyncio.fixture
async def documented_gateway(pool, make_tenant) -> AsyncIterator[DocumentedGateway]:
    store = FakeSessionStore()
    host = SessionHost(name="h1", store=store, tenants=FakeTenants(),
                       settings=HostSettings(output_gate=True, gate_timeout_s=0.3))
    await host.start()
    deps = GatewayDeps(router=LocalRouter(host), tenants=TenantRepo(pool), tools=ToolRepo(pool),
                       calls=ToolCallRepo(pool), sessions=SessionRepo(pool), configs=BotConfigRepo(pool),
                       secret_box=SecretBox([generate_key()]), jobs=JobRepo(pool))
    tenant, key = await make_tenant("openapi")
    try:
        async with TestClient(TestServer(build_app(deps), host="127.0.0.1")) as client:
            r = await client.get("/openapi.json")
            assert r.status == 200
            yield DocumentedGateway(client, deps, host, store, {"Authorization": f"Bearer {key.api_key}"}, tenant.id,
                          json.loads(await r.text()))
    finally:
        store.down = False
        if store.hold is not None:
            store.hold.set()
        await asyncio.wait_for(host.stop(), 10)


# -- where credentials go -----------------------------------------------------------------------

@dataclass
class OriginGateway:
    client: TestClient
    headers: dict[str, str]
    tenant_id: str
    box: SecretBox
    pool: Any

    async def call(self, method: str, path: str, body: Any = None) -> tuple[int, dict[str, Any]]:
        async with self.client.request(method, path, headers=self.headers, json=body) as r:
            text = await r.text()
            return r.status, json.loads(text) if text else {}

    async def tool_secret(self, name: str = "order_status") -> str | None:
        enc = (await ToolRepo(self.pool).get(self.tenant_id, name)).definition.get("auth_header_enc")
        return self.box.decrypt(enc) if enc else None

    async def backend(self) -> dict[str, Any]:
        return (await BotConfigRepo(self.pool).get(self.tenant_id) or {}).get("backend") or {}

    async def backend_secret(self) -> str | None:
        enc = (await self.backend()).get("auth_header_enc")
        return self.box.decrypt(enc) if enc else None

    async def mcp_secret(self, name: str = "shop") -> str | None:
        enc = (await McpServerRepo(self.pool).get(self.tenant_id, name)).auth_header_enc
        return self.box.decrypt(enc) if enc else None
