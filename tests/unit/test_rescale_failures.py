"""A rescale that stops between its two steps never leaves a moving session without a host.

`Placement.rescale` (the operator's `chat-engine scale`) and a gateway's Placement run against
real `SessionHostActor`s (actors/ray_host.py) over SessionHosts with the fakes of `host_fakes`,
through `placement_fakes.FakeRay` instead of Ray and `FakeShardStore` instead of ce_cluster in
Postgres. Between the pending step and the commit a session that moves is owned by no host; these
tests stop a rescale there in every way it can stop (a commit write refused or its answer lost, a
host that does not acknowledge, the command cancelled, its process killed, its lock lost) and
check that the sessions are served again, by one host each, without an operator.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import structlog

from actors import placement as placement_module
from actors import ray_host
from actors.host import HostSettings, SessionHost
from actors.placement import Placement, RescaleFailed
from actors.ray_host import SessionHostActor, encode_command, result_decoder
from actors.sharding import host_name, route
from services.settings import Settings
from services.wire import Turn
from storage.repos.cluster import ShardState
from tests.support.host_fakes import FakeSessionStore, FakeTenants
from tests.support.placement_fakes import FakeRay, FakeShardStore

T = 5.0
SESSIONS = [f"s{i}" for i in range(40)]


class _FakeRuntimeContext:
    @staticmethod
    def get_node_id() -> str:
        return "node-in-this-process"


class Cluster:
    """Shard hosts 0..n-1 as SessionHostActors in this process, a gateway, and an operator."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.store = FakeSessionStore()
        self.tenants = FakeTenants()
        self.shards = FakeShardStore(shards=2)
        self.ray = FakeRay(self._host).install(monkeypatch)
        settings = Settings(shards=2, host_lane=False)
        self.gateway = Placement(settings)
        self.shards.listeners.append(self.gateway.apply_shard_state)  # LISTEN ce_cluster
        self.operator = Placement(settings)  # `chat-engine scale N`
        self.hosts: list[SessionHost] = []
        monkeypatch.setattr(placement_module, "COMMIT_BACKOFF_S", 0.01)
        # a host's stats name its Ray node: without this, the first stats read starts a local Ray
        # (seconds, blocking the loop; it made the hung-host test fail when run alone)
        monkeypatch.setattr(ray_host.ray, "get_runtime_context", lambda: _FakeRuntimeContext())

    async def _host(self, name: str) -> SessionHostActor:
        # what SessionHostActor._ensure does, with the fakes for a runtime
        actor = SessionHostActor(name, msgspec.json.encode(Settings(host_lane=False)))
        host = SessionHost(name=name, store=self.store, tenants=self.tenants, settings=HostSettings(idle_seconds=300))
        await host.start()
        self.hosts.append(host)
        actor._cluster = self.shards
        actor._shard_state = await actor._stored_shard_state()
        host.set_ownership(actor._owns)
        actor._host = host
        return actor

    async def actor(self, index: int) -> SessionHostActor:
        return await self.ray.actor(host_name(index))

    async def states(self) -> list[ShardState | None]:
        return [(await self.ray.actor(n))._shard_state for n in sorted(self.ray.actors)]

    async def send(self, session_id: str, text: str, message_id: str) -> str:
        turn = Turn(tenant_id="t1", session_id=session_id, text=text, message_id=message_id)
        reply = await asyncio.wait_for(self.gateway.send(turn), T)
        return reply.reply

    def owners(self, session_id: str) -> list[str]:
        """The hosts that activated the session, in order (host names)."""
        return [owner.rsplit(":", 1)[0] for key, owner, _epoch in self.store.activations if key == ("t1", session_id)]

    async def converse(self, tag: str) -> None:
        for s in SESSIONS:
            assert await self.send(s, f"{s} {tag}", f"{s}-{tag}") == f"echo: {s} {tag}"

    async def close(self) -> None:
        self.tenants.model.release_all()
        for name in list(self.ray.actors):
            actor = await self.ray.actor(name)
            if actor._refresh is not None:
                actor._refresh.cancel()
        for host in self.hosts:
            await asyncio.wait_for(host.stop(), T)


@pytest.fixture
async def cluster(monkeypatch):
    c = Cluster(monkeypatch)
    await c.gateway.start_hosts()
    await c.converse("one")
    yield c
    await c.close()


def movers(old: int, new: int) -> list[str]:
    return [s for s in SESSIONS if route(ShardState(shards=old), "t1", s) != route(ShardState(shards=new), "t1", s)]


async def check_served_by(cluster: Cluster, shards: int) -> None:
    """Every session answers, from the host that owns it under `shards`, and nothing was
    written on a lost lease."""
    await cluster.converse("two")
    for s in SESSIONS:
        assert cluster.owners(s)[-1] == host_name(route(ShardState(shards=shards), "t1", s))
        assert cluster.store.texts(("t1", s))[-2:] == [f"{s} two", f"echo: {s} two"]
    assert cluster.store.refused == [] and cluster.store.duplicates == []


def committed(state: ShardState, shards: int) -> bool:
    return state.pending is None and state.shards == shards


# -- the rescale ends with a count committed, whatever stopped it ---------------------------------

@pytest.mark.parametrize("blip", ["refused", "answer_lost"])
async def test_a_rescale_whose_commit_write_fails_once_commits_the_target_on_a_retry(cluster, blip):
    # every host let go of the moving sessions, then the commit write failed (a Postgres blip):
    # before, the stored state stayed pending and the moving sessions had no host until an
    # operator ran `scale` again (each turn "moved" for 15 s, then 503)
    setattr(cluster.shards, {"refused": "refuse_commits", "answer_lost": "lose_commit_answers"}[blip], 1)
    with structlog.testing.capture_logs() as logs:
        report = await cluster.operator.rescale(3, cluster.shards, ack_timeout_s=T)

    assert (report.before, report.after, report.started) == (2, 3, ["ce-host-2"])
    assert committed(cluster.shards.state, 3) and report.generation == cluster.shards.state.generation
    assert await cluster.states() == [cluster.shards.state] * 3  # every host was told
    assert "rescale_commit_retried" in [e["event"] for e in logs]
    await check_served_by(cluster, 3)
    assert movers(2, 3) and all(cluster.owners(s)[-1] == "ce-host-2" for s in movers(2, 3))


async def test_a_rescale_a_host_did_not_acknowledge_puts_the_old_count_back(cluster):
    async def deaf_to_pending(name: str, method: str, args: tuple) -> None:
        if name == "ce-host-1" and method == "set_shard_state" and msgspec.json.decode(args[0])["pending"]:
            raise TimeoutError("host 1 is stuck")

    cluster.ray.intercept = deaf_to_pending
    with pytest.raises(RescaleFailed, match="ce-host-1 did not acknowledge shard state generation 2"):
        await cluster.operator.rescale(3, cluster.shards, ack_timeout_s=0.3)

    assert committed(cluster.shards.state, 2) and cluster.shards.state.generation == 3
    assert cluster.shards.commits == [(2, 2)]  # the target was never committed
    assert await cluster.states() == [cluster.shards.state] * 3
    await check_served_by(cluster, 2)


async def test_a_rescale_cancelled_in_its_pending_step_puts_the_old_count_back(cluster):
    stuck = asyncio.Event()

    async def host_1_hangs_on_pending(name: str, method: str, args: tuple) -> None:
        if name == "ce-host-1" and method == "set_shard_state" and msgspec.json.decode(args[0])["pending"]:
            stuck.set()
            await asyncio.Event().wait()

    cluster.ray.intercept = host_1_hangs_on_pending
    scale = asyncio.create_task(cluster.operator.rescale(3, cluster.shards, ack_timeout_s=60))
    await asyncio.wait_for(stuck.wait(), T)
    assert cluster.shards.state.pending == 3
    scale.cancel()  # Ctrl-C on `chat-engine scale`: asyncio.run cancels it
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(scale, T)

    assert committed(cluster.shards.state, 2) and not cluster.shards.locked
    assert [s for s in await cluster.states() if s != cluster.shards.state] == []
    await check_served_by(cluster, 2)


async def test_a_rescale_whose_commit_never_gets_through_says_so_and_a_host_rolls_it_back(cluster, monkeypatch):
    monkeypatch.setattr(placement_module, "COMMIT_ATTEMPTS", 3)
    cluster.shards.refuse_commits = 1 + 3  # Postgres away for the commit and every retry of it
    with pytest.raises(RescaleFailed, match=r"Postgres refused 3 attempts, so the state is left pending \(2 -> 3\)"):
        await cluster.operator.rescale(3, cluster.shards, ack_timeout_s=T)
    assert cluster.shards.state.pending == 3 and not cluster.shards.locked

    # Postgres is back: the first turn a host refuses (the old host of a moving session) rolls
    # the abandoned state back, and the gateway's retry of that turn is served
    await check_served_by(cluster, 2)
    assert committed(cluster.shards.state, 2)


# -- a rescale whose process died between its steps ------------------------------------------

@pytest.mark.parametrize(("died", "shards"), [("before_its_commit", 2), ("after_its_commit", 3)])
async def test_a_rescale_killed_between_its_steps_is_settled_by_the_first_turn_a_host_refuses(
    cluster, died, shards
):
    # what a `scale 3` killed with SIGKILL leaves: host 2 started, the pending state stored and
    # taken by every host, the lock gone with its connection; maybe the commit written, no host told
    await cluster.operator._handle("ce-host-2").ready.remote()
    pending = await cluster.shards.begin("", 3)
    for i in range(3):
        await (await cluster.actor(i)).set_shard_state(msgspec.json.encode(pending))
    if died == "after_its_commit":
        await cluster.shards.commit("", 3, generation=pending.generation)

    with structlog.testing.capture_logs() as logs:
        await check_served_by(cluster, shards)
    assert committed(cluster.shards.state, shards)
    caught_up = [e for e in logs if e["event"] == "shard_state_caught_up"]
    assert caught_up and all(e["shards"] == shards and e["pending"] is None for e in caught_up)


async def test_the_next_scale_takes_over_a_pending_state_its_predecessor_left(cluster):
    await cluster.operator._handle("ce-host-2").ready.remote()
    pending = await cluster.shards.begin("", 3)
    for i in range(3):
        await (await cluster.actor(i)).set_shard_state(msgspec.json.encode(pending))

    with structlog.testing.capture_logs() as logs:
        report = await cluster.operator.rescale(3, cluster.shards, ack_timeout_s=T)
    assert (report.before, report.after) == (2, 3) and committed(cluster.shards.state, 3)
    assert [e["pending"] for e in logs if e["event"] == "abandoned_rescale_found"] == [3]
    await check_served_by(cluster, 3)


async def test_a_host_leaves_the_pending_state_of_a_running_rescale_alone(cluster, monkeypatch):
    monkeypatch.setattr(ray_host, "SHARD_REFRESH_S", 0.0)
    await cluster.operator._handle("ce-host-2").ready.remote()
    pending = await cluster.shards.begin("", 3)
    for i in range(3):
        await (await cluster.actor(i)).set_shard_state(msgspec.json.encode(pending))
    cluster.shards.locked = True  # the rescale that began it holds the lock: it is alive
    mover = movers(2, 3)[0]
    old = await cluster.actor(route(ShardState(shards=2), "t1", mover))

    early = encode_command(Turn(tenant_id="t1", session_id=mover, text="hello", message_id="m-early"))
    refused = result_decoder.decode(await old.send(early))
    assert refused.error is not None and refused.error.reason == "moved"
    await asyncio.wait_for(old._refresh, T)
    assert cluster.shards.state == pending and cluster.shards.commits == []  # not rolled back under it

    cluster.shards.locked = False  # now its process is gone
    await old.send(early)  # refused again
    await asyncio.wait_for(old._refresh, T)
    assert committed(cluster.shards.state, 2) and cluster.shards.commits == [(2, pending.generation)]
    assert old._shard_state == cluster.shards.state
    assert result_decoder.decode(await old.send(early)).reply.reply == "echo: hello"


async def test_a_rescale_whose_lock_was_lost_never_commits_over_a_host_that_settled_its_state(cluster):
    # the rescale's lock went with a dropped Postgres connection while it announced the pending
    # state; a host that refused a turn found the lock free and rolled the state back. The
    # rescale's commit must not overrule that rollback (the hosts are activating the old count)
    async def lock_lost_and_settled() -> None:
        cluster.shards.locked = False
        actor = await cluster.actor(0)
        actor._refreshed_at = float("-inf")
        actor._moved()
        await asyncio.wait_for(actor._refresh, T)

    cluster.shards.before_commit = lock_lost_and_settled
    with pytest.raises(RescaleFailed, match=r"the shard state changed under this rescale \(now 2 shards"):
        await cluster.operator.rescale(3, cluster.shards, ack_timeout_s=T)

    assert committed(cluster.shards.state, 2) and cluster.shards.state.generation == 3
    assert [s for s in await cluster.states() if s != cluster.shards.state] == []
    await check_served_by(cluster, 2)


async def test_a_hung_host_is_left_out_of_a_stats_read_after_its_timeout(cluster):
    # /metrics reads every host's stats: before, one hung host hung the scrape with it
    async def host_1_hangs_on_stats(name: str, method: str, args: tuple) -> None:
        if name == "ce-host-1" and method == "stats":
            await asyncio.Event().wait()

    cluster.ray.intercept = host_1_hangs_on_stats
    stats = await asyncio.wait_for(cluster.gateway.stats(timeout_s=1.0), T)  # ce-host-0 answers in well under it
    assert [s["host"] for s in stats] == ["ce-host-0"]
    assert cluster.gateway.host_names() == ["ce-host-0", "ce-host-1"]  # still expected: reported down


async def test_a_scale_down_whose_retired_host_is_hung_drains_and_kills_it_without_waiting_for_its_flush(
    cluster, monkeypatch,
):
    # a host whose loop is stuck answers nothing (here: its stats and its shutdown never return);
    # before, the drain's stats read waited for it for ever, and the retire 30 s for its shutdown
    monkeypatch.setattr(placement_module, "STATS_TIMEOUT_S", 0.2)
    monkeypatch.setattr(placement_module, "RETIRE_PROBE_S", 0.2)
    monkeypatch.setattr(placement_module, "RETIRE_SHUTDOWN_S", 600.0)

    async def host_1_hangs_once_released(name: str, method: str, args: tuple) -> None:
        if name == "ce-host-1" and method in ("stats", "shutdown"):
            await asyncio.Event().wait()

    cluster.ray.intercept = host_1_hangs_once_released
    with structlog.testing.capture_logs() as logs:
        report = await asyncio.wait_for(cluster.operator.rescale(1, cluster.shards, ack_timeout_s=T), T)
    assert (report.after, report.retired) == (1, ["ce-host-1"]) and cluster.ray.killed == ["ce-host-1"]
    assert ("ce-host-1", "shutdown") not in cluster.ray.calls  # hung: killed without asking it to flush
    assert [e["host"] for e in logs if e["event"] == "retired_host_unresponsive"] == ["ce-host-1"]
    cluster.ray.intercept = None
    await check_served_by(cluster, 1)


async def test_a_scale_down_retires_its_hosts_together_not_one_after_another(cluster):
    # each retired host is probed (up to RETIRE_PROBE_S) and flushes and stops (up to
    # RETIRE_SHUTDOWN_S); one after another, N slow or hung hosts held the command N times that
    await asyncio.wait_for(cluster.operator.rescale(3, cluster.shards, ack_timeout_s=T), T)
    stopping: set[str] = set()
    both_stopping = asyncio.Event()
    release = asyncio.Event()

    async def shutdowns_wait_to_be_released(name: str, method: str, args: tuple) -> None:
        if method == "shutdown":
            stopping.add(name)
            if stopping == {"ce-host-1", "ce-host-2"}:
                both_stopping.set()
            await release.wait()

    cluster.ray.intercept = shutdowns_wait_to_be_released
    scale = asyncio.create_task(cluster.operator.rescale(1, cluster.shards, ack_timeout_s=T))
    await asyncio.wait_for(both_stopping.wait(), T)  # one host at a time never gets here
    release.set()
    report = await asyncio.wait_for(scale, T)
    assert report.retired == ["ce-host-1", "ce-host-2"]
    assert sorted(cluster.ray.killed) == ["ce-host-1", "ce-host-2"]
    cluster.ray.intercept = None
    await check_served_by(cluster, 1)


async def test_a_scale_down_whose_retired_host_is_gone_before_its_drain_still_completes(cluster):
    # another operator (or Ray, on a node lost) took the retired host away between the steps
    told = []

    async def host_1_vanishes_once_told(name: str, method: str, args: tuple) -> None:
        if name == "ce-host-1" and method == "set_shard_state":
            told.append(args)
            if len(told) == 2:  # the committed count: gone before the drain reads its stats
                asyncio.get_running_loop().call_soon(cluster.ray.actors.pop, "ce-host-1", None)

    cluster.ray.intercept = host_1_vanishes_once_told
    report = await asyncio.wait_for(cluster.operator.rescale(1, cluster.shards, ack_timeout_s=T), T)
    assert (report.after, report.retired) == (1, ["ce-host-1"]) and "ce-host-1" not in cluster.ray.actors
    cluster.ray.intercept = None
    await check_served_by(cluster, 1)
