"""`make bench`: the actor design's cost, measured side by side in one run (issue 8).

One workload, three ways, the same concurrency:
  (a) inprocess  Runtime + SessionHost driven directly in one process: no Ray, no gateway;
  (b) sharded    HTTP through the gateway to the sharded session hosts (Ray actors);
  (c) dedicated  HTTP through the gateway to one Ray actor per session.
Every message takes one tool round: "where is my order N?" -> model -> `check_order` webhook on
the demo store -> model -> text, with the output gate on; then all again with the gate off (the
gate is fixed when a host is created, so those hosts have their own names: Placement `prefix`).
Then the peak load of (a) and (b): clients at a time doubled (16, 32, 64, ...) while a level beats
the one before it by 5% (each level paired with the one before, round by round), with the group
commit (messages per flush transaction) at each way's peak. Then
(a) and (b) again, open loop at half the lower of the two peaks, for the latency the gateway +
Ray hop adds: one worker sends for (a), for (b) over the hosts' lanes and for (b) through Ray's
task path by turns, slice after slice, so that the machine's drift falls on all three alike. Each
reply's `Server-Timing` (in (a) the reply's own timing) gives the session host's share of a turn,
which splits the added p50 into the hosts' own time and the hop; the machine's busy share is read
around each way's slices. `--growth` measures live sessions 100 -> 1,000 -> 10,000 on one host set.
Last, on the stack's gateway and sharded hosts, live sessions (bench/live.py, from a worker
process): push latency, agent messages at --push-rate to --push-sessions handed-off sessions each
watched by one SSE stream, from the POST to the frame read on the stream; and --idle-watchers idle
SSE watchers held on the gateway, for the resident memory each adds to the gateway and the hosts.

Processes: this one runs the stack (embedded Postgres, local Ray, session hosts, gateways); the
local model and the demo store run in two helper processes (they stand for the model API and the
tenant's backend, so no way shares an event loop with them); the load comes from a worker process
(way a: the worker *is* the engine). CPU per message is the CPU time the engine's processes and
Postgres used during the timed phase (from /proc, so other work on the machine is not counted),
over the messages done; the helpers' CPU is reported beside it. Peak RSS is the largest sum of the
resident memory of the processes a way runs on (a: the worker; b, c: gateway process, Ray's own
daemons, and the session-host actors that way used), sampled every 0.5 s.

    python -m bench.measure [--messages N] [--concurrency C] [--sessions S]
                             [--dedicated-sessions D] [--shards K] [--repeat R] [--growth]
                             [--push-sessions N --push-rate R --push-seconds T | --no-push]
                             [--idle-watchers N]

Writes .data/bench.json in the shape docs/performance.md gives (gate on), with "gate_off", "peak",
"half_load", "detail", "live" and, with --growth, "growth" beside it; keeps the same document as
bench/results/<UTC time>.json and regenerates docs/benchmarks.md from every run kept there
(bench/report.py: the document, its printed table and that page). A program that reports
numbers, not a test.

The engine's modules are imported inside the functions that use them, not at the top: the worker
and helper processes this program starts load only what their part needs, so that way (a)'s
worker, whose memory is way (a)'s peak RSS, holds no gateway or Ray code it does not run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import json
import math
import os
import random
import resource
import statistics
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import msgspec

from bench.live import LiveSpec, per_watcher_kb, raise_open_files, worker_main
from bench.report import (
    RESULTS_DIR,
    TABLE,
    by_process_text,
    ms_text,
    print_table,
    record_run,
    report,
    tail_text,
)
from bench.stats import percentile, server_timing
from services.heap import PAUSES, tune_collector

WAYS = ("inprocess", "sharded", "dedicated")
#: the half-peak run's (b) on hosts of their own with --half-load-variant's settings
VARIANT = "sharded_variant"
ORDER_TEXT = "where is my order {n}?"
HELLO_TEXT = "hello, who are you?"


# =============================================================================================
# load: closed and open loops (run inside the worker process)
# =============================================================================================

#: one message sent and checked: the session host's own time for the turn, of it its wait at the
#: output gate, and the gateway's time from the body read to the reply (the host's time, the lane
#: both ways), in ms (nan when the reply did not say or, in process, there is no gateway), or None
#: when it failed
Times = tuple[float, float, float]
#: one answered turn of an open-loop run: (scheduled send in seconds, latency ms, *Times)
Record = tuple[float, float, float, float, float]
Send = Callable[[str, str], Awaitable[Times | None]]
UNKNOWN: Times = (math.nan, math.nan, math.nan)


def order_text() -> str:
    return ORDER_TEXT.format(n=random.randint(10000, 99999))


def reply_ok(body: dict[str, Any], *, tool_round: bool) -> bool:
    """The workload's shape held: one successful check_order call, two rounds, a reply."""
    if not body.get("reply"):
        return False
    if not tool_round:
        return True
    calls = body.get("tool_calls") or []
    return len(calls) == 1 and bool(calls[0].get("success")) and body.get("rounds") == 2


def sse_done(raw: bytes) -> dict[str, Any] | None:
    """The reply of a streamed turn: its `done` event's data (None when the stream has none)."""
    for chunk in raw.split(b"\n\n"):
        lines = chunk.split(b"\n")
        if lines[0] == b"event: done" and len(lines) > 1 and lines[1].startswith(b"data: "):
            return msgspec.json.decode(lines[1][len(b"data: "):])
    return None


def sessions_per_host(tenant_id: str, sessions: list[str], shards: int) -> list[int]:
    """How many of `sessions` each of `shards` hosts owns (the gateway's routing)."""
    from actors.sharding import rendezvous_index, session_key

    counts = [0] * shards
    for sid in sessions:
        counts[rendezvous_index(session_key(tenant_id, sid), shards)] += 1
    return counts


async def closed_loop(send: Send, sessions: list[str], concurrency: int, total: int, text: Callable[[], str]
                      ) -> dict[str, Any]:
    """`concurrency` clients, each waiting for its reply before sending the next message.

    Client i uses sessions i, i+C, i+2C, ... in turn, so no two clients share a session unless
    there are fewer sessions than clients; with no more messages than sessions, each session gets
    one message.
    """
    latencies: list[float] = []
    errors = 0
    issued = 0

    shared = iter(sessions) if total <= len(sessions) else None  # then: each session once

    async def client(i: int) -> None:
        nonlocal issued, errors
        mine = sessions[i::concurrency] or [sessions[i % len(sessions)]]
        k = 0
        while issued < total:
            issued += 1
            sid = next(shared) if shared is not None else mine[k % len(mine)]
            k += 1
            started = time.perf_counter()
            if await send(sid, text()) is not None:
                latencies.append((time.perf_counter() - started) * 1000)
            else:
                errors += 1

    started = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(concurrency)))
    return _summary(latencies, errors, time.perf_counter() - started)


async def open_loop(send: Send, sessions: list[str], rate: float, total: int, text: Callable[[], str],
                    times: list[Times] | None = None, records: list[Record] | None = None
                    ) -> tuple[list[float], int, float]:
    """Messages sent at a fixed rate whatever the replies do; latency counted from the
    scheduled send time (no coordinated omission). Returns (latencies in ms, errors, seconds);
    the session host's times of each turn that said them go into `times`, and every answered
    turn's scheduled send, latency and times (NaN where unsaid) into `records` (see tail_split)."""
    latencies: list[float] = []
    errors = 0

    async def one(sid: str, due: float) -> None:
        nonlocal errors
        got = await send(sid, text())
        if got is None:
            errors += 1
            return
        latency = (time.perf_counter() - due) * 1000
        latencies.append(latency)
        if times is not None and not math.isnan(got[0]):
            times.append(got)
        if records is not None:
            records.append((due, latency, *got))

    started = time.perf_counter()
    tasks = []
    for k in range(total):
        due = started + k / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(sessions[k % len(sessions)], due)))
    await asyncio.gather(*tasks)
    return latencies, errors, time.perf_counter() - started


def slice_order(ways: list[str], index: int) -> list[str]:
    """The order slice `index` runs the ways in: as given, then reversed, by turns (ABC CBA ...),
    so that no way always follows the same one."""
    return list(ways) if index % 2 == 0 else ways[::-1]


def slice_sizes(total: int, slices: int) -> list[int]:
    """`total` messages cut into `slices` slices as even as they go (the first ones one larger)."""
    return [total // slices + (1 if i < total % slices else 0) for i in range(slices)]


def interleaved_summary(slices: list[dict[str, tuple[list[float], int, float]]], base: str) -> dict[str, Any]:
    """Open-loop runs of several ways taken in turns, slice by slice: (latencies, errors, seconds)
    per way per slice. Per way, the summary of all its slices pooled; per other way, the median
    over slices of its p50 minus `base`'s p50 in the same slice (a paired estimate: a slow minute
    of the machine falls on both sides of each difference; a slice where either side got no
    reply is left out of it, and a way with no such slice gets None). The same for the p99: a
    stall of the machine that falls in one way's slice (the pooled p99 is the slowest 1% of all
    slices: one such stall of a few hundred ms is most of it) moves one slice's difference only."""
    ways = list(slices[0]) if slices else []
    pooled = {w: _summary([x for s in slices for x in s[w][0]], sum(s[w][1] for s in slices),
                          sum(s[w][2] for s in slices)) for w in ways}

    def paired(w: str, p: float) -> float | None:
        diffs = [percentile(s[w][0], p) - percentile(s[base][0], p) for s in slices if s[w][0] and s[base][0]]
        return statistics.median(diffs) if diffs else None

    others = [w for w in ways if w != base]
    return {"ways": pooled, "paired_added_p50_ms": {w: paired(w, 50) for w in others},
            "paired_added_p99_ms": {w: paired(w, 99) for w in others}}


#: turns of a way's tail whose scheduled sends are closer together than this make one burst
TAIL_BURST_S = 0.25


def tail_split(records: list[Record], p: float = 99) -> dict[str, Any] | None:
    """Where a way's slowest turns spent their time. Of `records` (see Record), the slowest
    (100 - p)% of turns, at least one: how many, in how many bursts (runs of them scheduled less
    than TAIL_BURST_S apart: one stall of a process or of the machine makes one burst, a cost that
    some turns pay now and then makes many; when each began), and the medians of their latency, the host's time,
    its wait at the output gate, the hop (latency less the host's time) and the gateway's own part
    (its time less the host's), with the host's share of their summed latency. A figure no reply
    said is None; no records, None."""
    if not records:
        return None
    n = max(1, math.ceil(len(records) * (100 - p) / 100 - 1e-9))
    tail = sorted(records, key=lambda r: r[1])[-n:]
    at = sorted(r[0] for r in tail)
    known = [r for r in tail if not math.isnan(r[2])]

    def median(values: Iterable[float]) -> float | None:
        said = [v for v in values if not math.isnan(v)]
        return statistics.median(said) if said else None

    first = min(r[0] for r in records)
    starts = [at[0], *(y for x, y in itertools.pairwise(at) if y - x >= TAIL_BURST_S)]
    return {
        "turns": n,
        "bursts": len(starts),
        # when each burst began, in seconds from the way's first scheduled send (its first ten)
        "burst_starts_s": [round(t - first, 2) for t in starts[:10]],
        "latency_ms": median(r[1] for r in tail),
        "host_ms": median(r[2] for r in tail),
        "gate_ms": median(r[3] for r in tail),
        "hop_ms": median(r[1] - r[2] for r in tail),
        "gateway_own_ms": median(r[4] - r[2] for r in tail),
        "host_share": sum(r[2] for r in known) / sum(r[1] for r in known) if known else None,
    }


class CpuShare:
    """The machine's CPU time (every core, from /proc/stat via psutil) over the intervals between
    `start()` and `stop()`: the share that was busy and the share the hypervisor gave to other
    guests (`steal`: a run with a large share measured the neighbours)."""

    def __init__(self) -> None:
        self.busy = self.steal = self.total = 0.0
        self._at: tuple[float, float, float] | None = None

    @staticmethod
    def _read() -> tuple[float, float, float]:
        import psutil

        t = psutil.cpu_times()
        total = sum(t[:8])  # guest time is already inside user
        idle = t.idle + getattr(t, "iowait", 0.0)
        steal = getattr(t, "steal", 0.0)
        return total - idle - steal, steal, total

    def start(self) -> CpuShare:
        self._at = self._read()
        return self

    def stop(self) -> CpuShare:
        if self._at is None:
            return self
        busy, steal, total = self._read()
        self.busy += busy - self._at[0]
        self.steal += steal - self._at[1]
        self.total += total - self._at[2]
        self._at = None
        return self

    def percent(self) -> tuple[float, float]:
        """(busy %, steal %) of all the CPU time measured."""
        if self.total <= 0:
            return 0.0, 0.0
        return 100.0 * self.busy / self.total, 100.0 * self.steal / self.total


class ProcessCpu:
    """The CPU time of every process on the machine over the intervals between `start()` and
    `stop()`, summed by label: the ones given (pid -> label: the gateway, the model, the store),
    else the process's name as `ps` shows it (`ray::SessionHostActor`, `raylet`; every Postgres
    backend is `postgres`). Read between the half-load slices, where (b)'s extra busy share of
    the machine goes, process by process. A process that starts or ends inside an interval
    counts from its first read to its last."""

    def __init__(self, labels: dict[int, str]) -> None:
        self.seconds: dict[str, float] = {}
        self._labels = dict(labels)
        self._at: dict[int, float] = {}

    def _label(self, pid: int) -> str:
        label = self._labels.get(pid)
        if label is None:
            name = _process_name(pid)
            label = self._labels[pid] = "postgres" if name.startswith("postgres") else name
        return label

    @staticmethod
    def _read() -> dict[int, float]:
        import psutil

        out = {}
        for p in psutil.process_iter(["cpu_times"]):
            t = p.info["cpu_times"]
            if t is not None:
                out[p.pid] = t.user + t.system
        return out

    def start(self) -> ProcessCpu:
        self._at = self._read()
        return self

    def stop(self) -> ProcessCpu:
        for pid, now in self._read().items():
            used = now - self._at.get(pid, now)
            if used > 0:
                label = self._label(pid)
                self.seconds[label] = self.seconds.get(label, 0.0) + used
        self._at = {}
        return self

    def ms_per_message(self, messages: int, top: int = 8) -> dict[str, float]:
        """The `top` largest labels' CPU ms per message, the rest summed as `other`."""
        ranked = sorted(self.seconds.items(), key=lambda kv: -kv[1])
        out = {k: round(1000 * v / max(messages, 1), 3) for k, v in ranked[:top]}
        rest = sum(v for _, v in ranked[top:])
        if rest:
            out["other"] = round(1000 * rest / max(messages, 1), 3)
        return out


def host_gc_pause_delta(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
                        ) -> dict[str, float]:
    """The shard hosts' collector pauses between two stats reads: the ms paused in total (a host
    seen only after, restarted meanwhile, counts from its start) and the longest pause of the
    last minute any host reports after."""
    total = 0.0
    for host, (now, _) in after.items():
        then = before.get(host, (0.0, 0.0))[0]
        total += now - then if now >= then else now
    longest = max((m for _, m in after.values()), default=0.0)
    return {"total_ms": round(total * 1000, 1), "longest_ms": round(longest * 1000, 1)}


def paired_growth(pairs: list[tuple[float, float]]) -> float | None:
    """The median over rounds of (msgs/s at a level) / (msgs/s at the level before it), each pair
    measured back to back in one round; None without a usable pair."""
    ratios = [cur / before for before, cur in pairs if before > 0]
    return statistics.median(ratios) if ratios else None


def peak_index(growths: list[float | None]) -> int:
    """The peak among levels swept in order, from each level's paired growth over the one before
    it (the first level has none): the last level of the climb, i.e. before the first level that
    did not beat the one before it."""
    peak = 0
    for i, g in enumerate(growths[1:], start=1):
        if g is None or g < 1.0:
            break
        peak = i
    return peak


def _summary(latencies: list[float], errors: int, elapsed: float) -> dict[str, Any]:
    return {
        "messages": len(latencies), "errors": errors, "elapsed_s": elapsed,
        "msgs_per_s": len(latencies) / elapsed if elapsed else 0.0,
        "p50_ms": percentile(latencies, 50), "p95_ms": percentile(latencies, 95),
        "p99_ms": percentile(latencies, 99), "max_ms": max(latencies, default=0.0),
    }


# =============================================================================================
# the worker process: one way's client (and, for way a, the engine itself)
# =============================================================================================

class WorkerSpec(msgspec.Struct, kw_only=True):
    mode: str  # "inprocess" | "http" | "interleaved" (the ways of `way_sessions`, slice by slice)
    sessions: list[str]
    concurrency: int
    messages: int
    rate: float | None = None  # interleaved: open loop at this rate (the other modes: closed loop)
    warm_rounds: int = 1  # messages per session before timing (activation + caches)
    text: str = "order"  # "order" (one tool round) | "hello" (one model round)
    url: str | None = None
    api_key: str | None = None
    tenant_id: str | None = None
    settings: bytes | None = None  # services.settings.Settings as JSON (way a)
    profile: str | None = None  # pyinstrument HTML report of the timed phase here (way a)
    gc_after_warm: str | None = None  # "freeze" | "collect": GC experiments on the warmed worker
    way_sessions: dict[str, list[str]] = {}  # interleaved: way -> its sessions ("inprocess" runs here)
    urls: dict[str, str] = {}  # interleaved: way -> its gateway's URL (every way but "inprocess")
    slices: int = 10  # interleaved: each way's messages are sent in this many slices, ways in turns
    process_labels: dict[int, str] = {}  # interleaved: pid -> label for the CPU by process
    stream: bool = False  # every message a streamed turn: SSE over HTTP, SessionHost.stream in process


async def _worker(spec: WorkerSpec) -> None:
    text = order_text if spec.text == "order" else (lambda: HELLO_TEXT)
    tool_round = spec.text == "order"
    if spec.mode == "interleaved":
        await _interleaved_worker(spec, text, tool_round)
        return
    close: Callable[[], Awaitable[None]]
    stats: Callable[[], dict[str, Any]] = dict
    if spec.mode == "inprocess":
        send, close, stats = await _inprocess_sender(spec, tool_round)
    else:
        send, close = await _http_sender(spec, spec.url or "", tool_round)
    try:
        await _warm(send, spec.sessions, spec.concurrency, spec.warm_rounds, text)
        if spec.gc_after_warm == "freeze":
            gc.freeze()
        elif spec.gc_after_warm == "collect":
            gc.collect()
        _ERRORS.clear()
        _say({"event": "ready", "pid": os.getpid()})
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # "go"
        before = stats()
        profiler = _start_profiler(spec.profile)
        result = await closed_loop(send, spec.sessions, spec.concurrency, spec.messages, text)
        _stop_profiler(profiler, spec.profile)
        after = stats()
        result["host"] = {k: after.get(k, 0) - before.get(k, 0) for k in ("flushes", "flushed_sessions", "gc_collections")}
        result["error_kinds"] = dict(sorted(_ERRORS.items(), key=lambda kv: -kv[1])[:5])
        _say({"event": "done", **result})
    finally:
        await close()


async def _interleaved_worker(spec: WorkerSpec, text: Callable[[], str], tool_round: bool) -> None:
    """Open loop at `spec.rate` for every way of `spec.way_sessions`, in turns: slice after slice,
    each way sends its share of `spec.messages` and waits for its replies before the next way
    starts, so the ways never overlap and drift on the machine weighs on all of them alike."""
    senders: dict[str, Send] = {}
    closers: list[Callable[[], Awaitable[None]]] = []
    try:
        for way in spec.way_sessions:
            if way == "inprocess":
                send, close, _stats = await _inprocess_sender(spec, tool_round)
            else:
                send, close = await _http_sender(spec, spec.urls[way], tool_round)
            senders[way] = send
            closers.append(close)
        for way, sessions in spec.way_sessions.items():
            await _warm(senders[way], sessions, spec.concurrency, spec.warm_rounds, text)
        _ERRORS.clear()
        _say({"event": "ready", "pid": os.getpid()})
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # "go"
        slices = []
        host_slices = []  # the same slices, the session host's own time of each turn
        gates: dict[str, list[float]] = {}  # per way, each turn's wait at the output gate
        in_gateway: dict[str, list[float]] = {}  # per way, each turn's time in the gateway less the host's
        records: dict[str, list[Record]] = {}  # per way, every answered turn (for its tail's split)
        cpu = {way: CpuShare() for way in senders}
        by_process = {way: ProcessCpu({**spec.process_labels, os.getpid(): "load worker"}) for way in senders}
        paused = 0.0  # this process's collector pauses during (a)'s slices (its session code runs here)
        sent = 0
        for index, size in enumerate(slice_sizes(spec.messages, spec.slices)):
            row, host_row = {}, {}
            for way in slice_order(list(senders), index):
                sessions = spec.way_sessions[way]
                turn = sent % len(sessions)  # each slice goes on where the last one stopped
                times: list[Times] = []
                by_process[way].start()
                cpu[way].start()
                paused_before = PAUSES.total_s
                row[way] = await open_loop(senders[way], sessions[turn:] + sessions[:turn], spec.rate or 1.0,
                                           size, text, times=times, records=records.setdefault(way, []))
                if way == "inprocess":
                    paused += PAUSES.total_s - paused_before
                cpu[way].stop()
                by_process[way].stop()
                host_row[way] = ([t[0] for t in times], 0, row[way][2])
                gates.setdefault(way, []).extend(t[1] for t in times)
                in_gateway.setdefault(way, []).extend(
                    t[2] - t[0] for t in times if not (math.isnan(t[0]) or math.isnan(t[2])))
            sent += size
            slices.append(row)
            host_slices.append(host_row)
        result = interleaved_summary(slices, base="inprocess")
        hosts = interleaved_summary(host_slices, base="inprocess")
        result["host_p50_ms"] = {w: v["p50_ms"] for w, v in hosts["ways"].items()}
        result["paired_host_added_p50_ms"] = hosts["paired_added_p50_ms"]
        result["gate_p50_ms"] = {w: percentile(gates.get(w, []), 50) for w in senders}
        result["gateway_own_p50_ms"] = {w: percentile(v, 50) for w, v in in_gateway.items() if v}
        result["busy_pct"] = {w: c.percent()[0] for w, c in cpu.items()}
        result["slice_steal_pct"] = {w: c.percent()[1] for w, c in cpu.items()}
        result["cpu_ms_per_msg_by_process"] = {
            w: c.ms_per_message(sum(len(s[w][0]) for s in slices)) for w, c in by_process.items()}
        result["tail"] = {w: tail_split(v) for w, v in records.items()}
        result["inprocess_gc_pause_ms"] = round(paused * 1000, 1)
        result["slice_p50_ms"] = [{w: percentile(s[w][0], 50) for w in s} for s in slices]
        result["error_kinds"] = dict(sorted(_ERRORS.items(), key=lambda kv: -kv[1])[:5])
        _say({"event": "done", **result})
    finally:
        for close in closers:
            await close()


async def _warm(send: Send, sessions: list[str], concurrency: int, rounds: int, text: Callable[[], str]) -> None:
    """Every session activated and used `rounds` times, never more than `concurrency` at once."""
    gate = asyncio.Semaphore(max(concurrency, 1))
    failures = 0

    async def one(sid: str) -> None:
        nonlocal failures
        async with gate:
            for _ in range(rounds):
                for _attempt in range(5):
                    if await send(sid, text()) is not None:
                        break
                    failures += 1
                    await asyncio.sleep(0.5)

    await asyncio.gather(*(one(s) for s in sessions))
    if failures:
        _say({"event": "warn", "detail": f"{failures} warm-up messages failed and were retried"})


async def _inprocess_sender(spec: WorkerSpec, tool_round: bool):
    from actors.host import HostSettings, SessionHost
    from actors.runtime import Runtime
    from kernel.errors import ChatEngineError
    from services.logging import configure_logging
    from services.settings import Settings
    from services.wire import Turn, TurnReply

    settings = msgspec.json.decode(spec.settings or b"", type=Settings)
    configure_logging(fmt=settings.log_format, level=settings.log_level)
    runtime = await Runtime.open(settings)
    host = SessionHost(
        name="bench-inprocess", store=runtime.sessions, tenants=runtime.tenants, jobs=runtime.jobs,
        settings=HostSettings.from_settings(settings),
    )
    await host.start()
    gc.freeze()  # as the Ray host does after start-up (actors.ray_host): the same treatment both ways
    tenant_id = spec.tenant_id or ""

    async def turn(sid: str, text: str) -> TurnReply:
        command = Turn(tenant_id=tenant_id, session_id=sid, text=text)
        if not spec.stream:
            return await host.send(command)
        done = None
        async for event in host.stream(command):
            if event.event == "error":
                raise ChatEngineError(str(event.data))
            done = event if event.event == "done" else done
        if done is None:
            raise ChatEngineError("the stream ended without its done event")
        return msgspec.convert(done.data, TurnReply)

    async def send(sid: str, text: str) -> Times | None:
        try:
            reply = await turn(sid, text)
        except ChatEngineError as exc:
            _error_sample(f"{type(exc).__name__}: {exc}")
            return None
        body = msgspec.to_builtins(reply)
        if not reply_ok(body, tool_round=tool_round):
            _error_sample(f"unexpected reply: {str(body)[:300]}")
            return None
        return UNKNOWN if reply.timing is None else (reply.timing.host_ms, reply.timing.gate_ms, math.nan)

    async def close() -> None:
        await host.stop()
        await runtime.close()

    return send, close, host.stats


async def _http_sender(spec: WorkerSpec, base: str, tool_round: bool):
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0 if spec.rate else max(spec.concurrency, 1) * 2,
                                     force_close=False)
    client = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120))
    headers = {"Authorization": f"Bearer {spec.api_key}", "Content-Type": "application/json"}
    if spec.stream:
        headers["Accept"] = "text/event-stream"
    encode = msgspec.json.encode
    decode = msgspec.json.decode

    async def send(sid: str, text: str) -> Times | None:
        try:
            async with client.post(f"{base}/v1/sessions/{sid}/messages", data=encode({"text": text}),
                                   headers=headers) as response:
                raw = await response.read()
                if response.status != 200:
                    _error_sample(f"HTTP {response.status}: {raw[:200]!r}")
                    return None
                timing = response.headers.get("Server-Timing", "")
        except (TimeoutError, aiohttp.ClientError) as exc:
            _error_sample(f"{type(exc).__name__}: {exc}")
            return None
        body = decode(raw) if not spec.stream else sse_done(raw)
        if body is None or not reply_ok(body, tool_round=tool_round):
            _error_sample(f"unexpected reply: {raw[:300]!r}")
            return None
        said = server_timing(timing)  # a stream's headers go before its turn ran: none
        return said.get("host", math.nan), said.get("gate", math.nan), said.get("gateway", math.nan)

    async def close() -> None:
        await client.close()

    return send, close


def _start_profiler(path: str | None):
    if not path:
        return None
    from pyinstrument import Profiler

    profiler = Profiler(async_mode="disabled", interval=0.0005)
    profiler.start()
    return profiler


def _stop_profiler(profiler, path: str | None) -> None:
    if profiler is None or not path:
        return
    profiler.stop()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(profiler.output_html())
    Path(path).with_suffix(".txt").write_text(profiler.output_text(unicode=False, color=False))


_ERRORS: dict[str, int] = {}


def _error_sample(text: str) -> None:
    """Count errors by kind (first 80 characters), so a run says why messages failed."""
    key = text[:80]
    _ERRORS[key] = _ERRORS.get(key, 0) + 1
    if sum(_ERRORS.values()) <= 3:
        print(f"  worker error: {text[:300]}", file=sys.stderr, flush=True)


def _say(event: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


# =============================================================================================
# helper backends: the local model and the demo store, each in its own process
# =============================================================================================

async def _backend(kind: str) -> None:
    from services.logging import configure_logging

    configure_logging(fmt="json", level="warning")  # a log line per request would cost the helper CPU
    if kind == "model":
        from app.local_model import start_local_model

        server = await start_local_model("127.0.0.1", 0)
        url = server.url
    else:
        from app.demo_store import start_demo_store
        from app.stack import DEMO_STORE_HOST

        server = await start_demo_store(DEMO_STORE_HOST, 0)
        url = server.url
    _say({"event": "ready", "url": url, "pid": os.getpid()})
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # EOF: stop
    await server.stop()


# =============================================================================================
# process accounting: CPU time and resident memory, from /proc through psutil
# =============================================================================================

class Meter:
    """CPU time and peak RSS of chosen processes over a timed phase, sampled in a thread.

    Sampling runs in the gateway's process during ways b and c, so it is kept cheap: every
    INTERVAL_S, per-process reads; the process sets (a scan of /proc) every REFRESH samples.
    """

    INTERVAL_S = 0.5
    REFRESH = 4

    def __init__(self, cpu_pids: Callable[[], set[int]], rss_pids: Callable[[], set[int]],
                 extra_cpu_pids: Callable[[], set[int]] = set) -> None:
        self._sources = (cpu_pids, extra_cpu_pids, rss_pids)
        self._sets: tuple[set[int], set[int], set[int]] = (set(), set(), set())
        self._samples = 0
        self._procs: dict[int, Any] = {}
        self._start: dict[int, float] = {}
        self._last: dict[int, float] = {}
        self._xstart: dict[int, float] = {}
        self._xlast: dict[int, float] = {}
        self.peak_rss = 0
        self.per_pid: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _proc(self, pid: int) -> Any:
        import psutil

        proc = self._procs.get(pid)
        if proc is None:
            proc = self._procs[pid] = psutil.Process(pid)
        return proc

    def _cpu(self, pids: set[int]) -> dict[int, float]:
        import psutil

        out = {}
        for pid in pids:
            try:
                t = self._proc(pid).cpu_times()
                out[pid] = t.user + t.system
            except psutil.Error:
                continue
        return out

    def _sample(self) -> None:
        import psutil

        if self._samples % self.REFRESH == 0:
            self._sets = tuple(source() for source in self._sources)  # type: ignore[assignment]
        self._samples += 1
        cpu, extra, rss = self._sets
        self._last.update(self._cpu(cpu))
        self._xlast.update(self._cpu(extra))
        total = 0
        for pid in rss:
            try:
                total += self._proc(pid).memory_info().rss
            except psutil.Error:
                continue
        self.peak_rss = max(self.peak_rss, total)

    def _run(self) -> None:
        while not self._stop.wait(self.INTERVAL_S):
            with contextlib.suppress(Exception):  # a sample lost is not worth failing the run
                self._sample()

    def start(self) -> None:
        self._sets = tuple(source() for source in self._sources)  # type: ignore[assignment]
        self._start = self._cpu(self._sets[0])
        self._xstart = self._cpu(self._sets[1])
        self._last = dict(self._start)
        self._xlast = dict(self._xstart)
        self._samples = 1
        self._sample()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> tuple[float, float, float]:
        """(engine CPU seconds, helper CPU seconds, peak RSS MB) since start."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._samples = 0  # a last full refresh: processes started since the last one count too
        self._sample()
        self.per_pid = {pid: v - self._start.get(pid, 0.0) for pid, v in self._last.items()}
        cpu = sum(self.per_pid.values())
        extra = sum(v - self._xstart.get(pid, 0.0) for pid, v in self._xlast.items())
        return cpu, extra, self.peak_rss / 2**20


def rss_mb(pids: set[int]) -> float:
    import psutil

    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            continue
    return total / 2**20


# =============================================================================================
# the orchestrator
# =============================================================================================

def postgres_pids(pgdata: Path | str) -> set[int]:
    """The processes of the Postgres server of `pgdata`: its postmaster and every child (the
    backends); empty when it is not running."""
    import psutil

    try:
        master = psutil.Process(int((Path(pgdata) / "postmaster.pid").read_text().split()[0]))
        return {master.pid, *(c.pid for c in master.children(recursive=True))}
    except (OSError, ValueError, psutil.Error):
        return set()


class Child:
    """A helper or worker process speaking JSON lines on stdout."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.pid = proc.pid

    @classmethod
    async def start(cls, *argv: str, stdin_line: bytes | None = None) -> Child:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.measure", *argv,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )
        child = cls(proc)
        if stdin_line is not None:
            child.write(stdin_line)
        return child

    def drain(self) -> None:
        """Read and drop what the process still prints: a full pipe would block it."""

        async def drain() -> None:
            assert self.proc.stdout is not None
            while await self.proc.stdout.readline():
                pass

        self._drain = asyncio.create_task(drain())

    def write(self, line: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.rstrip(b"\n") + b"\n")

    async def expect(self, event: str, timeout: float = 600.0) -> dict[str, Any]:
        try:
            return await asyncio.wait_for(self._expect(event), timeout)
        except TimeoutError:
            raise RuntimeError(f"benchmark helper {self.pid} sent no {event!r} within {timeout:.0f}s") from None

    async def _expect(self, event: str) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            raw = await self.proc.stdout.readline()
            if not raw:
                code = await self.proc.wait()
                raise RuntimeError(f"benchmark helper {self.pid} exited with {code} before {event!r}")
            try:
                message = json.loads(raw)
            except ValueError:
                continue
            if message.get("event") == "warn":
                print(f"  note: {message['detail']}", file=sys.stderr)
                continue
            if message.get("event") == event:
                return message

    async def close(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(Exception):  # already gone
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 30)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.stack: Any = None
        self.model: Child | None = None
        self.store: Child | None = None
        self.key = ""
        self.tenant_id = ""
        self.settings: Any = None
        self.run_no = 0
        self.gateways: list[Any] = []
        self.pg_seen: set[int] = set()
        self.env: dict[str, str] = {}

    # -- processes ---------------------------------------------------------------------------

    def pg_pids(self) -> set[int]:
        if self.stack is None or self.stack.pg is None:
            return set()
        pids = postgres_pids(self.stack.pg.pgdata)
        self.pg_seen |= pids  # backends of a closed connection are gone when the run is split up
        return pids

    def helper_pids(self) -> set[int]:
        return {c.pid for c in (self.model, self.store) if c is not None}

    def ray_daemon_pids(self, exclude: set[int]) -> set[int]:
        """Processes under this one that are not workers/actors, helpers or Postgres: the Ray
        daemons (gcs, raylet, agents) the actor design brings along."""
        import psutil

        out = set()
        for p in psutil.Process().children(recursive=True):
            try:
                if p.pid in exclude or p.name().startswith("ray::") or " ray::" in " ".join(p.cmdline()[:1]):
                    continue
                if p.name() in ("postgres", "postmaster"):
                    continue
            except psutil.Error:
                continue
            out.add(p.pid)
        return out

    def engine_cpu_pids(self, exclude: set[int]) -> set[int]:
        import psutil

        out = set(self.pg_pids()) | {os.getpid()}
        for p in psutil.Process().children(recursive=True):
            out.add(p.pid)
        return out - exclude - self.helper_pids()

    # -- set-up ------------------------------------------------------------------------------

    async def start(self) -> None:
        from app.stack import DEMO_STORE_HOST, Stack, seed_demo_tenant
        from services.logging import configure_logging
        from services.settings import Settings
        from storage.pool import create_pool
        from storage.repos import TenantRepo

        a = self.args
        configure_logging(fmt="console", level="warning")
        self.model = await Child.start("backend", "model")
        self.store = await Child.start("backend", "store")
        model_url = (await self.model.expect("ready"))["url"]
        store_url = (await self.store.expect("ready"))["url"]
        self.model.drain()
        self.store.drain()
        env = {k: v for k, v in os.environ.items() if k.startswith(("CE_", "DATABASE_URL", "RAY_"))}
        env.update({"CE_DATA_DIR": a.data_dir, "CE_SHARDS": str(a.shards), "CE_LOG_LEVEL": "warning",
                    "CE_LOG_FORMAT": "json", "CE_OUTPUT_GATE": "on",
                    # one tenant carries the whole load here: its fair-share limits would cap it;
                    # and --growth's burst puts 1,000 turns on one host, past its admission limit
                    "CE_TENANT_RATE": "0", "CE_TENANT_CONCURRENCY": "0", "CE_HOST_MAX_INFLIGHT": "2000"})
        self.env = env
        settings = Settings.from_env(env)
        settings = msgspec.structs.replace(
            settings, anthropic_base_url=model_url, anthropic_api_key=None,
            webhook_allow=(*settings.webhook_allow, f"{DEMO_STORE_HOST}/32"),
        )
        started = time.perf_counter()
        if not settings.database_url:
            await asyncio.to_thread(_allow_connections, Path(a.data_dir), 400)
        self.stack = await Stack.start(settings, port=0, seed_demo=False)
        self.settings = self.stack.settings
        pool = await create_pool(self.settings.database_url, min_size=1, max_size=2)
        try:
            self.key = await seed_demo_tenant(pool, self.settings, store_url, Path(a.data_dir))
            tenant = await TenantRepo(pool).tenant_for_key(self.key)
            self.tenant_id = tenant.id
            placement = self.stack.placement
            if placement.shards != a.shards:  # the count an earlier run stored wins over CE_SHARDS
                from storage.repos.cluster import ClusterRepo

                await placement.rescale(a.shards, ClusterRepo(pool))
        finally:
            await pool.close()
        print(f"stack up in {time.perf_counter() - started:.1f}s: gateway {self.stack.gateway.url}, "
              f"{a.shards} session hosts, model {model_url}, store {store_url}", file=sys.stderr)

    async def stop(self) -> None:
        for g in self.gateways:
            with contextlib.suppress(Exception):
                await g.close()
        if self.stack is not None:
            await self.stack.stop()
        for child in (self.model, self.store):
            if child is not None:
                await child.close()

    def variant_settings(self, settings: Any) -> Any:
        """`settings` with what --half-load-variant changes: the fields whose value the variant's
        variables change, read as the engine reads its environment."""
        from services.settings import Settings

        base, changed = Settings.from_env(self.env), Settings.from_env({**self.env, **self.args.half_load_variant})
        fields = {f: getattr(changed, f) for f in msgspec.structs.asdict(changed)
                  if getattr(changed, f) != getattr(base, f)}
        return msgspec.structs.replace(settings, **fields)

    async def gateway_for(self, settings: Any, prefix: str):
        from actors.placement import Placement
        from services.gateway.server import open_gateway

        placement = Placement(settings, prefix=prefix)
        await placement.start_hosts()
        gateway = await open_gateway(settings, placement, port=0)
        self.gateways.append(gateway)
        return placement, gateway

    async def close_gateway(self, gateway: Any) -> None:
        if gateway in self.gateways:
            self.gateways.remove(gateway)
            await gateway.close()

    # -- one measured run ----------------------------------------------------------------------

    async def run_way(self, way: str, gate: bool, *, messages: int | None = None,
                      concurrency: int | None = None) -> dict[str, Any]:
        """One timed closed-loop run of one way."""
        a = self.args
        self.run_no += 1
        tag = f"b{os.getpid()}-{self.run_no}-{way[:3]}-{'on' if gate else 'off'}"
        concurrency = concurrency or a.concurrency
        # at least a session per client: two clients of one session would queue on its lock
        n_sessions = a.dedicated_sessions if way == "dedicated" else max(a.sessions, concurrency)
        sessions = [f"{tag}-{i}" for i in range(n_sessions)]
        spec = WorkerSpec(mode="inprocess" if way == "inprocess" else "http", sessions=sessions,
                          concurrency=concurrency, messages=messages or a.messages,
                          warm_rounds=a.warm_rounds, tenant_id=self.tenant_id, api_key=self.key, stream=a.stream)
        settings = msgspec.structs.replace(self.settings, output_gate=gate)
        placement = None
        gateway = None
        prefix = "" if gate else "gateoff-"
        if way == "inprocess":
            spec.settings = msgspec.json.encode(settings)
            if a.profile_python:
                spec.profile = str(Path(a.profile_python) / f"inprocess-{'on' if gate else 'off'}.html")
        elif way == "sharded":
            if gate:
                placement, spec.url = self.stack.placement, self.stack.gateway.url
            else:  # gate off: hosts of their own
                placement, gateway = await self.gateway_for(settings, prefix)
                spec.url = gateway.url
        else:
            dedicated = msgspec.structs.replace(settings, placement="dedicated", idle_seconds=600.0)
            placement, gateway = await self.gateway_for(dedicated, prefix)
            spec.url = gateway.url
        worker = await Child.start("worker", stdin_line=msgspec.json.encode(spec))
        try:
            await worker.expect("ready")
            if placement is not None:
                stats = await (placement.actor_stats() if way == "dedicated" else placement.stats())
                actor_pids = {s["pid"] for s in stats if s.get("live_sessions")} if way == "dedicated" else {
                    s["pid"] for s in stats}
                before = {s["host"]: s for s in stats}
                rss_set = {os.getpid(), *actor_pids}
                daemons = self.ray_daemon_pids({worker.pid, *self.helper_pids()})
                rss_set |= daemons
                cpu_exclude = {worker.pid}
            else:
                rss_set = {worker.pid}
                cpu_exclude = set()
                before = {}
            meter = Meter(lambda: self.engine_cpu_pids(cpu_exclude), lambda: rss_set, self.helper_pids)
            profiler = self._profile_start(way, gate, placement, worker.pid)
            meter.start()
            stolen = CpuShare().start()
            worker.write(b"go")
            watch = asyncio.create_task(self._watch(placement))
            try:
                done = await worker.expect("done")
            finally:
                watch.cancel()
            cpu, helper_cpu, peak = meter.stop()
            steal = stolen.stop().percent()[1]
            await self._profile_stop(profiler)
        finally:
            await worker.close()
        pg = self.pg_pids() | self.pg_seen
        actors = actor_pids if placement is not None else set()
        split = {"engine": 0.0, "postgres": 0.0, "ray_other": 0.0}
        ray_other: dict[str, float] = {}  # by process name: which of Ray's own processes it is
        for pid, used in meter.per_pid.items():
            kind = ("postgres" if pid in pg else "engine" if pid in actors or pid == os.getpid() or pid == worker.pid
                    else "ray_other")
            split[kind] += used
            if kind == "ray_other":
                name = _process_name(pid)
                ray_other[name] = ray_other.get(name, 0.0) + used
        if placement is not None:
            split["gateway"] = meter.per_pid.get(os.getpid(), 0.0)
        flushes = flushed = collections = 0
        if placement is not None:
            stats = await (placement.actor_stats() if way == "dedicated" else placement.stats())
            for s in stats:
                b = before.get(s["host"], {})
                flushes += s["flushes"] - b.get("flushes", 0)
                flushed += s["flushed_sessions"] - b.get("flushed_sessions", 0)
                collections += s.get("gc_collections", 0) - b.get("gc_collections", 0)
        else:
            flushes, flushed = done["host"]["flushes"], done["host"]["flushed_sessions"]
            collections = done["host"]["gc_collections"]
        if way == "dedicated" or (way == "sharded" and not gate):
            await placement.shutdown_hosts()
            await self.close_gateway(gateway)
        n = max(done["messages"], 1)
        result = {
            "msgs_per_s": done["msgs_per_s"], "p50_ms": done["p50_ms"], "p95_ms": done["p95_ms"],
            "p99_ms": done["p99_ms"], "cpu_s_per_msg": cpu / n, "peak_rss_mb": peak,
            "errors": done["errors"], "messages": done["messages"], "elapsed_s": done["elapsed_s"],
            "helper_cpu_s_per_msg": helper_cpu / n, "flushes": flushes, "steal_pct": steal,
            **{f"cpu_{k}_ms_per_msg": v * 1000 / n for k, v in split.items()},
            "msgs_per_flush": done["messages"] / flushes if flushes else 0.0,
            "sessions_per_flush": flushed / flushes if flushes else 0.0,
            # the session code's processes (hosts, or way a's): the gateway's are not counted
            "gc_per_1k_msgs": collections * 1000 / n,
        }
        if done.get("error_kinds"):
            print(f"  errors: {json.dumps(done['error_kinds'])}", file=sys.stderr)
        label = f"{way:<9} gate {'on ' if gate else 'off'}" + (f" x{concurrency}" if concurrency != a.concurrency else "")
        print(f"  {label}: {result['msgs_per_s']:7.1f} msg/s  p50 {result['p50_ms']:6.1f}  "
              f"p99 {result['p99_ms']:7.1f} ms  cpu {result['cpu_s_per_msg'] * 1000:5.1f} ms/msg  "
              f"rss {peak:6.0f} MB  errors {result['errors']}  msgs/flush {result['msgs_per_flush']:.1f}"
              f"  gc/1k msgs {result['gc_per_1k_msgs']:.1f}  steal {steal:.0f}%",
              file=sys.stderr)
        print("      cpu ms/msg: " + ", ".join(f"{k} {v * 1000 / n:.2f}" for k, v in split.items()), file=sys.stderr)
        result["cpu_ray_other_ms_per_msg_by_process"] = {
            name: used * 1000 / n for name, used in sorted(ray_other.items(), key=lambda kv: -kv[1])}
        print("      ray_other ms/msg: " + ", ".join(
            f"{name} {v:.2f}" for name, v in list(result["cpu_ray_other_ms_per_msg_by_process"].items())[:6]),
            file=sys.stderr)
        return result

    async def run_interleaved(self, rate: float, messages: int) -> dict[str, Any]:
        """The half-peak latency run: open loop at `rate`, gate on, the ways from one worker taking
        turns slice by slice (--half-load-slices): (a) in the worker, (b) through the stack's
        gateway and the hosts' lanes, unless --no-via-ray (b) through a second gateway over the
        same hosts that sends turns on Ray's actor task path (CE_HOST_LANE=off), and with
        --half-load-variant (b) on hosts of their own with those settings. Run one after another, each for
        the whole run, the ways met different machines: a slow minute fell on one of them only
        (README § Performance, runs 6-9). Each way sends `messages` in all."""
        a = self.args
        self.run_no += 1
        tag = f"b{os.getpid()}-{self.run_no}-half"
        settings = msgspec.structs.replace(self.settings, output_gate=True)
        urls = {"sharded": self.stack.gateway.url}
        ray_placement = ray_gateway = None
        if a.via_ray:
            ray_placement, ray_gateway = await self.gateway_for(msgspec.structs.replace(settings, host_lane=False), "")
            urls["sharded_ray"] = ray_gateway.url
        variant = None
        if a.half_load_variant:  # (b) once more, on hosts of their own that run with the given settings
            variant = await self.gateway_for(self.variant_settings(settings), f"variant{self.run_no}-")
            urls[VARIANT] = variant[1].url
        ways = ("inprocess", *urls)
        spec = WorkerSpec(
            mode="interleaved", sessions=[], concurrency=a.concurrency, messages=messages, rate=rate,
            warm_rounds=a.warm_rounds, tenant_id=self.tenant_id, api_key=self.key,
            settings=msgspec.json.encode(settings), urls=urls, slices=a.half_load_slices, stream=a.stream,
            way_sessions={w: [f"{tag}-{w}-{i}" for i in range(max(a.sessions, a.concurrency))] for w in ways},
            process_labels={os.getpid(): "gateway (bench)", **{c.pid: name for c, name in ((self.model, "model"), (self.store, "store")) if c}})
        worker = await Child.start("worker", stdin_line=msgspec.json.encode(spec))
        try:
            await worker.expect("ready")
            paused_before = await self._host_gc_pauses()
            stolen = CpuShare().start()
            worker.write(b"go")
            done = await worker.expect("done")
            steal = stolen.stop().percent()[1]
            done["hosts_gc_pause"] = host_gc_pause_delta(paused_before, await self._host_gc_pauses())
        finally:
            await worker.close()
            if ray_placement is not None:
                ray_placement.close_lanes()
                await self.close_gateway(ray_gateway)
            if variant is not None:
                await variant[0].shutdown_hosts()
                await self.close_gateway(variant[1])
        for way, row in done["ways"].items():
            print(f"  {way.replace('_ray', '/ray'):<11} gate on  @{rate:.0f}/s in {a.half_load_slices} slices: "
                  f"{row['msgs_per_s']:7.1f} msg/s  p50 {row['p50_ms']:6.1f}  p99 {row['p99_ms']:7.1f} ms  "
                  f"errors {row['errors']}  steal {steal:.0f}%", file=sys.stderr)
        print("      p50 minus in process, median over slices: "
              + ", ".join(f"{w} {ms_text(v)}" for w, v in done["paired_added_p50_ms"].items())
              + "; p99 the same way: " + ", ".join(f"{w} {ms_text(v)}" for w, v in done["paired_added_p99_ms"].items()),
              file=sys.stderr)
        print("      the session host's own p50 (of it at the gate): " + ", ".join(
            f"{w} {v:.1f} ({done['gate_p50_ms'][w]:.1f}) ms" for w, v in done["host_p50_ms"].items())
            + "; machine busy while each way ran: "
            + ", ".join(f"{w} {v:.0f}%" for w, v in done["busy_pct"].items()), file=sys.stderr)
        if done.get("gateway_own_p50_ms"):
            print("      in the gateway less the host's time (handler, lane both ways), p50: " + ", ".join(
                f"{w} {v:.1f} ms" for w, v in done["gateway_own_p50_ms"].items()), file=sys.stderr)
        for way, used in done["cpu_ms_per_msg_by_process"].items():
            print(f"      {way}'s CPU ms per message by process: {by_process_text(used)}", file=sys.stderr)
        hosts_gc = done["hosts_gc_pause"]
        print(f"      collector pauses: (a)'s process {done['inprocess_gc_pause_ms']:.1f} ms in its slices; "
              f"the shard hosts {hosts_gc['total_ms']:.1f} ms over the whole run (every way's slices), the longest "
              f"{hosts_gc['longest_ms']:.1f} ms", file=sys.stderr)
        tails = {w: t for w, t in (done.get("tail") or {}).items() if t}
        if tails:
            print("      the slowest 1%, each way: " + "; ".join(
                f"{w} {tail_text(t)}, bursts from {', '.join(f'{b:.1f}' for b in t['burst_starts_s'])} s"
                for w, t in tails.items()), file=sys.stderr)
        # 64 sessions fall on the hosts as their ids hash: rarely evenly, and the host with more
        # of them queues longer (with thousands of sessions the shares even out)
        split = sessions_per_host(self.tenant_id, spec.way_sessions["sharded"], a.shards)
        print(f"      (b)'s {len(spec.way_sessions['sharded'])} sessions per host: "
              + "/".join(map(str, split)), file=sys.stderr)
        if done.get("error_kinds"):
            print(f"  errors: {json.dumps(done['error_kinds'])}", file=sys.stderr)
        return {**done, "steal_pct": steal, "sessions_per_host": split}

    async def _host_gc_pauses(self) -> dict[str, tuple[float, float]]:
        """host -> (collector pause seconds since it started, the longest of its last minute)."""
        return {h["host"]: (h.get("gc_pause_s_total", 0.0), h.get("gc_pause_longest_s", 0.0))
                for h in await self.stack.placement.stats()}

    async def _watch(self, placement: Any) -> None:
        """Say what the hosts are doing when a run takes far longer than it should."""
        while True:
            await asyncio.sleep(30)
            try:
                stats = await asyncio.wait_for(placement.actor_stats(), 10) if placement else []
            except Exception as exc:  # noqa: BLE001
                stats = [repr(exc)]
            print(f"  still running; hosts: {json.dumps(stats, default=str)[:2000]}", file=sys.stderr)

    # py-spy on the gateway process and on one session host, when --profile is given
    def _profile_start(self, way: str, gate: bool, placement: Any, worker_pid: int):
        if not self.args.profile:
            return None
        return asyncio.create_task(self._pyspy(way, gate, placement, worker_pid))

    async def _pyspy(self, way: str, gate: bool, placement: Any, worker_pid: int
                     ) -> list[asyncio.subprocess.Process]:
        if placement is None:  # way a: the worker is the engine
            targets = {"engine": worker_pid}
        else:
            stats = await (placement.actor_stats() if way == "dedicated" else placement.stats())
            targets = {"gateway": os.getpid()}
            if stats:
                targets["host"] = stats[0]["pid"]
        out = Path(self.args.profile)
        return [await self._spy(pid, out / f"{way}-{'on' if gate else 'off'}-{name}.txt")
                for name, pid in targets.items()]

    async def _spy(self, pid: int, path: Path) -> asyncio.subprocess.Process:
        """py-spy recording `pid` into `path` (raw stacks) for --profile-seconds, in the background."""
        import shutil

        path.parent.mkdir(parents=True, exist_ok=True)
        exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        return await asyncio.create_subprocess_exec(
            exe, "record", "--pid", str(pid), "--rate", "200", "--format", "raw", "--nonblocking",
            "--output", str(path), "--duration", str(int(self.args.profile_seconds)),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )

    async def _profile_stop(self, task) -> None:
        if task is None:
            return
        for proc in await task:
            try:
                await asyncio.wait_for(proc.wait(), self.args.profile_seconds + 10)
            except TimeoutError:
                proc.kill()

    # -- the whole comparison ----------------------------------------------------------------------

    async def compare(self) -> dict[str, Any]:
        a = self.args
        ways = [w for w in WAYS if w in a.ways]
        gates = [True] if a.no_gate_off else [True, False]
        runs: dict[bool, dict[str, list[dict[str, Any]]]] = {g: {w: [] for w in ways} for g in gates}
        for r in range(a.repeat):
            print(f"round {r + 1}/{a.repeat}", file=sys.stderr)
            for gate in gates:
                for way in ways:
                    runs[gate][way].append(await self.run_way(way, gate))
        out: dict[str, Any] = {}
        for gate in gates:
            out[gate] = _aggregate(runs[gate])
        peaks = await self.peak_sweep(ways)
        half = {}
        if "inprocess" in ways and "sharded" in ways and not a.no_half_load:
            if a.half_load_rate is not None:
                rate = a.half_load_rate
            else:
                found = (peaks[w]["peak"] if peaks else out[True]["ways"][w] for w in ("inprocess", "sharded"))
                rate = max(1.0, min(f["msgs_per_s"] for f in found) / 2)
            n = max(200, int(rate * a.half_load_seconds))
            # sharded_ray: the same hosts, turns through Ray's task path instead of their lanes
            hruns: dict[str, list[dict[str, Any]]] = {"inprocess": [], "sharded": []}
            if a.via_ray:
                hruns["sharded_ray"] = []
            if a.half_load_variant:
                hruns[VARIANT] = []
            rounds = []
            for _r in range(a.repeat):
                done = await self.run_interleaved(rate, n)
                rounds.append(done)
                for way, rows in hruns.items():
                    rows.append(done["ways"][way])
            hal = {w: _median_ways(v) for w, v in hruns.items()}
            half = {
                "rate_msgs_per_s": rate, "rate_given": a.half_load_rate is not None, "slices": a.half_load_slices,
                "ways": hal,
                "paired_added_p50_ms": _median_known(r["paired_added_p50_ms"]["sharded"] for r in rounds),
                "paired_added_p50_ms_via_ray": _median_known(r["paired_added_p50_ms"].get("sharded_ray") for r in rounds),
                # the p99 the same way: each slice's (b) p99 minus (a)'s, the median over slices and rounds' medians
                "paired_added_p99_ms": _median_known(r["paired_added_p99_ms"]["sharded"] for r in rounds),
                # of the paired figure: the session host's own time of the turn, (b)'s minus (a)'s
                "paired_host_added_p50_ms": _median_known(r["paired_host_added_p50_ms"]["sharded"] for r in rounds),
                "busy_pct": {w: statistics.median(r["busy_pct"][w] for r in rounds) for w in hruns},
                # where each way's busy share went, process by process: medians over rounds
                "cpu_ms_per_msg_by_process": {w: _median_by_label([r["cpu_ms_per_msg_by_process"][w] for r in rounds])
                                              for w in hruns},
                # collector pauses per round: (a)'s process in its slices; the hosts over the whole run
                "gc_pause_ms": [{"inprocess": r["inprocess_gc_pause_ms"], "hosts": r["hosts_gc_pause"]["total_ms"],
                                 "hosts_longest": r["hosts_gc_pause"]["longest_ms"]} for r in rounds],
                "rounds": rounds,
                "added_p50_ms": hal["sharded"]["p50_ms"] - hal["inprocess"]["p50_ms"],
                "added_p99_ms": hal["sharded"]["p99_ms"] - hal["inprocess"]["p99_ms"],
                "gate_p50_ms": {w: statistics.median(r["gate_p50_ms"][w] for r in rounds) for w in hruns},
                # each way's slowest 1%, split: the median over rounds of each figure
                "tail": {w: _median_tail([(r.get("tail") or {}).get(w) for r in rounds]) for w in hruns},
                # of the hop: the gateway's own part (its time less the host's: handler, lane both ways)
                "gateway_own_p50_ms": {
                    w: statistics.median(r["gateway_own_p50_ms"][w] for r in rounds)
                    for w in hruns if all(w in r.get("gateway_own_p50_ms", {}) for r in rounds)
                },
            }
            if a.via_ray:
                half["added_p50_ms_via_ray"] = hal["sharded_ray"]["p50_ms"] - hal["inprocess"]["p50_ms"]
                half["added_p99_ms_via_ray"] = hal["sharded_ray"]["p99_ms"] - hal["inprocess"]["p99_ms"]
            if a.half_load_variant:
                half["variant"] = {
                    "env": a.half_load_variant,
                    "paired_added_p50_ms": _median_known(r["paired_added_p50_ms"][VARIANT] for r in rounds),
                    "paired_host_added_p50_ms": _median_known(r["paired_host_added_p50_ms"][VARIANT] for r in rounds),
                    "added_p99_ms": hal[VARIANT]["p99_ms"] - hal["inprocess"]["p99_ms"],
                    "paired_added_p99_ms": _median_known(r["paired_added_p99_ms"][VARIANT] for r in rounds),
                }
        return {"gate_on": out[True], "gate_off": out.get(False), "half_load": half, "peak": peaks, "runs": {
            "gate_on": runs[True], "gate_off": runs.get(False)}}

    async def peak_sweep(self, ways: list[str]) -> dict[str, Any]:
        """Peak load of (a) and (b), gate on: more clients at a time (--peak-concurrency) while a
        level beats the one before it by 5%. Each level is measured against the one before it
        pair by pair: every round runs both, back to back (in turns: before-this, this-before), so a
        machine that slows between rounds moves both sides of each ratio (run 27: one way's 64-
        client rounds gave 630, 404 and 394 msgs/s within minutes). A level's growth is the median
        over rounds of its msgs/s over the level before it; the peak is the last level that beat
        the one before it (`peak_index`). Each point's figures are medians of all its runs; the
        group-commit figure is read at each way's peak."""
        a = self.args
        if a.no_peak:
            return {}
        sweep = [w for w in ("inprocess", "sharded") if w in ways]
        levels = a.peak_concurrency
        runs: dict[str, dict[int, list[dict[str, Any]]]] = {w: {} for w in sweep}
        growth: dict[str, list[float | None]] = {w: [] for w in sweep}
        open_ways = set(sweep)
        for k, c in enumerate(levels):
            if not open_ways:
                break
            before = levels[k - 1] if k else None
            pairs: dict[str, list[tuple[float, float]]] = {w: [] for w in open_ways}
            for r in range(a.repeat):
                order = [c] if before is None else ([before, c] if r % 2 == 0 else [c, before])
                got: dict[tuple[str, int], float] = {}
                for level in order:
                    for way in sweep:
                        if way in open_ways:
                            row = await self.run_way(way, True, concurrency=level)
                            runs[way].setdefault(level, []).append(row)
                            got[way, level] = row["msgs_per_s"]
                if before is not None:
                    for way, mine in pairs.items():
                        mine.append((got[way, before], got[way, c]))
            for way, mine in pairs.items():
                g = paired_growth(mine) if before is not None else None
                growth[way].append(g)
                if g is not None and g < 1.05:
                    open_ways.discard(way)
        out = {}
        for way in sweep:
            points = []
            for level, g in zip(levels, growth[way], strict=False):
                med = _median_ways(runs[way][level])
                points.append({"concurrency": level, "runs": len(runs[way][level]), "growth": g, **{k: med[k] for k in (
                    "msgs_per_s", "p50_ms", "p99_ms", "cpu_s_per_msg", "msgs_per_flush", "errors")}})
            out[way] = {"points": points, "peak": points[peak_index(growth[way])]}
        return out

    # -- live sessions --------------------------------------------------------------------------------

    async def live(self) -> dict[str, Any] | None:
        """Push latency and idle watchers (bench/live.py) on the stack's gateway and sharded hosts,
        unless --no-push and --idle-watchers 0."""
        a = self.args
        out: dict[str, Any] = {}
        if a.push:
            out["push"] = await self.push_latency()
        if a.idle_watchers > 0:
            out["idle"] = await self.idle_watchers()
        return out or None

    async def push_latency(self) -> dict[str, Any]:
        """--push-sessions sessions handed off and watched, then --push-rate agent messages a
        second for --push-seconds, open loop: how long each took from its POST to its watcher."""
        a = self.args
        self.run_no += 1
        tag = f"b{os.getpid()}-{self.run_no}-push"
        spec = LiveSpec(mode="push", url=self.stack.gateway.url, api_key=self.key,
                        sessions=[f"{tag}-{i}" for i in range(a.push_sessions)],
                        rate=a.push_rate, seconds=a.push_seconds)
        placement = self.stack.placement
        worker = await Child.start("live", stdin_line=msgspec.json.encode(spec))
        try:
            ready = await worker.expect("ready")
            watched = sum(s.get("watched_sessions", 0) for s in await placement.stats())
            print(f"push: {ready['handed_off']} of {ready['sessions']} sessions handed off in {ready['handoff_s']:.1f}s, "
                  f"{ready['watchers']} watchers connected in {ready['connect_s']:.1f}s "
                  f"({watched} sessions watched at the hosts)", file=sys.stderr)
            cpu = ProcessCpu({os.getpid(): "gateway (bench)", worker.pid: "client"})
            busy = CpuShare().start()
            cpu.start()
            worker.write(b"go")
            done = await worker.expect("done", timeout=600 + a.push_seconds)
            cpu.stop()
            busy.stop()
        finally:
            await worker.close()
        done.pop("event", None)
        done["watched_sessions_at_hosts"] = watched
        done["hosts_released_s"], done["watched_after_close"] = await self._hosts_let_go()
        done["busy_pct"], done["steal_pct"] = busy.percent()
        done["cpu_ms_per_push_by_process"] = cpu.ms_per_message(done["pushes"])
        print(f"  push @{a.push_rate:.0f}/s to {done['watchers']} watched sessions: {done['arrived']} of "
              f"{done['pushes']} arrived, p50 {done['p50_ms']:.1f} ms, p99 {done['p99_ms']:.1f} ms "
              f"(max {done['max_ms']:.1f}; the POST's own p50 {done['post_p50_ms']:.1f}, p99 {done['post_p99_ms']:.1f}); "
              f"errors {done['errors']} (POST {done['post_errors']}, missing {done['missing']}, twice "
              f"{done['duplicates']}, other stream {done['wrong_stream']}, streams lost {done['streams_lost']}); "
              f"machine busy {done['busy_pct']:.0f}%", file=sys.stderr)
        print(f"      CPU ms per push by process: {by_process_text(done['cpu_ms_per_push_by_process'])}", file=sys.stderr)
        if done.get("error_kinds"):
            print(f"  errors: {json.dumps(done['error_kinds'])}", file=sys.stderr)
        return done

    async def _hosts_let_go(self, limit_s: float = 60.0) -> tuple[float, int]:
        """Wait until no watcher waits on the hosts (a closed watcher's wait on its host ends at
        the host's next answer: 15 s at most), `limit_s` at most; returns (seconds, watchers still
        waiting). What a host knows of a session it served stays a minute more (FEED_IDLE_S)."""
        started = time.perf_counter()
        while True:
            left = sum(s.get("watchers", 0) for s in await self.stack.placement.stats())
            if not left or time.perf_counter() - started > limit_s:
                return time.perf_counter() - started, left
            await asyncio.sleep(0.5)

    async def idle_watchers(self) -> dict[str, Any]:
        """--idle-watchers SSE watchers of quiet sessions on the stack's gateway: connected, held
        --idle-settle-seconds, then the resident memory they added to the gateway process (this
        one) and the session hosts, per watcher; then closed, and the hosts seen to let go."""
        import psutil

        a = self.args
        n = a.idle_watchers
        self.run_no += 1
        tag = f"b{os.getpid()}-{self.run_no}-idle"
        placement = self.stack.placement
        spec = LiveSpec(mode="idle", url=self.stack.gateway.url, api_key=self.key,
                        sessions=[f"{tag}-{i}" for i in range(n)])
        hosts = {s["pid"] for s in await placement.stats()}
        gateway_nofile = resource.getrlimit(resource.RLIMIT_NOFILE)
        host_nofile = {}
        for pid in hosts:
            with contextlib.suppress(psutil.Error):
                host_nofile[pid] = psutil.Process(pid).rlimit(psutil.RLIMIT_NOFILE)[0]
        worker = await Child.start("live", stdin_line=msgspec.json.encode(spec))
        try:
            started = await worker.expect("started")
            for who, soft in (("the client", started["nofile_soft"]), ("the gateway", gateway_nofile[0])):
                if soft < n + 256:
                    print(f"  note: {who}'s open-file limit is {soft}, below {n} watchers and a margin: "
                          "expect failures (raise `ulimit -n`)", file=sys.stderr)
            gc.collect()
            gateway_before, hosts_before = rss_mb({os.getpid()}), rss_mb(hosts)
            worker.write(b"go")
            connected = await worker.expect("connected", timeout=900)
            print(f"idle: {connected['connected']} of {n} watchers connected in {connected['connect_s']:.1f}s, "
                  f"{connected['failed']} failed; settling {a.idle_settle_seconds:.0f}s", file=sys.stderr)
            if connected.get("error_kinds"):
                print(f"  errors: {json.dumps(connected['error_kinds'])}", file=sys.stderr)
            cpu = ProcessCpu({os.getpid(): "gateway (bench)", worker.pid: "client"})
            busy = CpuShare().start()
            cpu.start()
            await asyncio.sleep(a.idle_settle_seconds)
            cpu.stop()
            busy.stop()
            # read before the collection below: it holds up this process (the gateway) for a
            # moment with 10,000 connections' objects, and the waits that end meanwhile are
            # between two calls on the host when it counts them
            watched = sum(s.get("watched_sessions", 0) for s in await placement.stats())
            gc.collect()
            gateway_after, hosts_after = rss_mb({os.getpid()}), rss_mb(hosts)
            worker.write(b"close")
            done = await worker.expect("done", timeout=300)
        finally:
            await worker.close()
        released_s, left = await self._hosts_let_go()
        open_count = connected["connected"]
        settle_s = max(a.idle_settle_seconds, 1e-9)
        result = {
            "watchers": n, "connected": open_count, "failed": connected["failed"],
            "lost_while_idle": done["lost_while_idle"], "errors": connected["failed"] + done["lost_while_idle"],
            "error_kinds": connected.get("error_kinds", {}), "lost_kinds": done.get("lost_kinds", []),
            "connect_s": connected["connect_s"], "settle_s": a.idle_settle_seconds, "close_s": done["close_s"],
            "waiting_comments": done["waiting_comments"], "watched_sessions_at_hosts": watched,
            "hosts_released_s": round(released_s, 1), "watched_after_close": left,
            "gateway_rss_mb": [gateway_before, gateway_after], "hosts_rss_mb": [hosts_before, hosts_after],
            "kb_per_watcher": per_watcher_kb(gateway_before + hosts_before, gateway_after + hosts_after, open_count),
            "gateway_kb_per_watcher": per_watcher_kb(gateway_before, gateway_after, open_count),
            "hosts_kb_per_watcher": per_watcher_kb(hosts_before, hosts_after, open_count),
            "busy_pct": busy.percent()[0],
            # while they sat idle: CPU seconds per second, by process
            "cpu_pct_by_process": {k: round(100 * v / settle_s, 1) for k, v in sorted(
                cpu.seconds.items(), key=lambda kv: -kv[1])[:6]},
            "nofile": {"client": started["nofile_soft"], "gateway": gateway_nofile[0],
                       "hosts": sorted(set(host_nofile.values()))},
        }
        kb = result["kb_per_watcher"]
        print(f"  {open_count} idle watchers: {'-' if kb is None else f'{kb:.1f}'} KB each "
              f"(gateway {result['gateway_kb_per_watcher'] or 0:.1f}, hosts {result['hosts_kb_per_watcher'] or 0:.1f}); "
              f"gateway {gateway_before:.0f} -> {gateway_after:.0f} MB, hosts {hosts_before:.0f} -> {hosts_after:.0f} MB; "
              f"{watched} sessions watched at the hosts; {done['lost_while_idle']} lost while idle; "
              f"machine busy {result['busy_pct']:.0f}% while idle ("
              + ", ".join(f"{k} {v:.0f}%" for k, v in result["cpu_pct_by_process"].items())
              + f"); closed in {done['close_s']:.1f}s, the hosts let go in {result['hosts_released_s']:.0f}s "
              f"({left} still watched)", file=sys.stderr)
        return result

    # -- growth ---------------------------------------------------------------------------------------

    async def growth(self) -> dict[str, Any]:
        a = self.args
        # every session of every level stays live: neither the idle time nor the cap passivates one
        settings = msgspec.structs.replace(self.settings, idle_seconds=3600.0, shards=a.growth_shards,
                                           host_max_sessions=2 * sum(a.growth_levels) + 1000)
        placement, gateway = await self.gateway_for(settings, "growth-")
        url = gateway.url

        async def host_stats() -> list[dict[str, Any]]:
            return await placement.stats()

        async def drive(sessions: list[str], messages: int, text: str, concurrency: int, warm: int = 0
                        ) -> dict[str, Any]:
            spec = WorkerSpec(mode="http", sessions=sessions, concurrency=concurrency, messages=messages,
                              warm_rounds=warm, text=text, url=url, api_key=self.key)
            worker = await Child.start("worker", stdin_line=msgspec.json.encode(spec))
            try:
                await worker.expect("ready")
                before = await host_stats()
                host_pids = {s["pid"] for s in before}
                meter = Meter(lambda: self.engine_cpu_pids({worker.pid}), lambda: host_pids)
                spy = None
                if a.profile and text == "order":
                    spy = await self._spy(min(host_pids), Path(a.profile) / f"growth-{len(sessions)}-host.txt")
                meter.start()
                worker.write(b"go")
                done = await worker.expect("done")
                cpu, _, peak = meter.stop()
                if spy is not None:
                    await spy.wait()
                after = await host_stats()
            finally:
                await worker.close()
            if done.get("error_kinds"):
                print(f"  errors: {json.dumps(done['error_kinds'])}", file=sys.stderr)
            fl = sum(s["flushes"] for s in after) - sum(s["flushes"] for s in before)
            fs = sum(s["flushed_sessions"] for s in after) - sum(s["flushed_sessions"] for s in before)
            done.update(flushes_per_s=fl / done["elapsed_s"], msgs_per_flush=done["messages"] / fl if fl else 0.0,
                        sessions_per_flush=fs / fl if fl else 0.0, cpu_s_per_msg=cpu / max(done["messages"], 1),
                        host_peak_rss_mb=peak)
            return done

        tag = f"g{os.getpid()}"
        # the empty host: runtime open, the tenant's catalog loaded, one session
        await drive([f"{tag}-probe"], 5, "order", 1)
        stats = await host_stats()
        pids = {s["pid"] for s in stats}
        empty = rss_mb(pids)
        print(f"growth: {len(pids)} host(s), empty {empty:.0f} MB", file=sys.stderr)
        levels = []
        live: list[str] = []
        for level in a.growth_levels:
            new = [f"{tag}-{i}" for i in range(len(live), level)]
            started = time.perf_counter()
            if new:
                # one short message activates each new session (one model round, no tool)
                await drive(new, len(new), "hello", a.growth_concurrency)
            live += new
            create_s = time.perf_counter() - started
            await asyncio.sleep(1.0)
            rss_idle = rss_mb(pids)
            load = await drive(random.sample(live, len(live)), a.growth_messages, "order", a.growth_concurrency)
            rss_after = rss_mb(pids)
            stats = await host_stats()
            entry = {
                "live_sessions": sum(s["live_sessions"] for s in stats),
                "msgs_per_s": load["msgs_per_s"], "p50_ms": load["p50_ms"], "p99_ms": load["p99_ms"],
                "errors": load["errors"], "cpu_s_per_msg": load["cpu_s_per_msg"],
                "host_rss_mb": rss_idle, "host_rss_after_load_mb": rss_after,
                "rss_per_idle_session_kb": (rss_idle - empty) * 1024 / level,
                "flushes_per_s": load["flushes_per_s"], "msgs_per_flush": load["msgs_per_flush"],
                "sessions_per_flush": load["sessions_per_flush"], "activate_s": create_s,
            }
            levels.append(entry)
            print(f"  {entry['live_sessions']:>6} live: {entry['msgs_per_s']:6.1f} msg/s  p99 {entry['p99_ms']:6.1f} ms  "
                  f"hosts {rss_idle:6.0f} MB ({entry['rss_per_idle_session_kb']:.1f} KB/session)  "
                  f"{entry['flushes_per_s']:.0f} flush/s, {entry['msgs_per_flush']:.1f} msgs/flush  "
                  f"errors {entry['errors']}", file=sys.stderr)
        burst = None
        if len(live) >= a.burst:
            # that many sessions with a message in flight at once, through the gateway
            burst_run = await drive(random.sample(live, a.burst), a.burst * 2, "order", a.burst)
            burst = {"concurrent_sessions": a.burst, "messages": burst_run["messages"],
                     "errors": burst_run["errors"], "error_kinds": burst_run.get("error_kinds", {}),
                     "msgs_per_s": burst_run["msgs_per_s"],
                     "p50_ms": burst_run["p50_ms"], "p99_ms": burst_run["p99_ms"]}
            print(f"  {a.burst} concurrent sessions: {burst['messages']} messages, {burst['errors']} errors, "
                  f"p50 {burst['p50_ms']:.0f} ms, p99 {burst['p99_ms']:.0f} ms", file=sys.stderr)
        # passivate some sessions that have a past, then bring them back: activation from Postgres
        sample = random.sample(live, min(a.reactivate, len(live)))
        await asyncio.gather(*(placement.passivate(self.tenant_id, s) for s in sample))
        back = await drive(sample, len(sample), "order", a.growth_concurrency)
        stats = await host_stats()
        react = {
            "sessions": len(sample), "errors": back["errors"],
            "p50_ms": statistics.median([s["reactivation_p50_ms"] for s in stats]),
            "p99_ms": max(s["reactivation_p99_ms"] for s in stats),
            "first_message_p50_ms": back["p50_ms"], "first_message_p99_ms": back["p99_ms"],
        }
        print(f"  reactivation of {len(sample)} passivated sessions: p50 {react['p50_ms']:.1f} ms, "
              f"p99 {react['p99_ms']:.1f} ms (first message p50 {back['p50_ms']:.1f} ms)", file=sys.stderr)
        await placement.shutdown_hosts()
        await self.close_gateway(gateway)
        last = levels[-1]
        return {"shards": a.growth_shards, "empty_host_rss_mb": empty, "levels": levels, "reactivation": react,
                "burst": burst,
                "rss_beyond_empty_mb": last["host_rss_mb"] - empty, "at_sessions": last["live_sessions"]}


def _allow_connections(data_dir: Path, n: int) -> None:
    """Raise the embedded Postgres's max_connections: the benchmark runs gateways, shard hosts
    and up to 2 x --dedicated-sessions actors side by side, each with its own pool."""
    import asyncpg

    from storage.embedded import start_embedded

    pg = start_embedded(data_dir)
    try:
        async def alter() -> None:
            conn = await asyncpg.connect(pg.url)
            try:
                await conn.execute(f"ALTER SYSTEM SET max_connections = {int(n)}")
            finally:
                await conn.close()

        asyncio.run(alter())
    finally:
        pg.stop()  # restarted by the stack with the new setting


def _median_known(values: Any) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _median_ways(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the rounds; a breakdown (a dict of figures) by its parts."""
    out: dict[str, Any] = {}
    for k, first in rows[0].items():
        if isinstance(first, dict):
            parts = {part for r in rows for part in r.get(k, {})}
            out[k] = {part: statistics.median(r.get(k, {}).get(part, 0.0) for r in rows) for part in sorted(parts)}
        else:
            out[k] = statistics.median(r[k] for r in rows)
    return out


def _aggregate(ways: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    med = {w: _median_ways(rows) for w, rows in ways.items() if rows}
    base = med.get("inprocess", {}).get("msgs_per_s") or 0.0
    paired = {}
    for w in ("sharded", "dedicated"):
        if w in ways and ways.get("inprocess"):
            # each round's way against the in-process run just before it: drift on a shared
            # machine moves both, so the median of these is steadier than a ratio of medians
            paired[w] = statistics.median(
                b["msgs_per_s"] / a["msgs_per_s"] for a, b in zip(ways["inprocess"], ways[w], strict=False)
                if a["msgs_per_s"])
    return {
        "ways": med,
        "ratio_sharded": med["sharded"]["msgs_per_s"] / base if base and "sharded" in med else None,
        "ratio_dedicated": med["dedicated"]["msgs_per_s"] / base if base and "dedicated" in med else None,
        "paired_ratios": paired,
    }


def _median_by_label(rows: list[dict[str, float]]) -> dict[str, float]:
    """Per label, the median over rows (a label missing from a row counts as 0 there), largest first."""
    labels = {k for row in rows for k in row}
    medians = {k: statistics.median(row.get(k, 0.0) for row in rows) for k in labels}
    return dict(sorted(medians.items(), key=lambda kv: -kv[1]))


def _median_tail(splits: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """tail_split's figures, each the median over the rounds that said it."""
    known = [s for s in splits if s]
    if not known:
        return None
    return {k: _median_known(s[k] for s in known) for k in known[0] if k != "burst_starts_s"}


async def main_async(args: argparse.Namespace) -> int:
    bench = Bench(args)
    started = time.perf_counter()
    try:
        await bench.start()
        result = await bench.compare()
        growth = await bench.growth() if args.growth else None
        live = await bench.live()
    finally:
        await bench.stop()
    doc = report(result, args, growth, live)
    out = Path(args.data_dir).parent / "bench.json" if args.output is None else Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    kept = record_run(doc, Path(args.results_dir), Path(args.table))
    print_table(doc)
    print(f"\nwrote {out} in {time.perf_counter() - started:.0f}s (kept as {kept}; {args.table} regenerated)")
    return 0


def default_shards(cpus: int | None = None) -> int:
    """Way b's session hosts when --shards is not given: one per two CPUs, at least one.

    The hosts do about half of what the machine does for a message: the gateway, Postgres, the
    model, the store and the load worker take about as much CPU again. A host beyond that only
    time-shares the cores, and each is one more process a turn may wake: on 2 cores, two hosts
    used 0.5-0.8 ms more CPU per message than one, one host's peak was 0.90-0.96 of (a)'s against
    two's 0.84, and the added latency at half peak was the same within the noise (+3.9 and +4.4 ms
    p50 against two hosts' +2.4 and +6.3 in the same slices: README § Performance, runs 50-51).
    `cpus`: the CPUs this process may run on, when not given."""
    return max(1, (len(os.sched_getaffinity(0)) if cpus is None else cpus) // 2)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.measure", description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=1200, help="timed messages per way and round")
    p.add_argument("--concurrency", type=int, default=16, help="clients sending at once, every way")
    p.add_argument("--sessions", type=int, default=64, help="sessions for ways a and b")
    p.add_argument("--dedicated-sessions", type=int, default=16, help="sessions (= actors) for way c")
    p.add_argument("--shards", type=int, default=default_shards(),
                   help="session hosts for way b (default: one per two of the CPUs this process may use, "
                        "at least one; see default_shards)")
    p.add_argument("--repeat", type=int, default=1, help="rounds; figures are medians")
    p.add_argument("--warm-rounds", type=int, default=1, help="messages per session before timing")
    p.add_argument("--ways", default=",".join(WAYS), help="subset of inprocess,sharded,dedicated")
    p.add_argument("--no-gate-off", action="store_true", help="skip the gate-off runs")
    p.add_argument("--no-half-load", action="store_true", help="skip the half-peak latency runs")
    p.add_argument("--no-peak", action="store_true", help="skip the peak-load sweep of ways a and b")
    p.add_argument("--peak-concurrency", default="16,32,64,128,256",
                   help="clients at a time tried for the peak, while a level beats the one before it by 5%%")
    p.add_argument("--half-load-seconds", type=float, default=20.0,
                   help="each way's share of an open-loop half-peak run: its p99 is the 1%% tail of rate x seconds messages")
    p.add_argument("--half-load-slices", type=int, default=10,
                   help="slices the half-peak run is cut into, the ways taking turns slice by slice "
                        "(--profile and --profile-python do not cover these runs)")
    p.add_argument("--half-load-variant", action="append", default=[], metavar="CE_NAME=VALUE",
                   help="also run (b) in the half-peak run on hosts of their own with this setting "
                        "(repeat for more), slice by slice beside the others: a setting's effect, paired")
    p.add_argument("--no-via-ray", dest="via_ray", action="store_false",
                   help="leave (b) through Ray's actor task path out of the half-peak latency runs")
    p.add_argument("--half-load-rate", type=float, default=None,
                   help="msgs/s of the latency runs instead of half the measured peak (the hops' floor at a light load)")
    p.add_argument("--stream", action="store_true",
                   help="every message a streamed turn (SSE through the gateways, SessionHost.stream in process)")
    p.add_argument("--growth", action="store_true", help="also measure 100 -> 1,000 -> 10,000 live sessions")
    p.add_argument("--growth-levels", default="100,1000,10000")
    p.add_argument("--growth-shards", type=int, default=1, help="hosts in the growth host set")
    p.add_argument("--growth-messages", type=int, default=800, help="timed order messages per level")
    p.add_argument("--growth-concurrency", type=int, default=32)
    p.add_argument("--reactivate", type=int, default=500, help="sessions passivated and brought back")
    p.add_argument("--burst", type=int, default=1000, help="concurrent sessions in the growth burst")
    p.add_argument("--no-push", dest="push", action="store_false",
                   help="skip the push latency run (agent messages to watched sessions, through the gateway)")
    p.add_argument("--push-sessions", type=int, default=1000,
                   help="sessions handed off and watched (one SSE watcher each) for the push latency run")
    p.add_argument("--push-rate", type=float, default=100.0, help="agent messages per second, open loop")
    p.add_argument("--push-seconds", type=float, default=30.0, help="how long the agent messages are sent for")
    p.add_argument("--idle-watchers", type=int, default=10_000,
                   help="idle SSE watchers held open on one gateway for their memory (0: skip)")
    p.add_argument("--idle-settle-seconds", type=float, default=20.0,
                   help="how long the idle watchers are held before their memory is read (past the gateway's "
                        "15 s wait on the host, so each has been through one)")
    p.add_argument("--profile", default=None,
                   help="directory: py-spy profiles (collapsed stacks) of the engine processes during each way")
    p.add_argument("--profile-seconds", type=float, default=8.0)
    p.add_argument("--profile-python", default=None,
                   help="directory: a pyinstrument report of way a's timed phase (slows that way down)")
    p.add_argument("--neighbours", action="store_true",
                   help="only the noisy-neighbour run (bench/neighbours.py): tenant B's latency alone and while "
                        "tenant A sends hostile loads; writes .data/bench-neighbours.json")
    p.add_argument("--neighbours-rate", type=float, default=20.0, help="tenant B's messages per second")
    p.add_argument("--neighbours-seconds", type=float, default=20.0, help="each phase's length")
    p.add_argument("--neighbours-sessions", type=int, default=16, help="tenant B's sessions")
    p.add_argument("--neighbours-burst", type=int, default=1000, help="clients in each of tenant A's bursts")
    p.add_argument("--neighbours-loads", default="schemas,heavy,versions,bursts",
                   help="tenant A's loads, comma-separated (default: all of schemas, heavy, versions, bursts)")
    p.add_argument("--data-dir", default=".data/bench", help="embedded Postgres and keys of the benchmark")
    p.add_argument("--output", default=None, help="default: .data/bench.json")
    p.add_argument("--results-dir", default=str(RESULTS_DIR),
                   help="where the run is also kept, as <UTC time>.json (default: bench/results)")
    p.add_argument("--table", default=str(TABLE),
                   help="the markdown page regenerated from every run kept there (default: docs/benchmarks.md)")
    args = p.parse_args(argv)
    args.ways = [w.strip() for w in args.ways.split(",") if w.strip()]
    args.neighbours_loads = [x.strip() for x in args.neighbours_loads.split(",") if x.strip()]
    if unknown := set(args.neighbours_loads) - {"schemas", "heavy", "versions", "bursts"}:
        p.error(f"--neighbours-loads: unknown load(s) {', '.join(sorted(unknown))}; "
                "pick from schemas, heavy, versions, bursts")
    args.growth_levels = [int(x) for x in args.growth_levels.split(",")]
    args.peak_concurrency = [int(x) for x in args.peak_concurrency.split(",")]
    if args.half_load_rate is not None and not args.half_load_rate > 0:
        p.error("--half-load-rate takes a rate above 0 messages per second")
    variant = {}
    for item in args.half_load_variant:
        name, sep, value = item.partition("=")
        if not sep or not name.startswith("CE_"):
            p.error(f"--half-load-variant takes CE_NAME=VALUE (an engine setting), got {item!r}")
        variant[name] = value
    args.half_load_variant = variant
    if args.push and (args.push_sessions < 1 or not args.push_rate > 0 or not args.push_seconds > 0):
        p.error("--push-sessions, --push-rate and --push-seconds take numbers above 0 (or --no-push)")
    if args.idle_watchers < 0 or args.idle_settle_seconds < 0:
        p.error("--idle-watchers and --idle-settle-seconds take numbers of at least 0")
    if args.half_load_slices < 1:
        p.error("--half-load-slices takes a whole number of at least 1")
    if not args.ways or any(w not in WAYS for w in args.ways):
        p.error(f"--ways takes a subset of {','.join(WAYS)}")
    return args


def _process_name(pid: int) -> str:
    """A process's name as `ps` shows it (Ray's workers set theirs: `ray::SessionHostActor`,
    `ray::IDLE`), with its script's for a Python one (`python log_monitor.py`), or `gone` for one
    that has exited since it was metered."""
    import psutil

    try:
        process = psutil.Process(pid)
        return process_label(process.cmdline(), process.name())
    except psutil.Error:
        return "gone"


def process_label(argv: list[str], comm: str) -> str:
    """`_process_name` from a process's command line and its kernel name (`comm`). A kernel
    thread has no command line: its name is kept whole (`kworker/0:1`, `kdamond.0`)."""
    if not argv:
        return comm[:40] or "unnamed"
    name = argv[0].split(" ")[0].rsplit("/", 1)[-1][:40] or "unnamed"
    if name.startswith("python") and len(argv) > 1:  # Ray's daemons in Python: the script's name
        rest = [a for a in argv[1:] if a == "-m" or not a.startswith("-")]
        script = rest[1] if rest[:1] == ["-m"] and len(rest) > 1 else (rest or ["?"])[0]
        name = f"{name} {script.rsplit('/', 1)[-1][:40]}"
    return name


def _use_uvloop() -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _use_uvloop()
    if argv[:1] == ["worker"]:
        # Every way's load generator gets the servers' collector settings (services.heap): way a's
        # session code shares its process, and the ways must differ only in what they measure.
        tune_collector()
        spec = msgspec.json.decode(sys.stdin.readline().encode(), type=WorkerSpec)
        asyncio.run(_worker(spec))
        return 0
    if argv[:1] == ["live"]:
        worker_main()
        return 0
    if argv[:1] == ["backend"]:
        asyncio.run(_backend(argv[1]))
        return 0
    tune_collector()  # this process runs the benchmark's gateways, as `chat-engine serve` would
    # an SSE watcher is a socket in the gateway (this process); Postgres, Ray and the hosts started
    # from here inherit the limit (ray.init raises its caller's to the hard limit too, up to 65,536)
    raise_open_files()
    args = parse_args(argv)
    if args.neighbours:
        from bench import neighbours

        return neighbours.main(args)
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
