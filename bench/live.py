"""Live sessions through the gateway, measured from a client: how soon a person's message reaches
a watcher of its session (push latency), and what an idle watcher costs.

Runs in a worker process of bench/measure.py (`python -m bench.measure live`, a LiveSpec as the
first line of its stdin, JSON lines out), against the gateway and sharded session hosts of the
benchmark's own stack:

- push: every session handed off (the contact's line `/handoff`: the local model hands over), one
  SSE watcher each (GET /v1/sessions/{id}/events), all connected and past what their log already
  held before timing; then agent messages (POST .../agent-messages) sent open loop at a fixed
  rate, round robin over the sessions. A push's latency runs from the moment its POST starts to
  the moment this client has parsed the SSE frame carrying its message_id on that session's
  stream; a push whose POST fails is an error, one whose event never comes (within `drain_s` of
  the last send) is missing, one that comes twice or on another session's stream is counted too.
- idle: watchers of sessions with nothing to say, connected a bounded number at a time until each
  has its stream's `retry:` line, then held while the orchestrator reads the memory of the
  gateway and the hosts (it says when, on stdin), then closed.

The watchers have an aiohttp client (and connector, limit=0) of their own, and this process
raises its open-file limit to the hard one: each watcher is a socket here and one in the gateway.
The pure parts (SseParser, push_summary, per_watcher_kb) are unit-tested.
"""

from __future__ import annotations

import asyncio
import json
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

import msgspec

from bench.stats import percentile

#: the contact's line that makes the local model hand the session over (app/local_model_rules.py)
HANDOFF_TEXT = "/handoff"
#: the name the benchmark's agent writes under
AGENT = "bench agent"


# =============================================================================================
# pure: parsing a stream, summing up
# =============================================================================================

class SseFrame(msgspec.Struct, frozen=True, kw_only=True):
    """One server-sent event: its `id:` (None when it had none or not a number), `event:` (the
    default "message" when it had none) and its `data:` lines joined by a line feed."""

    id: int | None
    event: str
    data: bytes


class SseParser:
    """The server-sent events of one stream, parsed from its bytes as they arrive, however the
    network splits them. Comment lines (`: waiting`) are counted, the last `retry:` kept; a frame
    without a `data:` line (the `retry:` the gateway sends first) dispatches nothing."""

    __slots__ = ("_buffer", "_data", "_event", "_id", "comments", "retry_ms")

    def __init__(self) -> None:
        self._buffer = b""
        self._id: int | None = None
        self._event: str | None = None
        self._data: bytes | None = None
        self.comments = 0
        self.retry_ms: int | None = None

    def feed(self, chunk: bytes) -> list[SseFrame]:
        """The frames `chunk` completes, in order (a frame still open waits for the next chunk)."""
        *lines, self._buffer = (self._buffer + chunk).split(b"\n")
        out = []
        for line in lines:
            line = line.removesuffix(b"\r")
            if not line:
                if self._data is not None:
                    out.append(SseFrame(id=self._id, event=self._event or "message", data=self._data))
                self._id = self._event = self._data = None
            elif line.startswith(b":"):
                self.comments += 1
            else:
                name, _, value = line.partition(b":")
                value = value.removeprefix(b" ")
                if name == b"data":
                    self._data = value if self._data is None else self._data + b"\n" + value
                elif name == b"event":
                    self._event = value.decode()
                elif name == b"id":
                    self._id = int(value) if value.isdigit() else None
                elif name == b"retry" and value.isdigit():
                    self.retry_ms = int(value)
        return out


def push_summary(latencies_ms: list[float], *, pushes: int, post_errors: int, missing: int, duplicates: int,
                 wrong_stream: int, streams_lost: int, elapsed_s: float) -> dict[str, Any]:
    """A push run's figures: percentiles of the latencies of the pushes that arrived, the rate the
    pushes went out at, and `errors`, every push or stream that went wrong (a failed POST, an event
    missing, one read twice or on another session's stream, a watcher's stream that ended)."""
    return {
        "pushes": pushes, "arrived": len(latencies_ms), "post_errors": post_errors, "missing": missing,
        "duplicates": duplicates, "wrong_stream": wrong_stream, "streams_lost": streams_lost,
        "errors": post_errors + missing + duplicates + wrong_stream + streams_lost,
        "elapsed_s": elapsed_s, "pushes_per_s": pushes / elapsed_s if elapsed_s > 0 else 0.0,
        "p50_ms": percentile(latencies_ms, 50), "p95_ms": percentile(latencies_ms, 95),
        "p99_ms": percentile(latencies_ms, 99), "max_ms": max(latencies_ms, default=0.0),
    }


def per_watcher_kb(before_mb: float, after_mb: float, watchers: int) -> float | None:
    """Resident memory per watcher in KB: what `watchers` open connections added, (after - before)
    in MB over them; None without a watcher to divide by."""
    if watchers <= 0:
        return None
    return (after_mb - before_mb) * 1024 / watchers


def raise_open_files() -> tuple[int, int]:
    """This process's open-file limit raised to its hard limit (a watcher is a socket); returns
    (soft, hard) as they are after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass  # kept as it was: the run reports the limit it had
    return resource.getrlimit(resource.RLIMIT_NOFILE)


# =============================================================================================
# the worker: a client of the gateway
# =============================================================================================

class LiveSpec(msgspec.Struct, kw_only=True):
    mode: str  # "push" | "idle"
    url: str  # the gateway
    api_key: str
    sessions: list[str]
    rate: float = 100.0  # push: agent messages per second, open loop
    seconds: float = 30.0  # push: how long they are sent for
    drain_s: float = 10.0  # push: how long after the last send an event may still come
    setup_concurrency: int = 32  # push: handoff turns at once
    connect_concurrency: int = 256  # watchers connecting at once (the gateway's listen backlog is 128)
    connect_timeout_s: float = 60.0


class Watcher:
    """One session's event stream, read for as long as its task runs. `ready` is set once it is
    connected (its `retry:` line read and, with `backlog`, the events its log already held) or
    has failed (`error` says why)."""

    __slots__ = ("backlog", "error", "frames", "parser", "ready", "session_id", "task")

    def __init__(self, session_id: str, *, backlog: bool) -> None:
        self.session_id = session_id
        self.backlog = backlog
        self.parser = SseParser()
        self.ready = asyncio.Event()
        self.error: str | None = None
        self.frames = 0
        self.task: asyncio.Task | None = None

    async def follow(self, client: Any, url: str, headers: dict[str, str],
                     on_frame: Callable[[Watcher, SseFrame, float], None]) -> None:
        import aiohttp

        try:
            async with client.get(f"{url}/v1/sessions/{self.session_id}/events", headers=headers) as response:
                if response.status != 200:
                    self.error = f"HTTP {response.status}: {(await response.read())[:120]!r}"
                    return
                async for chunk in response.content.iter_any():
                    frames = self.parser.feed(chunk)
                    at = time.perf_counter()
                    for frame in frames:
                        self.frames += 1
                        on_frame(self, frame, at)
                    if self.parser.retry_ms is not None and (self.frames or not self.backlog):
                        self.ready.set()
                self.error = "the stream ended"
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            self.error = f"{type(exc).__name__}: {str(exc)[:120]}"
        finally:
            self.ready.set()

    def start(self, client: Any, url: str, headers: dict[str, str],
              on_frame: Callable[[Watcher, SseFrame, float], None]) -> None:
        self.task = asyncio.create_task(self.follow(client, url, headers, on_frame))


def _ignore(_w: Watcher, _f: SseFrame, _at: float) -> None:
    return None


async def connect_all(watchers: list[Watcher], client: Any, url: str, headers: dict[str, str],
                      on_frame: Callable[[Watcher, SseFrame, float], None], concurrency: int, timeout_s: float) -> float:
    """Every watcher started, at most `concurrency` not yet ready at a time; returns the seconds
    until all were ready or failed. One still not ready `timeout_s` after it started has failed."""
    gate = asyncio.Semaphore(max(concurrency, 1))

    async def one(w: Watcher) -> None:
        async with gate:
            w.start(client, url, headers, on_frame)
            try:
                await asyncio.wait_for(w.ready.wait(), timeout_s)
            except TimeoutError:
                w.error = w.error or f"not connected within {timeout_s:.0f}s"

    started = time.perf_counter()
    await asyncio.gather(*(one(w) for w in watchers))
    return time.perf_counter() - started


async def close_all(watchers: list[Watcher]) -> float:
    """Every watcher's stream closed (its task cancelled: aiohttp closes the connection); returns
    the seconds it took."""
    started = time.perf_counter()
    tasks = [w.task for w in watchers if w.task is not None]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return time.perf_counter() - started


def _api_client():
    """The API's client: its own connector, not limited in connections (the open loop must not
    queue for one)."""
    import aiohttp

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=60))


def _stream_client(spec: LiveSpec):
    """The watchers' client: a connector of their own, not limited in connections (each holds
    one open). A stream is silent for up to the gateway's wait (15 s) between `: waiting` lines:
    60 s of silence is a dead one."""
    import aiohttp

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(
        total=None, connect=spec.connect_timeout_s, sock_read=60))


async def run_push(spec: LiveSpec) -> None:
    """Hand off, watch, then push open loop (see the module's notes); says `ready` once every
    watcher is connected, waits for `go`, says `done` with the figures."""
    import aiohttp

    headers = {"Authorization": f"Bearer {spec.api_key}", "Content-Type": "application/json"}
    encode, decode = msgspec.json.encode, msgspec.json.decode
    errors: dict[str, int] = {}
    api, streams = _api_client(), _stream_client(spec)

    def note(kind: str) -> None:
        errors[kind[:80]] = errors.get(kind[:80], 0) + 1

    async def post(path: str, body: dict[str, Any]) -> tuple[int, bytes]:
        async with api.post(f"{spec.url}{path}", data=encode(body), headers=headers) as response:
            return response.status, await response.read()

    gate = asyncio.Semaphore(max(spec.setup_concurrency, 1))

    async def hand_off(sid: str) -> bool:
        async with gate:
            for _attempt in range(5):  # the same message id: a retry is answered, not run again
                try:
                    status, raw = await post(f"/v1/sessions/{sid}/messages",
                                             {"text": HANDOFF_TEXT, "message_id": f"{sid}-handoff"})
                    if status == 200 and decode(raw).get("handoff") is True:
                        return True
                    note(f"handoff: HTTP {status}: {raw[:60]!r}")
                except (TimeoutError, aiohttp.ClientError) as exc:
                    note(f"handoff: {type(exc).__name__}")
                await asyncio.sleep(0.5)
            return False

    pending: dict[str, tuple[float, str]] = {}  # message id -> (its POST's start, its session)
    arrived: set[str] = set()
    latencies: list[float] = []
    counts = {"duplicates": 0, "wrong_stream": 0}

    def on_frame(w: Watcher, frame: SseFrame, at: float) -> None:
        if frame.event != "message":
            return
        data = decode(frame.data)
        if data.get("author") != "agent":
            return
        message_id = data.get("message_id")
        sent = pending.pop(message_id, None)
        if sent is None:
            if message_id in arrived:
                counts["duplicates"] += 1
            return
        arrived.add(message_id)
        if sent[1] != w.session_id:
            counts["wrong_stream"] += 1
            return
        latencies.append((at - sent[0]) * 1000)

    watchers: list[Watcher] = []
    try:
        started = time.perf_counter()
        handed = await asyncio.gather(*(hand_off(s) for s in spec.sessions))
        sessions = [s for s, ok in zip(spec.sessions, handed, strict=True) if ok]
        handoff_s = time.perf_counter() - started
        watchers = [Watcher(s, backlog=True) for s in sessions]
        connect_s = await connect_all(watchers, streams, spec.url, headers, on_frame,
                                      spec.connect_concurrency, spec.connect_timeout_s)
        live = [w for w in watchers if w.error is None]
        for w in watchers:
            if w.error is not None:
                note(f"watcher: {w.error}")
        _say({"event": "ready", "sessions": len(spec.sessions), "handed_off": len(sessions),
              "watchers": len(live), "handoff_s": handoff_s, "connect_s": connect_s})
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # "go"

        post_ms: list[float] = []
        lags: list[float] = []
        post_errors = 0

        async def push(k: int, w: Watcher, due: float) -> None:
            nonlocal post_errors
            message_id = f"{w.session_id}-p{k}"
            sent = time.perf_counter()
            lags.append((sent - due) * 1000)
            pending[message_id] = (sent, w.session_id)
            try:
                status, raw = await post(f"/v1/sessions/{w.session_id}/agent-messages",
                                         {"text": f"push {k}", "agent": AGENT, "message_id": message_id})
            except (TimeoutError, aiohttp.ClientError) as exc:
                status, raw = 0, type(exc).__name__.encode()
            post_ms.append((time.perf_counter() - sent) * 1000)
            if status != 200:
                post_errors += 1
                pending.pop(message_id, None)
                note(f"push: HTTP {status}: {raw[:60]!r}")

        total = int(spec.rate * spec.seconds) if live else 0
        begun = time.perf_counter()
        tasks = []
        for k in range(total):
            due = begun + k / spec.rate
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(push(k, live[k % len(live)], due)))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - begun
        waited = time.perf_counter()
        while pending and time.perf_counter() - waited < spec.drain_s:
            await asyncio.sleep(0.05)
        lost = sum(1 for w in live if w.error is not None)
        for w in live:
            if w.error is not None:
                note(f"stream: {w.error}")
        result = push_summary(latencies, pushes=total, post_errors=post_errors, missing=len(pending),
                              duplicates=counts["duplicates"], wrong_stream=counts["wrong_stream"],
                              streams_lost=lost, elapsed_s=elapsed)
        result.update(
            sessions=len(spec.sessions), handed_off=len(sessions), watchers=len(live),
            watcher_failures=len(watchers) - len(live), handoff_failures=len(spec.sessions) - len(sessions),
            handoff_s=round(handoff_s, 3), connect_s=round(connect_s, 3), rate=spec.rate, seconds=spec.seconds,
            post_p50_ms=percentile(post_ms, 50), post_p99_ms=percentile(post_ms, 99),
            send_lag_p99_ms=percentile(lags, 99),
            error_kinds=dict(sorted(errors.items(), key=lambda kv: -kv[1])[:5]))
        _say({"event": "done", **result})
    finally:
        await close_all(watchers)
        await api.close()
        await streams.close()


async def run_idle(spec: LiveSpec) -> None:
    """Idle watchers: says `started` (with this process's open-file limit), waits for `go`,
    connects every watcher, says `connected`, holds them until `close`, then closes them and says
    `done`."""
    soft, hard = raise_open_files()
    headers = {"Authorization": f"Bearer {spec.api_key}"}
    streams = _stream_client(spec)
    watchers = [Watcher(s, backlog=False) for s in spec.sessions]
    readline = asyncio.get_running_loop().run_in_executor
    try:
        _say({"event": "started", "nofile_soft": soft, "nofile_hard": hard})
        await readline(None, sys.stdin.readline)  # "go"
        connect_s = await connect_all(watchers, streams, spec.url, headers, _ignore,
                                      spec.connect_concurrency, spec.connect_timeout_s)
        failed = {w for w in watchers if w.error is not None}
        kinds: dict[str, int] = {}
        for w in failed:
            kinds[w.error[:80]] = kinds.get(w.error[:80], 0) + 1
        _say({"event": "connected", "watchers": len(watchers), "connected": len(watchers) - len(failed),
              "failed": len(failed), "connect_s": connect_s,
              "error_kinds": dict(sorted(kinds.items(), key=lambda kv: -kv[1])[:5])})
        await readline(None, sys.stdin.readline)  # "close"
        lost = [w for w in watchers if w.error is not None and w not in failed]
        close_s = await close_all(watchers)
        _say({"event": "done", "lost_while_idle": len(lost), "close_s": close_s,
              "waiting_comments": sum(w.parser.comments for w in watchers),
              "lost_kinds": sorted({w.error[:80] for w in lost if w.error})[:5]})
    finally:
        await close_all(watchers)
        await streams.close()


def worker_main() -> None:
    """`python -m bench.measure live`: the LiveSpec on stdin's first line, then as run_push or
    run_idle say."""
    raise_open_files()
    spec = msgspec.json.decode(sys.stdin.readline().encode(), type=LiveSpec)
    asyncio.run(run_push(spec) if spec.mode == "push" else run_idle(spec))


def _say(event: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()
