"""Workflow jobs (seed 001): start now, return a reference, deliver the result to the session later.

A `workflow` tool's call creates a ce_jobs row and returns `JobStarted` at once. The job then runs
either here, as a background task of the session host (a handler registered in code), or in the
tenant's system: `start_url` receives `POST {job_id, tool, arguments, callback_path}` and reports
back through the gateway (`POST /v1/jobs/{job_id}/result`). The session remembers the jobs it is
waiting for; on its next turn the finished ones are delivered into the conversation.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import structlog

from services.tools.context import TrustedContext
from services.tools.errors import ToolError
from services.tools.model import ClientTool, WorkflowTool
from services.tools.registry import Handler, JobStarted

log = structlog.get_logger(__name__)


class WorkflowRunner:
    """Implements registry.WorkflowStarter over a JobRepo and the guarded webhook client."""

    def __init__(self, jobs: Any, webhooks: Any, *, job_timeout_s: float = 3600.0) -> None:
        self._jobs = jobs
        self._webhooks = webhooks
        self._timeout = job_timeout_s
        self._tasks: set[asyncio.Task] = set()

    async def start(
        self, tool: WorkflowTool, handler: Handler | None, args: dict[str, Any], ctx: TrustedContext
    ) -> JobStarted:
        job_id = f"job_{uuid.uuid4().hex}"
        await self._jobs.create(ctx.tenant_id, ctx.session_id, job_id, tool.name, args)
        if handler is not None:
            task = asyncio.create_task(self._run(job_id, handler, args, ctx), name=f"job-{job_id}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return JobStarted(job_id=job_id)
        assert tool.start_url is not None
        try:
            await self._webhooks.call(
                url_template=tool.start_url, method="POST",
                args={"job_id": job_id, "tool": tool.name, "arguments": args,
                      "callback_path": f"/v1/jobs/{job_id}/result"},
                headers={}, timeout_s=tool.timeout_ms / 1000, idempotency_key=job_id, tool_name=tool.name,
            )
        except ToolError as exc:
            await self._jobs.finish(ctx.tenant_id, job_id, succeeded=False, error=exc.reason)
            raise
        return JobStarted(job_id=job_id)

    async def await_client(self, tool: ClientTool, args: dict[str, Any], ctx: TrustedContext) -> str:
        """A client tool's call as a job the client's UI finishes with its answer."""
        job_id = f"job_{uuid.uuid4().hex}"
        await self._jobs.create(ctx.tenant_id, ctx.session_id, job_id, tool.name, args)
        return job_id

    async def _run(self, job_id: str, handler: Handler, args: dict[str, Any], ctx: TrustedContext) -> None:
        try:
            async with asyncio.timeout(self._timeout):
                result = await handler(args, ctx)
        except ToolError as exc:
            await self._finish(ctx, job_id, succeeded=False, error=f"{exc.reason}. {exc.advice}")
        except Exception:
            log.exception("workflow_job_crashed", job_id=job_id)
            await self._finish(ctx, job_id, succeeded=False, error="the background task failed")
        else:
            await self._finish(ctx, job_id, succeeded=True, result=result)

    async def _finish(self, ctx: TrustedContext, job_id: str, **outcome: Any) -> None:
        for attempt in range(5):
            try:
                await self._jobs.finish(ctx.tenant_id, job_id, **outcome)
                return
            except Exception:  # noqa: BLE001 - Postgres away: retry, then give up loudly
                await asyncio.sleep(0.5 * 2**attempt)
        log.error("workflow_result_not_saved", job_id=job_id)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
