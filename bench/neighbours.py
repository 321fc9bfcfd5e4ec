"""The noisy-neighbour run (`make bench ARGS=--neighbours`): tenant B chats at a steady rate, first
alone, then while tenant A sends every hostile load the engine has met, on the same gateway and
session hosts. It reports B's latency and errors in both phases side by side, and what A got.

Tenant A, in a process of its own, for the whole second phase:
- giant schemas: a 180 KB `anyOf` of `{}` (refused by its measure) and schemas of ~900
  subschemas (checked in the worker process), as tools and forms, and forms listed;
- heavy output schemas: its tool's result, a 4,000-item list, checked against a 200-way `anyOf`;
- a version flood: PATCHes of that tool, as fast as the gateway answers (its write rate);
- connection bursts: 1,000 clients at once, each a connection of its own, sending a message.

Four processes: the local model (a stand-in for the model API, which is not the engine's CPU),
the stack (`app.stack.Stack`: embedded Postgres, Ray, the session hosts, the gateway, the demo
store), A's load, and this one measuring B, so that neither load generator's own work shows in
the other's figures. Numbers are reported, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import time
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from bench.stats import percentile, server_timing

#: what tenant A's tool returns: long enough that its output schema needs the worker process
HEAVY_ITEMS = 4_000
HEAVY_OUTPUT = {"type": "object", "properties": {"items": {"type": "array", "items": {
    "anyOf": [{"type": "object", "required": [f"y{i}"]} for i in range(200)]}}}}
GIANT = {"type": "object", "properties": {"a": {"anyOf": [{}] * 60_000}}}  # 180 KB: under the body cap
WIDE = {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 9} for i in range(440)}}
B_TEXT = '/call check_order {"order_id": "12345"}'


# -- the model and the stack, each in a process of its own ----------------------------------------------------

def _model(ready: Any, stop: Any) -> None:
    asyncio.run(_model_async(ready, stop))


async def _model_async(ready: Any, stop: Any) -> None:
    from app.local_model import start_local_model
    from services.logging import configure_logging

    configure_logging(fmt="json", level="warning")  # a log line per request would cost it CPU
    server = await start_local_model("127.0.0.1", 0)
    ready.put(server.url)
    await asyncio.to_thread(stop.wait)
    await server.stop()


def _serve(data_dir: str, model_url: str, ready: Any, stop: Any) -> None:
    from app.cli import as_server

    as_server()  # as `chat-engine run` runs it: the collector's settings, uvloop
    asyncio.run(_serve_async(data_dir, model_url, ready, stop))


async def _serve_async(data_dir: str, model_url: str, ready: Any, stop: Any) -> None:
    from aiohttp import web

    from app.stack import Stack
    from services import heap
    from services.settings import Settings
    from storage.pool import create_pool
    from storage.repos.egress import EgressRepo

    async def items(request: web.Request) -> web.Response:
        return web.json_response({"items": [{"x": "a"}] * HEAVY_ITEMS})

    upstream = web.AppRunner(_app(items), access_log=None)
    await upstream.setup()
    site = web.TCPSite(upstream, "127.0.0.1", 0)
    await site.start()
    upstream_port = upstream.addresses[0][1]
    settings = msgspec.structs.replace(Settings.from_env(), data_dir=data_dir, host="127.0.0.1",
                                       anthropic_base_url=model_url)
    stack = await Stack.start(settings, port=0)
    heap.settle()
    try:
        tenants = stack.gateway.deps.tenants
        a, a_key = await tenants.create_tenant(f"neighbour-a-{random.randrange(10**9)}")
        _, b_key = await tenants.create_tenant(f"neighbour-b-{random.randrange(10**9)}")
        pool = await create_pool(stack.settings.database_url, max_size=1)
        try:  # A's upstream is on loopback, which the guard refuses: an operator allows it, to A alone
            await EgressRepo(pool).allow(a.id, "127.0.0.1/32", upstream_port)
        finally:
            await pool.close()
        ready.put({"url": stack.gateway.url, "a_key": a_key.api_key, "b_key": b_key.api_key,
                   "store": stack.demo_store.url, "upstream": f"http://127.0.0.1:{upstream_port}/items"})
        await asyncio.to_thread(stop.wait)
    finally:
        await stack.stop()
        await upstream.cleanup()


def _app(handler: Any) -> Any:
    from aiohttp import web

    app = web.Application()
    app.router.add_get("/items", handler)
    return app


# -- tenant A -------------------------------------------------------------------------------------------------

#: tenant A's loads, each of which `--neighbours-loads` may pick alone
LOADS = ("schemas", "heavy", "versions", "bursts")


def _hostile(target: dict[str, Any], seconds: float, burst: int, loads: tuple[str, ...], out: Any) -> None:
    # A's clients would be machines of their own: here they share the engine's cores, and their
    # CPU (a thousand client connections opened in Python) is not the engine's to lose
    os.nice(19)
    out.put(asyncio.run(_hostile_async(target, seconds, burst, loads)))


async def _hostile_async(target: dict[str, Any], seconds: float, burst: int,
                         loads: tuple[str, ...] = LOADS) -> dict[str, Any]:
    base, headers = target["url"], {"Authorization": f"Bearer {target['a_key']}"}
    statuses: dict[str, dict[str, int]] = {}
    failures: dict[str, int] = {}
    end = time.monotonic() + seconds

    def count(load: str, status: int | str) -> None:
        statuses.setdefault(load, {}).setdefault(str(status), 0)
        statuses[load][str(status)] += 1

    async def request(http: aiohttp.ClientSession, load: str, method: str, path: str, **kw: Any) -> None:
        try:
            async with http.request(method, base + path, headers=headers, **kw) as r:
                await r.read()
                count(load, r.status)
        except (aiohttp.ClientError, TimeoutError) as exc:
            failures[type(exc).__name__] = failures.get(type(exc).__name__, 0) + 1
            count(load, type(exc).__name__)

    async def schemas(http: aiohttp.ClientSession) -> None:
        i = 0
        while time.monotonic() < end:
            i += 1
            wide = {**WIDE, "properties": {**WIDE["properties"], "n": {"type": "integer", "minimum": i}}}
            await request(http, "giant_schemas", "POST", "/v1/tools", json={
                "name": f"giant_{i}", "description": "d", "webhook_url": target["upstream"], "parameters": GIANT})
            await request(http, "wide_schemas", "POST", "/v1/tools", json={
                "name": f"wide_{i}", "description": "d", "webhook_url": target["upstream"], "parameters": wide})
            await request(http, "wide_schemas", "PUT", f"/v1/forms/wide_{i % 50}", json=wide)
            await request(http, "wide_schemas", "GET", "/v1/forms")

    async def heavy(http: aiohttp.ClientSession, worker: int) -> None:
        n = 0
        while time.monotonic() < end:
            n += 1
            await request(http, "heavy_outputs", "POST", f"/v1/sessions/a-heavy-{worker}-{n % 20}/messages",
                          json={"text": "/call heavy_items {}"})

    async def versions(http: aiohttp.ClientSession) -> None:
        n = 0
        while time.monotonic() < end:
            n += 1
            await request(http, "version_flood", "PATCH", "/v1/tools/heavy_items",
                          json={"description": f"Fetch every item, take {n}.", "publish": n % 10 == 0})

    async def bursts() -> None:
        while time.monotonic() < end - 1:
            connector = aiohttp.TCPConnector(limit=0, force_close=True)
            async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as http:
                await asyncio.gather(*(request(http, "burst", "POST", f"/v1/sessions/a-burst-{i}/messages",
                                               json={"text": "hello"}) for i in range(burst)))
            await asyncio.sleep(max(0.0, min(seconds / 3, end - time.monotonic() - 1)))

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        picked = {"schemas": lambda: [schemas(http)], "versions": lambda: [versions(http)],
                  "bursts": lambda: [bursts()], "heavy": lambda: [heavy(http, w) for w in range(4)]}
        await asyncio.gather(*(c for load in loads for c in picked[load]()))
    return {"statuses": statuses, "connection_failures": failures}


# -- tenant B, measured here --------------------------------------------------------------------------------------

async def _steady(target: dict[str, Any], rate: float, seconds: float, sessions: int) -> dict[str, Any]:
    """B's messages at `rate` a second (open loop) for `seconds`: each one's latency, and errors."""
    headers = {"Authorization": f"Bearer {target['b_key']}"}
    latencies: list[float] = []
    parts: list[tuple[float, dict[str, float]]] = []  # each answer's latency and its Server-Timing
    errors: dict[str, int] = {}

    async def one(http: aiohttp.ClientSession, i: int) -> None:
        started = time.perf_counter()
        try:
            async with http.post(f"{target['url']}/v1/sessions/b-{i % sessions}/messages", headers=headers,
                                 json={"text": B_TEXT}) as r:
                body = await r.read()
                if r.status != 200 or b"shipped" not in body:
                    errors[str(r.status)] = errors.get(str(r.status), 0) + 1
                    return
        except (aiohttp.ClientError, TimeoutError) as exc:
            errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
            return
        latencies.append(ms := (time.perf_counter() - started) * 1000)
        parts.append((ms, server_timing(r.headers.get("Server-Timing", ""))))

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        tasks, start, i = [], time.perf_counter(), 0
        while (now := time.perf_counter() - start) < seconds:
            tasks.append(asyncio.create_task(one(http, i)))
            i += 1
            await asyncio.sleep(max(0.0, i / rate - now))
        await asyncio.gather(*tasks)
    return {"messages": i, **_figures(latencies), "slowest": _slowest(parts), "errors": errors}


def _slowest(parts: list[tuple[float, dict[str, float]]]) -> dict[str, float] | None:
    """Where the slowest 2% of answers spent their time, on average (ms): before the gateway read the
    body (`outside_gateway`: the client, the connection, the gateway's loop), in the gateway and the hop
    to the session host (`gateway_and_hop`), on the host (`host`, of which `gate` waited for durability
    and `share` for a compute slot behind other turns)."""
    worst = sorted(parts, key=lambda p: p[0])[-max(1, len(parts) // 50):] if parts else []
    if not worst:
        return None

    def mean(values: list[float]) -> float:
        return round(sum(values) / len(values), 1)

    return {"answers": len(worst), "total": mean([ms for ms, _ in worst]),
            "outside_gateway": mean([ms - t.get("gateway", 0.0) for ms, t in worst]),
            "gateway_and_hop": mean([t.get("gateway", 0.0) - t.get("host", 0.0) for _, t in worst]),
            "host": mean([t.get("host", 0.0) for _, t in worst]), "gate": mean([t.get("gate", 0.0) for _, t in worst]),
            "share": mean([t.get("share", 0.0) for _, t in worst]), "model": mean([t.get("model", 0.0) for _, t in worst]),
            "upstream": mean([t.get("upstream", 0.0) for _, t in worst])}


def _figures(latencies: list[float]) -> dict[str, Any]:
    def pct(p: float) -> float | None:
        return round(percentile(latencies, p), 1) if latencies else None

    return {"answered": len(latencies), "p50_ms": pct(50), "p99_ms": pct(99)}


async def _setup_tenants(target: dict[str, Any]) -> None:
    """B's order tool (the demo store) and A's heavy tool (its upstream, its output schema)."""
    async with aiohttp.ClientSession() as http:
        for key, body in ((target["b_key"], {
            "name": "check_order", "description": "Look up an order by number.",
            "parameters": {"order_id": {"type": "string", "required": True}},
            "webhook_url": f"{target['store']}/api/orders/{{order_id}}", "auth_header": "Bearer demo-store-key"}),
                (target["a_key"], {"name": "heavy_items", "description": "Fetch every item.", "parameters": {},
                                   "webhook_url": target["upstream"], "output_schema": HEAVY_OUTPUT})):
            async with http.post(f"{target['url']}/v1/tools", headers={"Authorization": f"Bearer {key}"},
                                 json=body) as r:
                if r.status != 201:
                    raise RuntimeError(f"setting up a tenant's tool failed: {r.status} {await r.text()}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    ready, stop, out = context.Queue(), context.Event(), context.Queue()
    model = context.Process(target=_model, args=(ready, stop), daemon=True)
    model.start()
    # not daemonic: the gateway in it starts its own worker process (services/offload.py)
    stack = context.Process(target=_serve, args=(args.data_dir, ready.get(timeout=120), ready, stop))
    stack.start()
    try:
        target = ready.get(timeout=300)
        asyncio.run(_setup_tenants(target))
        asyncio.run(_steady(target, args.neighbours_rate, min(3.0, args.neighbours_seconds), args.neighbours_sessions))
        alone = asyncio.run(_steady(target, args.neighbours_rate, args.neighbours_seconds, args.neighbours_sessions))
        hostile = context.Process(target=_hostile, args=(target, args.neighbours_seconds + 2, args.neighbours_burst,
                                                    tuple(args.neighbours_loads), out),
                                  daemon=True)
        hostile.start()
        time.sleep(1.0)  # A's loads are under way before B is measured again
        together = asyncio.run(_steady(target, args.neighbours_rate, args.neighbours_seconds,
                                       args.neighbours_sessions))
        a = out.get(timeout=args.neighbours_seconds + 300)
        hostile.join(timeout=30)
    finally:
        stop.set()
        stack.join(timeout=120)
        model.join(timeout=10)
        for process in (stack, model):
            if process.is_alive():
                process.terminate()
    ratio = (round(together["p99_ms"] / alone["p99_ms"], 2)
             if together["p99_ms"] and alone["p99_ms"] else None)
    return {"b_alone": alone, "b_with_neighbours": together, "b_p99_ratio": ratio,
            "b_errors_with_neighbours": sum(together["errors"].values()), "a": a,
            "settings": {"rate": args.neighbours_rate, "seconds": args.neighbours_seconds,
                         "sessions": args.neighbours_sessions, "burst": args.neighbours_burst,
                         "loads": list(args.neighbours_loads)}}


def main(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    doc = run(args)
    out = Path(args.data_dir).parent / "bench-neighbours.json" if args.output is None else Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    alone, together = doc["b_alone"], doc["b_with_neighbours"]
    print("| tenant B | messages | answered | p50 ms | p99 ms | errors |")
    print("|---|---|---|---|---|---|")
    for label, part in (("alone", alone), ("with A's loads", together)):
        print(f"| {label} | {part['messages']} | {part['answered']} | {part['p50_ms']} | {part['p99_ms']} | "
              f"{sum(part['errors'].values())} |")
    for label, part in (("alone", alone), ("with A's loads", together)):
        print(f"B's slowest 2% {label} (mean ms): {json.dumps(part['slowest'])}")
    print(f"\nB's p99 with neighbours / alone: {doc['b_p99_ratio']}; A got {json.dumps(doc['a']['statuses'])}")
    print(f"wrote {out} in {time.perf_counter() - started:.0f}s")
    return 0
