"""`python -m bench.flush`: what one group-commit flush costs, one statement against eight.

`SessionRepo.flush` writes a batch as one statement (`_FLUSH`: the lock with the epoch check and
the six tables' writes, one round trip, its own transaction). The batches it cannot take go
statement by statement inside a transaction (BEGIN, the lock, one statement per table, COMMIT),
which was the only way before. Both run here against the embedded Postgres under
`--data-dir` (durable, as the benchmark's), on the same sessions, in alternating rounds so that
the machine's drift weighs on both alike. Each flush carries one one-tool-round turn per session
(four messages, a tool call, a usage row, a stored answer). Reported per batch size and way: this
process's CPU per flush, the Postgres server's CPU per flush (its processes, from /proc) and the
wall time per flush, medians over the rounds.

A program that reports numbers, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import statistics
import sys
import time
from pathlib import Path

import psutil

from bench.measure import postgres_pids
from kernel.records import (
    MessageRecord,
    SessionDelta,
    SessionSnapshot,
    ToolCallRecord,
    TurnRecord,
    UsageDelta,
    session_uid,
)
from storage.embedded import start_embedded
from storage.migrate import migrate
from storage.pool import create_pool
from storage.repos.sessions import (
    SessionRepo,
    _flush_in_one_statement,
    _flush_statement_by_statement,
)

WAYS = ("one statement", "statement by statement")


def server_cpu_s(pgdata: Path) -> float:
    """CPU seconds of the Postgres server so far: its postmaster and its children (the backends)."""
    total = 0.0
    for pid in postgres_pids(pgdata):
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.Error:  # a backend that just ended
            continue
        total += times.user + times.system
    return total


def turn_delta(tenant_id: str, session_id: str, epoch: int, n: int) -> SessionDelta:
    """What one one-tool-round turn leaves to flush (the benchmark's workload)."""
    message_id = f"m{n}"
    text = [{"type": "text", "text": "where is my order 4242? It said it ships today."}]
    return SessionDelta(
        tenant_id=tenant_id, session_id=session_id, epoch=epoch,
        snapshot=SessionSnapshot(message_count=4 * n + 4, completed=[f"check_order:{n}"]),
        messages=[MessageRecord(seq=4 * n + i, role="user" if i % 2 == 0 else "assistant", content=text,
                                message_id=message_id) for i in range(4)],
        tool_calls=[ToolCallRecord(
            id="call_" + secrets.token_hex(8), tenant_id=tenant_id, session_id=session_id, message_id=message_id,
            tool_name="check_order", parameters={"order_id": "4242"}, result={"status": "shipped", "eta": "tomorrow"},
            success=True, latency_ms=3, queue_ms=0)],
        usage=[UsageDelta(model="claude-haiku-4-5", input_tokens=310, output_tokens=42)],
        turns=[TurnRecord(message_id=message_id, response={"reply": "It ships tomorrow.", "tool_rounds": 1})],
    )


async def flush(conn, way: str, deltas: list[SessionDelta]) -> int:
    """One flush the given way; returns how many deltas were written."""
    uids = [session_uid(d.tenant_id, d.session_id) for d in deltas]
    if way == WAYS[0]:
        return sum(await _flush_in_one_statement(conn, deltas, uids))
    async with conn.transaction():
        return sum(await _flush_statement_by_statement(conn, deltas, uids))


async def run(args: argparse.Namespace) -> int:
    server = start_embedded(Path(args.data_dir))
    pool = await create_pool(server.url, min_size=1, max_size=2)
    try:
        await migrate(pool)
        tenant_id = "bench-flush-" + secrets.token_hex(3)
        await pool.execute("INSERT INTO ce_tenants (id, name) VALUES ($1, $1)", tenant_id)
        repo = SessionRepo(pool)
        rows: dict[tuple[int, str], list[tuple[float, float, float]]] = {}
        for size in args.sizes:
            leases = [await repo.activate(tenant_id, f"s{size}-{i}", owner="bench") for i in range(size)]
            n = 0
            async with pool.acquire() as conn:
                for round_no in range(args.rounds):
                    for way in WAYS if round_no % 2 == 0 else WAYS[::-1]:
                        cpu, pg, walls = time.process_time(), server_cpu_s(server.pgdata), []
                        for _ in range(args.flushes):
                            n += 1
                            deltas = [turn_delta(tenant_id, lease.session_id, lease.epoch, n) for lease in leases]
                            started = time.perf_counter()
                            if await flush(conn, way, deltas) != size:
                                raise RuntimeError(f"a flush of {size} sessions was refused in part ({way})")
                            walls.append(time.perf_counter() - started)
                        rows.setdefault((size, way), []).append((
                            (time.process_time() - cpu) / args.flushes * 1000,
                            (server_cpu_s(server.pgdata) - pg) / args.flushes * 1000,
                            statistics.median(walls) * 1000,
                        ))
            print(f"  {size} sessions per flush done", file=sys.stderr)
    finally:
        await pool.close()
        server.stop()
    print(f"{'sessions':>8}  {'way':<22}  {'client CPU ms':>13}  {'Postgres CPU ms':>15}  {'wall p50 ms':>11}")
    for (size, way), found in rows.items():
        client, postgres, wall = (statistics.median(r[i] for r in found) for i in range(3))
        print(f"{size:>8}  {way:<22}  {client:>13.3f}  {postgres:>15.3f}  {wall:>11.3f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.flush", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1,4,16", help="sessions per flush, comma-separated")
    p.add_argument("--rounds", type=int, default=6, help="alternating rounds; figures are medians")
    p.add_argument("--flushes", type=int, default=300, help="flushes per way and round")
    p.add_argument("--data-dir", default=".data/bench-flush", help="the embedded Postgres of this benchmark")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        args.sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    except ValueError:
        p.error("--sizes takes whole numbers separated by commas, e.g. 1,4,16")
    if not args.sizes or min(args.sizes) < 1 or args.rounds < 1 or args.flushes < 1:
        p.error("--sizes, --rounds and --flushes take whole numbers of at least 1")
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
