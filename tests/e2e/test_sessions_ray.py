"""Session actors on Ray, end to end (issue 4): the real gateway, local Ray hosts, Postgres, the local
model and the demo store, driven with `/call` lines so every tool call is known in advance.

- load: 200 sessions x 3 messages at ~50 in flight through the sharded hosts; Postgres, the session
  view and the replies agree, every acknowledged tool call is stored exactly once;
- crash: kill -9 of a host mid-load; Ray restarts it, its sessions re-activate from Postgres, nothing
  acknowledged is lost, failed requests are 503 + Retry-After and a retry with the same message_id
  succeeds without recording tools twice;
- fencing: activations racing out of band with a live host; exactly one epoch wins each write, the
  stale host writes nothing and the retried message succeeds on a re-activated copy;
- placements: the same conversations through sharded hosts and dedicated per-session actors;
- passivation through Ray: variables, history and one-shot completion survive re-activation; a
  passivated dedicated session's process exits, reading it starts none, the next message brings it back.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter

import msgspec
import pytest
import pytest_asyncio
import ray

from actors.placement import NAMESPACE, SESSION_PREFIX
from actors.ray_host import DEDICATED_POOL_SIZE
from app.stack import DEMO_STORE_HOST
from kernel.errors import Overloaded
from kernel.records import SessionDelta, session_uid
from tests.support.e2e import (
    MESSAGES_PER_TOOL_TURN,
    NOTED,
    HoldingStore,
    Sent,
    call_lines,
    calls_of,
    check_conversations,
    db_state,
    register_hold_tool,
    register_order_tools,
    script,
    send,
)

pytestmark = pytest.mark.e2e


@pytest_asyncio.fixture(scope="module")
async def db(stack):
    """A small pool on the stack's database, for reading what the hosts wrote."""
    from storage.pool import create_pool

    p = await create_pool(stack.settings.database_url, min_size=1, max_size=4)
    try:
        yield p
    finally:
        await p.close()


async def converse(client, url: str, headers: dict, sessions: list[str], *, concurrency: int,
                   retries: int = 0, on_ack=None) -> list[Sent]:
    """Run script(i) for every session (its messages in order), at most `concurrency` messages in
    flight across sessions; returns every message's Sent, in session order."""
    sem = asyncio.Semaphore(concurrency)

    async def conversation(i: int, session_id: str) -> list[Sent]:
        out = []
        for k, (text, _expected) in enumerate(script(i)):
            async with sem:
                sent = await send(client, url, headers, session_id, text, f"{session_id}-m{k}", retries=retries)
            out.append(sent)
            if sent.reply is None:
                break  # the conversation cannot go on; the caller's checks say why
            if on_ack is not None:
                on_ack(sent)
        return out

    results = await asyncio.gather(*(conversation(i, s) for i, s in enumerate(sessions)))
    return [s for conv in results for s in conv]


def check_replies(sessions: list[str], sent: list[Sent]) -> None:
    """Every message was answered, with exactly the tool calls its script implies."""
    by_id = {s.message_id: s for s in sent}
    for i, session_id in enumerate(sessions):
        for k, (_text, expected) in enumerate(script(i)):
            s = by_id.get(f"{session_id}-m{k}")
            assert s is not None and s.reply is not None, (session_id, k, s and s.failures)
            r = s.reply
            assert (r["session_id"], r["message_id"]) == (session_id, s.message_id)
            assert calls_of(r) == expected, (session_id, k, r["tool_calls"])
            assert r["rounds"] == 2 and r["handoff"] is False
            if k == 2:  # the one-shot tool is refused in-band: the session remembers it ran
                assert "already done" in r["tool_calls"][0]["error"], r["tool_calls"][0]


async def views(client, url: str, headers: dict, sessions: list[str]) -> dict[str, dict]:
    sem = asyncio.Semaphore(20)

    async def one(sid: str) -> tuple[str, dict]:
        async with sem, client.get(f"{url}/v1/sessions/{sid}", headers=headers) as r:
            assert r.status == 200, await r.text()
            return sid, await r.json()

    return dict(await asyncio.gather(*(one(s) for s in sessions)))


def check_views(db_rows: dict, seen: dict[str, dict], expected_messages: int) -> None:
    for sid, view in seen.items():
        row = db_rows[sid]
        assert view == {"session_id": sid, "variables": row["variables"], "open_breakers": [],
                        "handoff": False, "messages": row["message_count"]}, (sid, view, row)
        assert view["messages"] == expected_messages


async def host_pids(placement) -> dict[str, int]:
    return {s["host"]: s["pid"] for s in await placement.stats()}


async def wait_for_hosts(placement, *, not_pid: dict[str, int] | None = None, timeout: float = 90.0) -> dict[str, int]:
    """Poll host stats until every shard answers (with a new pid where `not_pid` says)."""
    deadline = time.monotonic() + timeout
    while True:
        pids = await host_pids(placement)
        back = len(pids) == placement.shards and all(
            name in pids and pids[name] != pid for name, pid in (not_pid or {}).items()
        )
        if back:
            return pids
        assert time.monotonic() < deadline, f"hosts not back after {timeout}s: {pids}"
        await asyncio.sleep(0.2)


# -- 1. load ----------------------------------------------------------------------------------

async def test_the_local_ray_under_the_stack_is_on_loopback(stack):
    # Left to itself Ray binds the machine's interface address; the engine keeps a local Ray on
    # loopback (services/__init__.py). Its nodes, its GCS and every session host answer there.
    nodes = [n for n in ray.nodes() if n["Alive"]]
    assert nodes and all(n["NodeManagerAddress"] == "127.0.0.1" for n in nodes), nodes
    assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")
    hosts = await stack.placement.stats()
    assert hosts and {h["node_id"] for h in hosts} <= {n["NodeID"] for n in nodes}, hosts


async def test_session_hosts_run_at_normal_priority_not_rays_worker_niceness(stack):
    # Ray starts workers at niceness 15, behind Postgres, the gateway and Ray's daemons on the
    # same cores; the engine's local Ray starts them at 0 (services/__init__.py).
    hosts = await stack.placement.stats()
    assert hosts and all(h["niceness"] == 0 for h in hosts), hosts
    for h in hosts:  # every thread of the host process, as the kernel sees it
        for tid in os.listdir(f"/proc/{h['pid']}/task"):
            assert os.getpriority(os.PRIO_PROCESS, int(tid)) == 0, (h["host"], tid)


async def test_session_hosts_run_with_the_servers_collector_threshold(stack):
    from services.heap import YOUNG_THRESHOLD

    hosts = await stack.placement.stats()
    assert hosts and all(h["gc_threshold"] == YOUNG_THRESHOLD for h in hosts), hosts
    assert all(isinstance(h["gc_collections"], int) and h["gc_collections"] >= 0 for h in hosts), hosts


async def test_200_sessions_x_3_messages_through_sharded_hosts_are_stored_exactly_once(stack, client, tenant, db):
    tenant_id, _key, headers = tenant
    url = stack.gateway.url
    await register_order_tools(client, url, headers, stack.demo_store.url)
    sessions = [f"load-{i}" for i in range(200)]
    pids_before = await wait_for_hosts(stack.placement)

    sent = await converse(client, url, headers, sessions, concurrency=50)

    assert [s.failures for s in sent if s.failures] == []
    assert len(sent) == 600
    check_replies(sessions, sent)
    rows = await db_state(db, tenant_id)
    assert set(rows) == set(sessions)
    check_conversations(tenant_id, rows, sent, MESSAGES_PER_TOOL_TURN)
    assert all(r["epoch"] == 1 for r in rows.values())  # one activation each, no host restarted
    assert await host_pids(stack.placement) == pids_before
    # GET /v1/sessions/{id} (answered by the live actor) agrees with Postgres
    check_views(rows, await views(client, url, headers, sessions), 3 * MESSAGES_PER_TOOL_TURN)
    # and the load was spread over the shard hosts
    spread = Counter(stack.placement.actor_name(tenant_id, s) for s in sessions)
    assert len(spread) == stack.placement.shards and min(spread.values()) > 20, spread


# -- 2. kill -9 a host mid-load ------------------------------------------------------------------

async def test_a_host_killed_mid_load_restarts_and_nothing_acknowledged_is_lost(stack, client, tenant, db):
    tenant_id, _key, headers = tenant
    url = stack.gateway.url
    await register_order_tools(client, url, headers, stack.demo_store.url)
    holding = await HoldingStore().start(DEMO_STORE_HOST)
    try:
        await register_hold_tool(client, url, headers, holding.url)
        await _kill_mid_load_then_crash_loop(stack, client, tenant_id, headers, db, holding)
    finally:
        await holding.stop()
        await wait_for_hosts(stack.placement)  # whatever happened, the hosts are back for the next test


async def _kill_mid_load_then_crash_loop(stack, client, tenant_id, headers, db, holding) -> None:
    url = stack.gateway.url
    sessions = [f"crash-{i}" for i in range(60)]
    host_of = {s: stack.placement.actor_name(tenant_id, s) for s in sessions}
    pids = await wait_for_hosts(stack.placement)
    acked: list[tuple[float, Sent]] = []
    enough = asyncio.Event()

    def on_ack(s: Sent) -> None:
        acked.append((time.monotonic(), s))
        if len(acked) >= 45:
            enough.set()

    # A. kill -9 while 20 messages are in flight
    traffic = asyncio.create_task(
        converse(client, url, headers, sessions, concurrency=20, retries=30, on_ack=on_ack)
    )
    await asyncio.wait_for(enough.wait(), 60)
    victim = max(pids, key=lambda h: sum(1 for _t, s in acked if host_of[s.session_id] == h))
    live_before = {s.session_id for _t, s in acked if host_of[s.session_id] == victim}
    killed_at = time.monotonic()
    os.kill(pids[victim], signal.SIGKILL)
    sent = await asyncio.wait_for(traffic, 120)
    restarted = await wait_for_hosts(stack.placement, not_pid={victim: pids[victim]})

    after = [s for t, s in acked if t > killed_at]
    assert any(host_of[s.session_id] == victim for s in after), "the restarted host served nothing"
    failures = [(s.message_id, f) for s in sent for f in s.failures]
    assert all(st == 503 and ra and int(ra) >= 1 for _m, (st, ra, _b) in failures), failures
    check_replies(sessions, sent)
    rows = await db_state(db, tenant_id)
    check_conversations(tenant_id, rows, sent, MESSAGES_PER_TOOL_TURN)
    # the victim's sessions came back from Postgres under a new lease; the other host's did not move
    for s in sessions:
        if s in live_before:
            assert rows[s]["epoch"] >= 2, (s, rows[s]["epoch"])
        elif host_of[s] != victim:
            assert rows[s]["epoch"] == 1, (s, rows[s]["epoch"])
    # a message acknowledged before the crash, sent again: the first answer, nothing runs again
    early = next(s for t, s in acked if t < killed_at and host_of[s.session_id] == victim)
    again = await send(client, url, headers, early.session_id, "ignored: the message_id was answered", early.message_id)
    assert again.reply == early.reply
    assert await db_state(db, tenant_id) == rows

    # B. a host that dies twice under the same turns: the gateway's one retry is spent, the client
    # gets 503 + Retry-After, retries the same message_id and is answered once the host is back
    held = [s for s in sessions if host_of[s] == victim][:3]
    texts = {s: call_lines(("check_order", {"order_id": f"77{i}"}), ("hold_order", {"order_id": f"77{i}"}))
             for i, s in enumerate(held)}
    watch = {s: Sent(s, f"{s}-m3") for s in held}
    tasks = [asyncio.create_task(send(client, url, headers, s, texts[s], f"{s}-m3", retries=20, sent=watch[s]))
             for s in held]
    await holding.wait_hits(len(held), 60)  # the turns are inside their tools on the host
    os.kill(restarted[victim], signal.SIGKILL)
    await holding.wait_hits(2 * len(held), 90)  # the gateway retried them into the restarted host
    second = await wait_for_hosts(stack.placement, not_pid={victim: restarted[victim]})
    os.kill(second[victim], signal.SIGKILL)
    deadline = time.monotonic() + 90
    while not all(w.failures for w in watch.values()):
        assert time.monotonic() < deadline and not any(t.done() for t in tasks), {s: w.failures for s, w in watch.items()}
        await asyncio.sleep(0.05)
    holding.release()
    done = await asyncio.wait_for(asyncio.gather(*tasks), 120)
    await wait_for_hosts(stack.placement, not_pid={victim: second[victim]})

    for d in done:
        assert d.reply is not None, d.failures
        assert calls_of(d.reply) == [("check_order", True), ("hold_order", True)], d.reply
        assert d.failures and all(st == 503 and ra == "1" for st, ra, _b in d.failures), d.failures
        assert all("retry" in b["detail"] for _st, _ra, b in d.failures)
    # the tool ran in three activations with one idempotency key; Postgres holds it once
    for i, s in enumerate(held):
        keys = holding.keys[f"77{i}"]
        assert len(keys) == 3 and len(set(keys)) == 1 and keys[0].startswith(f"{s}-m3:"), keys
    rows = await db_state(db, tenant_id)
    check_conversations(tenant_id, rows, sent + done, MESSAGES_PER_TOOL_TURN)
    # and a repeat of an answered held message is the stored answer: no fourth call to the backend
    again = await send(client, url, headers, held[0], texts[held[0]], f"{held[0]}-m3")
    assert again.reply == done[0].reply and len(holding.keys["770"]) == 3
    print(f"\nkill -9 {victim} x3: {len(failures)} 503s in the load, {len(after)} acknowledged after the "
          f"first kill, {len(live_before)} sessions re-activated, {sum(len(d.failures) for d in done)} 503s "
          "in the crash loop")


# -- 3. racing activations and fencing -------------------------------------------------------------

async def test_racing_activations_fence_the_live_host_and_one_epoch_wins_each_write(stack, client, tenant, db):
    from storage.repos import SessionRepo

    tenant_id, _key, headers = tenant
    url = stack.gateway.url
    await register_order_tools(client, url, headers, stack.demo_store.url)
    repo = SessionRepo(db)
    sid = "race-1"
    check = call_lines(("check_order", {"order_id": "31337"}))

    first = await send(client, url, headers, sid, call_lines(("note_order", {"order_id": "31337"})), "race-m0")
    assert first.reply is not None and calls_of(first.reply) == [("note_order", True)], first.failures
    held = await repo.current_epoch(tenant_id, sid)
    assert held == 1  # the host's lease

    # five activations race out of band while the host still holds the session in memory
    racers = await asyncio.gather(*(repo.activate(tenant_id, sid, f"racer-{i}") for i in range(5)))
    epochs = sorted(a.epoch for a in racers)
    assert epochs == list(range(held + 1, held + 6))  # each took its own lease, one after another
    winner = max(racers, key=lambda a: a.epoch)
    assert winner.variables == {NOTED: "true"} and len(winner.history) == MESSAGES_PER_TOOL_TURN

    def probe(a) -> SessionDelta:
        return SessionDelta(tenant_id=tenant_id, session_id=sid, epoch=a.epoch, snapshot=a.snapshot,
                            variables={"probe": f"epoch-{a.epoch}"})

    results = await asyncio.gather(*(repo.flush([probe(a)]) for a in racers))
    won = [a.epoch for a, r in zip(racers, results, strict=True) if r.written]
    assert won == [winner.epoch]
    assert all(r.refused == [(tenant_id, sid)] for a, r in zip(racers, results, strict=True) if a is not winner)

    # the host's next turn runs on its stale copy: its flush is refused, the client gets 503
    stale = await send(client, url, headers, sid, check, "race-m1")
    assert stale.reply is None
    [(status, retry_after, body)] = stale.failures
    assert status == 503 and retry_after == "1", stale.failures
    assert "taken over" in body["detail"] and body["status"] == 503
    rows = (await db_state(db, tenant_id))[sid]
    assert rows["epoch"] == winner.epoch  # the refused writer did not take the lease back
    assert "race-m1" not in rows["message_ids"] and "race-m1" not in rows["turns"] and "race-m1" not in rows["calls"]
    assert rows["seqs"] == list(range(MESSAGES_PER_TOOL_TURN)) and rows["message_count"] == MESSAGES_PER_TOOL_TURN
    assert rows["variables"] == {NOTED: "true", "probe": f"epoch-{winner.epoch}"}

    # the same message again: the host re-activates from Postgres (a newer lease) and succeeds
    retried = await send(client, url, headers, sid, check, "race-m1")
    assert retried.failures == [] and calls_of(retried.reply) == [("check_order", True)]
    rows = (await db_state(db, tenant_id))[sid]
    assert rows["epoch"] == winner.epoch + 1
    assert rows["calls"]["race-m1"] == Counter({("check_order", True): 1})  # the stale run left nothing
    assert rows["message_ids"]["race-m1"] == MESSAGES_PER_TOOL_TURN
    assert rows["seqs"] == list(range(2 * MESSAGES_PER_TOOL_TURN))
    # the re-activated copy sees the winner's write, and the former winner is now the stale one
    async with client.get(f"{url}/v1/sessions/{sid}", headers=headers) as r:
        view = await r.json()
    assert view["variables"] == {NOTED: "true", "probe": f"epoch-{winner.epoch}"}
    assert view["messages"] == 2 * MESSAGES_PER_TOOL_TURN
    late = await repo.flush([msgspec.structs.replace(probe(winner), variables={"probe": "late"})])
    assert late.written == [] and late.refused == [(tenant_id, sid)]
    assert (await db_state(db, tenant_id))[sid]["variables"]["probe"] == f"epoch-{winner.epoch}"


def named_actors() -> set[str]:
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE}


# -- 4. both placements ---------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["sharded", "dedicated"])
async def test_both_placements_serve_the_same_conversations(mode, stack, dedicated_gateway, client, tenant, db):
    tenant_id, _key, headers = tenant
    gateway = stack.gateway if mode == "sharded" else dedicated_gateway
    placement = stack.placement if mode == "sharded" else dedicated_gateway.placement
    assert placement.mode == mode
    await register_order_tools(client, gateway.url, headers, stack.demo_store.url)
    sessions = [f"{mode}-{i}" for i in range(20)]

    connections = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
    before = await db.fetchval(connections)
    sent = await converse(client, gateway.url, headers, sessions, concurrency=20)
    opened = await db.fetchval(connections) - before

    assert [s.failures for s in sent if s.failures] == []
    check_replies(sessions, sent)
    rows = await db_state(db, tenant_id)
    check_conversations(tenant_id, rows, sent, MESSAGES_PER_TOOL_TURN)
    check_views(rows, await views(client, gateway.url, headers, sessions), 3 * MESSAGES_PER_TOOL_TURN)
    names = {placement.actor_name(tenant_id, s) for s in sessions}
    if mode == "dedicated":
        # one named actor per session, each its own process holding that session alone.
        # A dedicated session idle for idle_seconds (30 s here) passivates and its process exits;
        # on a slow machine the first conversations end that long before the last, and bringing
        # twenty actors back at once can take longer than that too. So each session's actor is
        # looked at right after that session's last message again (answered from its stored turn:
        # nothing runs twice), which makes it live then. One that reaches its actor as it exits is
        # served by the next actor (test_a_message_reaching_a_dedicated_actor_as_it_exits...); a
        # 503 left (the new actor not up within the gateway's one retry) is retried as a client would.
        assert names == {SESSION_PREFIX + session_uid(tenant_id, s) for s in sessions}

        async def again_then_stats(s: Sent) -> tuple[Sent, dict]:
            a = await send(client, gateway.url, headers, s.session_id, "again", s.message_id, retries=2)
            if a.reply is None:
                return a, {}
            handle = ray.get_actor(placement.actor_name(tenant_id, s.session_id), namespace=NAMESPACE)
            return a, await handle.stats.remote()

        last = list({s.session_id: s for s in sent}.values())
        checked = await asyncio.gather(*(again_then_stats(s) for s in last))
        assert [a.failures for a, _ in checked if a.reply is None] == []
        assert [a.reply for a, _ in checked] == [s.reply for s in last]
        stats = [st for _, st in checked]
        assert len({st["pid"] for st in stats}) == len(sessions)
        assert all(st["live_sessions"] == 1 for st in stats), stats
        # a process per session must not cost a shard host's connection pool per session
        assert opened <= DEDICATED_POOL_SIZE * len(sessions) + 10, opened
        # done with them: flush and stop those still up (the next message would create the actor again)
        handles = [ray.get_actor(n, namespace=NAMESPACE) for n in names & named_actors()]
        await asyncio.gather(*(h.shutdown.remote() for h in handles), return_exceptions=True)
        for h in handles:
            ray.kill(h, no_restart=True)
    else:
        named = named_actors()
        assert names <= {f"ce-host-{i}" for i in range(placement.shards)} and len(names) > 1
        assert not {SESSION_PREFIX + session_uid(tenant_id, s) for s in sessions} & named


# -- passivation -----------------------------------------------------------------------------------

async def test_passivated_session_reactivates_through_ray_with_variables_history_and_one_shots(
    stack, client, tenant, db
):
    tenant_id, _key, headers = tenant
    url = stack.gateway.url
    await register_order_tools(client, url, headers, stack.demo_store.url)
    natural = "Please note order 4243 for me."

    # control: in a fresh session this text makes the model pick the one-shot note_order
    control = await send(client, url, headers, "passive-control", natural, "ctl-m0")
    assert control.reply is not None and calls_of(control.reply) == [("note_order", True)], control.reply

    sid = "passive-1"
    m0 = await send(client, url, headers, sid, call_lines(("note_order", {"order_id": "4243"})), "p-m0")
    assert calls_of(m0.reply) == [("note_order", True)]
    assert await stack.placement.passivate(tenant_id, sid) is True
    assert await stack.placement.view(tenant_id, sid) is None  # dropped from the host's memory
    rows = (await db_state(db, tenant_id))[sid]
    assert (rows["epoch"], rows["message_count"], rows["variables"]) == (1, 4, {NOTED: "true"})

    # the next message re-activates it (a new lease) with its variables: note_order is not offered
    m1 = await send(client, url, headers, sid, natural, "p-m1")
    assert m1.reply is not None, m1.failures
    # (the same words as the control: with note_order gone, the model settles for check_order)
    assert calls_of(m1.reply) == [("check_order", True)], m1.reply
    live = await stack.placement.view(tenant_id, sid)
    assert live is not None and live.variables == {NOTED: "true"} and live.messages == 8
    # and if named anyway, it is refused in-band as done already
    m2 = await send(client, url, headers, sid, call_lines(("note_order", {"order_id": "4243"})), "p-m2")
    assert calls_of(m2.reply) == [("note_order", False)] and "already done" in m2.reply["tool_calls"][0]["error"]

    rows = (await db_state(db, tenant_id))[sid]
    assert rows["epoch"] == 2
    # history came back with it: the new messages continue the sequence instead of reusing seqs
    n = rows["message_count"]
    assert n == 12 and rows["seqs"] == list(range(n))
    assert [rows["message_ids"][m] for m in ("p-m0", "p-m1", "p-m2")] == [4, 4, 4]
    assert rows["turns"] == {"p-m0", "p-m1", "p-m2"}
    async with client.get(f"{url}/v1/sessions/{sid}", headers=headers) as r:
        assert (await r.json())["messages"] == n


def _named_actors() -> set[str]:
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE}


async def test_a_passivated_dedicated_session_frees_its_actor_and_comes_back_on_the_next_message(
    stack, dedicated_gateway, client, tenant, db
):
    tenant_id, _key, headers = tenant
    url, placement = dedicated_gateway.url, dedicated_gateway.placement
    await register_order_tools(client, url, headers, stack.demo_store.url)
    sid = "dedicated-passive"
    name = placement.actor_name(tenant_id, sid)

    m0 = await send(client, url, headers, sid, call_lines(("note_order", {"order_id": "5150"})), "dp-m0")
    assert calls_of(m0.reply) == [("note_order", True)]
    assert name in _named_actors()
    assert await placement.passivate(tenant_id, sid) is True
    # with its only session passivated, the dedicated process goes away by itself
    deadline = time.monotonic() + 30
    while name in _named_actors():
        assert time.monotonic() < deadline, "the idle dedicated actor did not exit"
        await asyncio.sleep(0.25)

    # reading the session is served from Postgres and starts no process for it
    async with client.get(f"{url}/v1/sessions/{sid}", headers=headers) as r:
        assert r.status == 200
        view = await r.json()
    assert view["variables"] == {NOTED: "true"} and view["messages"] == MESSAGES_PER_TOOL_TURN
    assert name not in _named_actors()

    # the next message creates the actor again, which re-activates the session from Postgres
    m1 = await send(client, url, headers, sid, call_lines(("note_order", {"order_id": "5150"})), "dp-m1")
    assert m1.failures == [] and calls_of(m1.reply) == [("note_order", False)]
    assert "already done" in m1.reply["tool_calls"][0]["error"]
    assert name in _named_actors()
    rows = (await db_state(db, tenant_id))[sid]
    assert rows["epoch"] == 2 and rows["seqs"] == list(range(2 * MESSAGES_PER_TOOL_TURN))
    handle = ray.get_actor(name, namespace=NAMESPACE)
    await handle.shutdown.remote()
    ray.kill(handle, no_restart=True)


@pytest.mark.parametrize("sse", [False, True], ids=["json", "sse"])
async def test_a_message_reaching_a_dedicated_actor_as_it_exits_is_served_by_the_next_one(
    sse, stack, dedicated_gateway, client, tenant
):
    """A dedicated actor whose session passivated shuts down, then is killed; a message arriving in
    between is refused by it having run nothing, so the gateway waits for the next actor instead of
    answering 503 (a contact writing again just as the idle timeout ends is the common case)."""
    from tests.support.api import post

    tenant_id, _key, headers = tenant
    url, placement = dedicated_gateway.url, dedicated_gateway.placement
    await register_order_tools(client, url, headers, stack.demo_store.url)
    sid = f"dedicated-exiting-{'sse' if sse else 'json'}"
    name = placement.actor_name(tenant_id, sid)
    note = call_lines(("note_order", {"order_id": "7070"}))
    m0 = await send(client, url, headers, sid, note, f"{sid}-m0")
    assert calls_of(m0.reply) == [("note_order", True)]

    old = ray.get_actor(name, namespace=NAMESPACE)
    assert await old.shutdown.remote() is True  # what the idle watchdog does before its kill
    if not sse:  # reading the session meanwhile answers what is stored, not 503
        async with client.get(f"{url}/v1/sessions/{sid}", headers=headers) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["messages"] == MESSAGES_PER_TOOL_TURN
        # an error the host raises reaches the gateway as itself: its text, not the host's
        # traceback (which the gateway would have answered with: paths, pid, actor id)
        with pytest.raises(Overloaded) as refused:
            await placement.passivate(tenant_id, sid)
        assert not isinstance(refused.value, ray.exceptions.RayTaskError)
        assert str(refused.value) == "this session host is shutting down; retry in a moment"

    async def kill_later() -> None:
        await asyncio.sleep(0.5)
        ray.kill(old, no_restart=True)

    killer = asyncio.create_task(kill_later())
    status, body = await post(client, f"{url}/v1/sessions/{sid}/messages", headers,
                              {"text": note, "message_id": f"{sid}-m1"}, sse=sse)
    await killer
    assert status == 200, body
    reply = body[-1][1] if sse else body
    if sse:
        assert body[-1][0] == "done", body
    # the new actor re-activated the session from Postgres: the one-shot tool was already done
    assert [(c["name"], c["success"]) for c in reply["tool_calls"]] == [("note_order", False)], reply
    assert "already done" in reply["tool_calls"][0]["error"]
    handle = ray.get_actor(name, namespace=NAMESPACE)
    assert handle._actor_id != old._actor_id
    await handle.shutdown.remote()
    ray.kill(handle, no_restart=True)
