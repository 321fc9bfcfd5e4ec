"""Workflow jobs against a real Postgres: started once per call, never open for ever, results
accepted once but safely sent again.

The runner's ports other than the job store are recorders here (the guarded webhook client has
tests of its own): what matters is what reaches ce_jobs and what a tenant's system is sent.
"""

from __future__ import annotations

import asyncio
import ipaddress
from typing import Any

import pytest

from kernel.errors import Conflict
from services.tools.context import TrustedContext
from services.tools.model import WorkflowTool
from services.tools.ssrf import DestinationPolicy
from services.workflows import STOPPED_ERROR, WorkflowRunner, job_id_for
from storage.repos.egress import EgressRepo
from storage.repos.jobs import JobRepo

SCHEMA = {"type": "object", "properties": {"order": {"type": "string"}}}


class RecordingWebhooks:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.policy: Any = None

    async def call(self, **kw: Any) -> dict:
        self.sent.append(kw)
        return {}


def _ctx(tenant_id: str, key: str = "m1:3f2a") -> TrustedContext:
    return TrustedContext(tenant_id=tenant_id, session_id="s1", message_id="m1", idempotency_key=key)


async def _rows(pool, tenant_id: str) -> list[tuple[str, str, str | None]]:
    rows = await pool.fetch("SELECT id, status, error FROM ce_jobs WHERE tenant_id = $1 ORDER BY created_at", tenant_id)
    return [(r["id"], r["status"], r["error"]) for r in rows]


async def test_a_turn_run_again_finds_the_job_its_call_started_and_the_system_gets_the_same_key(pool, make_tenant):
    tenant, _ = await make_tenant("wf")
    hooks = RecordingWebhooks()
    runner = WorkflowRunner(JobRepo(pool), hooks)
    tool = WorkflowTool(name="refund", description="Refund an order", parameters=SCHEMA,
                        start_url="https://erp.example/start")
    first = await runner.start(tool, None, {"order": "A1"}, _ctx(tenant.id))
    again = await runner.start(tool, None, {"order": "A1"}, _ctx(tenant.id))  # the same call, re-run
    other = await runner.start(tool, None, {"order": "A2"}, _ctx(tenant.id, "m1:77c1"))  # another call
    assert first.job_id == again.job_id == job_id_for(_ctx(tenant.id)) != other.job_id
    assert [r[0] for r in await _rows(pool, tenant.id)] == [first.job_id, other.job_id]
    # sent again while running (the first request may never have arrived), under the same key
    assert [(s["args"]["job_id"], s["idempotency_key"]) for s in hooks.sent] == [
        (first.job_id, first.job_id), (first.job_id, first.job_id), (other.job_id, other.job_id)]
    await JobRepo(pool).finish(tenant.id, first.job_id, succeeded=True, result={"refund": "done"})
    await runner.start(tool, None, {"order": "A1"}, _ctx(tenant.id))  # reported: nothing sent
    assert len(hooks.sent) == 3
    # the same message id in another session is another call
    assert job_id_for(TrustedContext(tenant_id=tenant.id, session_id="s2", idempotency_key="m1:3f2a")) != first.job_id


async def test_a_handler_job_found_started_is_not_run_twice(pool, make_tenant):
    tenant, _ = await make_tenant("wf")
    runner = WorkflowRunner(JobRepo(pool), RecordingWebhooks())
    runs = []

    async def export(args, ctx):
        runs.append(args)
        return {"url": "https://files.example/r.csv"}

    tool = WorkflowTool(name="export", description="Export", parameters=SCHEMA, handler="export")
    try:
        first = await runner.start(tool, export, {"order": "A1"}, _ctx(tenant.id))
        await runner.start(tool, export, {"order": "A1"}, _ctx(tenant.id))
        for _ in range(100):
            if (await _rows(pool, tenant.id))[0][1] == "succeeded":
                break
            await asyncio.sleep(0.02)
        assert runs == [{"order": "A1"}]
        assert await _rows(pool, tenant.id) == [(first.job_id, "succeeded", None)]
    finally:
        await runner.close()


async def test_a_handler_job_running_when_its_host_stops_is_failed_saying_to_start_it_again(pool, make_tenant):
    tenant, _ = await make_tenant("wf")
    runner = WorkflowRunner(JobRepo(pool), RecordingWebhooks())
    started = asyncio.Event()

    async def slow(args, ctx):
        started.set()
        await asyncio.sleep(60)

    tool = WorkflowTool(name="export", description="Export", parameters=SCHEMA, handler="export")
    job = await runner.start(tool, slow, {"order": "A1"}, _ctx(tenant.id))
    await asyncio.wait_for(started.wait(), 5)
    await asyncio.wait_for(runner.close(), 5)  # Runtime.close: a deploy, a rescale, an idle actor
    assert await _rows(pool, tenant.id) == [(job.job_id, "failed", STOPPED_ERROR)]


async def test_the_sweep_fails_jobs_left_open_past_their_timeout_and_nothing_else(pool, make_tenant):
    tenant, _ = await make_tenant("wf")
    repo = JobRepo(pool)
    for job_id in ("job_stale", "job_fresh", "job_done"):
        await repo.create(tenant.id, "s1", f"{job_id}_{tenant.id}", "export", {})
    await repo.finish(tenant.id, f"job_done_{tenant.id}", succeeded=True, result={})
    # its runner died with its process two hours ago (or the tenant's system never reported)
    await pool.execute("UPDATE ce_jobs SET updated_at = now() - interval '2 hours' WHERE id = ANY($1)",
                       [f"job_stale_{tenant.id}", f"job_done_{tenant.id}"])
    runner = WorkflowRunner(repo, RecordingWebhooks(), job_timeout_s=3600)
    assert await runner.sweep_once() >= 1
    rows = {r[0].removesuffix(f"_{tenant.id}"): r[1:] for r in await _rows(pool, tenant.id)}
    assert rows == {
        "job_stale": ("failed", "the background task did not finish within 3600 s; start it again"),
        "job_fresh": ("running", None),
        "job_done": ("succeeded", None),
    }
    # the waiting session learns it on its next turn, like any finished job
    assert [j.status for j in await repo.finished(tenant.id, "s1", [f"job_stale_{tenant.id}"])] == ["failed"]


async def test_a_result_sent_again_is_answered_as_recorded_and_another_one_is_refused(pool, make_tenant):
    tenant, _ = await make_tenant("wf")
    repo = JobRepo(pool)
    await repo.create(tenant.id, "s1", f"job_{tenant.id}", "export", {"q": 1})
    first = await repo.finish(tenant.id, f"job_{tenant.id}", succeeded=True, result={"url": "x"})
    again = await repo.finish(tenant.id, f"job_{tenant.id}", succeeded=True, result={"url": "x"})  # lost our 200
    assert (again.status, again.result, again.updated_at) == ("succeeded", {"url": "x"}, first.updated_at)
    with pytest.raises(Conflict, match=r"already finished \(succeeded\) with another outcome; results are "
                                       r"accepted once \(GET /v1/jobs/job_\S+ shows the one recorded\)"):
        await repo.finish(tenant.id, f"job_{tenant.id}", succeeded=False, error="no")


async def test_each_kind_of_job_records_who_reports_its_outcome(pool, make_tenant):
    tenant, _ = await make_tenant("wf")
    repo = JobRepo(pool)
    runner = WorkflowRunner(repo, RecordingWebhooks())
    release = asyncio.Event()

    async def export(args, ctx):
        await release.wait()
        return {}

    try:
        engine = await runner.start(WorkflowTool(name="export", description="Export", parameters=SCHEMA,
                                                 handler="export"), export, {}, _ctx(tenant.id, "m1:a"))
        tenant_job = await runner.start(WorkflowTool(name="refund", description="Refund", parameters=SCHEMA,
                                                     start_url="https://shop.example/jobs"), None, {},
                                        _ctx(tenant.id, "m1:b"))
        assert (await repo.get(tenant.id, engine.job_id)).runner == "engine"
        assert (await repo.get(tenant.id, tenant_job.job_id)).runner == "tenant"
        with pytest.raises(Conflict, match="run by the engine itself"):
            await repo.finish(tenant.id, engine.job_id, succeeded=True, result={}, posted=True)
        await repo.finish(tenant.id, tenant_job.job_id, succeeded=True, result={"ok": 1}, posted=True)
    finally:
        release.set()
        await runner.close()


async def test_a_start_url_is_sent_with_the_tenants_egress_allowances_added(pool, make_tenant):
    (mine, _), (theirs, _) = await make_tenant("wf-egress"), await make_tenant("wf-egress-other")
    await EgressRepo(pool).allow(mine.id, "10.20.0.0/16", 8443)
    hooks = RecordingWebhooks()
    hooks.policy = DestinationPolicy()  # the operator's: nothing private
    runner = WorkflowRunner(JobRepo(pool), hooks, egress=EgressRepo(pool))
    tool = WorkflowTool(name="refund", description="Refund an order", parameters=SCHEMA,
                        start_url="https://10.20.0.5:8443/start")
    await runner.start(tool, None, {"order": "A1"}, _ctx(mine.id))
    await runner.start(tool, None, {"order": "A1"}, _ctx(theirs.id))
    mine_policy, theirs_policy = (sent["policy"] for sent in hooks.sent)
    assert mine_policy is not None and mine_policy.covers(ipaddress.ip_address("10.20.0.5"), 8443)
    assert not mine_policy.covers(ipaddress.ip_address("10.20.0.5"), 9000)
    assert theirs_policy is None  # the client's own: the operator's list alone
