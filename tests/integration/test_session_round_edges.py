"""Edges of a turn's rounds against real parts: the anthropic SDK and the local model on loopback
(which refuses what the Messages API refuses), and a session host flushing to the test Postgres.

- once no tool may be offered, a request whose history holds tool blocks still defines tools (with
  their use forbidden): the API answers 400 to tool blocks in a request that defines none;
- a tool at its per-message limit is not offered in the turn's next round;
- a call refused for its arguments does not use up a tool's per-conversation limit;
- an answer whose turn is not written yet stays in the session's turn cache, however many turns
  came after it: a retry of its message id is answered from there, never run again.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from actors.host import HostSettings, SessionHost
from actors.session import LLM_DOWN_REPLY, TURN_CACHE, TurnEnv, handle_message, new_state
from app.local_model import LocalModelServer, start_local_model
from kernel.errors import Overloaded
from kernel.records import session_uid
from services.botconfig import BotConfig
from services.llm.anthropic_client import AnthropicLLM, make_anthropic_client
from services.tools.executor import Executor
from services.tools.model import PythonTool
from services.tools.registry import HandlerRegistry, build_catalog
from services.wire import Turn
from storage.errors import StorageUnavailable
from storage.repos import SessionRepo
from tests.support.host_fakes import FakeTenants

MODEL = "claude-haiku-4-5"
OPEN = {"type": "object", "properties": {"q": {"type": "string"}}}
CODE = {"type": "object", "properties": {"q": {"type": "string", "minLength": 3}}, "required": ["q"]}
T = 10.0


@pytest_asyncio.fixture(scope="module")
async def server() -> AsyncIterator[LocalModelServer]:
    srv = await start_local_model()
    try:
        yield srv
    finally:
        await srv.stop()


@pytest_asyncio.fixture
async def llm(server: LocalModelServer) -> AsyncIterator[AnthropicLLM]:
    client = AnthropicLLM(make_anthropic_client("local", server.url, max_retries=0))
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
def ran() -> list[tuple[str, Any]]:
    return []


def env(llm: AnthropicLLM, ran: list, *tools: PythonTool) -> TurnEnv:
    registry = HandlerRegistry()

    @registry.register("ok")
    async def ok(args, ctx):
        ran.append(("ok", args.get("q")))
        return {"status": "done"}

    catalog = build_catalog([], [(t, 1) for t in tools], registry=registry, backend=None)
    return TurnEnv(llm=llm, executor=Executor(), catalog=catalog, config=BotConfig(), main_model=MODEL,
                   cheap_model=MODEL)


@pytest.fixture(params=["json", "stream"])
def emit(request: pytest.FixtureRequest):
    """How the turn asks the model: one JSON body (nobody watches), or a stream (an SSE watcher)."""
    if request.param == "json":
        return None

    async def watch(_event) -> None:
        return None

    return watch


async def turn(state, text: str, message_id: str, turn_env: TurnEnv, emit):
    if emit is None:
        return await handle_message(state, text, message_id, turn_env)
    return await handle_message(state, text, message_id, turn_env, emit)


# -- the model API's rule on tool blocks -------------------------------------------------------


async def test_the_local_model_refuses_tool_blocks_in_a_request_that_defines_no_tools(server):
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 100, "messages": [
        {"role": "user", "content": "where is 7?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "check_order",
                                           "input": {"order_id": "7"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "shipped"}]},
    ]}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{server.url}/v1/messages", json=body) as r:
            assert r.status == 400
            error = (await r.json())["error"]
        assert error["type"] == "invalid_request_error"
        assert "`tool_use` or `tool_result` blocks must define tools" in error["message"]
        # defined, with their use forbidden: answered in text
        body |= {"tools": [{"name": "check_order", "input_schema": {"type": "object"}}],
                 "tool_choice": {"type": "none"}}
        async with http.post(f"{server.url}/v1/messages", json=body) as r:
            assert r.status == 200
            assert [b["type"] for b in (await r.json())["content"]] == ["text"]


async def test_once_the_only_tool_is_used_up_the_round_and_later_turns_are_still_answered(llm, ran, emit):
    lead = PythonTool(name="collect_lead", description="Save the customer as a lead.", parameters=OPEN,
                      handler="ok", mutability="write", requires_approval=False, completes_variable="lead_collected")
    turn_env, state = env(llm, ran, lead), new_state("t", "s")
    first = await turn(state, '/call collect_lead {"q": "ann@example.com"}', "m1", turn_env, emit)
    assert first.tool_calls[0].success and ran == [("ok", "ann@example.com")]
    assert first.rounds == 2 and first.reply != LLM_DOWN_REPLY
    second = await turn(state, "when are you open?", "m2", turn_env, emit)
    assert second.reply != LLM_DOWN_REPLY and second.tool_calls == []
    # the one-shot tool stays unusable: a request to call it is answered in text, nothing runs
    third = await turn(state, '/call collect_lead {"q": "bob@example.com"}', "m3", turn_env, emit)
    assert third.reply != LLM_DOWN_REPLY and third.tool_calls == [] and len(ran) == 1


# -- limits ------------------------------------------------------------------------------------


async def test_a_tool_at_its_per_message_limit_is_not_offered_in_the_next_round(llm, ran, emit):
    # /loop: after each round of results the model calls the same tools again while it may
    lookup = PythonTool(name="lookup", description="Look things up.", parameters=OPEN, handler="ok",
                        max_calls_per_turn=1)
    reply = await turn(new_state("t", "s"), '/loop\n/call lookup {"q": "abc"}', "m1", env(llm, ran, lookup), emit)
    assert ran == [("ok", "abc")]
    assert [c.success for c in reply.tool_calls] == [True]  # never called to be refused
    assert reply.rounds == 2 and reply.reply != LLM_DOWN_REPLY


async def test_a_call_refused_for_its_arguments_leaves_the_per_conversation_limit_unused(llm, ran, emit):
    lookup = PythonTool(name="lookup", description="Look up a code.", parameters=CODE, handler="ok",
                        max_calls_per_session=1)
    turn_env, state = env(llm, ran, lookup), new_state("t", "s")
    first = await turn(state, '/call lookup {"q": "x"}', "m1", turn_env, emit)
    assert "invalid arguments" in first.tool_calls[0].error and ran == []
    second = await turn(state, '/call lookup {"q": "xyz"}', "m2", turn_env, emit)
    assert second.tool_calls[0].success and ran == [("ok", "xyz")]
    third = await turn(state, '/call lookup {"q": "abc"}', "m3", turn_env, emit)  # now it is used up
    assert third.tool_calls == [] and third.reply != LLM_DOWN_REPLY and len(ran) == 1


# -- the turn cache while Postgres is away -----------------------------------------------------


class AwayPostgres:
    """The session store on the test Postgres, which a test can take away (`down`: every call
    raises StorageUnavailable, as the adapter does when Postgres is unreachable; `away_after_lease`:
    down from the end of the next activation on) and whose next flush it can hold before it commits
    (`hold`). `turn_read` is set when a read of a stored answer has returned."""

    def __init__(self, repo: SessionRepo) -> None:
        self.repo = repo
        self.down = False
        self.away_after_lease = False
        self.hold: asyncio.Event | None = None
        self.flush_entered = asyncio.Event()
        self.turn_read = asyncio.Event()

    def _check(self) -> None:
        if self.down:
            raise StorageUnavailable("postgres is away (test): connection refused")

    async def activate(self, tenant_id: str, session_id: str, owner: str):
        self._check()
        activated = await self.repo.activate(tenant_id, session_id, owner)
        self.down = self.down or self.away_after_lease
        return activated

    async def flush(self, deltas):
        self.flush_entered.set()
        if self.hold is not None:
            await self.hold.wait()
        self._check()
        return await self.repo.flush(deltas)

    async def get_turn(self, tenant_id: str, session_id: str, message_id: str):
        self._check()
        stored = await self.repo.get_turn(tenant_id, session_id, message_id)
        self.turn_read.set()
        return stored

    async def recent_turns(self, tenant_id: str, session_id: str, limit: int):
        self._check()
        return await self.repo.recent_turns(tenant_id, session_id, limit)


async def test_a_retry_of_a_turn_not_yet_written_after_many_more_turns_is_answered_not_run_again(pool, make_tenant):
    tenant, _ = await make_tenant("cache")
    store, tenants = AwayPostgres(SessionRepo(pool)), FakeTenants()
    host = SessionHost(name="h1", store=store, tenants=tenants,
                       settings=HostSettings(gate_timeout_s=0.05, max_backoff_s=0.05))
    await host.start()
    try:
        # Postgres goes away once the session is activated: every reply is 503 "not saved, retry
        # with the same message id"
        store.away_after_lease = True
        with pytest.raises(Overloaded):
            await asyncio.wait_for(host.send(Turn(tenant_id=tenant.id, session_id="s1", text="use lookup order-1", message_id="m0")), T)
        assert store.down and tenants.handler_calls == [("s1", "lookup", "order-1")]
        for i in range(1, TURN_CACHE + 1):  # the contact goes on writing meanwhile
            with pytest.raises(Overloaded):
                await asyncio.wait_for(host.send(Turn(tenant_id=tenant.id, session_id="s1", text=f"msg {i}", message_id=f"m{i}")), T)
        # Postgres is back; the flush writing all of it has not committed yet when m0 is retried
        store.hold, store.down = asyncio.Event(), False
        store.flush_entered.clear()
        await asyncio.wait_for(store.flush_entered.wait(), T)
        store.turn_read.clear()
        retry = asyncio.create_task(host.send(Turn(tenant_id=tenant.id, session_id="s1", text="use lookup order-1", message_id="m0")))
        # until it has looked m0 up in Postgres (which holds nothing of it yet), or has its answer
        # and waits for it to be saved (503 when that takes longer than the gate allows)
        read = asyncio.create_task(store.turn_read.wait())
        await asyncio.wait([retry, read], timeout=T, return_when=asyncio.FIRST_COMPLETED)
        read.cancel()
        store.hold.set()
        reply = None
        for _ in range(20):  # as a client told 503 does: the same message id again
            try:
                reply = await asyncio.wait_for(retry, T)
                break
            except Overloaded:
                retry = asyncio.create_task(host.send(Turn(tenant_id=tenant.id, session_id="s1", text="use lookup order-1", message_id="m0")))
        assert tenants.handler_calls == [("s1", "lookup", "order-1")]
        assert reply is not None and reply.replay and reply.reply == "done: " + '{"found":"order-1"}'
        uid = session_uid(tenant.id, "s1")
        assert await pool.fetchval("SELECT count(*) FROM ce_tool_calls WHERE tenant_id = $1 AND session_id = $2",
                                   tenant.id, uid) == 1
        assert (await SessionRepo(pool).get_turn(tenant.id, "s1", "m0"))["reply"] == reply.reply
    finally:
        store.down = False
        if store.hold is not None:
            store.hold.set()
        await asyncio.wait_for(host.stop(), 10)
