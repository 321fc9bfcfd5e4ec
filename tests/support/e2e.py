"""Helpers for the e2e session tests: tools on the demo store, messages with retries, DB reads.

A conversation here is scripted with the local model's `/call <tool> <json>` lines, so which tools
run, in which round, is known in advance and can be checked against Postgres afterwards.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections import Counter
from typing import Any

import aiohttp
from aiohttp import web

from kernel.records import session_uid

NOTED = "order_noted"


async def new_tenant(stack: Any, prefix: str = "e2e") -> tuple[str, str]:
    """A new tenant on the stack's database: (tenant_id, api_key)."""
    from storage.pool import create_pool
    from storage.repos import TenantRepo

    pool = await create_pool(stack.settings.database_url, min_size=1, max_size=1)
    try:
        t, key = await TenantRepo(pool).create_tenant(f"{prefix}-{secrets.token_hex(4)}")
    finally:
        await pool.close()
    return t.id, key.api_key


def call_lines(*calls: tuple[str, dict[str, Any]]) -> str:
    return "\n".join(f"/call {name} {json.dumps(args)}" for name, args in calls)


async def register_order_tools(client: aiohttp.ClientSession, gateway_url: str, headers: dict, store_url: str) -> None:
    """`check_order` (seed 000's example, plain read) and the one-shot `note_order` (completes
    the session variable `order_noted`), both webhooks to the demo store."""
    bodies = [
        {
            "name": "check_order",
            "description": "Look up a customer order by order number. Use when customer asks about their order status.",
            "parameters": {"order_id": {"type": "string", "description": "The order number"}},
            "webhook_url": f"{store_url}/api/orders/{{order_id}}",
            "auth_header": "Bearer e2e-store-key", "timeout_ms": 5000,
        },
        {
            "name": "note_order",
            "description": "Note an order for follow-up, once per conversation. Use when the customer asks to note it.",
            "parameters": {"order_id": {"type": "string", "description": "The order number"}},
            "webhook_url": f"{store_url}/api/orders/{{order_id}}",
            "mutability": "read", "completes_variable": NOTED, "timeout_ms": 5000,
        },
    ]
    for body in bodies:
        async with client.post(f"{gateway_url}/v1/tools", headers=headers, json=body) as r:
            assert r.status == 201, await r.text()


def script(index: int) -> list[tuple[str, list[tuple[str, bool]]]]:
    """The three messages of conversation `index` and the (tool, success) calls each must report.

    1. check an order; 2. note it (one-shot, sets `order_noted`) and check another, in one round;
    3. the same again: note_order is refused in-band as already done, check_order runs.
    """
    a, b = str(10_000 + index), str(20_000 + index)
    note_and_check = call_lines(("note_order", {"order_id": a}), ("check_order", {"order_id": b}))
    return [
        (call_lines(("check_order", {"order_id": a})), [("check_order", True)]),
        (note_and_check, [("note_order", True), ("check_order", True)]),
        (note_and_check, [("note_order", False), ("check_order", True)]),
    ]


#: every scripted turn is one tool round: user, assistant tool_use, user tool_result, assistant text
MESSAGES_PER_TOOL_TURN = 4


class Sent:
    """What a client saw for one message: the acknowledged reply and the failures before it."""

    def __init__(self, session_id: str, message_id: str) -> None:
        self.session_id = session_id
        self.message_id = message_id
        self.reply: dict[str, Any] | None = None
        self.failures: list[tuple[int, str | None, dict[str, Any]]] = []  # status, Retry-After, body


async def post(client: aiohttp.ClientSession, url: str, headers: dict, session_id: str, text: str,
               message_id: str) -> tuple[int, str | None, dict[str, Any]]:
    async with client.post(f"{url}/v1/sessions/{session_id}/messages", headers=headers,
                           json={"text": text, "message_id": message_id}) as r:
        return r.status, r.headers.get("Retry-After"), await r.json(content_type=None)


async def send(client: aiohttp.ClientSession, url: str, headers: dict, session_id: str, text: str,
               message_id: str, *, retries: int = 0, max_wait_s: float = 1.0, sent: Sent | None = None) -> Sent:
    """Send once, and on 503 retry the same message_id (honouring Retry-After, capped) up to
    `retries` times. Anything but 200 or 503 stops at once. `sent` lets a caller watch progress."""
    sent = sent or Sent(session_id, message_id)
    for _ in range(retries + 1):
        status, retry_after, body = await post(client, url, headers, session_id, text, message_id)
        if status == 200:
            sent.reply = body
            return sent
        sent.failures.append((status, retry_after, body))
        if status != 503:
            return sent
        await asyncio.sleep(min(float(retry_after or 1), max_wait_s))
    return sent


def calls_of(reply: dict[str, Any]) -> list[tuple[str, bool]]:
    return [(c["name"], c["success"]) for c in reply["tool_calls"]]


async def db_state(pool: Any, tenant_id: str) -> dict[str, dict[str, Any]]:
    """Per session key of the tenant: uid, epoch, message_count, variables, message seqs,
    tool calls by message_id (Counter of (tool, success)), stored turn message_ids."""
    async with pool.acquire() as conn:
        sessions = await conn.fetch(
            "SELECT id, session_key, epoch, message_count FROM ce_sessions WHERE tenant_id = $1", tenant_id)
        out: dict[str, dict[str, Any]] = {}
        by_uid: dict[str, dict[str, Any]] = {}
        for r in sessions:
            entry = {"uid": r["id"], "epoch": r["epoch"], "message_count": r["message_count"],
                     "variables": {}, "seqs": [], "message_ids": Counter(), "calls": {}, "turns": set()}
            out[r["session_key"]] = entry
            by_uid[r["id"]] = entry
        for r in await conn.fetch(
            "SELECT v.session_id, v.key, v.value FROM ce_session_variables v "
            "JOIN ce_sessions s ON s.id = v.session_id AND s.tenant_id = v.tenant_id WHERE v.tenant_id = $1",
            tenant_id,
        ):
            by_uid[r["session_id"]]["variables"][r["key"]] = r["value"]
        for r in await conn.fetch(
            "SELECT session_id, seq, message_id FROM ce_messages WHERE tenant_id = $1 ORDER BY session_id, seq",
            tenant_id,
        ):
            by_uid[r["session_id"]]["seqs"].append(r["seq"])
            by_uid[r["session_id"]]["message_ids"][r["message_id"]] += 1
        for r in await conn.fetch(
            "SELECT session_id, message_id, tool_name, success FROM ce_tool_calls WHERE tenant_id = $1", tenant_id
        ):
            calls = by_uid[r["session_id"]]["calls"]
            calls.setdefault(r["message_id"], Counter())[(r["tool_name"], r["success"])] += 1
        for r in await conn.fetch("SELECT session_id, message_id FROM ce_turns WHERE tenant_id = $1", tenant_id):
            by_uid[r["session_id"]]["turns"].add(r["message_id"])
    return out


def check_conversations(tenant_id: str, db: dict[str, dict[str, Any]], sent: list[Sent],
                        messages_per_session: int) -> None:
    """Everything acknowledged is in Postgres exactly once and agrees with the replies."""
    by_session: dict[str, list[Sent]] = {}
    for s in sent:
        assert s.reply is not None, (s.session_id, s.message_id, s.failures)
        by_session.setdefault(s.session_id, []).append(s)
    for session_id, turns in by_session.items():
        row = db.get(session_id)
        assert row is not None, f"session {session_id} is not in ce_sessions"
        assert row["uid"] == session_uid(tenant_id, session_id)
        n = messages_per_session * len(turns)
        assert row["message_count"] == n, (session_id, row["message_count"])
        assert row["seqs"] == list(range(n)), (session_id, row["seqs"])
        assert set(row["turns"]) == {t.message_id for t in turns}, session_id
        assert set(row["calls"]) == {t.message_id for t in turns if t.reply["tool_calls"]}, session_id
        for t in turns:
            # each message's rows exactly once: its four history entries and its tool calls
            assert row["message_ids"][t.message_id] == messages_per_session, (session_id, t.message_id)
            assert row["calls"].get(t.message_id, Counter()) == Counter(calls_of(t.reply)), (
                session_id, t.message_id, row["calls"].get(t.message_id), t.reply["tool_calls"])
        noted = any(c == ("note_order", True) for t in turns for c in calls_of(t.reply))
        assert row["variables"] == ({NOTED: "true"} if noted else {}), (session_id, row["variables"])


class HoldingStore:
    """A webhook backend on the allowlisted loopback address that holds every request until
    `release()`; records each request's Idempotency-Key by order id. Lets a test keep tool calls
    in flight inside a host while it kills that host."""

    def __init__(self) -> None:
        self.keys: dict[str, list[str]] = {}
        self.released = asyncio.Event()
        self._arrived = asyncio.Condition()
        self._runner: web.AppRunner | None = None
        self.url = ""

    @property
    def hits(self) -> int:
        return sum(len(v) for v in self.keys.values())

    async def _hold(self, request: web.Request) -> web.Response:
        order_id = request.match_info["order_id"]
        self.keys.setdefault(order_id, []).append(request.headers.get("Idempotency-Key", ""))
        async with self._arrived:
            self._arrived.notify_all()
        await self.released.wait()
        return web.json_response({"order_id": order_id, "held": "released"})

    async def wait_hits(self, n: int, timeout: float = 30.0) -> None:
        async with self._arrived:
            await asyncio.wait_for(self._arrived.wait_for(lambda: self.hits >= n), timeout)

    def release(self) -> None:
        self.released.set()

    async def start(self, host: str) -> HoldingStore:
        app = web.Application()
        app.router.add_get("/hold/{order_id}", self._hold)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, 0)
        await site.start()
        self.url = f"http://{host}:{self._runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        self.release()
        if self._runner is not None:
            await self._runner.cleanup()


async def register_hold_tool(client: aiohttp.ClientSession, gateway_url: str, headers: dict, hold_url: str) -> None:
    body = {
        "name": "hold_order",
        "description": "Reserve stock for an order (the backend answers when it is done).",
        "parameters": {"order_id": {"type": "string", "description": "The order number"}},
        "webhook_url": f"{hold_url}/hold/{{order_id}}", "timeout_ms": 30000,
    }
    async with client.post(f"{gateway_url}/v1/tools", headers=headers, json=body) as r:
        assert r.status == 201, await r.text()
