"""Finished workflow jobs reach the contact once, even when the turn that took them fails.

A turn takes the finished jobs its session waits for off the waiting list and delivers them with
its answer (`deliveries`). A turn that fails half way gives no answer: the jobs it took go back
on the list, and the next turn (the retry of the same message id included) delivers them.
"""

from __future__ import annotations

import asyncio

import pytest

from actors.host import HostSettings, SessionHost
from actors.session import JOBS_KEY
from kernel.records import JobRecord
from services.wire import Turn
from tests.support.host_fakes import FakeSessionStore, FakeTenants

T = 5.0
KEY = ("t1", "s1")


class FakeJobs:
    """The host's JobSource: the jobs given, all finished."""

    def __init__(self, *jobs: JobRecord) -> None:
        self.jobs = {j.id: j for j in jobs}

    async def finished(self, tenant_id: str, session_id: str, job_ids: list[str]) -> list[JobRecord]:
        return [self.jobs[i] for i in job_ids if i in self.jobs]


def _done(job_id: str) -> JobRecord:
    return JobRecord(id=job_id, tenant_id="t1", session_id="s1", tool_name="export", status="succeeded",
                     result={"report": "ready"})


@pytest.fixture
async def world():
    store, tenants = FakeSessionStore(), FakeTenants()
    host = SessionHost(name="h", store=store, tenants=tenants, jobs=FakeJobs(_done("j1"), _done("j2")),
                       settings=HostSettings())
    await host.start()
    await asyncio.wait_for(host.send(Turn(tenant_id=KEY[0], session_id=KEY[1], text="hello", message_id="m0")), T)  # activated, one turn done
    host._sessions[KEY].state.snapshot.extra[JOBS_KEY] = ["j1", "j2", "j3"]  # j3 still running
    try:
        yield host, store, tenants
    finally:
        await host.stop()


def _fail_the_model(tenants: FakeTenants):
    scripted = tenants.model.stream

    def broken(request):  # a bug or a cancellation mid-turn (model errors are answered in-band)
        raise RuntimeError("boom")

    tenants.model.stream = broken
    return lambda: setattr(tenants.model, "stream", scripted)


async def test_the_retry_of_a_failed_turn_delivers_the_jobs_it_had_taken(world):
    host, _, tenants = world
    restore = _fail_the_model(tenants)
    with pytest.raises(RuntimeError):
        await asyncio.wait_for(host.send(Turn(tenant_id=KEY[0], session_id=KEY[1], text="anything new?", message_id="m1")), T)
    restore()
    retried = await asyncio.wait_for(host.send(Turn(tenant_id=KEY[0], session_id=KEY[1], text="anything new?", message_id="m1")), T)
    assert [d["job_id"] for d in retried.deliveries] == ["j1", "j2"]
    assert host._sessions[KEY].state.snapshot.extra[JOBS_KEY] == ["j3"]
    later = await asyncio.wait_for(host.send(Turn(tenant_id=KEY[0], session_id=KEY[1], text="thanks", message_id="m2")), T)
    assert later.deliveries == []  # once


async def test_a_failed_turn_stores_the_jobs_it_took_as_still_waiting(world):
    host, store, tenants = world
    _fail_the_model(tenants)
    with pytest.raises(RuntimeError):
        await asyncio.wait_for(host.send(Turn(tenant_id=KEY[0], session_id=KEY[1], text="anything new?", message_id="m1")), T)
    await host.flush_all()
    # a re-activation from the store (another host, a restart) delivers them too
    assert store.snapshots[KEY].extra[JOBS_KEY] == ["j1", "j2", "j3"]
    assert "m1" not in store.turns[KEY]
