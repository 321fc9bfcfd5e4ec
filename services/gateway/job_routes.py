"""The workflow job routes: the tenant's system reports a job's outcome, or reads a job."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

import msgspec
import structlog
from aiohttp import web

from kernel.errors import InvalidInput
from services.gateway.common import DEPS, TENANT, GatewayDeps, decode_body, json_response
from services.wire import JobFinished

log = structlog.get_logger(__name__)


class JobResultIn(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/jobs/{job_id}/result: the tenant's system reports a workflow job's outcome."""

    status: Literal["succeeded", "failed"]
    result: Any = None
    error: str | None = None


def _job_view(job) -> dict[str, Any]:
    return {"job_id": job.id, "session_id": job.session_id, "tool": job.tool_name, "runner": job.runner,
            "status": job.status, "result": job.result, "error": job.error, "created_at": job.created_at,
            "updated_at": job.updated_at}


async def post_job_result(request: web.Request) -> web.Response:
    deps = request.app[DEPS]
    body: JobResultIn = await decode_body(request, JobResultIn)
    if body.status == "failed" and not body.error:
        raise InvalidInput("a failed job needs `error`: what went wrong, in words for the customer - at `$.error`",
                           path="$.error")
    job = await deps.jobs.finish(request[TENANT], request.match_info["job_id"],
                                 succeeded=body.status == "succeeded", result=body.result, error=body.error,
                                 posted=True)
    # The session runs the result now if its tool says so (SessionHost.act): in the background, so
    # the reporting system is not held for a model call; should it fail, the result is stored and
    # waits for the contact's next message
    if job.session_id is not None:
        wake = asyncio.create_task(_wake(deps, JobFinished(tenant_id=job.tenant_id, session_id=job.session_id,
                                                           job_id=job.id)))
        deps.background.add(wake)
        wake.add_done_callback(deps.background.discard)
    return json_response(_job_view(job))


async def _wake(deps: GatewayDeps, command: JobFinished) -> None:
    try:
        await deps.router.act(command)
    except Exception as exc:  # noqa: BLE001 - the stored result reaches the session's next turn
        log.info("job_wake_failed", session_id=command.session_id, error=type(exc).__name__)


async def get_job(request: web.Request) -> web.Response:
    deps = request.app[DEPS]
    return json_response(_job_view(await deps.jobs.get(request[TENANT], request.match_info["job_id"])))


def add_job_routes(app: web.Application) -> None:
    """Register the routes above on the gateway app (called once from build_app)."""
    r = app.router
    r.add_post("/v1/jobs/{job_id}/result", post_job_result)
    r.add_get("/v1/jobs/{job_id}", get_job)
