"""JobRepo: workflow jobs (ce_jobs) — started by a workflow tool, finished later by the engine or
by the tenant's system through the callback route, delivered into the session on its next turn."""

from __future__ import annotations

from typing import Any

import asyncpg

from kernel.errors import Conflict, NotFound
from kernel.records import JobRecord, session_uid
from storage.errors import translate

_COLUMNS = "id, tenant_id, session_key, tool_name, status, result, error, created_at, updated_at, runner"
#: who reports a job's outcome: the engine (a `handler` workflow), the tenant's system (a
#: `start_url` workflow) or the client app (a client tool); results posted through the API are
#: taken for the last two only
RUNNERS = ("engine", "tenant", "client")


def _job(row: asyncpg.Record) -> JobRecord:
    return JobRecord(
        id=row["id"], tenant_id=row["tenant_id"], session_id=row["session_key"], tool_name=row["tool_name"],
        status=row["status"], result=row["result"], error=row["error"],
        created_at=row["created_at"], updated_at=row["updated_at"], runner=row["runner"],
    )


class JobRepo:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def create(
        self, tenant_id: str, session_id: str, job_id: str, tool_name: str, arguments: dict[str, Any], *,
        runner: str = "tenant",
    ) -> tuple[JobRecord, bool]:
        """Start job `job_id` (running), reported by `runner` (RUNNERS), or find it started already:
        a re-run of the turn that started it makes the same id (services.workflows.job_id_for).
        Returns (the job, whether this call created it)."""
        if runner not in RUNNERS:
            raise ValueError(f"runner must be one of {RUNNERS}, got {runner!r}")
        with translate("starting a job"):
            row = await self._pool.fetchrow(
                f"INSERT INTO ce_jobs (id, tenant_id, session_id, session_key, tool_name, status, arguments, runner) "
                f"VALUES ($1, $2, $3, $4, $5, 'running', $6, $7) ON CONFLICT (id) DO NOTHING RETURNING {_COLUMNS}",
                job_id, tenant_id, session_uid(tenant_id, session_id), session_id, tool_name, arguments, runner,
            )
            if row is not None:
                return _job(row), True
            return await self.get(tenant_id, job_id), False

    async def finish(
        self, tenant_id: str, job_id: str, *, succeeded: bool, result: Any = None, error: str | None = None,
        posted: bool = False,
    ) -> JobRecord:
        """Record a job's outcome once; the same outcome sent again returns the job as recorded.
        NotFound for another tenant's or an unknown job; Conflict when it finished otherwise, or
        when the outcome was `posted` through the API for a job the engine runs itself."""
        status = "succeeded" if succeeded else "failed"
        with translate("finishing a job"):
            row = await self._pool.fetchrow(
                f"UPDATE ce_jobs SET status = $3, result = $4, error = $5, updated_at = now() "
                f"WHERE tenant_id = $1 AND id = $2 AND status IN ('pending', 'running') "
                f"AND (NOT $6 OR runner <> 'engine') RETURNING {_COLUMNS}",
                tenant_id, job_id, status, result, error, posted,
            )
            if row is None:
                current = await self.get(tenant_id, job_id)
                if posted and current.runner == "engine":
                    raise Conflict(f"job {job_id!r} is run by the engine itself ({current.tool_name}'s handler), "
                                   f"which records its outcome; results are posted only for jobs your system or "
                                   f"client app runs (GET /v1/jobs/{job_id} shows its status)")
                if (current.status, current.result, current.error) == (status, result, error):
                    return current  # the same outcome again (a sender that lost our answer): done
                raise Conflict(f"job {job_id!r} already finished ({current.status}) with another outcome; "
                               f"results are accepted once (GET /v1/jobs/{job_id} shows the one recorded)")
        return _job(row)

    async def get(self, tenant_id: str, job_id: str) -> JobRecord:
        with translate("reading a job"):
            row = await self._pool.fetchrow(
                f"SELECT {_COLUMNS} FROM ce_jobs WHERE tenant_id = $1 AND id = $2", tenant_id, job_id
            )
        if row is None:
            raise NotFound(f"no job {job_id!r} for this tenant", kind="job", key=job_id)
        return _job(row)

    async def finished(self, tenant_id: str, session_id: str, job_ids: list[str]) -> list[JobRecord]:
        """The jobs among `job_ids` of this session that have finished, oldest first."""
        with translate("reading finished jobs"):
            rows = await self._pool.fetch(
                f"SELECT {_COLUMNS} FROM ce_jobs WHERE tenant_id = $1 AND session_id = $2 AND id = ANY($3) "
                "AND status IN ('succeeded', 'failed') ORDER BY updated_at",
                tenant_id, session_uid(tenant_id, session_id), job_ids,
            )
        return [_job(r) for r in rows]

    async def expire_overdue(self, older_than_s: float, error: str) -> list[JobRecord]:
        """Fail every job of any tenant still open `older_than_s` after it last changed (its
        runner died with its process, or the tenant's system never reported): the session waiting
        for it is told on its next turn, instead of waiting for ever. Returns the jobs failed."""
        with translate("expiring overdue jobs"):
            rows = await self._pool.fetch(
                f"UPDATE ce_jobs SET status = 'failed', error = $2, updated_at = now() "
                f"WHERE status IN ('pending', 'running') AND updated_at < now() - make_interval(secs => $1) "
                f"RETURNING {_COLUMNS}",
                older_than_s, error,
            )
        return [_job(r) for r in rows]
