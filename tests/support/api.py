"""The e2e tests' HTTP client of the gateway: `Api`, a tenant's view of it; and small helpers
the seed-001 and approval tests share: post (JSON or SSE), register a tool, write a `/call` line
for the local model."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

PROBLEM_JSON = "application/problem+json"


class Reply(NamedTuple):
    """One answer: its status, its body decoded (JSON when it is JSON, else the text, None when
    empty) and the raw text."""

    status: int
    data: Any
    text: str


class Api:
    """A tenant's view of the gateway at `url`: `auth` is the tenant's API key or the headers to
    send. Every response text is kept in `seen` (to search for leaked secrets afterwards; pass a
    list to share it). `on_error(status, content_type, data)`, when given, checks every answer
    with a status of 400 or more (the tests that check every error's problem+json shape pass it).

    `call` answers (status, data); `get`/`post`/`patch`/`put`/`delete`/`request` answer a `Reply`
    (status, data, text); `expect` answers the data of a call that must answer `expect`; `chat`
    sends a message that must answer 200 and returns the reply."""

    def __init__(self, client, url: str, auth: str | Mapping[str, str], seen: list[str] | None = None, *,
                 on_error: Callable[[int, str, Any], None] | None = None) -> None:
        self.client, self.url = client, url
        self.headers = {"Authorization": f"Bearer {auth}"} if isinstance(auth, str) else dict(auth)
        self.seen = seen if seen is not None else []
        self.on_error = on_error

    async def request(self, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
                      headers: dict[str, str] | None = None) -> Reply:
        kwargs: dict[str, Any] = {"headers": {**self.headers, **(headers or {})}}
        if raw is not None:
            kwargs["data"] = raw
            kwargs["headers"]["Content-Type"] = "application/json"
        elif body is not None:
            kwargs["json"] = body
        async with self.client.request(method, self.url + path, **kwargs) as r:
            text = await r.text()
            self.seen.append(text)
            is_json = r.content_type == "application/json" or r.content_type.endswith("+json")
            data = json.loads(text) if text and is_json else (text or None)
            if r.status >= 400 and self.on_error is not None:
                self.on_error(r.status, r.content_type, data)
            return Reply(r.status, data, text)

    async def call(self, method: str, path: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
        reply = await self.request(method, path, body, **kw)
        return reply.status, reply.data

    async def get(self, path: str, **kw: Any) -> Reply:
        return await self.request("GET", path, **kw)

    async def post(self, path: str, body: Any = None, **kw: Any) -> Reply:
        return await self.request("POST", path, body, **kw)

    async def patch(self, path: str, body: Any = None, **kw: Any) -> Reply:
        return await self.request("PATCH", path, body, **kw)

    async def put(self, path: str, body: Any = None, **kw: Any) -> Reply:
        return await self.request("PUT", path, body, **kw)

    async def delete(self, path: str, **kw: Any) -> Reply:
        return await self.request("DELETE", path, **kw)

    async def expect(self, method: str, path: str, body: Any = None, expect: int = 200) -> Any:
        status, data = await self.call(method, path, body)
        assert status == expect, (status, data)
        return data

    async def chat(self, session_id: str, text: str, **extra: Any) -> dict[str, Any]:
        """`extra`: more fields of the message (`message_id`, ...)."""
        status, reply = await self.call("POST", f"/v1/sessions/{session_id}/messages", {"text": text, **extra})
        assert status == 200, reply
        return reply


async def post(client, url: str, headers: dict, body: dict, *, sse: bool = False):
    """POST `body`; returns (status, json) or, with sse, (status, [(event, data), ...])."""
    h = {**headers, **({"Accept": "text/event-stream"} if sse else {})}
    async with client.post(url, headers=h, json=body) as r:
        if not sse:
            return r.status, await r.json()
        events, event = [], None
        async for raw in r.content:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                events.append((event, json.loads(line[6:])))
        return r.status, events


async def register(client, gw: str, headers: dict, body: dict) -> None:
    status, data = await post(client, f"{gw}/v1/tools", headers, body)
    assert status == 201, data


def call(name: str, args: dict) -> str:
    return f"/call {name} {json.dumps(args)}"


async def read_sse(resp, count: int, timeout: float = 10.0) -> list[tuple[int | None, str, dict]]:
    """The next `count` events of a session's event stream (GET .../events) or of the agents'
    feed: (id, event, data); id None for a feed event, which carries none.
    Comment lines (`: waiting`) and the `retry:` field are skipped; each line is waited for at
    most `timeout` seconds."""
    got: list[tuple[int | None, str, dict]] = []
    fields: dict[str, str] = {}
    while len(got) < count:
        raw = await asyncio.wait_for(resp.content.readline(), timeout)
        if not raw:
            raise ConnectionResetError(f"the stream ended after {len(got)} of {count} events")
        line = raw.decode().rstrip("\n")
        if line == "":
            if "data" in fields:
                got.append((int(fields["id"]) if "id" in fields else None, fields["event"], json.loads(fields["data"])))
            fields = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(": ")
            fields[name] = value
    return got
