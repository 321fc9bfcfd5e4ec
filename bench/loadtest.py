"""`make loadtest`: realistic chat traffic from locust, stepped up until the engine bends.

Target: the stack named by --url/--key, else the one `make run` wrote into .data/demo.env when it
answers /readyz, else a stack started here (embedded Postgres, local Ray, local model, demo store,
the same code path as `chat-engine run`). For the booking and failing-tool scenarios it registers
two webhook tools for the tenant through the API: `lt_book_table` (write, held for approval,
POST to a small bookings backend this process serves on the demo store's loopback address) and
`lt_stock_check` (pointing at a closed port on that address, so every call fails and trips the
breaker). Nothing leaves loopback.

Locust runs headless (bench/locustfile.py) with CSV out under .data/loadtest/; concurrent
sessions step up stage by stage (--stages users:seconds,...), and the knee is the first stage
where p95 latency grew faster than throughput (relative to the stage before). A program that
reports numbers, not a test.

    python -m bench.loadtest [--url URL --key KEY] [--stages 10:20,25:20,...] [--think 0.5:1.5]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from app.stack import Stack
from services.logging import configure_logging
from services.settings import Settings

DEFAULT_STAGES = "10:20,25:20,50:20,100:20,150:20,200:20"
BOOK_TOOL = "lt_book_table"
FAILING_TOOL = "lt_stock_check"
BACKEND_HOST = "127.0.0.2"  # the demo store's loopback address: the only one `make run` allows


# -- a bookings backend for the write tool ------------------------------------------------------

async def start_bookings() -> tuple[web.AppRunner, str]:
    count = 0

    async def book(request: web.Request) -> web.Response:
        nonlocal count
        count += 1
        body = await request.json() if request.can_read_body else {}
        return web.json_response({"booking_id": f"bk-{count}", "status": "confirmed", **body}, status=201)

    app = web.Application()
    app.router.add_post("/api/bookings", book)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, BACKEND_HOST, 0)
    await site.start()
    return runner, f"http://{BACKEND_HOST}:{runner.addresses[0][1]}"


def closed_port(host: str) -> int:
    """A port on `host` with nothing listening (bound, then released)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# -- the target --------------------------------------------------------------------------------------

async def ready(url: str) -> bool:
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as client, \
                client.get(f"{url}/readyz") as r:
            return r.status == 200
    except (aiohttp.ClientError, TimeoutError, OSError):
        return False


def demo_env(data_dir: Path) -> dict[str, str]:
    env_file = data_dir / "demo.env"
    values: dict[str, str] = {}
    if env_file.exists():
        for line in env_file.read_text().splitlines():
            name, _, value = line.partition("=")
            values[name.strip()] = value.strip()
    return values


async def own_stack(data_dir: str) -> Any:
    configure_logging(fmt="json", level="warning")
    env = {k: v for k, v in os.environ.items() if k.startswith(("CE_", "DATABASE_URL", "RAY_"))}
    env.update({"CE_DATA_DIR": data_dir, "CE_LOG_LEVEL": "warning", "CE_LOG_FORMAT": "json"})
    return await Stack.start(Settings.from_env(env), port=0)


async def register_tools(url: str, key: str, bookings_url: str, dead_port: int) -> list[str]:
    """Create (or update) the two load-test tools; returns their names."""
    headers = {"Authorization": f"Bearer {key}"}
    tools = [
        {"name": BOOK_TOOL, "description": "Book a table for the customer. Use when they want a reservation.",
         "parameters": {"party": {"type": "integer", "description": "people", "required": True},
                        "time": {"type": "string", "description": "ISO date and time", "required": True}},
         "webhook_url": f"{bookings_url}/api/bookings", "method": "POST", "mutability": "write",
         "requires_approval": True, "timeout_ms": 5000},
        {"name": FAILING_TOOL, "description": "Check stock of a product (its backend is down in this test).",
         "parameters": {"sku": {"type": "string", "description": "product code", "required": True}},
         "webhook_url": f"http://{BACKEND_HOST}:{dead_port}/api/stock/{{sku}}", "timeout_ms": 1000},
    ]
    async with aiohttp.ClientSession(headers=headers) as client:
        for tool in tools:
            async with client.post(f"{url}/v1/tools", json=tool) as r:
                if r.status == 201:
                    continue
                if r.status != 409:
                    raise SystemExit(f"loadtest: creating tool {tool['name']} failed: HTTP {r.status} {await r.text()}")
            patch = {k: v for k, v in tool.items() if k != "name"}
            async with client.patch(f"{url}/v1/tools/{tool['name']}", json=patch) as r:
                if r.status != 200:
                    raise SystemExit(f"loadtest: updating tool {tool['name']} failed: HTTP {r.status} {await r.text()}")
        async with client.get(f"{url}/v1/tools") as r:
            names = [t["name"] for t in (await r.json()).get("tools", [])]
    return names


async def has_builtin(url: str, key: str, name: str) -> bool:
    """Whether the engine serves a built-in tool (the contract report lists the running catalog)."""
    headers = {"Authorization": f"Bearer {key}"}
    try:
        async with aiohttp.ClientSession(headers=headers) as client, client.get(f"{url}/v1/tools/contract") as r:
            return r.status == 200 and name in await r.text()
    except aiohttp.ClientError:
        return False


# -- locust and the knee ---------------------------------------------------------------------------------

async def run_locust(url: str, key: str, args: argparse.Namespace, out: Path, leads: bool) -> list[dict[str, Any]]:
    stages = args.stages
    stage_file = out / "stages.json"
    think_min, _, think_max = args.think.partition(":")
    env = {**os.environ, "CE_API_KEY": key, "LT_STAGES": stages, "LT_STAGE_FILE": str(stage_file),
           "LT_THINK_MIN": think_min, "LT_THINK_MAX": think_max or think_min,
           "LT_BOOK_TOOL": BOOK_TOOL, "LT_FAILING_TOOL": FAILING_TOOL, "LT_LEADS": "1" if leads else "0"}
    locustfile = Path(__file__).with_name("locustfile.py")
    exe = Path(sys.executable).with_name("locust")
    cmd = [str(exe), "-f", str(locustfile), "--headless", "--host", url, "--csv", str(out / "loadtest"),
           "--csv-full-history", "--only-summary", "--stop-timeout", "30",
           "--loglevel", "WARNING"]
    print(f"locust: {stages} (users:seconds), think {args.think} s, against {url}", file=sys.stderr)
    proc = await asyncio.create_subprocess_exec(*cmd, env=env, stdout=asyncio.subprocess.DEVNULL)
    await proc.wait()
    if not stage_file.exists():
        raise SystemExit(f"loadtest: locust exited with {proc.returncode} and wrote no stage figures")
    return json.loads(stage_file.read_text())


def find_knee(stages: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The first stage whose p95 grew faster than its throughput over the stage before."""
    for before, now in itertools.pairwise(stages):
        if not before["ok_rps"] or not before["p95_ms"]:
            continue
        tput = now["ok_rps"] / before["ok_rps"] - 1
        lat = now["p95_ms"] / before["p95_ms"] - 1
        if lat > tput:
            return {"users": now["users"], "previous_users": before["users"], "throughput_growth": tput,
                    "p95_growth": lat, "sustained_rps": before["ok_rps"], "p95_ms_before": before["p95_ms"]}
    return None


async def main_async(args: argparse.Namespace) -> int:
    data = Path(args.data_dir)
    out = data / "loadtest"
    out.mkdir(parents=True, exist_ok=True)
    stack = None
    url, key = args.url, args.key
    if not (url and key):
        values = demo_env(data)
        if values.get("CE_URL") and values.get("CE_API_KEY") and await ready(values["CE_URL"]):
            url, key = url or values["CE_URL"], key or values["CE_API_KEY"]
            print(f"using the running stack at {url}", file=sys.stderr)
    bookings, bookings_url = await start_bookings()
    try:
        if not (url and key):
            print("no running stack answered; starting one", file=sys.stderr)
            stack = await own_stack(str(data / "loadtest-stack"))
            url, key = stack.gateway.url, stack.demo_key
        await register_tools(url, key, bookings_url, closed_port(BACKEND_HOST))
        leads = await has_builtin(url, key, "collect_lead")
        if not leads:
            print("the engine has no collect_lead built-in: lead capture skipped", file=sys.stderr)
        started = time.perf_counter()
        stages = await run_locust(url, key, args, out, leads)
    finally:
        await bookings.cleanup()
        if stack is not None:
            await stack.stop()
    knee = find_knee(stages)
    print(f"\n{'users':>6} {'req/s':>8} {'ok/s':>8} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'failures':>9} "
          f"{'shed 429':>9}")
    for s in stages:
        print(f"{s['users']:>6} {s['rps']:>8.1f} {s['ok_rps']:>8.1f} {s['p50_ms']:>8.0f} {s['p95_ms']:>8.0f} "
              f"{s['p99_ms']:>8.0f} {s['failures']:>9} {s.get('shed_429', 0):>9}")
    if knee:
        print(f"\nknee at {knee['users']} concurrent sessions: p95 grew {knee['p95_growth']:+.0%} while throughput "
              f"grew {knee['throughput_growth']:+.0%}; {knee['previous_users']} sessions sustained "
              f"{knee['sustained_rps']:.0f} req/s at p95 {knee['p95_ms_before']:.0f} ms")
    else:
        print("\nno knee: throughput kept pace with latency at every stage (step further with --stages)")
    summary = {"target": url, "stages": stages, "knee": knee, "think_s": args.think,
               "elapsed_s": time.perf_counter() - started, "csv": str(out / "loadtest_stats.csv")}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {out}/summary.json and locust's CSVs ({out}/loadtest_*.csv)")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.loadtest", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=os.environ.get("CE_URL"), help="gateway URL (default: .data/demo.env)")
    p.add_argument("--key", default=os.environ.get("CE_API_KEY"), help="tenant API key")
    p.add_argument("--stages", default=DEFAULT_STAGES, help="users:seconds,... concurrent sessions per stage")
    p.add_argument("--think", default="0.5:1.5", help="seconds a contact pauses between messages, min:max")
    p.add_argument("--data-dir", default=".data")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
