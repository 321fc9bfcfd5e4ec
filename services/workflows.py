"""Workflow jobs (seed 001): start now, return a reference, deliver the result to the session later.

A `workflow` tool's call creates a ce_jobs row and returns `JobStarted` at once. The job then runs
either here, as a background task of the session host (a handler registered in code), or in the
tenant's system: `start_url` receives `POST {job_id, tool, arguments, callback_path}` and reports
back through the gateway (`POST /v1/jobs/{job_id}/result`). The session remembers the jobs it is
waiting for; on its next turn the finished ones are delivered into the conversation.

A job's id comes from the call's idempotency key (`job_id_for`): a turn run again (a retried
message, the gateway's retry of a host that died mid-turn) finds the job it started rather than
starting a second one, and a `start_url` receives the same `job_id` and Idempotency-Key again.
No job stays open for ever: one whose runner stopped with its process (a deploy, a crash) or whose
system never reported is failed JOB_GRACE_S after its timeout by every host's sweep
(`expire_overdue`), and the waiting session is told on its next turn; a job running here when its
host stops is failed at once, saying to start it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import uuid
from collections.abc import Callable
from typing import Any

import structlog

from kernel.errors import Conflict, NotFound
from services.tools.context import TrustedContext
from services.tools.errors import ToolError
from services.tools.model import ClientTool, WorkflowTool
from services.tools.registry import Handler, JobStarted

log = structlog.get_logger(__name__)


#: how long past its timeout an open job is failed by the sweep (the runner's own timeout fires first)
JOB_GRACE_S = 60.0
#: how often each host sweeps for overdue jobs
SWEEP_INTERVAL_S = 60.0
STOPPED_ERROR = "the engine stopped before the background task finished; start it again"


def job_id_for(ctx: TrustedContext) -> str:
    """The id of the job a call starts: the same for the same call of the same message (its
    idempotency key, which covers tenant, session, tool and arguments), so a turn run again finds
    its job; a fresh one for a call without a key."""
    if not ctx.idempotency_key:
        return f"job_{uuid.uuid4().hex}"
    digest = hashlib.sha256(b"\0".join(
        (ctx.tenant_id.encode(), ctx.session_id.encode(), ctx.idempotency_key.encode()))).hexdigest()
    return f"job_{digest[:32]}"


class WorkflowRunner:
    """Implements registry.WorkflowStarter over a JobRepo and the guarded webhook client."""

    def __init__(self, jobs: Any, webhooks: Any, *, job_timeout_s: float = 3600.0, egress: Any = None) -> None:
        self._jobs = jobs
        self._webhooks = webhooks
        self._egress = egress  # storage EgressRepo: a start_url is checked with the tenant's allowances added
        self._timeout = job_timeout_s
        self._tasks: set[asyncio.Task] = set()
        self._sweeper: asyncio.Task | None = None
        #: told (tenant_id, session_id, job_id) when a job run here has finished and its outcome is
        #: stored: the session host wakes the session with it (SessionHost.wake)
        self.on_finished: Callable[[str, str, str], None] | None = None

    async def start(
        self, tool: WorkflowTool, handler: Handler | None, args: dict[str, Any], ctx: TrustedContext
    ) -> JobStarted:
        job_id = job_id_for(ctx)
        job, created = await self._jobs.create(ctx.tenant_id, ctx.session_id, job_id, tool.name, args,
                                               runner="engine" if handler is not None else "tenant")
        if handler is not None:
            if created:  # a job found started runs (or ran) already: never twice
                task = asyncio.create_task(self._run(job_id, handler, args, ctx), name=f"job-{job_id}")
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            return JobStarted(job_id=job_id)
        assert tool.start_url is not None
        if not created and job.status != "running":
            return JobStarted(job_id=job_id)  # reported already: its outcome is delivered as any
        # Sent again for a job found running: the first request may never have arrived (its host
        # died mid-call); the tenant's system knows it by its job_id and Idempotency-Key.
        try:
            await self._webhooks.call(
                url_template=tool.start_url, method="POST",
                args={"job_id": job_id, "tool": tool.name, "arguments": args,
                      "callback_path": f"/v1/jobs/{job_id}/result"},
                headers={}, timeout_s=tool.timeout_ms / 1000, idempotency_key=job_id, tool_name=tool.name,
                policy=await self._policy(ctx.tenant_id),
            )
        except ToolError as exc:
            await self._jobs.finish(ctx.tenant_id, job_id, succeeded=False, error=exc.reason)
            raise
        return JobStarted(job_id=job_id)

    async def _policy(self, tenant_id: str) -> Any:
        """The operator's policy with the tenant's egress allowances added; None (the client's own)
        when it has none."""
        allowances = await self._egress.allowances(tenant_id) if self._egress is not None else ()
        return self._webhooks.policy.for_tenant(allowances) if allowances else None

    async def await_client(self, tool: ClientTool, args: dict[str, Any], ctx: TrustedContext) -> str:
        """A client tool's call as a job the client's UI finishes with its answer."""
        job_id = job_id_for(ctx)
        await self._jobs.create(ctx.tenant_id, ctx.session_id, job_id, tool.name, args, runner="client")
        return job_id

    async def _run(self, job_id: str, handler: Handler, args: dict[str, Any], ctx: TrustedContext) -> None:
        try:
            async with asyncio.timeout(self._timeout):
                result = await handler(args, ctx)
        except ToolError as exc:
            await self._finish(ctx, job_id, succeeded=False, error=f"{exc.reason}. {exc.advice}")
        except asyncio.CancelledError:
            # the host is stopping: say so now (one try, briefly) rather than leave the job open
            # until the sweep fails it an hour later; the session hears it on its next turn
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2.0):
                    await self._jobs.finish(ctx.tenant_id, job_id, succeeded=False, error=STOPPED_ERROR)
            raise
        except Exception:
            log.exception("workflow_job_crashed", job_id=job_id)
            await self._finish(ctx, job_id, succeeded=False, error="the background task failed")
        else:
            await self._finish(ctx, job_id, succeeded=True, result=result)

    async def _finish(self, ctx: TrustedContext, job_id: str, **outcome: Any) -> None:
        for attempt in range(8):
            try:
                await self._jobs.finish(ctx.tenant_id, job_id, **outcome)
                if self.on_finished is not None:
                    self.on_finished(ctx.tenant_id, ctx.session_id, job_id)
                return
            except (Conflict, NotFound) as exc:  # finished by someone else (the sweep), or gone
                log.warning("workflow_result_refused", job_id=job_id, reason=str(exc)[:200])
                return
            except Exception:  # noqa: BLE001 - Postgres away: retry for ~2 minutes, then give up loudly
                await asyncio.sleep(min(0.5 * 2**attempt, 30.0))
        log.error("workflow_result_not_saved", job_id=job_id)

    def start_sweeping(self, interval_s: float = SWEEP_INTERVAL_S) -> None:
        """Fail overdue open jobs every `interval_s` (any host may: the update is atomic)."""
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever(interval_s),
                                                                   name="workflow-sweeper")

    async def sweep_once(self) -> int:
        """Fail the jobs open JOB_GRACE_S past the job timeout; returns how many."""
        expired = await self._jobs.expire_overdue(
            self._timeout + JOB_GRACE_S,
            f"the background task did not finish within {self._timeout:g} s; start it again")
        for job in expired:
            log.warning("workflow_job_expired", job_id=job.id, tenant_id=job.tenant_id, tool=job.tool_name)
        return len(expired)

    async def _sweep_forever(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.sweep_once()
            except Exception as exc:  # noqa: BLE001 - Postgres away: the next sweep tries again
                log.info("workflow_sweep_failed", error=type(exc).__name__)

    async def close(self) -> None:
        tasks = list(self._tasks) + ([self._sweeper] if self._sweeper is not None else [])
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
