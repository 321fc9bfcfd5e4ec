"""JobRepo: workflow jobs (ce_jobs) — started by a workflow tool, finished later by the engine or
by the tenant's system through the callback route, delivered into the session on its next turn."""

from __future__ import annotations

from typing import Any

import asyncpg

from services.errors import Conflict, NotFound
from storage.errors import translate
from storage.records import JobRecord, session_uid

_COLUMNS = "id, tenant_id, session_key, tool_name, status, result, error, created_at, updated_at"


def _job(row: asyncpg.Record) -> JobRecord:
    return JobRecord(
        id=row["id"], tenant_id=row["tenant_id"], session_id=row["session_key"], tool_name=row["tool_name"],
        status=row["status"], result=row["result"], error=row["error"],
        created_at=row["created_at"], updated_at=row["updated_at"],
    )


class JobRepo:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def create(
        self, tenant_id: str, session_id: str, job_id: str, tool_name: str, arguments: dict[str, Any]
    ) -> JobRecord:
        with translate("starting a job", conflict=f"job {job_id!r} already exists"):
            row = await self._pool.fetchrow(
                f"INSERT INTO ce_jobs (id, tenant_id, session_id, session_key, tool_name, status, arguments) "
                f"VALUES ($1, $2, $3, $4, $5, 'running', $6) RETURNING {_COLUMNS}",
                job_id, tenant_id, session_uid(tenant_id, session_id), session_id, tool_name, arguments,
            )
        return _job(row)

    async def finish(
        self, tenant_id: str, job_id: str, *, succeeded: bool, result: Any = None, error: str | None = None
    ) -> JobRecord:
        """Record a job's outcome once. NotFound for another tenant's or an unknown job; Conflict
        when it already finished."""
        with translate("finishing a job"):
            row = await self._pool.fetchrow(
                f"UPDATE ce_jobs SET status = $3, result = $4, error = $5, updated_at = now() "
                f"WHERE tenant_id = $1 AND id = $2 AND status IN ('pending', 'running') RETURNING {_COLUMNS}",
                tenant_id, job_id, "succeeded" if succeeded else "failed", result, error,
            )
            if row is None:
                current = await self.get(tenant_id, job_id)
                raise Conflict(f"job {job_id!r} already finished ({current.status}); results are accepted once")
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
