"""`python -m bench.llm`: what one model call costs, per HTTP transport or per way of calling.

`--compare transports` (the default): the anthropic SDK can send its requests over httpx (its
default) or over aiohttp (`anthropic.DefaultAioHttpClient`, what `make_anthropic_client` uses);
both stream the answer. `--compare calls`: on aiohttp, the answer read as a stream
(`AnthropicLLM.stream`, what a turn watched over SSE does) against the whole answer in one body
(`AnthropicLLM.complete`, what every other turn does). Each pair runs against the local model on
loopback, through `AnthropicLLM` (the engine's adapter), in alternating rounds so that the
machine's drift weighs on both alike. Reported per way and concurrency: the caller's CPU per call
(this thread's CPU time), the model server's CPU per call (psutil, when it was started here)
and the wall time per call, medians over the rounds.

A program that reports numbers, not a test. The local model runs in a process of its own (started
here unless `--url` names one); pin this one to a core (`taskset -c 1`) for steadier figures.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

import anthropic
import psutil

from services.llm.anthropic_client import LOCAL_API_KEY, AnthropicLLM
from services.llm.port import ChatMessage, LLMRequest, TextBlock

TRANSPORTS = ("httpx", "aiohttp")
CALLS = ("stream", "complete")
REQUEST = LLMRequest(
    model="claude-haiku-4-5", max_tokens=256, system="You are Mia, the assistant of Acme Store.",
    messages=[ChatMessage(role="user", content=[TextBlock(text="hello there, how are you?")])],
)


def client_for(transport: str, url: str) -> anthropic.AsyncAnthropic:
    extra = {"http_client": anthropic.DefaultAioHttpClient()} if transport == "aiohttp" else {}
    return anthropic.AsyncAnthropic(api_key=LOCAL_API_KEY, base_url=url, max_retries=0, **extra)


def process_cpu(pid: int | None) -> float:
    """CPU seconds of process `pid` so far (0.0 without one)."""
    if pid is None:
        return 0.0
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


async def timed_calls(llm: AnthropicLLM, call: str, calls: int, concurrency: int, warm: int,
                      server_pid: int | None) -> tuple[float, float, float]:
    """(caller CPU ms, model server CPU ms, wall ms as one client sees it) per call."""
    gate = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with gate:
            if call == "complete":
                await llm.complete(REQUEST)
            else:
                async for _event in llm.stream(REQUEST):
                    pass

    for _ in range(warm):
        await one()
    cpu, server, wall = time.thread_time(), process_cpu(server_pid), time.perf_counter()
    await asyncio.gather(*(one() for _ in range(calls)))
    cpu, server = time.thread_time() - cpu, process_cpu(server_pid) - server
    wall = time.perf_counter() - wall
    return cpu / calls * 1000, server / calls * 1000, wall / calls * concurrency * 1000


async def compare(url: str, compared: str, rounds: int, calls: int, concurrencies: list[int],
                  server_pid: int | None) -> dict[tuple[str, int], list[tuple[float, float, float]]]:
    ways = [(t, t, "stream") for t in TRANSPORTS] if compared == "transports" else [(c, "aiohttp", c) for c in CALLS]
    rows: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    for r in range(rounds):
        for label, transport, call in ways if r % 2 == 0 else reversed(ways):
            for concurrency in concurrencies:
                client = client_for(transport, url)
                try:
                    rows.setdefault((label, concurrency), []).append(
                        await timed_calls(AnthropicLLM(client), call, calls, concurrency, 30, server_pid))
                finally:
                    await client.close()
    return rows


async def main_async(args: argparse.Namespace) -> None:
    server = None
    url = args.url
    if url is None:  # a process of its own, so that its CPU is not the caller's
        server = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "app.local_model", "--port", "0",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
        async with asyncio.timeout(30):
            while url is None:
                line = (await server.stdout.readline()).decode()  # type: ignore[union-attr]
                if not line:
                    raise SystemExit("the local model exited before it listened")
                if line.startswith("local model listening on "):
                    url = line.split()[-1]
    try:
        rows = await compare(url, args.compare, args.rounds, args.calls, args.concurrency,
                             server.pid if server is not None else None)
    finally:
        if server is not None:
            server.terminate()
            await server.wait()
    print(f"{'way':<9} {'clients':>7} {'CPU ms/call':>12} {'range':>13} {'model CPU ms':>13} {'wall ms/call':>13}")
    for (label, concurrency), runs in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        cpu = [c for c, _, _ in runs]
        model = f"{statistics.median(m for _, m, _ in runs):.3f}" if server is not None else "-"
        print(f"{label:<9} {concurrency:>7} {statistics.median(cpu):>12.3f} "
              f"{min(cpu):>6.3f}-{max(cpu):.3f} {model:>13} {statistics.median(w for _, _, w in runs):>13.2f}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.llm", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running local model (python -m app.local_model --port N); "
                   "without it one is started in a process of its own")
    p.add_argument("--compare", choices=("transports", "calls"), default="transports",
                   help="transports: httpx against aiohttp, both streamed; calls: streamed against "
                   "whole answers (complete), both on aiohttp")
    p.add_argument("--rounds", type=int, default=6, help="alternating rounds; figures are medians")
    p.add_argument("--calls", type=int, default=500, help="timed calls per way, concurrency and round")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8],
                   help="calls in flight at once, comma-separated")
    args = p.parse_args(argv)
    try:
        import uvloop
    except ImportError:
        asyncio.run(main_async(args))
    else:
        uvloop.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
