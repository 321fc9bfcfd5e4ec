"""Small HTTP helpers the seed-001 and approval e2e tests share: post (JSON or SSE), register a
tool, write a `/call` line for the local model."""

from __future__ import annotations

import json


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
