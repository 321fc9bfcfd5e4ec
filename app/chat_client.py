"""The terminal client of the gateway (`chat-engine chat`, `chat-engine contract`).

Plain stdlib HTTP in a worker thread: the aiohttp client stays inside the webhook client, and a
terminal client needs nothing faster. The reply streams over SSE; tool calls show as they happen.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import sys
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

from kernel.errors import ChatEngineError
from services.contract_text import format_report


def _connection(url: str) -> tuple[http.client.HTTPConnection, str]:
    parts = urlsplit(url)
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    return cls(parts.hostname, parts.port, timeout=120), parts.path.rstrip("/")


def _send(url: str, method: str, path: str, **request: Any) -> http.client.HTTPResponse:
    """One request to the gateway at `url`. Raises ChatEngineError (the CLI's one-sentence exit)
    when it cannot be reached, saying where it looked."""
    conn, base = _connection(url)
    try:
        conn.request(method, f"{base}{path}", **request)
        return conn.getresponse()
    except OSError as exc:
        raise ChatEngineError(
            f"cannot reach the gateway at {url} ({exc.strerror or exc}); start it with 'make run', or pass "
            "--url (the default is CE_URL in .data/demo.env)") from None


def sse_events(url: str, key: str, session_id: str, text: str) -> Iterator[tuple[str, dict]]:
    """POST one message with Accept: text/event-stream; yield (event, data) as they arrive."""
    body = json.dumps({"text": text, "message_id": uuid.uuid4().hex})
    response = _send(url, "POST", f"/v1/sessions/{session_id}/messages", body=body, headers={
        "Authorization": f"Bearer {key}", "Content-Type": "application/json", "Accept": "text/event-stream",
    })
    if response.status != 200:
        problem = json.loads(response.read() or b"{}")
        yield "error", problem
        return
    event = "message"
    for raw in response:
        line = raw.decode().rstrip("\n")
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            yield event, json.loads(line[6:])
    response.close()


def render(event: str, data: dict, out: Callable[[str], None]) -> None:
    if event == "text":
        out(data["text"])
    elif event == "tool_call":
        out(f"\n  [calling {data['name']}]\n")
    elif event == "tool_result":
        status = "ok" if data.get("success") else f"failed: {data.get('error')}"
        out(f"  [{data['name']} {status}, {data.get('latency_ms')} ms]\n")
    elif event == "approval_required":
        out("\n  [approval required]\n" + "\n".join(f"   - {s}" for s in data.get("summary", [])) + "\n")
    elif event == "client_action":
        out(f"\n  [shown in the app: {data.get('name')}]\n")
    elif event == "done":
        out("\n")
    elif event == "error":
        out(f"\n  error: {data.get('detail') or data.get('message') or data}\n")


async def chat(url: str, key: str, session_id: str) -> None:
    """Read lines from the terminal and stream each reply until EOF or 'exit'."""
    print(f"chatting in session {session_id} on {url} (Ctrl-D to leave)")

    def write(s: str) -> None:
        sys.stdout.write(s)
        sys.stdout.flush()

    while True:
        try:
            text = await asyncio.to_thread(input, "you> ")
        except EOFError:
            print()
            return
        if text.strip() in ("exit", "quit"):
            return
        if not text.strip():
            continue
        write("bot> ")

        def run(t: str = text) -> None:
            for event, data in sse_events(url, key, session_id, t):
                render(event, data, write)

        await asyncio.to_thread(run)


async def print_contract(url: str, key: str) -> None:
    def fetch() -> dict:
        response = _send(url, "GET", "/v1/tools/contract", headers={"Authorization": f"Bearer {key}"})
        body = response.read()
        if response.status != 200:
            try:
                detail = json.loads(body).get("detail")
            except (ValueError, AttributeError):
                detail = None
            raise ChatEngineError(f"the gateway at {url} answered {response.status}: "
                                  f"{detail or body[:200].decode(errors='replace')}")
        return json.loads(body)

    report = await asyncio.to_thread(fetch)
    print(format_report(report))
