"""Shard ownership across a change of shard count: rendezvous routing and the session host's side.

Pure: `actors.sharding` on its own, and SessionHost with the fakes of `host_fakes` (a store with
real lease semantics). The Ray and Postgres side of the same protocol is tests/e2e/test_cluster.py.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest

from actors.host import HostSettings, SessionHost, SessionMoved
from actors.sharding import owns, parse_host_name, rendezvous_index, route
from services.wire import Turn
from storage.repos.cluster import ShardState
from tests.support.host_fakes import FakeSessionStore, FakeTenants

T = 5.0
SESSIONS = [("t1", f"s{i}") for i in range(400)]


def texts(request) -> list[str]:
    return [b.text for m in request.messages for b in m.content if hasattr(b, "text")]


def owners(state: ShardState, tenant_id: str, session_id: str, hosts: int) -> list[int]:
    return [i for i in range(hosts) if owns(state, i, tenant_id, session_id)]


@pytest.mark.parametrize(("old", "new"), [(2, 4), (4, 3), (3, 1), (1, 5)])
def test_a_session_has_one_owner_before_and_after_and_a_moving_one_none_while_pending(old, new):
    before, pending = ShardState(shards=old, generation=1), ShardState(shards=old, pending=new, generation=2)
    after = ShardState(shards=new, generation=3)
    hosts = max(old, new)
    moved = 0
    for t, s in SESSIONS:
        assert owners(before, t, s, hosts) == [route(before, t, s)]
        assert owners(after, t, s, hosts) == [route(after, t, s)]
        during = owners(pending, t, s, hosts)
        if route(before, t, s) == route(after, t, s):
            assert during == [route(before, t, s)]  # staying sessions keep being served
        else:
            assert during == []  # nobody may hold it while its old host flushes it
            moved += 1
    # rendezvous hashing moves about |new-old|/max share of the sessions, not all of them
    assert 0 < moved < len(SESSIONS) * (abs(new - old) / max(old, new) + 0.15)


def test_growing_moves_sessions_only_to_the_new_hosts_and_shrinking_only_from_the_removed_ones():
    for t, s in SESSIONS:
        two, four, three = (rendezvous_index(f"{t}:{s}", n) for n in (2, 4, 3))
        assert four == two or four >= 2
        assert three == four or four == 3


@pytest.mark.parametrize(("name", "parsed"), [
    ("ce-host-0", ("", 0)), ("ce-host-12", ("", 12)), ("bench-ce-host-3", ("bench-", 3)),
    ("ce-session-abc", None), ("ce-host-x", None),
])
def test_host_names_parse_into_group_and_index(name, parsed):
    assert parse_host_name(name) == parsed


class Cluster:
    """Shard hosts over one fake database, each owning what its index wins under `state`."""

    def __init__(self) -> None:
        self.store = FakeSessionStore()
        self.tenants = FakeTenants()
        self.model = self.tenants.model
        self.hosts: list[SessionHost] = []
        self.state = ShardState(shards=2, generation=1)
        self.gen = itertools.count(2)

    async def start(self, n: int) -> None:
        while len(self.hosts) < n:
            index = len(self.hosts)
            host = SessionHost(name=f"ce-host-{index}", store=self.store, tenants=self.tenants,
                               settings=HostSettings(idle_seconds=300))
            host.set_ownership(lambda t, s, i=index: owns(self.state, i, t, s))
            await host.start()
            self.hosts.append(host)

    async def announce(self, state: ShardState) -> int:
        self.state = state
        return sum(await asyncio.wait_for(asyncio.gather(*(h.release_unowned() for h in self.hosts)), T))

    async def rescale(self, target: int) -> int:
        """The protocol of Placement.rescale: hosts first, pending, then commit."""
        await self.start(target)
        released = await self.announce(ShardState(shards=self.state.shards, pending=target, generation=next(self.gen)))
        await self.announce(ShardState(shards=target, generation=next(self.gen)))
        return released

    async def send(self, session_id: str, text: str, message_id: str):
        """As a gateway does: to the routed host, again on SessionMoved."""
        for _ in range(50):
            host = self.hosts[route(self.state, "t1", session_id)]
            try:
                return await asyncio.wait_for(host.send(Turn(tenant_id="t1", session_id=session_id, text=text, message_id=message_id)), T)
            except SessionMoved:
                await asyncio.sleep(0.01)
        raise AssertionError(f"{session_id} never found its host")

    async def close(self) -> None:
        self.model.release_all()
        for host in self.hosts:
            await asyncio.wait_for(host.stop(), T)


@pytest.fixture
async def cluster():
    c = Cluster()
    await c.start(2)
    yield c
    await c.close()


async def test_a_host_refuses_a_session_it_does_not_own_and_runs_nothing(cluster):
    stranger = cluster.hosts[1 - route(cluster.state, "t1", "s1")]
    with pytest.raises(SessionMoved, match="moving to another session host"):
        await stranger.send(Turn(tenant_id="t1", session_id="s1", text="hello", message_id="m1"))
    assert cluster.store.activations == [] and cluster.model.requests == []


async def test_2_4_3_moves_sessions_with_their_state_and_never_serves_a_stale_copy(cluster):
    sessions = [f"s{i}" for i in range(40)]
    for s in sessions:
        await cluster.send(s, f"{s} one", f"{s}-m1")
    homes = {s: route(cluster.state, "t1", s) for s in sessions}

    released = await cluster.rescale(4)
    moved = {s for s in sessions if route(cluster.state, "t1", s) != homes[s]}
    assert released == len(moved) > 0  # exactly the moved sessions were flushed and dropped
    for s in sessions:
        await cluster.send(s, f"{s} two", f"{s}-m2")

    await cluster.rescale(3)  # host 3's sessions go back to 0..2, some to where they were at 2
    back = [s for s in moved if route(cluster.state, "t1", s) == homes[s]]
    assert back, "the test needs sessions that return to their first host"
    for s in sessions:
        await cluster.send(s, f"{s} three", f"{s}-m3")

    store = cluster.store
    for s in sessions:
        key = ("t1", s)
        # every turn once, in order, nothing lost: a stale copy would have dropped "two"
        assert store.texts(key) == [f"{s} one", f"echo: {s} one", f"{s} two", f"echo: {s} two",
                                    f"{s} three", f"echo: {s} three"]
        assert store.seqs(key) == list(range(6))
    assert store.duplicates == [] and store.refused == []  # no copy ever wrote on a lost lease
    for s in back:  # the returning host saw the turn its session had elsewhere
        request = next(r for r in cluster.model.requests if texts(r)[-1:] == [f"{s} three"])
        assert f"{s} two" in texts(request)


async def test_a_turn_running_during_the_pending_step_finishes_and_the_one_queued_behind_it_moves(cluster):
    s = next(f"s{i}" for i in range(100) if rendezvous_index(f"t1:s{i}", 4) == 3)
    old = cluster.hosts[route(cluster.state, "t1", s)]
    await cluster.send(s, "hello", "m1")
    slow = cluster.model.hold("slow")
    running = asyncio.create_task(old.send(Turn(tenant_id="t1", session_id=s, text="slow", message_id="m2")))
    await asyncio.wait_for(cluster.model.entered("slow").wait(), T)
    queued = asyncio.create_task(old.send(Turn(tenant_id="t1", session_id=s, text="queued", message_id="m3")))
    await asyncio.sleep(0.01)

    await cluster.start(4)
    pending = ShardState(shards=2, pending=4, generation=next(cluster.gen))
    announce = asyncio.create_task(cluster.announce(pending))
    await asyncio.sleep(0.05)
    assert not announce.done()  # the old host waits for its running turn before it lets go
    slow.set()
    assert (await asyncio.wait_for(running, T)).reply == "echo: slow"
    assert await asyncio.wait_for(announce, T) == 1
    with pytest.raises(SessionMoved):
        await asyncio.wait_for(queued, T)
    with pytest.raises(SessionMoved):  # while pending, the new host refuses it too
        await cluster.hosts[3].send(Turn(tenant_id="t1", session_id=s, text="early", message_id="m4"))

    await cluster.announce(ShardState(shards=4, generation=next(cluster.gen)))
    reply = await cluster.send(s, "queued", "m3")  # the client's retry, same message_id
    assert reply.reply == "echo: queued"
    assert cluster.store.texts(("t1", s)) == ["hello", "echo: hello", "slow", "echo: slow", "queued", "echo: queued"]
    assert [a[1] for a in cluster.store.activations if a[0] == ("t1", s)] == [old.owner, cluster.hosts[3].owner]
