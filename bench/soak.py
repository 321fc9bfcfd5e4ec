"""`make soak`: mixed chat load for a long time (15 minutes by default) with faults injected on a
schedule, against a stack of its own; prints and writes a summary (.data/soak.json).

Faults: Postgres stopped for 10 s, a session host killed with SIGKILL, malformed model streams,
failing tool backends (timeouts, 500s, garbage) all along. Records lost (acknowledged replies whose
state is not in Postgres) must be 0; so must tools recorded twice for one message.
The building blocks (`StackProcess`, `Contacts`) are also what the fault tests use.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from aiohttp import web

from storage.embedded import start_embedded
from storage.pool import create_pool


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StackProcess:
    """`chat-engine run` in a subprocess with its own data dir, Postgres and Ray."""
    def __init__(self, data: Path | None = None, env: dict[str, str] | None = None) -> None:
        self.extra_env = dict(env or {})
        self.data = data or Path(tempfile.mkdtemp(prefix="ce-stack-"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.headers: dict[str, str] = {}
        self.pg = None

    async def start(self, timeout_s: float = 120) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CE_", "DATABASE_URL", "RAY_ADDRESS"))}
        env.update({"CE_DATA_DIR": str(self.data), "CE_PORT": str(self.port), "CE_SHARDS": "2",
                    "CE_LOG_FORMAT": "json", "CE_LOG_LEVEL": "warning",
                    "CE_TENANT_RATE": "0", "CE_TENANT_CONCURRENCY": "0", **self.extra_env})
        await asyncio.to_thread(self._spawn, env)
        end = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as client:
            while time.monotonic() < end:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the stack exited: {(self.data / 'stack.log').read_text()[-3000:]}")
                try:
                    async with client.get(f"{self.url}/readyz") as r:
                        if r.status == 200 and (self.data / "demo.env").exists():
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.5)
            else:
                raise RuntimeError(f"the stack did not become ready in {timeout_s:.0f} s")
        env_file = dict(line.split("=", 1) for line in (self.data / "demo.env").read_text().split())
        self.headers = {"Authorization": f"Bearer {env_file['CE_API_KEY']}"}

        self.pg = await asyncio.to_thread(start_embedded, self.data)  # attach to its Postgres

    async def stop_postgres(self) -> None:
        await asyncio.to_thread(self.pg.stop)

    async def start_postgres(self) -> None:
        self.pg = await asyncio.to_thread(start_embedded, self.data)

    def _spawn(self, env: dict[str, str]) -> None:
        self._log = open(self.data / "stack.log", "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, "-m", "app.cli", "run"], env=env,
                                     stdout=self._log, stderr=self._log, start_new_session=True)

    def host_pids(self) -> list[int]:
        # pgrep exits 1 when nothing matches: no host running is an answer, not an error
        out = subprocess.run(["pgrep", "-f", "SessionHostActor"], capture_output=True, text=True, check=False).stdout
        return [p for p in map(int, out.split()) if self.proc and _descends_from(p, self.proc.pid)]

    def stop(self) -> None:
        if self.proc is None:
            return
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()


class Contacts:
    """Contacts that retry a message (same message_id) until it is acknowledged."""
    def __init__(self, stack: StackProcess, client: aiohttp.ClientSession) -> None:
        self.stack, self.client = stack, client
        self.acked: dict[str, dict] = {}
        self.statuses: list[int] = []
        self.retries = 0

    async def send(self, session: str, text: str, message_id: str, *, deadline_s: float = 90) -> dict:
        end = time.monotonic() + deadline_s
        while True:
            try:
                async with self.client.post(f"{self.stack.url}/v1/sessions/{session}/messages",
                                            headers=self.stack.headers,
                                            json={"text": text, "message_id": message_id}) as r:
                    self.statuses.append(r.status)
                    body = await r.json(content_type=None)
                    if r.status == 200:
                        self.acked[message_id] = body
                        return body
                    if r.status not in (429, 503):
                        raise AssertionError(f"unexpected {r.status}: {body}")
                    pause = float(r.headers.get("Retry-After", "1"))
            except (TimeoutError, aiohttp.ClientError):
                pause = 0.5
            if time.monotonic() > end:
                raise AssertionError(f"{message_id} was never acknowledged")
            self.retries += 1
            await asyncio.sleep(min(pause, 2.0))


async def lost_records(stack: StackProcess, acked: dict[str, dict]) -> tuple[list[str], list[str]]:
    """(acknowledged message ids missing from ce_turns, message ids with tools recorded twice)."""
    ids = list(acked)
    pool = await create_pool(stack.pg.url, max_size=2)
    try:
        turns = {r["message_id"] for r in await pool.fetch(
            "SELECT message_id FROM ce_turns WHERE message_id = ANY($1)", ids)}
        calls = {r["message_id"]: r["n"] for r in await pool.fetch(
            "SELECT message_id, count(*) AS n FROM ce_tool_calls WHERE message_id = ANY($1) GROUP BY message_id", ids)}
    finally:
        await pool.close()
    missing = sorted(set(ids) - turns)
    doubled = sorted(m for m, reply in acked.items() if calls.get(m, 0) > len(reply["tool_calls"]))
    return missing, doubled


def order_call(n: int) -> str:
    return f'/call check_order {{"order_id": "{n}"}}'


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return False


async def soak(seconds: float, sessions: int) -> dict:
    stack = StackProcess()
    await stack.start()
    faults: list[dict] = []
    backend = web.Application()

    async def flaky(request: web.Request) -> web.Response:
        roll = random.random()
        if roll < 0.3:
            await asyncio.sleep(2)
        if roll < 0.6:
            return web.json_response({"error": "boom"}, status=500)
        return web.Response(text="not json{", content_type="application/json")

    backend.router.add_get("/flaky", flaky)
    runner = web.AppRunner(backend, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.2", 0).start()
    started = time.monotonic()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as client:
            async with client.post(f"{stack.url}/v1/tools", headers=stack.headers, json={
                "name": "flaky_backend", "description": "a backend that fails in every way",
                "parameters": {}, "webhook_url": f"http://127.0.0.2:{runner.addresses[0][1]}/flaky",
                "timeout_ms": 500}) as r:
                assert r.status == 201, await r.text()
            contacts = Contacts(stack, client)
            end = started + seconds
            inputs = 0

            async def contact(i: int) -> None:
                nonlocal inputs
                k = 0
                while time.monotonic() < end:
                    roll = random.random()
                    text = (order_call(i * 1000 + k) if roll < 0.7 else
                            "/call flaky_backend {}" if roll < 0.9 else
                            "/fault malformed-stream\nhello" if roll < 0.95 else "hi there")
                    inputs += 1
                    await contacts.send(f"soak-{i}-{k // 20}", text, f"soak-{i}-{k}")
                    k += 1

            async def chaos() -> None:
                schedule = [("postgres_down_10s", 60), ("kill_host", 120)]
                while time.monotonic() < end - 30:
                    for name, every in schedule:
                        await asyncio.sleep(every / 2)
                        if time.monotonic() >= end - 30:
                            return
                        if name == "postgres_down_10s":
                            await stack.stop_postgres()
                            await asyncio.sleep(10)
                            await stack.start_postgres()
                        else:
                            pids = stack.host_pids()
                            if pids:
                                os.kill(random.choice(pids), signal.SIGKILL)
                        faults.append({"fault": name, "at_s": round(time.monotonic() - started, 1)})

            await asyncio.gather(chaos(), *(contact(i) for i in range(sessions)))
            missing, doubled = await lost_records(stack, contacts.acked)
            elapsed = time.monotonic() - started
            return {
                "seconds": round(elapsed, 1), "sessions": sessions, "inputs_tried": inputs,
                "acknowledged": len(contacts.acked), "msgs_per_s": round(len(contacts.acked) / elapsed, 1),
                "retries": contacts.retries,
                "statuses": {str(s): contacts.statuses.count(s) for s in sorted(set(contacts.statuses))},
                "faults": faults, "records_lost": len(missing), "tools_recorded_twice": len(doubled),
            }
    finally:
        await runner.cleanup()
        stack.stop()


async def overload(stack: StackProcess, client: aiohttp.ClientSession, *, seconds: float = 15,
                   factor: float = 2.0, sessions: int = 400) -> dict:
    """Measure the peak (closed loop, 32 contacts), then offer `factor` times that rate open loop
    for `seconds`: admitted requests, shed ones (429/503) and anything else, with latencies."""
    contacts = Contacts(stack, client)
    done = 0
    stop_at = time.monotonic() + 6

    async def closed(i: int) -> None:
        nonlocal done
        k = 0
        while time.monotonic() < stop_at:
            await contacts.send(f"peak-{i}", order_call(i * 1000 + k), f"peak-{i}-{k}")
            done += 1
            k += 1

    started = time.monotonic()
    await asyncio.gather(*(closed(i) for i in range(32)))
    peak = done / (time.monotonic() - started)
    rate = peak * factor
    results: list[tuple[int, float]] = []
    acked: dict[str, dict] = {}

    async def one(n: int) -> None:
        t0 = time.monotonic()
        message_id = f"ovl-{n}"
        try:
            async with client.post(f"{stack.url}/v1/sessions/ovl-{n % sessions}/messages", headers=stack.headers,
                                   json={"text": order_call(n), "message_id": message_id}) as r:
                body = await r.json(content_type=None)
                if r.status == 200:
                    acked[message_id] = body
                results.append((r.status, time.monotonic() - t0))
        except (TimeoutError, aiohttp.ClientError):
            results.append((0, time.monotonic() - t0))

    tasks = []
    t_start = time.monotonic()
    n = 0
    while time.monotonic() - t_start < seconds:
        tasks.append(asyncio.create_task(one(n)))
        n += 1
        await asyncio.sleep(max(0.0, t_start + n / rate - time.monotonic()))
    await asyncio.gather(*tasks)
    admitted = sorted(lat for status, lat in results if status == 200)

    def pct(p: float) -> float:
        return round(admitted[min(len(admitted) - 1, int(len(admitted) * p))] * 1000, 1) if admitted else 0.0

    statuses: dict[str, int] = {}
    for status, _ in results:
        statuses[str(status)] = statuses.get(str(status), 0) + 1
    missing, doubled = await lost_records(stack, acked)
    return {"peak_msgs_per_s": round(peak, 1), "offered_per_s": round(rate, 1), "offered": len(results),
            "statuses": statuses, "admitted_p50_ms": pct(0.5), "admitted_p99_ms": pct(0.99),
            "records_lost": len(missing), "tools_recorded_twice": len(doubled)}


async def overload_run(seconds: float) -> dict:
    stack = StackProcess(env={"CE_HOST_MAX_INFLIGHT": "32"})
    await stack.start()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as client:
            return await overload(stack, client, seconds=seconds)
    finally:
        stack.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description="long mixed load with scheduled faults")
    parser.add_argument("--seconds", type=float, default=900)
    parser.add_argument("--sessions", type=int, default=50)
    parser.add_argument("--overload", action="store_true",
                        help="instead: measure the peak, then offer twice that rate for --seconds")
    args = parser.parse_args()
    if args.overload:
        result = asyncio.run(overload_run(args.seconds))
        print(json.dumps(result, indent=2))
        Path(".data").mkdir(exist_ok=True)
        Path(".data/overload.json").write_text(json.dumps(result, indent=2))
        sys.exit(1 if result["records_lost"] or set(result["statuses"]) - {"200", "429", "503"} else 0)
    summary = asyncio.run(soak(args.seconds, args.sessions))
    print(json.dumps(summary, indent=2))
    Path(".data").mkdir(exist_ok=True)
    Path(".data/soak.json").write_text(json.dumps(summary, indent=2))
    if summary["records_lost"] or summary["tools_recorded_twice"]:
        sys.exit(1)


if __name__ == "__main__":  # pragma: no cover
    main()
