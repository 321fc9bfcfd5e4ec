"""Dedicated placement: what a gateway keeps of the session actors it routed to.

One actor per session, which exits once its session has been idle for `idle_seconds`: a gateway
that kept the handle of every session it ever routed grew with every session it had seen, sent a
returning session's first message to a dead actor (a failed call and 0.2 s), and fanned its
`actor_stats` out to actors long gone. `Placement` over `placement_fakes.FakeRay`; no Ray.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from actors import placement as placement_module
from actors.placement import Placement
from actors.ray_host import HostResult, result_encoder, turn_decoder
from services.settings import Settings
from services.wire import Turn, TurnReply
from tests.support.placement_fakes import FakeRay


class FakeSessionActor:
    """A dedicated actor: answers every turn, passivates on request, and counts what it got."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.turns: list[str] = []
        self.stopped = False

    async def send(self, turn: bytes, *_rest) -> bytes:
        command = turn_decoder.decode(turn)
        self.turns.append(command.message_id or "")
        return result_encoder.encode(HostResult(reply=TurnReply(
            session_id=command.session_id, message_id=command.message_id or "", reply=f"echo: {command.text}",
            tool_calls=[], rounds=1,
            usage={"input_tokens": 1, "output_tokens": 1})))

    async def passivate(self, tenant_id: str, session_id: str) -> bool:
        return True

    async def stats(self) -> dict:
        return {"host": self.name, "live_sessions": 1, "turns": len(self.turns)}

    async def shutdown(self) -> bool:
        self.stopped = True
        return True


@pytest.fixture
def ray(monkeypatch) -> FakeRay:
    async def make(name: str) -> FakeSessionActor:
        return FakeSessionActor(name)

    return FakeRay(make).install(monkeypatch)


def dedicated(idle_seconds: float = 300.0, prefix: str = "") -> Placement:
    # no bound on live actors here (tests/unit/test_actor_quota.py has those): thousands of sessions
    return Placement(Settings(placement="dedicated", idle_seconds=idle_seconds, host_lane=False,
                              dedicated_max_actors=0, dedicated_max_actors_per_tenant=0), prefix=prefix)


async def test_a_gateway_keeps_the_handles_of_the_sessions_it_routed_most_recently_and_no_more(ray, monkeypatch):
    monkeypatch.setattr(placement_module, "DEDICATED_HANDLES", 100)
    p = dedicated()
    for i in range(2000):
        assert (await p.send(Turn(tenant_id="t1", session_id=f"s{i}", text="hello", message_id=f"m{i}"))).reply == "echo: hello"
    assert len(p._sessions) == 100  # before: 2000, one for every session ever seen
    assert list(p._sessions) == [p.actor_name("t1", f"s{i}") for i in range(1900, 2000)]

    await p.send(Turn(tenant_id="t1", session_id="s1950", text="again", message_id="m-again"))  # a kept handle is used, not looked up again
    assert len(ray.created) == 2000 and list(p._sessions)[-1] == p.actor_name("t1", "s1950")


async def test_a_handle_unused_for_idle_seconds_is_looked_up_again_not_tried_on_a_dead_actor(ray):
    p = dedicated(idle_seconds=0.1)
    for i in range(10):
        await p.send(Turn(tenant_id="t1", session_id=f"s{i}", text="hello", message_id=f"m{i}"))
    name = p.actor_name("t1", "s0")
    ray.kill(ray.get_actor(name))  # s0 went idle: its actor passivated it and exited
    await asyncio.sleep(0.15)

    started = time.monotonic()
    assert (await p.send(Turn(tenant_id="t1", session_id="s0", text="back", message_id="m-back"))).reply == "echo: back"
    assert time.monotonic() - started < 0.2  # no failed call, no 0.2 s wait before the retry
    assert ray.calls.count((name, "send")) == 2 and ray.created.count(name) == 2  # the first, and the new one
    assert list(p._sessions) == [name]  # the handles nobody used for idle_seconds are gone


async def test_a_session_passivated_through_the_gateway_drops_its_handle(ray):
    p = dedicated()
    await p.send(Turn(tenant_id="t1", session_id="s1", text="hello", message_id="m1"))
    await p.send(Turn(tenant_id="t1", session_id="s2", text="hello", message_id="m2"))
    assert await p.passivate("t1", "s1") is True  # its actor exits at its next idle check
    assert list(p._sessions) == [p.actor_name("t1", "s2")]


async def test_stats_and_shutdown_reach_the_live_actors_of_the_group_not_the_handles_kept(ray):
    p = dedicated(prefix="bench-")
    await p.send(Turn(tenant_id="t1", session_id="mine", text="hello", message_id="m1"))
    ray.add("bench-ce-session-other-gateway", FakeSessionActor("bench-ce-session-other-gateway"))
    ray.add("ce-session-another-group", FakeSessionActor("ce-session-another-group"))
    ray.add("bench-ce-host-0", FakeSessionActor("bench-ce-host-0"))  # not a session actor
    gone = p.actor_name("t1", "gone")
    await p.send(Turn(tenant_id="t1", session_id="gone", text="hello", message_id="m2"))
    ray.kill(ray.get_actor(gone))  # exited when idle: its handle is still kept

    mine = p.actor_name("t1", "mine")
    stats = await p.actor_stats()
    assert sorted(s["host"] for s in stats) == sorted([mine, "bench-ce-session-other-gateway"])
    assert (gone, "stats") not in ray.calls  # before: every handle ever kept was asked

    live = {n: await ray.actor(n) for n in (mine, "bench-ce-session-other-gateway", "ce-session-another-group")}
    await p.shutdown_hosts()
    assert {n for n, a in live.items() if a.stopped} == {mine, "bench-ce-session-other-gateway"}
    assert sorted(ray.actors) == ["bench-ce-host-0", "ce-session-another-group"] and not p._sessions
