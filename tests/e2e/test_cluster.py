"""The engine on a real two-node Ray cluster on this machine (issue 10), as an operator runs it.

`ray start --head` (resource `head`) and a second `ray start --address=…` (resource `worker2`),
each in its own temp dir and session, both on loopback (127.0.0.10 and 127.0.0.11: Ray turns
127.0.0.1 into the machine's interface address once multi-node is enabled, other 127/8
addresses it keeps), with token authentication. The gateway is `chat-engine serve` in a
subprocess joined by RAY_ADDRESS, so this process never holds a Ray context of its own (other
e2e tests run a local Ray in it); `chat-engine scale N` and a small probe are drivers too.
The local model and a counting webhook backend run here, on loopback.

- spread: the two session hosts land on different nodes, and chat flows through both;
- rescale 2 -> 4 -> 3 under traffic: exactly the moved sessions are released by their old host
  (the scale report says how many) and activated once by the new one (epoch = 1 + moves, so a
  session that moves back is activated anew, never served from a stale copy); no client sees an
  error; every message is stored once, every tool ran once (backend hits and ce_tool_calls per
  message id); every session's variables are intact; the retired host is gone;
- restart-hosts under traffic: every host is re-created, one at a time, with the operator's
  settings (a new process; its sessions flushed, then re-activated once: epoch 2); nothing lost;
- node loss under traffic: the second node's processes are killed; its hosts come back on the
  head node (max_restarts), their sessions re-activate from Postgres (epoch + 1), keep
  answering, and nothing acknowledged is lost; clients see only 503 + Retry-After meanwhile,
  and only a message that failed may have run its tool twice.

Run alone: `.venv/bin/python -m pytest -q tests/e2e/test_cluster.py`.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Self

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from actors.sharding import rendezvous_index

pytestmark = pytest.mark.e2e

BIN = Path(sys.executable).parent
HEAD_IP, WORKER_IP = "127.0.0.10", "127.0.0.11"
BACKEND_HOST = "127.0.0.3"  # the counting backend's own loopback address (the webhook allowlist)
MARKS = 6  # one-shot tools mark0..mark5: message k < MARKS sets variable mark<k>
MESSAGES_PER_TURN = 4  # user, assistant tool_use, user tool_result, assistant text


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def processes_of_session(sid: int) -> list[int]:
    """Every process of session `sid` (a `ray start` run with start_new_session: its daemons,
    the raylet's workers included, keep that session)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    pids.append(int(entry))
            except OSError:
                continue
    return pids


class RayNode:
    """One `ray start` node in its own session: `kill()` stops exactly its processes (`ray stop`
    would stop every Ray on the machine, the other tests' included)."""

    def __init__(self, name: str, temp_dir: Path, env: dict[str, str]) -> None:
        self.name = name
        self.temp_dir = temp_dir
        self.env = env
        self.sid: int | None = None

    async def start(self, *args: str) -> None:
        proc = await asyncio.create_subprocess_exec(
            str(BIN / "ray"), "start", f"--temp-dir={self.temp_dir}", "--disable-usage-stats", *args,
            env=self.env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
        self.sid = proc.pid
        out, _ = await asyncio.wait_for(proc.communicate(), 180)
        if proc.returncode != 0:
            self.kill()
            raise RuntimeError(f"ray start ({self.name}) failed:\n{out.decode()[-3000:]}")

    def kill(self, sig: int = signal.SIGKILL) -> int:
        if self.sid is None:
            return 0
        pids = processes_of_session(self.sid)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                continue
        return len(pids)

    async def stop(self) -> None:
        if self.kill(signal.SIGTERM):
            for _ in range(20):
                await asyncio.sleep(0.1)
                if not processes_of_session(self.sid or -1):
                    return
        self.kill(signal.SIGKILL)


class Backend:
    """The webhook target of every tool: counts each order id it is asked for (a tool run)."""

    def __init__(self) -> None:
        self.hits: Counter[str] = Counter()
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _order(self, request: web.Request) -> web.Response:
        order_id = request.match_info["order_id"]
        self.hits[order_id] += 1
        return web.json_response({"order_id": order_id, "status": "shipped"})

    async def start(self) -> Backend:
        app = web.Application()
        app.router.add_get("/orders/{order_id}", self._order)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        await web.TCPSite(self._runner, BACKEND_HOST, 0).start()
        self.url = f"http://{BACKEND_HOST}:{self._runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


class Cluster:
    def __init__(self, root: Path, env: dict[str, str], address: str) -> None:
        self.root = root
        self.env = env  # for every driver: RAY_ADDRESS, the token, DATABASE_URL, CE_*
        self.address = address
        self.head: RayNode | None = None
        self.worker: RayNode | None = None
        self.gateway: asyncio.subprocess.Process | None = None
        self.url = ""

    async def probe(self) -> dict[str, Any]:
        """Nodes and every shard host's stats, read by a short-lived driver."""
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.e2e.test_cluster", "probe", env=self.env, cwd=str(ROOT),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == 0, err.decode()[-3000:]
        return json.loads(out.decode().strip().splitlines()[-1])

    async def operator(self, *args: str, **env: str) -> dict[str, Any]:
        """`chat-engine <args>` as an operator runs it (a driver of its own); its JSON report."""
        proc = await asyncio.create_subprocess_exec(
            str(BIN / "chat-engine"), *args, env={**self.env, **env}, cwd=str(self.root),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 180)
        assert proc.returncode == 0, (out.decode()[-2000:], err.decode()[-3000:])
        for line in reversed(out.decode().splitlines()):
            if line.startswith("{"):
                return json.loads(line)
        raise AssertionError(f"no report from chat-engine {args}: {out.decode()[-2000:]}")

    async def scale(self, shards: int) -> dict[str, Any]:
        return await self.operator("scale", str(shards))

    def gateway_log(self) -> str:
        path = self.root / "gateway.log"
        return path.read_text()[-4000:] if path.exists() else ""

    def gateway_errors(self) -> list[str]:
        """The gateway's error-level log lines (why a request was answered 500), newest last."""
        path = self.root / "gateway.log"
        lines = path.read_text(errors="replace").splitlines() if path.exists() else []
        return [line[:3000] for line in lines if '"level": "error"' in line or '"level":"error"' in line][-5:]


ROOT = Path(__file__).resolve().parents[2]


@pytest_asyncio.fixture(scope="module")
async def backend():
    b = await Backend().start()
    yield b
    await b.stop()


@pytest_asyncio.fixture(scope="module")
async def model():
    from app.local_model import start_local_model

    m = await start_local_model()
    yield m
    await m.stop()


@pytest_asyncio.fixture(scope="module")
async def cluster(fresh_db, model, backend):
    """Two Ray nodes, and `chat-engine serve` with two shard hosts, joined by RAY_ADDRESS."""
    from cryptography.fernet import Fernet

    root = Path(tempfile.mkdtemp(prefix="ceclu-", dir="/tmp"))  # short: Ray's socket paths
    token = secrets.token_hex(32)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "CE_", "DATABASE_URL", "ANTHROPIC_"))}
    ray_env = {
        **base, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token,
        # notice a lost node in ~5 s rather than ~30 s (read by the GCS on the head)
        "RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "5",
        "RAY_health_check_timeout_ms": "1000",
    }
    port = free_port(HEAD_IP)
    address = f"{HEAD_IP}:{port}"
    env = {
        **ray_env, "RAY_ADDRESS": address, "DATABASE_URL": await fresh_db(),
        "ANTHROPIC_BASE_URL": model.url, "CE_SECRET_KEY": Fernet.generate_key().decode(),
        "CE_WEBHOOK_ALLOW": f"{BACKEND_HOST}/32", "CE_SHARDS": "2", "CE_HOST": "127.0.0.1",
        "CE_PORT": str(free_port()), "CE_LOG_FORMAT": "json", "CE_LOG_LEVEL": "warning",
        "CE_FLUSH_INTERVAL_MS": "2", "CE_DATA_DIR": str(root / "data"), "PYTHONUNBUFFERED": "1",
        # These tests move sessions under traffic; admission is tested elsewhere. Fourteen
        # sessions sending back to back exceed the default 100 messages/s per tenant whenever
        # turns are quick, and a 429 would then read as a lost message.
        "CE_TENANT_RATE": "0",
    }
    c = Cluster(root, env, address)
    log = None
    try:
        c.head = RayNode("head", root / "head", ray_env)
        await c.head.start(
            "--head", f"--node-ip-address={HEAD_IP}", f"--port={port}", "--num-cpus=1",
            '--resources={"head": 1}', "--include-dashboard=false", f"--dashboard-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}", f"--metrics-export-port={free_port()}",
        )
        c.worker = RayNode("worker2", root / "w2", ray_env)
        await c.worker.start(
            f"--address={address}", f"--node-ip-address={WORKER_IP}", "--num-cpus=1",
            '--resources={"worker2": 1}', f"--dashboard-agent-listen-port={free_port()}",
            f"--metrics-export-port={free_port()}",
        )
        log = open(root / "gateway.log", "wb")  # noqa: ASYNC230, SIM115 - a local file; closed below
        c.gateway = await asyncio.create_subprocess_exec(
            str(BIN / "chat-engine"), "serve", env=env, cwd=str(root), stdout=log, stderr=log,
        )
        c.url = f"http://127.0.0.1:{env['CE_PORT']}"
        async with aiohttp.ClientSession() as http:
            deadline = time.monotonic() + 150
            while True:
                assert c.gateway.returncode is None, f"the gateway exited:\n{c.gateway_log()}"
                try:
                    async with http.get(f"{c.url}/readyz") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                assert time.monotonic() < deadline, f"the gateway never got ready:\n{c.gateway_log()}"
                await asyncio.sleep(0.5)
        yield c
    finally:
        if c.gateway is not None and c.gateway.returncode is None:
            c.gateway.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(c.gateway.wait(), 15)
            except TimeoutError:
                c.gateway.kill()
                await c.gateway.wait()
        for node in (c.worker, c.head):
            if node is not None:
                await node.stop()
        if log is not None:
            log.close()
        if os.environ.get("KEEP_CLUSTER_ROOT"):  # to read the nodes' and the gateway's logs afterwards
            print("kept", root)
        else:
            shutil.rmtree(root, ignore_errors=True)


@pytest_asyncio.fixture(scope="module")
async def db(cluster):
    from storage.pool import create_pool

    pool = await create_pool(cluster.env["DATABASE_URL"], min_size=1, max_size=4)
    yield pool
    await pool.close()


@pytest_asyncio.fixture(scope="module")
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


@pytest_asyncio.fixture(scope="module")
async def tenant(cluster, db, http, backend):
    """A tenant with `check_order` and the one-shot `mark<k>` tools, all webhooks to the backend."""
    from storage.repos import TenantRepo

    t, key = await TenantRepo(db).create_tenant(f"cluster-{secrets.token_hex(3)}")
    headers = {"Authorization": f"Bearer {key.api_key}"}
    params = {"order_id": {"type": "string", "description": "The order number"}}
    bodies = [{"name": "check_order", "description": "Look up an order by its number.", "parameters": params,
               "webhook_url": f"{backend.url}/orders/{{order_id}}", "timeout_ms": 10000}]
    bodies += [{"name": f"mark{k}", "description": f"Mark step {k} of the order as done, once.",
                "parameters": params, "webhook_url": f"{backend.url}/orders/{{order_id}}",
                "timeout_ms": 10000, "completes_variable": f"mark{k}"} for k in range(MARKS)]
    for body in bodies:
        async with http.post(f"{cluster.url}/v1/tools", headers=headers, json=body) as r:
            assert r.status == 201, await r.text()
    return t.id, headers


# -- traffic --------------------------------------------------------------------------------------


def message(session_id: str, k: int) -> tuple[str, Counter]:
    """Message k of a session: check_order for its own order id, plus mark<k> while k < MARKS.
    Returns the text and the (tool, success) calls its reply must report."""
    calls = [("check_order", {"order_id": f"{session_id}-{k}"})]
    if k < MARKS:
        calls.append((f"mark{k}", {"order_id": f"{session_id}-{k}-mark"}))
    text = "\n".join(f"/call {name} {json.dumps(args)}" for name, args in calls)
    return text, Counter((name, True) for name, _ in calls)


class Sent:
    def __init__(self, session_id: str, k: int) -> None:
        self.session_id = session_id
        self.k = k
        self.message_id = f"{session_id}-m{k}"
        self.reply: dict[str, Any] | None = None
        self.failures: list[tuple[int, str | None]] = []  # status (0: no response), Retry-After
        self.acked_at = 0.0


class Traffic:
    """Each session sends its messages one after another until told to stop; a 503 (or a
    connection error) is retried with the same message_id, honouring Retry-After."""

    def __init__(self, http: aiohttp.ClientSession, cluster: Cluster, headers: dict, sessions: list[str]) -> None:
        self.http, self.url, self.headers, self.sessions = http, cluster.url, headers, sessions
        self.cluster = cluster
        self.sent: dict[str, list[Sent]] = {s: [] for s in sessions}
        self.stop = asyncio.Event()
        self.errors: list[str] = []
        self._tasks: list[asyncio.Task] = []

    async def __aenter__(self) -> Self:
        self._tasks = [asyncio.create_task(self._conversation(s)) for s in self.sessions]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop.set()
        for task in self._tasks:  # a failed test: do not leave them talking to a closed client
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _conversation(self, session_id: str) -> None:
        k = 0
        while not self.stop.is_set():
            sent = Sent(session_id, k)
            self.sent[session_id].append(sent)
            text, _ = message(session_id, k)
            deadline = time.monotonic() + 90
            while sent.reply is None:
                try:
                    async with self.http.post(
                        f"{self.url}/v1/sessions/{session_id}/messages", headers=self.headers,
                        json={"text": text, "message_id": sent.message_id},
                    ) as r:
                        body = await r.json(content_type=None)
                        status, retry_after = r.status, r.headers.get("Retry-After")
                except (aiohttp.ClientError, TimeoutError):
                    status, retry_after, body = 0, None, None
                if status == 200:
                    sent.reply, sent.acked_at = body, time.monotonic()
                    break
                sent.failures.append((status, retry_after))
                if status not in (0, 503) or time.monotonic() > deadline:
                    self.errors.append(f"{sent.message_id}: {status} {body}")
                    return
                await asyncio.sleep(min(float(retry_after or 0.5), 1.0))
            k += 1
            await asyncio.sleep(0.05)

    def failed(self) -> dict[str, list[str]]:
        """The failed requests, with the gateway's error log lines that say why."""
        return {"requests": self.errors, "gateway errors": self.cluster.gateway_errors()}

    def acked(self, session_id: str, after: float = 0.0) -> int:
        return sum(1 for s in self.sent[session_id] if s.reply is not None and s.acked_at > after)

    async def until(self, predicate, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert not self.errors, self.failed()
            assert time.monotonic() < deadline, {s: self.acked(s) for s in self.sessions}
            await asyncio.sleep(0.1)

    async def finish(self) -> list[Sent]:
        self.stop.set()
        await asyncio.wait_for(asyncio.gather(*self._tasks), 120)
        assert not self.errors, self.failed()
        return [s for sents in self.sent.values() for s in sents]


async def stored(db, tenant_id: str) -> dict[str, dict[str, Any]]:
    """Per session key: epoch, message_count, seqs, variables, history rows and tool calls by
    message_id, stored turns."""
    out: dict[str, dict[str, Any]] = {}
    by_uid: dict[str, dict[str, Any]] = {}
    async with db.acquire() as conn:
        for r in await conn.fetch("SELECT id, session_key, epoch, message_count FROM ce_sessions WHERE tenant_id = $1",
                                  tenant_id):
            out[r["session_key"]] = by_uid[r["id"]] = {
                "epoch": r["epoch"], "message_count": r["message_count"], "seqs": [], "variables": {},
                "rows": Counter(), "calls": {}, "turns": set()}
        for r in await conn.fetch("SELECT session_id, key, value FROM ce_session_variables WHERE tenant_id = $1",
                                  tenant_id):
            by_uid[r["session_id"]]["variables"][r["key"]] = r["value"]
        for r in await conn.fetch("SELECT session_id, seq, message_id FROM ce_messages WHERE tenant_id = $1 "
                                  "ORDER BY session_id, seq", tenant_id):
            by_uid[r["session_id"]]["seqs"].append(r["seq"])
            by_uid[r["session_id"]]["rows"][r["message_id"]] += 1
        for r in await conn.fetch("SELECT session_id, message_id, tool_name, success FROM ce_tool_calls "
                                  "WHERE tenant_id = $1", tenant_id):
            by_uid[r["session_id"]]["calls"].setdefault(r["message_id"], Counter())[(r["tool_name"], r["success"])] += 1
        for r in await conn.fetch("SELECT session_id, message_id FROM ce_turns WHERE tenant_id = $1", tenant_id):
            by_uid[r["session_id"]]["turns"].add(r["message_id"])
    return out


def check_stored(tenant_id: str, db_state: dict[str, dict[str, Any]], sent: list[Sent], backend: Backend) -> None:
    """Every acknowledged message is in Postgres exactly once and agrees with its reply; the
    session variables are what its messages set; a tool ran twice only for a message that failed."""
    by_session: dict[str, list[Sent]] = {}
    for s in sent:
        if s.reply is not None:
            by_session.setdefault(s.session_id, []).append(s)
    for session_id, turns in by_session.items():
        row = db_state[session_id]
        n = len(turns)
        assert [t.k for t in turns] == list(range(n)), session_id  # acked in order, none skipped
        assert row["message_count"] == MESSAGES_PER_TURN * n, (session_id, row["message_count"], n)
        assert row["seqs"] == list(range(MESSAGES_PER_TURN * n)), session_id
        assert row["turns"] == {t.message_id for t in turns}, session_id
        for t in turns:
            _, expected = message(session_id, t.k)
            assert Counter((c["name"], c["success"]) for c in t.reply["tool_calls"]) == expected, t.reply
            assert row["rows"][t.message_id] == MESSAGES_PER_TURN, (t.message_id, row["rows"][t.message_id])
            assert row["calls"].get(t.message_id) == expected, (t.message_id, row["calls"].get(t.message_id))
            orders = [f"{session_id}-{t.k}"] + ([f"{session_id}-{t.k}-mark"] if t.k < MARKS else [])
            for order in orders:
                if t.failures:
                    assert backend.hits[order] >= 1, order
                else:  # answered at the first attempt: its tools ran exactly once
                    assert backend.hits[order] == 1, (order, backend.hits[order])
        assert row["variables"] == {f"mark{k}": "true" for k in range(min(n, MARKS))}, (session_id, row["variables"])


def pick_sessions(tenant_id: str, prefix: str, want: dict[str, int], classify) -> dict[str, list[str]]:
    """Session ids of this tenant sorted into the classes `classify(session_id)` returns, `want`
    of each (rendezvous hashing is deterministic, the tenant id is not)."""
    found: dict[str, list[str]] = {c: [] for c in want}
    for i in range(100_000):
        if all(len(found[c]) >= n for c, n in want.items()):
            return found
        sid = f"{prefix}-{i}"
        c = classify(sid)
        if c in found and len(found[c]) < want[c]:
            found[c].append(sid)
    raise AssertionError(f"could not find sessions for {want}")


def host_of(tenant_id: str, session_id: str, shards: int) -> int:
    return rendezvous_index(f"{tenant_id}:{session_id}", shards)


# -- tests ------------------------------------------------------------------------------------------


async def test_session_hosts_spread_over_both_nodes_and_chat_flows_through_each(cluster, tenant, http, db, backend):
    tenant_id, headers = tenant
    probe = await cluster.probe()
    nodes = {n["ip"]: n for n in probe["nodes"] if n["alive"]}
    assert set(nodes) == {HEAD_IP, WORKER_IP}, probe["nodes"]
    hosts = probe["hosts"]
    assert set(hosts) == {"ce-host-0", "ce-host-1"}, hosts
    assert {h["node_id"] for h in hosts.values()} == {nodes[HEAD_IP]["node_id"], nodes[WORKER_IP]["node_id"]}
    assert all(h["shards"] == 2 for h in hosts.values())

    sessions = pick_sessions(tenant_id, "spread", {0: 2, 1: 2}, lambda s: host_of(tenant_id, s, 2))
    async with Traffic(http, cluster, headers, [s for ss in sessions.values() for s in ss]) as traffic:
        await traffic.until(lambda: all(traffic.acked(s) >= 2 for s in traffic.sessions))
        sent = await traffic.finish()
    assert all(not s.failures for s in sent)
    probe = await cluster.probe()
    for index in (0, 1):  # each host, one per node, holds the sessions routed to it
        assert probe["hosts"][f"ce-host-{index}"]["live_sessions"] >= len(sessions[index])
    check_stored(tenant_id, await stored(db, tenant_id), sent, backend)


async def test_rescaling_2_4_3_under_traffic_moves_each_session_once_and_loses_or_repeats_nothing(
    cluster, tenant, http, db, backend
):
    tenant_id, headers = tenant

    def path(sid: str) -> tuple[int, int, int]:
        return host_of(tenant_id, sid, 2), host_of(tenant_id, sid, 4), host_of(tenant_id, sid, 3)

    def classify(sid: str) -> str:
        two, four, three = path(sid)
        if two == four == three:
            return "stays"
        if two != four and three == two:
            return "moves_back"  # 2->4 moves it to a new host, 4->3 brings it home
        return "moves"

    picked = pick_sessions(tenant_id, "rs", {"stays": 4, "moves_back": 4, "moves": 6}, classify)
    sessions = [s for ss in picked.values() for s in ss]
    moves = {s: (path(s)[0] != path(s)[1]) + (path(s)[1] != path(s)[2]) for s in sessions}

    async with Traffic(http, cluster, headers, sessions) as traffic:
        await traffic.until(lambda: all(traffic.acked(s) >= 2 for s in sessions))
        async with db.acquire() as conn:  # every session activated so far is live (idle time: 300 s)
            live = [(r["tenant_id"], r["session_key"]) for r in await conn.fetch(
                "SELECT tenant_id, session_key FROM ce_sessions")]

        def index(t: str, k: str, n: int) -> int:
            return rendezvous_index(f"{t}:{k}", n)

        def busy(t: str, k: str) -> bool:  # has messages all along, so it is live after every move
            return t == tenant_id and k in sessions

        up = await cluster.scale(4)
        print(f"scale 2 -> 4: {up}")  # shown with -s, and in the report of a failure
        assert (up["before"], up["after"]) == (2, 4) and up["started"] == ["ce-host-2", "ce-host-3"], up
        assert up["retired"] == []
        # the old hosts released exactly the live sessions that moved, nothing else
        assert up["released"] == sum(1 for t, k in live if index(t, k, 2) != index(t, k, 4)) > 0, up
        # a moved idle session is in no host's memory until its next message
        live = [(t, k) for t, k in live if busy(t, k) or index(t, k, 2) == index(t, k, 4)]
        mark = time.monotonic()
        await traffic.until(lambda: all(traffic.acked(s, after=mark) >= 2 for s in sessions))

        down = await cluster.scale(3)
        print(f"scale 4 -> 3: {down}")
        assert (down["before"], down["after"], down["started"], down["retired"]) == (4, 3, [], ["ce-host-3"]), down
        assert down["released"] == sum(1 for t, k in live if index(t, k, 4) != index(t, k, 3)) > 0, down
        live = [(t, k) for t, k in live if busy(t, k) or index(t, k, 4) == index(t, k, 3)]
        mark = time.monotonic()
        await traffic.until(lambda: all(traffic.acked(s, after=mark) >= 2 for s in sessions))
        sent = await traffic.finish()

    assert [s.failures for s in sent if s.failures] == []  # the gateway re-routed; no client saw a move
    db_state = await stored(db, tenant_id)
    check_stored(tenant_id, db_state, sent, backend)
    for s in sessions:  # one activation per host the session lived on: never two at once, none stale
        assert db_state[s]["epoch"] == 1 + moves[s], (s, path(s), db_state[s]["epoch"])
    for s in sessions:  # through the gateway too: the live copy on the session's current host
        async with http.get(f"{cluster.url}/v1/sessions/{s}", headers=headers) as r:
            view = await r.json()
        assert view["variables"] == db_state[s]["variables"] and view["messages"] == db_state[s]["message_count"]

    probe = await cluster.probe()
    assert set(probe["hosts"]) == {"ce-host-0", "ce-host-1", "ce-host-2"}, probe["hosts"]
    assert {h["shards"] for h in probe["hosts"].values()} == {3}
    for name, host in probe["hosts"].items():
        mine = [k for t, k in live if f"ce-host-{index(t, k, 3)}" == name]
        assert host["live_sessions"] == len(mine), (name, host, mine)  # nothing left behind
    async with db.acquire() as conn:
        row = await conn.fetchrow("SELECT shards, pending, generation FROM ce_cluster WHERE host_group = ''")
    assert (row["shards"], row["pending"]) == (3, None) and row["generation"] == down["generation"]


async def test_restart_hosts_rolls_every_host_onto_new_settings_while_traffic_flows(cluster, tenant, http, db, backend):
    tenant_id, headers = tenant
    before = await cluster.probe()
    sessions = [f"rh-{i}" for i in range(8)]
    async with Traffic(http, cluster, headers, sessions) as traffic:
        await traffic.until(lambda: all(traffic.acked(s) >= 2 for s in sessions))
        started = time.monotonic()
        report = await cluster.operator("restart-hosts", CE_FLUSH_INTERVAL_MS="3")
        print(f"restart-hosts: {report} in {time.monotonic() - started:.1f} s (driver start included)")
        mark = time.monotonic()
        await traffic.until(lambda: all(traffic.acked(s, after=mark) >= 2 for s in sessions))
        sent = await traffic.finish()

    assert report["restarted"] == sorted(before["hosts"]), report
    after = await cluster.probe()
    assert set(after["hosts"]) == set(before["hosts"])
    for name, host in after["hosts"].items():
        assert host["pid"] != before["hosts"][name]["pid"], name
        assert host["settings"]["flush_interval_ms"] == 3.0 != before["hosts"][name]["settings"]["flush_interval_ms"]
        assert host["settings"]["shards"] == host["shards"]  # the stored count came along
    failures = [f for s in sent for f in s.failures]
    assert all(status == 503 and ra is not None for status, ra in failures), failures
    db_state = await stored(db, tenant_id)
    check_stored(tenant_id, db_state, sent, backend)
    for s in sessions:  # flushed by the old process, activated once by the new one
        assert db_state[s]["epoch"] == 2, (s, db_state[s]["epoch"])


async def test_losing_the_second_node_mid_traffic_loses_nothing_and_its_sessions_answer_from_the_head(
    cluster, tenant, http, db, backend
):
    tenant_id, headers = tenant
    before = await cluster.probe()
    nodes = {n["ip"]: n["node_id"] for n in before["nodes"] if n["alive"]}
    assert set(nodes) == {HEAD_IP, WORKER_IP}
    shards = {h["shards"] for h in before["hosts"].values()}
    assert len(shards) == 1
    shards_n = shards.pop()
    on_worker = {int(name.rsplit("-", 1)[1]) for name, h in before["hosts"].items() if h["node_id"] == nodes[WORKER_IP]}
    assert on_worker and len(on_worker) < shards_n, before["hosts"]  # hosts on both nodes

    picked = pick_sessions(tenant_id, "nl", {"worker": 5, "head": 5},
                           lambda s: "worker" if host_of(tenant_id, s, shards_n) in on_worker else "head")
    sessions = picked["worker"] + picked["head"]
    async with Traffic(http, cluster, headers, sessions) as traffic:
        await traffic.until(lambda: all(traffic.acked(s) >= 2 for s in sessions))
        killed_at = time.monotonic()
        assert cluster.worker is not None and cluster.worker.kill() > 0  # raylet, agents, host workers
        await traffic.until(lambda: all(traffic.acked(s, after=killed_at) >= 3 for s in sessions), timeout=150)
        sent = await traffic.finish()

    after = await cluster.probe()
    alive = {n["ip"] for n in after["nodes"] if n["alive"]}
    assert alive == {HEAD_IP}, after["nodes"]
    assert set(after["hosts"]) == set(before["hosts"])
    for name, host in after["hosts"].items():
        assert host["node_id"] == nodes[HEAD_IP], (name, host)
        if int(name.rsplit("-", 1)[1]) in on_worker:
            assert host["pid"] != before["hosts"][name]["pid"]  # restarted by Ray on the head

    failures = [f for s in sent for f in s.failures]
    recovered = min(s.acked_at for s in sent if s.acked_at > killed_at and s.session_id in picked["worker"])
    print(f"node loss: {len(failures)} failed attempts; first answer from a restarted host after "
          f"{recovered - killed_at:.1f} s")
    assert failures, "the kill should have been felt by the sessions on the lost node"
    assert all(status in (0, 503) for status, _ in failures), failures
    assert all(ra is not None for status, ra in failures if status == 503), failures
    assert {s.session_id for s in sent if s.failures} <= set(picked["worker"])
    db_state = await stored(db, tenant_id)
    check_stored(tenant_id, db_state, sent, backend)
    for s in picked["worker"]:  # re-activated from Postgres by the restarted host: one new lease
        assert db_state[s]["epoch"] == 2, (s, db_state[s]["epoch"])
        assert traffic.acked(s, after=killed_at) >= 3
    for s in picked["head"]:
        assert db_state[s]["epoch"] == 1, (s, db_state[s]["epoch"])


# -- the probe: a short-lived driver, run as `python -m tests.e2e.test_cluster probe` ----------------


def _probe() -> None:
    import ray

    ray.init(address=os.environ["RAY_ADDRESS"], namespace="chat-engine", logging_level="ERROR",
             log_to_driver=False)
    try:
        nodes = [{"node_id": n["NodeID"], "ip": n["NodeManagerAddress"], "alive": n["Alive"]} for n in ray.nodes()]
        hosts = {}
        for name in sorted(ray.util.list_named_actors()):
            if name.startswith("ce-host-"):
                actor = ray.get_actor(name)
                hosts[name] = ray.get(actor.stats.remote(), timeout=60)
                hosts[name]["settings"] = json.loads(ray.get(actor.encoded_settings.remote(), timeout=60))
        print(json.dumps({"nodes": nodes, "hosts": hosts}), flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__" and sys.argv[1:] == ["probe"]:
    _probe()
